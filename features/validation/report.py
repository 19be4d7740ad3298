"""The validation report of a raw partition, and the quarantine of a partition that failed.

The report folder is ``<root>/reports/validation/<dataset>/ds=<ds>/``: ``result.json`` (every check with its
observed value; written last, so that it marks the report complete), ``index.html`` (a self-contained table
of the checks), ``profile.json`` (the partition's profile, which later days compare with) and
``data_docs/`` (the GX Data Docs site of the run, when the suite ran). The folder is replaced whole through
``core.storage.publish``, so a rerun never leaves a previous run's Data Docs or profile beside a new result.

A failed, complete partition is quarantined under ``<root>/quarantine/<dataset>/ds=<ds>/<UTC time>/``:
``data/`` (the partition as it was landed, marker included), ``report/`` (a copy of the report) and
``QUARANTINE.json`` (what failed and how to restore), written last. Nothing there is ever deleted.

Every location is a ``core.storage`` string, on a local root or an object store alike.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import html
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core import contracts, storage
from features.validation.checks import Check, dataset_name, jsonable, raw_dataset, short

log = logging.getLogger(__name__)

RESULT_FILE = "result.json"
HTML_FILE = "index.html"
PROFILE_FILE = "profile.json"
DATA_DOCS_DIR = "data_docs"
QUARANTINE_FILE = "QUARANTINE.json"
# The scheme of ``content_fingerprint``; a report with another one (or none) does not vouch for the contents.
FINGERPRINT_SCHEME = "parquet-footers-v2"


def report_dir(root: storage.Location, dataset: str, ds: str | dt.date) -> str:
    """``<root>/reports/validation/<dataset>/ds=<ds>``: the report folder of a raw partition."""
    return storage.partition(root, f"{contracts.VALIDATION_REPORTS}/{dataset_name(dataset)}", ds)


def _parent(location: str) -> str:
    return location.rstrip("/").rsplit("/", 1)[0]


@dataclass
class ValidationReport:
    """The outcome of validating one raw partition; ``report_path`` is its ``result.json``."""

    dataset: str
    ds: str
    success: bool
    checks: list[Check]
    report_path: str
    rows: int | None = None
    partition: str = ""
    files: list[str] = field(default_factory=list)
    data_docs: str | None = None  # the GX Data Docs index, relative to the report folder
    duration_s: float = 0.0
    profile: dict[str, Any] | None = None
    quarantine: str | None = None  # where the failed partition was moved, with a copy of this report
    quarantine_history: list[str] = field(default_factory=list)  # earlier quarantines of this partition
    warnings: list[str] = field(default_factory=list)
    thresholds: dict[str, Any] = field(default_factory=dict)  # the validation: settings this run used
    # ``content_fingerprint`` of the partition taken before it was read: what this verdict is about.
    fingerprint: str | None = None

    @property
    def folder(self) -> str:
        """The report folder (``result.json``'s)."""
        return _parent(self.report_path)

    @property
    def failed_checks(self) -> list[Check]:
        """The checks that failed and count (``severity: fail``): why the partition failed."""
        return [c for c in self.checks if c.success is False and c.severity == "fail"]

    @property
    def warned_checks(self) -> list[Check]:
        """Checks that failed at ``severity: warn``: reported, never a reason to quarantine."""
        return [c for c in self.checks if c.success is False and c.severity == "warn"]

    @property
    def data_docs_path(self) -> str:
        """The page to show for this run: the GX Data Docs index, or this report's own HTML."""
        return storage.join(self.folder, *(self.data_docs or HTML_FILE).split("/"))

    def summary(self) -> dict[str, Any]:
        """A short JSON-serializable dict for XCom."""
        return {
            "dataset": self.dataset,
            "ds": self.ds,
            "success": self.success,
            "rows": self.rows,
            "failed_checks": [c.name for c in self.failed_checks],
            "top_failures": [f"{c.name}: {short(c.details or c.observed, 160)}" for c in self.failed_checks[:3]],
            "report_path": self.report_path,
            "data_docs": self.data_docs_path,
            "quarantine": self.quarantine,
            "warned_checks": [c.name for c in self.warned_checks],
            "warnings": self.warnings,
        }

    def failure_message(self, top: int = 5, again: str = "clear this task to validate it again") -> str:
        """What failed, where, what was seen and how to fix it (then ``again``: the DAG task's way by default); empty
        when the partition passed."""
        if self.success:
            return ""
        source = raw_dataset(self.dataset)
        failed = self.failed_checks
        skipped = sum(1 for c in self.checks if c.success is None)
        lines = [
            f"Validation failed for {source} partition ds={self.ds}: "
            f"{len(failed)} of {len(self.checks)} checks failed" + (f", {skipped} not run" if skipped else "")
        ]
        for check in failed[:top]:
            lines.append(f"  - {check.name}: {check.details or short(check.observed)}")
        if len(failed) > top:
            lines.append(f"  - ... and {len(failed) - top} more")
        lines.append(f"Report: {self.report_path}")
        where = self.partition or f"{source}/ds={self.ds}"
        if self.quarantine:
            lines.append(f"Quarantined: the partition was moved to {self.quarantine} (with this report)")
        if failed and failed[0].name == "partition.marker":
            fix = f"land the partition {where} (its data files, then its {storage.MARKER} marker)"
        else:
            fix = (
                f"correct the upstream data and replace the partition {where} (data files and its "
                f"{storage.MARKER} marker, written atomically)"
            )
        lines.append(f"Fix: {fix}, then {again}.")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["checks"] = [c.to_dict() for c in self.checks]
        payload["failed_checks"] = [c.name for c in self.failed_checks]
        payload.pop("profile", None)  # profile.json beside the report holds it
        return payload


# --- the content fingerprint -------------------------------------------------------------------------


def _files_with_stamps(location: storage.Location) -> list[tuple[str, int, str]]:
    """(name, size, write stamp) of the plain files directly in a folder, sorted by name; [] if there is none.

    The stamp changes whenever a file is written: its modification time in ns on a local root (a copy that keeps
    it, such as ``shutil.copy2`` or a hard link, keeps the stamp), its ETag on an object store (a hash of its bytes).
    """
    if not storage.is_remote(location):
        try:
            with os.scandir(storage.local_path(location)) as entries:
                return sorted((e.name, (st := e.stat()).st_size, str(st.st_mtime_ns)) for e in entries if e.is_file())
        except FileNotFoundError:
            return []
    fs, key = storage.filesystem(location)
    try:
        listing = fs.ls(key, detail=True)
    except FileNotFoundError:
        return []
    return sorted((storage.name_of(e["name"]), int(e["size"]), str(e.get("ETag") or e.get("LastModified") or ""))
                  for e in listing if e.get("type") == "file")


def _read_range(location: str, start: int, end: int) -> bytes:
    if not storage.is_remote(location):
        with storage.local_path(location).open("rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, key = storage.filesystem(location)
    return bytes(fs.cat_file(key, start=start, end=end))


def content_fingerprint(location: storage.Location) -> str:
    """A cheap fingerprint of a partition folder's current contents, ``parquet-footers-v2:<sha256>``.

    Over every file but the marker and hidden ones: its name, its size, its write stamp (``_files_with_stamps``:
    a rewrite that keeps the size and the footer, such as a value changed in an uncompressed column, still changes
    it) and, for a Parquet file, the hash of its footer (row counts, offsets and every column chunk's statistics),
    for another file (``_metadata.json``) the hash of its bytes. A rewrite, an added, removed or replaced file
    changes it; reading it costs one listing and one small ranged read per file, on a local root or an object store
    alike. On an object store, of the version folder the partition's marker names (``core.storage.resolve``).
    """
    return storage.read_version(location, _fingerprint)


def _fingerprint(location: str) -> str:
    digest = hashlib.sha256(FINGERPRINT_SCHEME.encode())
    for name, size, stamp in _files_with_stamps(location):
        if name == storage.MARKER or name.startswith("."):
            continue
        path = storage.join(location, name)
        content = b""
        if name.endswith(".parquet") and size >= 12:
            tail = _read_range(path, size - 8, size)
            footer = int.from_bytes(tail[:4], "little")
            if tail[4:] == b"PAR1" and footer <= size - 12:
                content = _read_range(path, size - 8 - footer, size)
        if not content:  # not Parquet, or not valid Parquet (validation fails it): the whole file
            content = storage.read_bytes(path)
        digest.update(json.dumps([name, size, stamp, hashlib.sha256(content).hexdigest()]).encode())
    return f"{FINGERPRINT_SCHEME}:{digest.hexdigest()}"


def unvalidated_reason(root: storage.Location, dataset: str, ds: str | dt.date) -> tuple[str, str | None]:
    """The partition's current fingerprint, and why its report does not vouch for it (None when it does).

    It does when ``result.json`` says the partition passed and records the fingerprint it has now.
    """
    day = storage.ds_str(ds)
    fingerprint = content_fingerprint(storage.partition(root, raw_dataset(dataset), day))
    result = storage.join(report_dir(root, dataset, day), RESULT_FILE)
    try:
        report = storage.read_json(result)
    except FileNotFoundError:
        return fingerprint, f"it has not been validated (no report at {result})"
    if not report.get("success"):
        failed = ", ".join(report.get("failed_checks") or []) or "see the report"
        return fingerprint, f"its validation failed ({failed}; report {result})"
    recorded = report.get("fingerprint")
    if not recorded:
        return fingerprint, f"its report {result} records no content fingerprint (validated by an older version)"
    if recorded.split(":")[0] != FINGERPRINT_SCHEME:
        return fingerprint, f"its report {result} records a fingerprint of an older version ({recorded.split(':')[0]})"
    if recorded != fingerprint:
        return fingerprint, f"its contents changed since it passed validation at {report.get('validated_at')} ({result})"
    return fingerprint, None


# --- the report folder ---------------------------------------------------------------------------------


def write_report(report: ValidationReport, data_docs: Path | None = None) -> None:
    """Write the report folder of ``report``, replacing the previous run's whole.

    ``data_docs``: a local folder holding the run's rendered GX Data Docs site (GX renders only to a local
    filesystem), copied to ``data_docs/`` of the report. ``result.json`` goes last.
    """
    folder = report.folder
    if storage.is_remote(folder):
        # An object store has no rename: the folder is emptied and refilled in place. The old result goes
        # first, so that history never takes the old day's verdict beside a half-written new profile.
        storage.remove(storage.join(folder, RESULT_FILE))
    with storage.publish(folder, marker=None) as staging:
        storage.write_text(storage.join(staging, HTML_FILE), render_html(report))
        if report.profile is not None:
            storage.write_json(
                storage.join(staging, PROFILE_FILE), {"dataset": report.dataset, "ds": report.ds, **report.profile}
            )
        if data_docs is not None and report.data_docs:
            storage.copy_tree(str(data_docs), storage.join(staging, DATA_DOCS_DIR))
        payload = report.to_dict()
        payload["great_expectations_version"] = _gx_version()
        payload["validated_at"] = dt.datetime.now(dt.UTC).isoformat()
        storage.write_json(storage.join(staging, RESULT_FILE), payload)


def _gx_version() -> str | None:
    module = sys.modules.get("great_expectations")
    return getattr(module, "__version__", None)


def render_html(report: ValidationReport) -> str:
    """The report as one self-contained HTML page: a table of every check."""
    esc = html.escape
    rows = "\n".join(
        f'<tr class="{c.status}"><td>{esc(c.name)}</td><td>{c.status}</td>'
        f"<td><code>{esc(short(jsonable(c.observed), 400))}</code></td>"
        f"<td><code>{esc(short(jsonable(c.expected), 400))}</code></td><td>{esc(c.details)}</td></tr>"
        for c in report.checks
    )
    verdict = "passed" if report.success else "FAILED"
    docs = (
        f'<p>Great Expectations Data Docs: <a href="{esc(report.data_docs)}">{esc(report.data_docs)}</a></p>'
        if report.data_docs
        else "<p>No Great Expectations Data Docs for this run (the suite did not run, or they were not asked for).</p>"
    )
    title = f"{raw_dataset(report.dataset)} ds={report.ds}: {verdict}"
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


# --- quarantine ----------------------------------------------------------------------------------------


def quarantine_root(root: storage.Location, dataset: str, ds: str | dt.date) -> str:
    """``<root>/quarantine/<dataset>/ds=<ds>``: one sub-folder per quarantine, named by its UTC time."""
    return storage.partition(root, f"{contracts.QUARANTINE}/{dataset_name(dataset)}", ds)


def quarantine_records(root: storage.Location, dataset: str, ds: str | dt.date) -> list[str]:
    """The quarantine folders of a partition, oldest first (each keeps the data and report it had)."""
    base = quarantine_root(root, dataset, ds)
    records = [storage.join(base, name) for name in storage.list_names(base) if not name.startswith(".")]
    return [record for record in records if storage.is_dir(record)]


def quarantine_partition(root: storage.Location, dataset: str, ds: str) -> str | None:
    """Move the complete partition ``raw/<dataset>/ds=<ds>`` to a new quarantine record; return the record (None
    when another validation of the partition moved it meanwhile: its record is the newest).

    The marker goes first: on an object store the move is a copy then a delete, and a reader must never
    see a half-moved partition; without its marker the partition does not exist for readers. The record's
    ``data/`` gets the marker back last, so that it holds the partition exactly as it was landed. On an object
    store a versioned partition's published version is moved (the versions kept beside it for readers are removed):
    its files go directly into ``data/``, with a plain marker (the publish time), as on a local root.
    """
    part = storage.partition(root, raw_dataset(dataset), ds)
    record = storage.join(quarantine_root(root, dataset, ds), dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ"))
    target = storage.join(record, "data")
    marker = storage.join(part, storage.MARKER)
    try:
        stamp = storage.read_bytes(marker)
        version = storage.marker_version(stamp) if storage.is_remote(part) else None
        storage.remove(marker)
        if version:
            current = storage.join(part, f"{storage.VERSION_PREFIX}{version}")
            storage.remove(storage.join(current, storage.MARKER))  # its own copy of the marker: data/ gets one last
            storage.move_tree(current, target)
            storage.remove_tree(part)
            stamp = str(json.loads(stamp).get("published") or dt.datetime.now(dt.UTC).isoformat()).encode()
        else:
            storage.move_tree(part, target)
    except FileNotFoundError:
        storage.remove_tree(record)  # this record's part of a move another validation finished
        log.warning("%s was quarantined meanwhile by another validation of it", part)
        return None
    storage.write_bytes(storage.join(target, storage.MARKER), stamp)
    log.warning("quarantined %s to %s", part, record)
    return record


def record_quarantine(report: ValidationReport, record: str) -> None:
    """Complete a quarantine record: a copy of the written report, then ``QUARANTINE.json`` last."""
    storage.copy_tree(report.folder, storage.join(record, "report"))
    storage.write_json(
        storage.join(record, QUARANTINE_FILE),
        {
            "dataset": raw_dataset(report.dataset),
            "ds": report.ds,
            "quarantined_at": dt.datetime.now(dt.UTC).isoformat(),
            "source": report.partition,
            "failed_checks": [c.name for c in report.failed_checks],
            "message": report.failure_message(),
            "report": storage.join(record, "report", RESULT_FILE),
            "restore": f"fix the data, land it again at {report.partition} (data files, then {storage.MARKER}) "
            "and clear the validation task; this record stays",
        },
    )
