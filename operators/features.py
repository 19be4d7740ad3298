"""Operators of the daily feature DAG that build the features (DuckDB), each step as a job on a compute backend.

A step runs as ``python -m features.build`` on the configured backend (``features.backend``, else
``training.backend``: a local process on the embedded default, an AWS Batch or Kubernetes job in production), never
in the Airflow worker's process. With ``features.shards`` (or the run's ``shards`` param) N > 1 the step is an array
job of N shards (users by ``hash(user_id)``, pins by ``hash(pin_id)``), each writing to a staging folder; once every
shard has its output the task publishes the day's partitions from them (``features.build.merge_shards``: files
linked or copied, metadata merged, nothing read). A retry builds only the shards still missing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, Context

from core.failures import ConfigError, DataError, InfraError
from operators.compute_job import ComputeJobOperator, JobRef, Submission, Watch

if TYPE_CHECKING:
    from core.config import FeaturesConfig, PlatformConfig
    from features.spec import BuildSpec
    from operators.jobs import ShardMarkers

# The datasets each step (or group of steps in one job, ``features.spec.STEP_GROUPS``) writes (``core.contracts``;
# spelled out here so that parsing a DAG imports no pyarrow or DuckDB).
STEP_OUTPUTS = {
    "daily": ("features/user_daily", "features/pin_daily"),
    "window": ("features/user_window", "features/pin_window"),
    "sequences": ("features/user_sequence",),
    "examples": ("examples",),
    "daily_sequences_examples": ("features/user_daily", "features/pin_daily", "features/user_sequence", "examples"),
}
FEATURE_STEPS = tuple(STEP_OUTPUTS)
# Steps that read the window's earlier days: checked for gaps again when their job is submitted.
WINDOW_READERS = ("window", "examples", "daily_sequences_examples")
# A staging folder of another build unwritten for this many build timeouts is abandoned (removed at the next merge).
ABANDONED_AFTER_TIMEOUTS = 2
def memory_gb(limit: str) -> float:
    """DuckDB's memory limit (``4GB``, ``512MiB``) in GB; a ConfigError naming the key if it is not one."""
    from core.config import memory_size_gb  # not at parse time: the DAG files read the configuration's cached view

    try:
        return memory_size_gb(limit)
    except ValueError as err:
        raise ConfigError(f"features.duckdb_memory_limit: {err}") from None


def build_spec(root: str, ds: str, step: str, features: FeaturesConfig, *, skip_validation: bool) -> BuildSpec:
    """The typed spec of one step's build with these settings (pure; every setting explicit), unsharded."""
    from features.spec import FEATURE_FIELDS, BuildSpec

    return BuildSpec.checked(
        f"the build spec of {step} ds={ds} (platform config and the run's params)", root=root, ds=ds, step=step,
        skip_validation=skip_validation, **{name: getattr(features, name) for name in FEATURE_FIELDS})


def staging_folder(root: str, step: str, ds: str, key: str) -> str:
    from core.storage import join
    from features.spec import STAGING

    return join(root, STAGING, "features", step, f"ds={ds}", key)


def with_run_params(features: FeaturesConfig, overrides: dict[str, Any], shards: Any) -> FeaturesConfig:
    """The ``features:`` settings of a run: the configuration's with the run's params (``shards`` empty: the
    configuration's ``features.shards``)."""
    from core import config
    return config.with_overrides(
        features, {**overrides, "shards": shards if shards not in ("", None) else None}, "the run's params"
    )


def build_job_spec(command: list[str], *, name: str, shards: Sequence[int], cfg: PlatformConfig,
                   features: FeaturesConfig, backend: str, side_by_side: int = 1) -> Any:
    """The job of one build step (pure): one process (``shards`` empty: unsharded), or an array job with one child
    per shard in ``shards`` (``--run-shards``: its array index picks one), each on a slice of a
    ``features.instance_type`` node (DuckDB's threads, its memory limit and half as much again for Arrow batches and
    the interpreter, per step run ``side_by_side`` in one DuckDB database: a shard of a step group). Local children run
    as many at once as the machine has CPUs for their DuckDB threads."""
    from core.arrays import format_shards
    from operators.backends import JobSpec

    spec = JobSpec(
        name=name, command=command, team=features.team or cfg.training.team, image=cfg.training.image,
        instance_type=features.instance_type, env={"OMP_NUM_THREADS": str(features.duckdb_threads)},
        timeout_s=int(features.timeout_seconds), cpus_per_node=features.duckdb_threads,
        memory_gb_per_node=round(memory_gb(features.duckdb_memory_limit) * (1 + 0.5 * side_by_side), 2),
    )
    if shards:
        parallelism = max(1, (os.cpu_count() or 1) // features.duckdb_threads) if backend == "local" else 0
        spec = dataclasses.replace(spec, command=[*command, "--run-shards", format_shards(shards)],
                                   array_size=len(shards), array_parallelism=parallelism)
    return spec


@dataclasses.dataclass(frozen=True)
class FeaturePlan:
    """What a feature task builds, the same for every try of a run: the settings, the job's typed spec (the shard
    count and, sharded, the staging folder the shards write to), the backend."""

    features: FeaturesConfig
    spec: BuildSpec
    backend: str

    @property
    def shards(self) -> int:
        return self.spec.shards

    @property
    def staging(self) -> str | None:
        return self.spec.staging or None


class FeatureBuildOperator(ComputeJobOperator):
    """Build one feature step of a day as a job on a compute backend; written atomically, rerunning replaces that
    day only.

    :param step: one of ``daily``, ``window``, ``sequences``, ``examples``, or ``daily_sequences_examples`` (those
        three in one job: what the DAG runs first, whose shards also build the window when it can be incremental; the
        window, which reads the day's merged aggregates, after it: no job when the first job's shards built it).
    :param ds: the partition day (templated).
    :param overrides: ``features:`` settings that win over the platform configuration for this run (templated),
        e.g. from params; validated by the same typed model (a bad value fails the task as USER).
    :param skip_validation: build even from raw partitions without a passed validation report for their current
        contents (for experts; recorded as ``skip_validation`` in the outputs' metadata). By default such a
        partition fails the task as DATA, naming the command that validates it.
    :param shards: split the step into this many jobs (templated; empty: ``features.shards``).
    :param backend: ``local``, ``batch`` or ``kubernetes`` (templated; empty: ``features.backend``, else
        ``training.backend``).
    :param gated: run after the upstream validations however they ended and decide (the day's first step:
        :func:`operators.validation.gate_on_validations`: build, skip a day whose events were quarantined, or fail).
    :param deferrable: wait for the job in the triggerer (default); False polls on the worker.

    The job's lifecycle is :class:`~operators.compute_job.ComputeJobOperator`'s: its end is classified
    (``core.failures``): a missing or unusable input (DATA) and a bad setting (USER) fail now, naming what to do; a
    killed process or a lost node (INFRA) is retried, and the retry builds only the shards still missing. A retry
    whose earlier try's job still runs (its worker was lost) waits for that job instead of submitting another.
    Killing the task cancels the job. Build jobs are not in the job history and hold no team quota (that accounts
    for training jobs).
    """

    template_fields: Sequence[str] = ("ds", "overrides", "shards", "backend")
    ui_color = "#f0e4d0"
    external_id_key = "feature_job"
    what = "feature build job"

    def __init__(
        self,
        *,
        step: str,
        ds: str,
        overrides: dict[str, Any] | None = None,
        skip_validation: bool = False,
        shards: Any = None,
        backend: str | None = None,
        gated: bool = False,
        **kwargs: Any,
    ) -> None:
        if gated:  # it decides itself what its upstream validations' end means (gate_on_validations)
            kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.gated = gated
        if step not in FEATURE_STEPS:
            raise ValueError(f"unknown feature step {step!r}: choose one of {FEATURE_STEPS}")
        self.step = step
        self.ds = ds
        self.overrides = overrides or {}
        self.skip_validation = skip_validation
        self.shards = shards
        self.backend = backend
        self._built: dict[str, Any] | None = None

    def execute(self, context: Context) -> Any:
        if self.gated:
            from operators.validation import gate_on_validations

            gate_on_validations(context, self.ds, sorted(self.upstream_task_ids))
        return super().execute(context)

    def _features(self, cfg: PlatformConfig) -> FeaturesConfig:
        return with_run_params(cfg.features, self.overrides, self.shards)

    def _plan(self, context: Context) -> FeaturePlan:
        """What this task builds (the same for every try of a run)."""
        from core import config
        cfg = config.load()
        features = self._features(cfg)
        spec = build_spec(cfg.storage_root, self.ds, self.step, features, skip_validation=self.skip_validation)
        ti = context.get("ti")
        run = [ti.dag_id, ti.run_id, ti.task_id, str(getattr(ti, "map_index", -1))] if ti is not None else []
        key = hashlib.sha1(json.dumps([*run, spec.model_dump(), features.shards]).encode()).hexdigest()[:16]
        backend = self.backend or features.backend or cfg.training.backend
        if features.shards > 1:
            staging = staging_folder(cfg.storage_root, self.step, self.ds, key)
            spec = spec.model_copy(update={"shards": features.shards, "staging": staging})
        return FeaturePlan(features, spec, backend)

    # -- ComputeJobOperator --------------------------------------------------------------------------------------
    def name_parts(self, context: Context) -> tuple[str, ...]:
        ti = context["ti"]
        return ("features", ti.task_id, ti.dag_id, ti.run_id)  # the task first: the name is cut at 63 characters

    def watch(self) -> Watch:
        from core import config
        cfg = config.load()
        features = self._features(cfg)
        return Watch(poll_s=float(self.poll_seconds or features.poll_seconds), stall_s=float(features.timeout_seconds),
                     queue_timeout_s=float(cfg.training.queue_timeout_seconds))

    def shard_markers(self, context: Context) -> ShardMarkers | None:
        """A sharded step's shards, counted by their outputs' markers in the staging folder while the job runs."""
        from core.storage import MARKER
        from operators.jobs import ShardMarkers

        plan = self._plan(context)
        if not plan.staging:
            return None
        return ShardMarkers(plan.staging, tuple(f"{d}/shard-*/{MARKER}" for d in STEP_OUTPUTS[self.step]), plan.shards)

    def todo(self, context: Context) -> tuple[FeaturePlan, list[int]]:
        """The plan and the shards of it still to build (``[0]``: an unsharded step, built whole)."""
        from features.build import missing_shards

        plan = self._plan(context)
        return plan, (missing_shards(plan.staging, self.step, plan.shards) if plan.staging else [0])

    def result_without_job(self, context: Context, todo: tuple[FeaturePlan, list[int]]) -> Any:
        plan, missing = todo
        # Sharded, the shards of the day's first job may have built the window (features.spec.STAGED_STEPS).
        if self.step == "window" and plan.staging and not plan.spec.recompute:
            from core import config, storage
            from features.build import recorded_settings, window_job_reason

            root = config.load().storage_root
            reason = window_job_reason(root, self.ds, recorded_settings(plan.features, skip_validation=self.skip_validation))
            if reason is None:
                self.log.info("the window of ds=%s was built by the shards of daily_sequences_examples (incrementally) "
                              "from inputs that are all still as published now: no job to run. A day of its window "
                              "rebuilt or landed later, or a run with other settings, makes this task build it", self.ds)
                self._built = {d: storage.read_metadata(root, d, self.ds) for d in STEP_OUTPUTS["window"]}
                return self._built
            self.log.info("building the window of ds=%s in this task's job: %s", self.ds, reason)
        if missing:
            return None
        self.log.info("every shard of %s ds=%s is built (an earlier try): merging", self.step, self.ds)
        return self._publish(plan)

    def prepare(self, context: Context, name: str, todo: tuple[FeaturePlan, list[int]] | None = None) -> Submission:
        from core import config, storage
        from features.spec import SPEC_FILE, STEP_GROUPS
        from operators.compute_job import job_folder
        cfg = config.load()
        plan, missing = todo or self.todo(context)
        if self.skip_validation:
            self.log.warning("skip_validation: building %s ds=%s without checking validation reports", self.step, self.ds)
        shards = missing if plan.staging else []
        # The job reads its spec from its folder (every backend the same way), as a training job its RUN.json.
        spec_path = storage.join(job_folder(cfg, plan.backend, name), SPEC_FILE)
        # A shard of a step group runs its steps side by side (features.build): each its Arrow batches.
        side_by_side = len(STEP_GROUPS.get(self.step, (self.step,))) if shards else 1
        spec = build_job_spec(["-m", "features.build", "--spec", spec_path], name=name, shards=shards, cfg=cfg,
                              features=plan.features, backend=plan.backend, side_by_side=side_by_side)
        what = f"shard(s) {shards} of {plan.shards}" if plan.staging else "unsharded"
        return Submission(plan.backend, spec, shards=tuple(shards), summary=f"{self.step} ds={self.ds}, {what}",
                          settings=(plan.spec, spec_path))

    def before_submit(self, context: Context, backend: Any, submission: Submission) -> None:
        """Write the job's BUILD.json; a step that reads the days before (the window, and the examples of the DAG's
        first job, which join the features of ds-1) checks the window's gaps again first (below)."""
        if self.step in WINDOW_READERS:
            self._check_window_gaps()
        build, path = submission.settings
        build.write(path)

    def _check_window_gaps(self) -> None:
        """``validation.on_window_gap: fail`` as of now: the run's validate_window may have looked before the day
        before was quarantined (runs of a backfill validate side by side; this task waits for the day before's build,
        ``depends_on_past``), and would let the window, or examples joined with the day before's features, build over
        that day."""
        from core import config, storage
        from features.validation.window import window_gaps

        cfg = config.load()
        if cfg.validation.on_window_gap != "fail":
            return
        gaps = window_gaps(cfg.storage_root, self.ds, cfg.features.window_days)
        if gaps["gaps"]:
            raise DataError(
                f"the {cfg.features.window_days}-day window of ds={self.ds} has {len(gaps['gaps'])} day(s) without "
                f"validated raw events: {storage.day_spans(gaps['gaps'])} (validation.on_window_gap=fail; found when "
                f"{self.step} was about to be built). Land those days again and clear their runs, or set "
                "validation.on_window_gap=proceed"
            )

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
        return self._publish(self._plan(context))

    def _publish(self, plan: FeaturePlan) -> dict[str, Any]:
        """Publish the shards (a sharded step) or read what the job published; log gaps; the summaries."""
        from core import config, storage
        from features.build import merge_shards, recorded_settings

        root = config.load().storage_root
        if plan.staging:
            settings = recorded_settings(plan.features, skip_validation=plan.spec.skip_validation)
            summary = merge_shards(root, self.ds, self.step, plan.staging, plan.shards, settings)
            self._remove_abandoned_staging(plan)
        else:
            summary = {}
            for dataset in STEP_OUTPUTS[self.step]:
                if not storage.is_complete(root, dataset, self.ds):
                    raise InfraError(f"the build job of {self.step} ds={self.ds} succeeded but {dataset} is not "
                                     "published: a retry builds it")
                summary[dataset] = storage.read_metadata(root, dataset, self.ds)
        for dataset, meta in summary.items():
            # Days left out or computed on demand are named in the task log, not only in the metadata.
            said = [f"{what} {storage.day_spans(days)}" for what, days in (
                ("no data (left out) for", meta.get("missing_days")),
                ("aggregates computed from the raw events of", meta.get("computed_from_raw")),
            ) if days]
            if said:
                self.log.warning("%s ds=%s: %s", dataset, self.ds, "; ".join(said))
        for dataset, meta in summary.items():  # the whole metadata is the task's return value (XCom)
            self.log.info("published %s ds=%s: %s rows%s%s", dataset, self.ds, meta.get("rows"),
                          f", {meta['shards']} shards" if meta.get("shards") else "",
                          f", {meta['mode']} ({meta.get('mode_reason')})" if meta.get("mode") else "")
        self._built = summary
        return summary

    def _remove_abandoned_staging(self, plan: FeaturePlan) -> None:
        """Remove other sharded builds of this step and day (runs that failed, or ran with other settings) left
        unwritten longer than ``ABANDONED_AFTER_TIMEOUTS`` build timeouts: no job of theirs can still be writing, and
        no retry of theirs still merging. A build in progress elsewhere is left alone."""
        from core import storage

        assert plan.staging is not None
        day_folder = plan.staging.rstrip("/").rsplit("/", 1)[0]
        cutoff = time.time() - ABANDONED_AFTER_TIMEOUTS * plan.features.timeout_seconds
        for name in storage.list_names(day_folder):
            folder = storage.join(day_folder, name)
            written = storage.last_modified(folder)
            if folder != plan.staging and written is not None and written < cutoff:
                self.log.info("removing an abandoned sharded build of %s ds=%s: %s", self.step, self.ds, folder)
                storage.remove_tree(folder)
        if not storage.is_remote(day_folder):  # the day's and the step's folders, once empty (an object store has none)
            for empty in (storage.local_path(day_folder), storage.local_path(day_folder).parent):
                try:
                    empty.rmdir()
                except OSError:  # not empty: another build of this step (a day) in progress, or gone
                    break

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's listener): the partitions this step read (its metadata's ``inputs``) and
        wrote (``operators.lineage``); read back from the outputs' ``_metadata.json`` if this instance did not
        build them."""
        from core import config, storage
        from operators.lineage import feature_lineage

        root = config.load().storage_root
        summary = self._built
        if summary is None:
            summary = {}
            for dataset in STEP_OUTPUTS[self.step]:
                try:
                    summary[dataset] = storage.read_metadata(root, dataset, self.ds)
                except (OSError, ValueError):
                    summary[dataset] = {}
        return feature_lineage(root, self.ds, summary)


def announce_examples(ds: str, run_type: str) -> dict[str, str]:
    """The examples of ``ds`` announced to training (the task's outlet, the ``pinflow_examples`` asset that
    ``pin_ranker_training`` is scheduled on), or the task skipped and nothing announced.

    Training follows the newest day: a run of the daily schedule, or a manual run of the newest complete day,
    announces; a backfill never does, nor a rebuild of an older day (a 3-day backfill started two full trainings
    nobody asked for, which then held the team's quota). To train on older days, trigger pin_ranker_training
    from its form (``end_ds``).
    """
    from airflow.sdk.exceptions import AirflowSkipException

    from core import config, contracts, storage

    if run_type == "backfill":
        raise AirflowSkipException(f"examples of ds={ds} are published; a backfill does not trigger training "
                                   "(trigger pin_ranker_training from its form to train on these days)")
    days = storage.complete_days(config.load().storage_root, contracts.EXAMPLES)
    newest = days[-1] if days else None
    if newest != ds:
        raise AirflowSkipException(f"examples of ds={ds} are published; training is not triggered: it follows the "
                                   f"newest day, and the newest complete examples day is {newest} (trigger "
                                   f"pin_ranker_training from its form with end_ds to train on older days)")
    return {"ds": ds}


class AnnounceExamplesOperator(BaseOperator):
    """The feature DAG's last task: :func:`announce_examples` for the run's day ``ds`` (templated), its outlet the
    ``pinflow_examples`` asset. Not a @task: the DAG's parse time (docs/architecture.md)."""

    template_fields: Sequence[str] = ("ds",)

    def __init__(self, *, ds: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ds = ds

    def execute(self, context: Context) -> dict[str, str]:
        run_type = getattr(context["dag_run"], "run_type", "")
        return announce_examples(self.ds, str(getattr(run_type, "value", run_type)))
