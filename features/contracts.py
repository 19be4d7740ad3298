"""Data contracts: the pyarrow schema of every dataset under the storage root.

Every dataset is Parquet, partitioned by day as ``<dataset>/ds=YYYY-MM-DD/``. Timestamps are
microseconds in UTC. These schemas are the single source of truth for writers, readers and validation.
"""

from __future__ import annotations

import pyarrow as pa

EMBEDDING_DIM = 32

# Engagement actions. ``impression`` is the parent of every other action: an engagement carries the
# ``impression_id`` of the impression it came from. Order matters: the index is the action id the model uses.
ACTIONS: tuple[str, ...] = ("impression", "click", "repin", "hide", "closeup")
ENGAGEMENTS: tuple[str, ...] = ACTIONS[1:]
# Actions that train a head of the ranker.
LABELS: tuple[str, ...] = ("click", "repin", "hide")
SURFACES: tuple[str, ...] = ("home_feed", "search", "related_pins")

TS = pa.timestamp("us", tz="UTC")

EVENTS = pa.schema(
    [
        pa.field("event_id", pa.int64(), nullable=False),
        pa.field("impression_id", pa.int64(), nullable=False),  # == event_id for an impression
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("surface", pa.string(), nullable=False),
        pa.field("ts", TS, nullable=False),
    ]
)

PINS = pa.schema(
    [
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32(), EMBEDDING_DIM), nullable=False),
        pa.field("category", pa.int32(), nullable=False),
        pa.field("creator_id", pa.int64(), nullable=False),
        pa.field("created_at", TS, nullable=False),
    ]
)

USERS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("country", pa.string(), nullable=False),
        pa.field("created_at", TS, nullable=False),
    ]
)

# Hidden ground truth of the synthetic world, one row per impression. Never read by the model.
TRUTH = pa.schema(
    [
        pa.field("impression_id", pa.int64(), nullable=False),
        pa.field("p_click", pa.float64(), nullable=False),
        pa.field("p_repin", pa.float64(), nullable=False),
        pa.field("p_hide", pa.float64(), nullable=False),
    ]
)

RAW_DATASETS: dict[str, pa.Schema] = {"events": EVENTS, "pins": PINS, "users": USERS}

# --- Derived datasets (written by features.build) ---------------------------------------------------

# Counts per action type, in this order, for the daily aggregates and the window features.
COUNT_COLUMNS: tuple[str, ...] = ("impressions", "clicks", "repins", "hides", "closeups")

# Per-category engagement of a user: one entry per category of the pins the user saw, sorted by category;
# ``engagements`` counts every action other than impression. A pin missing from the day's pins snapshot
# counts under category -1.
CATEGORY_ENGAGEMENT = pa.list_(
    pa.struct(
        [
            pa.field("category", pa.int32()),
            pa.field("impressions", pa.int64()),
            pa.field("engagements", pa.int64()),
        ]
    )
)

USER_DAILY = pa.schema(
    [pa.field("user_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [
        pa.field("distinct_pins", pa.int64(), nullable=False),
        pa.field("categories", CATEGORY_ENGAGEMENT, nullable=False),
    ]
)

PIN_DAILY = pa.schema(
    [pa.field("pin_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [pa.field("distinct_users", pa.int64(), nullable=False)]
)

# 30-day window as of the end of ds: sums of the daily counts plus smoothed rates.
USER_WINDOW = pa.schema(
    [pa.field("user_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [
        pa.field("ctr", pa.float64(), nullable=False),
        pa.field("categories", CATEGORY_ENGAGEMENT, nullable=False),
    ]
)

PIN_WINDOW = pa.schema(
    [pa.field("pin_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [
        pa.field("ctr", pa.float64(), nullable=False),
        pa.field("repin_rate", pa.float64(), nullable=False),
        pa.field("hide_rate", pa.float64(), nullable=False),
    ]
)

# Last N engagements (actions other than impression) per user as of the end of ds, most recent first,
# within the window; an action's category is that of its pin in the pins snapshot of the action's day.
USER_SEQUENCE = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("seq_pin_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_actions", pa.list_(pa.int32()), nullable=False),  # index into ACTIONS
        pa.field("seq_categories", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_ts", pa.list_(TS), nullable=False),
    ]
)

# Dense features of an example, in the order the model reads them.
DENSE_FEATURES: tuple[str, ...] = tuple(f"u_{c}" for c in COUNT_COLUMNS) + ("u_ctr",) + tuple(
    f"p_{c}" for c in COUNT_COLUMNS
) + ("p_ctr", "p_repin_rate", "p_hide_rate")

# One row per impression of ds; features as of the end of ds-1 (point-in-time correct); labels from ds.
# Users or pins without history get zero counts, the prior rates and an empty sequence.
EXAMPLES = pa.schema(
    [
        pa.field("impression_id", pa.int64(), nullable=False),
        pa.field("ts", TS, nullable=False),
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("category", pa.int32(), nullable=False),
        pa.field("creator_id", pa.int64(), nullable=False),
        pa.field("surface", pa.string(), nullable=False),
    ]
    + [pa.field(name, pa.float32(), nullable=False) for name in DENSE_FEATURES]
    + [
        pa.field("seq_pin_ids", pa.list_(pa.int64()), nullable=False),
        pa.field("seq_actions", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_categories", pa.list_(pa.int32()), nullable=False),
        pa.field("seq_age_hours", pa.list_(pa.float32()), nullable=False),  # impression ts - action ts
    ]
    + [pa.field(label, pa.int8(), nullable=False) for label in LABELS]
)
