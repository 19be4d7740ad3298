"""The training stage: plan the run, the health-checked distributed training operator, the promotion gate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink, Context

from core.failures import ConfigError, DataError, InfraError, UserError, as_typed
from operators.compute_job import ComputeJobOperator, JobRef, Submission, Watch, job_folder

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

    from core.config import PlatformConfig
    from training.config import RunConfig

# Fields of training.config.RunConfig a trigger-form param (or a test) may set.
TUNABLE = (
    "epochs", "batch_size", "lr", "strategy", "sharding", "seed", "max_steps", "target_examples", "checkpoint_every", "heartbeat_every_s",
    "fail_nan_at_step", "debug_step_sleep_s", "num_workers", "num_threads", "prefetch_factor", "pin_memory", "input_engine",
)


def plan_training_days(model: str, end_ds: str | None, train_days: int, accept_fewer_days: bool = False) -> dict[str, Any]:
    """Evaluation day and training days from the complete partitions of the family's dataset.

    The evaluation day is ``end_ds`` (default: the newest complete day); training uses the ``train_days``
    complete days before it. Fewer complete days than asked for is a USER error naming them, unless
    ``accept_fewer_days``: the run then trains on those it has and the promotion gate does not promote its model.
    An unknown family is a USER error.
    """
    from core import config
    from core.storage import complete_days  # a local root or s3://...

    cfg = config.load()
    dataset = family_dataset(model)
    root = cfg.storage_root
    days = complete_days(root, dataset)
    if not days:
        raise DataError(f"no complete {dataset} partition under {root} for model {model}: build or land it first")
    eval_ds = end_ds or days[-1]
    if eval_ds not in days:
        raise DataError(f"{dataset} partition ds={eval_ds} is missing or incomplete under {root}")
    train = [d for d in days if d < eval_ds][-train_days:]
    if not train:
        raise DataError(f"no {dataset} partition before the evaluation day {eval_ds}: build earlier days first")
    if len(train) < train_days and not accept_fewer_days:
        raise UserError(
            f"train_days={train_days}, but only {len(train)} complete {dataset} partition(s) lie before the evaluation "
            f"day {eval_ds} ({train[0]}..{train[-1]}) under {root}: build the missing days, lower train_days to "
            f"{len(train)}, or set accept_fewer_days (the model is then trained but not promoted)"
        )
    return {"model": model, "dataset": dataset, "train_days": train, "eval_ds": eval_ds,
            "train_days_requested": train_days}


INPUTS_DIR = "inputs"  # beside a run's checkpoints: its pinned input partitions and their manifest


def pin_inputs(root: str, pins_dir: str, dataset: str, train_days: Sequence[str], eval_ds: str) -> dict[str, Any]:
    """Pin the partitions a training run reads (``core.storage.pin_partition``); return the manifest for RUN.json
    ``inputs`` (dataset -> day -> pin).

    Pinned: ``dataset`` on the training days and the evaluation day; the ``features/user_sequence`` days their
    examples reference (``sequence_ds`` in their ``_metadata.json``, read from the pinned version); the ``raw/pins``
    partitions of the snapshot views as of the last training day and as of the evaluation day
    (``core.storage.snapshot_days``), which the families join. On a local root each is hard-linked under
    ``pins_dir``; on an object store only its version is recorded. The manifest is written last to
    ``<pins_dir>/PINS.json``: every try of one run reuses it (a retry resumes from checkpoints taken on exactly these
    versions), unless it was made for other days or a pinned copy is gone, when everything is pinned again.
    A missing or incomplete partition is a DataError naming it.
    """
    from core import storage
    from core.contracts import RAW_PINS, USER_SEQUENCE

    plan = {"dataset": dataset, "train_days": list(train_days), "eval_ds": eval_ds}
    manifest_path = storage.join(pins_dir, storage.PINS_FILE)
    try:
        saved = storage.read_json(manifest_path)
    except FileNotFoundError:
        saved = None
    if isinstance(saved, dict) and saved.get("plan") == plan and storage.pins_intact(saved.get("inputs") or {}):
        return dict(saved["inputs"])
    storage.remove_tree(pins_dir)  # a try that died while pinning, or pins of another plan
    inputs: dict[str, dict[str, Any]] = {}

    def pin(name: str, day: str) -> dict[str, Any]:
        if day not in inputs.get(name, {}):
            try:
                inputs.setdefault(name, {})[day] = storage.pin_partition(root, name, day, pins_dir).to_dict()
            except FileNotFoundError as err:
                raise DataError(f"cannot pin the inputs of this training run: {err} (under {root}); build or land it "
                                "first") from None
        return dict(inputs[name][day])

    for day in sorted({*train_days, eval_ds}):
        entry = pin(dataset, day)
        try:
            meta = storage.read_json(storage.join(entry["location"], storage.METADATA_FILE))
        except FileNotFoundError:
            meta = {}
        if meta.get("sequence_digest") and meta.get("sequence_ds"):  # examples referencing their user's sequence
            pin(USER_SEQUENCE, str(meta["sequence_ds"]))
    for as_of in sorted({max(train_days), eval_ds}):
        for day in storage.snapshot_days(root, RAW_PINS, as_of):
            pin(RAW_PINS, day)
    storage.write_json(manifest_path, {"plan": plan, "inputs": inputs})
    return inputs


def release_pinned_copies(checkpoint_dir: str) -> None:
    """Remove the pinned copies of a run that has finished (its checkpoints' sibling ``inputs/``), keeping the
    manifest ``PINS.json`` (the versions stay recorded there, in RUN.json and in MLflow)."""
    from core import storage

    pins_dir = storage.join(checkpoint_dir.rstrip("/").rsplit("/", 1)[0], INPUTS_DIR)
    for name in storage.list_names(pins_dir):
        if name != storage.PINS_FILE:
            storage.remove_tree(storage.join(pins_dir, name))


def tracking_server_answers(uri: str, timeout_s: float = 10.0) -> None:
    """InfraError (the task retries with backoff) if ``uri`` is an MLflow tracking server that does not answer
    its ``/health``; nothing for a database or file store (the job opens it itself) or no tracking (empty)."""
    import urllib.error
    import urllib.request

    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as answer:  # noqa: S310 - http(s) only
            if answer.status == 200:
                return
            problem = f"HTTP {answer.status}"
    except urllib.error.HTTPError as e:
        problem = f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        problem = str(getattr(e, "reason", e))
    raise InfraError(f"preflight: the MLflow tracking server {uri} does not answer ({problem}): nothing was submitted; "
                     "the task retries. Start it, or fix mlflow.tracking_uri (PINFLOW_MLFLOW__TRACKING_URI); an empty "
                     "tracking_uri trains without tracking")


def family_dataset(model: str) -> str:
    """The dataset whose rows a family trains on (imports the family's module: not at DAG parse time)."""
    from core import config
    from training.sdk import load_family

    cfg = config.load()
    if model not in cfg.families:
        raise ConfigError(f"unknown model family {model!r} (param model): configured are {', '.join(sorted(cfg.families))}")
    return load_family(model, cfg.families[model].module, dict(cfg.families[model].params)).dataset


class TrainingPlanOperator(BaseOperator):
    """The training DAG's first task: checks the run's form and plans the evaluation and training days
    (:func:`plan_training_days`); its XCom is the plan the training task reads. Not a @task: the DAG's parse
    time (docs/architecture.md)."""

    def execute(self, context: Context) -> dict[str, Any]:
        from operators.run_conf import check_run_conf

        check_run_conf(context)
        params = context["params"]
        return plan_training_days(params["model"], params["end_ds"], int(params["train_days"]),
                                  bool(params.get("accept_fewer_days")))


class JobConsoleLink(BaseOperatorLink):
    """The training job's page: the AWS Batch console, the Kubernetes dashboard, or the local job folder."""

    name = "Training job"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return str(getattr(operator, "_links", {}).get("job", ""))


class MlflowRunLink(BaseOperatorLink):
    """The MLflow run the training job logged to."""

    name = "MLflow run"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return str(getattr(operator, "_links", {}).get("mlflow", ""))


class DistributedTrainingOperator(ComputeJobOperator):
    """Train a model family (``training.sdk``) as a distributed job on a compute backend.

    The job's lifecycle is :class:`~operators.compute_job.ComputeJobOperator`'s: preflight (the spec is valid for
    the platform config, the inputs exist, the backend and the tracking server answer; on the nodes,
    ``training.preflight`` runs as the job's first step) → submit, or reattach to the job recorded for this task in
    the task state store, or to one an earlier try submitted and did not record (a restarted worker or a rerun while
    the job still runs never submits a second; a job that has ended is never reattached) → wait, deferred to
    :class:`~operators.triggers.ComputeJobTrigger` (``deferrable=True``) or polling on the worker → classify the
    outcome into a typed error per failure class (``operators.errors``), which the task's retry policy retries
    (INFRA) or fails now. Checkpoints live per DAG run, so an INFRA retry resumes where the failed try stopped.
    ``on_kill`` cancels the job on both paths.

    :param plan: ``{"train_days": [...], "eval_ds": ...}`` (templated).
    :param model: the model family, a key of ``families:`` (templated; default: ``training.model``).
    :param backend: ``local``, ``batch`` or ``kubernetes`` (templated).
    :param overrides: RunConfig fields from the trigger form, e.g. epochs, lr (templated).
    :param nodes: nodes of the job (templated; default: ``training.nodes``).
    :param procs_per_node: processes per node (templated; default: ``training.procs_per_node``).
    :param team: a team under ``teams:`` in the platform config: its queue, fair share, priority, default instance
        type and quota (templated; default: ``training.team``). Before submitting, the task waits (deferred to
        :class:`~operators.quotas.QuotaTrigger`) until the team's quota has room; every transition of the job is
        written to the job history (``services.job_history``).
    :param instance_type: the nodes' type, a key of ``instance_types:`` (templated; default: the team's, else
        ``training.instance_type``); the nodes' requests and limits derive from it (``operators.backends.resources``).
    :param deferrable: wait in the triggerer instead of on a worker slot.
    :param poll_seconds: seconds between status checks (default: ``training.poll_seconds``).
    """

    template_fields: Sequence[str] = (
        "plan", "model", "backend", "overrides", "nodes", "procs_per_node", "team", "instance_type",
    )
    ui_color = "#d6e4ff"
    operator_extra_links = (JobConsoleLink(), MlflowRunLink())
    external_id_key = "training_job"
    what = "training job"

    def __init__(
        self,
        *,
        plan: Any,
        model: str | None = None,
        backend: str = "local",
        overrides: dict[str, Any] | None = None,
        nodes: int | str | None = None,
        procs_per_node: int | str | None = None,
        team: str | None = None,
        instance_type: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.plan = plan
        self.model = model
        self.backend = backend
        self.overrides = overrides or {}
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.team = team
        self.instance_type = instance_type
        self._links: dict[str, str] = {}

    def job_key(self, context: Context) -> tuple[str, ...]:
        """What tells this task's jobs and checkpoints apart from other training tasks of the same DAG run
        (none: one training task per run; an HPO trial returns its trial number)."""
        return ()

    # -- ComputeJobOperator --------------------------------------------------------------------------------------
    def name_parts(self, context: Context) -> tuple[str, ...]:
        ti = context["ti"]
        return ("train", ti.dag_id, ti.run_id, *self.job_key(context))

    def watch(self) -> Watch:
        from core import config
        training = config.load().training
        return Watch(poll_s=float(self.poll_seconds or training.poll_seconds),
                     stall_s=float(training.heartbeat_timeout_seconds),
                     queue_timeout_s=float(training.queue_timeout_seconds))

    def prepare(self, context: Context, name: str, todo: Any = None) -> Submission:
        """The job spec and the run's RUN.json content (``settings``), checked by the job's own models."""
        from core import config, storage
        from core.contracts import MODELS
        from operators.backends import JobSpec
        from operators.jobs import job_name
        from training.config import RunConfig

        cfg = config.load()
        training = cfg.training
        backend_name = str(self.backend)
        ti = context["ti"]
        run_key = job_name("run", ti.dag_id, ti.run_id, *self.job_key(context))
        family_name = str(self.model or training.model)
        if family_name not in cfg.families:
            raise ConfigError(
                f"unknown model family {family_name!r} (param model): configured are {', '.join(sorted(cfg.families))}"
            )
        family = cfg.families[family_name]
        model_name = family.model_name or family_name
        output_dir = job_folder(cfg, backend_name, name)
        procs = training.procs_per_node if self.procs_per_node in (None, "") else int(self.procs_per_node)
        team = str(self.team or training.team)
        num_workers, num_threads = self._input_workers(cfg, backend_name, team, procs, self.overrides)
        # The family's own training defaults, else the platform's; a form value wins; the input workers as derived.
        optimisation = {
            "epochs": family.epochs or training.epochs, "batch_size": family.batch_size or training.batch_size,
            "lr": family.lr or training.lr, "strategy": training.strategy, "sharding": training.sharding,
            "sharded_export_above_mib": training.sharded_export_above_mib,
            "max_steps": training.max_steps, "target_examples": training.target_examples, "min_steps": training.min_steps,
            "prefetch_factor": training.prefetch_factor, "pin_memory": training.pin_memory,
            "input_engine": training.input_engine, "data_bound_share": training.data_bound_share,
            "ray_cpus": training.ray_cpus, "ray_task_cpus": training.ray_task_cpus,
            **{k: v for k, v in self.overrides.items() if k in TUNABLE and v is not None},
            "num_workers": num_workers, "num_threads": num_threads,
        }
        # The job's own typed settings, checked as they are built, before anything is submitted (a bad value: USER).
        run = RunConfig.checked(
            f"RUN.json of {name} (platform config and the run's params)",
            root=cfg.storage_root,
            train_days=list(self.plan["train_days"]),
            eval_ds=self.plan["eval_ds"],
            output_dir=output_dir,
            # Shared by every try of this DAG run: a retry resumes from the last checkpoint, on the inputs pinned
            # beside it (INPUTS_DIR).
            checkpoint_dir=storage.join(cfg.storage_root, MODELS, model_name, run_key, "checkpoints"),
            mlflow_tracking_uri=cfg.mlflow.tracking_uri,
            mlflow_artifact_location=cfg.mlflow.artifact_root,
            family=family_name,
            family_module=family.module,
            # Family hyperparameters from the form over the configured ones.
            params={**family.params, **(self.overrides["params"] if isinstance(self.overrides.get("params"), dict) else {})},
            experiment=family.experiment or family_name,
            model_name=model_name,
            register=True,
            run_name=f"{ti.run_id}-try{ti.try_number}",
            train_days_requested=int(self.plan.get("train_days_requested") or len(self.plan["train_days"])),
            lease_s=cfg.job_history.lease_s,  # the job registers its model only while a task renews its lease
            tags={"dag": ti.dag_id, "run": ti.run_id, "try": str(ti.try_number), "backend": backend_name,
                  "job": name, "team": team, "family": family_name},
            **optimisation,
        )
        run.family_instance()  # the family's params, by its own Params
        spec = JobSpec(
            name=name,
            command=["-m", "training.train", "--config", storage.join(output_dir, "RUN.json")],
            team=self.team or training.team,
            instance_type=self.instance_type or "",
            image=training.image,
            distributed=True,
            nodes=training.nodes if self.nodes in (None, "") else int(self.nodes),
            procs_per_node=procs,
            gpus_per_node=training.gpus_per_node,
            checkpoint_dir=run.checkpoint_dir,
            # The nodes' health check (devices, all-reduce, disk, inputs, MLflow) as the job's first step.
            preflight=training.preflight,
        )
        summary = (f"{spec.nodes} node(s) × {spec.procs_per_node} process(es), team {spec.team}, train "
                   f"{', '.join(run.train_days)}, evaluate {run.eval_ds}; output in {output_dir}")
        return Submission(backend_name, spec, output_dir=output_dir, summary=summary, settings=run)

    def preflight(self, context: Context, backend: Any, submission: Submission) -> None:
        self._preflight(backend, submission.settings.mlflow_tracking_uri)

    def before_submit(self, context: Context, backend: Any, submission: Submission) -> None:
        """Wait (deferred, or polling) until the team's quota has room, recording the job in the history; pin the
        inputs; write RUN.json; take the job's lease."""
        from core import lease, storage  # a local folder or s3://... (the job reads it the same way)
        from operators import quotas

        run, output_dir = submission.settings, str(submission.output_dir)
        quotas.admit_job(self, context, submission.spec, backend=backend.name, family=run.family,
                         output_dir=output_dir, checkpoint_dir=run.checkpoint_dir)
        pins_dir = storage.join(run.checkpoint_dir.rstrip("/").rsplit("/", 1)[0], INPUTS_DIR)
        submission.settings = run = run.replace(f"RUN.json inputs pinned in {pins_dir}",
                                                inputs=self._pin_inputs(run, pins_dir))
        run.write(storage.join(output_dir, "RUN.json"))
        lease.renew(output_dir, submission.spec.name)  # before the job exists: a runner killed after submitting leaves a lease

    def submit(self, context: Context, backend: Any, submission: Submission) -> str:
        from services import job_history

        spec = submission.spec
        submitted_at = job_history.now()
        try:
            job_id = backend.submit(spec)
        except Exception as err:
            job_history.note(job_history.upsert, spec.name, state=job_history.FAILED, outcome=job_history.FAILED,
                             ended_at=job_history.now(), reason=f"submission failed: {err}")
            raise
        job_history.note(job_history.mark_submitted, spec.name, job_id, submitted_at)
        return job_id

    def attached(self, context: Context, job: JobRef) -> None:
        """Renew the job's lease; the extra links and the log."""
        from core import lease
        from operators import links
        from operators.backends import get_backend
        from services import job_history

        if job.output_dir:  # this try watches the job now (a reattaching one too): its lease is renewed at once
            lease.renew(job.output_dir, job.job_id)
        ti = context["ti"]
        try:  # http(s) only (the UI shows no other link): a local job's folder is the plugin's job page
            url = links.console_url(job.backend, job.job_id, get_backend(job.backend).console_url(job.job_id))
        except Exception:  # noqa: BLE001 - a link is not worth failing a job for
            url = ""
        if url and self._links.get("job") != url:
            self._links["job"] = url
            ti.xcom_push(key=JobConsoleLink().xcom_key, value=url)
            # Each URL last on its line or before a space: the log viewer makes a link of everything up to a space.
            self.log.info("%s job %s: %s ; progress of this run: %s", job.backend, job.job_id, url,
                          links.run_page_url(ti.dag_id, ti.run_id))
            job_history.note(job_history.update_job, job.backend, job.job_id, console_url=url)
        if "mlflow" not in self._links:  # resolves to the job's MLflow run as soon as the job has created it
            self._links["mlflow"] = links.mlflow_run_url(ti.dag_id, ti.run_id)
            ti.xcom_push(key=MlflowRunLink().xcom_key, value=self._links["mlflow"])

    def ended(self, job: JobRef, event: dict[str, Any] | None, *, status: Any = None,
              error: BaseException | None = None) -> None:
        from services import job_history

        job_history.job_ended(job.to_dict(), event, error=error, status=status)

    def cancelling(self, job: JobRef) -> None:
        from services import job_history

        # CANCELLED first: the cancelled job exits as a killed process (INFRA), which is not what happened.
        job_history.note(job_history.mark_ended, job.backend, job.job_id, job_history.CANCELLED,
                         reason=job_history.STOPPED_BY_A_PERSON)

    def finish(self, context: Context, job: JobRef) -> dict[str, Any]:
        """The job's result.json, recorded in the job history; the run's pinned input copies released."""
        from core import config, storage

        output_dir = str(job.output_dir)
        try:
            result: dict[str, Any] = storage.read_json(storage.join(output_dir, "result.json"))
        except FileNotFoundError as err:
            raise UserError(
                f"training job {job.job_id} succeeded but wrote no result.json in {output_dir}: "
                "the entry point must write it (training.train)"
            ) from err
        from services import job_history

        job_history.note(job_history.record_result, job.backend, job.job_id, result)
        if result.get("mlflow_run_id"):
            base = config.load().mlflow.ui_url.rstrip("/")
            self._links["mlflow"] = f"{base}/#/runs/{result['mlflow_run_id']}"
        self.log.info("training finished: model %s version %s, metrics %s",
                      result.get("model_name"), result.get("model_version"), result.get("metrics"))
        try:  # the run is over: its frozen input copies go (the manifest stays, with the versions)
            from training.config import RunConfig

            release_pinned_copies(RunConfig.from_json(storage.join(output_dir, "RUN.json")).checkpoint_dir)
        except Exception as err:  # noqa: BLE001 - a cleanup is not worth failing a finished run for
            self.log.warning("could not remove the pinned input copies of %s: %s", output_dir, err)
        for warning in result.get("warnings") or []:
            self.log.warning("training summary: %s", warning)
        self._result = result  # for get_openlineage_facets_on_complete
        return result

    def execute_after_quota(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        """The team's quota has room (:class:`~operators.quotas.QuotaTrigger`): admit and submit, or wait again."""
        if event:
            self.log.info("team %s has room after %.0fs: admitting job %s", event.get("team"),
                          float(event.get("waited_s") or 0), event.get("job_name"))
        return self.execute(context)

    def _input_workers(self, cfg: PlatformConfig, backend: str, team: str, procs: int,
                       overrides: dict[str, Any]) -> tuple[int, int]:
        """Input workers and torch threads per process (``resources.input_workers``): the form's, else
        ``training:``'s, else derived from the node (the local backend: this machine's CPUs, no GPU; otherwise the
        job's instance type). input_engine ray reads with one reader per process (its workers are Ray's)."""
        from operators.backends.resources import Catalog, input_workers

        training = cfg.training
        workers = overrides.get("num_workers") if overrides.get("num_workers") not in (None, "") else training.num_workers
        threads = overrides.get("num_threads") if overrides.get("num_threads") not in (None, "") else training.num_threads
        engine = overrides.get("input_engine") or training.input_engine
        if backend == "local":
            cpus, gpus, where = len(os.sched_getaffinity(0)), 0, "this machine, the local backend"
        else:
            catalog = Catalog.from_config(cfg)
            itype = self.instance_type or (cfg.teams[team].instance_type if team in cfg.teams else "") or training.instance_type
            if itype not in catalog.instance_types:
                itype = training.instance_type  # the job spec's own check names an unknown type
            node = catalog.instance_types[itype]
            cpus, gpus, where = node.vcpus, node.gpus if training.gpus_per_node is None else training.gpus_per_node, itype
        workers, threads = input_workers(cpus, procs, gpus, None if workers is None else int(workers),
                                         None if threads is None else int(threads), where=where)
        return (0 if engine == "ray" else workers), threads

    def _pin_inputs(self, run: RunConfig, pins_dir: str) -> dict[str, Any]:
        """The run's input partitions, pinned by its first try and reused by the others (:func:`pin_inputs`)."""
        dataset = run.family_instance().dataset
        inputs = pin_inputs(run.root, pins_dir, dataset, run.train_days, run.eval_ds)
        count = sum(len(days) for days in inputs.values())
        self.log.info("pinned %d input partition(s) in %s: %s", count, pins_dir, "; ".join(
            f"{dataset} " + ", ".join(f"{ds}@{entry['version']}" for ds, entry in sorted(days.items()))
            for dataset, days in sorted(inputs.items())))
        return inputs

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's listener): the partitions of the train and evaluation days in, the model
        version the job registered out (``operators.lineage``)."""
        from core import config
        from operators.lineage import training_lineage

        result = getattr(self, "_result", None)
        if result is None:  # another instance ran the job (e.g. resumed from the triggerer): its XCom
            try:
                result = task_instance.xcom_pull(task_ids=self.task_id)
            except Exception:
                result = None
        cfg = config.load()
        plan = self.plan if isinstance(self.plan, dict) else {}
        return training_lineage(cfg.storage_root, cfg.mlflow.tracking_uri, plan, result if isinstance(result, dict) else None)

    def _preflight(self, backend: Any, tracking_uri: str) -> None:
        """Cheap checks before anything is submitted: the inputs exist, the backend and the tracking server
        answer (a job submitted while MLflow is down would only fail its own preflight, after its queue wait)."""
        from core import config
        from core.contracts import EXAMPLES
        from core.storage import is_complete

        dataset = str(self.plan.get("dataset", EXAMPLES))
        missing = [d for d in [*self.plan["train_days"], self.plan["eval_ds"]]
                   if not is_complete(config.load().storage_root, dataset, d)]
        if missing:
            raise DataError(f"{dataset} partitions missing or incomplete: {missing}; build or land them first")
        try:
            backend.ping()
        except Exception as err:
            # Missing credentials are a setting to fix (USER); a service that does not answer is INFRA.
            raise as_typed(err, f"preflight: the {backend.name} backend") from err
        tracking_server_answers(tracking_uri)
