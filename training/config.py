"""The configuration of one training run: ``RUN.json``, read once by the entry point and passed down.

The Airflow layer writes ``RUN.json`` (it is the only layer that reads platform config); everything under
``training/`` takes its settings from a :class:`RunConfig`. This module imports no torch, so the Airflow
layer can validate a RUN.json (``RunConfig.from_dict``) before it submits a job. Every field carries its help text in its
dataclass metadata, which is what ``python -m training.train --help`` prints.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from core.config import TrainingConfig
from core.failures import ConfigError
from core.storage import InputPins, Pin, parse_ds

if typing.TYPE_CHECKING:
    from training.sdk import ModelFamily

_REQUIRED = object()
T = typing.TypeVar("T")


# Defaults shared with the platform configuration are taken from its typed model: defined once, in core.config.
_TRAINING = TrainingConfig()


def _f(help: str, default: Any = _REQUIRED, factory: Any = None) -> Any:
    meta = {"help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    if default is _REQUIRED:
        return field(metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class RunConfig:
    """Settings of one training run (RUN.json). Required fields have no default."""

    # --- where things are -------------------------------------------------------------------------
    root: str = _f("storage root (local path, file:// or s3:// URL) holding the family's dataset, raw/pins/ and truth")
    train_days: list[str] = _f("days (YYYY-MM-DD) of the family's dataset to train on")
    eval_ds: str = _f("day (YYYY-MM-DD) of the family's dataset to evaluate on, after training")
    output_dir: str = _f("job folder: heartbeat-rank{r}.json, failure-rank{r}.json and result.json are written here")
    checkpoint_dir: str = _f(
        "checkpoints (torch.distributed.checkpoint) as step-XXXXXXXX/ folders; must be shared by all "
        "nodes; the newest complete one is resumed on start"
    )
    mlflow_tracking_uri: str = _f(
        "MLflow tracking (and registry) URI, e.g. sqlite:////abs/path/mlflow.db; empty: no tracking (MLflow is not "
        "imported; the serving module is exported to <output_dir>/model.pt2 and nothing is registered)"
    )
    mlflow_artifact_location: str | None = _f(
        "artifact location given to a newly created MLflow experiment (ignored if it exists)", None
    )
    family: str = _f("the model family (training.sdk): pin_ranker, pin_content or one under families:", _TRAINING.model)
    family_module: str = _f("Python module of the family (empty: the built-in family of that name)", "")
    params: dict[str, Any] = _f(
        "the family's hyperparameters (its Params dataclass; unknown keys are refused)", factory=dict
    )
    experiment: str = _f("MLflow experiment name (default: the family's name)", "")
    model_name: str = _f("registered model name in the MLflow model registry (default: the family's name)", "")
    tags: dict[str, str] = _f("MLflow run tags (dag, run, try, backend, job, team, family)", factory=dict)
    register: bool = _f("register the logged model as a new version of model_name", True)
    run_name: str | None = _f("MLflow run name (default: MLflow's generated name)", None)
    inputs: dict[str, dict[str, dict[str, Any]]] = _f(
        "the input partitions pinned when the run's first try was submitted (the training operator writes it): "
        "dataset -> day -> {version, location, source, marker, files} (core.storage.Pin). The job reads a pinned "
        "partition at its location: on a local root a hard-linked copy of the pinned version, which a rebuild of the "
        "partition does not change; on an object store the partition itself, and a read that finds another version "
        "fails as DATA. Empty: the live partitions are read", factory=dict,
    )
    # --- optimisation -----------------------------------------------------------------------------
    epochs: int = _f("passes over the training days", _TRAINING.epochs)
    batch_size: int = _f("examples per batch per rank (the global batch is batch_size x world size)", _TRAINING.batch_size)
    lr: float = _f("peak learning rate of AdamW (reached after warmup_steps)", _TRAINING.lr)
    weight_decay: float = _f("AdamW weight decay", 1e-5)
    warmup_steps: int = _f("linear warmup steps, then cosine decay to min_lr_ratio x lr", 20)
    min_lr_ratio: float = _f("final learning rate of the cosine schedule, as a fraction of lr", 0.1)
    grad_clip: float = _f("clip the global gradient norm to this value (0 = no clipping)", 1.0)
    seed: int = _f("seed of the model initialisation and of the data order (with the epoch)", 0)
    max_steps: int = _f("stop after this many optimizer steps in total (0 = no cap)", _TRAINING.max_steps)
    target_examples: int = _f(
        "train until this many examples (all ranks) were seen, taking as many epochs as needed up to 100; "
        "0 = train for `epochs`", _TRAINING.target_examples,
    )
    min_steps: int = _f(
        "the fewest optimizer steps of the run: training by epochs takes more passes (each in its own order, up to "
        "100 epochs) until it has this many; a run with fewer (max_steps, a short target_examples) warns in "
        "result.json and the promotion gate does not promote it", _TRAINING.min_steps,
    )
    train_days_requested: int = _f(
        "training days the run asked for; fewer in train_days (the run accepted fewer) are recorded in result.json "
        "and the promotion gate does not promote the model (0: len(train_days))", 0,
    )
    evaluate_champion: bool = _f(
        "rank 0 also evaluates the registered champion of model_name (the MLflow alias 'champion') on eval_ds, for "
        "the promotion gate's comparison on the same day (result.json 'champion')", True,
    )
    # --- data -------------------------------------------------------------------------------------
    num_workers: int = _f(
        "DataLoader worker processes per rank, input_engine local (0 = read in the training process); the training "
        "operator derives it from the node (training.num_workers)", 0
    )
    num_threads: int = _f("torch intra-op threads per rank (0 = torch's default)", 1)
    prefetch_factor: int = _f("batches each DataLoader worker prepares ahead (num_workers > 0)", _TRAINING.prefetch_factor)
    pin_memory: bool | None = _f("page-locked batches for faster copies to the GPU (null: on CUDA)", None)
    input_engine: Literal["local", "ray"] = _f(
        "local: each rank reads with its DataLoader workers; ray: a Ray Data pipeline on the cluster's CPU workers "
        "builds each rank's batches, the same batches in the same order as local with num_workers 0 "
        "(training.ray_input)", _TRAINING.input_engine,
    )
    data_bound_share: float = _f(
        "share of step time spent waiting for input from which the job is called data-bound (result.json input)",
        _TRAINING.data_bound_share,
    )
    ray_cpus: int = _f("input_engine ray: CPUs of the node-local Ray cluster (0: the node's)", _TRAINING.ray_cpus)
    ray_task_cpus: float = _f("input_engine ray: CPUs a read-and-encode task reserves", _TRAINING.ray_task_cpus)
    eval_batch_size: int = _f("batch size of the evaluation pass", 1024)
    # --- checkpoints, heartbeats, logging ---------------------------------------------------------
    checkpoint_every: int = _f(
        "save a checkpoint every this many steps, and at least ten times in a run (0 = only at the end)", 500)
    keep_checkpoints: int = _f("complete checkpoints to keep (older ones are deleted)", 2)
    heartbeat_every_s: float = _f("seconds between heartbeat files of each rank", 10.0)
    lease_s: float = _f(
        "before it registers its model, rank 0 checks the job's lease (<output_dir>/LEASE.json, renewed by the task "
        "watching the job; core.lease): not renewed for this long, the task is gone and the job exits as INFRA "
        "without registering (the training operator sets job_history.lease_s); 0, or no lease file: not checked", 0.0)
    log_every: int = _f("log the train loss to MLflow every this many steps", 10)
    dist_timeout_s: int = _f("timeout of collectives (gloo/NCCL), after which the job fails as INFRA", 1800)
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto: CUDA (nccl, bf16 autocast) when available, else CPU (gloo)", "auto"
    )
    strategy: Literal["ddp", "fsdp", "torchrec"] = _f(
        "ddp: DistributedDataParallel, every rank holds the whole model; torchrec: the family's sparse_features "
        "(embedding tables) sharded model-parallel by TorchRec (DistributedModelParallel: all-to-all lookups, a "
        "row-wise Adagrad fused into the backward pass), the rest under DDP; fsdp (a fallback): FSDP2 "
        "fully_shard per table, every step gathers each whole table and reduces a dense gradient of its size",
        _TRAINING.strategy,
    )
    sharding: Literal["table_wise", "column_wise", "row_wise"] = _f(
        "strategy torchrec: how the tables are split over the ranks. table_wise and column_wise are planned by "
        "TorchRec's planner (topology: the ranks, their device and embedding_memory_mb); row_wise (each rank a "
        "slice of every table's rows: a table larger than one rank's memory trains) is planned on CUDA and "
        "built by hand on CPU, where the planner does not offer it",
        "row_wise",
    )
    sparse_lr: float = _f(
        "strategy torchrec: peak learning rate of the tables' fused row-wise Adagrad (the LR schedule scales it "
        "as it scales lr)", 0.05,
    )
    embedding_memory_mb: float = _f(
        "strategy torchrec: memory per rank (MiB) the sharding plan may fill with tables and their optimizer "
        "state (0: TorchRec's default for the device); a plan that does not fit is a USER error", 0.0,
    )
    sharded_export_above_mib: float = _f(
        "strategy torchrec: tables larger than this (MiB, all of them together) are not gathered at the end: each "
        "rank exports its row ranges (training.sharded_export), which scoring reads; the training world evaluates "
        "the sharded model itself; 0: always",
        _TRAINING.sharded_export_above_mib,
    )
    deterministic: bool = _f(
        "torch.use_deterministic_algorithms: a resumed run is bitwise equal to an uninterrupted one (CPU)", False
    )
    # --- debugging --------------------------------------------------------------------------------
    debug_step_sleep_s: float = _f(
        "debug: sleep this long after every step (widens the window of the kill-and-resume test)", 0.0
    )
    fail_nan_at_step: int | None = _f(
        "debug: make the last rank's loss NaN at this step, to exercise the NaN path (exit code 76)", None
    )

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> RunConfig:
        """Read and validate RUN.json (a local path or a URL); raise ConfigError naming the offending key."""
        from core.storage import read_settings

        return cls.from_dict(read_settings(path, "run config"), source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run config") -> RunConfig:
        with _naming(source):
            return dataclass_from_dict(cls, data, source, hint="see `python -m training.train --help`")

    @classmethod
    def checked(cls, source: str, **values: Any) -> RunConfig:
        """A run's settings from keyword values (the training operator builds them so), checked as RUN.json is:
        a ConfigError names ``source`` and the field."""
        _known(cls, values, source)
        with _naming(source):
            return cls(**values)

    def replace(self, source: str, **changes: Any) -> RunConfig:
        """These settings with ``changes``, checked again (:meth:`checked`)."""
        _known(type(self), changes, source)
        with _naming(source):
            return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        # Construction validates: every value against its field's type (ints are taken for floats), then the ranges.
        hints = _run_hints()
        problems = []
        for f in dataclasses.fields(self):
            try:
                object.__setattr__(self, f.name, _check_type(f.name, getattr(self, f.name), hints[f.name]))
            except ConfigError as e:
                problems.append(str(e))
        if not problems:
            problems = self.problems()
        if problems:
            raise _Invalid(problems)

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write RUN.json (one atomic file, a local path or a URL): what the job reads with :meth:`from_json`."""
        from core.storage import write_json

        write_json(path, self.to_dict())

    def problems(self) -> list[str]:
        """What is wrong with these values (the platform's fields; the family's ``params`` are checked by the
        family's own Params, ``family_instance()``)."""
        problems = []
        if not self.train_days:
            problems.append("train_days is empty: give at least one day")
        dates = []
        for ds in [*self.train_days, self.eval_ds]:
            try:
                dates.append(parse_ds(ds))
            except ValueError as e:
                problems.append(str(e))
        if len(dates) == len(self.train_days) + 1:
            *train, evaluated = dates
            repeated = sorted({d for d in self.train_days if self.train_days.count(d) > 1})
            if repeated:
                problems.append(f"train_days repeats {', '.join(repeated)}: give each day once")
            late = sorted({ds for ds, day in zip(self.train_days, train, strict=True) if day >= evaluated})
            if late:
                problems.append(
                    f"train_days {', '.join(late)} not before eval_ds {self.eval_ds}: a model evaluated on a day it "
                    "trained on, or before its training days, looks better than it is (the promotion gate would "
                    "trust it); train on days before eval_ds")
        for name in "epochs batch_size eval_batch_size log_every keep_checkpoints dist_timeout_s prefetch_factor".split():
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        for name in ("max_steps target_examples min_steps checkpoint_every warmup_steps num_workers num_threads "
                     "train_days_requested").split():
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        for name in ("lr", "sparse_lr"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive (and finite)")
        for name in ("weight_decay", "grad_clip"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative (and finite)"
                                + (" (0 = no clipping)" if name == "grad_clip" else ""))
        if self.sharded_export_above_mib < 0:
            problems.append(f"sharded_export_above_mib={self.sharded_export_above_mib} must not be negative")
        if self.embedding_memory_mb < 0:
            problems.append(f"embedding_memory_mb={self.embedding_memory_mb} must not be negative")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0 < self.data_bound_share < 1:
            problems.append(f"data_bound_share={self.data_bound_share} must be in (0, 1)")
        if self.ray_cpus < 0 or self.ray_task_cpus <= 0:
            problems.append(f"ray_cpus={self.ray_cpus} must not be negative and ray_task_cpus={self.ray_task_cpus} "
                            "must be positive")
        if self.heartbeat_every_s <= 0:
            problems.append(f"heartbeat_every_s={self.heartbeat_every_s} must be positive")
        if self.lease_s < 0:
            problems.append(f"lease_s={self.lease_s} must not be negative")
        for dataset, days in self.inputs.items():
            for ds, entry in days.items():
                try:
                    Pin.from_dict(dataset, ds, entry)
                except ValueError as e:
                    problems.append(f"inputs: {e}")
        return problems

    # ----------------------------------------------------------------------------------------------
    @functools.cached_property
    def input_root(self) -> InputPins:
        """``root`` as this run reads it: its pinned ``inputs`` (:class:`core.storage.InputPins`). The job's code
        passes it to every reader of the run's inputs; a reader given the plain ``root`` reads the live partitions."""
        return InputPins.of(self.root, self.inputs)

    def input_versions(self) -> dict[str, dict[str, str]]:
        """The pinned version of each input partition: dataset -> day -> version."""
        return {dataset: {ds: str(entry["version"]) for ds, entry in sorted(days.items())}
                for dataset, days in sorted(self.inputs.items())}

    def family_instance(self) -> ModelFamily:
        """The run's model family with its params (a ConfigError names a bad one). Imports the family's module."""
        from training.sdk import load_family

        return load_family(self.family, self.family_module, self.params)

    @property
    def experiment_name(self) -> str:
        return self.experiment or self.family

    @property
    def registered_model(self) -> str:
        return self.model_name or self.family

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Invalid(ConfigError):
    """RunConfig's values are wrong (:meth:`RunConfig.__post_init__`); :func:`_naming` says where they came from."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("the run's settings are invalid: " + "; ".join(problems))
        self.problems = problems


@contextlib.contextmanager
def _naming(source: str) -> Iterator[None]:
    """Name ``source`` in a RunConfig's ConfigError (a USER error, like every ConfigError)."""
    try:
        yield
    except _Invalid as e:
        raise ConfigError(f"{source} is invalid: " + "; ".join(e.problems)) from None


def _known(cls: Any, data: dict[str, Any], source: str, hint: str = "") -> None:
    """ConfigError naming the keys of ``data`` that are not fields of the dataclass ``cls`` (with the closest one)."""
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in fields]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, fields, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}" + (f"; {hint}" if hint else ""))


@functools.cache
def _run_hints() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


def dataclass_from_dict(cls: type[T], data: dict[str, Any], source: str, hint: str = "") -> T:
    """An instance of the dataclass ``cls`` from a JSON object, every value checked against its field's type.

    Raises ConfigError naming unknown keys (with the closest known one), missing required keys and values of
    the wrong type.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    _known(cls, data, source, hint)
    missing = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data
    ]
    if missing:
        raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
    types_ = typing.get_type_hints(cls)
    values = {name: _check_type(f"{source}: {name}", value, types_[name]) for name, value in data.items()}
    for name in fields:  # tuples in a frozen dataclass arrive as JSON lists
        if name in values and typing.get_origin(types_[name]) is tuple and isinstance(values[name], list):
            values[name] = tuple(values[name])
    return cls(**values)


def _check_type(where: str, value: Any, hint: Any) -> Any:
    """Check a JSON value against a field's type; ints are accepted for floats. Returns the value."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                return _check_type(where, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{where}: {value!r} is not {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if hint is Any:
        return value
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_check_type(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {value!r}")
        return {k: _check_type(f"{where}[{k!r}]", v, args[1]) for k, v in value.items()}
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null, got {value!r}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported field type {hint!r}")  # pragma: no cover - a bug in RunConfig


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(hint))
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in typing.get_args(hint))
        return f"{origin.__name__}[{inner}]"
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))


def fields_help() -> str:
    """Every RUN.json field with its type, default and help: the epilog of ``--help``."""
    hints = typing.get_type_hints(RunConfig)
    lines = ["RUN.json fields (required ones have no default):", ""]
    for f in dataclasses.fields(RunConfig):
        if f.default is not dataclasses.MISSING:
            default = json.dumps(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = json.dumps(f.default_factory())
        else:
            default = "required"
        lines.append(f"  {f.name} ({_type_name(hints[f.name])}, {default})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)
