"""The MLflow UI of the embedded default, beside ``make airflow``: an ``mlflow server`` over the platform's tracking
store (``mlflow.tracking_uri``, SQLite under PINFLOW_HOME) and artifacts, on ``--host``/``--port``, where the
training runs' "MLflow run" links point (``mlflow.ui_url``, which the Makefile sets to the same port).

    .venv/bin/python scripts/mlflow_ui.py --port 5000        # what `make airflow` runs (MLFLOW_PORT moves it)

A tracking URI that is already a server (http...) is its own UI: this says so and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def server_command(host: str, port: int) -> list[str] | None:
    """The ``mlflow server`` command over the platform's store; None where the tracking URI is a server."""
    from core import config

    mlflow = config.load().mlflow
    if mlflow.tracking_uri.startswith(("http://", "https://", "databricks")):
        return None
    if mlflow.tracking_uri.startswith("sqlite:///"):
        Path(mlflow.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", mlflow.tracking_uri,
               "--host", host, "--port", str(port), "--workers", "1"]
    if mlflow.artifact_root:
        command += ["--default-artifact-root", mlflow.artifact_root]
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=5000)
    args = parser.parse_args(argv)
    command = server_command(args.host, args.port)
    if command is None:
        from core import config

        print(f"mlflow.tracking_uri is a tracking server ({config.load().mlflow.tracking_uri}): its own UI serves the "
              "runs; set mlflow.ui_url to it", flush=True)
        return 0
    print(f"MLflow UI on http://{args.host}:{args.port} over {command[3]}", flush=True)
    # In a session of its own: mlflow server runs its web server as a child process, and stopping this script
    # (make airflow's exit, SIGTERM, Ctrl-C) stops the whole group, leaving nothing behind. The handlers only ask;
    # the stopping is done here (a handler that waited would wait inside this wait).
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda number, _frame: stopping.append(number))
    # Without MLflow's server-side jobs (GenAI evaluation, scorers; pinflow runs none): with them, every start makes a
    # folder in /dev/shm for their queue that nothing removes.
    server = subprocess.Popen(command, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    while server.poll() is None and not stopping:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)  # its web server too, also when mlflow itself ended first
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    return 0 if stopping else int(server.returncode or 0)

if __name__ == "__main__":
    sys.exit(main())
