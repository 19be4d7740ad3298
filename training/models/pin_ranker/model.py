"""The ``pin_ranker`` model family: a TransAct-style multi-task ranker (action sequence + sparse ids + dense counts).

Trains on the ``examples`` dataset (impressions with labels and features as of the day before, built by
``pin_daily_features``); heads click, repin and hide; an ablation without the action sequence trains in
lockstep on the same batches so that the report shows what the sequence adds. This module is the network;
``family.py`` is the SDK side (:class:`~training.models.pin_ranker.family.PinRankerFamily`).

Per example the model reads (names are the keys of a batch, see ``PinRankerFamily.encode`` in ``family.py``):

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
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from core.contracts import ACTIONS, DENSE_FEATURES, EMBEDDING_DIM, LABELS, SURFACES
from training.models.pin_ranker.ids import (
    MANAGED_EMPTY,
    MANAGED_FEATURES,
    hash_ids,
    managed_layout,
    managed_rows,
)

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


@dataclass(frozen=True)
class RankerSizes:
    """The sizes of a PinRanker that its params set as they are (:class:`ModelConfig` and the family's
    ``RankerParams`` both extend this); defaults are small enough for CPU training."""

    sequence_length: int = 50  # user sequence length N the model reads (most recent actions first)
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
    # How raw ids become table rows. "hashed": a fixed hash into the buckets (hash_ids: ids collide at random).
    # "managed": the ids most frequent in the training days' examples get a row each, the others share the last
    # managed_tail of the rows by hash (managed_rows; docs/training.md, "Managed id tables").
    id_tables: str = "hashed"
    managed_tail: float = 0.1


@dataclass(frozen=True)
class ModelConfig(RankerSizes):
    """Everything a PinRanker is built from: its sizes and what the params resolve (the data's widths)."""

    use_sequence: bool = True  # False: the ablation without the action sequence (tower and match features)
    embedding_dim: int = EMBEDDING_DIM  # width of the pins' content embedding (the data's)
    surfaces: int = len(SURFACES)  # size of the surface vocabulary

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
                self.register_buffer(f"managed_{feature}", torch.full((own + 1,), MANAGED_EMPTY, dtype=torch.int64))

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
            values = torch.full_like(buffer, MANAGED_EMPTY, device="cpu")
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

