"""The MLflow UI of the embedded default (``scripts/mlflow_ui.py``, started by ``make airflow``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def test_the_mlflow_ui_serves_the_platforms_store_and_stops_with_its_whole_group(tmp_path):
    """`make airflow` starts scripts/mlflow_ui.py beside Airflow (the runs' "MLflow run" links point at it) and
    stops it on exit: a real mlflow server on a free port, then SIGTERM, then no process of it left."""
    import signal
    import socket
    import sys
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PINFLOW_HOME": str(tmp_path / "home")}
    env.pop("PINFLOW_MLFLOW__TRACKING_URI", None)
    shm = Path("/dev/shm")
    folders_before = {d for d in shm.iterdir() if d.is_dir()} if shm.is_dir() else set()
    ui = subprocess.Popen([sys.executable, "scripts/mlflow_ui.py", "--port", str(port)], cwd=REPO, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, answer = time.monotonic() + 90, b""
        while time.monotonic() < deadline and ui.poll() is None and answer != b"OK":
            try:
                answer = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            except OSError:
                time.sleep(0.5)
        assert answer == b"OK", ui.stdout.read() if ui.poll() is not None else "no answer in 90 s"
        assert (tmp_path / "home" / "mlflow" / "mlflow.db").exists()  # the platform's store (sqlite under home)
    finally:
        ui.send_signal(signal.SIGTERM)
        ui.wait(timeout=30)
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", str(tmp_path / "home")], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the MLflow UI left behind: {left}"
    # Nor a folder: MLflow's server-side jobs are off (with them each start left their queue's folder in /dev/shm).
    made = ({d for d in shm.iterdir() if d.is_dir()} - folders_before) if shm.is_dir() else set()
    assert not made, f"the MLflow UI left folders in /dev/shm: {sorted(map(str, made))}"
