"""One compute job's lifecycle, written once for every stage: feature builds, training, corpus scoring, HPO trials.

A stage is a subclass that says what its job is (:meth:`~ComputeJobOperator.prepare`) and what its result is
(:meth:`~ComputeJobOperator.finish`); this class decides when to submit, how to find the job again and how its end
is classified. ``execute``:

1. reattaches to the job this task recorded in the task state store (a :class:`JobRef`) while it still runs; one
   that succeeded is finished; one that ended otherwise is forgotten, never reattached (the retry submits anew and
   resumes from what the failed job left);
2. returns :meth:`~ComputeJobOperator.result_without_job` when the work is done already (every shard built);
3. prepares the job (its settings and the backend's :class:`~operators.backends.JobSpec`, named deterministically
   per task try), validates it for the teams and dry-runs it on the backend (torchx's ``submit_dryrun`` before
   ``schedule``): a bad setting fails now, as USER, before anything is spent;
4. looks up the names of this task's earlier tries: a job whose try lost its worker between submitting and recording
   it is waited for, never submitted twice;
5. :meth:`~ComputeJobOperator.before_submit` (quota admission, input pins, the job's settings file), submits,
   records the job;
6. waits, deferred to :class:`~operators.triggers.ComputeJobTrigger` (no worker slot held) or polling on the worker
   (``deferrable=False``); :meth:`~ComputeJobOperator.execute_complete` re-checks the job through its backend (the
   event is a hint) and raises its failure class's typed error (``core.failures``), which the task's retry policy
   retries (INFRA) or fails now.

``on_kill`` cancels the job on both paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context

from core.failures import InfraError, PinflowError

if TYPE_CHECKING:
    from airflow.triggers.base import BaseTrigger

    from core.config import PlatformConfig
    from operators.backends import Backend, JobSpec, JobStatus
    from operators.jobs import ShardMarkers


def job_folder(cfg: PlatformConfig, backend: str, name: str) -> str:
    """The folder of the job ``name``, where the task writes its typed settings file (RUN.json, BUILD.json) for it:
    under PINFLOW_HOME for the local backend's jobs, which run on this machine; on the storage root for the others,
    which every node reaches."""
    from core import storage
    from core.contracts import RUNS

    return storage.join(cfg.home if backend == "local" else cfg.storage_root, RUNS, name)


@dataclasses.dataclass(frozen=True)
class JobRef:
    """A submitted job as the task state store, the deferral's kwargs and the job history hold it."""

    backend: str
    job_id: str
    name: str = ""
    output_dir: str | None = None  # where its ranks write heartbeats (watched for stalls); None: not watched
    shards: tuple[int, ...] = ()  # the shards an array job runs; () for one job

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "job_id": self.job_id, "name": self.name, "output_dir": self.output_dir,
                "shards": list(self.shards)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobRef:
        return cls(backend=str(data["backend"]), job_id=str(data["job_id"]), name=str(data.get("name") or ""),
                   output_dir=data.get("output_dir") or None, shards=tuple(int(s) for s in data.get("shards") or ()))


@dataclasses.dataclass(frozen=True)
class Watch:
    """How a job is waited for: seconds between status checks, without heartbeat progress before it counts as
    stalled, and queued before it is cancelled (0: no limit)."""

    poll_s: float
    stall_s: float
    queue_timeout_s: float
    shard_markers: ShardMarkers | None = None  # an array job's shards, logged as they are built (ShardCounter)


@dataclasses.dataclass
class Submission:
    """A job ready to submit: the backend it goes to, its spec, where its ranks write heartbeats, the shards it runs,
    what the log says about it, and the stage's own settings for it (e.g. the training run's RUN.json content)."""

    backend: str
    spec: JobSpec
    output_dir: str | None = None
    shards: tuple[int, ...] = ()
    summary: str = ""
    settings: Any = None

    def ref(self, job_id: str, name: str | None = None) -> JobRef:
        """The job submitted (or found) under ``name`` (default: this submission's); the output folder follows the
        name when it ends with it (a job's folder is named after the job)."""
        name = name or self.spec.name
        output_dir = self.output_dir
        if output_dir and name != self.spec.name and output_dir.endswith(self.spec.name):
            output_dir = output_dir.removesuffix(self.spec.name) + name
        return JobRef(self.backend, job_id, name, output_dir, self.shards)


class ComputeJobOperator(BaseOperator):
    """Run one job of a stage on a compute backend (``local``, ``batch``, ``kubernetes``) to its end; see the module.

    A stage fills in :meth:`name_parts`, :meth:`watch`, :meth:`prepare` and :meth:`finish`, and where it needs them
    :meth:`result_without_job`, :meth:`before_submit`, :meth:`submit`, :meth:`attached`, :meth:`ended`,
    :meth:`cancelling` and :meth:`trigger`.

    :param deferrable: wait in the triggerer (default); False polls on the worker.
    :param poll_seconds: between status checks (default: the stage's configured poll).
    """

    external_id_key = "compute_job"  # the task state store's key of the job (one per task)
    what = "job"  # the job in messages: "training job"

    def __init__(self, *, deferrable: bool = True, poll_seconds: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.deferrable = deferrable
        self.poll_seconds = poll_seconds
        self._job: JobRef | None = None

    # -- what a stage says --------------------------------------------------------------------------------------
    def name_parts(self, context: Context) -> tuple[str, ...]:
        """What names this task's jobs, before the try: ``job_name(*parts, "try<n>")``."""
        raise NotImplementedError

    def watch(self) -> Watch:
        raise NotImplementedError

    def prepare(self, context: Context, name: str, todo: Any = None) -> Submission:
        """The job this try submits under ``name`` for ``todo`` (:meth:`todo`'s), validated (a bad setting raises a
        USER error here)."""
        raise NotImplementedError

    def finish(self, context: Context, job: JobRef) -> Any:
        """The task's result once ``job`` has succeeded (what it published, read back and checked)."""
        raise NotImplementedError

    def todo(self, context: Context) -> Any:
        """What this try has left to do (e.g. the plan and its shards still missing), worked out once per execute and
        handed to :meth:`result_without_job` and :meth:`prepare`; None by default."""
        return None

    def result_without_job(self, context: Context, todo: Any) -> Any:
        """The task's result when nothing is left to run (an earlier try did it all); None: a job is needed."""
        return None

    def before_submit(self, context: Context, backend: Backend, submission: Submission) -> None:
        """Just before submitting (nothing is submitted if it raises or defers)."""

    def submit(self, context: Context, backend: Backend, submission: Submission) -> str:
        return backend.submit(submission.spec)  # idempotent per name: a job this try submitted already is reattached

    def attached(self, context: Context, job: JobRef) -> None:
        """This try watches ``job`` now (submitted, reattached, or resumed from the triggerer)."""

    def ended(self, job: JobRef, event: dict[str, Any] | None, *, status: JobStatus | None = None,
              error: BaseException | None = None) -> None:
        """``job`` has ended: succeeded (``status``) or classified as ``error``."""

    def cancelling(self, job: JobRef) -> None:
        """``job`` is about to be cancelled because the task was killed."""

    def shard_markers(self, context: Context) -> ShardMarkers | None:
        """Where an array job's shards leave their outputs, for progress lines while it runs; None: not counted."""
        return None

    def trigger(self, job: JobRef, watch: Watch) -> BaseTrigger:
        from operators.triggers import ComputeJobTrigger

        return ComputeJobTrigger(backend=job.backend, job_id=job.job_id, output_dir=job.output_dir,
                                 poll_seconds=watch.poll_s, stall_seconds=watch.stall_s,
                                 queue_timeout_seconds=watch.queue_timeout_s,
                                 shard_markers=watch.shard_markers.to_list() if watch.shard_markers else None)

    # -- the lifecycle ------------------------------------------------------------------------------------------
    def job_name(self, context: Context, try_number: int, again: int = 0) -> str:
        """Deterministic per (stage, task, try): the same try, the same name. ``again``: the try of a run created
        again under the same id, whose first name an ended job of the earlier run holds (:meth:`_of_an_earlier_run`)."""
        from operators.jobs import job_name

        return job_name(*self.name_parts(context), f"try{try_number}", *([f"again{again}"] if again else []))

    @staticmethod
    def _of_an_earlier_run(context: Context, backend: Backend, job_id: str) -> bool:
        """Whether ``job_id`` ended before this DAG run began: a job of an earlier run of the same id (deleted and
        created again, as the demo does each time), whose outputs were built with that run's settings."""
        began = getattr(context.get("dag_run"), "start_date", None)
        status = backend.status(job_id)
        return bool(status.state.terminal and began is not None and status.created_at is not None
                    and status.created_at < began.timestamp())

    def execute(self, context: Context) -> Any:
        from core import config
        from operators import links
        from operators.backends import JobState, get_backend, validate_for

        stored = self._stored(context)
        if stored is not None:
            try:
                state = get_backend(stored.backend).status(stored.job_id).state
            except LookupError:
                state = None  # its record is gone: submit anew
            if state is not None and not state.terminal:
                self.log.info("reattaching to %s %s (recorded by an earlier try)", self.what, stored.job_id)
                return self._wait(context, stored)
            self._forget(context)  # ended: never reattached; a retry submits a job that resumes
            if state is JobState.SUCCEEDED:
                return self.finish(context, stored)
        todo = self.todo(context)
        done = self.result_without_job(context, todo)
        if done is not None:
            return done
        cfg = config.load()
        try_number = int(context["ti"].try_number)
        submission = self.prepare(context, self.job_name(context, try_number), todo)
        validate_for(submission.spec, cfg.teams, backend=submission.backend)
        backend = get_backend(submission.backend, cfg)
        backend.dry_run(submission.spec)  # the backend's own checks (schema, resources) before anything is submitted
        self.preflight(context, backend, submission)
        job = self._earlier_try(context, backend, submission, try_number)
        if job is None:
            job_id = backend.find(submission.spec.name)
            again = 0
            while job_id and self._of_an_earlier_run(context, backend, job_id):
                again += 1  # never adopted: this try's job gets a name of its own
                self.log.info("%s %s ended before this run began (an earlier run of the same id): not reused",
                              self.what, job_id)
                submission = self.prepare(context, self.job_name(context, try_number, again), todo)
                job_id = backend.find(submission.spec.name)
            if job_id:
                self.log.info("reattaching to %s %s submitted earlier for this task try", self.what, job_id)
            else:
                self.before_submit(context, backend, submission)
                job_id = self.submit(context, backend, submission)
                self.log.info("submitted %s %s to %s%s: %s", self.what, job_id, submission.backend,
                              f" ({submission.summary})" if submission.summary else "",
                              links.console_url(submission.backend, job_id, backend.console_url(job_id)))
            job = submission.ref(job_id)
        store: Any = context.get("task_state_store")
        if store is not None:
            store.set(self.external_id_key, job.to_dict())
        return self._wait(context, job)

    def preflight(self, context: Context, backend: Backend, submission: Submission) -> None:
        """Cheap checks of the world before a job is looked up or submitted (the inputs, the services it needs)."""

    def _earlier_try(self, context: Context, backend: Backend, submission: Submission, try_number: int) -> JobRef | None:
        """A job an earlier try of this task submitted and that still runs (its worker was lost)."""
        for earlier in range(try_number - 1, 0, -1):
            name = self.job_name(context, earlier)
            found = backend.find(name)
            if found and not backend.status(found).state.terminal:
                self.log.info("reattaching to %s %s that try %d submitted, still running", self.what, found, earlier)
                return submission.ref(found, name)
        return None

    def _wait(self, context: Context, job: JobRef) -> Any:
        from operators.backends import get_backend
        from operators.jobs import wait_for_job

        self._attach(context, job)
        watch = dataclasses.replace(self.watch(), shard_markers=self.shard_markers(context))
        if self.deferrable:
            self.defer(trigger=self.trigger(job, watch), method_name="execute_complete", kwargs={"job": job.to_dict()})
        return self._conclude(context, job, None, lambda: wait_for_job(
            get_backend(job.backend), job.job_id, output_dir=job.output_dir, what=self.what, poll_seconds=watch.poll_s,
            stall_seconds=watch.stall_s, queue_timeout_seconds=watch.queue_timeout_s, shard_markers=watch.shard_markers))

    def _conclude(self, context: Context, job: JobRef, event: dict[str, Any] | None,
                  outcome: Callable[[], JobStatus]) -> Any:
        """The job's end: ``outcome`` returns its succeeded status or raises its failure class's error; either way the
        task forgets it (a retry never reattaches to an ended job) and says so (:meth:`ended`); then :meth:`finish`."""
        try:
            status = outcome()
        except PinflowError as err:
            self.ended(job, event, error=err)
            self._forget(context)
            raise
        finally:
            self._job = None
        self.ended(job, event, status=status)
        self._forget(context)
        return self.finish(context, job)

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None,
                         job: dict[str, Any] | None = None) -> Any:
        """Re-check the job through its backend (the trigger's event is a hint), classify its end, finish."""
        from operators.backends import get_backend
        from operators.jobs import WATCHER_STATES, raise_for_status

        if not event or not event.get("state"):
            # Resumed without the trigger's event (its triggerer died with it): decide again from the store.
            self.log.warning("resumed without a trigger event: reattaching through the task state store")
            return self.execute(context)
        stored = self._stored(context)
        ref = JobRef.from_dict(job) if job else (stored or JobRef.from_dict(event))
        self._attach(context, ref)

        def outcome() -> JobStatus:
            if event.get("state") in WATCHER_STATES:  # stalled or queued too long: the trigger cancelled it
                raise InfraError(str(event.get("reason")))
            backend = get_backend(ref.backend)
            return raise_for_status(backend, backend.status(ref.job_id), what=self.what)

        return self._conclude(context, ref, event, outcome)

    def on_kill(self) -> None:
        if self._job is not None:
            from operators.backends import get_backend

            self.log.info("task killed: cancelling %s job %s", self._job.backend, self._job.job_id)
            self.cancelling(self._job)
            get_backend(self._job.backend).cancel(self._job.job_id)

    def _attach(self, context: Context, job: JobRef) -> None:
        self._job = job  # for on_kill
        self.attached(context, job)

    def _stored(self, context: Context) -> JobRef | None:
        store: Any = context.get("task_state_store")
        stored = store.get(self.external_id_key) if store is not None else None
        return JobRef.from_dict(stored) if isinstance(stored, Mapping) and stored.get("job_id") else None

    def _forget(self, context: Context) -> None:
        """The recorded job has ended: a retry must submit a new one, never reattach to it."""
        store: Any = context.get("task_state_store")
        if store is not None:
            store.delete(self.external_id_key)
