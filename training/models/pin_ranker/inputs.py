"""The ranker's input: rows of ``examples`` → the model's tensors, and the ids its managed tables give a row."""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from core.contracts import DENSE_FEATURES, EXAMPLES, LABELS, SURFACES
from core.storage import Location, data_files, read_parquet
from training.data import Alloc, PinEmbeddings, new_tensor
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


# What encode_ids gives, in this order.
ENCODED = ("seq_pin_rows", "seq_actions", "seq_categories", "seq_age_hours", "seq_mask", "cand_pin_emb", "pin_id",
           "user_id", "category", "creator_id", "surface", "dense", "labels", "impression_id")


def _list_values(column: pa.ChunkedArray | pa.Array, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``steps`` items of each list, as one flat array (row after row), and how many each row has."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = arr.offsets.to_numpy().astype(np.int64)
    flat = arr.values.to_numpy(zero_copy_only=False)
    full = np.diff(offsets)
    lengths = np.minimum(full, steps)
    if np.array_equal(lengths, full):
        return flat[offsets[0]:offsets[-1]], lengths
    # Longer lists cut to their first ``steps`` items: each kept item's position in ``flat``.
    starts = np.repeat(offsets[:-1] - (np.cumsum(lengths) - lengths), lengths)
    return flat[starts + np.arange(int(lengths.sum()))], lengths


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
    table: pa.Table,
    pins: PinEmbeddings,
    sequence_length: int,
    surfaces: tuple[str, ...] = SURFACES,
    alloc: Alloc = new_tensor,
) -> dict[str, torch.Tensor]:
    """:func:`encode_batch` but for the sequence's content embeddings: ``seq_pin_rows`` [B, N], their rows in the
    table of ``pins`` (:meth:`PinEmbeddings.table_rows`), in place of ``seq_pin_emb`` [B, N, D], D times smaller
    (:func:`with_sequence_embeddings` gathers them). The search for each id's row is done here, in the input
    workers; what is left to the trainer is the gather.

    Each tensor is made by ``alloc`` and written once, in place: an input worker's ``alloc`` gives views of the
    shared buffer its item crosses to the trainer in (``training.data.Placement``), so nothing is copied there."""
    rows, steps = table.num_rows, sequence_length
    out: dict[str, torch.Tensor] = {}

    def new(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> np.ndarray:
        out[name] = alloc(shape, dtype)
        return out[name].numpy()

    seq_pins, lengths = _list_values(table.column("seq_pin_ids"), steps)
    mask = new("seq_mask", (rows, steps), torch.bool)
    np.less(np.arange(steps)[None, :], lengths[:, None], out=mask)
    # The padding: row len(pins) (the zero row), action 0, category -1, age 0. The real items in row-major order.
    for name, values, dtype, padding in (
        ("seq_pin_rows", pins.table_rows(seq_pins), torch.int64, len(pins)),
        ("seq_actions", _list_values(table.column("seq_actions"), steps)[0].astype(np.int64) + 1, torch.int64, 0),
        ("seq_categories", _list_values(table.column("seq_categories"), steps)[0], torch.int64, -1),
        ("seq_age_hours", _list_values(table.column("seq_age_hours"), steps)[0], torch.float32, 0),
    ):
        padded = new(name, (rows, steps), dtype)
        padded.fill(padding)
        padded[mask] = values
    pins.take(pins.table_rows(table.column("pin_id").to_numpy()), out=new("cand_pin_emb", (rows, pins.dim), torch.float32))
    for name in ("pin_id", "user_id", "category", "creator_id"):
        new(name, (rows,), torch.int64)[:] = table.column(name).to_numpy()
    new("surface", (rows,), torch.int64)[:] = surface_ids(table.column("surface"), surfaces)
    for name, columns in (("dense", DENSE_FEATURES), ("labels", LABELS)):
        np.stack([table.column(c).to_numpy() for c in columns], axis=1, out=new(name, (rows, len(columns)), torch.float32))
    new("impression_id", (rows,), torch.int64)[:] = table.column("impression_id").to_numpy()
    return {name: out[name] for name in ENCODED}


def with_sequence_embeddings(batch: dict[str, torch.Tensor], pins: PinEmbeddings) -> dict[str, torch.Tensor]:
    """``seq_pin_rows`` of :func:`encode_ids` replaced by ``seq_pin_emb``, their content embeddings (zeros past the
    sequence's end and for unknown pins), first among the inputs as :func:`encode_batch` makes them. ``pins`` must
    be the table the rows were found in: every process's context is read from the same snapshot (``prepare``)."""
    embeddings = pins.gather(batch["seq_pin_rows"])  # on the batch's device: the training step's
    rest = {name: value for name, value in batch.items() if name != "seq_pin_rows"}
    return {"seq_pin_emb": embeddings, **rest}

