"""The training stage: plan the run, the health-checked distributed training operator, the promotion gate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink, Context, ResumableJobMixin

from core.failures import ConfigError, DataError, InfraError, PinflowError, UserError, as_typed

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

    from core import config

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


class DistributedTrainingOperator(ResumableJobMixin, BaseOperator):
    """Train a model family (``training.sdk``) as a distributed job on a compute backend.

    Preflight (the spec is valid for the platform config, the inputs exist, the backend answers; on the
    nodes, ``training.preflight`` runs as the job's first step) → submit,
    or reattach to the job recorded for this task in the task state store (a restarted worker or a rerun
    while the job still runs never submits a second; a job that has ended is never reattached) → wait,
    deferred to :class:`~operators.triggers.ComputeJobTrigger` (``deferrable=True``) or polling on the
    worker (Airflow's ``ResumableJobMixin``) → classify the outcome into a typed error per failure class
    (``operators.errors``), which the task's retry policy retries (INFRA) or fails now.

    Job names are deterministic per (dag, run, task, try), and before submitting the operator looks up
    the names of this task's earlier tries: a worker that died between submitting and recording the job
    id cannot cause a duplicate either. Checkpoints live per DAG run, so an INFRA retry resumes where the
    failed try stopped. ``on_kill`` cancels the job on both paths.

    :param plan: ``{"train_days": [...], "eval_ds": ...}`` (templated).
    :param model: the model family, a key of ``families:`` (templated; default: ``training.model``).
    :param backend: ``local``, ``batch`` or ``kubernetes`` (templated).
    :param overrides: RunConfig fields from the trigger form, e.g. epochs, lr (templated).
    :param nodes: nodes of the job (templated; default: ``training.nodes``).
    :param procs_per_node: processes per node (templated; default: ``training.procs_per_node``).
    :param team: a team under ``teams:`` in the platform config: its queue, fair share, priority, default instance
        type and quota (templated; default: ``training.team``). Before submitting, the task waits (deferred to
        :class:`~operators.quotas.QuotaTrigger`) until the team's quota has room; every transition of the job is
        written to the job history (``operators.job_history``).
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
        deferrable: bool = True,
        poll_seconds: float | None = None,
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
        self.deferrable = deferrable
        self.poll_seconds = poll_seconds
        self._job: dict[str, Any] | None = None
        self._links: dict[str, str] = {}

    # -- the job ---------------------------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        from core import config

        cfg = config.load()
        training = cfg.training
        return {
            "cfg": cfg,
            "poll": float(self.poll_seconds or training.poll_seconds),
            "stall": float(training.heartbeat_timeout_seconds),
            "queue_timeout": float(training.queue_timeout_seconds),
        }

    def job_key(self, context: Context) -> tuple[str, ...]:
        """What tells this task's jobs and checkpoints apart from other training tasks of the same DAG run
        (none: one training task per run; an HPO trial returns its trial number)."""
        return ()

    def _job_name(self, context: Context, try_number: int) -> str:
        from operators.jobs import job_name

        ti = context["ti"]
        return job_name("train", ti.dag_id, ti.run_id, *self.job_key(context), f"try{try_number}")

    def _prepare(self, context: Context) -> tuple[Any, Any, dict[str, Any], str]:
        """The backend, the validated job spec, the run's RUN.json content and where it goes."""
        from core import config, storage
        from core.contracts import MODELS, RUNS
        from operators.backends import JobSpec, get_backend, validate_for
        from operators.jobs import job_name
        from training.config import RunConfig

        cfg = config.load()
        training = cfg.training
        backend_name = str(self.backend)
        ti = context["ti"]
        name = self._job_name(context, ti.try_number)
        run_key = job_name("run", ti.dag_id, ti.run_id, *self.job_key(context))
        family_name = str(self.model or training.model)
        if family_name not in cfg.families:
            raise ConfigError(
                f"unknown model family {family_name!r} (param model): configured are {', '.join(sorted(cfg.families))}"
            )
        family = cfg.families[family_name]
        model_name = family.model_name or family_name
        # The local backend's job writes under PINFLOW_HOME; remote jobs write to the shared storage root.
        output_dir = storage.join(cfg.home if backend_name == "local" else cfg.storage_root, RUNS, name)
        run_config = {
            "root": cfg.storage_root,
            "train_days": list(self.plan["train_days"]),
            "eval_ds": self.plan["eval_ds"],
            "output_dir": output_dir,
            # Shared by every try of this DAG run: a retry resumes from the last checkpoint, on the inputs pinned
            # beside it (INPUTS_DIR).
            "checkpoint_dir": storage.join(cfg.storage_root, MODELS, model_name, run_key, "checkpoints"),
            "mlflow_tracking_uri": cfg.mlflow.tracking_uri,
            "mlflow_artifact_location": cfg.mlflow.artifact_root,
            "family": family_name,
            "family_module": family.module,
            "params": dict(family.params),
            "experiment": family.experiment or family_name,
            "model_name": model_name,
            "register": True,
            "run_name": f"{ti.run_id}-try{ti.try_number}",
            # The family's own training defaults, else the platform's; a form value wins below.
            "epochs": family.epochs or training.epochs,
            "batch_size": family.batch_size or training.batch_size,
            "lr": family.lr or training.lr,
            "strategy": training.strategy,
            "sharding": training.sharding,
            "max_steps": training.max_steps,
            "target_examples": training.target_examples,
            "min_steps": training.min_steps,
            "prefetch_factor": training.prefetch_factor,
            "pin_memory": training.pin_memory,
            "input_engine": training.input_engine,
            "data_bound_share": training.data_bound_share,
            "ray_cpus": training.ray_cpus,
            "ray_task_cpus": training.ray_task_cpus,
            "train_days_requested": int(self.plan.get("train_days_requested") or len(self.plan["train_days"])),
            # The job registers its model only while a task renews its lease (core.lease).
            "lease_s": cfg.job_history.lease_s,
            "tags": {"dag": ti.dag_id, "run": ti.run_id, "try": str(ti.try_number), "backend": backend_name,
                     "job": name, "team": str(self.team or training.team), "family": family_name},
        }
        run_config.update({k: v for k, v in self.overrides.items() if k in TUNABLE and v is not None})
        if isinstance(self.overrides.get("params"), dict):  # family hyperparameters over the configured ones
            run_config["params"] = {**run_config["params"], **self.overrides["params"]}
        procs = training.procs_per_node if self.procs_per_node in (None, "") else int(self.procs_per_node)
        run_config["num_workers"], run_config["num_threads"] = self._input_workers(
            cfg, backend_name, str(self.team or training.team), procs, self.overrides)
        # The job's own models check RUN.json here, before anything is submitted (a bad value: USER, now).
        source = f"RUN.json of {name} (platform config and the run's params)"
        RunConfig.from_dict(run_config, source=source).family_instance()
        backend = get_backend(backend_name, cfg)
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
            checkpoint_dir=run_config["checkpoint_dir"],
            # The nodes' health check (devices, all-reduce, disk, inputs, MLflow) as the job's first step.
            preflight=training.preflight,
        )
        validate_for(spec, cfg.teams, backend=backend_name)
        backend.dry_run(spec)  # the backend's own checks (schema, resources) before anything is submitted
        return backend, spec, run_config, output_dir

    def _input_workers(self, cfg: config.PlatformConfig, backend: str, team: str, procs: int,
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

    def _remember(self, context: Context, job: dict[str, Any]) -> None:
        """Keep the job for on_kill, the extra links and the log."""
        from operators.backends import get_backend

        self._job = job
        from core import lease
        from operators import job_history, links

        if job.get("output_dir"):  # this try watches the job now (a reattaching one too): its lease is renewed at once
            lease.renew(job["output_dir"], job["job_id"])

        ti = context["ti"]
        try:  # http(s) only (the UI shows no other link): a local job's folder is the plugin's job page
            url = links.console_url(job["backend"], job["job_id"], get_backend(job["backend"]).console_url(job["job_id"]))
        except Exception:  # noqa: BLE001 - a link is not worth failing a job for
            url = ""
        if url and self._links.get("job") != url:
            self._links["job"] = url
            ti.xcom_push(key=JobConsoleLink().xcom_key, value=url)
            # Each URL last on its line or before a space: the log viewer makes a link of everything up to a space.
            self.log.info("%s job %s: %s ; progress of this run: %s", job["backend"], job["job_id"], url,
                          links.run_page_url(ti.dag_id, ti.run_id))
            job_history.note(job_history.update_job, job["backend"], job["job_id"], console_url=url)
        if "mlflow" not in self._links:  # resolves to the job's MLflow run as soon as the job has created it
            self._links["mlflow"] = links.mlflow_run_url(ti.dag_id, ti.run_id)
            ti.xcom_push(key=MlflowRunLink().xcom_key, value=self._links["mlflow"])

    # ResumableJobMixin: the stored external id is the job's record, a dict.
    def submit_job(self, context: Context) -> dict[str, Any]:
        """Reattach to a job an earlier try of this task left running, or submit this try's job."""
        backend, spec, run_config, output_dir = self._prepare(context)
        self._preflight(backend, run_config.get("mlflow_tracking_uri") or "")
        ti = context["ti"]
        # Closes the window between submitting and recording the id: names are deterministic per try.
        for earlier in range(ti.try_number - 1, 0, -1):
            name = self._job_name(context, earlier)
            found = backend.find(name)
            if found and not backend.status(found).state.terminal:
                self.log.info("reattaching to job %s that try %d submitted and did not record", found, earlier)
                job = {"backend": backend.name, "job_id": found, "name": name,
                       "output_dir": output_dir.removesuffix(spec.name) + name}
                self._remember(context, job)
                return job
        job_id = backend.find(spec.name)
        if job_id:
            self.log.info("reattaching to job %s submitted earlier for this task try", job_id)
        else:
            from core import storage  # a local folder or s3://... (the job reads it the same way)
            from operators import job_history, quotas

            # Waits (deferred, or polling) until the team's quota has room; records the job in the history.
            quotas.admit_job(self, context, spec, backend=backend.name, family=run_config["family"],
                             output_dir=output_dir, checkpoint_dir=run_config["checkpoint_dir"])
            run_config["inputs"] = self._pin_inputs(run_config)
            storage.write_json(storage.join(output_dir, "RUN.json"), run_config)
            from core import lease

            lease.renew(output_dir, spec.name)  # before the job exists: a runner killed after submitting leaves a lease
            submitted_at = job_history.now()
            try:
                job_id = backend.submit(spec)
            except Exception as err:
                job_history.note(job_history.upsert, spec.name, state=job_history.FAILED, outcome=job_history.FAILED,
                                 ended_at=job_history.now(), reason=f"submission failed: {err}")
                raise
            job_history.note(job_history.mark_submitted, spec.name, job_id, submitted_at)
            self.log.info(
                "submitted %s job %s: %d node(s) × %d process(es), team %s, train %s, evaluate %s; output in %s",
                backend.name, job_id, spec.nodes, spec.procs_per_node, spec.team,
                ", ".join(run_config["train_days"]), run_config["eval_ds"], output_dir,
            )
        job = {"backend": backend.name, "job_id": job_id, "name": spec.name, "output_dir": output_dir}
        self._remember(context, job)
        return job

    def _pin_inputs(self, run_config: dict[str, Any]) -> dict[str, Any]:
        """The run's input partitions, pinned by its first try and reused by the others (:func:`pin_inputs`)."""
        from core import storage
        from training.config import RunConfig

        checkpoint_dir = str(run_config["checkpoint_dir"])
        pins_dir = storage.join(checkpoint_dir.rstrip("/").rsplit("/", 1)[0], INPUTS_DIR)
        dataset = RunConfig.from_dict(run_config).family_instance().dataset
        inputs = pin_inputs(str(run_config["root"]), pins_dir, dataset, list(run_config["train_days"]),
                            str(run_config["eval_ds"]))
        RunConfig.from_dict({**run_config, "inputs": inputs}, source=f"RUN.json inputs pinned in {pins_dir}")
        count = sum(len(days) for days in inputs.values())
        self.log.info("pinned %d input partition(s) in %s: %s", count, pins_dir, "; ".join(
            f"{dataset} " + ", ".join(f"{ds}@{entry['version']}" for ds, entry in sorted(days.items()))
            for dataset, days in sorted(inputs.items())))
        return inputs

    def _status(self, job: Any) -> Any:
        from operators.backends import get_backend

        return get_backend(str(job["backend"])).status(str(job["job_id"]))

    def get_job_status(self, external_id: Any, context: Context) -> str:
        try:
            return str(self._status(external_id).state.value)
        except LookupError:
            return "MISSING"  # its record is gone: submit anew

    def is_job_active(self, status: str) -> bool:
        return status in ("PENDING", "RUNNING")

    def is_job_succeeded(self, status: str) -> bool:
        return status == "SUCCEEDED"

    def poll_until_complete(self, external_id: Any, context: Context) -> Any:
        from operators.backends import get_backend
        from operators.jobs import wait_for_job

        job = dict(external_id)  # type: ignore[arg-type]
        self._remember(context, job)
        settings = self._settings()
        from operators import job_history

        try:
            status = wait_for_job(
                get_backend(job["backend"]), job["job_id"], output_dir=job["output_dir"], what="training job",
                poll_seconds=settings["poll"], stall_seconds=settings["stall"],
                queue_timeout_seconds=settings["queue_timeout"],
            )
        except PinflowError as err:
            job_history.job_ended(job, error=err)
            self._forget(context)
            raise
        finally:
            self._job = None
        job_history.job_ended(job, status=status)
        # The mixin returns this when it reattached; otherwise it calls get_job_result itself.
        return self.get_job_result(job, context)

    def get_job_result(self, external_id: Any, context: Context) -> dict[str, Any]:
        from core import config, storage

        job = dict(external_id)  # type: ignore[arg-type]
        try:
            result: dict[str, Any] = storage.read_json(storage.join(job["output_dir"], "result.json"))
        except FileNotFoundError as err:
            raise UserError(
                f"training job {job['job_id']} succeeded but wrote no result.json in {job['output_dir']}: "
                "the entry point must write it (training.train)"
            ) from err
        from operators import job_history

        job_history.note(job_history.record_result, job["backend"], job["job_id"], result)
        if result.get("mlflow_run_id"):
            base = config.load().mlflow.ui_url.rstrip("/")
            self._links["mlflow"] = f"{base}/#/runs/{result['mlflow_run_id']}"
        self.log.info("training finished: model %s version %s, metrics %s",
                      result.get("model_name"), result.get("model_version"), result.get("metrics"))
        try:  # the run is over: its frozen input copies go (the manifest stays, with the versions)
            run_config = storage.read_json(storage.join(job["output_dir"], "RUN.json"))
            release_pinned_copies(str(run_config["checkpoint_dir"]))
        except Exception as err:  # noqa: BLE001 - a cleanup is not worth failing a finished run for
            self.log.warning("could not remove the pinned input copies of %s: %s", job["output_dir"], err)
        for warning in result.get("warnings") or []:
            self.log.warning("training summary: %s", warning)
        self._result = result  # for get_openlineage_facets_on_complete
        return result

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

    # -- the task --------------------------------------------------------------------------------------------
    def execute(self, context: Context) -> Any:
        if not self.deferrable:
            return self.execute_resumable(context)
        store = context.get("task_state_store")
        stored = store.get(self.external_id_key) if store is not None else None
        job: dict[str, Any] | None = dict(stored) if isinstance(stored, dict) else None
        if job:
            status = self.get_job_status(job, context)
            if self.is_job_active(status):
                self.log.info("reattaching to job %s (recorded by an earlier try)", job["job_id"])
                self._remember(context, job)
            elif self.is_job_succeeded(status):
                return self.get_job_result(job, context)
            else:
                job = None  # ended: never reattached; this try submits a new job that resumes
        if job is None:
            job = self.submit_job(context)
            if store is not None:
                store.set(self.external_id_key, job)
        self._defer(job)
        return None  # not reached: defer() raises

    def _defer(self, job: dict[str, Any]) -> None:
        from operators.triggers import ComputeJobTrigger

        settings = self._settings()
        self.defer(
            trigger=ComputeJobTrigger(
                backend=job["backend"], job_id=job["job_id"], output_dir=job["output_dir"],
                poll_seconds=settings["poll"], stall_seconds=settings["stall"],
                queue_timeout_seconds=settings["queue_timeout"],
            ),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        """Re-check the job through its backend (the event is only a hint) and classify the outcome."""
        from operators.backends import get_backend
        from operators.jobs import WATCHER_STATES, raise_for_status

        if not event or not event.get("job_id"):
            # Resumed without the trigger's event (its triggerer died with it): decide again from the store.
            self.log.warning("resumed without a trigger event: reattaching through the task state store")
            return self.execute(context)
        job = {k: event[k] for k in ("backend", "job_id", "output_dir")}
        backend = get_backend(job["backend"])
        self._remember(context, job)
        from operators import job_history

        try:
            if event.get("state") in WATCHER_STATES:  # stalled or queued too long: the trigger cancelled it
                raise InfraError(str(event.get("reason")))
            status = raise_for_status(backend, backend.status(job["job_id"]), what="training job")
        except PinflowError as err:
            job_history.job_ended(job, event, error=err)
            self._forget(context)
            raise
        finally:
            self._job = None
        job_history.job_ended(job, event, status=status)
        return self.get_job_result(job, context)

    def execute_after_quota(self, context: Context, event: dict[str, Any] | None = None) -> Any:
        """The team's quota has room (:class:`~operators.quotas.QuotaTrigger`): admit and submit, or wait again."""
        if event:
            self.log.info("team %s has room after %.0fs: admitting job %s", event.get("team"),
                          float(event.get("waited_s") or 0), event.get("job_name"))
        return self.execute(context)

    def _forget(self, context: Context) -> None:
        """The recorded job has ended badly: a retry must submit a new one, never reattach to it."""
        store = context.get("task_state_store")
        if store is not None:
            store.delete(self.external_id_key)

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

    def on_kill(self) -> None:
        if self._job is not None:
            from operators import job_history
            from operators.backends import get_backend

            self.log.info("task killed: cancelling %s job %s", self._job["backend"], self._job["job_id"])
            # CANCELLED first: the cancelled job exits as a killed process (INFRA), which is not what happened.
            job_history.note(job_history.mark_ended, self._job["backend"], self._job["job_id"], job_history.CANCELLED,
                             reason=job_history.STOPPED_BY_A_PERSON)
            get_backend(self._job["backend"]).cancel(self._job["job_id"])
