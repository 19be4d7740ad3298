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
    monkeypatch.setattr(storage, "_exchange", lambda a, b: False)
    final = tmp_path / "ds=2026-01-01"
    for token in ("one", "two"):
        with storage.publish(str(final)) as staging:
            storage.write_text(storage.join(staging, "x.txt"), token)
    assert (final / "x.txt").read_text() == "two"
    assert os.listdir(tmp_path) == ["ds=2026-01-01"]
