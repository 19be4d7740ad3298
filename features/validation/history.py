"""History checks: a profile of every validated partition, compared with the trailing validated days.

``profile_table`` summarises one partition (row count, per-action counts and mix, null rates per column,
distinct users and pins, the share of ids not seen the day before). The report stores it as ``profile.json``
beside the partition's ``result.json``. ``history_checks`` compares a new profile with the profiles of the
trailing days that passed validation (a quarantined day never becomes history):

* ``history.volume`` — the row count inside ``[volume_min_ratio, volume_max_ratio]`` x the trailing median;
* ``history.action_mix`` (events) — the population stability index of the mix of the contract's actions against
  the pooled mix of the trailing days, at most ``action_mix_max_psi`` (actions outside the contract are
  ``action.in_set``'s failure, said once);
* ``history.null_rate`` — no column's null rate more than ``null_rate_max_increase`` above its trailing
  median.

Real traffic has weekly cycles: with ``history_baseline`` ``weekday`` (or ``both``, the default) the volume
and the action mix are also compared with the same weekday of the trailing ``weekday_weeks`` weeks, and with
``both`` a day passes when it fits either baseline (a quiet Sunday fits last Sundays; a halved Tuesday fits
neither). Days listed in ``holidays`` only warn (``ValidationConfig.severity_of``). With fewer than
``min_history_days`` trailing profiles (the first days of a dataset) the history checks pass with a warning. The thresholds are the ``validation:`` section of the platform configuration
(``core.config.ValidationConfig``), passed in. Profiles are read through ``core.storage`` from the storage
root, local or not.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from core import contracts, storage
from core.config import ValidationConfig
from features.validation.checks import raw_dataset
from features.validation.report import PROFILE_FILE, RESULT_FILE, report_dir

log = logging.getLogger(__name__)

# History checks per dataset, in report order.
HISTORY_CHECKS: dict[str, tuple[str, ...]] = {
    "events": ("history.volume", "history.action_mix", "history.null_rate"),
    "pins": ("history.volume", "history.null_rate"),
    "users": ("history.volume", "history.null_rate"),
    "pin_labels": ("history.volume", "history.null_rate"),
}
# Id columns whose distinct count and new-id rate a profile records, per dataset.
_ID_COLUMNS: dict[str, tuple[str, ...]] = {
    "events": ("user_id", "pin_id"), "pins": ("pin_id",), "users": ("user_id",), "pin_labels": ("pin_id",),
}
_PSI_EPSILON = 1e-4  # floor of a bucket's share, so that an empty bucket gives a large, finite PSI


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


def previous_ids(root: storage.Location, dataset: str, ds: str) -> dict[str, pa.Array]:
    """Ids of the raw partition of the day before (empty when it is missing or unreadable)."""
    prev = storage.shift_ds(ds, -1)
    source = raw_dataset(dataset)
    cols = list(_ID_COLUMNS.get(dataset, ()))
    if not cols or not storage.is_complete(root, source, prev):
        return {}
    try:
        files = storage.data_files(root, source, prev)
        table = pa.concat_tables([storage.read_parquet(f, columns=cols) for f in files])
    except Exception:  # noqa: BLE001 - history is a comparison; an unreadable old day just has no new-id rate
        return {}
    return {c: pc.unique(table.column(c).drop_null()) for c in cols}


def trailing_profiles(
    root: storage.Location, dataset: str, ds: str, days: int, step: int = 1
) -> list[tuple[str, dict[str, Any]]]:
    """``(day, profile)`` of the ``days`` days before ``ds`` (every ``step``-th day: 7 for the same weekday)
    whose partition passed validation.

    A day counts only when its ``result.json`` says it passed (the report writes it last): a failed or
    quarantined day, or a report still being written, never becomes history.
    """
    out = []
    for back in range(days, 0, -1):
        day = storage.shift_ds(ds, -back * step)
        folder = report_dir(root, dataset, day)
        try:
            result = storage.read_json(storage.join(folder, RESULT_FILE))
            if result.get("success") is not True:
                continue
            profile = storage.read_json(storage.join(folder, PROFILE_FILE))
        except (FileNotFoundError, ValueError, AttributeError):  # no report, or not one this code wrote
            continue
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
    """One history check: the fields of ``features.validation.checks.Check``."""

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
    config: ValidationConfig,
    weekdays: list[tuple[str, dict[str, Any]]] | None = None,
) -> list[HistoryResult]:
    """Compare ``profile`` with the trailing ``history`` (and the same weekday of the trailing weeks,
    ``weekdays``) under the thresholds of ``config``; see the module docstring."""
    names = HISTORY_CHECKS[dataset]
    days = [d for d, _ in history]
    if len(history) < config.min_history_days:
        warning = (
            f"warning: only {len(history)} of the {config.history_days} days before ds={ds} have a validated "
            f"profile (min_history_days={config.min_history_days}): history checks pass without comparing"
        )
        log.warning("raw/%s ds=%s: %s", dataset, ds, warning)
        return [
            HistoryResult(n, True, {"history_days": days}, {"min_history_days": config.min_history_days}, warning)
            for n in names
        ]
    results = []
    baselines = _baselines(history, weekdays or [], config)
    volumes = {
        name: _volume(profile, days_of, config) for name, days_of in baselines.items()
    }
    ok = any(v["ok"] for v in volumes.values())
    best = next((name for name, v in volumes.items() if v["ok"]), next(iter(volumes)))
    results.append(
        HistoryResult(
            "history.volume",
            ok,
            {"rows": profile["rows"], **{f"{name}_median": v["median"] for name, v in volumes.items()},
             **{f"{name}_ratio": v["ratio"] for name, v in volumes.items()}, "history_days": days,
             "baseline": best if ok else list(volumes)},
            # In rows of the baseline that passed (else the first): what a reader compares the row count with.
            {"min_rows": config.volume_min_ratio * volumes[best]["median"],
             "max_rows": config.volume_max_ratio * volumes[best]["median"]},
            "" if ok else "; ".join(
                f"{profile['rows']} rows is {v['ratio']:.2f}x the median of the {v['count']} {name.replace('_', ' ')} "
                f"({v['median']:g})" for name, v in volumes.items()
            ) + f"; expected between {config.volume_min_ratio}x and {config.volume_max_ratio}x",
        )
    )
    if "history.action_mix" in names and not profile["rows"]:
        results.append(HistoryResult("history.action_mix", None, None, None, "not run: the partition has no rows"))
    elif "history.action_mix" in names:
        actual_mix = _pooled_mix([profile])
        mixes = {name: _pooled_mix(days_of) for name, days_of in baselines.items()}
        values = {name: psi(actual_mix, mix) for name, mix in mixes.items()}
        ok = any(v <= config.action_mix_max_psi for v in values.values())
        name = min(values, key=lambda n: values[n])
        expected_mix = mixes[name]
        shifted = sorted(
            set(actual_mix) | set(expected_mix),
            key=lambda a: -abs(actual_mix.get(a, 0.0) - expected_mix.get(a, 0.0)),
        )[:3]
        results.append(
            HistoryResult(
                "history.action_mix",
                ok,
                {
                    **{f"{n}_psi": round(v, 5) for n, v in values.items()},
                    "psi": round(values[name], 5),
                    "mix": {a: round(v, 5) for a, v in actual_mix.items()},
                    "trailing_mix": {a: round(v, 5) for a, v in expected_mix.items()},
                    "baseline": name,
                },
                {"max_psi": config.action_mix_max_psi},
                "" if ok else (
                    f"action mix drifted: PSI {values[name]:.3f} > {config.action_mix_max_psi} against the "
                    f"{name.replace('_', ' ')}; largest shifts: "
                    + ", ".join(
                        f"{a} {expected_mix.get(a, 0.0):.1%} -> {actual_mix.get(a, 0.0):.1%}" for a in shifted
                    )
                ),
            )
        )
    jumps: dict[str, dict[str, float]] = {}
    for col, rate in profile.get("null_rates", {}).items():
        base = statistics.median(float(p.get("null_rates", {}).get(col, 0.0)) for _, p in history)
        if rate - base > config.null_rate_max_increase:
            jumps[col] = {"null_rate": round(rate, 6), "trailing_median": round(base, 6)}
    results.append(
        HistoryResult(
            "history.null_rate",
            not jumps,
            jumps or {"max_null_rate": max(profile.get("null_rates", {}).values(), default=0.0)},
            {"max_increase": config.null_rate_max_increase},
            "; ".join(
                f"{col} null rate {v['null_rate']:.2%} vs trailing median {v['trailing_median']:.2%}"
                for col, v in jumps.items()
            ),
        )
    )
    return results


def _baselines(
    history: list[tuple[str, dict[str, Any]]], weekdays: list[tuple[str, dict[str, Any]]], config: ValidationConfig
) -> dict[str, list[dict[str, Any]]]:
    """The profiles of each baseline the configuration asks for (the weekday one needs two weeks at least)."""
    out: dict[str, list[dict[str, Any]]] = {}
    if config.history_baseline in ("days", "both") or len(weekdays) < 2:
        out["trailing_days"] = [p for _, p in history]
    if config.history_baseline in ("weekday", "both") and len(weekdays) >= 2:
        out["same_weekday"] = [p for _, p in weekdays]
    return out


def _volume(profile: Mapping[str, Any], history: list[dict[str, Any]], config: ValidationConfig) -> dict[str, Any]:
    median = statistics.median(int(p["rows"]) for p in history)
    ratio = profile["rows"] / median if median else math.inf
    return {
        "median": median, "ratio": round(ratio, 4), "count": len(history),
        "ok": config.volume_min_ratio <= ratio <= config.volume_max_ratio,
    }


def _pooled_mix(history: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The mix of the contract's actions over the profiles' counts (other actions left out)."""
    pooled: dict[str, int] = {}
    for p in history:
        for action, count in p.get("action_counts", {}).items():
            if action in contracts.ACTIONS:
                pooled[action] = pooled.get(action, 0) + int(count)
    total = sum(pooled.values())
    return {a: c / total for a, c in pooled.items()} if total else {}
