"""Derived checks: what GX cannot express on the raw columns, computed as boolean (or length) columns first.

References to another dataset (an event's pin in that day's pins snapshot), links between rows (an
engagement has the impression it came from), nested values (an embedding's length, its finiteness). Each
``DerivedCheck`` names the column ``derived_columns`` computes; the GX suite (``features.validation.suite``)
then judges that column like any other, so the report shows them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc

from core import contracts, storage
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
            "an engagement without an impression of the same user and pin in the partition (or an impression "
            "whose impression_id is not its own event_id)",
            "true", ("event_id", "impression_id", "user_id", "pin_id", "action"),
        ),
    ),
    "pins": (
        DerivedCheck(
            "embedding.length", "_check_embedding_length",
            f"an embedding whose length is not {contracts.EMBEDDING_DIM}", "embedding_length", ("embedding",),
        ),
        DerivedCheck(
            "embedding.finite", "_check_embedding_finite",
            "an embedding with a NaN, infinite or null value", "true", ("embedding",),
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
    root: storage.Location, dataset: str, ds: str, table: pa.Table, bad_columns: set[str]
) -> tuple[dict[str, pa.Array], dict[str, Check]]:
    """The columns of the dataset's ``DerivedCheck``s, and the checks that cannot run (with why)."""
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
            columns[check.column] = has_impression(table)
        elif check.kind == "embedding_length":
            try:
                columns[check.column] = pc.list_value_length(table.column("embedding"))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
                not_run[check.name] = Check(check.name, None, details="not run: embedding is not a list column")
        else:
            finite = embedding_finite(table.column("embedding"))
            if finite is None:
                not_run[check.name] = Check(check.name, None, details="not run: embedding is not a list of floats")
            else:
                columns[check.column] = finite
    return columns, not_run


def reference_ids(root: storage.Location, dataset: str, ds: str, column: str) -> tuple[pa.Array | None, str]:
    """The distinct ``column`` values of ``raw/<dataset>/ds=<ds>``, or None and why they are unavailable."""
    source = raw_dataset(dataset)
    where = f"{source} ds={ds}"
    if not storage.is_complete(root, source, ds):
        return None, f"{where} is missing or incomplete"
    try:
        files = storage.data_files(root, source, ds)
        if not files:
            return None, f"{where} has no Parquet file"
        table = pa.concat_tables([storage.read_parquet(f, columns=[column]) for f in files])
        ids = pc.unique(table.column(column).cast(pa.int64()))
    except Exception as err:  # noqa: BLE001 - any unreadable reference makes the check not runnable
        return None, f"{where} is unreadable ({type(err).__name__}: {short(str(err), 120)})"
    return ids, ""


def has_impression(table: pa.Table) -> pa.Array:
    """Per row: an impression references itself; an engagement an impression of its user and pin."""
    import numpy as np

    def ints(col: str) -> np.ndarray:
        column = table.column(col)
        return (column.fill_null(-1) if column.null_count else column).to_numpy()

    event, impression, user, pin = ints("event_id"), ints("impression_id"), ints("user_id"), ints("pin_id")
    is_imp = pc.fill_null(pc.equal(table.column("action"), "impression"), False).to_numpy()
    imp_rows = np.flatnonzero(is_imp)
    keys = event[imp_rows]
    if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):  # upstream writes events in id order
        order = np.argsort(keys, kind="stable")
        imp_rows, keys = imp_rows[order], keys[order]
    linked = impression == event  # an impression references itself
    eng = np.flatnonzero(~is_imp)
    if len(keys) and len(eng):
        ref = impression[eng]
        pos = np.minimum(np.searchsorted(keys, ref), len(keys) - 1)
        match = imp_rows[pos]
        linked[eng] = (keys[pos] == ref) & (user[match] == user[eng]) & (pin[match] == pin[eng])
    elif len(eng):
        linked[eng] = False
    # A row with a null key is left to the not_null checks rather than reported twice.
    mask = None
    for col in ("event_id", "impression_id", "user_id", "pin_id", "action"):
        if table.column(col).null_count:
            nulls = table.column(col).is_null().to_numpy(zero_copy_only=False)
            mask = nulls if mask is None else mask | nulls
    return pa.array(linked, mask=mask)


def embedding_finite(column: pa.ChunkedArray | pa.Array) -> pa.Array | None:
    """Per row: every value of the embedding is finite (null rows stay null: not_null reports them)."""
    import numpy as np

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        return None
    if not pa.types.is_floating(arr.type.value_type):
        return None
    flat = pc.list_flatten(arr)
    parents = pc.list_parent_indices(arr).to_numpy()
    bad = ~pc.fill_null(pc.is_finite(flat), False).to_numpy(zero_copy_only=False)
    ok = np.ones(len(arr), dtype=bool)
    ok[np.unique(parents[bad])] = False
    return pa.array(ok, mask=arr.is_null().to_numpy(zero_copy_only=False))
