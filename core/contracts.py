"""Data contracts: the name and the pyarrow schema of every dataset under the storage root.

Every dataset is Parquet, partitioned by day as ``<dataset>/ds=YYYY-MM-DD/``. Timestamps are microseconds in
UTC. A nullable field is optional: a raw partition may leave it out. List columns may be written as variable or
fixed-size lists; widths and closed sets that differ between deployments (the embedding width, the surfaces)
are settings of the validation (``validation:`` of the configuration), not of the schema. One name per thing: a dataset's name is its folder under the storage root (``EXAMPLES = "examples"``),
its schema is ``<NAME>_SCHEMA``, and the Airflow asset that announces it lives in ``operators.assets`` as
``<NAME>_ASSET``. These are the single source of truth for writers, readers and validation.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

# The default width of a pin's content embedding (the synthetic world's): the contract takes any width, the
# validation checks the configured one (validation.embedding_dim) and the models read it from the data.
EMBEDDING_DIM = 32
# Content features of a pin, for the content-understanding models: a visual embedding and a bag of text tokens.
IMAGE_DIM = 64
TEXT_VOCAB = 256
# Topics of the trust-and-safety review (related to, not the same as, the pin's category).
TOPICS = 8

# Engagement actions. ``impression`` is the parent of every other action: an engagement carries the
# ``impression_id`` of the impression it came from. Order matters: the index is the action id the model uses.
ACTIONS: tuple[str, ...] = ("impression", "click", "repin", "hide", "closeup")
ENGAGEMENTS: tuple[str, ...] = ACTIONS[1:]
# Actions that train a head of the ranker.
LABELS: tuple[str, ...] = ("click", "repin", "hide")
SURFACES: tuple[str, ...] = ("home_feed", "search", "related_pins")

TS = pa.timestamp("us", tz="UTC")

EVENTS_SCHEMA = pa.schema(
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

PINS_SCHEMA = pa.schema(
    [
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("embedding", pa.list_(pa.float32()), nullable=False),  # a fixed-size list is accepted too
        pa.field("category", pa.int32(), nullable=False),
        pa.field("creator_id", pa.int64(), nullable=False),
        pa.field("created_at", TS, nullable=True),  # optional: upstream may not know it
        pa.field("image_embedding", pa.list_(pa.float32()), nullable=False),
        pa.field("text_tokens", pa.list_(pa.int32()), nullable=False),  # token ids in [0, TEXT_VOCAB)
    ]
)

USERS_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("country", pa.string(), nullable=False),
        pa.field("created_at", TS, nullable=True),  # optional: upstream may not know it
    ]
)

# Hidden ground truth of the synthetic world, one row per impression. Never read by the model.
TRUTH_SCHEMA = pa.schema(
    [
        pa.field("impression_id", pa.int64(), nullable=False),
        pa.field("p_click", pa.float64(), nullable=False),
        pa.field("p_repin", pa.float64(), nullable=False),
        pa.field("p_hide", pa.float64(), nullable=False),
    ]
)

# Human review of a sample of pins, one partition per review day: a pin's safety label and its topic.
PIN_LABELS_SCHEMA = pa.schema(
    [
        pa.field("review_id", pa.int64(), nullable=False),
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("is_unsafe", pa.int8(), nullable=False),  # 1: violates the content policy
        pa.field("topic", pa.int32(), nullable=False),  # in [0, TOPICS)
        pa.field("reviewed_at", TS, nullable=False),
    ]
)

# Hidden ground truth of the synthetic world per pin of the snapshot. Never read by a model.
TRUTH_PINS_SCHEMA = pa.schema(
    [
        pa.field("pin_id", pa.int64(), nullable=False),
        pa.field("p_unsafe", pa.float64(), nullable=False),
        pa.field("topic_probs", pa.list_(pa.float64(), TOPICS), nullable=False),
    ]
)

# --- Dataset names: the folder of each dataset under the storage root -----------------------------------

RAW_EVENTS = "raw/events"
RAW_PINS = "raw/pins"
RAW_USERS = "raw/users"
RAW_PIN_LABELS = "raw/pin_labels"
TRUTH = "truth"
TRUTH_PINS = "truth_pins"
USER_DAILY = "features/user_daily"
PIN_DAILY = "features/pin_daily"
USER_WINDOW = "features/user_window"
PIN_WINDOW = "features/pin_window"
USER_SEQUENCE = "features/user_sequence"
EXAMPLES = "examples"
# The day's events bucketed by a fixed hash of user id / pin id (written by validation; what a shard reads).
EVENTS_BY_USER = "buckets/events_by_user"
EVENTS_BY_PIN = "buckets/events_by_pin"
VALIDATION_REPORTS = "reports/validation"
QUARANTINE = "quarantine"
MODELS = "models"
INFERENCE = "inference"
RUNS = "runs"

# Raw datasets by their short name (the validation CLI's argument): their folder and their schema.
RAW_DATASETS: dict[str, str] = {
    "events": RAW_EVENTS, "pins": RAW_PINS, "users": RAW_USERS, "pin_labels": RAW_PIN_LABELS,
}
RAW_SCHEMAS: dict[str, pa.Schema] = {
    "events": EVENTS_SCHEMA, "pins": PINS_SCHEMA, "users": USERS_SCHEMA, "pin_labels": PIN_LABELS_SCHEMA,
}

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

USER_DAILY_SCHEMA = pa.schema(
    [pa.field("user_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [
        pa.field("distinct_pins", pa.int64(), nullable=False),
        pa.field("categories", CATEGORY_ENGAGEMENT, nullable=False),
    ]
)

PIN_DAILY_SCHEMA = pa.schema(
    [pa.field("pin_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [pa.field("distinct_users", pa.int64(), nullable=False)]
)

# 30-day window as of the end of ds: sums of the daily counts plus smoothed rates.
USER_WINDOW_SCHEMA = pa.schema(
    [pa.field("user_id", pa.int64(), nullable=False)]
    + [pa.field(c, pa.int64(), nullable=False) for c in COUNT_COLUMNS]
    + [
        pa.field("ctr", pa.float64(), nullable=False),
        pa.field("categories", CATEGORY_ENGAGEMENT, nullable=False),
    ]
)

PIN_WINDOW_SCHEMA = pa.schema(
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
USER_SEQUENCE_SCHEMA = pa.schema(
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

# The user's action sequence of an example, as readers see it (``training.data`` resolves it, see below).
SEQUENCE_COLUMNS: tuple[str, ...] = ("seq_pin_ids", "seq_actions", "seq_categories", "seq_age_hours")
SEQUENCE_FIELDS = [
    pa.field("seq_pin_ids", pa.list_(pa.int64()), nullable=False),
    pa.field("seq_actions", pa.list_(pa.int32()), nullable=False),
    pa.field("seq_categories", pa.list_(pa.int32()), nullable=False),
    pa.field("seq_age_hours", pa.list_(pa.float32()), nullable=False),  # impression ts - action ts, hours
]
# How an example references that sequence instead of copying it: the first ``seq_len`` actions (the cut; 0 =
# no sequence) of its user's row in ``features/user_sequence`` of ``seq_ds`` (the day before the example's, so
# every action is before the impression: point in time). The examples' ``_metadata.json`` records the content
# digest of that partition (``sequence_digest``, see ``sequence_digest``); a reader refuses a sequence partition
# whose content changed since.
SEQUENCE_REF_COLUMNS: tuple[str, ...] = ("seq_ds", "seq_len")
SEQUENCE_REF_FIELDS = [
    pa.field("seq_ds", pa.date32(), nullable=False),
    pa.field("seq_len", pa.int32(), nullable=False),
]

# One row per impression of ds; features as of the end of ds-1 (point-in-time correct); labels from ds.
# Users or pins without history get zero counts, the prior rates and an empty sequence (``seq_len`` 0).
_EXAMPLE_HEAD = [
    pa.field("impression_id", pa.int64(), nullable=False),
    pa.field("ts", TS, nullable=False),
    pa.field("user_id", pa.int64(), nullable=False),
    pa.field("pin_id", pa.int64(), nullable=False),
    pa.field("category", pa.int32(), nullable=False),
    pa.field("creator_id", pa.int64(), nullable=False),
    pa.field("surface", pa.string(), nullable=False),
    *(pa.field(name, pa.float32(), nullable=False) for name in DENSE_FEATURES),
]
_EXAMPLE_LABELS = [pa.field(label, pa.int8(), nullable=False) for label in LABELS]
# What the feature build stores: the sequence by reference.
EXAMPLES_SCHEMA = pa.schema([*_EXAMPLE_HEAD, *SEQUENCE_REF_FIELDS, *_EXAMPLE_LABELS])
# What a reader of examples sees (``training.data.ExampleStream``, ``read_examples``): the sequence resolved into
# its four lists. A partition may also store this layout itself (the sequence copied inline; the training smoke
# world does): readers take it as it is.
RESOLVED_EXAMPLES_SCHEMA = pa.schema([*_EXAMPLE_HEAD, *SEQUENCE_FIELDS, *_EXAMPLE_LABELS])


class SequenceDigest:
    """Content digest of a ``features/user_sequence`` table: its rows in their order, whatever the chunking or
    the batches it is fed in (each column and each list's lengths hash in their own stream).

    An examples partition records the digest of the sequences it references; a reader computes it again over
    what it loaded, so a sequence partition rebuilt with other content is caught, and a rebuild with the same
    content (a rerun) is not.
    """

    def __init__(self) -> None:
        import hashlib

        # SHA-256: the fastest of hashlib's on CPUs with SHA extensions (about 0.9 GB/s, blake2b 0.35).
        self._streams = {
            part: hashlib.sha256()
            for name in USER_SEQUENCE_SCHEMA.names
            for part in ((name, "lengths"), (name, "values"))
        }

    def update(self, table: pa.Table | pa.RecordBatch) -> SequenceDigest:
        # The values' bytes straight from the Arrow buffers: ``to_numpy`` imports pandas (0.4 s in every shard job).
        for name in USER_SEQUENCE_SCHEMA.names:
            column = table.column(name)
            chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
            for chunk in chunks:
                if isinstance(chunk, pa.ListArray):
                    self._streams[name, "lengths"].update(_fixed_width_bytes(pc.list_value_length(chunk)))
                    chunk = chunk.flatten()
                # Each column in its contract's width (the table is conformed to USER_SEQUENCE_SCHEMA).
                self._streams[name, "values"].update(_fixed_width_bytes(chunk))
        return self

    def hexdigest(self) -> str:
        import hashlib

        whole = hashlib.sha256()
        for stream in self._streams.values():
            whole.update(stream.digest())
        return whole.hexdigest()[:32]


def _fixed_width_bytes(array: pa.Array) -> pa.Buffer:
    """The little-endian values of a fixed-width array without nulls (a timestamp as its int64), as stored."""
    if array.null_count:
        raise ValueError(f"a {array.type} column of a user_sequence table holds nulls: conform it to the contract first")
    width = array.type.bit_width // 8
    data = array.buffers()[1]
    assert data is not None, "a fixed-width array has a data buffer"
    return data.slice(array.offset * width, len(array) * width)


def combined_digest(digests: Sequence[str]) -> str:
    """The content digest of a partition merged from shards, one file each: of its files' digests, in file order (the
    merge reads no data). A reader accepts it or the digest of the rows as one stream."""
    import hashlib

    if len(digests) == 1:  # one file: the rows' own digest
        return digests[0]
    return hashlib.sha256("".join(digests).encode()).hexdigest()[:32]


def sequence_digest(sequences: pa.Table) -> str:
    """The :class:`SequenceDigest` of a whole ``features/user_sequence`` table."""
    return SequenceDigest().update(sequences).hexdigest()


# Every dataset a day's feature build writes, in build order, and its schema.
FEATURE_SCHEMAS: dict[str, pa.Schema] = {
    USER_DAILY: USER_DAILY_SCHEMA,
    PIN_DAILY: PIN_DAILY_SCHEMA,
    USER_WINDOW: USER_WINDOW_SCHEMA,
    PIN_WINDOW: PIN_WINDOW_SCHEMA,
    USER_SEQUENCE: USER_SEQUENCE_SCHEMA,
    EXAMPLES: EXAMPLES_SCHEMA,
}
FEATURE_OUTPUTS: tuple[str, ...] = tuple(FEATURE_SCHEMAS)
