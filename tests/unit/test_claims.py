"""One process at a time per claimed folder (core/claims.py): the demo's home here; checkpoint folders in
test_checkpoint.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core import claims

REPO = Path(__file__).resolve().parents[2]
# Claims ``argv[1]`` as a running process does, says so, and waits to be killed.
_HOLDER = "import sys, time; from core import claims; claims.hold(sys.argv[1]); print('held', flush=True); time.sleep(600)"


@pytest.mark.unit
def test_a_second_demo_in_one_home_stops_at_once_naming_the_first_and_a_killed_ones_claim_is_gone(tmp_path: Path) -> None:
    lock = tmp_path / "home" / "demo.lock"
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, str(lock)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        env = {**os.environ, "PINFLOW_HOME": str(tmp_path / "home")}
        second = subprocess.run([sys.executable, "scripts/demo.py"], capture_output=True, text=True, cwd=REPO, env=env,
                                timeout=120)
        assert second.returncode == 1
        assert f"another demo is running with PINFLOW_HOME={tmp_path / 'home'} (" in second.stdout
        assert f"pid {first.pid}, since " in second.stdout
        assert not {"storage", "demo.log"} & {p.name for p in (tmp_path / "home").iterdir()}  # no world, no runs
        with pytest.raises(claims.Claimed, match=f"pid {first.pid}"):
            claims.hold(str(lock))
    finally:
        first.kill()
        first.wait(timeout=30)
    held = claims.hold(str(lock))  # the kernel dropped the killed process's claim
    assert held is not None
    os.close(held)


@pytest.mark.unit
def test_a_folder_that_cannot_hold_a_claim_warns_and_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder would be
    assert claims.hold(str(blocker / "demo.lock")) is None
    assert "could not claim" in caplog.text
