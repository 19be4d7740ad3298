"""The ranker's side of the model SDK (training/sdk.py): what the platform drives, built from this package's
model, params, inputs, evaluation and corpus scoring."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from core.contracts import DENSE_FEATURES, EMBEDDING_DIM, EXAMPLES, LABELS, RAW_PINS
from core.failures import DataError
from core.storage import Location
from training.data import Alloc, PinEmbeddings, latest_complete_day, new_tensor
from training.models.pin_ranker.evaluate import evaluate, metrics_of, predict_day, with_mean_auc
from training.models.pin_ranker.inputs import EXAMPLE_COLUMNS, choose_managed_ids, encode_ids, with_sequence_embeddings
from training.models.pin_ranker.model import (
    COUNT_FEATURES,
    SERVING_INPUTS,
    TABLE_STD,
    TASTE_STD,
    PinRanker,
    ServingModule,
    multitask_loss,
)
from training.models.pin_ranker.params import RankerParams
from training.models.pin_ranker.score import context_dense, context_inputs, history_priors, read_pin_window
from training.sdk import ModelFamily


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
            raise DataError(f"{RAW_PINS} embeddings are {pins.dim}-d, the model's params say {self.params.embedding_dim}")
        if self.params.id_tables == "managed":
            self.managed_ids = choose_managed_ids(root, train_days, self.params.model_config())
        return pins

    def encode(self, table: pa.Table, context: Any) -> dict[str, torch.Tensor]:
        return self.encode_into(table, context, new_tensor)

    def encode_into(self, table: pa.Table, context: Any, alloc: Alloc) -> dict[str, torch.Tensor]:
        batch = encode_ids(table, context, self.params.sequence_length, self.params.surfaces, alloc)
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
            surfaces=self.params.surfaces, rank=rank, world_size=world_size, sharded=True,
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
            self._windows = {key: read_pin_window(root, ds)}
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
