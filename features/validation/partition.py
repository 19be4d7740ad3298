"""``validate_partition``: run the stages of the gate on one raw partition, in order, and write the report.

1. storage and physical schema (``checks``): marker, files, readability, column names and types;
2. derived columns (``derived``) and the Great Expectations suite (``suite``) on the partition as one table;
3. the profile and the history checks against the trailing validated days (``history``);
4. the report (``report``), after moving a failed, complete partition to quarantine when asked.
"""

from __future__ import annotations

import datetime as dt
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from core import contracts, storage
from core.config import ValidationConfig
from core.scratch import scratch as scratch_folder
from features.bucketed_events import write_event_buckets
from features.validation.checks import (
    EXAMPLES,
    STORAGE_CHECKS,
    Check,
    dataset_name,
    raw_dataset,
    read_partition,
)
from features.validation.derived import DERIVED, derived_columns
from features.validation.history import (
    HISTORY_CHECKS,
    history_checks,
    previous_ids,
    profile_table,
    trailing_profiles,
)
from features.validation.report import (
    DATA_DOCS_DIR,
    HTML_FILE,
    RESULT_FILE,
    ValidationReport,
    content_fingerprint,
    quarantine_partition,
    quarantine_records,
    record_quarantine,
    report_dir,
    write_report,
)
from features.validation.suite import IN_SET, run_suite, suite_check_names

# The id column that names a row of each raw dataset in a failure message.
ROW_KEYS: dict[str, str] = {"events": "event_id", "pins": "pin_id", "users": "user_id", "pin_labels": "review_id"}


def name_offenders(checks: dict[str, Check], dataset: str, table: pa.Table, derived: dict[str, pa.Array]) -> None:
    """Add to each failed derived or not-null check a sample of the ids of its offending rows (what to look up
    upstream): the row's id, or its row number when the id itself is null (a null's own value names nothing)."""
    key = ROW_KEYS[dataset]
    for name, null_check in checks.items():
        column, _, kind = name.partition(".")
        if kind != "not_null" or null_check.success is not False or column not in table.column_names:
            continue
        nulls = pc.is_null(table.column(column))
        if column == key or key not in table.column_names:
            _add_sample(null_check, "rows", pc.indices_nonzero(nulls), "rows (numbered from 0, files in name order)")
        else:
            _add_sample(null_check, key, pc.filter(table.column(key), nulls))
    if key not in table.column_names:
        return
    for check in DERIVED[dataset]:
        result = checks.get(check.name)
        values = derived.get(check.column)
        if result is None or result.success is not False or values is None or check.kind != "true":
            continue
        _add_sample(result, key, pc.filter(table.column(key), pc.equal(pc.fill_null(values, True), False)))


def _add_sample(result: Check, name: str, offending: pa.Array | pa.ChunkedArray, said: str = "") -> None:
    """``offending_<name>`` in the check's observed values, and ``said`` (default: the name) in its details."""
    sample = offending.slice(0, EXAMPLES).to_pylist()
    if sample:
        result.details += f"; offending {said or name}: {sample}" + (" ..." if len(offending) > EXAMPLES else "")
        if isinstance(result.observed, dict):
            result.observed[f"offending_{name}"] = sample


def check_names(dataset: str) -> list[str]:
    """Every check a report of ``dataset`` lists, in order."""
    return list(STORAGE_CHECKS) + suite_check_names(dataset) + list(HISTORY_CHECKS[dataset_name(dataset)])


def check_config_names(config: ValidationConfig) -> None:
    """ConfigError naming each dataset under ``validation.per_dataset`` / ``severity`` and each check name (or
    ``prefix.*``) under ``severity`` that matches nothing: a typo there would otherwise silently change nothing."""
    import difflib

    from core.failures import ConfigError

    known = {name: check_names(name) for name in contracts.RAW_DATASETS}
    problems = []
    for section in ("per_dataset", "severity"):
        for scope in getattr(config, section):
            if scope not in known and not (section == "severity" and scope == "*"):
                close = difflib.get_close_matches(scope, list(known), n=1)
                problems.append(f"validation.{section}.{scope}: no such dataset" + (
                    f" (did you mean {close[0]!r}?)" if close else f" (datasets: {', '.join(known)})"))
    for scope, rules in config.severity.items():
        names = sorted({n for dataset, checks in known.items() if scope in ("*", dataset) for n in checks})
        for pattern in rules:
            if not names or pattern in names or (pattern.endswith(".*") and any(n.startswith(pattern[:-1]) for n in names)):
                continue
            close = difflib.get_close_matches(pattern, names, n=1)
            problems.append(f"validation.severity.{scope}: {pattern!r} names no check" + (
                f" (did you mean {close[0]!r}?)" if close else " (the checks: any report's result.json lists them)"))
    if problems:
        raise ConfigError("invalid validation settings: " + "; ".join(problems))


def validate_partition(
    root: storage.Location,
    dataset: str,
    ds: str | dt.date,
    *,
    config: ValidationConfig,
    data_docs: bool = True,
    quarantine: bool = False,
    event_buckets: int = 0,
) -> ValidationReport:
    """Validate the raw partition ``<root>/raw/<dataset>/ds=<ds>`` and write its report and profile.

    ``root``: a local path, ``file://`` URL or fsspec URL (``s3://bucket/prefix``). ``dataset``: ``events``,
    ``pins`` or ``users`` (a ``raw/`` prefix is accepted). ``config``: the thresholds, the ``validation:``
    section of the platform configuration. ``data_docs``: also render the GX Data Docs site of the run.
    ``quarantine``: move a failed, complete partition to ``quarantine/<dataset>/ds=<ds>/<UTC time>/`` with a
    copy of its report (never deleted; an incomplete partition is left in place, its writer may still be
    landing it). The caller applies ``config.data_docs`` and ``config.quarantine`` through these two.
    ``event_buckets`` > 0: a passed events partition is also written bucketed in that many files by user and by pin
    (``features.bucketed_events.write_event_buckets``), so the shards of a sharded build read only their part.

    Raises only for errors of the tool itself (a bad argument, a GX failure, storage that does not answer);
    everything wrong with the data is a failed check in the returned report.
    """
    started = time.perf_counter()
    name = dataset_name(dataset)
    check_config_names(config)
    config = config.for_dataset(name)  # validation.per_dataset thresholds
    day = storage.ds_str(ds)
    out_dir = report_dir(root, name, day)
    # Taken before the partition is read: if it changes while it is read, the verdict cannot vouch for the new
    # contents (features.build compares this fingerprint with the partition's when it reads it).
    location = storage.partition(root, raw_dataset(name), day)
    fingerprint = content_fingerprint(location) if storage.exists(storage.join(location, storage.MARKER)) else None
    # The closed sets' string columns also as the dictionary codes Parquet stores: the suite judges codes.
    contract = contracts.RAW_SCHEMAS[name]
    closed_strings = [c for c in IN_SET.get(name, {}) if c in contract.names and pa.types.is_string(contract.field(c).type)]
    found = read_partition(root, name, day, dictionary=closed_strings)
    checks = found.checks
    suite_names = suite_check_names(name)
    profile: dict[str, Any] | None = None
    warnings: list[str] = []
    rendered = False

    # GX renders Data Docs only to a local folder: a temporary one, copied under the report by write_report.
    with scratch_folder("pinflow-data-docs-") as scratch:
        docs_dir = Path(scratch) / DATA_DOCS_DIR if data_docs else None
        if found.table is None:
            for check_name in STORAGE_CHECKS:
                checks.setdefault(check_name, Check(check_name, None, details=f"not run: {found.skip_reason}"))
            for check_name in (*suite_names, *HISTORY_CHECKS[name]):
                checks[check_name] = Check(check_name, None, details=f"not run: {found.skip_reason}")
        else:
            table = found.table
            # The profile, with the ids of the day before it compares with, is Arrow work that needs nothing from
            # the suite: it runs on a second thread while the derived columns and the suite (mostly GX's Python)
            # are computed, and is waited for before the history checks.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="pinflow-profile") as pool:
                profiling = pool.submit(lambda: profile_table(name, table, previous_ids(root, name, day)))
                derived, not_run = derived_columns(root, name, day, table, found.bad_columns, config)
                gx_checks, rendered = run_suite(
                    name, day, table, config=config, skip_columns=found.bad_columns, derived=derived,
                    docs_dir=docs_dir, encoded=found.encoded,
                )
                profile = profiling.result()
            schema = contracts.RAW_SCHEMAS[name]
            absent = {c for c in schema.names if schema.field(c).nullable and c not in table.column_names}
            for check_name in suite_names:
                column = check_name.split(".", 1)[0]
                checks[check_name] = gx_checks.get(check_name) or not_run.get(check_name) or (
                    Check(check_name, None, details=f"not run: the optional column {column} is absent", required=False)
                    if column in absent
                    else Check(check_name, None, details="not run: the column is missing or of the wrong type")
                )
            name_offenders(checks, name, table, derived)
            # An incremental snapshot (only changed rows) is compared with increments, a full one with full ones.
            profile["snapshot"] = snapshot = storage.read_metadata(root, name, day).get("snapshot", "full")
            history = [
                (d, p) for d, p in trailing_profiles(root, name, day, config.history_days)
                if p.get("snapshot", "full") == snapshot
            ]
            weekdays = [
                (d, p) for d, p in trailing_profiles(root, name, day, config.weekday_weeks, step=7)
                if p.get("snapshot", "full") == snapshot
            ]
            for result in history_checks(name, day, profile, history, config, weekdays):
                checks[result.name] = Check(
                    result.name, result.success, result.observed, result.expected, result.details
                )
                if result.details.startswith("warning:") and result.details not in warnings:
                    warnings.append(result.details)

        ordered = [checks[n] for n in check_names(name)]
        for check in ordered:
            check.severity = config.severity_of(name, check.name, day)
            if check.severity == "warn" and check.success is False:
                warning = f"warning: {check.name} failed, reported only (validation.severity warn): {check.details}"
                warnings.append(warning)
            elif check.severity == "off":
                check.details = "off (validation.severity)" + (f"; {check.details}" if check.details else "")
        report = ValidationReport(
            dataset=name,
            ds=day,
            success=all(c.passed for c in ordered),
            checks=ordered,
            report_path=storage.join(out_dir, RESULT_FILE),
            rows=None if found.table is None else found.table.num_rows,
            partition=found.location,
            files=[storage.name_of(f) for f in found.files],
            data_docs=f"{DATA_DOCS_DIR}/{HTML_FILE}" if rendered else None,
            profile=profile,
            quarantine_history=quarantine_records(root, name, day),
            warnings=warnings,
            thresholds=config.model_dump(),
            fingerprint=fingerprint,
        )
        # Only a complete partition is moved: an incomplete one may still be landing. The failed verdict is written
        # first (a full disk or a kill then leaves the partition where it was, never a stale passed verdict), then
        # the partition moved, then the report again, saying where it went.
        record = None
        if quarantine and not report.success and found.complete:
            report.duration_s = round(time.perf_counter() - started, 3)
            write_report(report, docs_dir if rendered else None)
            record = quarantine_partition(root, name, day)
            # None: another validation moved it meanwhile; the report names its record (the newest).
            report.quarantine = record or next(reversed(quarantine_records(root, name, day)), None)
        report.duration_s = round(time.perf_counter() - started, 3)
        write_report(report, docs_dir if rendered else None)
    if record is not None:
        record_quarantine(report, record)
    if event_buckets > 0 and name == "events" and report.success:
        write_event_buckets(root, day, event_buckets)
    return report

