"""`make demo` stopped while its training job runs (SIGTERM: `kill`, or `make` itself stopped): the job is cancelled,
the demo exits saying so, and nothing is retried. Before, Airflow's task runner took the SIGTERM for the task alone:
the job was cancelled, then retried, and the demo went on."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def processes_naming(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and text in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def stop_everything(demo: subprocess.Popen, jobs: Path) -> None:
    """Whatever the test's outcome, no process of it stays: the demo, and its jobs' nodes (process groups of their
    own)."""
    if demo.poll() is None:
        os.killpg(demo.pid, signal.SIGKILL)
        demo.wait()
    for request in jobs.glob("*/request.json"):
        for pid in json.loads(request.read_text()).get("pids", []):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.e2e
def test_sigterm_stops_the_demo_and_cancels_its_training_job_without_a_retry(airflow_db, tmp_path):
    home = tmp_path / "home"
    (home / "airflow").mkdir(parents=True)
    with sqlite3.connect(airflow_db) as source, sqlite3.connect(home / "airflow" / "airflow.db") as copy:
        source.backup(copy)  # the session's migrated metadata database (with the runs of earlier tests): a home of its own
    history_url = f"sqlite:///{home / 'job_history.db'}"
    env = {**os.environ, "PINFLOW_HOME": str(home), "AIRFLOW_HOME": str(home / "airflow"),
           "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow' / 'airflow.db'}",
           "PINFLOW_JOB_HISTORY__URL": history_url,
           "PINFLOW_TRAINING__PROCS_PER_NODE": "2", "PINFLOW_TRAINING__BATCH_SIZE": "128",
           "PINFLOW_TRAINING__MIN_STEPS": "0", "PINFLOW_TRAINING__PREFLIGHT": "false",
           "PINFLOW_TRAINING__POLL_SECONDS": "1", "PINFLOW_FEATURES__POLL_SECONDS": "0.5"}
    out = tmp_path / "terminal.txt"
    with out.open("w") as terminal:
        demo = subprocess.Popen(
            [sys.executable, str(REPO / "scripts" / "demo.py"), "--days", "3", "--users", "60", "--pins", "100",
             "--impressions-per-user", "10", "--train-days", "2", "--epochs", "100", "--no-quality-check"],
            env=env, stdout=terminal, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        job: dict | None = None
        while job is None and time.monotonic() < deadline and demo.poll() is None:
            requests = list((home / "jobs").glob("train-*/request.json"))
            if requests and processes_naming("training.train"):
                job = json.loads(requests[0].read_text())
            time.sleep(0.2)
        assert job is not None, f"no training job started:\n{out.read_text()}"
        assert processes_naming(job["job_name"]), "the training job runs"

        demo.send_signal(signal.SIGTERM)
        rc = demo.wait(timeout=120)
    finally:
        stop_everything(demo, home / "jobs")
    said = out.read_text()
    assert rc == 128 + signal.SIGTERM, said
    assert "SIGTERM: stopping the demo; cancelling the job of pin_ranker_training.train" in said, said
    assert "stopped (SIGTERM) in pin_ranker_training.train, whose job was cancelled" in said, said
    assert "failed" not in said and "retries" not in said, said  # the stop is not reported as a failure to retry
    assert not processes_naming(job["job_name"]), "every process of the cancelled job has stopped"
    assert [p.name for p in (home / "jobs").glob("train-*")] == [Path(job["job_dir"]).name], "no retry was submitted"

    with sqlite3.connect(home / "job_history.db") as db:
        rows = db.execute("SELECT job_name, state, reason FROM pinflow_job_history WHERE job_name LIKE 'train-%'").fetchall()
    assert rows == [(job["job_name"], "CANCELLED", "the demo was stopped (SIGTERM)")]
    with sqlite3.connect(home / "airflow" / "airflow.db") as db:
        trains = db.execute("SELECT state, try_number FROM task_instance WHERE dag_id = 'pin_ranker_training' AND "
                            "task_id = 'train' AND run_id = 'demo__2026-11-03__pin_ranker'").fetchall()
    assert trains == [("up_for_retry", 1)], trains  # what Airflow made of the cancelled job; its retry never ran
