"""Backfills through Airflow, while the scheduler runs: nothing lost, and the same rows as the days built one by one.

Starts a private Airflow (SQLite metadata database, LocalExecutor): the DAG processor, the scheduler, the triggerer
(where the build tasks wait for their jobs) and the API server (REST API and the execution API that task processes
report to), as subprocesses of this test. Then, as a
data engineer would:

1. ``airflow backfill create --dag-id pin_daily_features ... --reprocess-behavior completed`` over the first two
   days of a fresh synthetic world (Airflow requires a reprocess behaviour for a DAG with ``depends_on_past``
   tasks);
2. ``POST /api/v2/backfills`` (what the UI's Backfill dialog sends) over all three days, taking over the two
   existing runs, while another connection commits to the metadata database every few milliseconds as a busy
   scheduler does (without ``services/metadata_db.py`` that fails at once with ``database is locked`` and can
   delete the runs it took over);

3. triggers a run of today (its day's raw data never comes) with a deadline of 1.8 s (``deadlines.features_built_h``):
   the scheduler finds it missed and the triggerer runs pinflow's callback, which records it and tells the
   configured notifier (a test notifier writing a file); every backfill run missed the same deadline by days and
   is ignored;

waits for the runs (bounded), stops what it started, and compares every feature partition with a day-by-day
build of the same raw data by row checksums.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from core import contracts
from core.storage import day_range, read_metadata, read_table, shift_ds
from features import build
from features.synthetic import WorldConfig, generate_world

REPO = Path(__file__).resolve().parents[2]
START = "2026-11-01"
DAYS = day_range(START, shift_ds(START, 2))
CLI_DAYS = DAYS[:2]
DAG_ID = "pin_daily_features"
# Short window and sequences, and downsampling, so that each of them shows in three days.
FEATURES = {"window_days": 2, "sequence_length": 4, "negative_downsample": 0.5, "negative_downsample_seed": 3}
OUTPUTS = contracts.FEATURE_OUTPUTS
RUNS_TIMEOUT_S = 1200
DEADLINE_H = 0.0005  # 1.8 s after a run's logical date: every run misses it


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
        self.url = f"http://127.0.0.1:{self.port}"
        airflow_home = home / "airflow"
        airflow_home.mkdir(parents=True)
        self.db = airflow_home / "airflow.db"
        self.env = {
            **os.environ,
            "PINFLOW_HOME": str(home),
            "AIRFLOW_HOME": str(airflow_home),
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            # Also where Airflow finds plugins/airflow_local_settings.py (the SQLite settings under test).
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "3",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__CORE__UNIT_TEST_MODE": "False",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.db}",
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(16),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            # Only the backfills' runs: no run of the latest interval when the DAG is unpaused.
            "AIRFLOW__SCHEDULER__USE_JOB_SCHEDULE": "False",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "GX_ANALYTICS_ENABLED": "False",
            "PINFLOW_VALIDATION__SENSOR_POKE_SECONDS": "5",
            "PINFLOW_DEADLINES__FEATURES_BUILT_H": str(DEADLINE_H),
            "PINFLOW_DEADLINES__NOTIFIER": "file_notifier.FileNotifier",
            "PINFLOW_DEADLINES__NOTIFIER_KWARGS__PATH": str(home / "notified.txt"),
            "PINFLOW_DEADLINES__NOTIFIER_KWARGS__TEXT": "{{ dag_run.dag_run_id }} missed {{ pinflow_deadline.name }}",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests" / "notifiers"), os.environ.get("PYTHONPATH")])),
            **{f"PINFLOW_FEATURES__{k.upper()}": str(v) for k, v in FEATURES.items()},
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

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

    def api(self, method: str, path: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
        """One call of the REST API as the admin user of the simple auth manager; (status, JSON body)."""
        headers = {"Content-Type": "application/json"}
        if not path.startswith("/auth/"):
            headers["Authorization"] = f"Bearer {self.token()}"
        request = urllib.request.Request(
            self.url + path, method=method, headers=headers, data=json.dumps(body).encode() if body else None
        )
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, {"detail": error.read().decode(errors="replace")}

    def token(self) -> str:
        passwords = json.loads((self.home / "airflow" / "simple_auth_manager_passwords.json.generated").read_text())
        status, body = self.api("POST", "/auth/token", {"username": "admin", "password": passwords["admin"]})
        assert status == 201, body
        return str(body["access_token"])

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

    def backfill_finished(self, backfill_id: int, days: int) -> bool:
        states = self.query("SELECT state FROM dag_run WHERE backfill_id = ?", backfill_id)
        return len(states) == days and all(s in ("success", "failed") for (s,) in states)


class BusyNeighbour(threading.Thread):
    """Commits a row to the metadata database every few milliseconds, as a busy scheduler commits its loops."""

    def __init__(self, db: Path) -> None:
        super().__init__(daemon=True)
        self.db, self.commits, self.stopping = db, 0, threading.Event()
        with sqlite3.connect(db, timeout=60) as con:
            con.execute("CREATE TABLE IF NOT EXISTS pinflow_test_neighbour (at REAL)")

    def run(self) -> None:
        con = sqlite3.connect(self.db, timeout=60)
        while not self.stopping.is_set():
            con.execute("INSERT INTO pinflow_test_neighbour VALUES (?)", (time.time(),))
            con.commit()
            self.commits += 1
            time.sleep(0.002)
        con.close()

    def __enter__(self) -> BusyNeighbour:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.join(timeout=60)


@dataclasses.dataclass
class Backfilled:
    storage: Path
    runs_before_api: list[tuple[object, ...]]  # (id, run_id, logical_date) after the CLI backfill
    api_status: int
    api_body: dict[str, object]
    neighbour_commits: int
    backfill_days: list[tuple[object, ...]]  # backfill_dag_run rows of the API's backfill
    runs_after: list[tuple[object, ...]]  # (id, run_id, logical_date, state, backfill_id) when all ended
    announced: list[object]  # the announce_examples task's states
    examples_events: int  # pinflow_examples asset events (what starts training)
    late_run_id: str  # the run of today that missed its deadline
    deadline_misses: list[tuple[object, ...]]  # (run_id, run_type, deadline, notified) recorded
    notified: list[str]  # what the notifier was told


@pytest.fixture(scope="module")
def backfilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backfilled]:
    home = tmp_path_factory.mktemp("backfill")
    airflow = Airflow(home)
    storage = home / "storage"
    generate_world(storage, WorldConfig(start=START, days=len(DAYS), users=40, pins=60, seed=3, active_rate=0.9))
    airflow.cli("db", "migrate", timeout=600)
    try:
        airflow.start("dag-processor")
        airflow.start("scheduler")
        airflow.start("triggerer")  # the feature build tasks wait for their jobs there
        airflow.start("api-server", "--apps", "core,execution", "--workers", "1")
        airflow.wait(
            f"the DAG processor to serialize {DAG_ID}",
            lambda: airflow.query("SELECT count(*) FROM serialized_dag WHERE dag_id = ?", DAG_ID)[0][0] > 0,
            timeout=300,
        )
        airflow.cli("dags", "unpause", DAG_ID)
        airflow.cli(
            "backfill", "create", "--dag-id", DAG_ID, "--from-date", CLI_DAYS[0], "--to-date", CLI_DAYS[-1],
            "--max-active-runs", str(len(CLI_DAYS)),
            # Required by Airflow for a DAG with depends_on_past tasks; on a fresh root nothing exists yet.
            "--reprocess-behavior", "completed",
        )
        (cli_backfill,) = airflow.query("SELECT id FROM backfill WHERE dag_id = ?", DAG_ID)[0]
        airflow.wait(f"{len(CLI_DAYS)} CLI backfill runs",
                     lambda: airflow.backfill_finished(int(cli_backfill), len(CLI_DAYS)), timeout=RUNS_TIMEOUT_S)
        # Airflow allows one active backfill per DAG: the scheduler closes this one once its runs ended.
        airflow.wait("the CLI backfill to be marked complete",
                     lambda: airflow.query("SELECT completed_at FROM backfill WHERE id = ?", cli_backfill)[0][0]
                     is not None, timeout=120)
        runs_before = airflow.query("SELECT id, run_id, logical_date FROM dag_run WHERE dag_id = ? ORDER BY id",
                                    DAG_ID)

        airflow.api("GET", "/api/v2/version")  # the API server answers before the neighbour starts
        with BusyNeighbour(airflow.db) as neighbour:
            status, body = airflow.api("POST", "/api/v2/backfills", {
                "dag_id": DAG_ID, "from_date": f"{DAYS[0]}T00:00:00Z", "to_date": f"{DAYS[-1]}T00:00:00Z",
                "reprocess_behavior": "completed", "max_active_runs": len(DAYS),
            })
        if status == 200:
            airflow.wait(f"{len(DAYS)} API backfill runs",
                         lambda: airflow.backfill_finished(int(body["id"]), len(DAYS)),  # type: ignore[call-overload]
                         timeout=RUNS_TIMEOUT_S)
        backfill_days = airflow.query(
            "SELECT logical_date, dag_run_id, exception_reason FROM backfill_dag_run WHERE backfill_id = ? "
            "ORDER BY logical_date", body.get("id"))
        runs_after = airflow.query(
            "SELECT id, run_id, logical_date, state, backfill_id FROM dag_run WHERE dag_id = ? ORDER BY id", DAG_ID)
        announced = [state for (state,) in airflow.query(
            "SELECT state FROM task_instance WHERE dag_id = ? AND task_id = 'announce_examples'", DAG_ID)]
        examples_events = airflow.query(
            "SELECT count(*) FROM asset_event e JOIN asset a ON a.id = e.asset_id WHERE a.name = 'pinflow_examples'"
        )[0][0]

        # A run of today, whose raw data never comes: it misses its 1.8 s deadline while its sensors wait.
        status_late, late = airflow.api("POST", f"/api/v2/dags/{DAG_ID}/dagRuns",
                                        {"logical_date": dt.datetime.now(dt.UTC).isoformat(), "conf": {}})
        assert status_late == 200, late
        history = home / "jobdata" / "job_history.db"
        airflow.wait("the late run's deadline miss to be recorded", lambda: history.exists() and bool(
            sqlite3.connect(history, timeout=30).execute("SELECT count(*) FROM pinflow_deadline_misses").fetchone()[0]),
            timeout=300)
        with sqlite3.connect(history, timeout=30) as con:
            misses = con.execute("SELECT run_id, run_type, deadline, notified FROM pinflow_deadline_misses").fetchall()
        yield Backfilled(
            storage=storage, runs_before_api=runs_before, api_status=status, api_body=body,
            neighbour_commits=neighbour.commits, backfill_days=backfill_days, runs_after=runs_after,
            announced=announced, examples_events=examples_events, late_run_id=str(late["dag_run_id"]),
            deadline_misses=misses,
            notified=(home / "notified.txt").read_text().splitlines() if (home / "notified.txt").exists() else [],
        )
    finally:
        airflow.stop()


@pytest.mark.e2e
def test_api_backfill_while_scheduler_commits_keeps_every_run(backfilled: Backfilled) -> None:
    assert backfilled.api_status == 200, backfilled.api_body
    assert backfilled.neighbour_commits > 0
    # The runs that existed before are all still there, taken over by the new backfill; one run per day.
    before = {run_id: (run, day) for run, run_id, day in backfilled.runs_before_api}
    assert len(before) == len(CLI_DAYS)
    after = {run_id: (run, day, state, backfill) for run, run_id, day, state, backfill in backfilled.runs_after}
    for run_id, (run, day) in before.items():
        assert run_id in after and after[run_id][:2] == (run, day), (run_id, backfilled.runs_after)
    assert [str(day)[:10] for _, _, day, _, _ in backfilled.runs_after] == DAYS
    assert {backfill for *_, backfill in backfilled.runs_after} == {backfilled.api_body["id"]}
    assert [state for _, _, _, state, _ in backfilled.runs_after] == ["success"] * len(DAYS)
    # A backfill does not start training: its runs announce no examples (issue 34: a 3-day backfill had started
    # two trainings nobody asked for).
    assert backfilled.announced == ["skipped"] * len(DAYS) and backfilled.examples_events == 0
    # The backfill covers every requested day with a run, none skipped.
    assert [(str(day)[:10], reason) for day, _, reason in backfilled.backfill_days] == [(d, None) for d in DAYS]
    assert all(run is not None for _, run, _ in backfilled.backfill_days)


@pytest.mark.e2e
def test_backfill_equals_day_by_day_build(backfilled: Backfilled, tmp_path: Path) -> None:
    storage = backfilled.storage
    assert [state for _, _, _, state, _ in backfilled.runs_after] == ["success"] * len(DAYS)

    reference = tmp_path / "day-by-day"
    for dataset in ("raw/events", "raw/pins", "raw/users"):
        shutil.copytree(storage / dataset, reference / dataset)
    for day in DAYS:
        build.build_day(
            reference, day, window_days=FEATURES["window_days"], sequence_length=FEATURES["sequence_length"],
            negative_downsample=FEATURES["negative_downsample"], seed=FEATURES["negative_downsample_seed"],
            require_validation=False,  # a copy of the raw data the DAG validated, without its reports
        )

    for day in DAYS:
        for dataset in OUTPUTS:
            assert row_checksum(storage, dataset, day) == row_checksum(reference, dataset, day), (dataset, day)
        # Each day after the first extended the sequences of the day before (depends_on_past ordered them).
        mode = read_metadata(storage, contracts.USER_SEQUENCE, day)["mode"]
        assert mode == ("full" if day == DAYS[0] else "incremental"), (day, mode)
        assert read_metadata(storage, contracts.EXAMPLES, day)["negative_downsample"] == 0.5


@pytest.mark.e2e
def test_a_missed_deadline_is_recorded_and_notified_and_backfills_are_not_late(backfilled: Backfilled) -> None:
    # Every backfill run's deadline passed days before the run was made: ignored, not recorded, nobody told.
    assert backfilled.deadline_misses == [(backfilled.late_run_id, "manual", "features built",
                                           "file_notifier.FileNotifier")], backfilled.deadline_misses
    assert backfilled.notified == [f"{backfilled.late_run_id} missed features built"]
