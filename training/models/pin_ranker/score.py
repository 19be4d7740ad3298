"""Scoring the corpus with the ranker: each pin in a non-personalised context (no user, the pin's own counts of
``features/pin_window``, the priors of a user without history)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pyarrow as pa

from core import storage
from core.contracts import COUNT_COLUMNS, DENSE_FEATURES, EXAMPLES, PIN_WINDOW, RAW_PINS, SURFACES
from core.failures import DataError
from core.storage import Location, data_files, parquet_file, pins_of
from training.data import fixed_width

log = logging.getLogger(__name__)

# Scoring the corpus: each pin in a non-personalised context on this surface.
CONTEXT_SURFACE = "home_feed"


def history_priors(root: Location, ds: str) -> dict[str, float]:
    """The rate features the feature build gives a user or pin without history (its prior), as observed.

    Read from the first row group of the ``examples`` partition of ``ds``: the median rate of the rows
    with zero impressions (the median of all rows if there are none). Inference uses these for the
    non-personalised context.
    """
    files = data_files(root, EXAMPLES, ds)
    if not files:
        raise DataError(f"{EXAMPLES} partition ds={ds} under {root} has no Parquet file")
    rates = {
        "u_ctr": "u_impressions",
        "p_ctr": "p_impressions",
        "p_repin_rate": "p_impressions",
        "p_hide_rate": "p_impressions",
    }
    with parquet_file(files[0], pins_of(root)) as parquet:
        table = parquet.read_row_group(0, columns=sorted({*rates, *rates.values()}))
    out = {}
    for rate, count in rates.items():
        values = table.column(rate).to_numpy()
        fresh = values[table.column(count).to_numpy() == 0]
        out[rate] = float(np.median(fresh if fresh.size else values)) if values.size else 0.0
    return out


def read_pin_window(root: Location, ds: str) -> pa.Table | None:
    if not storage.is_complete(root, PIN_WINDOW, ds):
        log.info("no complete %s partition for ds=%s: every pin scored as a pin without history", PIN_WINDOW, ds)
        return None
    columns = ["pin_id", *COUNT_COLUMNS, "ctr", "repin_rate", "hide_rate"]
    return storage.read_table(root, PIN_WINDOW, ds, columns=columns)


def context_dense(pin_ids: np.ndarray, window: pa.Table | None, priors: dict[str, float]) -> np.ndarray:
    """The dense features (DENSE_FEATURES order) of the non-personalised context for each pin."""
    n = len(pin_ids)
    values: dict[str, np.ndarray] = {name: np.zeros(n, dtype=np.float32) for name in DENSE_FEATURES}
    values["u_ctr"][:] = priors.get("u_ctr", 0.0)
    for rate in ("p_ctr", "p_repin_rate", "p_hide_rate"):
        values[rate][:] = priors.get(rate, 0.0)
    if window is not None and window.num_rows and n:
        ids = window.column("pin_id").to_numpy()
        order = np.argsort(ids, kind="stable")
        ids = ids[order]
        pos = np.minimum(np.searchsorted(ids, pin_ids), len(ids) - 1)
        found = ids[pos] == pin_ids
        rows = order[pos[found]]
        for column in COUNT_COLUMNS:
            values[f"p_{column}"][found] = window.column(column).to_numpy()[rows]
        for column, name in (("ctr", "p_ctr"), ("repin_rate", "p_repin_rate"), ("hide_rate", "p_hide_rate")):
            values[name][found] = window.column(column).to_numpy()[rows]
    return np.stack([values[name] for name in DENSE_FEATURES], axis=1).astype(np.float32)


def context_inputs(pins: pa.Table, dense: np.ndarray, spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """The serving inputs (``spec["serving_inputs"]``) of a batch of pins in the non-personalised context."""
    n, steps = pins.num_rows, int(spec["sequence_length"])
    emb = fixed_width(pins.column("embedding"), f"{RAW_PINS}.embedding")
    surfaces = list(spec.get("surfaces") or SURFACES)
    # The context surface, when the model knows it (else the unknown surface, 0).
    surface = surfaces.index(CONTEXT_SURFACE) + 1 if CONTEXT_SURFACE in surfaces else 0
    return {
        "seq_pin_emb": np.zeros((n, steps, emb.shape[1]), dtype=np.float32),
        "seq_actions": np.zeros((n, steps), dtype=np.int64),
        "seq_categories": np.full((n, steps), -1, dtype=np.int64),
        "seq_age_hours": np.zeros((n, steps), dtype=np.float32),
        "seq_mask": np.zeros((n, steps), dtype=bool),
        "cand_pin_emb": emb.astype(np.float32),
        "pin_id": pins.column("pin_id").to_numpy().astype(np.int64),
        "user_id": np.full(n, -1, dtype=np.int64),  # absent: the model's zero embedding
        "category": pins.column("category").to_numpy().astype(np.int64),
        "creator_id": pins.column("creator_id").to_numpy().astype(np.int64),
        "surface": np.full(n, surface, dtype=np.int64),
        "dense": dense,
    }
