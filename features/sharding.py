"""Shards of a feature build step and the hash-bucketed layouts they read (docs/architecture.md §4).

A ``Shard`` builds the rows of one hash class of user or pin ids; ``shard_part`` says which files of a partition
can hold them (all, unless the partition records a ``hash_buckets`` layout: the merged output of a sharded step,
or the bucketed events of ``features.bucketed_events``). ``features.build.merge_shards`` publishes the day from the
shards' files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import duckdb

from core.contracts import (
    EVENTS_BY_PIN,
    EVENTS_BY_USER,
    EXAMPLES,
    PIN_DAILY,
    PIN_WINDOW,
    USER_DAILY,
    USER_SEQUENCE,
    USER_WINDOW,
)
from core.storage import data_files, join, name_of, read_metadata


@dataclass(frozen=True)
class Shard:
    """One of ``count`` shards of a day's build step (scale-out: each shard a job, docs/architecture.md §4).

    A shard builds the rows of the users whose ``hash(user_id) % count == index`` (user outputs and examples) and
    of the pins whose ``hash(pin_id) % count == index`` (pin outputs), reading whatever else it needs whole (the
    window's global pin rates are summed over every pin). Its outputs go to ``<staging>/<dataset>/shard-NNNNN/``,
    each folder published with its marker, until :func:`merge_shards` publishes the day's partitions from every
    shard's file: rows equal to those of an unsharded build (a row's values never depend on other shards' rows).
    """

    index: int
    count: int
    staging: str

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} is not in [0, {self.count}): set --shards / --run-shards")

    def keeps(self, column: str) -> str:
        """The SQL condition of this shard's rows, by ``column`` (user_id or pin_id)."""
        return f"hash({column}) % {self.count} = {self.index}"

    def folder(self, dataset: str) -> str:
        return shard_folder(self.staging, dataset, self.index)


def shard_folder(staging: str, dataset: str, index: int) -> str:
    return join(staging, *dataset.split("/"), f"shard-{index:05d}")


def shard_file(index: int) -> str:
    return f"part-{index:05d}.parquet"


def shard_keeps(shard: Shard | None, column: str) -> str:
    return shard.keeps(column) if shard is not None else "TRUE"


# --- bucketed layouts -------------------------------------------------------------------------------------
# A partition whose metadata has ``hash_buckets`` {key, count, probe} holds in file part-b exactly the rows with
# hash(key) % count = b: the merged output of a sharded step (part-i: shard i), and the day's events bucketed by
# validation (EVENTS_BY_USER, EVENTS_BY_PIN). Shard i of N needs the rows with hash % N = i, which lie in the files
# b with b % gcd(count, N) = i % gcd(count, N) (exactly those files when N divides count): it reads those only,
# and still filters them. Any other partition (unsharded, written before) is read whole and filtered, as before.
# ``probe`` is DuckDB's hash of fixed ids when the layout was written: a DuckDB whose hash differs reads whole.
_PROBE_IDS = "(VALUES (0), (1), (12345), (987654321))"
DATASET_KEYS = {
    USER_DAILY: "user_id", PIN_DAILY: "pin_id", USER_WINDOW: "user_id", PIN_WINDOW: "pin_id", USER_SEQUENCE: "user_id",
    EXAMPLES: "user_id", EVENTS_BY_USER: "user_id", EVENTS_BY_PIN: "pin_id",
}


# This process's probe: taken on its first connection (``connect``), as a DuckDB instance costs ~15 ms of CPU.
_HASH_PROBE: list[int] = []


def take_hash_probe(con: duckdb.DuckDBPyConnection) -> int:
    if not _HASH_PROBE:
        # fetchall: a result left open by fetchone makes the connection's next con.sql() fail (DuckDB 2).
        ((value,),) = con.execute(f"SELECT sum(hash(v) % 1000003)::BIGINT FROM {_PROBE_IDS} AS t(v)").fetchall()
        _HASH_PROBE.append(int(value))
    return _HASH_PROBE[0]


def hash_probe() -> int:
    """A digest of this DuckDB's ``hash()`` of fixed ids (the same in every process of one DuckDB version)."""
    if _HASH_PROBE:
        return _HASH_PROBE[0]
    con = duckdb.connect()
    try:
        return take_hash_probe(con)
    finally:
        con.close()


def hash_layout(key: str, count: int) -> dict[str, Any]:
    return {"key": key, "count": count, "probe": hash_probe()}


class ShardPart(NamedTuple):
    """What a shard reads of a partition: ``files``, and ``keeps``, the SQL condition that picks its rows of them."""

    files: list[str]
    keeps: str


def shard_part(
    root: str | os.PathLike[str], dataset: str, day: str, shard: Shard | None, files: Sequence[str] | None = None
) -> ShardPart:
    """The Parquet files of partition ``dataset/day`` that can hold ``shard``'s rows (every file without a shard, or
    when the partition records no usable ``hash_buckets`` layout), and the condition that keeps its rows: TRUE when
    the files hold exactly those (the shard count divides the layout's), as the filter costs a hash per row."""
    files = list(data_files(root, dataset, day) if files is None else files)
    key = DATASET_KEYS[dataset]
    if shard is None:
        return ShardPart(files, "TRUE")
    whole = ShardPart(files, shard.keeps(key))
    layout = read_metadata(root, dataset, day).get("hash_buckets")
    if not isinstance(layout, dict) or layout.get("key") != key or layout.get("probe") != hash_probe():
        return whole
    count = int(layout["count"])
    group = math.gcd(count, shard.count)
    by_name = {name_of(f): f for f in files}
    picked = [by_name.get(shard_file(b)) for b in range(count) if b % group == shard.index % group]
    if len(by_name) != count or None in picked:  # not the recorded layout: read every file
        return whole
    return ShardPart([f for f in picked if f is not None], "TRUE" if group == shard.count else whole.keeps)


def shard_files(
    root: str | os.PathLike[str], dataset: str, day: str, shard: Shard | None, files: Sequence[str] | None = None
) -> list[str]:
    """The files of :func:`shard_part`, for a reader that joins them to rows already the shard's."""
    return shard_part(root, dataset, day, shard, files).files
