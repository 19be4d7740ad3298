"""Partition days (``YYYY-MM-DD``) and the folder of one day of a dataset."""

from __future__ import annotations

import datetime as dt
import re

from core.storage.paths import Location, join


def parse_ds(ds: str | dt.date) -> dt.date:
    if isinstance(ds, dt.date):
        return ds
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", ds):  # fromisoformat also takes 20261105 and 2026-W45-4
            raise ValueError(ds)
        return dt.date.fromisoformat(ds)
    except (TypeError, ValueError):
        raise ValueError(f"partition day {ds!r} is not a date in the form YYYY-MM-DD") from None


def ds_str(ds: str | dt.date) -> str:
    return parse_ds(ds).isoformat()


def day_range(start: str | dt.date, end: str | dt.date) -> list[str]:
    """Days from ``start`` to ``end``, both included, as YYYY-MM-DD strings."""
    first, last = parse_ds(start), parse_ds(end)
    return [(first + dt.timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


def shift_ds(ds: str | dt.date, days: int) -> str:
    return (parse_ds(ds) + dt.timedelta(days=days)).isoformat()


def day_spans(days: list[str]) -> str:
    """Days for a message, consecutive ones as one span (``2026-06-01 to 2026-06-03 (3 days), 2026-06-07``): a window
    missing 29 days reads as one span, not 29 dates."""
    spans: list[list[str]] = []
    for day in sorted(set(days)):
        if spans and shift_ds(spans[-1][-1], 1) == day:
            spans[-1].append(day)
        else:
            spans.append([day])
    return ", ".join(s[0] if len(s) == 1 else f"{s[0]} to {s[-1]} ({len(s)} days)" for s in spans)


def partition(root: Location, dataset: str, ds: str | dt.date) -> str:
    """The folder of one day of a dataset: ``<root>/<dataset>/ds=YYYY-MM-DD``."""
    return join(root, *dataset.split("/"), f"ds={ds_str(ds)}")
