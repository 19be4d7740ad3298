"""A backfill through Airflow equals the days built one by one.

Starts a private Airflow (SQLite metadata database, LocalExecutor): the DAG processor, the scheduler and
the API server's execution API that task processes report to, as subprocesses of this test. Creates
``airflow backfill create --dag-id pin_daily_features ... --reprocess-behavior completed`` (Airflow requires a
reprocess behaviour for a DAG with ``depends_on_past`` tasks) over three days of a fresh synthetic world, with
three runs active at once, waits for the runs (bounded), stops what it started, and compares every
feature partition with a day-by-day build of the same raw data by row checksums.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from features import build
from features.storage import day_range, read_metadata, read_table, shift_ds
from features.synthetic import WorldConfig, generate_world

REPO = Path(__file__).resolve().parents[2]
START = "2026-11-01"
DAYS = day_range(START, shift_ds(START, 2))
DAG_ID = "pin_daily_features"
# Short window and sequences, and downsampling, so that each of them shows in three days.
FEATURES = {"window_days": 2, "sequence_length": 4, "negative_downsample": 0.5, "negative_downsample_seed": 3}
OUTPUTS = build.OUTPUTS
RUNS_TIMEOUT_S = 1200


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def row_checksum(root: Path, dataset: str, ds: str) -> tuple[int, str]:
    """Rows and an order-independent digest of their values."""
    rows = sorted(repr(sorted(row.items())) for row in read_table(root, dataset, ds).to_pylist())
    return len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest()


class Airflow:
    """A private Airflow installation whose services run as subprocesses of the test."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.port = free_port()
        airflow_home = home / "airflow"
        airflow_home.mkdir(parents=True)
        self.db = airflow_home / "airflow.db"
        self.env = {
            **os.environ,
            "PINFLOW_HOME": str(home),
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "3",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db}",
            # Four processes write to one SQLite file: wait for its lock (sqlite3 gives up after 5 s).
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS": "pinflow_test_sqlite.CONNECT_ARGS",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(home), os.environ.get("PYTHONPATH")])),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
            # Only the backfill's runs: no run of the latest interval when the DAG is unpaused.
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "GX_ANALYTICS_ENABLED": "False",
            "PINFLOW_VALIDATION__SENSOR_POKE_SECONDS": "5",
            **{f"PINFLOW_FEATURES__{k.upper()}": str(v) for k, v in FEATURES.items()},
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        (home / "pinflow_test_sqlite.py").write_text("CONNECT_ARGS = {'timeout': 60}\n")

    def migrate(self) -> None:
        """Create the metadata database, in WAL mode: readers then never block the scheduler's writes."""
        self.cli("db", "migrate", timeout=600)
        with sqlite3.connect(self.db) as con:
            con.execute("PRAGMA journal_mode=WAL")

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [sys.executable, "-m", "airflow", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"airflow {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc

    def start(self, name: str, *args: str) -> None:
        log = (self.home / f"{name}.log").open("wb")
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "airflow", name, *args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    def stop(self) -> None:
        """SIGTERM each service's process group (they were started in their own sessions), then SIGKILL."""
        for proc in self.processes.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for proc in self.processes.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def query(self, sql: str, *params: object) -> list[tuple[object, ...]]:
        with sqlite3.connect(self.db, timeout=30) as con:
            return con.execute(sql, params).fetchall()

    def diagnostics(self) -> str:
        parts = [f"--- {name}.log ---\n{(self.home / f'{name}.log').read_text(errors='replace')[-3000:]}"
                 for name in self.processes]
        failed = self.query(
            "SELECT run_id, task_id, state FROM task_instance WHERE state NOT IN ('success') ORDER BY run_id"
        )
        parts.append(f"--- task instances not successful ---\n{failed}")
        for log in sorted((self.home / "airflow" / "logs").rglob("*.log"))[-4:]:
            parts.append(f"--- {log} ---\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)

    def wait(self, what: str, done: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                assert proc.poll() is None, f"airflow {name} exited with {proc.returncode}\n{self.diagnostics()}"
            if done():
                return
            time.sleep(3)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.diagnostics()}")


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[tuple[object, ...]]]]:
    home = tmp_path_factory.mktemp("backfill")
    airflow = Airflow(home)
    storage = home / "storage"
    generate_world(storage, WorldConfig(start=START, days=len(DAYS), users=40, pins=60, seed=3, active_rate=0.9))
    airflow.migrate()
    try:
        airflow.start("dag-processor")
        airflow.start("scheduler")
        airflow.start("api-server", "--apps", "execution", "--workers", "1")
        airflow.wait(
            f"the DAG processor to serialize {DAG_ID}",
            lambda: airflow.query("SELECT count(*) FROM serialized_dag WHERE dag_id = ?", DAG_ID)[0][0] > 0,
            timeout=300,
        )
        airflow.cli("dags", "unpause", DAG_ID)
        airflow.cli(
            "backfill", "create", "--dag-id", DAG_ID, "--from-date", DAYS[0], "--to-date", DAYS[-1],
            "--max-active-runs", str(len(DAYS)),
            # Required by Airflow for a DAG with depends_on_past tasks; on a fresh root nothing exists yet.
            "--reprocess-behavior", "completed",
        )

        def finished() -> bool:
            states = airflow.query("SELECT state FROM dag_run WHERE dag_id = ? AND run_type = 'backfill'", DAG_ID)
            return len(states) == len(DAYS) and all(s in ("success", "failed") for (s,) in states)

        airflow.wait(f"{len(DAYS)} backfill runs", finished, timeout=RUNS_TIMEOUT_S)
        runs = airflow.query(
            "SELECT logical_date, state FROM dag_run WHERE dag_id = ? AND run_type = 'backfill' ORDER BY logical_date",
            DAG_ID,
        )
        assert [state for _, state in runs] == ["success"] * len(DAYS), f"{runs}\n{airflow.diagnostics()}"
        yield storage, runs
    finally:
        airflow.stop()


@pytest.mark.e2e
def test_backfill_equals_day_by_day_build(backfilled: tuple[Path, list[tuple[object, ...]]], tmp_path: Path) -> None:
    storage, runs = backfilled
    assert [str(logical_date)[:10] for logical_date, _ in runs] == DAYS

    reference = tmp_path / "day-by-day"
    for dataset in ("raw/events", "raw/pins", "raw/users"):
        shutil.copytree(storage / dataset, reference / dataset)
    for day in DAYS:
        build.build_day(
            reference, day, window_days=FEATURES["window_days"], sequence_length=FEATURES["sequence_length"],
            negative_downsample=FEATURES["negative_downsample"], seed=FEATURES["negative_downsample_seed"],
        )

    for day in DAYS:
        for dataset in OUTPUTS:
            assert row_checksum(storage, dataset, day) == row_checksum(reference, dataset, day), (dataset, day)
        # Each day after the first extended the sequences of the day before (depends_on_past ordered them).
        mode = read_metadata(storage, build.USER_SEQUENCE_DS, day)["mode"]
        assert mode == ("full" if day == DAYS[0] else "incremental"), (day, mode)
        assert read_metadata(storage, build.EXAMPLES_DS, day)["negative_downsample"] == 0.5
