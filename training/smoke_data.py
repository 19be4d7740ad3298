"""A tiny synthetic world in the storage layout, for tests and smoke runs of the training container.

``write_tiny_world`` writes complete ``examples``, ``raw/pins`` and ``truth`` partitions following
``core.contracts``, with a learnable signal (user taste x pin content, pin popularity), and for the content
family ``raw/pin_labels`` and ``truth_pins`` (a pin's topic shows in its image embedding and tokens, its
unsafety along one direction of the image embedding). It is not the
platform's demo data generator (that lives in ``features/``); it exists so that ``training/`` can be
exercised on its own, in milliseconds, without the feature build.
"""

from __future__ import annotations

import datetime as dt
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core import contracts
from core.contracts import ACTIONS, DENSE_FEATURES, EMBEDDING_DIM, IMAGE_DIM, SURFACES, TEXT_VOCAB, TOPICS
from core.storage import DATA_FILE, join, open_output, write_partition


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def write_tiny_world(
    root: str | os.PathLike[str],
    days: list[str],
    *,
    rows_per_day: int = 200,
    pins: int = 120,
    users: int = 40,
    row_group_size: int = 50,
    max_sequence: int = 60,
    seed: int = 0,
    embedding_dim: int = EMBEDDING_DIM,
) -> dict[str, object]:
    """Write examples (+ truth) for each day and a raw/pins snapshot for each day; return the pin ids."""
    rng = np.random.default_rng(seed)
    pin_ids = rng.choice(np.arange(1_000, 1_000_000), size=pins, replace=False).astype(np.int64)
    pin_emb = rng.normal(size=(pins, embedding_dim)).astype(np.float32) / np.sqrt(embedding_dim)
    pin_pop = rng.normal(size=pins)
    categories = rng.integers(0, 12, size=pins).astype(np.int32)
    creators = rng.integers(1, 30, size=pins).astype(np.int64)
    user_ids = np.arange(1, users + 1, dtype=np.int64) * 7
    taste = rng.normal(size=(users, embedding_dim)).astype(np.float32)
    liked = np.argsort(-(taste @ pin_emb.T), axis=1)[:, : max(1, pins // 4)]
    created = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    # Content (its own random stream, so that the examples above do not depend on it).
    crng = np.random.default_rng(seed + 1_000)
    topic = crng.integers(0, TOPICS, size=pins)
    unsafe_dir = crng.normal(size=IMAGE_DIM) / np.sqrt(IMAGE_DIM)
    z = crng.normal(size=pins)
    image = (crng.normal(size=(TOPICS, IMAGE_DIM))[topic] * 2.0 + 3.0 * z[:, None] * unsafe_dir
             + crng.normal(size=(pins, IMAGE_DIM))).astype(np.float32)
    tokens = (topic[:, None] * 16 + crng.integers(0, 16, size=(pins, 6))).astype(np.int32) % TEXT_VOCAB
    p_unsafe = _sigmoid(2.5 * z - 3.0)
    impression = 1
    for day_index, ds in enumerate(days):
        pins_table = pa.table(
            {
                "pin_id": pin_ids,
                "embedding": pa.FixedSizeListArray.from_arrays(pa.array(pin_emb.ravel()), embedding_dim),
                "category": categories,
                "creator_id": creators,
                "created_at": pa.array([created] * pins, type=pa.timestamp("us", tz="UTC")),
                "image_embedding": pa.FixedSizeListArray.from_arrays(pa.array(image.ravel()), IMAGE_DIM),
                "text_tokens": pa.array(tokens.tolist(), pa.list_(pa.int32())),
            },
            schema=contracts.PINS_SCHEMA,
        )
        with write_partition(root, contracts.RAW_PINS, ds) as staging, open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(pins_table, f)
        reviewed = crng.choice(pins, size=max(1, pins // 2), replace=False)
        day_start = dt.datetime.fromisoformat(ds).replace(tzinfo=dt.UTC)
        labels_table = pa.table(
            {
                "review_id": np.arange(len(reviewed), dtype=np.int64) + 1_000_000 * (day_index + 1),
                "pin_id": pin_ids[reviewed],
                "is_unsafe": (crng.random(len(reviewed)) < p_unsafe[reviewed]).astype(np.int8),
                "topic": topic[reviewed].astype(np.int32),
                "reviewed_at": pa.array([day_start] * len(reviewed), type=pa.timestamp("us", tz="UTC")),
            },
            schema=contracts.PIN_LABELS_SCHEMA,
        )
        with write_partition(root, contracts.RAW_PIN_LABELS, ds) as staging, open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(labels_table, f, row_group_size=row_group_size)
        truth_pins = pa.table(
            {
                "pin_id": pin_ids,
                "p_unsafe": p_unsafe,
                "topic_probs": pa.FixedSizeListArray.from_arrays(pa.array(np.eye(TOPICS)[topic].ravel()), TOPICS),
            },
            schema=contracts.TRUTH_PINS_SCHEMA,
        )
        with write_partition(root, contracts.TRUTH_PINS, ds) as staging, open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(truth_pins, f)

        n = rows_per_day
        u = rng.integers(0, users, size=n)
        p = rng.integers(0, pins, size=n)
        affinity = np.einsum("ij,ij->i", taste[u], pin_emb[p])
        truth = {
            "p_click": _sigmoid(-1.0 + 2.0 * affinity + 0.8 * pin_pop[p]),
            "p_repin": _sigmoid(-2.0 + 1.5 * affinity + 0.5 * pin_pop[p]),
            "p_hide": _sigmoid(-2.5 - 1.5 * affinity - 0.5 * pin_pop[p]),
        }
        labels = {k[2:]: (rng.random(n) < v).astype(np.int8) for k, v in truth.items()}
        ids = np.arange(impression, impression + n, dtype=np.int64)
        impression += n
        day = dt.datetime.fromisoformat(ds).replace(tzinfo=dt.UTC)
        lengths = rng.integers(0, max_sequence + 1, size=n)
        lengths[::7] = 0  # users without history
        # A user's history is drawn from the pins they like most, so the sequence reveals their taste.
        seq_idx = [liked[ui][rng.integers(0, liked.shape[1], size=k)] for ui, k in zip(u, lengths, strict=True)]
        cols: dict[str, object] = {
            "impression_id": ids,
            "ts": pa.array(
                [day + dt.timedelta(seconds=int(s)) for s in rng.integers(0, 86_400, n)],
                pa.timestamp("us", tz="UTC"),
            ),
            "user_id": user_ids[u],
            "pin_id": pin_ids[p],
            "category": categories[p],
            "creator_id": creators[p],
            "surface": [SURFACES[i] for i in rng.integers(0, len(SURFACES), n)],
        }
        for name in DENSE_FEATURES:
            if name.endswith("ctr") or name.endswith("_rate"):
                base = truth["p_click"] if name in ("p_ctr", "u_ctr") else truth["p_repin"]
                if name == "p_hide_rate":
                    base = truth["p_hide"]
                cols[name] = np.clip(base + rng.normal(0, 0.1, n), 0, 1).astype(np.float32)
            else:
                cols[name] = rng.poisson(20, n).astype(np.float32) * (lengths > 0)
        cols["seq_pin_ids"] = pa.array([pin_ids[s].tolist() for s in seq_idx], pa.list_(pa.int64()))
        cols["seq_actions"] = pa.array(
            [rng.integers(1, len(ACTIONS), size=k).tolist() for k in lengths], pa.list_(pa.int32())
        )
        cols["seq_categories"] = pa.array([categories[s].tolist() for s in seq_idx], pa.list_(pa.int32()))
        cols["seq_age_hours"] = pa.array(
            [np.sort(rng.exponential(48, size=k)).astype(np.float32).tolist() for k in lengths],
            pa.list_(pa.float32()),
        )
        for label, values in labels.items():
            cols[label] = values
        examples = pa.table(cols, schema=contracts.RESOLVED_EXAMPLES_SCHEMA)  # the sequence inline (per example)
        with write_partition(root, contracts.EXAMPLES, ds) as staging, open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(examples, f, row_group_size=row_group_size)
        truth_table = pa.table({"impression_id": ids, **truth}, schema=contracts.TRUTH_SCHEMA)
        with write_partition(root, contracts.TRUTH, ds) as staging, open_output(join(staging, DATA_FILE)) as f:
            pq.write_table(truth_table, f)
    return {"pin_ids": pin_ids}
