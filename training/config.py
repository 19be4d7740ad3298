"""The configuration of one training run: ``RUN.json``, read once by the entry point and passed down.

The Airflow layer writes ``RUN.json`` (it is the only layer that reads platform config); everything under
``training/`` takes its settings from a :class:`RunConfig`. This module imports no torch, so the Airflow
layer can validate a RUN.json (``RunConfig.from_dict``) before it submits a job. Every field carries its help text in its
dataclass metadata, which is what ``python -m training.train --help`` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from core.config import FeaturesConfig, MlflowConfig, TrainingConfig
from core.contracts import LABELS
from core.failures import ConfigError
from core.storage import parse_ds

if typing.TYPE_CHECKING:
    from training.model import ModelConfig

_REQUIRED = object()


# Defaults shared with the platform configuration are taken from its typed models: defined once, in core.config.
_TRAINING = TrainingConfig()
_MLFLOW = MlflowConfig()


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
    root: str = _f("storage root (local path, file:// or s3:// URL) holding examples/, raw/pins/ and truth/")
    train_days: list[str] = _f("days (YYYY-MM-DD) of the examples dataset to train on")
    eval_ds: str = _f("day (YYYY-MM-DD) of the examples dataset to evaluate on, after training")
    output_dir: str = _f("job folder: heartbeat-rank{r}.json, failure-rank{r}.json and result.json are written here")
    checkpoint_dir: str = _f(
        "checkpoints (torch.distributed.checkpoint) as step-XXXXXXXX/ folders; must be shared by all "
        "nodes; the newest complete one is resumed on start"
    )
    mlflow_tracking_uri: str = _f("MLflow tracking (and registry) URI, e.g. sqlite:////abs/path/mlflow.db")
    mlflow_artifact_location: str | None = _f(
        "artifact location given to a newly created MLflow experiment (ignored if it exists)", None
    )
    experiment: str = _f("MLflow experiment name", _MLFLOW.experiment)
    model_name: str = _f("registered model name in the MLflow model registry", _MLFLOW.model_name)
    register: bool = _f("register the logged model as a new version of model_name", True)
    run_name: str | None = _f("MLflow run name (default: MLflow's generated name)", None)
    # --- optimisation -----------------------------------------------------------------------------
    epochs: int = _f("passes over the training days", _TRAINING.epochs)
    batch_size: int = _f("examples per batch per rank (the global batch is batch_size x world size)", _TRAINING.batch_size)
    lr: float = _f("peak learning rate of AdamW (reached after warmup_steps)", _TRAINING.lr)
    weight_decay: float = _f("AdamW weight decay", 1e-5)
    warmup_steps: int = _f("linear warmup steps, then cosine decay to min_lr_ratio x lr", 20)
    min_lr_ratio: float = _f("final learning rate of the cosine schedule, as a fraction of lr", 0.1)
    grad_clip: float = _f("clip the global gradient norm to this value (0 = no clipping)", 1.0)
    loss_weights: dict[str, float] = _f(
        f"weight of each head's BCE loss in the total loss; labels: {', '.join(LABELS)} (missing = 1.0)",
        # hide is the rarest label (about 3%) and the one the sequence explains least: it gets more weight.
        factory=lambda: {label: 3.0 if label == "hide" else 1.0 for label in LABELS},
    )
    seed: int = _f("seed of the model initialisation and of the data order (with the epoch)", 0)
    max_steps: int = _f("stop after this many optimizer steps in total (0 = no cap)", 0)
    # --- data -------------------------------------------------------------------------------------
    sequence_length: int = _f(
        "user sequence length N the model reads (most recent actions first)", FeaturesConfig().sequence_length
    )
    num_workers: int = _f(
        "DataLoader worker processes per rank (0 = read in the training process; raise it on GPU nodes)", 0
    )
    num_threads: int = _f("torch intra-op threads per rank (0 = torch's default)", 1)
    eval_batch_size: int = _f("batch size of the evaluation pass", 1024)
    # --- checkpoints, heartbeats, logging ---------------------------------------------------------
    checkpoint_every: int = _f("save a checkpoint every this many steps (0 = only at the end)", 500)
    keep_checkpoints: int = _f("complete checkpoints to keep (older ones are deleted)", 2)
    heartbeat_every_s: float = _f("seconds between heartbeat files of each rank", 10.0)
    log_every: int = _f("log the train loss to MLflow every this many steps", 10)
    dist_timeout_s: int = _f("timeout of collectives (gloo/NCCL), after which the job fails as INFRA", 1800)
    device: Literal["auto", "cpu", "cuda"] = _f(
        "auto: CUDA (nccl, bf16 autocast) when available, else CPU (gloo)", "auto"
    )
    strategy: Literal["ddp", "fsdp"] = _f(
        "ddp: DistributedDataParallel, every rank holds the whole model; fsdp: FSDP2 fully_shard, the "
        "embedding tables (and every other parameter and its optimizer state) are sharded across ranks",
        _TRAINING.strategy,
    )
    deterministic: bool = _f(
        "torch.use_deterministic_algorithms: a resumed run is bitwise equal to an uninterrupted one (CPU)", False
    )
    ablation: bool = _f(
        "also train, in lockstep on the same batches, the model without the action sequence and report "
        "its evaluation (ablation_auc, sequence_lift)",
        True,
    )
    # --- model size -------------------------------------------------------------------------------
    d_model: int = _f("width of the sequence transformer", 32)
    n_heads: int = _f("attention heads of the sequence transformer", 2)
    n_layers: int = _f("layers of the sequence transformer", 1)
    ff_dim: int = _f("feed-forward width of the sequence transformer", 64)
    first_k: int = _f("the first K (most recent) transformer outputs are kept flattened", 4)
    dropout: float = _f("dropout of the transformer and the MLP", 0.0)
    sparse_dim: int = _f("width of the sparse id embeddings", 16)
    pin_buckets: int = _f("hash buckets of the candidate pin id table", 20011)
    user_buckets: int = _f("hash buckets of the user id table", 20011)
    creator_buckets: int = _f("hash buckets of the creator id table", 5003)
    category_buckets: int = _f("hash buckets of the category table", 1009)
    cross_layers: int = _f("layers of the DCN-v2 cross network", 2)
    mlp_hidden: list[int] = _f("hidden widths of the MLP after the cross network", factory=lambda: [64, 32])
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
        from core.storage import read_text

        try:
            data = json.loads(read_text(path))
        except FileNotFoundError:
            raise ConfigError(f"run config {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"run config {path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"run config {path} must hold a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, source=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "run config") -> RunConfig:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = [k for k in data if k not in fields]
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, list(fields), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(f"{source}: unknown key(s) {', '.join(hints)}; see `python -m training.train --help`")
        missing = [
            name
            for name, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data
        ]
        if missing:
            raise ConfigError(f"{source}: missing required key(s) {', '.join(missing)}")
        types_ = typing.get_type_hints(cls)
        values = {name: _check_type(f"{source}: {name}", value, types_[name]) for name, value in data.items()}
        config = cls(**values)
        config.validate(source)
        return config

    def validate(self, source: str = "run config") -> None:
        problems = []
        if not self.train_days:
            problems.append("train_days is empty: give at least one day")
        for ds in [*self.train_days, self.eval_ds]:
            try:
                parse_ds(ds)
            except ValueError as e:
                problems.append(str(e))
        positive = (
            "epochs batch_size sequence_length eval_batch_size d_model n_heads n_layers ff_dim first_k "
            "sparse_dim pin_buckets user_buckets creator_buckets category_buckets log_every keep_checkpoints "
            "dist_timeout_s"
        ).split()
        for name in positive:
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        for name in "max_steps checkpoint_every warmup_steps cross_layers num_workers num_threads".split():
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must not be negative")
        if self.lr <= 0:
            problems.append(f"lr={self.lr} must be positive")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.first_k > self.sequence_length:
            problems.append(f"first_k={self.first_k} exceeds sequence_length={self.sequence_length}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            problems.append(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.heartbeat_every_s <= 0:
            problems.append(f"heartbeat_every_s={self.heartbeat_every_s} must be positive")
        for label, weight in self.loss_weights.items():
            if label not in LABELS:
                problems.append(f"loss_weights has unknown label {label!r}; labels are {', '.join(LABELS)}")
            elif weight < 0:
                problems.append(f"loss_weights[{label!r}]={weight} must not be negative")
        if any(h <= 0 for h in self.mlp_hidden):
            problems.append(f"mlp_hidden={self.mlp_hidden} must hold positive widths")
        if problems:
            raise ConfigError(f"{source} is invalid: " + "; ".join(problems))

    # ----------------------------------------------------------------------------------------------
    def label_weights(self) -> dict[str, float]:
        return {label: float(self.loss_weights.get(label, 1.0)) for label in LABELS}

    def model_config(self) -> ModelConfig:
        from training.model import ModelConfig  # torch is imported only where a model is built

        return ModelConfig(
            sequence_length=self.sequence_length,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            ff_dim=self.ff_dim,
            first_k=self.first_k,
            dropout=self.dropout,
            sparse_dim=self.sparse_dim,
            pin_buckets=self.pin_buckets,
            user_buckets=self.user_buckets,
            creator_buckets=self.creator_buckets,
            category_buckets=self.category_buckets,
            cross_layers=self.cross_layers,
            mlp_hidden=tuple(self.mlp_hidden),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    if origin is list:
        if not isinstance(value, list):
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
