"""The training stage: plan the run, the health-checked distributed training operator, the promotion gate."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator, Context

from operators import config
from operators.errors import DataFailure, InfraFailure

# Fields of training.config.RunConfig a trigger-form param may set.
TUNABLE = ("epochs", "batch_size", "lr", "seed", "max_steps")


def plan_training_days(end_ds: str | None, train_days: int) -> dict[str, Any]:
    """Evaluation day and training days from the complete ``examples`` partitions.

    The evaluation day is ``end_ds`` (default: the newest complete day); training uses up to
    ``train_days`` days before it.
    """
    from features.storage import complete_days

    days = complete_days(config.storage_root(), "examples")
    if not days:
        raise DataFailure("no complete examples partition under the storage root: run pin_daily_features first")
    eval_ds = end_ds or days[-1]
    if eval_ds not in days:
        raise DataFailure(f"examples partition ds={eval_ds} is missing or incomplete: run pin_daily_features for it")
    train = [d for d in days if d < eval_ds][-train_days:]
    if not train:
        raise DataFailure(f"no examples partition before the evaluation day {eval_ds}: build earlier days first")
    return {"train_days": train, "eval_ds": eval_ds}


class DistributedTrainingOperator(BaseOperator):
    """Train the ranker as a distributed job on a compute backend, and wait for it.

    Preflight (the backend answers, the inputs exist) → submit, or find the job already submitted for
    this task try (its name is derived from dag, run, task and try, so a restarted worker never starts
    a duplicate) → watch heartbeats → classify the outcome into a typed error per failure class.
    Checkpoints live per DAG run, so an INFRA retry resumes where the failed try stopped.

    :param plan: ``{"train_days": [...], "eval_ds": ...}`` (templated).
    :param backend: ``local`` (templated).
    :param overrides: RunConfig fields from the trigger form, e.g. epochs, lr (templated).
    """

    template_fields: Sequence[str] = ("plan", "backend", "overrides", "nodes", "procs_per_node")
    ui_color = "#d6e4ff"

    def __init__(
        self,
        *,
        plan: Any,
        backend: str = "local",
        overrides: dict[str, Any] | None = None,
        nodes: int | str | None = None,
        procs_per_node: int | str | None = None,
        team: str = "ranking",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.plan = plan
        self.backend = backend
        self.overrides = overrides or {}
        self.nodes = nodes
        self.procs_per_node = procs_per_node
        self.team = team
        self._job: tuple[Any, str] | None = None

    def execute(self, context: Context) -> dict[str, Any]:
        from operators.backends import JobSpec, get_backend
        from operators.jobs import job_name, wait_for_job

        cfg = config.load()
        training = cfg["training"]
        if self.team not in cfg["teams"]:
            raise ValueError(f"team {self.team!r} is not in config/platform.yaml teams: {sorted(cfg['teams'])}")
        ti = context["ti"]
        name = job_name("train", ti.dag_id, ti.run_id, f"try{ti.try_number}")
        run_key = job_name("run", ti.dag_id, ti.run_id)
        home = Path(cfg["home"])
        output_dir = home / "runs" / name
        run_config = {
            "root": cfg["storage_root"],
            "train_days": list(self.plan["train_days"]),
            "eval_ds": self.plan["eval_ds"],
            "output_dir": str(output_dir),
            # Shared by every try of this DAG run: a retry resumes from the last checkpoint.
            "checkpoint_dir": str(Path(cfg["storage_root"]) / "models" / cfg["mlflow"]["model_name"] / run_key / "checkpoints"),
            "mlflow_tracking_uri": cfg["mlflow"]["tracking_uri"],
            "mlflow_artifact_location": cfg["mlflow"]["artifact_root"],
            "experiment": cfg["mlflow"]["experiment"],
            "model_name": cfg["mlflow"]["model_name"],
            "register": True,
            "run_name": f"{ti.run_id}-try{ti.try_number}",
            "sequence_length": int(cfg["features"]["sequence_length"]),
            "epochs": int(training["epochs"]),
            "batch_size": int(training["batch_size"]),
            "lr": float(training["lr"]),
        }
        run_config.update({k: v for k, v in self.overrides.items() if k in TUNABLE and v is not None})

        backend = get_backend(str(self.backend), str(home))
        spec = JobSpec(
            name=name,
            command=["-m", "training.train", "--config", str(output_dir / "RUN.json")],
            team=self.team,
            image=str(training["image"]),
            distributed=True,
            nodes=int(self.nodes or training["nodes"]),
            procs_per_node=int(self.procs_per_node or training["procs_per_node"]),
            checkpoint_dir=run_config["checkpoint_dir"],
        )
        spec.validate()
        self._preflight(backend, home)

        job_id = backend.find(name)
        if job_id:
            self.log.info("reattaching to job %s submitted earlier for this task try", job_id)
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            (output_dir / "RUN.json").write_text(json.dumps(run_config, indent=2))
            job_id = backend.submit(spec)
            self.log.info(
                "submitted %s job %s: %d node(s) × %d process(es), train %s, evaluate %s; logs in %s",
                backend.name, job_id, spec.nodes, spec.procs_per_node,
                ", ".join(run_config["train_days"]), run_config["eval_ds"], output_dir,
            )
        self._job = (backend, job_id)
        wait_for_job(
            backend, job_id, output_dir=output_dir, what="training job",
            stall_seconds=float(training["heartbeat_timeout_seconds"]),
        )
        self._job = None
        result = json.loads((output_dir / "result.json").read_text())
        self.log.info("training finished: model %s version %s, metrics %s",
                      result.get("model_name"), result.get("model_version"), result.get("metrics"))
        return result

    def _preflight(self, backend: Any, home: Path) -> None:
        """Cheap checks before anything is submitted: the backend's state folder is writable, inputs exist."""
        from features.storage import is_complete

        missing = [d for d in [*self.plan["train_days"], self.plan["eval_ds"]]
                   if not is_complete(config.storage_root(), "examples", d)]
        if missing:
            raise DataFailure(f"examples partitions missing or incomplete: {missing}; run pin_daily_features for them")
        try:
            (home / "jobs").mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise InfraFailure(f"preflight: {backend.name} backend state folder {home / 'jobs'} is not writable: {err}") from err

    def on_kill(self) -> None:
        if self._job is not None:
            backend, job_id = self._job
            self.log.info("task killed: cancelling job %s", job_id)
            backend.cancel(job_id)


def promote_if_better(result: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Give the new version the ``champion`` alias if its mean AUC is at least the champion's (within tolerance)
    on the same evaluation day; record the decision on the version either way."""
    from mlflow import MlflowClient

    cfg = config.load()
    client = MlflowClient(tracking_uri=cfg["mlflow"]["tracking_uri"], registry_uri=cfg["mlflow"]["tracking_uri"])
    name, version = result["model_name"], str(result["model_version"])
    new_auc = float(result["metrics"]["mean_auc"])
    decision: dict[str, Any] = {"model_name": name, "model_version": version, "auc": new_auc}
    try:
        champion = client.get_model_version_by_alias(name, "champion")
    except Exception:  # noqa: BLE001 - MLflow raises a generic MlflowException when the alias is unset
        champion = None
    if champion is None:
        promote, why = True, "no champion yet"
    else:
        champ_run = client.get_run(str(champion.run_id))
        champ_auc = float(champ_run.data.metrics.get("eval_mean_auc", float("nan")))
        same_day = champ_run.data.params.get("eval_ds") == result.get("eval_ds")
        decision.update(champion_version=champion.version, champion_auc=champ_auc)
        if not same_day:
            promote, why = True, "champion was evaluated on another day; the newer model wins"
        elif new_auc + tolerance >= champ_auc:
            promote, why = True, f"mean AUC {new_auc:.4f} >= champion {champ_auc:.4f} - {tolerance}"
        else:
            promote, why = False, f"mean AUC {new_auc:.4f} < champion {champ_auc:.4f} - {tolerance}"
    client.set_model_version_tag(name, version, "promotion", ("promoted: " if promote else "rejected: ") + why)
    if promote:
        client.set_registered_model_alias(name, "champion", version)
    decision.update(promoted=promote, reason=why)
    return decision
