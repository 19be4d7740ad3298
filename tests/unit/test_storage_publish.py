"""core.storage.publish on a local root: concurrent writers of one folder and a reader that never finds it missing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from core import storage

REPO = Path(__file__).resolve().parents[2]
FILES = ("a.txt", "b.txt", "c.txt")

# Each writer publishes the folder `rounds` times; every file of one version holds the same token.
WRITER = textwrap.dedent(
    """
    import sys
    from core import storage

    final, writer, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        with storage.publish(final) as staging:
            for name in {files!r}:
                storage.write_text(storage.join(staging, name), f"{{writer}}-{{i}}\\n" * 2000)
    """
).format(files=FILES)


@pytest.mark.unit
def test_two_writers_and_a_reader_see_only_whole_partitions(tmp_path: Path) -> None:
    final = tmp_path / "features" / "user_daily" / "ds=2026-01-01"
    with storage.publish(str(final)) as staging:
        for name in FILES:
            storage.write_text(storage.join(staging, name), "seed-0\n" * 2000)

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(final), w, "40"], env=env, cwd=REPO, stderr=subprocess.PIPE)
        for w in ("w1", "w2")
    ]
    reads = missing = 0
    tokens: set[str] = set()
    while any(w.poll() is None for w in writers) or reads == 0:
        reads += 1
        try:
            # Through a descriptor of the folder: every file read comes from the one version opened.
            fd = os.open(final, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            missing += 1
            continue
        try:
            names = sorted(os.listdir(fd))
            if names != sorted([*FILES, storage.MARKER]):
                continue  # the version opened was replaced and is being removed (never a partial new one)
            contents = set()
            for name in FILES:
                try:
                    with open(os.open(name, os.O_RDONLY, dir_fd=fd)) as f:
                        contents.add(f.read())
                except FileNotFoundError:
                    contents = set()  # removed while read: an old version on its way out
                    break
            if contents:
                assert len(contents) == 1, f"a mixed partition: {[c[:8] for c in contents]}"
                tokens.add(next(iter(contents)).split("\n", 1)[0])
        finally:
            os.close(fd)
    errors = [w.stderr.read().decode() if w.stderr else "" for w in writers]
    assert [w.wait() for w in writers] == [0, 0], errors

    assert missing == 0, f"the partition was missing in {missing} of {reads} reads"
    assert any(t.startswith(("w1", "w2")) for t in tokens)
    # Nothing left behind: no temporary or old copies, no lock file.
    assert os.listdir(final.parent) == ["ds=2026-01-01"]
    last = {(final / name).read_text() for name in FILES}
    assert len(last) == 1 and next(iter(last)).split("\n", 1)[0] in {"w1-39", "w2-39"}


@pytest.mark.unit
def test_exchange_falls_back_to_a_rename_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(storage.publishing, "_exchange", lambda a, b: False)
    final = tmp_path / "ds=2026-01-01"
    for token in ("one", "two"):
        with storage.publish(str(final)) as staging:
            storage.write_text(storage.join(staging, "x.txt"), token)
    assert (final / "x.txt").read_text() == "two"
    assert os.listdir(tmp_path) == ["ds=2026-01-01"]


# Each writer publishes a partition of three Parquet files `rounds` times; every row of one version holds one token.
TABLE_WRITER = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    import pyarrow.parquet as pq
    from core import storage

    root, writer, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for i in range(rounds):
        with storage.write_partition(root, "features/user_daily", "2026-01-01") as staging:
            for f in range(3):
                pq.write_table(pa.table({"token": [f"{writer}-{i}"] * 500}), storage.join(staging, f"part-{f}.parquet"))
    """
)


@pytest.mark.unit
def test_read_table_on_a_local_root_reads_one_whole_version_while_two_writers_republish(tmp_path: Path) -> None:
    import pyarrow as pa

    root = str(tmp_path / "storage")
    storage.write_table(root, "features/user_daily", "2026-01-01", pa.table({"token": ["seed"] * 1500}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writers = [subprocess.Popen([sys.executable, "-c", TABLE_WRITER, root, w, "60"], env=env, stderr=subprocess.PIPE)
               for w in ("w1", "w2")]
    reads, seen = 0, set()
    while any(w.poll() is None for w in writers) or reads == 0:
        table = storage.read_table(root, "features/user_daily", "2026-01-01")  # never missing
        tokens = set(table.column("token").to_pylist())
        assert table.num_rows == 1500 and len(tokens) == 1, f"read {reads}: a mixed partition {sorted(tokens)}"
        seen |= tokens
        reads += 1
    errors = [w.stderr.read().decode() if w.stderr else "" for w in writers]
    assert [w.wait() for w in writers] == [0, 0], errors
    assert len(seen) > 2, seen  # the reads overlapped the publishes


def test_a_publish_removes_the_temporary_folders_killed_writers_left_a_day_ago(tmp_path: Path) -> None:
    import time

    from core.storage.publishing import STALE_TEMPORARY_S

    stale, fresh = tmp_path / ".tmp-ds=2026-01-01-deadbeef", tmp_path / ".tmp-ds=2026-01-01-0badf00d"
    for folder in (stale, fresh):
        (folder / "part-00000.parquet").parent.mkdir()
        (folder / "part-00000.parquet").write_bytes(b"half a file")
    old = time.time() - STALE_TEMPORARY_S - 60
    for entry in (stale / "part-00000.parquet", stale):
        os.utime(entry, (old, old))
    other = tmp_path / ".tmp-ds=2026-01-02-deadbeef"  # another partition's: not this publish's business
    other.mkdir()
    os.utime(other, (old, old))
    with storage.publish(tmp_path / "ds=2026-01-01") as folder:
        Path(folder, "part-00000.parquet").write_bytes(b"whole")
    assert not stale.exists() and fresh.exists() and other.exists()  # a live writer's folder is left alone
    assert (tmp_path / "ds=2026-01-01" / "part-00000.parquet").read_bytes() == b"whole"
