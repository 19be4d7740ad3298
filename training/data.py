"""Streaming a model family's training rows from Parquet partitions into batches of tensors.

:class:`ExampleStream` never reads a whole day: its unit of work is a whole Parquet row group, decoded once
per epoch by the one reader (rank and DataLoader worker) it is dealt to; a row group is never sliced between
readers, because a slice costs the decoding of its whole row group. From the Parquet footers alone it plans, for
each epoch, which units every rank and every DataLoader worker reads, in an order that depends only on
``(seed, epoch)``. Because the plan is known up front, every rank can compute how many batches each rank will
produce and all stop at the same step (:meth:`ExampleStream.steps_per_epoch`): no rank waits in a collective for
a rank that ran out of data. With fewer row groups than readers some readers idle, and ranks dealt fewer rows
leave the others' tail of an epoch untrained (a different tail each epoch). The feature build writes row groups
of 64Ki rows: a production day of millions of examples is hundreds of units, a small day one.

Which dataset and columns are read, and how rows become tensors, is the model family's (``training.sdk``):
the stream hands the family's ``encode`` tables of up to ``ITEM_ROWS`` rows (whole batches) and cuts what it
returns into batches of ``batch_size`` rows. Examples store each user's action
sequence by reference (``seq_ds``, ``seq_len``: see ``core.contracts``); the stream resolves a reference into the four
sequence lists (:class:`SequenceResolver`), so an ``encode`` sees the same columns and values as if they had been
copied into every row. Pin content embeddings (for
families that join the pin snapshot) come from a :class:`PinEmbeddings` table of one ``raw/pins`` snapshot.
The storage root is a local path or a URL (``s3://bucket/prefix``, through ``core.storage``): on
an object store a row group is read with ranged GETs of its column chunks, never the whole file.

A training job reads the versions of its inputs pinned when it was planned (RUN.json ``inputs``): its code passes
``RunConfig.input_root`` (a ``core.storage.InputPins``) where these readers take a root, and every ``core.storage``
read here (the examples' files and metadata, the referenced sequences, the pin snapshot) then resolves a pinned
partition to its pinned copy, so a partition rebuilt during the run changes nothing read here (the units planned at
start keep pointing at the pinned files). Given a plain root they read the live partitions.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import IterableDataset, get_worker_info

from core.contracts import (
    EXAMPLES,
    RAW_PINS,
    SEQUENCE_COLUMNS,
    SEQUENCE_FIELDS,
    SEQUENCE_REF_COLUMNS,
    USER_SEQUENCE,
    USER_SEQUENCE_SCHEMA,
    SequenceDigest,
    combined_digest,
)
from core.failures import DataError
from core.storage import (
    METADATA_FILE,
    complete_days,
    data_files,
    ds_str,
    is_complete,
    join,
    parquet_file,
    pins_of,
    read_json,
    read_metadata,
)


def latest_complete_day(root: str | os.PathLike[str], dataset: str, ds: str) -> str | None:
    """The newest complete partition of ``dataset`` on or before ``ds``."""
    days = [d for d in complete_days(root, dataset) if d <= ds_str(ds)]
    return days[-1] if days else None


def snapshot(
    root: str | os.PathLike[str], dataset: str, ds: str, key: str, columns: list[str]
) -> tuple[pa.Table, str]:
    """``core.storage.read_snapshot`` for a training job: a DataError naming the dataset when there is none."""
    from core.storage import read_snapshot

    table, day = read_snapshot(root, dataset, ds, key, columns)
    if day is None or not table.num_rows:
        raise DataError(f"no complete {dataset} snapshot on or before ds={ds} under {root}")
    return table, day


def fixed_width(column: pa.ChunkedArray, where: str) -> np.ndarray:
    """A list column of equal-length float lists as a float32 [n, width] array; DataError naming ``where`` (the
    dataset and column) if the widths differ."""
    lists = column.combine_chunks()
    if pa.types.is_fixed_size_list(lists.type):
        return lists.flatten().to_numpy(zero_copy_only=False).reshape(len(lists), lists.type.list_size).astype(np.float32)
    lengths = pc.list_value_length(lists).to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths.min() != lengths.max()):
        raise DataError(f"{where} has rows of widths {sorted(set(lengths.tolist()))[:5]}: every row must have "
                        "the same width (validation.embedding_dim checks it)")
    width = int(lengths[0]) if len(lengths) else 0
    return lists.flatten().to_numpy(zero_copy_only=False).reshape(len(lists), width).astype(np.float32)


class PinEmbeddings:
    """Content embedding of every pin of the ``raw/pins`` snapshot as of a day: a float32 [n, dim] array + sorted ids.

    ``dim`` is the data's (32 in the synthetic world). ``lookup`` maps any array of pin ids to their embeddings
    (zeros for pins not in the snapshot) with a vectorised binary search: no Python dict.
    """

    def __init__(self, pin_ids: np.ndarray, vectors: np.ndarray, ds: str | None = None) -> None:
        order = np.argsort(pin_ids, kind="stable")
        self.pin_ids = np.ascontiguousarray(pin_ids[order], dtype=np.int64)
        self.vectors = np.ascontiguousarray(vectors[order], dtype=np.float32)
        if self.vectors.ndim != 2 or len(self.vectors) != len(self.pin_ids):
            raise ValueError(f"pin embeddings must be [n, dim] for n={len(self.pin_ids)} ids, got {self.vectors.shape}")
        self.dim = int(self.vectors.shape[1])
        self.ds = ds
        # The vectors and a zero row after them (row len(self): an unknown pin), and, for ids that are small
        # non-negative integers (as they usually are), a direct id -> row index instead of a binary search.
        self._padded = np.concatenate([self.vectors, np.zeros((1, self.dim), dtype=np.float32)])
        self._dense: np.ndarray | None = None
        self._on_device: dict[str, torch.Tensor] = {}  # the padded table, per device it is gathered on
        if len(self.pin_ids) and self.pin_ids[0] >= 0 and self.pin_ids[-1] < 16 * len(self.pin_ids) + 4096:
            self._dense = np.full(int(self.pin_ids[-1]) + 1, -1, dtype=np.int64)
            self._dense[self.pin_ids] = np.arange(len(self.pin_ids))

    @classmethod
    def from_snapshot(cls, root: str | os.PathLike[str], ds: str) -> PinEmbeddings:
        """The ``raw/pins`` snapshot as of ``ds`` (the newest full one, with any increments after it); DataError
        if there is none, or when the embeddings are not all of one width."""
        table, day = snapshot(root, RAW_PINS, ds, "pin_id", ["embedding"])
        return cls(table.column("pin_id").to_numpy(), fixed_width(table.column("embedding"), f"{RAW_PINS}.embedding"), ds=day)

    def __len__(self) -> int:
        return len(self.pin_ids)

    def rows(self, pin_ids: np.ndarray) -> np.ndarray:
        """Row of each id in the table, -1 where the pin is unknown."""
        pin_ids = np.asarray(pin_ids, dtype=np.int64)
        if len(self.pin_ids) == 0:
            return np.full(np.shape(pin_ids), -1, dtype=np.int64)
        if self._dense is not None:
            inside = (pin_ids >= 0) & (pin_ids < len(self._dense))
            return np.where(inside, self._dense[np.where(inside, pin_ids, 0)], -1)
        pos = np.searchsorted(self.pin_ids, pin_ids)
        pos = np.minimum(pos, len(self.pin_ids) - 1)
        return np.where(self.pin_ids[pos] == pin_ids, pos, -1)

    def table_rows(self, pin_ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Row of each id (any shape) in the table :meth:`take` reads: the pin's, or the zero row after the last
        (``len(self)``) for an unknown pin and where ``mask`` is False."""
        rows = self.rows(pin_ids)
        known = rows >= 0 if mask is None else (rows >= 0) & mask
        return np.where(known, rows, len(self.pin_ids))

    def take(self, table_rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The embeddings at ``table_rows`` (of :meth:`table_rows`) as float32 [..., dim]: a gather, no search
        (into ``out`` when given)."""
        if out is None:
            return np.take(self._padded, table_rows, axis=0)
        if len(table_rows) and not 0 <= int(table_rows.min()) <= int(table_rows.max()) <= len(self.pin_ids):
            raise IndexError(f"table rows outside [0, {len(self.pin_ids)}]")
        return np.take(self._padded, table_rows, axis=0, out=out, mode="clip")  # clip: checked, and unbuffered

    def gather(self, table_rows: torch.Tensor) -> torch.Tensor:
        """:meth:`take` on the device of ``table_rows`` (the table copied there once): the same floats."""
        key = str(table_rows.device)
        if key not in self._on_device:
            self._on_device[key] = torch.from_numpy(self._padded).to(table_rows.device)
        return torch.nn.functional.embedding(table_rows, self._on_device[key])

    def lookup(self, pin_ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Embeddings of ``pin_ids`` (any shape) as float32 [..., dim]; unknown pins, and those where ``mask`` is
        False, get zeros."""
        return self.take(self.table_rows(pin_ids, mask))


# --- sequences referenced by examples ------------------------------------------------------------


def _has_refs(names: Sequence[str]) -> bool:
    return all(c in names for c in SEQUENCE_REF_COLUMNS)


def _needs_resolving(wanted: Sequence[str], names: Sequence[str]) -> bool:
    """Whether reading ``wanted`` from a file with columns ``names`` takes resolving its sequence references."""
    return _has_refs(names) and any(c in SEQUENCE_COLUMNS and c not in names for c in wanted)


def _check_sequence_partition(root: str | os.PathLike[str], dataset: str, ds: str) -> None:
    """DataError when the examples of ``ds`` reference a ``features/user_sequence`` partition that is not there."""
    meta = read_metadata(root, dataset, ds)
    seq_ds = meta.get("sequence_ds")
    if meta.get("sequence_digest") and seq_ds and not is_complete(root, USER_SEQUENCE, seq_ds):
        raise DataError(
            f"{dataset} ds={ds} references the sequences of {USER_SEQUENCE} ds={seq_ds}, which is missing or "
            f"incomplete under {root}: rebuild that day (`python -m features.build --step sequences --ds {seq_ds}`)"
        )


@dataclass(frozen=True)
class _Sequences:
    """One ``features/user_sequence`` partition, loaded for lookups: users sorted, lists as offsets + values."""

    user_ids: np.ndarray  # int64, sorted
    offsets: np.ndarray  # int64 [n + 1], into the values, in user_ids order
    values: dict[str, pa.Array]  # seq_pin_ids, seq_actions, seq_categories values
    ts_us: np.ndarray  # int64 microseconds of each value
    digests: tuple[str, ...]  # of the rows as one stream, and of the files' (a merged sharded partition's)


class SequenceResolver:
    """Resolves examples' sequence references into the lists a model family reads.

    An example's ``seq_ds`` and ``seq_len`` name the first ``seq_len`` actions of its user's row in
    ``features/user_sequence`` of ``seq_ds`` (the day before the example's). :meth:`resolve` replaces them by
    ``seq_pin_ids``, ``seq_actions``, ``seq_categories`` and ``seq_age_hours`` (impression ts - action ts, hours,
    float32: the arithmetic the feature build used when it copied the lists), equal to the copied lists. Each
    sequence partition is loaded once per process and checked against the content digest the examples recorded
    (a partition rebuilt with other content since is a DataError, not silently other features); every action must
    be strictly before its impression (point in time), else a DataError.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = root
        self._loaded: dict[str, _Sequences] = {}

    def sequences(self, seq_ds: str) -> _Sequences:
        if seq_ds not in self._loaded:
            try:
                files = data_files(self.root, USER_SEQUENCE, seq_ds)
            except FileNotFoundError as e:
                raise DataError(f"examples reference the sequences of ds={seq_ds}, but {e}") from None
            digest = SequenceDigest()
            file_digests = []
            tables = []
            for path in files:
                with parquet_file(path, pins_of(self.root)) as parquet:
                    table = parquet.read().select(USER_SEQUENCE_SCHEMA.names).cast(USER_SEQUENCE_SCHEMA)
                digest.update(table)
                if len(files) > 1:
                    file_digests.append(SequenceDigest().update(table).hexdigest())
                tables.append(table)
            table = pa.concat_tables(tables) if tables else USER_SEQUENCE_SCHEMA.empty_table()
            user_ids = table.column("user_id").to_numpy()
            order = np.argsort(user_ids, kind="stable")
            if len(order) and np.any(np.diff(user_ids[order]) == 0):
                raise DataError(f"{USER_SEQUENCE} ds={seq_ds} has more than one row for a user")
            if not np.array_equal(order, np.arange(len(order))):
                table = table.take(pa.array(order))
            lists = {name: table.column(name).combine_chunks() for name in USER_SEQUENCE_SCHEMA.names[1:]}
            offsets = lists["seq_ts"].offsets.to_numpy().astype(np.int64)
            for name, array in lists.items():
                if not np.array_equal(array.offsets.to_numpy(), offsets):
                    raise DataError(f"{USER_SEQUENCE} ds={seq_ds}: the lists of a row differ in length ({name}, seq_ts)")
            base = int(offsets[0])
            values = {name: lists[name].values.slice(base, int(offsets[-1]) - base) for name in lists}
            self._loaded[seq_ds] = _Sequences(
                user_ids=np.ascontiguousarray(user_ids[order], dtype=np.int64),
                offsets=offsets - base,
                values={name: values[name] for name in ("seq_pin_ids", "seq_actions", "seq_categories")},
                ts_us=values["seq_ts"].cast(pa.int64()).to_numpy(zero_copy_only=False),
                digests=(digest.hexdigest(), *([combined_digest(file_digests)] if file_digests else [])),
            )
        return self._loaded[seq_ds]

    def resolve(self, table: pa.Table, digest: str | None, where: str = "examples") -> pa.Table:
        """``table`` (with ``user_id``, ``ts``, ``seq_ds``, ``seq_len``) with the four lists inserted before the
        references (callers select the columns they want).

        ``digest``: the ``sequence_digest`` the examples recorded (None: they reference no sequences). ``where``
        names the examples in errors.
        """
        seq_len = table.column("seq_len").to_numpy().astype(np.int64)
        days = pc.unique(table.column("seq_ds").filter(pc.greater(table.column("seq_len"), 0))).to_pylist()
        if len(days) > 1:  # never written so; resolved day by day, then put back in order
            groups = [pc.indices_nonzero(pc.equal(table.column("seq_ds"), day)) for day in days]
            rest = pc.indices_nonzero(pc.invert(pc.is_in(table.column("seq_ds"), pa.array(days))))
            index = pa.concat_arrays([*groups, rest])
            parts = [self.resolve(table.take(rows), digest, where) for rows in [*groups, rest]]
            return pa.concat_tables(parts).take(pc.sort_indices(index))
        n = table.num_rows
        lengths = seq_len
        out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lengths, out=out_offsets[1:])
        impression_us = table.column("ts").cast(pa.int64()).to_numpy()
        if days:
            seq_ds = days[0].isoformat()
            sequences = self.sequences(seq_ds)
            if digest not in sequences.digests:
                raise DataError(
                    f"{where} reference the sequences of {USER_SEQUENCE} ds={seq_ds} with content digest {digest}, "
                    f"but that partition now holds {sequences.digests[0]}: it was rebuilt from other data after these "
                    f"examples; rebuild the examples (`python -m features.build --step examples --ds <the examples' day>`)"
                )
            users = table.column("user_id").to_numpy()
            if len(sequences.user_ids):
                pos = np.minimum(np.searchsorted(sequences.user_ids, users), len(sequences.user_ids) - 1)
                found = sequences.user_ids[pos] == users
                available = np.where(found, sequences.offsets[pos + 1] - sequences.offsets[pos], 0)
            else:
                pos, available = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
            bad = np.flatnonzero(lengths > available)
            if bad.size:
                i = int(bad[0])
                raise DataError(
                    f"{where}: user {int(users[i])} references {int(lengths[i])} actions of {USER_SEQUENCE} "
                    f"ds={seq_ds}, which holds {int(available[i])} for them ({bad.size} such rows)"
                )
            starts = np.where(lengths > 0, sequences.offsets[pos], 0)
            index = np.arange(out_offsets[-1], dtype=np.int64) + np.repeat(starts - out_offsets[:-1], lengths)
            values = {name: array.take(pa.array(index)) for name, array in sequences.values.items()}
            action_us = sequences.ts_us[index]
        else:  # no row references a sequence
            values = {name: array.slice(0, 0) for name, array in self._empty_values().items()}
            action_us = np.zeros(0, dtype=np.int64)
        impression_of_value = np.repeat(impression_us, lengths)
        late = np.flatnonzero(action_us >= impression_of_value)
        if late.size:
            raise DataError(
                f"{where}: {late.size} referenced actions are not before their impression (point in time), e.g. "
                f"action at {int(action_us[late[0]])} us for an impression at {int(impression_of_value[late[0]])} us"
            )
        # The same arithmetic as the copied lists had: microseconds difference / 3600e6 as float64, then float32.
        ages = pa.array(((impression_of_value - action_us) / 3600e6).astype(np.float32))
        offsets = pa.array(out_offsets.astype(np.int32))
        resolved = {
            **{name: pa.ListArray.from_arrays(offsets, values[name]) for name in ("seq_pin_ids", "seq_actions", "seq_categories")},
            "seq_age_hours": pa.ListArray.from_arrays(offsets, ages),
        }
        at = table.column_names.index("seq_ds")
        out = table
        for i, field in enumerate(SEQUENCE_FIELDS):
            out = out.add_column(at + i, field, resolved[field.name].cast(field.type))
        return out

    @staticmethod
    def _empty_values() -> dict[str, pa.Array]:
        return {name: pa.array([], USER_SEQUENCE_SCHEMA.field(name).type.value_type)
                for name in ("seq_pin_ids", "seq_actions", "seq_categories")}


def resolved_columns(names: Sequence[str]) -> list[str]:
    """The columns a reader sees of a file with columns ``names``: the sequence lists where the references are."""
    if not _has_refs(names):
        return list(names)
    return [c for name in names if name != "seq_len" for c in (SEQUENCE_COLUMNS if name == "seq_ds" else [name])]


def read_columns(wanted: Sequence[str], names: Sequence[str]) -> list[str]:
    """The columns to read from a file with ``names`` to produce ``wanted`` (references instead of lists)."""
    if not _needs_resolving(wanted, names):
        return list(wanted)
    need = [c for c in wanted if c not in SEQUENCE_COLUMNS] + ["user_id", "ts", *SEQUENCE_REF_COLUMNS]
    return list(dict.fromkeys(need))


def read_examples(
    root: str | os.PathLike[str], ds: str, columns: Sequence[str] = (), *, dataset: str = EXAMPLES
) -> pa.Table:
    """A whole examples partition as readers see it: sequence references resolved (:class:`SequenceResolver`).

    ``columns``: the columns wanted, in order (default: every column, the sequence lists where the references
    were). For tests, tools and small days; training streams row groups (:class:`ExampleStream`).
    """
    ds = ds_str(ds)
    try:
        files = data_files(root, dataset, ds)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    resolver = SequenceResolver(root)
    digest = read_metadata(root, dataset, ds).get("sequence_digest")
    tables = []
    for path in files:
        with parquet_file(path, pins_of(root)) as parquet:
            names = parquet.schema_arrow.names
            wanted = list(columns) or resolved_columns(names)
            table = parquet.read(columns=read_columns(wanted, names))
        if _needs_resolving(wanted, names):
            table = resolver.resolve(table, digest, f"{dataset} ds={ds}")
        tables.append(table.select(wanted))
    return pa.concat_tables(tables)


# --- planning the work ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkUnit:
    """Rows [start, stop) of one row group of one Parquet file (of the partition of day ``ds``)."""

    path: str
    row_group: int
    start: int
    stop: int
    ds: str = ""

    @property
    def rows(self) -> int:
        return self.stop - self.start


def example_units(
    root: str | os.PathLike[str],
    days: Sequence[str],
    *,
    dataset: str = EXAMPLES,
    columns: Sequence[str] = (),
) -> list[WorkUnit]:
    """Work units of the ``dataset`` partitions of ``days`` in a fixed order, read from the footers only: one per
    non-empty row group."""
    units: list[WorkUnit] = []
    for ds in days:
        try:
            files = data_files(root, dataset, ds)
        except FileNotFoundError as e:
            raise DataError(str(e)) from None
        if not files:
            raise DataError(f"{dataset} partition ds={ds} under {root} has a marker but no Parquet file")
        for path in files:
            with parquet_file(path, pins_of(root)) as parquet:
                meta, names = parquet.metadata, parquet.schema_arrow.names
            missing = [c for c in columns if c not in names and not (c in SEQUENCE_COLUMNS and _has_refs(names))]
            if missing:
                raise DataError(f"{path} lacks the {dataset} column(s) {', '.join(missing)}")
            if _needs_resolving(columns or names, names):
                _check_sequence_partition(root, dataset, ds)
            for rg in range(meta.num_row_groups):
                rows = meta.row_group(rg).num_rows
                if rows:
                    units.append(WorkUnit(path, rg, 0, rows, ds))
    return units


def balance(units: Sequence[WorkUnit], parts: int) -> list[list[WorkUnit]]:
    """Deal units (in the given order) to ``parts`` bins, each to the bin with the fewest rows so far."""
    bins: list[list[WorkUnit]] = [[] for _ in range(parts)]
    load = [0] * parts
    for unit in units:
        i = min(range(parts), key=lambda j: (load[j], j))
        bins[i].append(unit)
        load[i] += unit.rows
    return bins


def read_unit(
    root: str | os.PathLike[str], unit: WorkUnit, columns: Sequence[str] = (), resolver: SequenceResolver | None = None
) -> pa.Table:
    """The rows of one work unit as readers see them (sequence references resolved; ``columns`` as in
    :func:`read_examples`). For checks of a few rows (the preflight); training streams (:class:`ExampleStream`)."""
    with parquet_file(unit.path, pins_of(root)) as parquet:
        names = parquet.schema_arrow.names
        wanted = list(columns) or resolved_columns(names)
        resolve = _needs_resolving(wanted, names)
        table = parquet.read_row_group(unit.row_group, columns=read_columns(wanted, names))
    table = table.slice(unit.start, unit.rows)
    if resolve:
        folder = str(unit.path).replace(os.sep, "/").rsplit("/", 1)[0]
        try:
            digest = read_json(join(folder, METADATA_FILE)).get("sequence_digest")
        except FileNotFoundError:
            digest = None
        table = (resolver or SequenceResolver(root)).resolve(table, digest, folder)
    return table.select(wanted)


PACKED, LAYOUT = "_packed", "_layout"  # an item's tensors in one buffer (:func:`pack_item`)
# Rows encoded at once, and what a DataLoader worker hands over at a time (batches_per_item batches): encoding
# thousands of rows in one call costs a third less per row than a batch of hundreds, and what crosses from a worker
# to the trainer costs a fixed price per item (its layout, the loader's queues, the trainer's unpacking), which a
# small batch alone would not repay. 8192: two workers delivered 1.63-1.70x what none did on 2 cores, against
# 1.43-1.56x with 4096 and 1.58-1.68x with 16384 (benchmarks/input_pipeline.py, alternately). The rows' batches are
# the same either way (``encode`` is row-wise, see ``training.sdk``); a run resumed from a checkpoint taken with
# another item size keeps that one (``load_position``).
ITEM_ROWS = 8192


# How an encode makes its tensors (shape, dtype): :func:`new_tensor`, or an input worker's :class:`Placement`.
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class Placement:
    """An :data:`Alloc` over the buffer of a worker's next item (``target``; None: none yet): each tensor a view of
    its next bytes (64-byte aligned), so that an ``encode_into`` writes the item where it crosses to the trainer
    and :func:`pack_item` copies nothing; a tensor that does not fit is made as usual (and copied)."""

    def __init__(self, target: torch.Tensor | None) -> None:
        self.target, self.end = target, 0

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = int(np.prod(shape)) * dtype.itemsize
        start = -(-self.end // 64) * 64
        if self.target is None or start + nbytes > self.target.numel():
            return torch.empty(shape, dtype=dtype)
        self.end = start + nbytes
        return self.target[start:start + nbytes].view(dtype).view(shape)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Where ``tensor`` lies in ``target`` when it is one of this placement's (contiguous, inside), else None."""
        if self.target is None or not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != self.target.untyped_storage().data_ptr():
            return None
        start = tensor.data_ptr() - self.target.data_ptr()
        return start if 0 <= start and start + tensor.numel() * tensor.element_size() <= self.end else None


def split_rows(batch: dict[str, torch.Tensor], sizes: Sequence[int]) -> list[dict[str, torch.Tensor]]:
    """``batch`` (rows encoded at once) cut into batches of ``sizes`` rows, views of its tensors."""
    if len(sizes) == 1:
        return [batch]
    parts = [tensor.split(list(sizes)) for tensor in batch.values()]
    return [dict(zip(batch, views, strict=True)) for views in zip(*parts, strict=True)]


def pack_item(batch: dict[str, torch.Tensor], sizes: Sequence[int], buffers: ItemBuffers | None = None,
              item: ItemSlot | None = None, placement: Placement | None = None) -> dict[str, Any]:
    """The rows of an item (``batch``, its batches ``sizes`` rows each) as one contiguous byte buffer (the worker's
    next reused shared buffer from ``buffers``: ``item``, reserved before the batch was encoded, else the next;
    without ``buffers`` a private one) and its layout, to cross from a DataLoader worker to the trainer in one
    piece; :func:`unpack_item` gives back its batches as views of the same bytes. The tensors an ``encode_into``
    already wrote into the item's buffer (``placement``) stay where they are; the rest are copied in.

    A reused buffer crosses once per epoch (``PACKED`` is None after): a shared tensor sent costs a connection to
    the worker for its file descriptor and, in the trainer, a fresh mapping whose pages fault in again; the
    trainer keeps what crossed (:class:`HeldBuffers`) and reads the next items of that slot from it."""
    layout, placed = [], []
    end = placement.end if placement is not None else 0
    for name, tensor in batch.items():
        nbytes = tensor.numel() * tensor.element_size()
        start = placement.offset_of(tensor) if placement is not None else None
        placed.append(start is not None)
        if start is None:
            start = -(-end // 64) * 64  # aligned for any dtype's view
            end = start + nbytes
        layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), start, nbytes))
    sent: torch.Tensor | None
    if buffers is None:
        target = sent = torch.empty(end, dtype=torch.uint8)
        origin, slot = (-1, -1), -1
    else:
        target, sent, origin, slot = buffers.finish(item if item is not None else buffers.reserve(), end)
    # The placed tensors are in the target unless it is another buffer (the slot's grown, or one of the item's own).
    in_place = placement is not None and placement.target is not None and target.data_ptr() == placement.target.data_ptr()
    view = target.numpy()
    for (_, _, _, start, nbytes), tensor, is_placed in zip(layout, batch.values(), placed, strict=True):
        if not (in_place and is_placed):
            view[start:start + nbytes] = tensor.contiguous().numpy().reshape(-1).view(np.uint8)
    return {PACKED: sent, LAYOUT: json.dumps({"tensors": layout, "sizes": list(sizes), "origin": list(origin),
                                              "slot": slot})}


class HeldBuffers:
    """The trainer's end of the workers' reused buffers: each (worker, slot)'s buffer as it last crossed."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}

    def buffer(self, sent: torch.Tensor | None, worker: int, slot: int) -> torch.Tensor:
        """The item's buffer: ``sent`` (kept when it is a reused slot's), else the slot's kept one."""
        if sent is None:
            if (worker, slot) not in self.buffers:  # the worker's epoch and the trainer's are out of step
                raise RuntimeError(f"an item of input worker {worker} came without its buffer (slot {slot}), "
                                   "which never crossed to this loader")
            return self.buffers[(worker, slot)]
        if slot >= 0:
            if not sent.is_shared():  # a pinned copy: the worker's later items would land in its own buffer, unseen
                raise RuntimeError(f"input worker {worker} kept its buffer back from a loader that pins its items "
                                   "(pin_memory): the stream's workers were started by a loader without pin_memory")
            self.buffers[(worker, slot)] = sent
        return sent


def unpack_item(item: dict[str, Any], held: HeldBuffers | None = None) -> tuple[list[dict[str, torch.Tensor]], tuple[int, int]]:
    """The batches of an item from :func:`pack_item` (views of its buffer, from ``held`` when it did not cross
    with the item) and its origin; a plain batch as a list of one (origin (-1, -1))."""
    if PACKED not in item:
        return [item], (-1, -1)
    layout = json.loads(item[LAYOUT])
    worker, number = layout["origin"]
    buffer = (held or HeldBuffers()).buffer(item[PACKED], worker, layout["slot"])
    batch = {name: buffer[start:start + nbytes].view(getattr(torch, dtype)).view(shape)
             for name, dtype, shape, start, nbytes in layout["tensors"]}
    return split_rows(batch, layout["sizes"]), (worker, number)


@dataclass(frozen=True)
class ItemSlot:
    """A worker's next item (:meth:`ItemBuffers.reserve`): its number, its slot (-1: a buffer of its own) and the
    slot's buffer as it was (None: none yet)."""

    number: int
    slot: int
    buffer: torch.Tensor | None


class ItemBuffers:
    """A DataLoader worker's shared-memory buffers, one per item in flight, reused in turn.

    A fresh shared buffer per item costs its pages' first touch on both sides (about a millisecond per 300 KB on a
    small machine: more than the batch's decoding); a reused one costs a copy. The trainer marks item ``n`` of a
    worker done (``released[worker] = n``) once it has asked for the batch after the item's last; the worker fills
    a buffer again only after the item that used it is done. ``count`` (the DataLoader's prefetch + 2) is more items
    than the DataLoader lets a worker run ahead, so the wait never blocks a loader that keeps to that; if it would
    (a consumer that stopped marking), the item gets a buffer of its own after ``patience_s``, never a hang.
    A reused buffer crosses to the trainer with the first item of its slot in each epoch only; the trainer keeps
    it (:class:`HeldBuffers`), and later items of the slot cross as their layout alone.
    """

    def __init__(self, released: torch.Tensor, worker: int, count: int, patience_s: float = 2.0,
                 trainer_holds: bool = True) -> None:
        self.released, self.worker, self.patience_s = released, worker, patience_s
        # Whether the trainer holds the buffers that crossed (HeldBuffers); not when the DataLoader pins the
        # items: the trainer then gets a pinned copy of each, and each item's buffer must cross.
        self.trainer_holds = trainer_holds
        self.buffers: list[torch.Tensor | None] = [None] * count
        self.sent = [False] * count  # whether the trainer holds the slot's buffer (crossed this epoch)
        self.items = 0
        self.floor = 0  # items numbered below are free: items of an epoch that has ended (see new_epoch)

    def reserve(self) -> ItemSlot:
        """The worker's next item: its number and slot, once the item that used the slot last is done (else slot
        -1: a buffer of its own), with the slot's buffer as it is, which an encode may write into
        (:class:`Placement`) before :meth:`finish` sizes it."""
        number, slot = self.items, self.items % len(self.buffers)
        self.items += 1
        previous = number - len(self.buffers)  # the item that used this slot last
        if previous >= 0 and not self._done(previous):
            return ItemSlot(number, -1, None)
        return ItemSlot(number, slot, self.buffers[slot])

    def next(self, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int], int]:
        return self.finish(self.reserve(), nbytes)

    def finish(self, item: ItemSlot, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int], int]:
        """A buffer of ``nbytes`` for ``item`` (its slot's, grown if it is smaller); what must cross with the item
        (the whole buffer when the trainer does not hold it yet this epoch, else None); the item's origin (worker,
        item number); its slot (-1: not held by the trainer, always sent)."""
        number, slot = item.number, item.slot
        if slot < 0:
            own = torch.empty(nbytes, dtype=torch.uint8)
            return own, own, (self.worker, number), -1
        held = self.buffers[slot]
        if held is None or held.numel() < nbytes:
            held = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
            self.sent[slot] = False
        if not self.trainer_holds:
            return held[:nbytes], held[:nbytes], (self.worker, number), -1
        sent = None if self.sent[slot] else held
        self.sent[slot] = True
        return held[:nbytes], sent, (self.worker, number), slot

    def new_epoch(self) -> None:
        """The worker starts an epoch: every item it made before is free. The trainer finished the last epoch's
        steps, and the items made past its end were dropped by the DataLoader, never handed on (nor marked)."""
        self.floor = self.items
        # Items made past the last epoch's end were dropped unseen, buffers with them: each crosses again.
        self.sent = [False] * len(self.buffers)

    def _done(self, number: int) -> bool:
        if number < self.floor:
            return True
        deadline = time.monotonic() + self.patience_s
        while int(self.released[self.worker]) < number:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True


class UnitReader:
    """Reads work units as a stream's readers see them: the unit's rows, shuffled by ``(seed, epoch, key)`` (the
    unit's number in its stream), their sequence references resolved. Picklable by :meth:`spec` (a Ray worker
    builds its own from it: ``training.ray_input``); sequence partitions and digests are loaded once per reader."""

    def __init__(self, root: str | os.PathLike[str], dataset: str = EXAMPLES, columns: Sequence[str] = (), seed: int = 0,
                 shuffle: bool = True) -> None:
        self.root, self.dataset, self.columns = root, dataset, list(columns)
        self.seed, self.shuffle = seed, shuffle
        self._digests: dict[str, str | None] = {}
        self._resolver = SequenceResolver(root)

    def spec(self) -> dict[str, Any]:
        return {"root": self.root, "dataset": self.dataset, "columns": self.columns, "seed": self.seed,
                "shuffle": self.shuffle}

    def read(self, unit: WorkUnit, epoch: int, key: int) -> pa.Table:
        with parquet_file(unit.path, pins_of(self.root)) as parquet:
            names = parquet.schema_arrow.names
            wanted = self.columns or resolved_columns(names)
            resolve = _needs_resolving(wanted, names)
            table = parquet.read_row_group(unit.row_group, columns=read_columns(wanted, names) if resolve else self.columns or None)
        table = table.slice(unit.start, unit.rows)
        if self.shuffle:
            table = table.take(pa.array(np.random.default_rng([self.seed, epoch, key]).permutation(table.num_rows)))
        if resolve:  # after the slice and the shuffle: a row's resolved lists depend on that row only
            if unit.ds not in self._digests:
                self._digests[unit.ds] = read_metadata(self.root, self.dataset, unit.ds).get("sequence_digest")
            table = self._resolver.resolve(table, self._digests[unit.ds], f"{self.dataset} ds={unit.ds}").select(wanted)
        return table


class ExampleStream(IterableDataset):
    """Batches (dicts of tensors, from ``encode``) of one rank's share of the rows of ``dataset`` on ``days``.

    Iterate it through a :meth:`loader` (a ``DataLoader`` of ``num_workers`` workers, its items unpacked): the
    stream batches by itself, every worker reads its own units and yields full batches, the last one of each
    worker may be short (``drop_last``: dropped); a worker hands over ``batches_per_item`` consecutive batches at
    a time, so the loader's batches come in turns of that many per worker. Call :meth:`set_epoch` before each
    epoch and stop after :meth:`steps_per_epoch` batches (the same number on every rank; ranks with more data drop
    their tail for that epoch).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        days: Sequence[str],
        encode: Callable[[pa.Table], dict[str, torch.Tensor]],
        *,
        batch_size: int,
        encode_into: Callable[[pa.Table, Alloc], dict[str, torch.Tensor]] | None = None,
        dataset: str = EXAMPLES,
        columns: Sequence[str] = (),
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.root = root
        self.days = [ds_str(d) for d in days]
        self.encode = encode
        # encode, writing each tensor where alloc says (in a worker: the item's shared buffer); None: encode's
        # tensors are copied there.
        self.encode_into = encode_into
        self.dataset = dataset
        self.columns = list(columns)
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.seed = seed
        self.shuffle = shuffle
        # Full batches only (each worker's short tail is dropped): TorchRec's all-to-all lookups need the same
        # batch size on every rank at every step.
        self.drop_last = drop_last
        self.encode_batches = max(1, -(-ITEM_ROWS // batch_size))
        self.batches_per_item = self.encode_batches if num_workers else 1
        # (epoch, skip) in shared memory: a loader's workers live across epochs and read them at each epoch's
        # start. skip: batches of the epoch already trained on (a resumed run starts after them).
        self._position = torch.zeros(2, dtype=torch.int64).share_memory_()
        # The last item of each worker the trainer is done with, and how many buffers a worker keeps
        # (:class:`ItemBuffers`; set by the loader from its prefetch).
        self._released = torch.full((max(1, num_workers),), -1, dtype=torch.int64).share_memory_()
        self._items_in_flight = 4
        self._pinned_items = False
        self._buffers: ItemBuffers | None = None
        self.units = example_units(root, self.days, dataset=dataset, columns=columns)
        self._unit_index = {unit: i for i, unit in enumerate(self.units)}
        self._reader = UnitReader(self.root, dataset, self.columns, seed, shuffle)

    @property
    def total_rows(self) -> int:
        return sum(u.rows for u in self.units)

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        """Iterate ``epoch`` next, starting after its first ``skip`` batches (which are not read)."""
        self._position[0], self._position[1] = epoch, skip

    @property
    def epoch(self) -> int:
        return int(self._position[0])

    @property
    def skip(self) -> int:
        return int(self._position[1])

    def position(self, epoch: int, batches: int) -> dict[str, int]:
        """The input position for a checkpoint: ``batches`` of ``epoch`` have been consumed.

        The order of an epoch is a function of (seed, epoch, world size, workers), so this pair is the
        whole position; :meth:`load_position` checks that the layout it was taken with still holds.
        """
        return {
            "epoch": epoch,
            "batches": batches,
            "seed": self.seed,
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "batch_size": self.batch_size,
            "batches_per_item": self.batches_per_item,
            "total_rows": self.total_rows,
        }

    def load_position(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`position` (the next :meth:`__iter__` starts right after it). Call it before the
        stream's loader starts its workers. The items' size is this version's (``ITEM_ROWS``), not the run's: one
        taken from a checkpoint of another keeps the order of the run it resumes."""
        layout = ("seed", "world_size", "num_workers", "batch_size", "total_rows")
        changed = {k: (state[k], getattr(self, k)) for k in layout if k in state and state[k] != getattr(self, k)}
        if changed:
            raise ValueError(
                "the checkpoint's input position was taken with another data layout "
                + ", ".join(f"{k}: saved {a}, now {b}" for k, (a, b) in changed.items())
                + ": resume with the same seed, world size, num_workers, batch_size and days"
            )
        if self.num_workers and "batches_per_item" in state:
            self.batches_per_item = self.encode_batches = int(state["batches_per_item"])
        self.set_epoch(int(state["epoch"]), int(state["batches"]))

    def worker_batches(self, epoch: int) -> list[int]:
        """Batches each loader worker of this rank yields in ``epoch``."""
        return [self._batches(sum(u.rows for u in units)) for units in self.plan(epoch)[self.rank]]

    def _batches(self, rows: int) -> int:
        """Batches a worker yields from ``rows`` rows (a short last one unless ``drop_last``)."""
        return rows // self.batch_size if self.drop_last else -(-rows // self.batch_size)

    def resume_order(self, epoch: int, skip: int) -> list[tuple[int, int]]:
        """(planned worker, batches it skips) for each loader worker, so a loader resumes after ``skip`` batches.

        ``DataLoader`` takes items from its workers in turn (0, 1, ..., W-1, 0, ...), passing over a worker
        that has finished; an item is a worker's next ``batches_per_item`` batches (counted from the worker's
        first batch, its last item shorter). Replaying that turn order for ``skip`` batches gives each planned
        worker's share of them and whose turn is next (the worker whose item was being taken, whose first item
        after the restart is the rest of that item); a resumed loader starts its turns at its worker 0, so its
        worker j reads the j-th planned worker in turn from there (finished ones last).
        """
        left = self.worker_batches(epoch)
        n, k = len(left), self.batches_per_item
        taken = [0] * n
        w, consumed = 0, 0
        while consumed < skip and any(t < c for t, c in zip(taken, left, strict=True)):
            while taken[w] >= left[w]:
                w = (w + 1) % n
            item = min(k, left[w] - taken[w])
            if consumed + item > skip:  # the restart falls inside this item: its worker is next, for the rest
                taken[w] += skip - consumed
                break
            taken[w] += item
            consumed += item
            w = (w + 1) % n
        turn = [(w + i) % n for i in range(n)]
        active = [i for i in turn if taken[i] < left[i]]
        done = [i for i in turn if taken[i] >= left[i]]
        return [(i, taken[i]) for i in active + done]

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, *key])

    def reader(self) -> UnitReader:
        return self._reader

    def unit_key(self, unit: WorkUnit) -> int:
        """The unit's number in this stream: with the seed and the epoch, what its rows are shuffled by."""
        return self._unit_index[unit]

    def plan(self, epoch: int) -> list[list[list[WorkUnit]]]:
        """Units per rank per worker for ``epoch``: ``plan[rank][worker]``."""
        order = list(self.units)
        if self.shuffle:
            order = [order[i] for i in self._rng(epoch).permutation(len(order))]
        return [balance(rank_units, max(1, self.num_workers)) for rank_units in balance(order, self.world_size)]

    def rank_units(self, epoch: int, rank: int | None = None) -> list[WorkUnit]:
        return [u for worker in self.plan(epoch)[self.rank if rank is None else rank] for u in worker]

    def batches_per_rank(self, epoch: int) -> list[int]:
        return [sum(self._batches(sum(u.rows for u in w)) for w in workers) for workers in self.plan(epoch)]

    def steps_per_epoch(self, epoch: int) -> int:
        """Batches every rank yields in ``epoch``: the smallest count of any rank."""
        return min(self.batches_per_rank(epoch))

    # ----------------------------------------------------------------------------------------------
    def _read(self, unit: WorkUnit, epoch: int) -> pa.Table:
        return self._reader.read(unit, epoch, self._unit_index[unit])

    def iter_tables(self, units: Sequence[WorkUnit], epoch: int, skip_batches: int = 0) -> Iterator[pa.Table]:
        """Tables of ``batch_size`` rows (the last may be short) over ``units`` in order.

        The first ``skip_batches`` tables are not produced; units wholly inside them are not even read.
        """
        pending: list[pa.Table] = []
        have = 0
        skip_rows = skip_batches * self.batch_size
        for unit in units:
            if skip_rows >= unit.rows:
                skip_rows -= unit.rows
                continue
            table = self._read(unit, epoch)
            if skip_rows:
                table, skip_rows = table.slice(skip_rows), 0
            pending.append(table)
            have += table.num_rows
            while have >= self.batch_size:
                merged = pa.concat_tables(pending) if len(pending) > 1 else pending[0]
                yield merged.slice(0, self.batch_size)
                rest = merged.slice(self.batch_size)
                pending, have = ([rest] if rest.num_rows else []), rest.num_rows
        if have and not self.drop_last:
            yield pa.concat_tables(pending) if len(pending) > 1 else pending[0]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        planned = self.plan(self.epoch)[self.rank]
        order = self.resume_order(self.epoch, self.skip) if self.skip else [(i, 0) for i in range(len(planned))]
        workers = [planned[i] for i, _ in order]
        skips = [k for _, k in order]
        info = get_worker_info()
        if info is not None:
            if info.num_workers != len(workers):
                raise ValueError(
                    f"ExampleStream planned for {self.num_workers} workers but the DataLoader has "
                    f"{info.num_workers}: pass num_workers=stream.num_workers"
                )
            torch.set_num_threads(1)
            pa.set_cpu_count(1)  # one thread per worker: the workers are the parallelism
            workers, skips = [workers[info.id]], [skips[info.id]]
            if self._buffers is None:  # a worker's buffers live as long as it (across epochs)
                self._buffers = ItemBuffers(self._released, info.id, self._items_in_flight,
                                            trainer_holds=not self._pinned_items)
            self._buffers.new_epoch()
        buffers = self._buffers if info is not None else None
        for units, skip in zip(workers, skips, strict=True):
            # Rows encoded an item at a time; from a worker, items of batches_per_item batches counted from the
            # worker's first batch (a resumed worker first finishes the item it was in), each one buffer
            # (unpacked by loader()).
            size = self.encode_batches - skip % self.encode_batches
            tables: list[pa.Table] = []
            for table in itertools.chain(self.iter_tables(units, self.epoch, skip), [None]):
                if table is not None:
                    tables.append(table)
                if tables and (table is None or len(tables) == size):
                    rows = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
                    sizes = [t.num_rows for t in tables]
                    if buffers is None:
                        yield from split_rows(self.encode(rows), sizes)
                    else:  # encoded into the buffer the item crosses in, where the encode can
                        item = buffers.reserve()
                        placement = Placement(item.buffer)
                        batch = self.encode_into(rows, placement) if self.encode_into else self.encode(rows)
                        yield pack_item(batch, sizes, buffers, item, placement)
                    tables, size = [], self.encode_batches

    def loader(self, *, pin_memory: bool = False, prefetch_factor: int = 2, generator: Any = None) -> StreamLoader:
        """A :class:`StreamLoader` of this stream: iterate it once per epoch (after :meth:`set_epoch`)."""
        return StreamLoader(self, pin_memory=pin_memory, prefetch_factor=prefetch_factor, generator=generator)


class StreamLoader:
    """The batches of a stream's current epoch (after its ``skip``), through a ``DataLoader`` of the stream's
    ``num_workers`` workers, unpacked in the order the workers' items come; without workers, the stream itself.

    The workers are started by the first epoch and serve every later one (a new process per worker and epoch
    costs more than a small epoch's reading); they stop when this loader is dropped. The stream does not hold
    its loader, so that dropping the loader stops the workers at once.
    """

    def __init__(self, stream: ExampleStream, *, pin_memory: bool = False, prefetch_factor: int = 2,
                 generator: Any = None) -> None:
        from torch.utils.data import DataLoader

        self.stream = stream
        # Set before the workers start (at the first epoch) and see it: more buffers per worker than the items
        # the DataLoader lets it run ahead (prefetch_factor), so a worker never waits for one.
        stream._items_in_flight = prefetch_factor + 2
        stream._pinned_items = pin_memory
        stream._released.fill_(-1)
        self.items = DataLoader(stream, batch_size=None, num_workers=stream.num_workers, pin_memory=pin_memory,
                                prefetch_factor=prefetch_factor, persistent_workers=True, generator=generator,
                                ) if stream.num_workers else None
        self.held = HeldBuffers()

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """A batch's tensors are views of its worker's reused buffer, valid until the batch after it is asked for
        (a trainer's step uses its batch and drops it; copy what must outlive the step)."""
        if self.items is None:
            yield from self.stream
            return
        released = self.stream._released
        origin = (-1, -1)
        try:
            for item in self.items:
                batches, origin = unpack_item(item, self.held)
                yield from batches
                if origin[0] >= 0:  # every batch of the item has been handed on and the next asked for
                    released[origin[0]] = origin[1]
        finally:  # the epoch stopped early (or the trainer stopped): its buffers are free for the next epoch
            if origin[0] >= 0:
                released[origin[0]] = origin[1]


def lockstep(stream: ExampleStream) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """This rank's batches of ``stream`` (its current epoch, read without workers) for a model whose forward is a
    collective: a TorchRec-sharded model's lookups are all-to-alls, so every rank must call it the same number of
    times, each time with the same number of rows. Yields ``(batch, rows)``: each batch padded with zero rows to the
    stream's ``batch_size`` (its first ``rows`` rows are real), then batches of zero rows only (``rows`` 0) until
    as many batches as the rank with the most have come. The counts come from the plan, the same on every rank
    without a collective; a rank dealt no data takes the padding's shapes from one row of the day's first unit."""
    counts = stream.batches_per_rank(stream.epoch)
    steps = max(counts, default=0)
    if steps == 0:
        return
    batches = iter(stream)
    first = next(batches, None) if counts[stream.rank] else None
    if first is None:  # nothing of its own: the shapes of an encoded row
        first_row = stream.encode(stream._read(stream.units[0], stream.epoch).slice(0, 1))
        template = {name: tensor[:0] for name, tensor in first_row.items()}
    else:
        template = {name: tensor[:0] for name, tensor in first.items()}
    size = stream.batch_size
    real = itertools.chain([first] if first is not None else [], batches)
    for _ in range(steps):
        batch = next(real, None)
        if batch is None:
            yield {name: tensor.new_zeros((size, *tensor.shape[1:])) for name, tensor in template.items()}, 0
            continue
        rows = len(next(iter(batch.values())))
        if rows < size:
            batch = {name: torch.cat([tensor, tensor.new_zeros((size - rows, *tensor.shape[1:]))])
                     for name, tensor in batch.items()}
        yield batch, rows
    if next(real, None) is not None:
        raise RuntimeError(f"rank {stream.rank} has more than the {counts[stream.rank]} batches its plan says")
