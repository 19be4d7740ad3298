"""Real data on the raw contract: the MovieLens 100K ratings replayed as days of engagement logs.

The "Bring your own data" path of docs/data.md, with a real public log: 100,000 ratings (1-5 stars) of 1,682 movies by
943 users (GroupLens, University of Minnesota; F. M. Harper and J. A. Konstan, "The MovieLens Datasets: History
and Context", ACM TiiS 5(4), 2015). The project does not carry or download the data: it reads the copy that the
``recbole`` package ships in its wheel (``recbole/dataset_example/ml-100k``; ``make install`` installs it without
its dependencies), or the folder given by ``--source``. The data's own terms (research use, no redistribution)
apply to it.

How a rating becomes the raw contract (``core/contracts.py``):

- every rating is an **impression** of the movie (a pin) to the user, on the surface ``home_feed``;
- 4 or 5 stars is a **click**, 5 stars also a **repin**, 1 or 2 stars a **hide** (each an engagement of the
  impression, one second after it);
- each user's ratings, in the order of their timestamps, are spread over the ``days`` days starting at ``start``
  (a user's k-th of n ratings falls on day floor(k x days / n)): every user comes back every day, as a daily
  engagement log's users do, and the last day holds each user's latest ratings with the earlier ones as their
  history (the per-user temporal split of recommender evaluation). Within a day the ratings keep their order
  and are spread evenly over its 24 hours, so a user's earlier ratings are the action sequence of their later
  ones. ``--order global`` cuts the ratings by time instead (days of equal size): most users of a day are then
  seen for the first time, because MovieLens users rate in a few sessions;
- a movie's ``embedding`` is its genres (19, multi-hot, L2-normalised: ``validation.embedding_dim: 19``), its
  ``category`` its first genre, its ``creator_id`` its release year, its ``text_tokens`` the words of its title
  hashed into the text vocabulary, and its ``image_embedding`` a fixed random projection of its genres (the data
  has no images); ``raw/pins`` and ``raw/users`` are full snapshots every day.

    python -m features.movielens --root .pinflow/movielens --start 2026-11-01 --days 12

then validate and build each day with the configuration this data needs (``PINFLOW_VALIDATION__EMBEDDING_DIM=19``,
see docs/data.md), and train.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from core import contracts, storage
from core.failures import ConfigError

# The genres of MovieLens 100K, in the order of its u.genre file: the embedding's axes.
GENRES: tuple[str, ...] = (
    "unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama", "Fantasy",
    "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western",
)
EMBEDDING_DIM = len(GENRES)
SURFACE = "home_feed"
CLICK_STARS, REPIN_STARS, HIDE_STARS = 4, 5, 2  # a click at >= 4 stars, a repin at 5, a hide at <= 2
RECBOLE_FOLDER = ("dataset_example", "ml-100k")
UNKNOWN_YEAR = 1  # the creator of the one movie without a release year (ids must be positive)
PROVENANCE = "MovieLens 100K (GroupLens), ratings replayed by features.movielens"


def default_source() -> Path:
    """The MovieLens 100K copy inside the installed ``recbole`` package (found without importing it)."""
    spec = importlib.util.find_spec("recbole")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "MovieLens 100K: the recbole package is not installed (it carries the data): "
            "`pip install --no-deps recbole==1.2.1` (make install does), or give --source <folder of ml-100k.inter>"
        )
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*RECBOLE_FOLDER)


def _read(source: Path, name: str) -> pa.Table:
    path = source / f"ml-100k.{name}"
    if not path.is_file():
        raise ConfigError(f"MovieLens 100K: {path} is missing (--source names the folder holding ml-100k.{name})")
    table = pacsv.read_csv(path, parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                           convert_options=pacsv.ConvertOptions(strings_can_be_null=False))
    # RecBole's atomic-file headers name a field's type after a colon (user_id:token): keep the name.
    return table.rename_columns([column.split(":", 1)[0] for column in table.column_names])


def load_ratings(source: Path) -> pa.Table:
    """user_id, item_id, rating, timestamp of every rating, sorted by time (ties by user, then movie)."""
    table = _read(source, "inter")
    missing = {"user_id", "item_id", "rating", "timestamp"} - set(table.column_names)
    if missing:
        raise ConfigError(f"MovieLens 100K: {source}/ml-100k.inter lacks the column(s) {', '.join(sorted(missing))}")
    table = pa.table({
        "user_id": table["user_id"].cast(pa.int64()), "item_id": table["item_id"].cast(pa.int64()),
        "rating": table["rating"].cast(pa.float64()), "timestamp": table["timestamp"].cast(pa.int64()),
    })
    return table.sort_by([("timestamp", "ascending"), ("user_id", "ascending"), ("item_id", "ascending")])


def _title_tokens(title: str) -> list[int]:
    """The words of a title as ids in [1, TEXT_VOCAB) (0 is left for padding), by a stable hash."""
    words = "".join(c.lower() if c.isalnum() else " " for c in title).split()
    return [1 + int.from_bytes(hashlib.md5(w.encode()).digest()[:4], "little") % (contracts.TEXT_VOCAB - 1)
            for w in words[:16]] or [0]


def pins_table(source: Path) -> pa.Table:
    """Every movie as a pin of the raw contract (``PINS_SCHEMA``)."""
    items = _read(source, "item")
    ids = items["item_id"].cast(pa.int64()).to_numpy()
    genres = np.zeros((len(ids), EMBEDDING_DIM), dtype=np.float32)
    for row, names in enumerate(items["class"].to_pylist()):
        for name in str(names or "").split():
            if name in GENRES:
                genres[row, GENRES.index(name)] = 1.0
    genres[genres.sum(axis=1) == 0, 0] = 1.0  # no genre listed: "unknown"
    embedding = genres / np.linalg.norm(genres, axis=1, keepdims=True)
    projection = np.random.default_rng(0).standard_normal((EMBEDDING_DIM, contracts.IMAGE_DIM)).astype(np.float32)
    image = embedding @ projection / np.sqrt(EMBEDDING_DIM)
    years = [int(y) if str(y).isdigit() else UNKNOWN_YEAR for y in items["release_year"].to_pylist()]
    return pa.table({
        "pin_id": pa.array(ids, pa.int64()),
        "embedding": pa.array(list(embedding), pa.list_(pa.float32())),
        "category": pa.array(genres.argmax(axis=1).astype(np.int32), pa.int32()),
        "creator_id": pa.array(years, pa.int64()),
        "created_at": pa.nulls(len(ids), contracts.TS),
        "image_embedding": pa.array(list(image.astype(np.float32)), pa.list_(pa.float32())),
        "text_tokens": pa.array([_title_tokens(str(t)) for t in items["movie_title"].to_pylist()], pa.list_(pa.int32())),
    }, schema=contracts.PINS_SCHEMA)


def users_table(source: Path) -> pa.Table:
    """Every user of the raw contract (``USERS_SCHEMA``): MovieLens 100K's users all rated from the US."""
    ids = _read(source, "user")["user_id"].cast(pa.int64())
    return pa.table({"user_id": ids, "country": pa.array(["US"] * len(ids)), "created_at": pa.nulls(len(ids), contracts.TS)},
                    schema=contracts.USERS_SCHEMA)


ORDERS = ("per_user", "global")


def day_of_rating(ratings: pa.Table, days: int, order: str = "per_user") -> np.ndarray:
    """The day index (0-based) of each rating of ``ratings`` (sorted by time): ``per_user`` spreads each user's
    ratings over the days (a user's k-th of n on day floor(k x days / n)); ``global`` cuts the ratings by time into
    days of (nearly) equal size."""
    rows = ratings.num_rows
    if order == "global":
        return (np.arange(rows, dtype=np.int64) * days) // max(rows, 1)
    if order != "per_user":
        raise ConfigError(f"--order {order!r}: choose one of {', '.join(ORDERS)}")
    users = ratings["user_id"].to_numpy()
    by_user = np.argsort(users, kind="stable")  # each user's ratings in time order
    sorted_users = users[by_user]
    starts = np.flatnonzero(np.r_[True, sorted_users[1:] != sorted_users[:-1]])
    counts = np.diff(np.r_[starts, rows])
    rank = np.arange(rows) - np.repeat(starts, counts)
    day = np.empty(rows, dtype=np.int64)
    day[by_user] = (rank * days) // np.repeat(counts, counts)
    return day


def events_table(ratings: pa.Table, ds: str, first_event_id: int) -> pa.Table:
    """One day's ratings as impressions and their engagements (``EVENTS_SCHEMA``), ordered by time."""
    n = ratings.num_rows
    day_start = int(dt.datetime.fromisoformat(ds).replace(tzinfo=dt.UTC).timestamp() * 1_000_000)
    spacing = 86_400_000_000 // max(n, 1)
    impression_ts = day_start + np.arange(n, dtype=np.int64) * spacing
    impression_ids = first_event_id + np.arange(n, dtype=np.int64) * 4  # room for three engagements each
    stars = ratings["rating"].to_numpy()
    users, items = ratings["user_id"].to_numpy(), ratings["item_id"].to_numpy()
    parts = [(np.ones(n, dtype=bool), "impression", 0)]
    parts += [(stars >= CLICK_STARS, "click", 1), (stars >= REPIN_STARS, "repin", 2), (stars <= HIDE_STARS, "hide", 3)]
    columns: dict[str, list[Any]] = {k: [] for k in ("event_id", "impression_id", "user_id", "pin_id", "action", "ts")}
    for mask, action, offset in parts:
        columns["event_id"].append(impression_ids[mask] + offset)
        columns["impression_id"].append(impression_ids[mask])
        columns["user_id"].append(users[mask])
        columns["pin_id"].append(items[mask])
        columns["action"].append(np.full(int(mask.sum()), action, dtype=object))
        columns["ts"].append(impression_ts[mask] + (1_000_000 if offset else 0))  # an engagement a second later
    merged = {k: np.concatenate(v) for k, v in columns.items()}
    order = np.lexsort((merged["event_id"], merged["ts"]))
    return pa.table({
        "event_id": pa.array(merged["event_id"][order], pa.int64()),
        "impression_id": pa.array(merged["impression_id"][order], pa.int64()),
        "user_id": pa.array(merged["user_id"][order], pa.int64()),
        "pin_id": pa.array(merged["pin_id"][order], pa.int64()),
        "action": pa.array(merged["action"][order].tolist(), pa.string()),
        "surface": pa.array([SURFACE] * len(order), pa.string()),
        "ts": pa.array(merged["ts"][order], contracts.TS),
    }, schema=contracts.EVENTS_SCHEMA)


def land(root: str | os.PathLike[str], start: str, days: int, source: Path | None = None,
         order: str = "per_user") -> dict[str, Any]:
    """Write ``days`` days of MovieLens 100K under ``root`` as raw/events, raw/pins and raw/users (data, then the
    marker, per partition). Returns a summary: the days, ratings and events per day, users and movies."""
    if days < 2:
        raise ConfigError(f"--days {days}: give at least 2 (the ranker trains on the days before the last)")
    source = source or default_source()
    ratings = load_ratings(source)
    pins, users = pins_table(source), users_table(source)
    first = storage.parse_ds(start)
    day = day_of_rating(ratings, days, order)
    summary: dict[str, Any] = {"source": str(source), "order": order, "days": [], "ratings": ratings.num_rows,
                               "events": 0, "users": users.num_rows, "pins": pins.num_rows}
    meta = {"source": PROVENANCE, "order": order}
    first_event_id = 1
    for index in range(days):
        ds = (first + dt.timedelta(days=index)).isoformat()
        todays = ratings.filter(pa.array(day == index))
        events = events_table(todays, ds, first_event_id=first_event_id)
        first_event_id += 4 * todays.num_rows
        storage.write_table(root, contracts.RAW_EVENTS, ds, events, {**meta, "rows": events.num_rows})
        storage.write_table(root, contracts.RAW_PINS, ds, pins, {**meta, "rows": pins.num_rows})
        storage.write_table(root, contracts.RAW_USERS, ds, users, {**meta, "rows": users.num_rows})
        summary["days"].append(ds)
        summary["events"] += events.num_rows
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="storage root to write raw/events, raw/pins and raw/users under")
    parser.add_argument("--start", default="2026-11-01", help="the first day, YYYY-MM-DD (default: %(default)s)")
    parser.add_argument("--days", type=int, default=12, help="days to cut the ratings into (default: %(default)s)")
    parser.add_argument("--order", choices=ORDERS, default="per_user",
                        help="per_user: each user's ratings spread over the days; global: cut by time (default: %(default)s)")
    parser.add_argument("--source", type=Path, default=None,
                        help="folder holding ml-100k.inter, .item and .user (default: the recbole package's copy)")
    args = parser.parse_args(argv)
    try:
        summary = land(args.root, args.start, args.days, args.source, args.order)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return int(err.exit_code)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"landed {summary['ratings']} ratings ({summary['events']} events) of {summary['users']} users on "
          f"{summary['pins']} movies as {len(summary['days'])} days {summary['days'][0]}..{summary['days'][-1]} "
          f"under {args.root} (validation.embedding_dim: {EMBEDDING_DIM})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
