"""Derived checks: what GX cannot express on the raw columns, computed as boolean (or length) columns first.

References to another dataset (an event's pin in that day's pins snapshot), links between rows (an
engagement has the impression it came from), nested values (an embedding's length, its finiteness). Each
``DerivedCheck`` names the column ``derived_columns`` computes; the GX suite (``features.validation.suite``)
then judges that column like any other, so the report shows them the same way.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

from core import storage
from core.config import ValidationConfig
from core.contracts import TEXT_VOCAB
from features.validation.checks import Check, raw_dataset, short


@dataclass(frozen=True)
class DerivedCheck:
    """A check on a column computed before the suite runs.

    ``kind``: ``true`` (every value must be True, or a share ``mostly`` of them) or ``embedding_length``.
    ``sources``: the columns it is computed from; ``reference``: the raw dataset it looks up, if any.
    """

    name: str
    column: str
    problem: str
    kind: Literal["true", "embedding_length"]
    sources: tuple[str, ...]
    reference: str | None = None
    referential: bool = False  # True: must hold for at least min_referential_integrity of the rows


DERIVED: dict[str, tuple[DerivedCheck, ...]] = {
    "events": (
        DerivedCheck(
            "pin_id.in_pins_snapshot", "_check_pin_in_snapshot",
            "a pin_id that is not in that day's raw/pins snapshot", "true", ("pin_id",), "pins", True,
        ),
        DerivedCheck(
            "user_id.in_users_snapshot", "_check_user_in_snapshot",
            "a user_id that is not in that day's raw/users snapshot", "true", ("user_id",), "users", True,
        ),
        DerivedCheck(
            "engagement.has_impression", "_check_has_impression",
            "an engagement without an impression of the same user and pin in the partition or in the last "
            "validation.engagement_lookback_minutes of the day before (or an impression whose impression_id is "
            "not its own event_id)",
            "true", ("event_id", "impression_id", "user_id", "pin_id", "action"),
        ),
    ),
    "pins": (
        DerivedCheck(
            "embedding.length", "_check_embedding_length",
            "an embedding whose length is not validation.embedding_dim", "embedding_length", ("embedding",),
        ),
        DerivedCheck(
            "embedding.finite", "_check_embedding_finite",
            "an embedding with a NaN, infinite or null value", "true", ("embedding",),
        ),
        # The content model's inputs: one image width for every pin (the model reads it from the data), finite
        # values, and text tokens inside the vocabulary.
        DerivedCheck(
            "image_embedding.one_width", "_check_image_one_width",
            "an image_embedding whose width differs from the partition's most common one", "true", ("image_embedding",),
        ),
        DerivedCheck(
            "image_embedding.finite", "_check_image_finite",
            "an image_embedding with a NaN, infinite or null value", "true", ("image_embedding",),
        ),
        DerivedCheck(
            "text_tokens.in_vocabulary", "_check_tokens_in_vocabulary",
            f"a text token outside [0, {TEXT_VOCAB}) (the text vocabulary), or a null token", "true", ("text_tokens",),
        ),
    ),
    "users": (),
    "pin_labels": (
        DerivedCheck(
            "pin_id.in_pins_snapshot", "_check_pin_in_snapshot",
            "a reviewed pin_id that is not in that day's raw/pins snapshot", "true", ("pin_id",), "pins", True,
        ),
    ),
}


def derived_columns(
    root: storage.Location,
    dataset: str,
    ds: str,
    table: pa.Table,
    bad_columns: set[str],
    config: ValidationConfig | None = None,
) -> tuple[dict[str, pa.Array], dict[str, Check]]:
    """The columns of the dataset's ``DerivedCheck``s, and the checks that cannot run (with why).

    ``config.engagement_lookback_minutes``: an engagement may come from an impression of the previous day
    that late (an impression at 23:59:59, its click at 00:00:02), looked up in the previous day's events.
    """
    columns: dict[str, pa.Array] = {}
    not_run: dict[str, Check] = {}
    for check in DERIVED[dataset]:
        unusable = [c for c in check.sources if c not in table.column_names or (c in bad_columns and c != "embedding")]
        if unusable:
            not_run[check.name] = Check(check.name, None, details=f"not run: column {unusable} missing or mistyped")
            continue
        if check.reference is not None:
            ids, why = reference_ids(root, check.reference, ds, check.sources[0])
            if ids is None:
                # The reference partition is validated by its own task; this partition is not to blame.
                not_run[check.name] = Check(
                    check.name, None, details=f"not run: {why}; validate_{check.reference} reports it", required=False
                )
                continue
            values = pc.is_in(table.column(check.sources[0]), value_set=ids)
            columns[check.column] = pc.if_else(pc.is_null(table.column(check.sources[0])), None, values)
        elif check.name == "engagement.has_impression":
            lookback = config.engagement_lookback_minutes if config is not None else 0.0
            # The day before is read only when an engagement's impression is not among the day's own.
            late = functools.partial(late_impressions, root, ds, lookback) if lookback > 0 else None
            columns[check.column] = has_impression(table, late)
        elif check.kind == "embedding_length":
            try:
                columns[check.column] = pc.list_value_length(table.column("embedding"))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
                not_run[check.name] = Check(check.name, None, details="not run: embedding is not a list column")
        elif check.name == "image_embedding.one_width":
            widths = one_width(table.column("image_embedding"))
            if widths is None:
                not_run[check.name] = Check(check.name, None, details="not run: image_embedding is not a list column")
            else:
                columns[check.column] = widths
        elif check.name == "text_tokens.in_vocabulary":
            tokens = tokens_in_range(table.column("text_tokens"), TEXT_VOCAB)
            if tokens is None:
                not_run[check.name] = Check(check.name, None, details="not run: text_tokens is not a list of integers")
            else:
                columns[check.column] = tokens
        else:
            source = check.sources[0]
            finite = embedding_finite(table.column(source))
            if finite is None:
                not_run[check.name] = Check(check.name, None, details=f"not run: {source} is not a list of floats")
            else:
                columns[check.column] = finite
    return columns, not_run


def _as_list_array(column: pa.ChunkedArray | pa.Array) -> pa.Array | None:
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        return None
    return arr


def one_width(column: pa.ChunkedArray | pa.Array) -> pa.Array | None:
    """Per row: the list has the partition's most common length (null rows stay null: not_null reports them)."""
    import numpy as np

    arr = _as_list_array(column)
    if arr is None:
        return None
    lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
    nulls = arr.is_null().to_numpy(zero_copy_only=False)
    known = lengths[~nulls].astype(np.int64)
    if not known.size:
        return pa.array(np.ones(len(arr), dtype=bool), mask=nulls)
    values, counts = np.unique(known, return_counts=True)
    common = values[counts.argmax()]
    return pa.array(np.where(nulls, True, lengths == common), mask=nulls)


def tokens_in_range(column: pa.ChunkedArray | pa.Array, vocabulary: int) -> pa.Array | None:
    """Per row: every token is a non-null integer in [0, ``vocabulary``) (null rows stay null)."""
    arr = _as_list_array(column)
    if arr is None or not pa.types.is_integer(arr.type.value_type):
        return None
    flat = pc.list_flatten(arr)
    values = flat.to_numpy(zero_copy_only=False) if flat.null_count == 0 else pc.fill_null(flat, -1).to_numpy()
    return _rows_without(arr, (values < 0) | (values >= vocabulary))


def _rows_without(arr: pa.Array, bad: Any) -> pa.Array:
    """Per row of the list array ``arr``: none of its values is flagged in ``bad`` (a mask over the flattened
    values); null rows stay null (not_null reports them)."""
    import numpy as np

    ok = np.ones(len(arr), dtype=bool)
    ok[np.unique(pc.list_parent_indices(arr).to_numpy()[bad])] = False
    return pa.array(ok, mask=arr.is_null().to_numpy(zero_copy_only=False))


def reference_ids(root: storage.Location, dataset: str, ds: str, column: str) -> tuple[pa.Array | None, str]:
    """The distinct ``column`` values of the snapshot ``raw/<dataset>`` as of ``ds``, or None and why not."""
    source = raw_dataset(dataset)
    where = f"{source} ds={ds}"
    if not storage.is_complete(root, source, ds):
        return None, f"{where} is missing or incomplete"
    try:
        if not storage.data_files(root, source, ds):
            return None, f"{where} has no Parquet file"
        # The snapshot as of ds: that day's, or the newest full one with the increments after it.
        table, _ = storage.read_snapshot(root, source, ds, column, [])
        ids = pc.unique(table.column(column).cast(pa.int64()))
    except Exception as err:  # noqa: BLE001 - any unreadable reference makes the check not runnable
        return None, f"{where} is unreadable ({type(err).__name__}: {short(str(err), 120)})"
    return ids, ""


def late_impressions(root: storage.Location, ds: str, minutes: float) -> pa.Table | None:
    """The impressions of the day before ``ds`` in its last ``minutes`` (event_id, user_id, pin_id); None when
    that day's events are not there (then only the day's own impressions count)."""
    import datetime as dt

    previous = storage.shift_ds(ds, -1)
    source = raw_dataset("events")
    if not storage.is_complete(root, source, previous):
        return None
    import pyarrow.parquet as pq

    start = dt.datetime.fromisoformat(ds).replace(tzinfo=dt.UTC) - dt.timedelta(minutes=minutes)
    tables = []
    for path in storage.data_files(root, source, previous):
        fs, key = storage.filesystem(path)
        # A local file by its path: pyarrow reads it natively (through a Python file object it is several times slower).
        with (contextlib.nullcontext(str(storage.local_path(path))) if not storage.is_remote(path) else fs.open(key, "rb")) as f:
            # action as dictionary codes (decoding millions of strings was most of the read); row groups whose
            # ts statistics end before ``start`` are not read (an event log written in time order reads one or two).
            parquet = pq.ParquetFile(f, read_dictionary=["action"])
            ts_index = parquet.schema_arrow.get_field_index("ts")
            groups = [
                g for g in range(parquet.metadata.num_row_groups)
                if not _ends_before(parquet.metadata.row_group(g).column(ts_index).statistics, start)
            ]
            table = parquet.read_row_groups(groups, columns=["event_id", "user_id", "pin_id", "action", "ts"])
        keep = pc.and_(pc.equal(table.column("action"), "impression"), pc.greater_equal(table.column("ts"), pa.scalar(start)))
        tables.append(table.filter(keep).select(["event_id", "user_id", "pin_id"]))
    return pa.concat_tables(tables) if tables else None


def _ends_before(statistics: Any, start: Any) -> bool:
    """Whether a row group's ts column statistics say every value is before ``start`` (False when unknown)."""
    if statistics is None or not statistics.has_min_max:
        return False
    latest = statistics.max
    return latest is not None and getattr(latest, "tzinfo", None) is not None and latest < start


def has_impression(table: pa.Table, late: pa.Table | Callable[[], pa.Table | None] | None = None) -> pa.Array:
    """Per row: an impression references itself; an engagement an impression of its user and pin, of the same
    day or, given ``late``, one of the last impressions of the day before.

    ``late``: those impressions (``late_impressions``), or a function that reads them, called only when some
    engagement's impression is not among the day's own (most days: never, and the day before is not read).
    """
    import numpy as np

    def ints(source: pa.Table, col: str) -> np.ndarray:
        column = source.column(col)
        return (column.fill_null(-1) if column.null_count else column).to_numpy()

    event, impression, user, pin = (ints(table, c) for c in ("event_id", "impression_id", "user_id", "pin_id"))
    is_imp = pc.fill_null(pc.equal(table.column("action"), "impression"), False).to_numpy()
    linked = impression == event  # an impression references itself
    eng = np.flatnonzero(~is_imp)
    if len(eng):
        ref = impression[eng]
        # The first of the day's impressions whose id is the reference (in id order, then in row order), if any.
        if len(event) > 1 and bool(np.all(event[1:] > event[:-1])):
            # Upstream writes events in id order: search the day's rows themselves (an id is on one row at most).
            pos = np.minimum(np.searchsorted(event, ref), len(event) - 1)
            row = pos
            found = (event[pos] == ref) & is_imp[pos]
        else:
            imp_rows = np.flatnonzero(is_imp)
            keys = event[imp_rows]
            if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
                order = np.argsort(keys, kind="stable")
                keys, imp_rows = keys[order], imp_rows[order]
            if len(keys):
                pos = np.minimum(np.searchsorted(keys, ref), len(keys) - 1)
                row = imp_rows[pos]
                found = keys[pos] == ref
            else:
                row = np.zeros(len(eng), dtype=np.int64)
                found = np.zeros(len(eng), dtype=bool)
        eng_user, eng_pin = user[eng], pin[eng]
        ok = found & (user[row] == eng_user) & (pin[row] == eng_pin)
        # References to no impression of the day: one of the day before's last impressions, if any.
        missing = np.flatnonzero(~found)
        if len(missing) and late is not None:
            late_table = late() if callable(late) else late
            if late_table is not None and late_table.num_rows:
                keys = ints(late_table, "event_id")
                late_user, late_pin = ints(late_table, "user_id"), ints(late_table, "pin_id")
                if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
                    order = np.argsort(keys, kind="stable")
                    keys, late_user, late_pin = keys[order], late_user[order], late_pin[order]
                missing_ref = ref[missing]
                pos = np.minimum(np.searchsorted(keys, missing_ref), len(keys) - 1)
                ok[missing] = (
                    (keys[pos] == missing_ref) & (late_user[pos] == eng_user[missing]) & (late_pin[pos] == eng_pin[missing])
                )
        linked[eng] = ok
    # A row with a null key is left to the not_null checks rather than reported twice.
    mask = None
    for col in ("event_id", "impression_id", "user_id", "pin_id", "action"):
        if table.column(col).null_count:
            nulls = table.column(col).is_null().to_numpy(zero_copy_only=False)
            mask = nulls if mask is None else mask | nulls
    return pa.array(linked, mask=mask)


def embedding_finite(column: pa.ChunkedArray | pa.Array) -> pa.Array | None:
    """Per row: every value of the embedding is finite (null rows stay null: not_null reports them)."""
    arr = _as_list_array(column)
    if arr is None or not pa.types.is_floating(arr.type.value_type):
        return None
    return _rows_without(arr, ~pc.fill_null(pc.is_finite(pc.list_flatten(arr)), False).to_numpy(zero_copy_only=False))
