"""The window gap check: days of a feature window whose raw events are missing or quarantined.

The operator layer decides what a gap means (``validation.on_window_gap``: fail the day, or proceed with the
gap recorded); this module only finds the gaps, on any storage root ``core.storage`` knows.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from core import contracts, storage


def quarantined_days(root: storage.Location, dataset: str) -> set[str]:
    """The days of a raw dataset (short name) that have at least one quarantine folder."""
    base = storage.join(root, contracts.QUARANTINE, dataset)
    return {name.removeprefix("ds=") for name in storage.list_names(base) if name.startswith("ds=")}


def window_gaps(root: storage.Location, ds: str | dt.date, window_days: int) -> dict[str, Any]:
    """The days of the window ``[ds-window_days+1, ds-1]`` without a complete ``raw/events`` partition.

    Days before the first day ``raw/events`` (or its quarantine) knows of are not gaps: the history just
    starts there. ``quarantined``: the gap days that have a quarantine record. The window's own feature
    metadata records the same days as ``missing_days`` (written by ``features.build``).
    """
    day = storage.ds_str(ds)
    window = storage.day_range(storage.shift_ds(day, -(window_days - 1)), day)[:-1]
    known = set(storage.complete_days(root, contracts.RAW_EVENTS))
    quarantined = quarantined_days(root, "events")
    first = min(known | quarantined, default=None)
    gaps = [d for d in window if first is not None and d >= first and d not in known]
    return {
        "ds": day,
        "window_start": window[0] if window else day,
        "window_days": window_days,
        "history_start": first,
        "gaps": gaps,
        "quarantined": [d for d in gaps if d in quarantined],
    }
