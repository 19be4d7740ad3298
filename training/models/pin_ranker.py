"""The ``pin_ranker`` model family: a TransAct-style multi-task ranker (action sequence + sparse ids + dense counts).

Trains on the ``examples`` dataset (impressions with labels and features as of the day before, built by
``pin_daily_features``); heads click, repin and hide; an ablation without the action sequence trains in
lockstep on the same batches so that the report shows what the sequence adds. The SDK side
(:class:`PinRankerFamily`) is at the end of this file; the network first.

Per example the model reads (names are the keys of a batch, see :meth:`PinRankerFamily.encode`):

- the user's last N engagements, most recent first: ``seq_pin_emb`` [B, N, 32] (content embedding of each
  engaged pin), ``seq_actions`` [B, N] (index into ``ACTIONS`` + 1; 0 = padding), ``seq_categories`` [B, N],
  ``seq_age_hours`` [B, N] (impression time - action time) and ``seq_mask`` [B, N] (True = a real step);
- the candidate pin: ``cand_pin_emb`` [B, 32] and the raw ids ``pin_id``, ``category``, ``creator_id``;
- the context: ``user_id``, ``surface`` (index into ``SURFACES`` + 1; 0 = unknown);
- ``dense`` [B, len(DENSE_FEATURES)]: the counts and rates of ``DENSE_FEATURES``, untransformed.

Raw ids go in and are hashed inside the model (a fixed universal hash into ``buckets - 1`` rows; row 0 is
reserved for "absent", i.e. negative ids, and stays zero), so a serving caller needs no hashing code. With
``id_tables: managed`` the training days' most frequent ids get a row each instead and the others share a hashed
tail of the rows (:func:`managed_rows`; the mapping is a buffer of the model, so serving still needs no code).

Sequence tower (TransAct): every step is the sum of an action-type embedding, a projection of the engaged
pin's content embedding, a projection of the *candidate's* content embedding (early fusion: every step sees
what is being ranked), a category embedding, an encoding of log1p(age in hours) and a position embedding.
A small ``nn.TransformerEncoder`` with a padding mask runs over the steps; its output is the first K steps
flattened plus a max-pool over the valid steps. Users without history (all padding) get zeros, not NaN.

The sequence output, the sparse embeddings, the transformed dense features (log1p of counts, rates as is)
and the candidate content embedding are concatenated, crossed by a DCN-v2 cross network, passed through an
MLP, and read by one logit head per label.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.nn.functional as F
from torch import nn

from core import storage
from core.contracts import (
    ACTIONS,
    COUNT_COLUMNS,
    DENSE_FEATURES,
    EMBEDDING_DIM,
    EXAMPLES,
    LABELS,
    PIN_WINDOW,
    RAW_PINS,
    SURFACES,
    TRUTH,
)
from core.failures import DataError
from core.storage import Location, data_files, is_complete, parquet_file, pins_of, read_parquet
from training.data import ExampleStream, PinEmbeddings, fixed_width, latest_complete_day
from training.evaluate import auc, calibration, finite, hit_at_k, log_loss, oracle_ratio
from training.sdk import ModelFamily

log = logging.getLogger("training.models.pin_ranker")

# The inputs of the exported serving model, in this order (also the names of the MLflow signature).
SERVING_INPUTS: tuple[str, ...] = (
    "seq_pin_emb",
    "seq_actions",
    "seq_categories",
    "seq_age_hours",
    "seq_mask",
    "cand_pin_emb",
    "pin_id",
    "user_id",
    "category",
    "creator_id",
    "surface",
    "dense",
)
# Dense features that are counts (log1p-transformed in the model); the others are rates in [0, 1].
COUNT_FEATURES: tuple[str, ...] = tuple(
    name for name in DENSE_FEATURES if not (name.endswith("ctr") or name.endswith("_rate"))
)

# Scalars per action type of PinRanker.match_features (count, mean/max similarity, same category, decayed).
MATCH_FEATURES = 5 * len(ACTIONS)
TABLE_STD = 0.05  # the id tables' initial scale (normal)
TASTE_STD = 0.01  # user_taste's

# A universal hash h(x) = ((x mod P) * A + C) mod P, then mod (buckets - 1) + 1. P = 2^31 - 1 keeps every
# product below 2^62, so nothing overflows int64 (in eager mode, under torch.export and on CUDA alike).
_HASH_P = 2_147_483_647
_HASH_A = 48_271
_HASH_C = 12_345


def hash_ids(ids: torch.Tensor, buckets: int) -> torch.Tensor:
    """Map raw int64 ids to rows 1..buckets-1 of an embedding table; negative ids (absent) map to row 0."""
    h = torch.remainder(torch.remainder(ids, _HASH_P) * _HASH_A + _HASH_C, _HASH_P)
    rows = torch.remainder(h, buckets - 1) + 1
    return torch.where(ids < 0, torch.zeros_like(rows), rows)


# --- managed id tables (``id_tables: managed``) ------------------------------------------------------------
ID_TABLES: tuple[str, ...] = ("hashed", "managed")  # the values of RankerParams.id_tables
# The raw id features whose tables a managed model manages (user_taste shares user_emb's rows, seq_category_emb
# category_emb's).
MANAGED_FEATURES: tuple[str, ...] = ("pin_id", "user_id", "creator_id", "category")
_MANAGED_EMPTY = torch.iinfo(torch.int64).max  # an unused slot of a managed-id buffer (sorts last, never an id)


def managed_layout(buckets: int, tail_share: float) -> tuple[int, int]:
    """(own rows, shared tail rows) of a managed table of ``buckets`` rows: row 0 is absent, rows 1..own are each
    one managed id's, the last ``tail`` rows are shared by every other id (hashed)."""
    tail = min(buckets - 1, max(1, round(tail_share * (buckets - 1))))
    return buckets - 1 - tail, tail


def managed_rows(ids: torch.Tensor, managed: torch.Tensor, tail: int) -> torch.Tensor:
    """Rows of raw ids in a managed table: a managed id (one of the sorted ``managed[:-1]``) gets row 1 + its
    index, any other id one of the ``tail`` rows after them by :func:`hash_ids`, a negative id row 0 (absent).

    The same remap as TorchRec's ``MCHManagedCollisionModule`` (a searchsorted into the sorted managed ids), with
    the misses hashed over a band of rows instead of one; it exports with ``torch.export``. ``managed`` always ends
    with one unused slot, so the search never runs past it.
    """
    own = managed.shape[0] - 1
    pos = torch.searchsorted(managed, ids).clamp(max=own)
    found = (managed[pos] == ids) & (pos < own) & (ids != _MANAGED_EMPTY)
    tail_rows = own + hash_ids(ids, tail + 1)  # hash_ids: 1..tail
    rows = torch.where(found, pos + 1, tail_rows)
    return torch.where(ids < 0, torch.zeros_like(rows), rows)


def select_managed(ids: np.ndarray, counts: np.ndarray, own: int) -> np.ndarray:
    """The ``own`` most frequent ids (ties: the smaller id first), sorted by id: the ids a managed table gives a
    row each. Negative (absent) ids never get one."""
    keep = ids >= 0
    ids, counts = ids[keep].astype(np.int64), counts[keep]
    order = np.lexsort((ids, -counts))[:own]
    return np.sort(ids[order])


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a PinRanker; defaults are small enough for CPU training."""

    sequence_length: int = 50
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    ff_dim: int = 64
    first_k: int = 4
    dropout: float = 0.0
    sparse_dim: int = 16
    pin_buckets: int = 20011
    user_buckets: int = 20011
    creator_buckets: int = 5003
    category_buckets: int = 1009
    cross_layers: int = 2
    mlp_hidden: tuple[int, ...] = (64, 32)
    use_sequence: bool = True  # False: the ablation without the action sequence (tower and match features)
    embedding_dim: int = EMBEDDING_DIM  # width of the pins' content embedding (the data's)
    surfaces: int = len(SURFACES)  # size of the surface vocabulary
    id_tables: str = "hashed"  # how raw ids become rows: "hashed" (hash_ids) or "managed" (managed_rows)
    managed_tail: float = 0.1  # managed: the share of a table's rows that the ids without their own row share

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        if self.id_tables == "hashed":  # the hashed model's spec as it was before managed tables existed
            del out["id_tables"], out["managed_tail"]
        return out

    def buckets(self, feature: str) -> int:
        return {"pin_id": self.pin_buckets, "user_id": self.user_buckets, "creator_id": self.creator_buckets,
                "category": self.category_buckets}[feature]


class CrossNetV2(nn.Module):
    """DCN-v2 cross network: x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, full-rank W_l."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        linears = [nn.Linear(dim, dim) for _ in range(layers)]
        for layer in linears:
            nn.init.xavier_uniform_(layer.weight, gain=0.1)
            nn.init.zeros_(layer.bias)
        self.layers = nn.ModuleList(linears)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class PinRanker(nn.Module):
    """TransAct sequence tower + hashed sparse ids + dense features → DCN-v2 → MLP → one head per label."""

    first_position: torch.Tensor
    dense_is_count: torch.Tensor

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or ModelConfig()
        d, n, s = config.d_model, config.sequence_length, config.sparse_dim
        self.labels = LABELS
        # Managed id tables: per feature, the sorted ids that own a row (persistent buffers: checkpoints, the
        # gathered model and the exported program carry them). Empty until set_managed_ids; registered before
        # any table (buffers draw no random numbers: the tables start as the hashed model's do).
        self._tails: dict[str, int] = {}
        if config.id_tables == "managed":
            for feature in MANAGED_FEATURES:
                own, self._tails[feature] = managed_layout(config.buckets(feature), config.managed_tail)
                self.register_buffer(f"managed_{feature}", torch.full((own + 1,), _MANAGED_EMPTY, dtype=torch.int64))

        # Sequence tower (absent in the ablation without the sequence).
        if config.use_sequence:
            self.action_emb = nn.Embedding(len(ACTIONS) + 1, d, padding_idx=0)
            self.seq_category_emb = nn.Embedding(config.category_buckets, d, padding_idx=0)
            self.seq_pin_proj = nn.Linear(config.embedding_dim, d)
            self.cand_proj = nn.Linear(config.embedding_dim, d)
            self.age_proj = nn.Linear(1, d)
            self.position_emb = nn.Parameter(torch.zeros(n, d))
            layer = nn.TransformerEncoderLayer(
                d, config.n_heads, config.ff_dim, config.dropout, batch_first=True, norm_first=True
            )
            # No nested tensors: they are data-dependent (bad for torch.export) and do not pay off at this size.
            self.encoder = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)
            self.register_buffer("first_position", torch.arange(n) == 0, persistent=False)

        # Sparse ids (row 0 = absent, kept at zero by padding_idx).
        self.pin_emb = nn.Embedding(config.pin_buckets, s, padding_idx=0)
        self.user_emb = nn.Embedding(config.user_buckets, s, padding_idx=0)
        self.category_emb = nn.Embedding(config.category_buckets, s, padding_idx=0)
        self.creator_emb = nn.Embedding(config.creator_buckets, s, padding_idx=0)
        self.surface_emb = nn.Embedding(config.surfaces + 1, s, padding_idx=0)
        # A user's taste in the pins' content space: its product with the candidate's content embedding
        # is a factorisation term (user x content) the cross network would otherwise have to discover.
        self.user_taste = nn.Embedding(config.user_buckets, config.embedding_dim, padding_idx=0)
        tower = (self.action_emb, self.seq_category_emb) if config.use_sequence else ()
        for emb in (
            *tower,
            self.pin_emb,
            self.user_emb,
            self.category_emb,
            self.creator_emb,
            self.surface_emb,
        ):
            nn.init.normal_(emb.weight, std=TABLE_STD)
            with torch.no_grad():
                emb.weight[0].zero_()
        nn.init.normal_(self.user_taste.weight, std=TASTE_STD)
        with torch.no_grad():
            self.user_taste.weight[0].zero_()
        if config.use_sequence:
            nn.init.normal_(self.position_emb, std=0.02)

        # Dense features: which columns are counts.
        is_count = torch.tensor([name in COUNT_FEATURES for name in DENSE_FEATURES])
        self.register_buffer("dense_is_count", is_count, persistent=False)

        seq_dim = (config.first_k + 1) * d + MATCH_FEATURES + len(ACTIONS) * config.embedding_dim
        joint = (seq_dim if config.use_sequence else 0) + 5 * s + len(DENSE_FEATURES) + 2 * config.embedding_dim + 1
        self.cross = CrossNetV2(joint, config.cross_layers)
        mlp: list[nn.Module] = []
        width = joint
        for hidden in config.mlp_hidden:
            mlp += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(config.dropout)]
            width = hidden
        self.mlp = nn.Sequential(*mlp)
        self.heads = nn.ModuleDict({label: nn.Linear(width, 1) for label in LABELS})

    # ----------------------------------------------------------------------------------------------
    def rows(self, feature: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the raw ``ids`` of ``feature`` in its table: hashed, or managed (``config.id_tables``)."""
        if self.config.id_tables == "managed":
            return managed_rows(ids, getattr(self, f"managed_{feature}"), self._tails[feature])
        return hash_ids(ids, self.config.buckets(feature))

    def set_managed_ids(self, managed: dict[str, np.ndarray]) -> None:
        """Give each id of ``managed[feature]`` (at most the table's own rows, see :func:`select_managed`) a row."""
        for feature, ids in managed.items():
            buffer = getattr(self, f"managed_{feature}")
            if len(ids) > buffer.shape[0] - 1:
                raise ValueError(f"{len(ids)} managed {feature}s exceed the table's {buffer.shape[0] - 1} own rows")
            values = torch.full_like(buffer, _MANAGED_EMPTY, device="cpu")
            values[: len(ids)] = torch.from_numpy(np.sort(np.asarray(ids, dtype=np.int64)))
            with torch.no_grad():
                buffer.copy_(values)

    def sequence_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        cfg = self.config
        mask = batch["seq_mask"]
        age = torch.log1p(batch["seq_age_hours"].float().clamp(min=0.0)).unsqueeze(-1)
        steps = (
            self.action_emb(batch["seq_actions"])
            + self.seq_pin_proj(batch["seq_pin_emb"])
            + self.seq_category_emb(self.rows("category", batch["seq_categories"]))
            + self.age_proj(age)
            + self.position_emb.unsqueeze(0)
            + self.cand_proj(batch["cand_pin_emb"]).unsqueeze(1)
        )
        valid = mask.unsqueeze(-1)
        steps = steps * valid
        # A row with no valid step would make every attention weight -inf/-inf = NaN: let such a row
        # attend to its (zeroed) first step, and zero the outputs below.
        empty = ~mask.any(dim=1)
        padding = ~mask & ~(empty.unsqueeze(1) & self.first_position.unsqueeze(0))
        hidden = self.encoder(steps, src_key_padding_mask=padding)
        hidden = hidden * valid
        first = hidden[:, : cfg.first_k, :].flatten(1)
        pooled = hidden.masked_fill(~valid, -1e4).amax(dim=1)
        pooled = torch.where(empty.unsqueeze(1), torch.zeros_like(pooled), pooled)
        return torch.cat([first, pooled], dim=1)

    def match_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """How the user's past actions relate to the candidate, per action type (target attention by hand).

        Per action type a: log1p(count), mean and max cosine of the engaged pins' content embeddings with
        the candidate's, log1p(steps in the candidate's category) and the same count decayed with a
        half-life of one day; plus the mean content embedding of the steps of type a times the candidate's
        embedding (elementwise: the MLP sums it into any bilinear taste x content score). Shape [B, F].
        """
        mask = batch["seq_mask"]
        valid = mask.float()
        onehot = F.one_hot(batch["seq_actions"].clamp(0, len(ACTIONS)), len(ACTIONS) + 1)[..., 1:].float()
        onehot = onehot * valid.unsqueeze(-1)  # [B, N, A]
        count = onehot.sum(dim=1)  # [B, A]
        has = count > 0
        seq = batch["seq_pin_emb"].float()
        cand = batch["cand_pin_emb"].float()
        sim = (F.normalize(seq, dim=-1) * F.normalize(cand, dim=-1).unsqueeze(1)).sum(-1)  # [B, N]
        mean_sim = (onehot * sim.unsqueeze(-1)).sum(1) / count.clamp(min=1.0)
        max_sim = sim.unsqueeze(-1).masked_fill(onehot == 0, -2.0).amax(1)
        max_sim = torch.where(has, max_sim, torch.zeros_like(max_sim))
        same = (batch["seq_categories"] == batch["category"].unsqueeze(1)).float() * valid
        decay = torch.exp2(-batch["seq_age_hours"].float().clamp(min=0.0) / 24.0)
        same_count = (onehot * same.unsqueeze(-1)).sum(1)
        same_decayed = (onehot * (same * decay).unsqueeze(-1)).sum(1)
        taste = torch.einsum("bna,bnd->bad", onehot, seq) / count.clamp(min=1.0).unsqueeze(-1)  # [B, A, 32]
        fused = (taste * cand.unsqueeze(1)).flatten(1)
        scalars = [torch.log1p(count), mean_sim, max_sim, torch.log1p(same_count), same_decayed]
        return torch.cat([*scalars, fused], dim=1)

    def transform_dense(self, dense: torch.Tensor) -> torch.Tensor:
        dense = dense.float()
        return torch.where(self.dense_is_count, torch.log1p(dense.clamp(min=0.0)), dense)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Logits per label, each of shape [B]."""
        cfg = self.config
        user_rows = self.rows("user_id", batch["user_id"])
        sparse = [
            self.pin_emb(self.rows("pin_id", batch["pin_id"])),
            self.user_emb(user_rows),
            self.category_emb(self.rows("category", batch["category"])),
            self.creator_emb(self.rows("creator_id", batch["creator_id"])),
            self.surface_emb(batch["surface"]),
        ]
        sequence = [self.sequence_features(batch), self.match_features(batch)] if cfg.use_sequence else []
        cand = batch["cand_pin_emb"].float()
        taste = self.user_taste(user_rows) * cand
        x0 = torch.cat(
            [
                *sequence,
                *sparse,
                self.transform_dense(batch["dense"]),
                cand,
                taste,
                taste.sum(dim=1, keepdim=True),
            ],
            dim=1,
        )
        h = self.mlp(self.cross(x0))
        return {label: head(h).squeeze(-1) for label, head in self.heads.items()}


class ServingModule(nn.Module):
    """The exported form: positional tensors in ``SERVING_INPUTS`` order → probabilities ``p_<label>``."""

    def __init__(self, ranker: PinRanker) -> None:
        super().__init__()
        self.ranker = ranker

    def forward(
        self,
        seq_pin_emb: torch.Tensor,
        seq_actions: torch.Tensor,
        seq_categories: torch.Tensor,
        seq_age_hours: torch.Tensor,
        seq_mask: torch.Tensor,
        cand_pin_emb: torch.Tensor,
        pin_id: torch.Tensor,
        user_id: torch.Tensor,
        category: torch.Tensor,
        creator_id: torch.Tensor,
        surface: torch.Tensor,
        dense: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        batch = {
            "seq_pin_emb": seq_pin_emb,
            "seq_actions": seq_actions,
            "seq_categories": seq_categories,
            "seq_age_hours": seq_age_hours,
            "seq_mask": seq_mask,
            "cand_pin_emb": cand_pin_emb,
            "pin_id": pin_id,
            "user_id": user_id,
            "category": category,
            "creator_id": creator_id,
            "surface": surface,
            "dense": dense,
        }
        return {f"p_{label}": torch.sigmoid(logit) for label, logit in self.ranker(batch).items()}


def multitask_loss(
    logits: dict[str, torch.Tensor], labels: torch.Tensor, weights: dict[str, float]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of per-head mean BCE losses; ``labels`` is [B, len(LABELS)] in ``LABELS`` order."""
    per_head = {
        label: F.binary_cross_entropy_with_logits(logits[label].float(), labels[:, i].float())
        for i, label in enumerate(LABELS)
    }
    total = torch.stack([weights.get(label, 1.0) * loss for label, loss in per_head.items()]).sum()
    return total, per_head


# --- the SDK side ---------------------------------------------------------------------------------

# The columns of ``examples`` the ranker reads.
EXAMPLE_COLUMNS: tuple[str, ...] = (
    "impression_id",
    "user_id",
    "pin_id",
    "category",
    "creator_id",
    "surface",
    *DENSE_FEATURES,
    "seq_pin_ids",
    "seq_actions",
    "seq_categories",
    "seq_age_hours",
    *LABELS,
)
# The popularity baseline of each head: the candidate pin's own smoothed rate.
BASELINE_FEATURE = {"click": "p_ctr", "repin": "p_repin_rate", "hide": "p_hide_rate"}
# Scoring the corpus: each pin in a non-personalised context on this surface.
CONTEXT_SURFACE = "home_feed"


@dataclass(frozen=True)
class RankerParams:
    """The ranker's hyperparameters (RUN.json ``params``; ``families.pin_ranker.params`` in the config)."""

    sequence_length: int = 50  # user sequence length N the model reads (most recent actions first)
    # Weight of each head's BCE loss. hide is the rarest label (about 3%) and the one the sequence explains
    # least: it gets more weight.
    loss_weights: dict[str, float] = field(default_factory=lambda: {"click": 1.0, "repin": 1.0, "hide": 3.0})
    ablation: bool = True  # also train the model without the action sequence, in lockstep (ablation_auc)
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    ff_dim: int = 64
    first_k: int = 4
    dropout: float = 0.0
    sparse_dim: int = 16
    pin_buckets: int = 20011
    user_buckets: int = 20011
    creator_buckets: int = 5003
    category_buckets: int = 1009
    cross_layers: int = 2
    mlp_hidden: tuple[int, ...] = (64, 32)
    # The surface vocabulary (an unknown surface is index 0); set it to your data's surfaces.
    surfaces: tuple[str, ...] = SURFACES
    # Width of the pins' content embedding: None reads it from the pin snapshot when training starts.
    embedding_dim: int | None = None
    # How raw ids become table rows. "hashed": a fixed hash into the buckets (ids collide at random). "managed": the
    # ids most frequent in the training days' examples get a row each, the others share the last managed_tail of
    # the rows by hash (docs/training.md, "Managed id tables").
    id_tables: str = "hashed"
    managed_tail: float = 0.1

    def __post_init__(self) -> None:
        from core.failures import ConfigError

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
        return ModelConfig(
            sequence_length=self.sequence_length, d_model=self.d_model, n_heads=self.n_heads, n_layers=self.n_layers,
            ff_dim=self.ff_dim, first_k=self.first_k, dropout=self.dropout, sparse_dim=self.sparse_dim,
            pin_buckets=self.pin_buckets, user_buckets=self.user_buckets, creator_buckets=self.creator_buckets,
            category_buckets=self.category_buckets, cross_layers=self.cross_layers,
            mlp_hidden=tuple(self.mlp_hidden), use_sequence=use_sequence,
            embedding_dim=self.embedding_dim or EMBEDDING_DIM, surfaces=len(self.surfaces),
            id_tables=self.id_tables, managed_tail=self.managed_tail,
        )


class PinRankerFamily(ModelFamily):
    """Ranks candidate pins for a user: P(click), P(repin), P(hide) of an impression."""

    name = "pin_ranker"
    metrics = ("mean_auc", "train_loss", "examples", "oracle_coverage", *(
        f"{metric}_{label}" for metric in ("auc", "hit3", "baseline_auc", "baseline_hit3", "logloss", "calibration",
                                           "ablation_auc", "ablation_hit3", "sequence_lift", "oracle_auc",
                                           "oracle_ratio") for label in LABELS))
    Params = RankerParams
    dataset = EXAMPLES
    columns = EXAMPLE_COLUMNS
    serving_inputs = SERVING_INPUTS
    outputs = tuple(f"p_{label}" for label in LABELS)
    corpus_schema = pa.schema(
        [pa.field("pin_id", pa.int64(), nullable=False)]
        + [pa.field(f"p_{label}", pa.float32(), nullable=False) for label in LABELS]
    )
    corpus_table = "pin_emb"
    params: RankerParams

    def __init__(self, params: RankerParams) -> None:
        super().__init__(params)
        self._windows: dict[tuple[str, str], pa.Table | None] = {}
        self.managed_ids: dict[str, np.ndarray] = {}  # id_tables managed: what prepare chose, build_model installs

    # --- data -----------------------------------------------------------------------------------
    def prepare(self, root: Location, train_days: list[str], eval_ds: str) -> PinEmbeddings:
        """The content embeddings of the pin snapshot as of the last training day; the model takes their width."""
        pins = PinEmbeddings.from_snapshot(root, max(train_days))
        if self.params.embedding_dim is None:
            self.params = dataclasses.replace(self.params, embedding_dim=pins.dim)
        elif self.params.embedding_dim != pins.dim:
            from core.failures import DataError

            raise DataError(f"{RAW_PINS} embeddings are {pins.dim}-d, the model's params say {self.params.embedding_dim}")
        if self.params.id_tables == "managed":
            self.managed_ids = choose_managed_ids(root, train_days, self.params.model_config())
        return pins

    def encode(self, table: pa.Table, context: Any) -> dict[str, torch.Tensor]:
        batch = encode_ids(table, context, self.params.sequence_length, self.params.surfaces)
        batch["row_id"] = batch.pop("impression_id")
        return batch

    def finish(self, batch: dict[str, torch.Tensor], context: Any) -> dict[str, torch.Tensor]:
        """The sequence's content embeddings, looked up where the batch is trained: [B, N, D] floats are 32 times
        the bytes of the [B, N] ids, which is what crosses from the input workers (or Ray) to the trainer."""
        return with_sequence_embeddings(batch, context)

    # --- model ----------------------------------------------------------------------------------
    def variants(self) -> tuple[str, ...]:
        return ("model", "ablation") if self.params.ablation else ("model",)

    def build_model(self, variant: str = "model") -> nn.Module:
        model = PinRanker(self.params.model_config(use_sequence=variant != "ablation"))
        if self.managed_ids:
            model.set_managed_ids(self.managed_ids)
        return model

    def sparse_features(self, variant: str = "model") -> tuple[str, ...]:
        """The hashed-id tables (row 0: absent, as their padding_idx): sharded under strategy torchrec. The tiny
        action and surface vocabularies stay dense."""
        tables = ("pin_emb", "user_emb", "category_emb", "creator_emb", "user_taste")
        return tables if variant == "ablation" else (*tables, "seq_category_emb")

    def sparse_init_std(self, variant: str = "model") -> dict[str, float]:
        """The scales PinRanker draws its tables with (TABLE_STD, TASTE_STD), for the tables' sharded build."""
        return {name: TASTE_STD if name == "user_taste" else TABLE_STD for name in self.sparse_features(variant)}

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weights = {label: float(self.params.loss_weights.get(label, 1.0)) for label in LABELS}
        return multitask_loss(outputs, batch["labels"], weights)

    # --- evaluation -----------------------------------------------------------------------------
    def evaluate(
        self,
        models: dict[str, nn.Module],
        root: Location,
        eval_ds: str,
        context: Any,
        *,
        device: Any,
        batch_size: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        pins = context if latest_complete_day(root, RAW_PINS, eval_ds) == context.ds else None
        metrics = evaluate(
            models["model"], root, eval_ds, sequence_length=self.params.sequence_length, batch_size=batch_size,
            pins=pins, device=device, on_batch=on_batch, ablation=models.get("ablation"), surfaces=self.params.surfaces,
        )
        return with_mean_auc(metrics)

    def evaluate_part(
        self, models: dict[str, nn.Module], root: Location, eval_ds: str, context: Any, *, device: Any, batch_size: int,
        rank: int, world_size: int, on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, np.ndarray]:
        pins = context if latest_complete_day(root, RAW_PINS, eval_ds) == context.ds else None
        return predict_day(
            models["model"], root, eval_ds, sequence_length=self.params.sequence_length, batch_size=batch_size,
            pins=pins, device=device, on_batch=on_batch, ablation=models.get("ablation"),
            surfaces=self.params.surfaces, rank=rank, world_size=world_size,
        )

    def evaluate_parts(self, parts: list[Any], root: Location, eval_ds: str, context: Any) -> dict[str, Any]:
        """The ranks' predictions in impression order (a deterministic order whatever the ranks), then the metrics."""
        out = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
        order = np.argsort(out["impression_id"], kind="stable")
        return with_mean_auc(metrics_of({key: value[order] for key, value in out.items()}, root, eval_ds))

    # --- serving --------------------------------------------------------------------------------
    def serving(self, model: nn.Module) -> nn.Module:
        return ServingModule(model)  # type: ignore[arg-type]

    def example_inputs(self) -> dict[str, np.ndarray]:
        """A serving batch: row 0 has an empty sequence, the others a full one. Shapes match SERVING_INPUTS."""
        rows, n, dim = 2, self.params.sequence_length, self.params.embedding_dim or EMBEDDING_DIM
        mask = np.zeros((rows, n), dtype=bool)
        mask[1:] = True
        return {
            "seq_pin_emb": np.zeros((rows, n, dim), dtype=np.float32),
            "seq_actions": np.where(mask, 2, 0).astype(np.int64),
            "seq_categories": np.where(mask, 1, -1).astype(np.int64),
            "seq_age_hours": np.where(mask, 1.0, 0.0).astype(np.float32),
            "seq_mask": mask,
            "cand_pin_emb": np.zeros((rows, dim), dtype=np.float32),
            "pin_id": np.arange(1, rows + 1, dtype=np.int64),
            "user_id": np.arange(1, rows + 1, dtype=np.int64),
            "category": np.ones(rows, dtype=np.int64),
            "creator_id": np.ones(rows, dtype=np.int64),
            "surface": np.ones(rows, dtype=np.int64),
            "dense": np.zeros((rows, len(DENSE_FEATURES)), dtype=np.float32),
        }

    def feature_spec(self, root: Location, train_days: list[str], eval_ds: str, context: Any) -> dict[str, Any]:
        p = self.params
        return {
            "sequence_length": p.sequence_length,
            "embedding_dim": p.embedding_dim,
            "surfaces": list(p.surfaces),
            "dense_features": list(DENSE_FEATURES),
            "count_features": list(COUNT_FEATURES),
            "labels": list(LABELS),
            "hash_buckets": {
                "pin_id": p.pin_buckets, "user_id": p.user_buckets, "creator_id": p.creator_buckets,
                "category": p.category_buckets,
            },
            "pins_snapshot_ds": context.ds,
            "priors": history_priors(root, train_days[-1]),
            "model_config": p.model_config().to_dict(),
        }

    # --- corpus scoring -------------------------------------------------------------------------
    def score_corpus(self, module: Any, pins: pa.Table, spec: dict[str, Any], root: str, ds: str) -> pa.Table:
        """Each pin's prior engagement probabilities in a non-personalised context.

        No user (an empty sequence, the absent user id, zero user counts and the user rate at the prior the
        feature build gives users without history); the candidate is the pin itself with its own counts and
        rates from ``features/pin_window`` of ``ds`` (zeros and the priors without history); surface
        ``home_feed``. Comparable across pins, but not what a user would see: a personalised score needs a
        user's sequence.
        """
        return self.score_inputs(module, self.corpus_inputs(pins, spec, root, ds), spec)

    def corpus_inputs(self, pins: pa.Table, spec: dict[str, Any], root: str, ds: str) -> dict[str, np.ndarray]:
        key = (root, ds)
        if key not in self._windows:  # a shard scores many slices of one snapshot: read its window once
            self._windows = {key: _pin_window(root, ds)}
        pin_ids = pins.column("pin_id").to_numpy()
        return context_inputs(pins, context_dense(pin_ids, self._windows[key], spec.get("priors", {})), spec)

    def corpus_rows(self, module: Any, pins: pa.Table) -> np.ndarray:
        """Each pin's row of ``pin_emb`` in the serving ``module`` (hashed, or its managed mapping)."""
        ids = torch.from_numpy(pins.column("pin_id").to_numpy().astype(np.int64))
        return module.ranker.rows("pin_id", ids).numpy()  # type: ignore[no-any-return]

    def score_inputs(self, module: Any, inputs: dict[str, np.ndarray], spec: dict[str, Any]) -> pa.Table:
        with torch.no_grad():
            out = module(*(torch.from_numpy(inputs[name]) for name in spec["serving_inputs"]))
        return pa.table(
            {"pin_id": inputs["pin_id"], **{f"p_{label}": out[f"p_{label}"].float().numpy() for label in LABELS}},
            schema=self.corpus_schema,
        )


# --- the ranker's input, evaluation and scoring helpers ----------------------------------------------

def id_counts(root: Location, days: list[str], features: tuple[str, ...] = MANAGED_FEATURES) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per id feature, the distinct ids of the ``examples`` of ``days`` and how many examples hold each."""
    values: dict[str, list[np.ndarray]] = {feature: [] for feature in features}
    for ds in days:
        for path in data_files(root, EXAMPLES, ds):
            table = read_parquet(path, columns=list(features))
            for feature in features:
                values[feature].append(table.column(feature).to_numpy().astype(np.int64))
    out = {}
    for feature, parts in values.items():
        ids, counts = np.unique(np.concatenate(parts) if parts else np.zeros(0, np.int64), return_counts=True)
        out[feature] = (ids, counts)
    return out


def choose_managed_ids(root: Location, train_days: list[str], config: ModelConfig) -> dict[str, np.ndarray]:
    """The ids that get a row of their own in each managed table: the most frequent of the training days'
    examples, as many as the table has own rows (:func:`managed_layout`). The same on every rank (same data)."""
    chosen = {}
    for feature, (ids, counts) in id_counts(root, train_days).items():
        own, _ = managed_layout(config.buckets(feature), config.managed_tail)
        chosen[feature] = select_managed(ids, counts, own)
        log.info("managed %s table: %d of %d distinct training ids get a row of their own, %d rows shared by the rest",
                 feature, len(chosen[feature]), int((ids >= 0).sum()), config.buckets(feature) - 1 - own)
    return chosen


def _pad_lists(column: pa.ChunkedArray | pa.Array, steps: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """The first ``steps`` items of each list, zero-padded to [B, steps], and the mask of real items."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy().astype(np.int64)
    flat = arr.values.to_numpy(zero_copy_only=False)
    lengths = np.minimum(np.diff(offsets), steps)
    pos = np.arange(steps)
    mask = pos[None, :] < lengths[:, None]
    if flat.size == 0:
        return np.zeros(mask.shape, dtype=dtype), mask
    idx = np.where(mask, offsets[:-1, None] + pos[None, :], 0)
    return np.where(mask, flat[idx], 0).astype(dtype), mask


def surface_ids(column: pa.ChunkedArray | pa.Array, surfaces: tuple[str, ...] = SURFACES) -> np.ndarray:
    """Index of each surface in ``surfaces`` + 1; 0 for an unknown surface."""
    idx = pc.index_in(column, value_set=pa.array(list(surfaces), pa.string()))
    return pc.fill_null(idx, -1).to_numpy(zero_copy_only=False).astype(np.int64) + 1


def encode_batch(
    table: pa.Table, pins: PinEmbeddings, sequence_length: int, surfaces: tuple[str, ...] = SURFACES
) -> dict[str, torch.Tensor]:
    """Rows of the ``examples`` schema → the model's input tensors (see ``training.model``) + labels."""
    return with_sequence_embeddings(encode_ids(table, pins, sequence_length, surfaces), pins)


def encode_ids(
    table: pa.Table, pins: PinEmbeddings, sequence_length: int, surfaces: tuple[str, ...] = SURFACES
) -> dict[str, torch.Tensor]:
    """:func:`encode_batch` but for the sequence's content embeddings: ``seq_pin_ids`` [B, N] in place of
    ``seq_pin_emb`` [B, N, D], D times smaller (:func:`with_sequence_embeddings` looks them up)."""

    def col(name: str, dtype: type) -> np.ndarray:
        return np.array(table.column(name).to_numpy(), dtype=dtype)

    seq_pins, mask = _pad_lists(table.column("seq_pin_ids"), sequence_length, np.int64)
    actions, _ = _pad_lists(table.column("seq_actions"), sequence_length, np.int64)
    categories, _ = _pad_lists(table.column("seq_categories"), sequence_length, np.int64)
    ages, _ = _pad_lists(table.column("seq_age_hours"), sequence_length, np.float32)
    pin_ids = col("pin_id", np.int64)
    arrays = {
        "seq_pin_ids": seq_pins,
        "seq_actions": np.where(mask, actions + 1, 0),
        "seq_categories": np.where(mask, categories, -1),
        "seq_age_hours": np.where(mask, ages, 0.0).astype(np.float32),
        "seq_mask": mask,
        "cand_pin_emb": pins.lookup(pin_ids),
        "pin_id": pin_ids,
        "user_id": col("user_id", np.int64),
        "category": col("category", np.int64),
        "creator_id": col("creator_id", np.int64),
        "surface": surface_ids(table.column("surface"), surfaces),
        "dense": np.stack([col(name, np.float32) for name in DENSE_FEATURES], axis=1),
        "labels": np.stack([col(label, np.float32) for label in LABELS], axis=1),
        "impression_id": col("impression_id", np.int64),
    }
    return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in arrays.items()}


def with_sequence_embeddings(batch: dict[str, torch.Tensor], pins: PinEmbeddings) -> dict[str, torch.Tensor]:
    """``seq_pin_ids`` of :func:`encode_ids` replaced by ``seq_pin_emb``, their content embeddings (zeros past the
    sequence's end), first among the inputs as :func:`encode_batch` makes them."""
    embeddings = pins.lookup(batch["seq_pin_ids"].numpy(), mask=batch["seq_mask"].numpy())
    rest = {name: value for name, value in batch.items() if name != "seq_pin_ids"}
    return {"seq_pin_emb": torch.from_numpy(embeddings), **rest}


def history_priors(root: Location, ds: str) -> dict[str, float]:
    """The rate features the feature build gives a user or pin without history (its prior), as observed.

    Read from the first row group of the ``examples`` partition of ``ds``: the median rate of the rows
    with zero impressions (the median of all rows if there are none). Inference uses these for the
    non-personalised context.
    """
    files = data_files(root, EXAMPLES, ds)
    if not files:
        raise DataError(f"{EXAMPLES} partition ds={ds} under {root} has no Parquet file")
    rates = {
        "u_ctr": "u_impressions",
        "p_ctr": "p_impressions",
        "p_repin_rate": "p_impressions",
        "p_hide_rate": "p_impressions",
    }
    with parquet_file(files[0], pins_of(root)) as parquet:
        table = parquet.read_row_group(0, columns=sorted({*rates, *rates.values()}))
    out = {}
    for rate, count in rates.items():
        values = table.column(rate).to_numpy()
        fresh = values[table.column(count).to_numpy() == 0]
        out[rate] = float(np.median(fresh if fresh.size else values)) if values.size else 0.0
    return out


def _pin_window(root: Location, ds: str) -> pa.Table | None:
    if not storage.is_complete(root, PIN_WINDOW, ds):
        log.info("no complete %s partition for ds=%s: every pin scored as a pin without history", PIN_WINDOW, ds)
        return None
    columns = ["pin_id", *COUNT_COLUMNS, "ctr", "repin_rate", "hide_rate"]
    return storage.read_table(root, PIN_WINDOW, ds, columns=columns)


def context_dense(pin_ids: np.ndarray, window: pa.Table | None, priors: dict[str, float]) -> np.ndarray:
    """The dense features (DENSE_FEATURES order) of the non-personalised context for each pin."""
    n = len(pin_ids)
    values: dict[str, np.ndarray] = {name: np.zeros(n, dtype=np.float32) for name in DENSE_FEATURES}
    values["u_ctr"][:] = priors.get("u_ctr", 0.0)
    for rate in ("p_ctr", "p_repin_rate", "p_hide_rate"):
        values[rate][:] = priors.get(rate, 0.0)
    if window is not None and window.num_rows and n:
        ids = window.column("pin_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        pos = np.minimum(np.searchsorted(ids, pin_ids), len(ids) - 1)
        found = ids[pos] == pin_ids
        rows = order[pos[found]]
        for column in COUNT_COLUMNS:
            values[f"p_{column}"][found] = window.column(column).to_numpy()[rows]
        for column, name in (("ctr", "p_ctr"), ("repin_rate", "p_repin_rate"), ("hide_rate", "p_hide_rate")):
            values[name][found] = window.column(column).to_numpy()[rows]
    return np.stack([values[name] for name in DENSE_FEATURES], axis=1).astype(np.float32)


def context_inputs(pins: pa.Table, dense: np.ndarray, spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """The serving inputs (``spec["serving_inputs"]``) of a batch of pins in the non-personalised context."""
    n, steps = pins.num_rows, int(spec["sequence_length"])
    emb = fixed_width(pins.column("embedding"), f"{RAW_PINS}.embedding")
    surfaces = list(spec.get("surfaces") or SURFACES)
    # The context surface, when the model knows it (else the unknown surface, 0).
    surface = surfaces.index(CONTEXT_SURFACE) + 1 if CONTEXT_SURFACE in surfaces else 0
    return {
        "seq_pin_emb": np.zeros((n, steps, emb.shape[1]), dtype=np.float32),
        "seq_actions": np.zeros((n, steps), dtype=np.int64),
        "seq_categories": np.full((n, steps), -1, dtype=np.int64),
        "seq_age_hours": np.zeros((n, steps), dtype=np.float32),
        "seq_mask": np.zeros((n, steps), dtype=bool),
        "cand_pin_emb": emb.astype(np.float32),
        "pin_id": pins.column("pin_id").to_numpy().astype(np.int64),
        "user_id": np.full(n, -1, dtype=np.int64),  # absent: the model's zero embedding
        "category": pins.column("category").to_numpy().astype(np.int64),
        "creator_id": pins.column("creator_id").to_numpy().astype(np.int64),
        "surface": np.full(n, surface, dtype=np.int64),
        "dense": dense,
    }




def with_mean_auc(metrics: dict[str, Any]) -> dict[str, Any]:
    aucs = [v for v in metrics["auc"].values() if v is not None]
    metrics["mean_auc"] = sum(aucs) / len(aucs) if aucs else None
    return metrics


def load_truth(root: Location, ds: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Sorted impression ids and their true probabilities [n, len(LABELS)], or None without truth."""
    if not is_complete(root, TRUTH, ds):
        return None
    ids, probs = [], []
    for path in data_files(root, TRUTH, ds):
        table = read_parquet(path, columns=["impression_id", *(f"p_{label}" for label in LABELS)])
        ids.append(table.column("impression_id").to_numpy())
        probs.append(np.stack([table.column(f"p_{label}").to_numpy() for label in LABELS], axis=1))
    if not ids:
        return None
    all_ids = np.concatenate(ids)
    order = np.argsort(all_ids, kind="stable")
    return all_ids[order], np.concatenate(probs)[order]


@torch.no_grad()
def predict(
    model: nn.Module,
    stream: ExampleStream,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
) -> dict[str, np.ndarray]:
    """Probabilities, labels, baseline features, user and impression ids of every example of ``stream``.

    With ``ablation``, its probabilities too (``ablation_probs``), from the same pass over the data.
    """
    was_training = model.training
    model.eval()
    if ablation is not None:
        ablation.eval()
    probs: list[np.ndarray] = []
    ablation_probs: list[np.ndarray] = []
    users: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    dense: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    try:
        for i, batch in enumerate(stream):
            inputs = {k: v.to(device) for k, v in batch.items()}
            logits = model(inputs)
            probs.append(torch.stack([torch.sigmoid(logits[lb].float()) for lb in LABELS], 1).cpu().numpy())
            if ablation is not None:
                other = ablation(inputs)
                ablation_probs.append(torch.stack([torch.sigmoid(other[lb].float()) for lb in LABELS], 1).cpu().numpy())
            users.append(batch["user_id"].numpy())
            labels.append(batch["labels"].numpy())
            dense.append(batch["dense"].numpy())
            ids.append(batch["impression_id"].numpy())
            if on_batch is not None:
                on_batch(i)
    finally:
        model.train(was_training)
    width = len(LABELS)
    out = {
        "probs": np.concatenate(probs) if probs else np.zeros((0, width)),
        "user_id": np.concatenate(users) if users else np.zeros(0, dtype=np.int64),
        "labels": np.concatenate(labels) if labels else np.zeros((0, width)),
        "dense": np.concatenate(dense) if dense else np.zeros((0, len(DENSE_FEATURES))),
        "impression_id": np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64),
    }
    if ablation is not None:
        out["ablation_probs"] = np.concatenate(ablation_probs) if ablation_probs else np.zeros((0, width))
    return out


def evaluate(
    model: nn.Module,
    root: Location,
    eval_ds: str,
    *,
    sequence_length: int,
    batch_size: int = 1024,
    pins: PinEmbeddings | None = None,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
    surfaces: tuple[str, ...] = SURFACES,
) -> dict[str, Any]:
    """Evaluate ``model`` (a PinRanker, not DDP-wrapped) on the examples of ``eval_ds``.

    Returns ``{"auc", "hit3", "baseline_auc", "baseline_hit3", "oracle_auc", "oracle_ratio", "logloss",
    "calibration": {label: float | None}, "examples": n}``, plus ``"ablation_auc"``, ``"ablation_hit3"``
    and ``"sequence_lift"`` (auc - ablation_auc) given ``ablation``; a metric that is undefined (one
    class only, no truth) is None. ``oracle_auc`` and ``oracle_ratio`` are ``{}`` without a ``truth``
    partition for ``eval_ds``.
    """
    out = predict_day(model, root, eval_ds, sequence_length=sequence_length, batch_size=batch_size, pins=pins,
                      device=device, on_batch=on_batch, ablation=ablation, surfaces=surfaces)
    return metrics_of(out, root, eval_ds)


def predict_day(
    model: nn.Module,
    root: Location,
    eval_ds: str,
    *,
    sequence_length: int,
    batch_size: int = 1024,
    pins: PinEmbeddings | None = None,
    device: torch.device | str = "cpu",
    on_batch: Callable[[int], None] | None = None,
    ablation: nn.Module | None = None,
    surfaces: tuple[str, ...] = SURFACES,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, np.ndarray]:
    """:func:`predict` over the examples of ``eval_ds``: this rank's share of its row groups (all with one rank)."""
    pins = pins or PinEmbeddings.from_snapshot(root, eval_ds)
    stream = ExampleStream(
        root, [eval_ds], lambda table: encode_batch(table, pins, sequence_length, surfaces), batch_size=batch_size,
        dataset=EXAMPLES, columns=EXAMPLE_COLUMNS, shuffle=False, rank=rank, world_size=world_size,
    )
    return predict(model, stream, device=device, on_batch=on_batch, ablation=ablation)


def metrics_of(out: dict[str, np.ndarray], root: Location, eval_ds: str) -> dict[str, Any]:
    """:func:`evaluate`'s metrics of :func:`predict`'s output."""
    probs, labels, dense, users = out["probs"], out["labels"], out["dense"], out["user_id"]
    result: dict[str, Any] = {
        "auc": {},
        "hit3": {},
        "baseline_auc": {},
        "baseline_hit3": {},
        "oracle_auc": {},
        "oracle_ratio": {},
        "logloss": {},
        "calibration": {},
        "examples": int(labels.shape[0]),
    }
    for i, label in enumerate(LABELS):
        y = labels[:, i]
        result["auc"][label] = finite(auc(probs[:, i], y))
        result["logloss"][label] = finite(log_loss(probs[:, i], y))
        result["calibration"][label] = finite(calibration(probs[:, i], y))
        baseline = dense[:, DENSE_FEATURES.index(BASELINE_FEATURE[label])]
        result["baseline_auc"][label] = finite(auc(baseline, y))
        result["hit3"][label] = finite(hit_at_k(probs[:, i], y, users))
        result["baseline_hit3"][label] = finite(hit_at_k(baseline, y, users))
    if "ablation_probs" in out:
        result["ablation_auc"], result["ablation_hit3"], result["sequence_lift"] = {}, {}, {}
        for i, label in enumerate(LABELS):
            y = labels[:, i]
            result["ablation_auc"][label] = finite(auc(out["ablation_probs"][:, i], y))
            result["ablation_hit3"][label] = finite(hit_at_k(out["ablation_probs"][:, i], y, users))
            a, b = result["auc"][label], result["ablation_auc"][label]
            result["sequence_lift"][label] = None if a is None or b is None else a - b

    truth = load_truth(root, eval_ds)
    if truth is not None:
        truth_ids, truth_probs = truth
        ids = out["impression_id"]
        pos = np.minimum(np.searchsorted(truth_ids, ids), max(len(truth_ids) - 1, 0))
        found = truth_ids[pos] == ids if len(truth_ids) else np.zeros(len(ids), dtype=bool)
        result["oracle_coverage"] = float(found.mean()) if len(ids) else 0.0
        for i, label in enumerate(LABELS):
            oracle = finite(auc(truth_probs[pos[found], i], labels[found, i]))
            result["oracle_auc"][label] = oracle
            ratio = oracle_ratio(result["auc"][label], oracle)
            if ratio is not None:
                result["oracle_ratio"][label] = ratio
    return result

