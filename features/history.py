"""History checks of the raw datasets: a profile of every validated partition, compared with trailing days.

``profile_table`` summarises one partition (row count, per-action counts and mix, null rates per column,
distinct users and pins, the share of ids not seen the day before). ``validate`` stores it as
``profile.json`` beside the partition's report. ``history_checks`` compares a new profile with the
profiles of the trailing days that passed validation (a quarantined day never becomes history):

* ``history.volume`` — the row count inside ``[volume_min_ratio, volume_max_ratio]`` x the trailing median;
* ``history.action_mix`` (events) — the population stability index of the action mix against the pooled
  mix of the trailing days, at most ``action_mix_max_psi``;
* ``history.null_rate`` — no column's null rate more than ``null_rate_max_increase`` above its trailing
  median.

With fewer than ``min_history_days`` trailing profiles (the first days of a dataset) the history checks
pass with a warning. ``window_gaps`` lists the days of a feature window whose raw events are missing or
quarantined, for the window gap switch of the operator layer.

Pure functions of explicit arguments and storage paths; pyarrow only.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from features import contracts, storage

log = logging.getLogger(__name__)

PROFILE_FILE = "profile.json"
QUARANTINE_DIR = "quarantine"

GapPolicy = Literal["fail", "proceed"]

# History checks per dataset, in report order.
HISTORY_CHECKS: dict[str, tuple[str, ...]] = {
    "events": ("history.volume", "history.action_mix", "history.null_rate"),
    "pins": ("history.volume", "history.null_rate"),
    "users": ("history.volume", "history.null_rate"),
}
# Id columns whose distinct count and new-id rate a profile records, per dataset.
_ID_COLUMNS: dict[str, tuple[str, ...]] = {"events": ("user_id", "pin_id"), "pins": ("pin_id",), "users": ("user_id",)}
_PSI_EPSILON = 1e-4  # floor of a bucket's share, so that an empty bucket gives a large, finite PSI


@dataclass(frozen=True)
class ValidationSettings:
    """Thresholds of the validation gate; ``config/platform.yaml`` ``validation:`` holds the defaults.

    ``min_referential_integrity``: the share of events whose pin (user) is in that day's pins (users)
    snapshot must be at least this. ``history_days``: trailing days a profile is compared with.
    ``min_history_days``: fewer trailing profiles than this and the history checks pass with a warning.
    """

    min_referential_integrity: float = 0.999
    history_days: int = 7
    min_history_days: int = 3
    volume_min_ratio: float = 0.5
    volume_max_ratio: float = 2.0
    action_mix_max_psi: float = 0.1
    null_rate_max_increase: float = 0.01

    def __post_init__(self) -> None:
        problems = []
        if not 0.0 <= self.min_referential_integrity <= 1.0:
            problems.append(f"min_referential_integrity={self.min_referential_integrity} must be in [0, 1]")
        if self.history_days < 1:
            problems.append(f"history_days={self.history_days} must be >= 1")
        if not 1 <= self.min_history_days <= self.history_days:
            problems.append(f"min_history_days={self.min_history_days} must be in [1, history_days]")
        if not 0.0 <= self.volume_min_ratio <= 1.0 <= self.volume_max_ratio:
            problems.append(
                f"volume band [{self.volume_min_ratio}, {self.volume_max_ratio}] must contain 1.0 "
                "(volume_min_ratio <= 1 <= volume_max_ratio)"
            )
        if self.action_mix_max_psi <= 0 or self.null_rate_max_increase < 0:
            problems.append("action_mix_max_psi must be > 0 and null_rate_max_increase >= 0")
        if problems:
            raise ValueError("invalid validation settings (config/platform.yaml validation:): " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ValidationSettings:
        """Settings from a config section; keys that are not settings (sensor timings...) are ignored."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name in values and values[f.name] is not None:
                kwargs[f.name] = int(values[f.name]) if f.type == "int" else float(values[f.name])
        return cls(**kwargs)


# --- profiles -------------------------------------------------------------------------------------------


def profile_table(
    dataset: str, table: pa.Table, previous_ids: Mapping[str, pa.Array] | None = None
) -> dict[str, Any]:
    """The profile of one partition. ``previous_ids``: id column -> ids of the day before, for new-id rates."""
    rows = table.num_rows
    profile: dict[str, Any] = {
        "rows": rows,
        "null_rates": {
            name: (table.column(name).null_count / rows if rows else 0.0) for name in table.column_names
        },
    }
    if dataset == "events" and "action" in table.column_names:
        counts = {a: 0 for a in contracts.ACTIONS}
        for entry in pc.value_counts(table.column("action")).to_pylist():
            counts[str(entry["values"])] = int(entry["counts"])
        profile["action_counts"] = counts
        profile["action_mix"] = {a: (c / rows if rows else 0.0) for a, c in counts.items()}
    for col in _ID_COLUMNS.get(dataset, ()):
        if col not in table.column_names:
            continue
        distinct = pc.unique(table.column(col).drop_null())
        profile[f"distinct_{col.removesuffix('_id')}s"] = len(distinct)
        previous = (previous_ids or {}).get(col)
        if previous is not None and len(distinct):
            seen = pc.is_in(distinct, value_set=previous.cast(distinct.type, safe=False))
            profile[f"new_{col}_rate"] = 1.0 - pc.sum(seen).as_py() / len(distinct)
        else:
            profile[f"new_{col}_rate"] = None
    return profile


def previous_ids(root: str | os.PathLike[str], dataset: str, ds: str) -> dict[str, pa.Array]:
    """Ids of the raw partition of the day before (empty when it is missing or unreadable)."""
    prev = storage.shift_ds(ds, -1)
    cols = list(_ID_COLUMNS.get(dataset, ()))
    if not cols or not storage.is_complete(root, f"raw/{dataset}", prev):
        return {}
    try:
        files = storage.data_files(root, f"raw/{dataset}", prev)
        table = pa.concat_tables([pq.read_table(f, columns=cols) for f in files])
    except Exception:  # noqa: BLE001 - history is a comparison; an unreadable old day just has no new-id rate
        return {}
    return {c: pc.unique(table.column(c).drop_null()) for c in cols}


def trailing_profiles(
    reports_root: Path, dataset: str, ds: str, days: int
) -> list[tuple[str, dict[str, Any]]]:
    """``(day, profile)`` of the ``days`` days before ``ds`` whose partition passed validation."""
    out = []
    for back in range(days, 0, -1):
        day = storage.shift_ds(ds, -back)
        folder = reports_root / dataset / f"ds={day}"
        try:
            result = json.loads((folder / "result.json").read_text())
            profile = json.loads((folder / PROFILE_FILE).read_text())
        except (OSError, ValueError):
            continue
        if result.get("success") is True:
            out.append((day, profile))
    return out


# --- comparisons ----------------------------------------------------------------------------------------


def psi(actual: Mapping[str, float], expected: Mapping[str, float]) -> float:
    """Population stability index of two distributions over the same buckets (shares, summing to 1)."""
    total = 0.0
    for key in set(actual) | set(expected):
        a = max(float(actual.get(key, 0.0)), _PSI_EPSILON)
        e = max(float(expected.get(key, 0.0)), _PSI_EPSILON)
        total += (a - e) * math.log(a / e)
    return total


@dataclass
class HistoryResult:
    """One history check: the fields of ``validate.Check``."""

    name: str
    success: bool | None
    observed: Any
    expected: Any
    details: str = ""


def history_checks(
    dataset: str,
    ds: str,
    profile: Mapping[str, Any],
    history: list[tuple[str, dict[str, Any]]],
    settings: ValidationSettings,
) -> list[HistoryResult]:
    """Compare ``profile`` with the trailing ``history``; see the module docstring."""
    names = HISTORY_CHECKS[dataset]
    days = [d for d, _ in history]
    if len(history) < settings.min_history_days:
        warning = (
            f"warning: only {len(history)} of the {settings.history_days} days before ds={ds} have a validated "
            f"profile (min_history_days={settings.min_history_days}): history checks pass without comparing"
        )
        log.warning("raw/%s ds=%s: %s", dataset, ds, warning)
        return [
            HistoryResult(n, True, {"history_days": days}, {"min_history_days": settings.min_history_days}, warning)
            for n in names
        ]
    results = []
    rows_hist = [int(p["rows"]) for _, p in history]
    median_rows = statistics.median(rows_hist)
    ratio = profile["rows"] / median_rows if median_rows else math.inf
    low, high = settings.volume_min_ratio * median_rows, settings.volume_max_ratio * median_rows
    ok = settings.volume_min_ratio <= ratio <= settings.volume_max_ratio
    results.append(
        HistoryResult(
            "history.volume",
            ok,
            {"rows": profile["rows"], "trailing_median": median_rows, "ratio": round(ratio, 4), "history_days": days},
            {"min_rows": low, "max_rows": high},
            "" if ok else (
                f"{profile['rows']} rows is {ratio:.2f}x the median of the {len(days)} trailing days "
                f"({median_rows:g}); expected between {settings.volume_min_ratio}x and {settings.volume_max_ratio}x"
            ),
        )
    )
    if "history.action_mix" in names and not profile["rows"]:
        results.append(HistoryResult("history.action_mix", None, None, None, "not run: the partition has no rows"))
    elif "history.action_mix" in names:
        pooled: dict[str, int] = {}
        for _, p in history:
            for action, count in p.get("action_counts", {}).items():
                pooled[action] = pooled.get(action, 0) + int(count)
        total = sum(pooled.values())
        expected_mix = {a: c / total for a, c in pooled.items()} if total else {}
        actual_mix = dict(profile.get("action_mix", {}))
        value = psi(actual_mix, expected_mix)
        ok = value <= settings.action_mix_max_psi
        shifted = sorted(
            set(actual_mix) | set(expected_mix),
            key=lambda a: -abs(actual_mix.get(a, 0.0) - expected_mix.get(a, 0.0)),
        )[:3]
        results.append(
            HistoryResult(
                "history.action_mix",
                ok,
                {
                    "psi": round(value, 5),
                    "mix": {a: round(v, 5) for a, v in actual_mix.items()},
                    "trailing_mix": {a: round(v, 5) for a, v in expected_mix.items()},
                },
                {"max_psi": settings.action_mix_max_psi},
                "" if ok else (
                    f"action mix drifted: PSI {value:.3f} > {settings.action_mix_max_psi} against the "
                    f"{len(days)} trailing days; largest shifts: "
                    + ", ".join(
                        f"{a} {expected_mix.get(a, 0.0):.1%} -> {actual_mix.get(a, 0.0):.1%}" for a in shifted
                    )
                ),
            )
        )
    jumps: dict[str, dict[str, float]] = {}
    for col, rate in profile.get("null_rates", {}).items():
        base = statistics.median(float(p.get("null_rates", {}).get(col, 0.0)) for _, p in history)
        if rate - base > settings.null_rate_max_increase:
            jumps[col] = {"null_rate": round(rate, 6), "trailing_median": round(base, 6)}
    results.append(
        HistoryResult(
            "history.null_rate",
            not jumps,
            jumps or {"max_null_rate": max(profile.get("null_rates", {}).values(), default=0.0)},
            {"max_increase": settings.null_rate_max_increase},
            "; ".join(
                f"{col} null rate {v['null_rate']:.2%} vs trailing median {v['trailing_median']:.2%}"
                for col, v in jumps.items()
            ),
        )
    )
    return results


# --- quarantine and window gaps ---------------------------------------------------------------------------


def quarantine_root(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> Path:
    """``<root>/quarantine/<dataset>/ds=<ds>/``: one sub-folder per quarantine, named by its UTC time."""
    return storage.local_root(root) / QUARANTINE_DIR / dataset / f"ds={storage.ds_str(ds)}"


def quarantine_records(root: str | os.PathLike[str], dataset: str, ds: str | dt.date) -> list[Path]:
    """The quarantine folders of a partition, oldest first (each keeps the data and report it had)."""
    base = quarantine_root(root, dataset, ds)
    return sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")) if base.exists() else []


def window_gaps(root: str | os.PathLike[str], ds: str | dt.date, window_days: int) -> dict[str, Any]:
    """The days of the window ``[ds-window_days+1, ds-1]`` without a complete ``raw/events`` partition.

    Days before the first day ``raw/events`` (or its quarantine) knows of are not gaps: the history just
    starts there. ``quarantined``: the gap days that have a quarantine record. The window's own feature
    metadata records the same days as ``missing_days`` (written by ``features.build``).
    """
    day = storage.ds_str(ds)
    window = storage.day_range(storage.shift_ds(day, -(window_days - 1)), day)[:-1]
    local = storage.local_root(root)
    known = set(storage.complete_days(root, "raw/events"))
    qbase = local / QUARANTINE_DIR / "events"
    quarantined_days = {p.name[3:] for p in qbase.glob("ds=*")} if qbase.exists() else set()
    first = min(known | quarantined_days, default=None)
    gaps = [d for d in window if first is not None and d >= first and d not in known]
    return {
        "ds": day,
        "window_start": window[0] if window else day,
        "window_days": window_days,
        "history_start": first,
        "gaps": gaps,
        "quarantined": [d for d in gaps if d in quarantined_days],
    }
