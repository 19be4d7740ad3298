"""The platform configuration as typed models: one per section, defaults here and nowhere else.

Sources, later ones winning: the defaults below; ``config/platform.yaml`` (or the file ``PINFLOW_CONFIG``
names); environment variables ``PINFLOW_<SECTION>__<KEY>`` (``PINFLOW_TRAINING__EPOCHS=3``) and, for top-level
keys, ``PINFLOW_<KEY>`` (``PINFLOW_STORAGE_ROOT=s3://bucket/prefix``), parsed as YAML scalars. Other
``PINFLOW_*`` variables without ``__`` (``PINFLOW_HOME``, ``PINFLOW_RDZV_PORT``) are not settings.

An unknown key (in the file or a ``__`` variable) is an error that names it, where it came from and the
closest known key; a value of the wrong type names the key, its source and what was expected. The Airflow
layer reads the configuration once (:func:`load`) and passes sections down as explicit arguments; the DAGs'
``Param`` defaults come from it, so a trigger-form value wins only for its own run.

    python -m core.config          # every key with its effective value, source and help
"""

from __future__ import annotations

import datetime as dt
import difflib
import functools
import logging
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from core.failures import ConfigError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_FILE = REPO_ROOT / "config" / "platform.yaml"
ENV_PREFIX = "PINFLOW_"
# PINFLOW_* variables that are not settings: where things are, and what the platform hands its own processes.
RUNTIME_VARIABLES = frozenset({
    "PINFLOW_HOME", "PINFLOW_CONFIG", "PINFLOW_RDZV_PORT", "PINFLOW_ARRAY_INDEX", "PINFLOW_AGENT_PID",
    "PINFLOW_CHECKPOINT_DIR", "PINFLOW_SCREENSHOTS", "PINFLOW_INFERENCE_DEBUG_BATCH_SLEEP_S", "PINFLOW_BIND_ADDRESS",
    "PINFLOW_BUCKET", "PINFLOW_CHECKPOINT_KEY",
})


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


S = TypeVar("S", bound=Section)


def _backend_name(value: Any, *, empty: bool = False) -> str:
    """A compute backend's name: one of those ``core.registry`` discovers (the built-in ones and any installed)."""
    from pydantic_core import PydanticCustomError

    from core import registry

    choices = ([""] if empty else []) + list(registry.names(registry.BACKENDS))
    if value not in choices:
        expected = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}" if len(choices) > 1 else repr(choices[0])
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return str(value)


class MlflowConfig(Section):
    """Experiment tracking and the model registry."""

    tracking_uri: str = Field("", description="tracking and registry URI; empty: sqlite:///<PINFLOW_HOME>/mlflow/mlflow.db")
    artifact_root: str = Field("mlflow/artifacts", description="artifact location of new experiments (relative: under PINFLOW_HOME; empty: the tracking server's own, e.g. its proxied --artifacts-destination)")
    ui_url: str = Field("http://localhost:5000", description="where the MLflow UI runs (the 'MLflow run' link points here)")


# A memory size as DuckDB's memory_limit takes it and as a build job is sized by it (operators.features).
_MEMORY_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", re.IGNORECASE)
_UNIT_GB = {"KB": 1e-6, "MB": 1e-3, "GB": 1.0, "TB": 1e3, "KIB": 2**10 / 1e9, "MIB": 2**20 / 1e9, "GIB": 2**30 / 1e9,
            "TIB": 2**40 / 1e9}


def memory_size_gb(value: str) -> float:
    """A memory size (``4GB``, ``512MiB``) in GB; a ValueError saying what is expected if it is not one."""
    match = _MEMORY_SIZE.fullmatch(value)
    if not match:
        raise ValueError(f"{value!r} is not a memory size: give a number and a unit, e.g. 4GB, 512MB or 8GiB")
    return float(match.group(1)) * _UNIT_GB[match.group(2).upper()]


def _memory_size(value: Any) -> Any:
    """Checked here, so that a typo stops the configuration, not a job's first query."""
    if isinstance(value, str):
        memory_size_gb(value)
    return value


class FeaturesConfig(Section):
    """The daily feature build (DuckDB)."""

    window_days: int = Field(30, ge=1, le=365, description="length of the rolling window features")
    sequence_length: int = Field(50, ge=1, le=1000, description="last N engagements per user")
    pin_prior_impressions: float = Field(20.0, ge=0, description="strength of the prior of the smoothed pin rates")
    negative_downsample: float = Field(1.0, gt=0, le=1, description="keep this fraction of impressions without any label")
    negative_downsample_seed: int = Field(0, description="seed of the hash that picks the kept negatives")
    duckdb_threads: int = Field(2, ge=1, description="DuckDB threads per build step")
    duckdb_memory_limit: Annotated[str, BeforeValidator(_memory_size)] = Field(
        "4GB", description="beyond it DuckDB spills to disk instead of failing: a size (4GB, 512MB, 8GiB); a build job asks for 1.5 times it")
    duckdb_temp_directory: str = Field("", description="parent folder of spill files; empty: the system temporary folder")
    backend: Annotated[str, BeforeValidator(functools.partial(_backend_name, empty=True))] = Field(
        "", description="where a build step runs as a job (local: a process on this machine); empty: training.backend"
    )
    shards: int = Field(1, ge=1, le=10000, description="split each build job of a day into this many shards by user / pin id hash")
    event_buckets: int = Field(
        64, ge=1, le=1024,
        description="buckets of the day's events that validation writes when shards > 1 (a shard reads its buckets; keep shards a divisor)",
    )
    team: str = Field("", description="team whose queue build jobs use (a key of teams:); empty: training.team")
    instance_type: str = Field("m5.2xlarge", description="node type of a build job (a key of instance_types:)")
    poll_seconds: float = Field(2, gt=0, description="between status checks of a build job")
    timeout_seconds: int = Field(6 * 3600, gt=0, description="a build job running longer is cancelled (INFRA, retried)")


class ValidationConfig(Section):
    """The validation gate of raw partitions."""

    sensor_poke_seconds: float = Field(30, gt=0, description="seconds between checks for a raw partition")
    sensor_timeout_seconds: float = Field(21600, gt=0, description="a raw partition not landed this long after its run starts fails the run")
    min_referential_integrity: float = Field(0.999, ge=0, le=1, description="share of events whose pin / user is in that day's snapshot")
    history_days: int = Field(7, ge=1, description="trailing days a partition's profile is compared with")
    min_history_days: int = Field(3, ge=1, description="fewer validated trailing days: history checks pass with a warning")
    volume_min_ratio: float = Field(0.5, ge=0, le=1, description="rows must lie in [min, max] x the trailing median")
    volume_max_ratio: float = Field(2.0, ge=1, description="rows must lie in [min, max] x the trailing median")
    action_mix_max_psi: float = Field(0.1, gt=0, description="population stability index of the action mix vs the trailing days")
    null_rate_max_increase: float = Field(0.01, ge=0, description="a column's null rate may exceed its trailing median by this much")
    quarantine: bool = Field(True, description="move a failed partition to quarantine/<dataset>/ds=.../<time>/")
    on_window_gap: Literal["fail", "proceed"] = Field("proceed", description="a quarantined or missing day in the window")
    data_docs: bool = Field(True, description="render the GX Data Docs HTML beside each report")
    history_baseline: Literal["days", "weekday", "both"] = Field(
        "both", description="compare with the trailing days, the same weekday of the trailing weeks, or either"
    )
    weekday_weeks: int = Field(4, ge=1, le=52, description="trailing weeks of the same weekday the weekday baseline uses")
    holidays: list[str] = Field(
        default_factory=list, description="days (YYYY-MM-DD) whose history checks only warn: holidays, known events"
    )
    embedding_dim: int = Field(32, ge=1, description="width of a pin's embedding in raw/pins")
    surfaces: list[str] = Field(
        default_factory=lambda: ["home_feed", "search", "related_pins"],
        description="the surfaces an event may come from (empty: any)",
    )
    engagement_lookback_minutes: float = Field(
        60, ge=0, description="an engagement may link to an impression of the previous day this close to midnight"
    )
    severity: dict[str, dict[str, Literal["fail", "warn", "off"]]] = Field(
        default_factory=dict,
        description="per dataset (or '*' for all): check name (or 'prefix.*') -> fail | warn | off; "
        "a warn-level check that fails is reported and does not quarantine",
    )
    per_dataset: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per dataset: thresholds of this section that differ for it"
    )

    @model_validator(mode="after")
    def _history(self) -> ValidationConfig:
        if self.min_history_days > self.history_days:
            raise ValueError(f"min_history_days={self.min_history_days} must be at most history_days={self.history_days}")
        for day in self.holidays:
            if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(day)):  # compared as text with partition days
                raise ValueError(f"holidays: {day!r} is not a date YYYY-MM-DD")
            try:
                dt.date.fromisoformat(day)
            except ValueError:
                raise ValueError(f"holidays: {day!r} is not a date YYYY-MM-DD") from None
        for dataset, overrides in self.per_dataset.items():
            if "per_dataset" in overrides:
                raise ValueError(f"per_dataset.{dataset} cannot itself hold per_dataset")
            self.for_dataset(dataset)  # every override is a known key with a valid value
        return self

    def for_dataset(self, dataset: str) -> ValidationConfig:
        """This section with the ``per_dataset`` thresholds of ``dataset`` applied (unknown keys are errors)."""
        overrides = self.per_dataset.get(dataset)
        if not overrides:
            return self
        try:
            return ValidationConfig.model_validate({**self.model_dump(), **overrides, "per_dataset": {}})
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors())
            raise ValueError(f"per_dataset.{dataset}: {problems}") from None

    def severity_of(self, dataset: str, check: str, ds: str) -> Literal["fail", "warn", "off"]:
        """How much a failure of ``check`` on ``dataset`` counts: exact names beat ``prefix.*``, the dataset
        beats ``*``; on a holiday the history checks only warn."""
        level: Literal["fail", "warn", "off"] = "fail"
        for scope in ("*", dataset):
            rules = self.severity.get(scope, {})
            for pattern in sorted(rules, key=lambda p: (not p.endswith(".*"), len(p))):
                if pattern == check or (pattern.endswith(".*") and check.startswith(pattern[:-1])):
                    level = rules[pattern]
        if ds in self.holidays and check.startswith("history.") and level == "fail":
            return "warn"
        return level


class TrainingConfig(Section):
    """Training runs: the defaults of the training DAG's form and of every job."""

    backend: Annotated[str, BeforeValidator(_backend_name)] = Field("local", description="where training and scoring jobs run")
    model: str = Field("pin_ranker", description="the model family a scheduled training run trains (a key of families:)")
    team: str = Field("ranking", description="team whose queue, fair share and priority jobs use (a key of teams:)")
    nodes: int = Field(1, ge=1, le=64, description="nodes of a training job")
    procs_per_node: int = Field(2, ge=1, le=8, description="worker processes per node")
    train_days: int = Field(7, ge=1, le=30, description="days of examples before the evaluation day to train on")
    epochs: int = Field(1, ge=1, le=100, description="passes over the training days")
    max_steps: int = Field(0, ge=0, description="stop after this many optimizer steps in total; 0: no cap")
    target_examples: int = Field(
        0, ge=0, description="train until this many examples were seen (as many epochs as that takes, up to 100); 0: by epochs"
    )
    min_steps: int = Field(
        100, ge=0, description="the fewest optimizer steps of a run: a run by epochs takes more passes until it has "
        "this many (up to 100); a run with fewer (a max_steps cap, a short target_examples) warns and is not promoted"
    )
    batch_size: int = Field(512, ge=8, le=65536, description="examples per rank per step")
    lr: float = Field(0.003, gt=0, le=1, description="peak learning rate (AdamW, warmup then cosine)")
    strategy: Literal["ddp", "torchrec", "fsdp"] = Field(
        "ddp", description="ddp: replicated model; torchrec: embedding tables sharded model-parallel by TorchRec, the "
        "rest under DDP; fsdp (a fallback): FSDP2 per table"
    )
    sharding: Literal["row_wise", "table_wise", "column_wise"] = Field(
        "row_wise", description="strategy torchrec: how the tables are split over the ranks (row_wise: a table larger "
        "than one rank's memory trains)"
    )
    sharded_export_above_mib: float = Field(
        1024, ge=0, description="strategy torchrec: tables larger than this (MiB, all of them together) are exported "
        "sharded (row-range files and a manifest; scorers read only their rows) instead of gathered into one "
        "process; 0: always sharded"
    )
    promotion_tolerance: float = Field(0.002, ge=0, le=0.1, description="how much worse than the champion's mean AUC a new model may be and still be promoted")
    heartbeat_timeout_seconds: float = Field(300, gt=0, description="no heartbeat progress this long: cancel the job as INFRA (retried)")
    poll_seconds: float = Field(10, gt=0, description="between job status checks of the operator and its trigger")
    gpus_per_node: int | None = Field(None, ge=0, description="GPUs per node; empty: all of the instance type's")
    image: str = Field("", description="container image of training and scoring jobs; empty: the instance type's (images:)")
    instance_type: str = Field("m5.2xlarge", description="node type of jobs whose team names none (a key of instance_types:)")
    queue_timeout_seconds: float = Field(
        86400, ge=0, description="a job queued (not yet running) this long is cancelled as INFRA (retried); 0: no limit"
    )
    preflight: bool = Field(True, description="run the nodes' health check (training.preflight) before training")
    num_workers: int | None = Field(
        None, ge=0, le=64, description="input worker processes per training process (input_engine local); empty: "
        "derived from the node: on a GPU node its vCPUs per process less the trainer's threads and one (at most 16), "
        "on a CPU node a quarter of them (the local backend: this machine's CPUs); more than the node's CPUs is refused"
    )
    num_threads: int | None = Field(
        None, ge=1, le=256, description="torch threads per training process; empty: derived with num_workers (2 on a "
        "GPU node, the CPUs the workers leave on a CPU node)"
    )
    prefetch_factor: int = Field(
        4, ge=1, le=64, description="items (of 8192 rows, training.data.ITEM_ROWS) each input worker prepares ahead"
    )
    pin_memory: bool | None = Field(None, description="page-locked batches for faster copies to the GPU; empty: on CUDA")
    input_engine: Literal["local", "ray"] = Field(
        "local", description="local: each process reads its input with its own worker processes (DataLoader); ray: "
        "a Ray Data pipeline on the cluster's CPU workers builds the batches (RAY_ADDRESS, else a node-local cluster)"
    )
    data_bound_share: float = Field(
        0.2, gt=0, lt=1, description="a job whose processes wait for input this share of their step time or more is "
        "data-bound: said in the task log, the progress tab, result.json and the job history, with what to change"
    )
    ray_cpus: int = Field(0, ge=0, description="input_engine ray: CPUs of the node-local Ray cluster a job starts when "
                          "RAY_ADDRESS names none; 0: the node's")
    ray_task_cpus: float = Field(1.0, gt=0, description="input_engine ray: CPUs one read-and-encode task reserves")
    quota_poll_seconds: float = Field(30, gt=0, description="between checks of the team's quota while a job waits for room")


class PromotionConfig(Section):
    """The promotion gate (``services.promotion``): the floors a trained model must clear before it can become its
    family's champion, whether or not the family has one yet. The comparison with the champion (on the same day)
    and its tolerance are ``training.promotion_tolerance`` (the training form's ``promotion_tolerance``)."""

    min_lift_over_chance: float = Field(
        0.01, ge=0, le=0.5, description="every head's AUC on the evaluation day must be at least 0.5 + this"
    )
    min_lift_over_baseline: float = Field(
        0.0, ge=0, le=0.5, description="every head with a baseline on the evaluation day (the ranker's popularity) "
        "must beat the baseline's AUC by at least this"
    )
    approval_timeout_h: float = Field(
        24.0, gt=0, le=24 * 30, description="a family with promotion: approval waits this many hours for a person's "
        "answer (the training form's approval_timeout_h); no answer leaves the champion as it is"
    )


class FamilyConfig(Section):
    """A model family (training.sdk): where it is defined, its MLflow names and its training defaults.

    ``epochs``, ``batch_size`` and ``lr`` left empty take the ``training:`` section's; ``params`` are the
    family's hyperparameters (checked by the family's own ``Params``).
    """

    module: str = Field("", description="Python module defining the family (empty: the built-in one of that name)")
    experiment: str = Field("", description="MLflow experiment (empty: the family's name)")
    model_name: str = Field("", description="registered model name (empty: the family's name)")
    epochs: int | None = Field(None, ge=1, le=100)
    batch_size: int | None = Field(None, ge=8, le=65536)
    lr: float | None = Field(None, gt=0, le=1)
    params: dict[str, Any] = Field(default_factory=dict, description="the family's hyperparameters")
    promotion: Literal["auto", "approval"] = Field(
        "auto", description="auto: a model that passes the promotion gate becomes champion at once; approval: it "
        "waits for a person to approve it on Airflow's Required Actions page (promotion.approval_timeout_h)"
    )


# The families that ship with the platform (training/models/), always configured; families: may override them.
BUILTIN_FAMILIES: dict[str, FamilyConfig] = {
    "pin_ranker": FamilyConfig(),
    # A small encoder over ~1,000 reviewed pins a day: a few passes at a smaller batch.
    "pin_content": FamilyConfig(epochs=5, batch_size=256, lr=0.003),
}


class InferenceConfig(Section):
    """Corpus inference: how the corpus is cut into shards and scored (operators.inference, training.inference)."""

    shards: int | None = Field(None, ge=1, le=10000, description="a fixed shard count (the inference DAG's form default); empty: sized by the work")
    instance_type: str = Field("m5.2xlarge", description="node type of a scoring job (a key of instance_types:)")
    engine: Literal["processes", "ray"] = Field("processes", description="processes: one scoring process per shard (an array job); ray: one Ray Data job, readers on CPU workers and an actor pool scoring")
    target_shard_seconds: float = Field(600, gt=0, description="shards are sized to take about this long at the throughput measured by earlier runs")
    assumed_pins_per_s: float = Field(2000, gt=0, description="pins/s of one scoring process while no earlier run of the model measured it")
    min_pins_per_shard: int = Field(10000, ge=1, description="shards are not cut smaller than this to reach the parallelism")
    max_shards: int = Field(1000, ge=1, le=10000, description="the most shards the planner makes (an AWS Batch array has at most 10,000 children)")
    parallelism: int = Field(0, ge=0, description="shards scored at once (local processes; a Kubernetes Indexed Job's parallelism); 0: local, CPUs / threads; kubernetes, all")
    threads: int = Field(1, ge=1, le=256, description="torch threads of a scoring process (and of a Ray scoring actor)")
    batch_size: int = Field(4096, ge=1, le=1_000_000, description="pins per forward pass (part of the plan: scores depend on it)")
    poll_seconds: float = Field(10, gt=0, description="between status checks of a scoring job by the trigger")
    timeout_seconds: int = Field(21600, ge=60, description="a scoring job (each array child) running longer is stopped")
    ray_cpus: int = Field(0, ge=0, description="CPUs of the local Ray cluster a ray job starts when it has no cluster to join; 0: the node's")
    ray_actor_cpus: float = Field(1.0, gt=0, description="CPUs a Ray scoring actor reserves (a sharded model's "
                                  "plan: each shard's scoring task)")
    ray_reader_cpus: float = Field(0.5, gt=0, description="CPUs a Ray read-and-preprocess task reserves; the actor pool leaves room for one")
    ray_actors: int = Field(0, ge=0, description="scoring actors of the pool; 0: as many as fit beside one reader "
                            "(a sharded model's plan: scoring tasks at once; 0: as many as the cluster holds)")
    ray_workers: int = Field(2, ge=0, le=1000, description="worker pods of the KubeRay RayJob's cluster (besides the head)")
    ray_version: str = Field("2.60.0", description="rayVersion of the KubeRay RayJob (the image's Ray)")
    ray_temp_dir: str = Field("", description="Ray's temporary folder (sockets, logs, spilled objects); empty: <system temp>/pinflow-ray; never under the storage root")


class QuotaConfig(Section):
    """What a team's jobs may hold at once (submitted or running); empty: no limit.

    The training operator checks it before submitting and defers until there is room (``operators.quotas``);
    ``jobs`` is also the slots of the team's Airflow pool (``python -m operators.quotas sync-pools``).
    """

    jobs: int | None = Field(None, ge=1, description="concurrent jobs (also the team pool's slots)")
    nodes: int | None = Field(None, ge=1, description="nodes of all its jobs together")
    gpus: int | None = Field(None, ge=0, description="GPUs of all its jobs together (nodes x the instance type's GPUs)")


class HpoConfig(Section):
    """Hyperparameter searches (the pinflow_hpo DAG): Optuna studies whose trials are training jobs."""

    storage_url: str = Field("", description="Optuna RDB storage (e.g. postgresql+psycopg2://user:pw@host/optuna); empty: sqlite:///<PINFLOW_HOME>/hpo/optuna.db")
    # The form's defaults are a study one click may start on a laptop: 4 trials of 3 days, at most 2 h of rounds.
    n_trials: int = Field(4, ge=1, le=1000, description="trials of a study (the form's default)")
    train_days: int = Field(3, ge=1, le=30, description="days before the evaluation day every trial trains on (the form's default)")
    parallel_trials: int = Field(2, ge=1, le=64, description="trials trained at once, one round (the form's default)")
    max_rounds: int = Field(10, ge=1, le=100, description="rounds of ask, train, tell in the DAG (read when it is parsed): a study runs at most max_rounds x parallel_trials trials")
    time_budget_minutes: float = Field(120, ge=0, description="no new round starts once the study's rounds took this long (the form's default); 0: no limit")
    metric: str = Field("mean_auc", description="the evaluation metric a study optimises (the form's default)")
    direction: Literal["maximize", "minimize"] = Field("maximize", description="of the metric (the form's default)")
    tpe_startup_trials: int = Field(10, ge=0, description="random trials before TPE models the space (Optuna's n_startup_trials)")
    pruner: Literal["median", "none"] = Field("median", description="median: stop a trial whose best intermediate value is worse than the median of completed trials at the same step")
    prune_metric: str = Field("train_loss", description="the per-step MLflow metric of a trial (lower is better) its pruning compares")
    prune_startup_trials: int = Field(2, ge=0, description="completed trials before any trial is pruned")
    prune_warmup_steps: int = Field(100, ge=0, description="steps a trial runs before it may be pruned (the first steps' losses are alike and noisy)")
    report_every_steps: int = Field(10, ge=1, description="a trial logs prune_metric every this many steps (its log_every): the steps at which trials are compared")


class TeamConfig(Section):
    """A team: its AWS Batch job queue and Kueue LocalQueue, Batch fair-share id and priority, pod PriorityClass,
    default instance type and quota."""

    queue: str
    share: str
    priority: int = Field(50, ge=0, le=9999)
    priority_class: str = ""
    instance_type: str = Field("", description="the team's node type (a key of instance_types:); empty: training.instance_type")
    scheduling: Literal["auto", "fair_share", "fifo"] = Field(
        "auto", description="its Batch queue's policy; auto: read with describe_job_queues (schedulingPolicyArn)"
    )
    quota: QuotaConfig = QuotaConfig()
    capacity: Literal["on_demand", "spot"] = Field("on_demand", description="what its jobs run on: priced at costs.prices' on_demand or spot")


class PriceConfig(Section):
    """What one node of an instance type costs per hour."""

    on_demand: float = Field(..., ge=0, description="per node-hour, on-demand")
    spot: float | None = Field(None, ge=0, description="per node-hour on Spot capacity; empty: the on-demand price")


LOCAL_MACHINE = "this machine"  # the instance type the job history records for a job of the local backend (priced at costs.local_per_hour)


class CostsConfig(Section):
    """Prices of the instance types, for the cost of each job (job history, its export, the Platform page, the
    promotion note and the HPO summary). A job costs its nodes x its hours x its instance type's price (its team's
    capacity: on-demand or Spot); a job of the local backend costs local_per_hour."""

    currency: str = Field("USD", min_length=1, max_length=8, description="of every price (ISO 4217 code)")
    prices: dict[str, PriceConfig] = Field(default_factory=dict, description="instance type (a key of instance_types:) -> price per node-hour")
    local_per_hour: float = Field(0.0, ge=0, description="a job of the local backend (this machine) per hour")


class JobHistoryConfig(Section):
    """The job history database (``services.job_history``): one row per job, written at each transition."""

    url: str = Field("", description="SQLAlchemy URL (postgresql+psycopg2://... in production); empty: sqlite:///<PINFLOW_HOME>/jobdata/job_history.db")
    orphan_after_s: float = Field(
        900.0, ge=0, description="a job still running that no task (operator or trigger) has looked at for this long "
        "is orphaned (its task was killed with no retry left, or its runner died): cancelled and its row ended; 0: never")
    lease_s: float = Field(
        300.0, ge=0, description="a training job checks its lease (core.lease: renewed by the task that watches it) "
        "before it registers its model: not renewed for this long, its task is gone, so it registers nothing and "
        "exits as INFRA; 0: not checked")


class InstanceTypeConfig(Section):
    """A named node type, as torchx's named resources: what one node of a job has (requests derive from it)."""

    gpus: int = Field(0, ge=0)
    vcpus: int = Field(..., ge=1)
    memory_gib: float = Field(..., gt=0, description="nominal memory of the instance")
    efa: int = Field(0, ge=0, description="EFA interfaces (vpc.amazonaws.com/efa, /dev/infiniband/uverbsN)")
    efa_rdma: bool = Field(False, description="GPUDirect RDMA over EFA (p4d, p5): FI_EFA_USE_DEVICE_RDMA=1")
    image: str = Field("", description="container image on this type; empty: images.gpu or images.cpu")


class ImagesConfig(Section):
    """Container images of jobs (deploy/training.Dockerfile, deploy/training-cpu.Dockerfile)."""

    gpu: str = Field("pinflow-training:latest", description="GPU image: an AWS PyTorch DLC with EFA and aws-ofi-nccl")
    cpu: str = Field("pinflow-training-cpu:latest", description="CPU image (CPU instance types, tests)")


class ResourcesConfig(Section):
    """How a node's requests and limits derive from its instance type."""

    memory_tax: float = Field(
        0.96, gt=0, le=1, description="share of nominal memory a container can get (OS, ECS agent, kubelet take the rest)"
    )
    request_fraction: float = Field(
        0.95, gt=0, le=1, description="Kubernetes cpu/memory requests = limits x this, so a whole-node pod fits beside DaemonSets"
    )
    shm_fraction: float = Field(0.25, gt=0, lt=1, description="/dev/shm is at most this share of the memory limit")
    shm_max_gib: float = Field(48, gt=0, description="/dev/shm cap (AWS's p5 Batch reference: 48 GiB)")
    hugepages_2mi_mib: int = Field(5120, ge=0, description="hugepages-2Mi of a pod with EFA (AWS's EKS examples)")


def _default_instance_types() -> dict[str, InstanceTypeConfig]:
    # As torchx's named_resources_aws (vCPUs, GPUs, nominal memory, EFA interfaces).
    return {
        "p5.48xlarge": InstanceTypeConfig(gpus=8, vcpus=192, memory_gib=2048, efa=32, efa_rdma=True),
        "p4d.24xlarge": InstanceTypeConfig(gpus=8, vcpus=96, memory_gib=1152, efa=4, efa_rdma=True),
        "g5.12xlarge": InstanceTypeConfig(gpus=4, vcpus=48, memory_gib=192, efa=1),
        "m5.2xlarge": InstanceTypeConfig(vcpus=8, memory_gib=32),  # CPU: tests, scoring
    }


class BatchConfig(Section):
    """AWS Batch multi-node parallel jobs (backend: batch)."""

    aws_conn_id: str = Field("aws_default", description="Airflow connection; endpoint_url in its extra points at a test server")
    region_name: str | None = Field("us-east-1", description="AWS region of the Batch queues")
    job_role_arn: str = Field("", description="IAM role of the containers (S3 access to the storage root)")
    log_group: str = Field("/aws/batch/job", description="CloudWatch log group of the awslogs driver")
    checkpoint_key_secret: str = Field(
        "", description="ARN of the Secrets Manager secret (or SSM parameter) holding the checkpoint signing key, given "
        "to jobs as PINFLOW_CHECKPOINT_KEY; empty: checkpoints are not signed")
    rdzv_port: int = Field(29400, ge=1, le=65535, description="c10d rendezvous port on the main node")
    nccl_socket_ifname: str = Field("^lo,docker,ecs", description="NCCL_SOCKET_IFNAME (AWS's Batch reference)")
    attempts: int = Field(3, ge=1, le=10, description="Batch-level attempts, for host and Spot loss only")


class KubernetesConfig(Section):
    """Kubeflow Trainer v2 TrainJobs (or v1 PyTorchJobs) queued by Kueue (backend: kubernetes)."""

    conn_id: str = Field("kubernetes_default", description="Airflow connection of the cluster")
    namespace: str = Field("pinflow", description="namespace of the jobs")
    api: Literal["trainjob", "pytorchjob"] = Field(
        "trainjob", description="trainjob: Kubeflow Trainer v2 (deploy/kubernetes/); pytorchjob: training-operator v1"
    )
    runtime: str = Field("pinflow-torch", description="the ClusterTrainingRuntime of TrainJobs (deploy/kubernetes/)")
    service_account: str = Field("", description="service account of the pods (S3 access through IRSA)")
    checkpoint_key_secret: str = Field(
        "", pattern=r"^$|^[a-z0-9.-]+/[A-Za-z0-9._-]+$", description="<secret name>/<key> of the Kubernetes Secret "
        "holding the checkpoint signing key, given to pods as PINFLOW_CHECKPOINT_KEY; empty: checkpoints are not signed")
    rdzv_port: int = Field(29400, ge=1, le=65535, description="the master's pytorchjob-port (api: pytorchjob)")
    nccl_socket_ifname: str = Field("^lo", description="NCCL_SOCKET_IFNAME (AWS's EKS examples)")
    ttl_seconds_after_finished: int = Field(86400, ge=0, description="how long a finished job is kept")
    console_url: str = Field(
        "https://kubernetes-dashboard/#/customresourcedefinition/{plural}.{group}/{namespace}/{name}",
        description="a dashboard URL with {namespace}, {name} (and {plural}, {group} of the job's API)",
    )


class DeadlinesConfig(Section):
    """Deadlines on the daily chain (``operators.deadlines``, Airflow's deadline alerts): a run not done in time is
    recorded with how late it is (the Platform page) and told to ``notifier``. Backfills have none."""

    features_built_h: float = Field(
        30.0, ge=0, le=24 * 30, description="pin_daily_features: a day's features built within this many hours of the "
        "day's start (the run's logical date): 30 is 06:00 UTC the next morning; 0: no deadline"
    )
    champion_decision_h: float = Field(
        4.0, ge=0, le=24 * 30, description="pin_ranker_training: a run's promotion decided (its approval too) within "
        "this many hours of the run being queued; 0: no deadline"
    )
    notifier: str = Field(
        "", pattern=r"^$|^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="an Airflow notifier class told of each missed deadline (dotted path; it needs async_notify, "
        "as the Slack, SMTP and Amazon SNS providers' notifiers have: it runs in the triggerer), e.g. "
        "airflow.providers.slack.notifications.slack_webhook.SlackWebhookNotifier; empty: logged and shown on the "
        "Platform page only"
    )
    notifier_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="the notifier's arguments (its connection id, channel, text; templated with "
        "the context: dag_run, deadline, pinflow_deadline). No secrets here: they live in Airflow connections"
    )


class DemoConfig(Section):
    """The synthetic world of ``make demo``."""

    start: str = Field("2026-11-01", pattern=r"^\d{4}-\d{2}-\d{2}$", description="first day of the world")
    days: int = Field(20, ge=2, description="days of synthetic logs")
    users: int = Field(300, ge=1)
    impressions_per_user: int = Field(100, ge=1, description="mean impressions of an active user per day")
    pins: int = Field(3000, ge=1)
    train_days: int = Field(19, ge=1, description="days trained on, the ones before the last (evaluation) day")
    seed: int = 7

    @model_validator(mode="after")
    def _train_days(self) -> DemoConfig:
        if self.train_days > self.days - 1:
            raise ValueError(f"train_days={self.train_days} must be at most days - 1 = {self.days - 1}")
        return self


class PlatformConfig(Section):
    """The whole platform configuration. ``home`` is PINFLOW_HOME, not a key of the file."""

    storage_root: str = Field("storage", description="local path, file:// URL or s3://bucket/prefix (relative: under PINFLOW_HOME)")
    mlflow: MlflowConfig = MlflowConfig()
    features: FeaturesConfig = FeaturesConfig()
    validation: ValidationConfig = ValidationConfig()
    training: TrainingConfig = TrainingConfig()
    promotion: PromotionConfig = PromotionConfig()
    inference: InferenceConfig = InferenceConfig()
    hpo: HpoConfig = HpoConfig()
    families: dict[str, FamilyConfig] = Field(
        default_factory=dict, description="model families besides (or overriding) the built-in ones"
    )
    teams: dict[str, TeamConfig] = Field(
        default_factory=lambda: {"ranking": TeamConfig(queue="ranking", share="ranking", priority=50,
                                                       priority_class="pinflow-ranking")},
    )
    instance_types: dict[str, InstanceTypeConfig] = Field(default_factory=_default_instance_types)
    job_history: JobHistoryConfig = JobHistoryConfig()
    costs: CostsConfig = CostsConfig()
    deadlines: DeadlinesConfig = DeadlinesConfig()
    images: ImagesConfig = ImagesConfig()
    resources: ResourcesConfig = ResourcesConfig()
    batch: BatchConfig = BatchConfig()
    kubernetes: KubernetesConfig = KubernetesConfig()
    demo: DemoConfig = DemoConfig()
    home: str = Field("", exclude=True)

    @field_validator("families", mode="after")
    @classmethod
    def _with_builtin_families(cls, families: dict[str, FamilyConfig]) -> dict[str, FamilyConfig]:
        return {**BUILTIN_FAMILIES, **families}

    @model_validator(mode="after")
    def _team(self) -> PlatformConfig:
        if self.training.model not in self.families:
            raise ValueError(
                f"training.model={self.training.model!r} is not under families: (known: {', '.join(sorted(self.families))})"
            )
        for key, team in (("training.team", self.training.team), ("features.team", self.features.team)):
            if (team or key == "training.team") and team not in self.teams:
                raise ValueError(f"{key}={team!r} is not under teams: (known: {', '.join(sorted(self.teams))})")
        return self

    @model_validator(mode="after")
    def _lease(self) -> PlatformConfig:
        # The watcher renews the lease once per status check: a lease shorter than a few checks would expire under it.
        if self.job_history.lease_s and self.job_history.lease_s < 3 * self.training.poll_seconds:
            raise ValueError(f"job_history.lease_s={self.job_history.lease_s:g} must be at least 3 x training.poll_seconds "
                             f"({3 * self.training.poll_seconds:g} s), or 0 (not checked)")
        return self

    @model_validator(mode="after")
    def _instance_types(self) -> PlatformConfig:
        named = [("training.instance_type", self.training.instance_type),
                 ("inference.instance_type", self.inference.instance_type),
                 ("features.instance_type", self.features.instance_type)] + [
            (f"teams.{name}.instance_type", team.instance_type) for name, team in self.teams.items() if team.instance_type
        ]
        for key, value in named:
            if value not in self.instance_types:
                raise ValueError(
                    f"{key}={value!r} is not under instance_types: (known: {', '.join(sorted(self.instance_types))})"
                )
        unknown = sorted(set(self.costs.prices) - set(self.instance_types))
        if unknown:
            raise ValueError(f"costs.prices names instance type(s) {', '.join(unknown)} not under instance_types: (known: "
                             f"{', '.join(sorted(self.instance_types))}): fix the name or add the type")
        return self


def pinflow_home() -> Path:
    """Where the embedded default writes everything (``PINFLOW_HOME``, default: ``.pinflow/`` of the clone)."""
    return Path(os.environ.get("PINFLOW_HOME") or REPO_ROOT / ".pinflow").resolve()


def config_file() -> Path:
    named = os.environ.get("PINFLOW_CONFIG")
    if named and not Path(named).is_file():
        raise ConfigError(f"PINFLOW_CONFIG={named} names no file: give the path of a platform configuration (YAML), "
                          f"or unset it for {CONFIG_FILE}")
    return Path(named or CONFIG_FILE)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one, silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {seen[key].start_mark.line + 1} and line "
                    f"{key_node.start_mark.line + 1}): keep one", key_node.start_mark)
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


# --- reading ------------------------------------------------------------------------------------------------


def _read_file(path: Path) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader) if path.exists() else {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(data).__name__}")
    return data


def _overlay_env(data: dict[str, Any], environ: dict[str, str], sources: dict[tuple[str, ...], str]) -> None:
    """Apply ``PINFLOW_*`` overrides to ``data`` in place; ``sources`` records which variable set which key."""
    top_level = {name for name, f in PlatformConfig.model_fields.items() if not f.exclude}
    for name, raw in sorted(environ.items()):
        if name.upper().startswith(ENV_PREFIX) and not name.startswith(ENV_PREFIX):
            raise ConfigError(f"environment variable {name}: pinflow's variables are upper case ({name.upper()})")
        if not name.startswith(ENV_PREFIX) or name in RUNTIME_VARIABLES:
            continue
        path = tuple(name[len(ENV_PREFIX):].lower().split("__"))
        if len(path) == 1 and path[0] not in top_level:
            raise ConfigError(f"environment variable {name} is not a setting{_env_hint(path[0], top_level)} (settings: "
                              "PINFLOW_<SECTION>__<KEY> with two underscores, or PINFLOW_<TOP_LEVEL_KEY>; runtime "
                              f"variables: {', '.join(sorted(RUNTIME_VARIABLES))})")
        try:
            value = yaml.safe_load(raw) if raw else raw
        except yaml.YAMLError:
            value = raw
        node = data
        for key in path[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {'.'.join(path[:-1])} is not a section of the platform configuration")
            node = child
        node[path[-1]] = value
        sources[path] = f"environment variable {name}"


def _env_hint(name: str, top_level: set[str]) -> str:
    """``(did you mean PINFLOW_...?)`` for a one-part variable name: a section and key joined by one underscore,
    or a top-level key misspelt."""
    for section in sorted(top_level, key=len, reverse=True):
        if name.startswith(f"{section}_") and name[len(section) + 1:]:
            key = name[len(section) + 1:]
            fields = _known_keys(PlatformConfig, (section,))
            close = difflib.get_close_matches(key, fields, n=1) if fields else [key]
            if close:
                return f" (did you mean {ENV_PREFIX}{section.upper()}__{close[0].upper()}?)"
    close = difflib.get_close_matches(name, sorted(top_level), n=1)
    return f" (did you mean {ENV_PREFIX}{close[0].upper()}?)" if close else ""


def _known_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at ``loc`` (for a 'did you mean' hint)."""
    current: Any = model
    for part in loc:
        if isinstance(current, type) and issubclass(current, BaseModel) and part in current.model_fields:
            annotation = current.model_fields[part].annotation
            current = annotation
        elif getattr(current, "__origin__", None) is dict:
            current = current.__args__[1]
        else:
            return []
    return list(current.model_fields) if isinstance(current, type) and issubclass(current, BaseModel) else []


def _describe(err: ValidationError, file: Path, sources: dict[tuple[str, ...], str]) -> str:
    lines = []
    for problem in err.errors():
        loc = tuple(str(p) for p in problem["loc"])
        key = ".".join(loc) or "(top level)"
        # The variable that set this key or a section above it (a nested value set whole), else one that set a key
        # under it (a misspelt section it created, a section-wide check), else the file.
        source = next((sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), None) or next(
            (name for path, name in sources.items() if path[:len(loc)] == loc), str(file))
        if problem["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], _known_keys(PlatformConfig, loc[:-1]), n=1)
            hint = f" (did you mean {'.'.join((*loc[:-1], close[0]))!r}?)" if close else ""
            lines.append(f"{key}: unknown key in {source}{hint}")
        else:
            given = problem.get("input")
            hint = (" (YAML reads an unquoted yes, no, on or off as true or false: quote it, e.g. 'off')"
                    if isinstance(given, bool) and problem["type"].startswith(("string", "literal", "enum")) else "")
            lines.append(f"{key} = {given!r} in {source}: {problem['msg']}{hint}")
    return "invalid platform configuration:\n  " + "\n  ".join(lines) + (
        f"\n(keys, defaults and help: python -m core.config; file: {file})"
    )


def read(file: Path | None = None, environ: dict[str, str] | None = None, home: Path | None = None) -> PlatformConfig:
    """Read and validate the configuration (no cache): the file, then the environment; paths resolved."""
    file = file or config_file()
    environ = dict(os.environ if environ is None else environ)
    home = home or pinflow_home()
    data = _read_file(file)
    sources: dict[tuple[str, ...], str] = {}
    _overlay_env(data, environ, sources)
    try:
        config = PlatformConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, file, sources)) from None

    def resolve(value: str) -> str:
        return value if "://" in value or Path(value).is_absolute() else str(home / value)

    history_url = config.job_history.url or f"sqlite:///{home / 'jobdata' / 'job_history.db'}"
    mlflow = config.mlflow.model_copy(update={
        "artifact_root": resolve(config.mlflow.artifact_root) if config.mlflow.artifact_root else "",
        "tracking_uri": config.mlflow.tracking_uri or f"sqlite:///{home / 'mlflow' / 'mlflow.db'}",
    })
    return config.model_copy(update={"home": str(home), "storage_root": resolve(config.storage_root), "mlflow": mlflow,
                                     "job_history": config.job_history.model_copy(update={"url": history_url})})


class _Loaded:
    """``load()``: the platform configuration, read again when its file or the PINFLOW_ environment changes, so
    a long-lived process (the API server's pages, the triggerer) sees an edit at its next call as a new task does
    (a stat of the file per call). ``load.cache_clear()`` forgets it."""

    def __init__(self) -> None:
        self._stamp: tuple[Any, ...] | None = None
        self._config: PlatformConfig | None = None

    def __call__(self) -> PlatformConfig:
        stamp = self._stamp_now()
        if self._config is not None and (stamp == self._stamp or stamp[2] == 0):
            return self._config  # unchanged; or emptied, as an editor does just before it writes
        try:
            config = read(config_file())
        except ConfigError as err:
            if self._config is None:
                raise
            # A long-lived process keeps the configuration it has while the file is mid-write or wrong (a new
            # task reads the same file and stops with the message): said once per version of the file.
            if stamp != self._stamp:
                log.warning("keeping the platform configuration read before: the new one is not valid: %s", err)
                self._stamp = stamp
            return self._config
        if self._stamp_now() == stamp:  # not changed while it was read (else: read again at the next call)
            self._stamp = stamp
        self._config = config
        return config

    @staticmethod
    def _stamp_now() -> tuple[Any, ...]:
        try:
            file = config_file()
            st = file.stat()
            stamp: tuple[Any, ...] = (str(file), st.st_mtime_ns, st.st_size)
        except (ConfigError, OSError):  # PINFLOW_CONFIG names no file (read() says so), or it is being replaced
            stamp = (os.environ.get("PINFLOW_CONFIG"), None, None)
        return stamp + tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PINFLOW")))

    def cache_clear(self) -> None:
        self._stamp = self._config = None


load = _Loaded()


def with_overrides(section: S, overrides: dict[str, Any], source: str) -> S:
    """``section`` with the non-None ``overrides`` (a trigger form's values), validated by the same model.

    A ConfigError names each bad key, its value, ``source`` (e.g. "the run's params") and what was expected.
    """
    changes = {k: v for k, v in overrides.items() if v is not None}
    if not changes:
        return section
    try:
        return type(section).model_validate({**section.model_dump(), **changes})
    except ValidationError as err:
        name = next((n for n, f in PlatformConfig.model_fields.items() if f.annotation is type(section)), "")
        problems = "; ".join(
            f"{'.'.join(p for p in (name, *(str(p) for p in e['loc'])) if p)} = {e.get('input')!r}: {e['msg']}"
            for e in err.errors()
        )
        raise ConfigError(f"{source}: {problems}") from None


def describe(config: PlatformConfig) -> str:
    """Every key with its effective value and help (what ``python -m core.config`` prints)."""
    lines = [f"# effective platform configuration (file: {config_file()}, PINFLOW_HOME: {config.home})"]
    for name, field in PlatformConfig.model_fields.items():
        if field.exclude:
            continue
        value = getattr(config, name)
        if isinstance(value, Section):
            lines.append(f"{name}:  # {(type(value).__doc__ or '').splitlines()[0]}")
            for key, sub in type(value).model_fields.items():
                lines.append(f"  {key}: {getattr(value, key)!r}  # {sub.description or ''}")
        elif isinstance(value, dict):
            lines.append(f"{name}:")
            for key, item in value.items():
                lines.append(f"  {key}: {item.model_dump()}")
        else:
            lines.append(f"{name}: {value!r}  # {field.description or ''}")
    return "\n".join(lines)


def main() -> int:
    try:
        print(describe(read()))
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
