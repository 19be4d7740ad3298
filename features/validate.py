"""The data validation gate for the raw datasets (DESIGN.md §2, §3).

``validate_partition`` checks one raw partition in two stages and writes a report before it returns:

1. Storage and physical schema, with pyarrow: the ``_SUCCESS`` marker, at least one Parquet file, every
   file readable, and the column names and types of every file equal to the contract in
   ``features.contracts``. An unreadable file or a missing marker is a failed check naming the file,
   never only a stack trace.
2. A Great Expectations 1.x suite as code (``build_suite``), run through an ephemeral context on the
   partition as one pandas dataframe: the column set, the row count, nulls, uniqueness, allowed values and
   the partition's UTC day.

The report goes to ``<root>/reports/validation/<dataset>/ds=<ds>/``: ``result.json`` (every check with its
observed value, written atomically and last), ``index.html`` (a self-contained table of the checks) and
``data_docs/`` (the GX Data Docs site of the run, when the suite ran).

Command line::

    python -m features.validate events --root /data/pinflow --ds 2024-05-01

exits 0 when the partition passes, 2 when it fails validation, 1 when the tool itself fails, and prints
the report path as its last line.

Great Expectations is imported inside the functions that need it: Airflow imports this module when a task
starts, and importing GX takes seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import html
import json
import logging
import os
import shutil
import sys
import time
import traceback
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from features import contracts, storage
from features.history import (
    HISTORY_CHECKS,
    PROFILE_FILE,
    ValidationSettings,
    history_checks,
    previous_ids,
    profile_table,
    quarantine_records,
    quarantine_root,
    trailing_profiles,
)

if TYPE_CHECKING:
    import great_expectations as gx
    import pandas as pd

log = logging.getLogger(__name__)

RAW_PREFIX = "raw"
REPORTS_DIR = "reports/validation"
RESULT_FILE = "result.json"
HTML_FILE = "index.html"
DATA_DOCS_DIR = "data_docs"

# Exit codes of the command line.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_FAILED = 2

CheckStatus = Literal["passed", "failed", "skipped"]

# Checks of the storage and physical-schema stage, in the order they run.
STORAGE_CHECKS: tuple[str, ...] = (
    "partition.marker",
    "partition.files",
    "files.readable",
    "schema.columns",
    "schema.types",
)

# Columns whose values must be unique in a partition, per dataset.
_UNIQUE: dict[str, tuple[str, ...]] = {"events": ("event_id",), "pins": ("pin_id",), "users": ("user_id",)}
# Id columns that must be well formed (positive int64: upstream ids start at 1), per dataset.
_IDS: dict[str, tuple[str, ...]] = {
    "events": ("event_id", "impression_id", "user_id", "pin_id"),
    "pins": ("pin_id", "creator_id"),
    "users": ("user_id",),
}
# Columns whose values must come from a closed set, per dataset.
_IN_SET: dict[str, dict[str, tuple[str, ...]]] = {
    "events": {"action": contracts.ACTIONS, "surface": contracts.SURFACES},
}
# Columns that must match a regular expression, per dataset: column -> (regex, what it is).
_REGEX: dict[str, dict[str, tuple[str, str]]] = {"users": {"country": (r"^[A-Z]{2}$", "an ISO 3166 alpha-2 code")}}
# Columns of timestamps that must lie inside the partition's UTC day, per dataset.
_IN_DAY: dict[str, tuple[str, ...]] = {"events": ("ts",)}
# Columns of timestamps that must not be after the partition's UTC day (a snapshot of ds knows no later row).
_NOT_AFTER_DAY: dict[str, tuple[str, ...]] = {"pins": ("created_at",), "users": ("created_at",)}


@dataclass(frozen=True)
class DerivedCheck:
    """A check on a column computed before the suite runs, for what GX cannot express on the raw columns:
    references to another dataset, links between rows, nested values.

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


_DERIVED: dict[str, tuple[DerivedCheck, ...]] = {
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
}

_EXAMPLES = 10  # offending values quoted in a check's observed value


@dataclass
class Check:
    """One named check and its outcome; ``success`` is ``None`` when it was skipped."""

    name: str
    success: bool | None
    observed: Any = None
    expected: Any = None
    details: str = ""
    required: bool = True  # False: a skipped check does not fail the partition (its input lies elsewhere)

    @property
    def passed(self) -> bool:
        return self.success is True or (self.success is None and not self.required)

    @property
    def status(self) -> CheckStatus:
        if self.success is None:
            return "skipped"
        return "passed" if self.success else "failed"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "status": self.status,
            "success": self.success,
            "observed": _jsonable(self.observed),
            "expected": _jsonable(self.expected),
            "details": self.details,
        }


@dataclass
class ValidationReport:
    """The outcome of validating one raw partition; ``report_path`` is its ``result.json``."""

    dataset: str
    ds: str
    success: bool
    checks: list[Check]
    report_path: Path
    rows: int | None = None
    partition: str = ""
    files: list[str] = field(default_factory=list)
    data_docs: str | None = None
    duration_s: float = 0.0
    profile: dict[str, Any] | None = None
    quarantine: str | None = None  # where the failed partition was moved, with a copy of this report
    quarantine_history: list[str] = field(default_factory=list)  # earlier quarantines of this partition
    warnings: list[str] = field(default_factory=list)

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if c.success is False]

    @property
    def data_docs_path(self) -> Path:
        """The page to show for this run: the GX Data Docs index, or this report's own HTML."""
        out = self.report_path.parent
        return out / self.data_docs if self.data_docs else out / HTML_FILE

    def summary(self) -> dict[str, Any]:
        """A short JSON-serializable dict for XCom."""
        return {
            "dataset": self.dataset,
            "ds": self.ds,
            "success": self.success,
            "rows": self.rows,
            "failed_checks": [c.name for c in self.failed_checks],
            "top_failures": [f"{c.name}: {_short(c.details or c.observed, 160)}" for c in self.failed_checks[:3]],
            "report_path": str(self.report_path),
            "data_docs": str(self.data_docs_path),
            "quarantine": self.quarantine,
            "warnings": self.warnings,
        }

    def failure_message(self, top: int = 5) -> str:
        """What failed, where, what was seen and how to fix it; empty when the partition passed."""
        if self.success:
            return ""
        failed = self.failed_checks
        skipped = sum(1 for c in self.checks if c.success is None)
        lines = [
            f"Validation failed for {RAW_PREFIX}/{self.dataset} partition ds={self.ds}: "
            f"{len(failed)} of {len(self.checks)} checks failed" + (f", {skipped} not run" if skipped else "")
        ]
        for check in failed[:top]:
            lines.append(f"  - {check.name}: {check.details or _short(check.observed)}")
        if len(failed) > top:
            lines.append(f"  - ... and {len(failed) - top} more")
        lines.append(f"Report: {self.report_path}")
        where = self.partition or f"{RAW_PREFIX}/{self.dataset}/ds={self.ds}"
        if self.quarantine:
            lines.append(f"Quarantined: the partition was moved to {self.quarantine} (with this report)")
        if failed and failed[0].name == "partition.marker":
            fix = f"land the partition {where} (its data files, then its {storage.MARKER} marker)"
        else:
            fix = (
                f"correct the upstream data and replace the partition {where} (data files and its "
                f"{storage.MARKER} marker, written atomically)"
            )
        lines.append(f"Fix: {fix}, then clear this task to validate it again.")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["checks"] = [c.to_dict() for c in self.checks]
        payload["report_path"] = str(self.report_path)
        payload["failed_checks"] = [c.name for c in self.failed_checks]
        payload.pop("profile", None)  # profile.json beside the report holds it
        return payload


# --- suites -----------------------------------------------------------------------------------------


def dataset_name(dataset: str) -> str:
    """``events`` for ``events`` or ``raw/events``; raises ValueError naming the known datasets."""
    name = dataset.removeprefix(f"{RAW_PREFIX}/")
    if name not in contracts.RAW_DATASETS:
        known = ", ".join(sorted(contracts.RAW_DATASETS))
        raise ValueError(f"unknown raw dataset {dataset!r}: expected one of {known}")
    return name


def day_bounds(ds: str | dt.date) -> tuple[dt.datetime, dt.datetime]:
    """The partition's UTC day as ``[start, end)``."""
    day = storage.parse_ds(ds)
    start = dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)
    return start, start + dt.timedelta(days=1)


def build_suite(
    dataset: str,
    ds: str | dt.date,
    *,
    skip_columns: Sequence[str] = (),
    settings: ValidationSettings | None = None,
    derived: Sequence[str] | None = None,
) -> gx.ExpectationSuite:
    """The GX expectation suite of a raw dataset for the partition ``ds``.

    Every expectation carries its check name in ``meta["check"]`` and a phrase for its offending rows
    in ``meta["problem"]``. ``skip_columns``: columns to leave out of the column-level expectations
    (missing, or of the wrong type, so that GX cannot judge them). ``derived``: the names of the derived
    checks whose column the dataframe has (default: all of the dataset's, see ``DerivedCheck``).
    """
    _quiet_gx()
    import great_expectations as gx
    import great_expectations.expectations as gxe

    name = dataset_name(dataset)
    schema = contracts.RAW_DATASETS[name]
    settings = settings or ValidationSettings()
    skip = set(skip_columns)
    suite = gx.ExpectationSuite(name=f"{RAW_PREFIX}.{name}")

    # exact_match=False: derived check columns sit beside the contract's; schema.columns reports extras.
    suite.add_expectation(
        gxe.ExpectTableColumnsToMatchSet(
            column_set=list(schema.names),
            exact_match=False,
            meta={"check": "table.columns_match_set"},
        )
    )
    suite.add_expectation(gxe.ExpectTableRowCountToBeBetween(min_value=1, meta={"check": "table.row_count"}))
    for col in schema.names:
        if col not in skip and not schema.field(col).nullable:
            suite.add_expectation(
                gxe.ExpectColumnValuesToNotBeNull(
                    column=col, meta={"check": f"{col}.not_null", "problem": f"null {col}"}
                )
            )
    for col in _IDS.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    min_value=1,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not a positive id"},
                )
            )
    for col in _UNIQUE.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeUnique(
                    column=col,
                    meta={"check": f"{col}.unique", "problem": f"{col} shared with another row"},
                )
            )
    for col, allowed in _IN_SET.get(name, {}).items():
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeInSet(
                    column=col,
                    value_set=list(allowed),
                    meta={"check": f"{col}.in_set", "problem": f"{col} outside {list(allowed)}"},
                )
            )
    for col, (regex, what) in _REGEX.get(name, {}).items():
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToMatchRegex(
                    column=col,
                    regex=regex,
                    meta={"check": f"{col}.well_formed", "problem": f"{col} that is not {what}"},
                )
            )
    start, end = day_bounds(ds)
    for col in _IN_DAY.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    min_value=start,
                    max_value=end,
                    strict_max=True,
                    meta={
                        "check": f"{col}.in_partition_day",
                        "problem": f"{col} outside [{start.isoformat()}, {end.isoformat()})",
                    },
                )
            )
    for col in _NOT_AFTER_DAY.get(name, ()):
        if col not in skip:
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=col,
                    max_value=end,
                    strict_max=True,
                    meta={
                        "check": f"{col}.not_after_partition_day",
                        "problem": f"{col} at or after the end of the partition day {end.isoformat()}",
                    },
                )
            )
    wanted = None if derived is None else set(derived)
    for check in _DERIVED[name]:
        if wanted is not None and check.name not in wanted:
            continue
        meta = {"check": check.name, "problem": check.problem}
        if check.kind == "embedding_length":
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeBetween(
                    column=check.column, min_value=contracts.EMBEDDING_DIM, max_value=contracts.EMBEDDING_DIM, meta=meta
                )
            )
        else:
            mostly = settings.min_referential_integrity if check.referential else 1.0
            suite.add_expectation(
                gxe.ExpectColumnValuesToBeInSet(column=check.column, value_set=[True], mostly=mostly, meta=meta)
            )
    return suite


def suite_check_names(dataset: str) -> list[str]:
    """The names of the checks of ``build_suite(dataset, ...)``, in order (no GX import)."""
    name = dataset_name(dataset)
    schema = contracts.RAW_DATASETS[name]
    names = ["table.columns_match_set", "table.row_count"]
    names += [f"{c}.not_null" for c in schema.names if not schema.field(c).nullable]
    names += [f"{c}.well_formed" for c in _IDS.get(name, ())]
    names += [f"{c}.unique" for c in _UNIQUE.get(name, ())]
    names += [f"{c}.in_set" for c in _IN_SET.get(name, {})]
    names += [f"{c}.well_formed" for c in _REGEX.get(name, {})]
    names += [f"{c}.in_partition_day" for c in _IN_DAY.get(name, ())]
    names += [f"{c}.not_after_partition_day" for c in _NOT_AFTER_DAY.get(name, ())]
    names += [c.name for c in _DERIVED[name]]
    return names


def check_names(dataset: str) -> list[str]:
    """Every check a report of ``dataset`` lists, in order."""
    return list(STORAGE_CHECKS) + suite_check_names(dataset) + list(HISTORY_CHECKS[dataset_name(dataset)])


# --- validation -------------------------------------------------------------------------------------


def report_dir(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> Path:
    return storage.local_root(root) / REPORTS_DIR / dataset_name(dataset) / f"ds={storage.ds_str(ds)}"


def validate_partition(
    root: str | os.PathLike[str],
    dataset: str,
    ds: str | dt.date,
    *,
    data_docs: bool = True,
    settings: ValidationSettings | None = None,
    quarantine: bool = False,
) -> ValidationReport:
    """Validate the raw partition ``<root>/raw/<dataset>/ds=<ds>`` and write its report and profile.

    ``dataset``: ``events``, ``pins`` or ``users`` (a ``raw/`` prefix is accepted). ``data_docs``:
    also render the GX Data Docs site of the run. ``settings``: thresholds (default:
    ``ValidationSettings()``). ``quarantine``: move a failed, complete partition to
    ``quarantine/<dataset>/ds=<ds>/<UTC time>/`` with a copy of its report (never deleted; an incomplete
    partition is left in place, its writer may still be landing it). Raises only for errors of the tool
    itself (a bad argument, a GX failure); everything wrong with the data is a failed check in the
    returned report.
    """
    started = time.perf_counter()
    name = dataset_name(dataset)
    day = storage.ds_str(ds)
    settings = settings or ValidationSettings()
    source = f"{RAW_PREFIX}/{name}"
    part = storage.partition_path(root, source, day)
    contract = contracts.RAW_DATASETS[name]
    out_dir = report_dir(root, name, day)

    checks: dict[str, Check] = {}
    files: list[Path] = []
    table: pa.Table | None = None
    bad_columns: set[str] = set()
    skip_reason = ""

    if not part.is_dir():
        checks["partition.marker"] = Check(
            "partition.marker",
            False,
            "partition folder missing",
            storage.MARKER,
            f"{part} does not exist: the partition has not landed",
        )
    elif not (part / storage.MARKER).exists():
        checks["partition.marker"] = Check(
            "partition.marker",
            False,
            "missing",
            storage.MARKER,
            f"no {storage.MARKER} marker in {part}: the partition is incomplete and does not exist for readers",
        )
    else:
        checks["partition.marker"] = Check("partition.marker", True, "present", storage.MARKER)
        files = storage.data_files(root, source, day)
        checks["partition.files"] = Check(
            "partition.files",
            bool(files),
            [f.name for f in files],
            ">= 1 *.parquet file",
            "" if files else f"{part} has a {storage.MARKER} marker but no *.parquet file: the partition is empty",
        )

    if not checks["partition.marker"].success:
        skip_reason = "the partition is missing or incomplete"
    elif not files:
        skip_reason = "the partition has no Parquet file"
    else:
        tables, readable = _read_files(files)
        checks["files.readable"] = readable
        if not readable.success:
            skip_reason = "a Parquet file is unreadable"
        else:
            checks["schema.columns"], checks["schema.types"], bad_columns = _check_schema(
                [(f, t.schema) for f, t in zip(files, tables, strict=True)], contract
            )
            try:
                table = pa.concat_tables(tables, promote_options="permissive")
            except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
                skip_reason = f"the files cannot be combined into one table ({err})"

    suite_names = suite_check_names(name)
    history_names = HISTORY_CHECKS[name]
    docs_rel: str | None = None
    profile: dict[str, Any] | None = None
    warnings: list[str] = []
    if table is None:
        for check_name in STORAGE_CHECKS:
            checks.setdefault(check_name, Check(check_name, None, details=f"not run: {skip_reason}"))
        for check_name in (*suite_names, *history_names):
            checks[check_name] = Check(check_name, None, details=f"not run: {skip_reason}")
        _remove_tree(out_dir / DATA_DOCS_DIR)  # a previous run's docs would contradict this report
    else:
        derived, not_run = _derived_columns(root, name, day, table, bad_columns)
        gx_checks, docs_rel = _run_suite(
            name, day, table, bad_columns, derived, settings, out_dir / DATA_DOCS_DIR if data_docs else None
        )
        for check_name in suite_names:
            checks[check_name] = gx_checks.get(check_name) or not_run.get(check_name) or Check(
                check_name, None, details="not run: the column is missing or of the wrong type"
            )
        if not data_docs:
            _remove_tree(out_dir / DATA_DOCS_DIR)
        profile = profile_table(name, table, previous_ids(root, name, day))
        history = trailing_profiles(storage.local_root(root) / REPORTS_DIR, name, day, settings.history_days)
        for result in history_checks(name, day, profile, history, settings):
            checks[result.name] = Check(result.name, result.success, result.observed, result.expected, result.details)
            if result.details.startswith("warning:") and result.details not in warnings:
                warnings.append(result.details)

    ordered = [checks[n] for n in check_names(name)]
    report = ValidationReport(
        dataset=name,
        ds=day,
        success=all(c.passed for c in ordered),
        checks=ordered,
        report_path=out_dir / RESULT_FILE,
        rows=None if table is None else table.num_rows,
        partition=str(part),
        files=[f.name for f in files],
        data_docs=docs_rel,
        profile=profile,
        quarantine_history=[str(p) for p in quarantine_records(root, name, day)],
        warnings=warnings,
    )
    # Only a complete partition is moved: an incomplete one may still be landing.
    move = quarantine and not report.success and checks["partition.marker"].success is True
    target = quarantine_root(root, name, day) / _timestamp() if move else None
    if target is not None:
        target.mkdir(parents=True)
        part.rename(target / "data")
        report.quarantine = str(target)
    report.duration_s = round(time.perf_counter() - started, 3)
    _write_report(report)
    if target is not None:
        shutil.copytree(out_dir, target / "report")
        storage.write_json_atomic(
            target / "QUARANTINE.json",
            {
                "dataset": f"{RAW_PREFIX}/{name}",
                "ds": day,
                "quarantined_at": dt.datetime.now(dt.UTC).isoformat(),
                "source": str(part),
                "failed_checks": [c.name for c in report.failed_checks],
                "message": report.failure_message(),
                "report": str(target / "report" / RESULT_FILE),
                "restore": f"fix the data, land it again at {part} (data files, then {storage.MARKER}) and clear "
                "the validation task; this record stays",
            },
        )
        log.warning("quarantined %s to %s", part, target)
    return report


def _timestamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")


def _derived_columns(
    root: str | os.PathLike[str], dataset: str, ds: str, table: pa.Table, bad_columns: set[str]
) -> tuple[dict[str, pa.Array], dict[str, Check]]:
    """The columns of the dataset's ``DerivedCheck``s, and the checks that cannot run (with why)."""
    columns: dict[str, pa.Array] = {}
    not_run: dict[str, Check] = {}
    for check in _DERIVED[dataset]:
        unusable = [c for c in check.sources if c not in table.column_names or (c in bad_columns and c != "embedding")]
        if unusable:
            not_run[check.name] = Check(check.name, None, details=f"not run: column {unusable} missing or mistyped")
            continue
        if check.reference is not None:
            ids, why = _reference_ids(root, check.reference, ds, check.sources[0])
            if ids is None:
                # The reference partition is validated by its own task; this partition is not to blame.
                not_run[check.name] = Check(
                    check.name, None, details=f"not run: {why}; validate_{check.reference} reports it", required=False
                )
                continue
            values = pc.is_in(table.column(check.sources[0]), value_set=ids)
            columns[check.column] = pc.if_else(pc.is_null(table.column(check.sources[0])), None, values)
        elif check.name == "engagement.has_impression":
            columns[check.column] = _has_impression(table)
        elif check.kind == "embedding_length":
            try:
                columns[check.column] = pc.list_value_length(table.column("embedding"))
            except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
                not_run[check.name] = Check(check.name, None, details="not run: embedding is not a list column")
        else:
            finite = _embedding_finite(table.column("embedding"))
            if finite is None:
                not_run[check.name] = Check(check.name, None, details="not run: embedding is not a list of floats")
            else:
                columns[check.column] = finite
    return columns, not_run


def _reference_ids(
    root: str | os.PathLike[str], dataset: str, ds: str, column: str
) -> tuple[pa.Array | None, str]:
    """The distinct ``column`` values of ``raw/<dataset>/ds=<ds>``, or None and why they are unavailable."""
    where = f"{RAW_PREFIX}/{dataset} ds={ds}"
    if not storage.is_complete(root, f"{RAW_PREFIX}/{dataset}", ds):
        return None, f"{where} is missing or incomplete"
    try:
        files = storage.data_files(root, f"{RAW_PREFIX}/{dataset}", ds)
        table = pa.concat_tables([pq.read_table(f, columns=[column]) for f in files])
        ids = pc.unique(table.column(column).cast(pa.int64()))
    except Exception as err:  # noqa: BLE001 - any unreadable reference makes the check not runnable
        return None, f"{where} is unreadable ({type(err).__name__}: {_short(str(err), 120)})"
    if not files:
        return None, f"{where} has no Parquet file"
    return ids, ""


def _has_impression(table: pa.Table) -> pa.Array:
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


def _embedding_finite(column: pa.ChunkedArray) -> pa.Array | None:
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


def _read_files(files: list[Path]) -> tuple[list[pa.Table], Check]:
    tables: list[pa.Table] = []
    unreadable: dict[str, str] = {}
    for f in files:
        try:
            tables.append(pq.read_table(f))
        except Exception as err:  # noqa: BLE001 - a corrupt file raises many types; each is a data failure
            unreadable[str(f)] = f"{type(err).__name__}: {err}"
    if unreadable:
        details = "; ".join(
            f"{path} is not a readable Parquet file (truncated or not Parquet): {msg}"
            for path, msg in unreadable.items()
        )
        return tables, Check("files.readable", False, unreadable, "every file readable as Parquet", details)
    return tables, Check("files.readable", True, {}, "every file readable as Parquet")


def _check_schema(schemas: list[tuple[Path, pa.Schema]], contract: pa.Schema) -> tuple[Check, Check, set[str]]:
    """Column names and types of every file against the contract; also the columns GX cannot judge."""
    missing: dict[str, list[str]] = {}
    unexpected: dict[str, list[str]] = {}
    wrong: dict[str, dict[str, str]] = {}
    for path, schema in schemas:
        for col in contract.names:
            if col not in schema.names:
                missing.setdefault(col, []).append(path.name)
            elif not schema.field(col).type.equals(contract.field(col).type):
                wrong.setdefault(col, {})[path.name] = str(schema.field(col).type)
        for col in schema.names:
            if col not in contract.names:
                unexpected.setdefault(col, []).append(path.name)

    columns_details = []
    if missing:
        columns_details.append(f"missing columns {sorted(missing)} (in {_files_of(missing)})")
    if unexpected:
        columns_details.append(f"unexpected columns {sorted(unexpected)} (in {_files_of(unexpected)})")
    columns = Check(
        "schema.columns",
        not missing and not unexpected,
        {"missing": sorted(missing), "unexpected": sorted(unexpected)},
        list(contract.names),
        "; ".join(columns_details),
    )
    types = Check(
        "schema.types",
        not wrong,
        {col: by_file for col, by_file in wrong.items()},
        {col: str(contract.field(col).type) for col in (wrong or contract.names)},
        "; ".join(
            f"{col} is {sorted(set(by_file.values()))} in {sorted(by_file)}, the contract says "
            f"{contract.field(col).type}"
            for col, by_file in wrong.items()
        ),
    )
    return columns, types, set(missing) | set(wrong)


def _files_of(by_column: dict[str, list[str]]) -> str:
    return ", ".join(sorted({f for files in by_column.values() for f in files}))


def _run_suite(
    dataset: str,
    ds: str,
    table: pa.Table,
    skip_columns: set[str],
    derived: dict[str, pa.Array],
    settings: ValidationSettings,
    docs_dir: Path | None,
) -> tuple[dict[str, Check], str | None]:
    """Run the GX suite on ``table``; return its checks by name and the Data Docs path (relative)."""
    _quiet_gx()
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch_definition = (
        context.data_sources.add_pandas("pinflow")
        .add_dataframe_asset(f"{RAW_PREFIX}_{dataset}")
        .add_batch_definition_whole_dataframe("partition")
    )
    by_column = {c.column: c.name for c in _DERIVED[dataset]}
    suite = context.suites.add(
        build_suite(
            dataset,
            ds,
            skip_columns=sorted(skip_columns),
            settings=settings,
            derived=[by_column[col] for col in derived],
        )
    )
    validation = context.validation_definitions.add(
        gx.ValidationDefinition(name=f"{RAW_PREFIX}_{dataset}_ds={ds}", data=batch_definition, suite=suite)
    )
    for column, values in derived.items():
        table = table.append_column(column, values)
    # Columns of a closed set as pandas categoricals: GX hashes, filters and tests membership of every row,
    # several times faster on codes than on strings (measured by benchmarks/validation.py).
    for col in _IN_SET.get(dataset, {}):
        if col in table.column_names and pa.types.is_string(table.schema.field(col).type):
            table = table.set_column(
                table.schema.get_field_index(col), col, pc.dictionary_encode(table.column(col))
            )
    frame: pd.DataFrame = table.to_pandas()
    result = validation.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")

    checks: dict[str, Check] = {}
    for item in result.results:
        config = item.expectation_config
        if config is None:
            raise RuntimeError(f"GX returned a result without its expectation for {RAW_PREFIX}/{dataset} ds={ds}")
        meta = config.meta or {}
        check_name = meta.get("check", config.type)
        checks[check_name] = _check_from_result(
            check_name, meta, config.kwargs, item.success, item.result, item.exception_info
        )

    docs_rel = None
    if docs_dir is not None:
        docs_rel = _build_data_docs(context, docs_dir)
    return checks, docs_rel


def _check_from_result(
    name: str,
    meta: dict[str, Any],
    kwargs: dict[str, Any],
    success: bool | None,
    result: dict[str, Any],
    exception_info: dict[str, Any] | None,
) -> Check:
    expected = {k: v for k, v in kwargs.items() if k not in {"column", "batch_id"}}
    raised = _raised_exception(exception_info)
    if raised:
        return Check(name, False, None, expected, f"GX could not evaluate this check: {raised}")
    if "observed_value" in result:
        observed: Any = result["observed_value"]
        details = ""
        if not success:
            mismatched = (result.get("details") or {}).get("mismatched")
            details = f"observed {_short(observed)}" + (f"; mismatched {mismatched}" if mismatched else "")
        return Check(name, bool(success), observed, expected, details)
    count = int(result.get("unexpected_count") or 0)
    total = int(result.get("element_count") or 0)
    # Distinct offending values with their counts: a duplicated id would otherwise fill the list.
    counts = result.get("partial_unexpected_counts") or [
        {"value": v, "count": 1} for v in result.get("partial_unexpected_list") or []
    ]
    examples = [c["value"] for c in counts[:_EXAMPLES]]
    observed = {
        "unexpected_count": count,
        "element_count": total,
        "unexpected_percent": result.get("unexpected_percent"),
        "examples": examples,
    }
    details = ""
    if not success:
        problem = meta.get("problem", "unexpected value")
        details = f"{count} of {total} rows have {problem}"
        shown = [
            f"{_short(json.dumps(_jsonable(c['value'])), 60)} ({c['count']}x)"
            for c in counts[:3]
            if c["value"] is not None
        ]
        if shown:
            details += f", e.g. {', '.join(shown)}"
    return Check(name, bool(success), observed, expected, details)


def _raised_exception(exception_info: dict[str, Any] | None) -> str:
    """The message of an exception GX caught while evaluating one expectation, or ''."""
    if not exception_info:
        return ""
    infos = [exception_info] if "raised_exception" in exception_info else list(exception_info.values())
    for info in infos:
        if isinstance(info, dict) and info.get("raised_exception"):
            return str(info.get("exception_message") or "unknown error")
    return ""


def _build_data_docs(context: Any, docs_dir: Path) -> str | None:
    """Render the run's Data Docs into ``docs_dir`` (replaced atomically); None when rendering fails."""
    tmp = docs_dir.parent / f".{docs_dir.name}-{uuid.uuid4().hex[:8]}"
    site = {
        "class_name": "SiteBuilder",
        "show_how_to_buttons": False,
        "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(tmp)},
        "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
    }
    try:
        context.add_data_docs_site("pinflow", site)
        context.build_data_docs(site_names=["pinflow"])
        # The site copies 3 MB of animated tutorial GIFs that no page of a validation result shows.
        for gif in (tmp / "static" / "images").glob("*.gif"):
            gif.unlink()
        _replace_tree(tmp, docs_dir)
    except Exception as err:  # noqa: BLE001 - the HTML is a convenience; the JSON report is the result
        log.warning("could not render GX Data Docs into %s: %s", docs_dir, err)
        _remove_tree(tmp)
        return None
    return f"{docs_dir.name}/index.html"


def _quiet_gx() -> None:
    """Import great_expectations with analytics off and its logging at WARNING."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    # Before the import: importing GX logs hundreds of INFO lines, which a task log at INFO would show.
    gx_logger = logging.getLogger("great_expectations")
    if gx_logger.level == logging.NOTSET:
        gx_logger.setLevel(logging.WARNING)
    import great_expectations  # noqa: F401 - imported here so that the next line finds its logger set up

    # This module pins its own logger to INFO and logs a temporary folder for every ephemeral context.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.WARNING)


# --- report files -----------------------------------------------------------------------------------


def _write_report(report: ValidationReport) -> None:
    """HTML and ``profile.json`` first, then ``result.json`` atomically: the JSON is the report's completion
    marker (history reads a profile only beside a passing result)."""
    out_dir = report.report_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = out_dir / HTML_FILE
    tmp = html_path.with_name(f".{html_path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(_render_html(report), encoding="utf-8")
    tmp.replace(html_path)
    profile_path = out_dir / PROFILE_FILE
    if report.profile is not None:
        storage.write_json_atomic(profile_path, {"dataset": report.dataset, "ds": report.ds, **report.profile})
    else:
        profile_path.unlink(missing_ok=True)  # a previous run's profile would describe other data
    payload = report.to_dict()
    payload["great_expectations_version"] = _gx_version()
    payload["validated_at"] = dt.datetime.now(dt.UTC).isoformat()
    storage.write_json_atomic(report.report_path, payload)


def _gx_version() -> str | None:
    module = sys.modules.get("great_expectations")
    return getattr(module, "__version__", None)


def _render_html(report: ValidationReport) -> str:
    esc = html.escape
    rows = "\n".join(
        f'<tr class="{c.status}"><td>{esc(c.name)}</td><td>{c.status}</td>'
        f"<td><code>{esc(_short(_jsonable(c.observed), 400))}</code></td>"
        f"<td><code>{esc(_short(_jsonable(c.expected), 400))}</code></td><td>{esc(c.details)}</td></tr>"
        for c in report.checks
    )
    verdict = "passed" if report.success else "FAILED"
    docs = (
        f'<p>Great Expectations Data Docs: <a href="{esc(report.data_docs)}">{esc(report.data_docs)}</a></p>'
        if report.data_docs
        else "<p>No Great Expectations Data Docs for this run (the suite did not run).</p>"
    )
    title = f"{RAW_PREFIX}/{report.dataset} ds={report.ds}: {verdict}"
    notes = "".join(f"<p class=\"note\">{esc(w)}</p>" for w in report.warnings)
    if report.quarantine:
        notes += f"<p class=\"note\">Quarantined: the partition was moved to <code>{esc(report.quarantine)}</code></p>"
    if report.quarantine_history:
        notes += "<p>Earlier quarantines: " + ", ".join(f"<code>{esc(q)}</code>" for q in report.quarantine_history) + "</p>"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }}
tr.failed td {{ background: #fdd; }} tr.skipped td {{ color: #777; }} tr.passed td:nth-child(2) {{ color: #070; }}
code {{ white-space: pre-wrap; word-break: break-all; }} p.note {{ background: #ffd; padding: 4px; }}
</style></head><body>
<h1>{esc(title)}</h1>
<p>Partition: <code>{esc(report.partition)}</code> &mdash; rows: {report.rows} &mdash;
files: {esc(", ".join(report.files) or "none")} &mdash; {report.duration_s} s</p>
{docs}
{notes}
<table><tr><th>check</th><th>status</th><th>observed</th><th>expected</th><th>details</th></tr>
{rows}
</table></body></html>
"""


def _replace_tree(new: Path, final: Path) -> None:
    old = final.parent / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
    if final.exists():
        final.rename(old)
    new.rename(final)
    _remove_tree(old)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _jsonable(value: Any) -> Any:
    """``value`` with numpy scalars, timestamps and sets turned into plain JSON types."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v) for v in value), key=str)
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return _jsonable(item())
        except (TypeError, ValueError):
            pass
    tolist = getattr(value, "tolist", None)  # numpy arrays
    if callable(tolist):
        return _jsonable(tolist())
    return str(value)


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- command line -----------------------------------------------------------------------------------


class _ArgumentParser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; here 2 means "the data failed", so a usage error exits 1."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _ArgumentParser(
        prog="python -m features.validate",
        description=(
            "Validate one raw partition <root>/raw/<dataset>/ds=<ds> against its contract and GX suite, "
            "and write the report to <root>/reports/validation/<dataset>/ds=<ds>/result.json. "
            "Exit status: 0 passed, 2 failed validation, 1 error of the tool. "
            "The last line printed is the report path."
        ),
    )
    parser.add_argument("dataset", choices=sorted(contracts.RAW_DATASETS), help="the raw dataset")
    parser.add_argument("--root", required=True, help="storage root: a local path or file:// URL")
    parser.add_argument("--ds", required=True, help="the partition day, YYYY-MM-DD")
    parser.add_argument("--no-data-docs", action="store_true", help="skip rendering the GX Data Docs HTML site")
    parser.add_argument(
        "--quarantine",
        action="store_true",
        help="move a failed, complete partition to <root>/quarantine/<dataset>/ds=<ds>/<UTC time>/ with its report",
    )
    args = parser.parse_args(argv)
    try:
        day = storage.ds_str(args.ds)
        storage.local_root(args.root)
        report = validate_partition(
            args.root, args.dataset, day, data_docs=not args.no_data_docs, quarantine=args.quarantine
        )
    except Exception as err:  # noqa: BLE001 - the CLI turns any tool error into exit status 1
        if not isinstance(err, ValueError):  # a bad argument needs no traceback; a bug does
            traceback.print_exc(file=sys.stderr)
        print(
            f"error: validating {RAW_PREFIX}/{args.dataset} ds={args.ds}: {type(err).__name__}: {err}", file=sys.stderr
        )
        return EXIT_ERROR
    if report.success:
        print(
            f"{RAW_PREFIX}/{report.dataset} ds={report.ds}: passed {len(report.checks)} checks "
            f"on {report.rows} rows in {report.duration_s} s"
        )
    else:
        print(report.failure_message())
    print(report.report_path, flush=True)
    return EXIT_OK if report.success else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
