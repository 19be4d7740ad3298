"""Scratch folders that a SIGKILLed process leaves are removed by the next one (core/scratch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from core import scratch
from features import step_io

# Opens a DuckDB connection spilling into ``argv[1]``, says where, and waits to be killed.
_HOLDER = """
import sys, time
from features import step_io
with step_io.connect(step_io.DuckDBSettings(threads=1, temp_directory=sys.argv[1])) as con:
    print(con.execute("SELECT current_setting('temp_directory')").fetchone()[0], flush=True)
    time.sleep(600)
"""


def _holder(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(parent)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])
    assert proc.stdout is not None
    spill = Path(proc.stdout.readline().strip())
    assert spill.parent == parent and spill.is_dir(), spill
    return proc, spill


def test_a_killed_builds_spill_folder_is_removed_by_the_next_connection_and_a_live_ones_is_kept(tmp_path: Path) -> None:
    killed, left = _holder(tmp_path)
    live, kept = _holder(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert left.is_dir()  # a SIGKILL skips the connection's own cleanup
        other_host = tmp_path / "pinflow-duckdb-elsewhere.1.abcdefgh"  # a shared temp folder: not this host's
        other_host.mkdir()
        with step_io.connect(step_io.DuckDBSettings(threads=1, temp_directory=str(tmp_path))):
            assert not left.exists()
            assert kept.is_dir() and other_host.is_dir()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([kept.name, other_host.name])
    finally:
        live.kill()
        live.wait(timeout=30)
    # The live one's folder goes once it is killed too; the scratch of another prefix is never touched.
    other_prefix = Path(scratch.make_scratch("pinflow-torchrun-", str(tmp_path)))
    assert scratch.remove_abandoned("pinflow-duckdb-", str(tmp_path)) == [str(kept)]
    assert other_prefix.is_dir() and other_prefix.name.startswith(f"pinflow-torchrun-{scratch._host()}.{os.getpid()}.")
