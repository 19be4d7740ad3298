"""The ranker's hyperparameters: its sizes (:class:`RankerSizes`, shared with :class:`ModelConfig`) and its
training choices, checked before anything is read or built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from core.contracts import EMBEDDING_DIM, LABELS, SURFACES
from core.failures import ConfigError
from training.models.pin_ranker.ids import ID_TABLES
from training.models.pin_ranker.model import ModelConfig, RankerSizes


@dataclass(frozen=True)
class RankerParams(RankerSizes):
    """The ranker's hyperparameters (RUN.json ``params``; ``families.pin_ranker.params`` in the config): the fields
    of :class:`RankerSizes` and these."""

    # Weight of each head's BCE loss. hide is the rarest label (about 3%) and the one the sequence explains
    # least: it gets more weight.
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "repin": 1.0, "hide": 3.0})
    ablation: bool = True  # also train the model without the action sequence, in lockstep (ablation_auc)
    # The surface vocabulary (an unknown surface is index 0); set it to your data's surfaces.
    surfaces: tuple[str, ...] = SURFACES
    # Width of the pins' content embedding: None reads it from the pin snapshot when training starts.
    embedding_dim: int | None = None

    def __post_init__(self) -> None:
        problems = [f"{name}={getattr(self, name)} must be positive" for name in (
            "sequence_length", "d_model", "n_heads", "n_layers", "ff_dim", "first_k", "sparse_dim", "pin_buckets",
            "user_buckets", "creator_buckets", "category_buckets",
        ) if getattr(self, name) <= 0]
        if self.cross_layers < 0:
            problems.append(f"cross_layers={self.cross_layers} must not be negative")
        if not 0 <= self.dropout < 1:
            problems.append(f"dropout={self.dropout} must be in [0, 1)")
        if self.d_model % self.n_heads:
            problems.append(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.first_k > self.sequence_length:
            problems.append(f"first_k={self.first_k} exceeds sequence_length={self.sequence_length}")
        for label, weight in self.loss_weights.items():
            if label not in LABELS:
                problems.append(f"loss_weights has unknown label {label!r}; labels are {', '.join(LABELS)}")
            elif weight < 0:
                problems.append(f"loss_weights[{label!r}]={weight} must not be negative")
        if any(h <= 0 for h in self.mlp_hidden):
            problems.append(f"mlp_hidden={list(self.mlp_hidden)} must hold positive widths")
        if self.id_tables not in ID_TABLES:
            problems.append(f"id_tables={self.id_tables!r} must be one of {', '.join(ID_TABLES)}")
        if not 0 < self.managed_tail < 1:
            problems.append(f"managed_tail={self.managed_tail} must be in (0, 1)")
        if self.id_tables == "managed":
            problems += [f"{name}={getattr(self, name)} must be at least 3 with id_tables=managed" for name in (
                "pin_buckets", "user_buckets", "creator_buckets", "category_buckets") if 0 < getattr(self, name) < 3]
        if problems:
            raise ConfigError("pin_ranker params are invalid: " + "; ".join(problems))

    def model_config(self, use_sequence: bool = True) -> ModelConfig:
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(RankerSizes)}
        return ModelConfig(**{**sizes, "mlp_hidden": tuple(self.mlp_hidden)}, use_sequence=use_sequence,
                           embedding_dim=self.embedding_dim or EMBEDDING_DIM, surfaces=len(self.surfaces))
