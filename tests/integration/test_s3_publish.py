"""core.storage.publish on an object store (a moto S3 server over HTTP): versioned partition folders switched by
their marker. Readers never find a partition missing or mixed while it is republished, concurrent writers leave one
whole version, a failed publish leaves the old one, a pin keeps reading its version, plain markers read as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import s3_bucket

from core import storage
from core.failures import DataError

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BUCKET = "pinflow-publish"
DATASET = "features/user_daily"
DAY = "2026-01-01"
FILES = 3  # files per version: a reader that mixed two versions would see two tokens
ROWS = 50

# Publishes the partition `rounds` times; every row of one version holds the token "<writer>-<round>".
WRITER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    import pyarrow.parquet as pq
    from core import storage

    root, dataset, day, writer, rounds, files, rows = sys.argv[1:4] + [sys.argv[4]] + [int(a) for a in sys.argv[5:]]
    for i in range(rounds):
        token = f"{writer}-{i}"
        with storage.write_partition(root, dataset, day) as staging:
            for f in range(files):
                with storage.open_output(storage.join(staging, f"part-{f:05d}.parquet")) as out:
                    pq.write_table(pa.table({"token": [token] * rows, "f": [f] * rows}), out)
            storage.write_json(storage.join(staging, storage.METADATA_FILE), {"token": token})
    """
)


@pytest.fixture
def s3(moto_server: str, tmp_path: Path) -> Iterator[Any]:
    with s3_bucket(moto_server, tmp_path, BUCKET) as fs:
        yield fs


@pytest.fixture
def root(s3: Any, request: pytest.FixtureRequest) -> str:
    return f"s3://{BUCKET}/{request.node.name}"


def publish(root: str, token: str, day: str = DAY) -> None:
    with storage.write_partition(root, DATASET, day) as staging:
        for f in range(FILES):
            with storage.open_output(storage.join(staging, f"part-{f:05d}.parquet")) as out:
                pq.write_table(pa.table({"token": [token] * ROWS, "f": [f] * ROWS}), out)
        storage.write_json(storage.join(staging, storage.METADATA_FILE), {"token": token})


def tokens(table: pa.Table) -> set[str]:
    return set(table.column("token").to_pylist())


def versions(root: str, day: str = DAY) -> list[str]:
    part = storage.partition(root, DATASET, day)
    return [n for n in storage.list_names(part) if n.startswith(storage.VERSION_PREFIX)]


def current(root: str, day: str = DAY) -> str:
    marker = storage.read_text(storage.join(storage.partition(root, DATASET, day), storage.MARKER))
    version = storage.marker_version(marker)
    assert version, marker
    return f"{storage.VERSION_PREFIX}{version}"


def writers(root: str, names: list[str], rounds: int) -> list[subprocess.Popen[bytes]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return [
        subprocess.Popen([sys.executable, "-c", WRITER, root, DATASET, DAY, name, str(rounds), str(FILES), str(ROWS)],
                         env=env, stderr=subprocess.PIPE)
        for name in names
    ]


def read_while(procs: list[subprocess.Popen[bytes]], root: str) -> int:
    """Read the partition until every writer is done: always whole, one version. The number of reads."""
    reads = 0
    while any(p.poll() is None for p in procs):
        assert storage.is_complete(root, DATASET, DAY)
        assert len(storage.data_files(root, DATASET, DAY)) == FILES
        table = storage.read_table(root, DATASET, DAY)
        assert table.num_rows == FILES * ROWS and len(tokens(table)) == 1, tokens(table)
        assert sorted(set(table.column("f").to_pylist())) == list(range(FILES))
        reads += 1
    for p in procs:
        _, err = p.communicate()
        assert p.returncode == 0, err.decode()
    return reads


def assert_whole(root: str, kept: list[str]) -> None:
    """Every version left is whole: its own marker, all its files."""
    part = storage.partition(root, DATASET, DAY)
    for name in kept:
        assert len(storage.glob(storage.join(part, name), "*.parquet")) == FILES
        assert storage.exists(storage.join(part, name, storage.MARKER))


def tidy_after_the_grace(root: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Publish once more as if the grace had passed: the versions left then (the new one and the one it replaced)."""
    before = current(root)
    monkeypatch.setattr(storage.publishing, "SUPERSEDED_GRACE_SECONDS", 0.0)
    publish(root, "after-the-grace")
    kept = versions(root)
    assert kept == [before, current(root)], kept
    return kept


def test_a_reader_never_sees_a_missing_or_mixed_partition_while_it_is_republished(
    root: str, monkeypatch: pytest.MonkeyPatch
):
    publish(root, "seed")
    reads = read_while(writers(root, ["w"], 15), root)
    assert reads > 0
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"w-14"}
    assert storage.read_metadata(root, DATASET, DAY) == {"token": "w-14"}
    # Republished faster than the grace: every version published is still whole (a reader that resolved any of
    # them can finish it); the marker names the newest.
    kept = versions(root)
    assert len(kept) == 16 and current(root) == max(kept), kept
    assert_whole(root, kept)
    # The first publish after the grace leaves the version it replaced and its own, nothing else.
    kept = tidy_after_the_grace(root, monkeypatch)
    assert storage.list_names(storage.partition(root, DATASET, DAY)) == [storage.MARKER, *kept]
    assert json.loads(storage.read_text(storage.join(storage.partition(root, DATASET, DAY), storage.MARKER))).keys() \
        == {"published", "version"}


def test_concurrent_writers_leave_one_of_them_whole_and_nothing_else(root: str, monkeypatch: pytest.MonkeyPatch):
    publish(root, "seed")
    assert read_while(writers(root, ["a", "b"], 8), root) > 0
    table = storage.read_table(root, DATASET, DAY)
    assert table.num_rows == FILES * ROWS and tokens(table) <= {"a-7", "b-7"} and len(tokens(table)) == 1
    kept = versions(root)
    assert current(root) in kept and len(kept) <= 17, kept  # the seed and the 16 publishes at most, every one whole
    assert_whole(root, kept)
    assert_whole(root, tidy_after_the_grace(root, monkeypatch))


def test_a_writer_stalled_before_its_switch_never_moves_the_marker_back(root: str, monkeypatch: pytest.MonkeyPatch):
    # The race a plain PUT could not close: writer "stalled" reads the marker, then stalls while "late" (a newer
    # version) and "later" publish; its switch is an S3 conditional PUT, refused since the marker changed: it reads
    # again, steps aside, and the marker stays on the newest version, whose folder is whole.
    publish(root, "seed")
    put_marker = storage.publishing._put_marker
    answers = []

    def stall_once(path: str, text: str, tag: str | None) -> bool:
        if not answers:
            answers.append(None)
            publish(root, "late")
            publish(root, "later")
        answers.append(put_marker(path, text, tag))
        return answers[-1]

    monkeypatch.setattr(storage.publishing, "_put_marker", stall_once)
    publish(root, "stalled")  # its version id is the oldest of the three: taken when it started
    # late's and later's switches went through; then the stalled one's conditional PUT was refused (and not tried
    # again: the marker it read again names a newer version).
    assert answers == [None, True, True, False]
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"later"}
    part = storage.partition(root, DATASET, DAY)
    kept = versions(root)
    # later, late kept for its readers and the seed for the grace; the stalled writer's folder is gone.
    assert current(root) == max(kept) and len(kept) == 3, kept
    for name in kept:
        assert len(storage.glob(storage.join(part, name), "*.parquet")) == FILES


def test_a_failed_publish_leaves_the_previous_version_and_removes_its_own_folder(root: str):
    publish(root, "one")
    before = versions(root)
    with pytest.raises(RuntimeError, match="the writer died"):
        with storage.write_partition(root, DATASET, DAY) as staging:
            assert staging.startswith(storage.join(storage.partition(root, DATASET, DAY), storage.VERSION_PREFIX))
            storage.write_bytes(storage.join(staging, "part-00000.parquet"), b"half a file")
            # Not visible while it is written: readers still read the complete old version.
            assert tokens(storage.read_table(root, DATASET, DAY)) == {"one"}
            raise RuntimeError("the writer died")
    assert versions(root) == before
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"one"}
    assert storage.complete_days(root, DATASET) == [DAY]


def test_a_pinned_partition_keeps_reading_its_version_after_a_rebuild(
    root: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    publish(root, "one")
    pin = storage.pin_partition(root, DATASET, DAY, str(tmp_path / "pins"))
    assert pin.frozen and pin.location == storage.join(pin.source, current(root))
    assert not (tmp_path / "pins").exists()  # nothing copied
    run = storage.InputPins.of(root, {DATASET: {DAY: pin.to_dict()}})  # the root as the run reads it
    files = storage.data_files(run, DATASET, DAY)
    publish(root, "two")  # a rebuild during the run
    assert storage.is_complete(run, DATASET, DAY)
    assert storage.data_files(run, DATASET, DAY) == files
    assert tokens(storage.read_table(run, DATASET, DAY)) == {"one"}
    assert storage.read_metadata(run, DATASET, DAY) == {"token": "one"}
    with storage.parquet_file(files[0], run) as parquet:
        assert parquet.read().num_rows == ROWS
    assert storage.pins_intact({DATASET: {DAY: pin.to_dict()}})

    publish(root, "three")  # two publishes old, within the grace: still there
    assert tokens(storage.read_table(run, DATASET, DAY)) == {"one"}
    assert storage.pins_intact({DATASET: {DAY: pin.to_dict()}})

    monkeypatch.setattr(storage.publishing, "SUPERSEDED_GRACE_SECONDS", 0.0)
    publish(root, "four")  # after the grace: the pinned version is removed
    for read in (storage.data_files, storage.read_table, storage.read_metadata):
        with pytest.raises(DataError, match=rf"{DATASET} partition ds={DAY} .* version folder was removed"):
            read(run, DATASET, DAY)
    with pytest.raises(DataError, match="start a new run of the training"):
        with storage.parquet_file(files[0], run):
            pass
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"four"}


def test_partitions_with_a_plain_marker_are_read_as_before_and_replaced_by_versions(
    root: str, s3: Any, monkeypatch: pytest.MonkeyPatch
):
    part = storage.partition(root, DATASET, DAY)
    # Landed by an upstream producer (or older code): data files, then a marker that names no version.
    for f in range(FILES):
        with storage.open_output(storage.join(part, f"part-{f:05d}.parquet")) as out:
            pq.write_table(pa.table({"token": ["plain"] * ROWS, "f": [f] * ROWS}), out)
    storage.write_json(storage.join(part, storage.METADATA_FILE), {"token": "plain"})
    storage.write_text(storage.join(part, storage.MARKER), "2026-01-02T00:00:00+00:00")
    assert storage.resolve(part) == part
    assert storage.data_files(root, DATASET, DAY) == [storage.join(part, f"part-{f:05d}.parquet") for f in range(FILES)]
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"plain"}
    assert storage.read_metadata(root, DATASET, DAY) == {"token": "plain"}
    pin = storage.pin_partition(root, DATASET, DAY, "unused")
    assert not pin.frozen and pin.location == part  # checked against its ETags when read, as before

    publish(root, "one")  # the plain objects are the version it replaced: kept for readers
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"one"}
    assert len(storage.glob(part, "*.parquet")) == FILES
    publish(root, "two")  # within the grace: kept
    assert len(storage.glob(part, "*.parquet")) == FILES
    monkeypatch.setattr(storage.publishing, "SUPERSEDED_GRACE_SECONDS", 0.0)
    publish(root, "two")  # after it: removed
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"two"}
    assert storage.glob(part, "*.parquet") == [] and not storage.exists(storage.join(part, storage.METADATA_FILE))
    assert len(versions(root)) == 2


def test_folders_without_a_marker_and_shard_copies(root: str):
    # A report folder (no marker) is written in place, as before.
    folder = storage.join(root, "reports", "x")
    with storage.publish(folder, marker=None) as staging:
        assert staging == folder
        storage.write_text(storage.join(staging, "a.txt"), "1")
    assert storage.list_names(folder) == ["a.txt"]
    # copy_file copies server-side into the version folder being published.
    source = storage.join(root, "staging", "part-00000.parquet")
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"token": ["copied"] * ROWS, "f": [0] * ROWS}), sink)
    storage.write_bytes(source, sink.getvalue().to_pybytes())
    with storage.write_partition(root, DATASET, DAY) as staging:
        storage.copy_file(source, storage.join(staging, "part-00000.parquet"))
    assert tokens(storage.read_table(root, DATASET, DAY)) == {"copied"}
    # When a folder was last written (what tells an abandoned sharded build from a running one).
    written = storage.last_modified(storage.join(root, "staging"))
    assert written is not None and abs(written - time.time()) < 600
    assert storage.last_modified(storage.join(root, "nothing-here")) is None


def test_a_quarantined_versioned_partition_stays_whole_and_readable(root: str):
    from features.validation.report import content_fingerprint, quarantine_partition

    raw = "raw/events"
    with storage.write_partition(root, raw, DAY) as staging:
        with storage.open_output(storage.join(staging, "part-00000.parquet")) as out:
            pq.write_table(pa.table({"token": ["q"] * ROWS}), out)
    part = storage.partition(root, raw, DAY)
    fingerprint = content_fingerprint(part)
    time.sleep(0.01)
    record = quarantine_partition(root, "events", DAY)
    assert not storage.is_complete(root, raw, DAY) and not storage.is_dir(part)
    data = storage.join(record, "data")
    # The published version's files, directly in data/ under a plain marker: as a local root's record.
    assert storage.list_names(data) == [storage.MARKER, "part-00000.parquet"] and storage.resolve(data) == data
    assert storage.marker_version(storage.read_text(storage.join(data, storage.MARKER))) is None
    files = storage.glob(data, "*.parquet")
    assert tokens(storage.read_parquet(files[0])) == {"q"}
    assert content_fingerprint(data) == fingerprint


def test_a_sharded_build_on_an_object_store_equals_the_unsharded_one(root: str, tmp_path: Path) -> None:
    """Shards published as versions in the staging area, merged (server-side copies) into versioned partitions; the
    second day's window built by the first job's shards from their staged daily aggregates (its window job idle)."""
    from core import contracts
    from core.config import FeaturesConfig
    from features import bucketed_events, build, sharding, spec, step_io
    from features.synthetic import WorldConfig, generate_world

    local = tmp_path / "local"
    generate_world(local, WorldConfig(start=DAY, days=2, users=30, pins=40, seed=4, active_rate=0.9))
    storage.copy_tree(str(local / "raw"), storage.join(root, "raw"))
    features = FeaturesConfig(window_days=2, sequence_length=5)
    engine = step_io.DuckDBSettings(threads=1, memory_limit="512MB")
    settings = build.recorded_settings(features, skip_validation=True)
    for day in storage.day_range(DAY, storage.shift_ds(DAY, 1)):
        bucketed_events.write_event_buckets(root, day, 4, engine=engine)
        for step in spec.DAY_JOBS:
            build.build_step(local, day, step, features, require_validation=False, engine=engine)
            if step == "window" and build.window_built_by_group(root, day, settings):
                continue
            staging = storage.join(root, "_staging", step, day)
            for index in range(2):
                build.build_step(root, day, step, features, require_validation=False, engine=engine,
                                 shard=sharding.Shard(index, 2, staging))
            build.merge_shards(root, day, step, staging, 2)
            assert not storage.exists(staging)
    day = storage.shift_ds(DAY, 1)
    assert storage.read_metadata(root, contracts.PIN_WINDOW, day)["staged_day"]
    assert not storage.read_metadata(root, contracts.PIN_WINDOW, DAY).get("staged_day")  # the first day: a full sum
    for dataset, key in ((contracts.USER_WINDOW, "user_id"), (contracts.PIN_WINDOW, "pin_id"),
                         (contracts.USER_SEQUENCE, "user_id"), (contracts.EXAMPLES, "impression_id")):
        expected = storage.read_table(local, dataset, day).sort_by(key)
        assert storage.read_table(root, dataset, day).sort_by(key).equals(expected), dataset
        assert storage.resolve(storage.partition(root, dataset, day)) != storage.partition(root, dataset, day)
        assert len(storage.data_files(root, dataset, day)) == 2
