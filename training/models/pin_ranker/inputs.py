"""The ranker's input: rows of ``examples`` → the model's tensors, and the ids its managed tables give a row."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from core.contracts import DENSE_FEATURES, EXAMPLES, LABELS, SURFACES
from core.storage import Location, data_files, read_parquet
from training.data import PinEmbeddings
from training.models.pin_ranker.ids import MANAGED_FEATURES, managed_layout, select_managed
from training.models.pin_ranker.model import ModelConfig

log = logging.getLogger(__name__)

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
    """Rows of the ``examples`` schema → the model's input tensors (see ``model.py``) + labels."""
    return with_sequence_embeddings(encode_ids(table, pins, sequence_length, surfaces), pins)


def encode_ids(
    table: pa.Table, pins: PinEmbeddings, sequence_length: int, surfaces: tuple[str, ...] = SURFACES
) -> dict[str, torch.Tensor]:
    """:func:`encode_batch` but for the sequence's content embeddings: ``seq_pin_rows`` [B, N], their rows in the
    table of ``pins`` (:meth:`PinEmbeddings.table_rows`), in place of ``seq_pin_emb`` [B, N, D], D times smaller
    (:func:`with_sequence_embeddings` gathers them). The search for each id's row is done here, in the input
    workers; what is left to the trainer is the gather."""

    def col(name: str, dtype: type) -> np.ndarray:
        return np.array(table.column(name).to_numpy(), dtype=dtype)

    seq_pins, mask = _pad_lists(table.column("seq_pin_ids"), sequence_length, np.int64)
    actions, _ = _pad_lists(table.column("seq_actions"), sequence_length, np.int64)
    categories, _ = _pad_lists(table.column("seq_categories"), sequence_length, np.int64)
    ages, _ = _pad_lists(table.column("seq_age_hours"), sequence_length, np.float32)
    pin_ids = col("pin_id", np.int64)
    arrays = {
        "seq_pin_rows": pins.table_rows(seq_pins, mask),
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
    """``seq_pin_rows`` of :func:`encode_ids` replaced by ``seq_pin_emb``, their content embeddings (zeros past the
    sequence's end and for unknown pins), first among the inputs as :func:`encode_batch` makes them. ``pins`` must
    be the table the rows were found in: every process's context is read from the same snapshot (``prepare``)."""
    embeddings = pins.gather(batch["seq_pin_rows"])  # on the batch's device: the training step's
    rest = {name: value for name, value in batch.items() if name != "seq_pin_rows"}
    return {"seq_pin_emb": embeddings, **rest}

