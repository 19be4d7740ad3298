"""The examples step: ``examples`` of a day, one row per impression with its labels and its features as of ds-1.

Point in time: the features joined are those of the end of ds-1 only; negatives are downsampled by a hash of the
impression id and a seed, so a rerun keeps the same rows.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import os
from collections.abc import Sequence
from typing import Any

from core.contracts import (
    COUNT_COLUMNS,
    DENSE_FEATURES,
    EVENTS_SCHEMA,
    EXAMPLES,
    EXAMPLES_SCHEMA,
    LABELS,
    PIN_WINDOW,
    PIN_WINDOW_SCHEMA,
    RAW_EVENTS,
    RAW_PINS,
    USER_SEQUENCE,
    USER_SEQUENCE_SCHEMA,
    USER_WINDOW,
    USER_WINDOW_SCHEMA,
    SequenceDigest,
)
from core.storage import data_files, ds_str, is_complete, read_metadata, read_parquet, shift_ds
from features.bucketed_events import events_part
from features.sharding import Shard, shard_files
from features.step_io import (
    DEFAULTS,
    UNKNOWN_ID,
    DuckDBSettings,
    MissingInputError,
    check_positive,
    check_unique_pins,
    check_validated,
    conform,
    connect,
    create_view,
    events_hint,
    indent,
    one_row,
    partition_ref,
    pins_hint,
    pins_view,
    require_input,
    write_query,
)
from features.steps.window import DEFAULT_GLOBAL_RATES, SMOOTHED_MACRO

log = logging.getLogger(__name__)


_RATE_OF_ACTION = {"click": "ctr", "repin": "repin_rate", "hide": "hide_rate"}


# Negative downsampling keeps an impression when u < rate, u = the first 52 bits of
# md5('<seed>:<impression_id>') / 2^52: reproducible across reruns, engines and languages. Evaluated without
# parsing the digest: u < rate <=> those bits (an integer) < ceil(rate * 2^52) <=> the digest's hex string sorts
# before that bound written as 13 lowercase hex digits ('0'-'9' sort before 'a'-'f'; a digest whose first 13
# digits equal the bound is longer, so sorts after it). A third of the hash's cost, the same rows.
KEEP_NEGATIVE_HASH = "md5($seed_prefix || i.impression_id::VARCHAR) < $keep_below"
KEEP_NEGATIVE = "/* keep negative */"


def _keep_negative(negative_downsample: float, seed: int) -> tuple[str, dict[str, str]]:
    """The sampling condition of an impression without a positive label, and its query parameters.

    TRUE when every 52-bit value is below the bound (rate 1, or a rate within 2^-52 of it), FALSE at rate 0:
    the same rows, without an md5 per impression.
    """
    bound = math.ceil(negative_downsample * 2**52)
    if bound >= 2**52:
        return "TRUE", {}
    if bound <= 0:
        return "FALSE", {}
    return KEEP_NEGATIVE_HASH, {"seed_prefix": f"{seed}:", "keep_below": format(bound, "013x")}


_LABEL_COLUMNS = indent([f"max((action = '{a}')::TINYINT) AS {a}" for a in LABELS], 9)
# The feature columns are computed once per user and per pin (a few hundred thousand rows), then joined: one join
# per entity instead of one per input table, and no cast per impression.
_USER_FEATURES = indent([f"u.{c}::FLOAT AS u_{c}" for c in COUNT_COLUMNS] + ["u.ctr::FLOAT AS u_ctr"], 9)
_PIN_FEATURES = indent(
    [f"pw.{c}::FLOAT AS p_{c}" for c in COUNT_COLUMNS] + [f"pw.{rate}::FLOAT AS p_{rate}" for rate in _RATE_OF_ACTION.values()],
    9,
)
# An impression of a user or pin without features (new to the window) gets zero counts and the prior rates.
_USER_DEFAULTS = indent([f"coalesce(uf.u_{c}, 0.0::FLOAT) AS u_{c}" for c in (*COUNT_COLUMNS, "ctr")], 7)
_PIN_DEFAULTS = indent(
    [f"coalesce(pf.p_{c}, 0.0::FLOAT) AS p_{c}" for c in COUNT_COLUMNS]
    + [
        f"coalesce(pf.p_{rate}, smoothed(0, 0, $prior, $global_{rate})::FLOAT) AS p_{rate}"
        for rate in _RATE_OF_ACTION.values()
    ],
    7,
)
_LABEL_VALUES = indent([f"coalesce(l.{a}, 0)::TINYINT AS {a}" for a in LABELS], 7)
_ANY_POSITIVE_L = " OR ".join(f"l.{a} = 1" for a in LABELS)
_LABEL_NAMES = ", ".join(f"i.{a}" for a in LABELS)

# Examples: impressions of ds (view events) + labels of ds + features as of ds-1 (views user_window,
# pin_window, user_sequence: empty when missing) + pin attributes of the ds snapshot (view pins).
EXAMPLES_SQL = f"""
WITH labels AS (
  SELECT impression_id,
         {_LABEL_COLUMNS}
  FROM events
  WHERE action <> 'impression'
  GROUP BY impression_id
),
-- Downsampling first, so that features are joined for the kept impressions only.
sampled AS (
  SELECT i.impression_id, i.ts, i.user_id, i.pin_id, i.surface,
         {_LABEL_VALUES}
  FROM events AS i
  LEFT JOIN labels AS l ON l.impression_id = i.impression_id
  WHERE i.action = 'impression'
    AND ({_ANY_POSITIVE_L} OR {KEEP_NEGATIVE})
),
user_features AS (
  SELECT coalesce(u.user_id, s.user_id) AS user_id,
         {_USER_FEATURES},
         s.seq_len
  FROM user_window AS u
  -- The four lists have one length: the INTEGER one is the cheapest to read (half the bytes of the timestamps).
  FULL JOIN (SELECT user_id, len(seq_actions) AS seq_len FROM user_sequence) AS s ON s.user_id = u.user_id
),
pin_features AS (
  SELECT coalesce(p.pin_id, pw.pin_id) AS pin_id, p.category, p.creator_id,
         {_PIN_FEATURES}
  FROM pins AS p
  FULL JOIN pin_window AS pw ON pw.pin_id = p.pin_id
)
SELECT i.impression_id, i.ts, i.user_id, i.pin_id,
       coalesce(pf.category, $unknown)::INTEGER AS category,
       coalesce(pf.creator_id, $unknown)::BIGINT AS creator_id,
       i.surface,
       {_USER_DEFAULTS},
       {_PIN_DEFAULTS},
       $seq_ds::DATE AS seq_ds,
       coalesce(uf.seq_len, 0)::INTEGER AS seq_len,
       {_LABEL_NAMES}
FROM sampled AS i
LEFT JOIN pin_features AS pf ON pf.pin_id = i.pin_id
LEFT JOIN user_features AS uf ON uf.user_id = i.user_id
ORDER BY i.impression_id
"""
# The user's sequence is referenced, not copied: ``seq_ds`` (= ds-1) and ``seq_len`` (the number of its actions
# the example sees, all of them: every action of ds-1 is before the impression) point at the user's row of
# ``features/user_sequence`` of ds-1, and readers (``training.data``) resolve them into the four lists, with
# seq_age_hours = (impression ts - action ts) in hours as FLOAT. Copying lists of 50 into every example was
# most of the day's time and of its bytes.

# Of the shard's impressions (every one unsharded); the merge sums the shards'.
IMPRESSION_COUNTS_SQL = """
SELECT count(*) AS impressions,
       count(*) FILTER (WHERE pin_id NOT IN (SELECT pin_id FROM pins)) AS unknown_pin
FROM events
WHERE action = 'impression'
"""


def _sequence_digest(root: str | os.PathLike[str], ds: str, files: Sequence[str]) -> str:
    """The content digest of ``features/user_sequence`` of ``ds``: the one its build recorded, else computed."""
    recorded = read_metadata(root, USER_SEQUENCE, ds).get("content_digest")
    if isinstance(recorded, str):
        return recorded
    digest = SequenceDigest()
    for f in files:
        digest.update(conform(read_parquet(f), USER_SEQUENCE_SCHEMA))
    return digest.hexdigest()


def build_examples(
    root: str | os.PathLike[str],
    ds: str | dt.date,
    prior_impressions: float = DEFAULTS.pin_prior_impressions,
    negative_downsample: float = DEFAULTS.negative_downsample,
    seed: int = DEFAULTS.negative_downsample_seed,
    *,
    require_validation: bool = True,
    engine: DuckDBSettings | None = None,
    shard: Shard | None = None,
) -> dict[str, Any]:
    """Write ``examples`` of ``ds``: one row per impression of ds with its labels and its features.

    Features are those of the end of ``ds-1`` only (point in time). A missing ds-1 feature partition is
    an error naming it when the raw events of ds-1 are there (build that day first: the DAG's
    ``depends_on_past`` does); when ds-1 has no raw events either (the first day, or a gap), its users
    and pins get zero counts, the prior rates (the global rates of the ds-1 pin_window metadata, else
    DEFAULT_GLOBAL_RATES) and an empty sequence, and the partitions are listed in ``missing_inputs``.
    Impressions without a positive label are kept with probability ``negative_downsample`` (a hash of
    ``impression_id`` and ``seed``, so a rerun keeps the same rows); the rate, and the weight
    ``1/negative_downsample`` that undoes it, are in the metadata.
    """
    ds = ds_str(ds)
    check_positive("prior_impressions", prior_impressions, "--prior-impressions", allow_zero=True)
    if not 0.0 <= negative_downsample <= 1.0:
        raise ValueError(
            f"negative_downsample must be in [0, 1], got {negative_downsample!r}; set --negative-downsample"
        )
    features_ds = shift_ds(ds, -1)
    require_input(root, RAW_EVENTS, ds, events_hint(ds))
    require_input(root, RAW_PINS, ds, pins_hint(ds))  # the day's snapshot (or increment) has landed
    feature_inputs = (
        ("user_window", USER_WINDOW, USER_WINDOW_SCHEMA),
        ("pin_window", PIN_WINDOW, PIN_WINDOW_SCHEMA),
        ("user_sequence", USER_SEQUENCE, USER_SEQUENCE_SCHEMA),
    )
    missing_inputs = [partition_ref(d, features_ds) for _, d, _ in feature_inputs if not is_complete(root, d, features_ds)]
    if missing_inputs and is_complete(root, RAW_EVENTS, features_ds):
        raise MissingInputError(
            f"examples of ds={ds} need the features as of the end of {features_ds}, but "
            f"{', '.join(missing_inputs)} are missing while {partition_ref(RAW_EVENTS, features_ds)} is there; build "
            f"that day first (`python -m features.build --ds {features_ds}`), then rerun this day"
        )

    validation = check_validated(root, [ds], require_validation=require_validation)
    inputs = [partition_ref(RAW_EVENTS, ds), partition_ref(RAW_PINS, ds)]
    global_rates, rates_source = dict(DEFAULT_GLOBAL_RATES), "defaults"
    with connect(engine, root) as con:
        events = events_part(root, ds, shard)
        create_view(con, "events_all", events.files, EVENTS_SCHEMA)
        # An impression and its engagements have one user: a shard's labels are complete.
        con.execute(f"CREATE OR REPLACE TEMP VIEW events AS SELECT * FROM events_all WHERE {events.keeps}")
        pins_view(con, root, ds)
        check_unique_pins(con, ds, shard)
        sequence_digest: str | None = None
        for name, dataset, schema in feature_inputs:
            files = [] if partition_ref(dataset, features_ds) in missing_inputs else data_files(root, dataset, features_ds)
            if files:
                inputs.append(partition_ref(dataset, features_ds))
                if dataset == USER_SEQUENCE:
                    sequence_digest = _sequence_digest(root, features_ds, files)
            # A shard joins its own users' features only; every pin's (any user may see any pin).
            create_view(con, name, files if dataset == PIN_WINDOW else shard_files(root, dataset, features_ds, shard, files), schema)
        if partition_ref(PIN_WINDOW, features_ds) in inputs:
            recorded = read_metadata(root, PIN_WINDOW, features_ds).get("global_rates")
            if recorded:
                global_rates = {k: float(recorded[k]) for k in DEFAULT_GLOBAL_RATES}
                rates_source = partition_ref(PIN_WINDOW, features_ds)
        if missing_inputs:
            log.warning("examples of ds=%s: no features of %s (cold start): %s", ds, features_ds, missing_inputs)
        con.execute(SMOOTHED_MACRO)
        keep_negative, keep_params = _keep_negative(negative_downsample, seed)
        params: dict[str, Any] = {"prior": prior_impressions, "unknown": UNKNOWN_ID} | {
            f"global_{k}": v for k, v in global_rates.items()
        }
        params |= keep_params
        params["seq_ds"] = dt.date.fromisoformat(features_ds)

        def impression_counts() -> dict[str, int]:
            impressions, unknown_pin = one_row(con, IMPRESSION_COUNTS_SQL)
            return {"impressions": int(impressions), "impressions_unknown_pin": int(unknown_pin)}

        metadata = {
            "step": "examples",
            "dataset": EXAMPLES,
            "ds": ds,
            "features_ds": features_ds,
            "inputs": inputs,
            "missing_inputs": missing_inputs,
            "missing_days": [features_ds] if missing_inputs else [],
            "impressions": None,  # counted while the examples' file encodes (``impression_counts``)
            "impressions_unknown_pin": None,
            "negative_downsample": negative_downsample,
            "negative_weight": 1.0 / negative_downsample if negative_downsample > 0 else None,
            "seed": seed,
            "prior_impressions": prior_impressions,
            "global_rates": global_rates,
            "global_rates_source": rates_source,
            "dense_features": list(DENSE_FEATURES),
            # The reference of every example's sequence (seq_ds, seq_len): what a reader checks it resolves against.
            "sequence_ds": features_ds,
            # The window of the features joined (their own build's, None without them): a day built with another
            # --window-days than the day before's joins that day's window as it is. Not ``window_days``, the build's
            # own setting, which a merge checks its shards against.
            "features_window_days": read_metadata(root, USER_WINDOW, features_ds).get("window_days"),
            "sequence_digest": sequence_digest,
            **validation,
        }
        summary = write_query(
            con, EXAMPLES_SQL.replace(KEEP_NEGATIVE, keep_negative), params, root, EXAMPLES, ds, EXAMPLES_SCHEMA, metadata,
            sums=LABELS, sums_key="positives", shard=shard, late_metadata=impression_counts, last_query=True,
        )
    return {EXAMPLES: summary}
