"""pinflow's pages in the Airflow UI, after a small real run, against a real ``airflow api-server``.

One module fixture sets the world up, all at once (what can overlap does: this must stay short on 2 cores):

- ``airflow api-server`` with the plugin, on a free port, with a generated admin password and JWT secret;
- two runs of ``pin_ranker_training`` for one team whose quota is one job (``dag.test()`` in two processes; this
  file is also their driver: ``python test_ui_pages.py run a|b``): real ``torchrun`` jobs on the local backend on a
  tiny world. Run b's job must wait for run a's to end (deferred on the quota trigger), then runs (two steps);
- a day of raw events validated (passes) and a corrupted one (fails, quarantined), with the real validation code
  (``python test_ui_pages.py prep``, which first creates the MLflow store that run a's job then uses);
- each team's pool, by ``python -m operators.quotas sync-pools``'s own ``main`` (what ``make install`` runs).

While run a's job trains and run b's waits, the pages' data and HTML are taken in this process (the same code the
API server runs). Then: the job history rows; the pages' API answers 401 without a token and 200 with one; the
plugin is registered (FastAPI app, external views); every extra link is ``http(s)`` and resolves; and headless
Chromium (Debian's, driven by Playwright) logs in, opens the three pages inside the Airflow UI and finds their
rows and plots. Its screenshots go to a temporary folder, or with ``PINFLOW_SCREENSHOTS=docs`` (``make
screenshots``) to ``docs/``, where docs/using-airflow.md shows them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from core.config import LOCAL_MACHINE
from operators.backends.resources import local_gpus

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
CHROMIUM = "/usr/bin/chromium"
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03"]
RAW_DAYS = ["2026-10-20", "2026-10-21"]  # the data quality page's days (not the training world's)
TEAM = "pages"
# A team of this test's own (no other test's job can hold its quota), with a quota of one job.
TEAM_ENV = {
    "PINFLOW_TEAMS__PAGES__QUEUE": TEAM, "PINFLOW_TEAMS__PAGES__SHARE": TEAM,
    "PINFLOW_TEAMS__PAGES__INSTANCE_TYPE": "g5.12xlarge", "PINFLOW_TEAMS__PAGES__QUOTA__JOBS": "1",
    "PINFLOW_TRAINING__QUOTA_POLL_SECONDS": "1", "PINFLOW_TRAINING__POLL_SECONDS": "0.5",
    "PINFLOW_TRAINING__PREFLIGHT": "false", "OMP_NUM_THREADS": "1",
    "PINFLOW_TRAINING__MIN_STEPS": "0",  # the runs are short on purpose: exactly the epochs asked for
}
# Run a trains long enough to be seen training while run b waits (a sleep per step: no CPU taken from the rest);
# run b, two steps.
OVERRIDES = {
    "a": {"epochs": 2, "batch_size": 32, "max_steps": 30, "heartbeat_every_s": 0.3, "checkpoint_every": 13,
          "debug_step_sleep_s": 0.3},
    "b": {"epochs": 1, "batch_size": 32, "max_steps": 2, "heartbeat_every_s": 0.3},
}
ADMISSION_TIMEOUT_S = 300
pytestmark = pytest.mark.integration


# -- the drivers (run in subprocesses) -----------------------------------------------------------------------
def _wait_until(what: str, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what} after {timeout:.0f}s")
        time.sleep(0.3)


def _announce_run(marker: Path, since: Any) -> None:
    """Touch ``marker`` once this process's dag.test() has created its run (the DAG is in the database then)."""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session
    from sqlalchemy import select

    query = select(DagRun.id).where(DagRun.dag_id == "pin_ranker_training", DagRun.run_after >= since)
    while not marker.exists():
        with create_session() as session:
            if session.scalars(query).first() is not None:
                marker.touch()
                return
        time.sleep(0.3)


def _run(tag: str, scratch: Path) -> dict[str, Any]:
    import datetime as dt
    import threading

    from airflow.dag_processing.dagbag import DagBag

    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    dag = DagBag(dag_folder=str(REPO / "dags" / "pin_ranker_training.py")).dags["pin_ranker_training"]
    train = dag.task_dict["train"]
    train.overrides = {**train.overrides, **OVERRIDES[tag]}  # type: ignore[attr-defined]
    conf = {"team": TEAM, "train_days": 2, "nodes": 1, "procs_per_node": 1, "end_ds": DAYS[-1]}
    if tag == "a":
        # Its job uses the MLflow store the prep process creates (two creating it at once collide): submitted
        # once it exists (dag.test() runs the task in this process).
        from operators.training import DistributedTrainingOperator

        before_submit = DistributedTrainingOperator.before_submit

        def submit_once_mlflow_is_ready(self: Any, context: Any, *args: Any) -> Any:
            _wait_until("the MLflow store", (scratch / "mlflow-ready").exists, ADMISSION_TIMEOUT_S)
            return before_submit(self, context, *args)

        DistributedTrainingOperator.before_submit = submit_once_mlflow_is_ready  # type: ignore[method-assign]
        # What dag.test() imports while it serialises the DAG, imported before the thread starts: the thread's
        # first query configures the ORM mappers (importing every model under SQLAlchemy's configure lock)
        # while this thread, importing airflow.models.dagbag, held that module's import lock and waited for the
        # configure lock: a deadlock, seen twice under load (py-spy showed both stacks).
        from airflow.models import import_all_models
        from airflow.serialization.serialized_objects import DagSerialization
        from sqlalchemy.orm import configure_mappers

        import_all_models()
        DagSerialization.serialize_dag(dag)
        configure_mappers()
        threading.Thread(target=_announce_run, args=(scratch / "run-a-created", since), daemon=True).start()
        dr = dag.test(run_conf=conf)
    else:
        # Its job asks for room once run a's job holds the quota (run a's waits for the MLflow store first: under
        # load run b's would otherwise get there first, and the runs' roles swap).
        from operators.training import DistributedTrainingOperator
        from services import job_history

        before_submit = DistributedTrainingOperator.before_submit

        def run_a_holds_the_quota() -> bool:
            rows = job_history.rows(dag_id="pin_ranker_training", team=TEAM)  # the team of this module's runs
            return any(r["state"] != job_history.WAITING for r in rows)

        def submit_once_run_a_is_admitted(self: Any, context: Any, *args: Any) -> Any:
            _wait_until("run a's job to be admitted", run_a_holds_the_quota, ADMISSION_TIMEOUT_S)
            return before_submit(self, context, *args)

        DistributedTrainingOperator.before_submit = submit_once_run_a_is_admitted  # type: ignore[method-assign]
        # Once run a exists (two dag.test() writing the same new DAG version at once collide); its promotion is
        # not waited for (run a's is).
        _wait_until("run a", (scratch / "run-a-created").exists, ADMISSION_TIMEOUT_S)
        dr = dag.test(run_conf=conf, mark_success_pattern="promote")
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}  # type: ignore[attr-defined]
    return {"tag": tag, "run_id": dr.run_id, "state": str(dr.state), "tasks": states}  # type: ignore[attr-defined]


def _prep(root: Path, mlflow_ready: Path) -> dict[str, Any]:
    """The MLflow store, then a validated day and a corrupted one (quarantined): one process, one import."""
    from mlflow import MlflowClient

    from core import config
    from features import synthetic, validate

    MlflowClient(tracking_uri=config.load().mlflow.tracking_uri).search_experiments()  # creates its tables
    mlflow_ready.touch()
    synthetic.main(["--root", str(root), "--start", RAW_DAYS[0], "--days", "2", "--users", "20", "--pins", "60"])
    good = validate.main(["events", "--ds", RAW_DAYS[0], "--root", str(root)])
    _corrupt(root, RAW_DAYS[1])
    bad = validate.main(["events", "--ds", RAW_DAYS[1], "--root", str(root), "--quarantine"])
    return {"good": good, "bad": bad}


def main() -> None:
    scratch = Path(sys.argv[-1])
    summary = _prep(Path(sys.argv[2]), scratch / "mlflow-ready") if sys.argv[1] == "prep" else _run(sys.argv[2], scratch)
    print("SUMMARY " + json.dumps(summary), flush=True)
    sys.stderr.flush()
    os._exit(0)  # done: no need to wait for the teardown of Airflow's and MLflow's process-wide state


# -- the world -----------------------------------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _corrupt(root: Path, ds: str) -> None:
    """Replace a day's raw events with rows whose action is not an allowed one (the suite fails it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = root / "raw" / "events" / f"ds={ds}"
    for path in part.glob("*.parquet"):
        table = pq.read_table(path)
        actions = pa.array(["explode"] * table.num_rows)
        pq.write_table(table.set_column(table.schema.get_field_index("action"), "action", actions), path)


class Stack:
    def __init__(self, home: Path, scratch: Path) -> None:
        self.home, self.scratch = home, scratch
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        self.live: dict[str, Any] = {}
        self.sync_pools = ""
        passwords = scratch / "passwords.json"
        passwords.write_text(json.dumps({"admin": self.password}))
        passwords.chmod(0o600)
        self.env = {
            **os.environ, **TEAM_ENV,
            "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__PORT": str(self.port), "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1", "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        log = (self.scratch / f"{name}.log").open("wb")
        proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        log.close()
        self.processes[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.scratch / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> None:
        proc = self.processes[name]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Where it is stuck: the Python stacks of the process (py-spy, installed with Ray).
            spy = subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--pid", str(proc.pid)],
                                 capture_output=True, text=True, timeout=60, check=False)
            pytest.fail(f"{name} did not finish in {timeout:.0f}s:\n{self.log(name)[-5000:]}\n{spy.stdout[-6000:]}")
        assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{self.log(name)[-5000:]}"

    def summary(self, name: str) -> dict[str, Any]:
        lines = [line for line in self.log(name).splitlines() if line.startswith("SUMMARY ")]
        assert lines, f"{name} printed no summary:\n{self.log(name)[-5000:]}"
        return dict(json.loads(lines[-1][len("SUMMARY "):]))

    def stop(self) -> None:
        """Stop every process group this test started (the API server's workers, torchrun's ranks): a test server
        needs no graceful shutdown, so SIGKILL follows soon."""
        for proc in self.processes.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever is left of its group
            proc.wait(timeout=10)

    def request(self, path: str, token: str | None = None, method: str = "GET", body: Any = None,
                follow: bool = True) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=json.dumps(body).encode() if body is not None else None)
        opener = urllib.request.build_opener(*([] if follow else [_NoRedirect()]))
        try:
            with opener.open(req, timeout=60) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as err:
            return err.code, dict(err.headers), err.read()

    def token(self) -> str:
        status, _, body = self.request("/auth/token", method="POST", body={"username": "admin", "password": self.password})
        assert status in (200, 201), body
        return str(json.loads(body)["access_token"])

    def watch_live(self, timeout: float) -> None:
        """While run a's job trains and run b's waits for room: the pages' data and HTML then, taken in this
        process with the code the API server runs (its answers over HTTP are checked once the runs are done)."""
        sys.path.insert(0, str(REPO / "plugins"))  # as Airflow puts the plugins folder on sys.path
        try:
            from pinflow_ui import pages, web
        finally:
            sys.path.remove(str(REPO / "plugins"))

        from core import config

        cfg = config.read(environ={**os.environ, **TEAM_ENV})
        request: Any = SimpleNamespace(scope={"root_path": "/pinflow"})
        deadline = time.monotonic() + timeout
        seen: dict[str, Any] = {}  # the latest moment that shows both; the first past a third of the steps is kept
        while time.monotonic() < deadline and self.processes["run-b"].poll() is None:
            assert self.processes["run-a"].poll() is None or self.processes["run-a"].returncode == 0, \
                self.log("run-a")[-5000:]
            platform = pages.platform(cfg)
            mine = {j["state"]: j for j in platform["active"] if j["team"] == TEAM}
            running = mine.get("RUNNING", {})
            progress = running.get("progress", {})
            usage = next((t for t in platform["usage"] if t["team"] == TEAM), {})
            if "WAITING" in mine and usage.get("waiting") == 1 and progress.get("phase") == "training" and \
                    0 < progress["step"] < progress["total_steps"]:
                run = pages.training_run(cfg, "pin_ranker_training", running["run_id"])
                # Read a moment after the platform's data: the job may have moved on to checkpointing meanwhile.
                if run["progress"].get("phase") == "training":
                    seen = {"platform": platform, "run": run}
                    if progress["step"] >= progress["total_steps"] / 3:
                        break
            elif seen and (not running or progress.get("phase") != "training"):
                break  # run a's job has moved on: the latest moment seen will do
            time.sleep(0.2)
        if seen:
            self.live = seen
            (self.scratch / "platform-live.html").write_text(web.render_platform(request, seen["platform"]))
            (self.scratch / "run-live.html").write_text(web.render_run(request, seen["run"]))

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.processes["api-server"].poll() is None, self.log("api-server")[-5000:]
            try:
                if self.request("/api/v2/monitor/health")[0] == 200:
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        pytest.fail(f"the API server did not answer in {timeout:.0f}s:\n{self.log('api-server')[-5000:]}")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


@pytest.fixture(scope="module")
def stack(airflow_db, pinflow_home, tmp_path_factory):
    from core import config
    from operators import quotas
    from training.smoke_data import write_tiny_world

    root = pinflow_home / "storage"
    # Always this tiny world (it replaces only its days): the session's storage root may hold the e2e demo's
    # bigger world for the same days, which made each training job here ~7x longer.
    write_tiny_world(root, DAYS, rows_per_day=200)
    s = Stack(pinflow_home, tmp_path_factory.mktemp("ui-pages"))
    py = sys.executable
    try:
        # Everything starts at once; the drivers order themselves: run a waits for the MLflow store, run b for
        # run a's DAG run; run b's job then waits for room in the quota while run a's trains.
        s.start("api-server", [py, "-m", "airflow", "api-server", "--apps", "core"])
        s.start("prep", [py, str(HERE), "prep", str(root), str(s.scratch)])
        # Each team's pool, as `make install` makes them, before the runs' tasks are scheduled.
        out = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
            cfg = config.read(environ={**os.environ, **TEAM_ENV})
            patch.setattr(config, "load", lambda: cfg)
            assert quotas.main(["sync-pools"]) == 0
        s.sync_pools = out.getvalue()
        s.start("run-a", [py, str(HERE), "run", "a", str(s.scratch)])
        s.start("run-b", [py, str(HERE), "run", "b", str(s.scratch)])
        s.watch_live(ADMISSION_TIMEOUT_S)
        s.wait("prep", 300)
        s.wait("run-a", 600)
        s.wait("run-b", 600)
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def _history(stack: Stack) -> dict[str, dict[str, Any]]:
    from services import job_history

    runs = {stack.summary(tag)["run_id"]: tag for tag in ("run-a", "run-b")}
    rows = job_history.rows(dag_id="pin_ranker_training")
    return {runs[r["run_id"]]: r for r in rows if r["run_id"] in runs}


# -- quota and job history -----------------------------------------------------------------------------------
def test_quota_of_one_job_makes_the_second_run_wait_then_run(stack):
    for tag in ("run-a", "run-b"):
        summary = stack.summary(tag)
        assert summary["state"] == "success", summary
        assert summary["tasks"]["train"] == "success" and summary["tasks"]["promote"] in ("success", "skipped")
    rows = _history(stack)
    assert set(rows) == {"run-a", "run-b"}, rows
    first, second = rows["run-a"], rows["run-b"]
    assert first["state"] == second["state"] == "SUCCEEDED"
    # The second job was submitted only once the first had ended, after waiting for room.
    assert second["submitted_at"] >= first["ended_at"], (first, second)
    assert second["quota_wait_s"] > 1 and (first["quota_wait_s"] or 0) < second["quota_wait_s"]
    log = stack.log("run-b")
    assert f"team {TEAM} is at its quota" in log and "waits for room: deferring" in log, log[-4000:]
    assert "has room after" in log
    # Progress lines: the task's (the trigger's, at each phase and every 30 s) and the job's own (every 30 s and at
    # the last step): step of total, %, examples/s, ETA; no loss before the first step, never "loss nan".
    task_log = stack.log("run-a")
    # The trigger polls, so which step its first training line shows depends on the machine's load: any step
    # before the last, with its total and percent; a line of step 0 shows no loss.
    first_lines = re.findall(r"step (\d+)/(\d+) \([0-9.]+%\), epoch 1/2(.*)\(1 rank\(s\) reporting\)", task_log)
    assert any(int(step) < int(total) for step, total, _ in first_lines), task_log[-4000:]
    assert all("loss" not in rest for step, _, rest in first_lines if step == "0"), first_lines
    assert re.search(r"step (\d+)/\1 \(100\.0%\), epoch 2/2, (evaluating|logging|done), loss [0-9.]+, [0-9,]+ "
                     r"examples/s, input wait \d+%( \(data-bound\))? \(1 rank\(s\) reporting\)", task_log), task_log[-4000:]
    node_log = (stack.home / "jobs" / first["job_id"] / "node-0.log").read_text()
    assert re.search(r"progress: step (\d+)/\1 \(100\.0%\), epoch 2/2, loss [0-9.]+, [0-9,]+ examples/s, ETA 0s",
                     node_log), node_log[-3000:]
    assert "loss nan" not in (task_log + node_log).lower()


def test_the_pages_showed_the_waiting_job_and_the_live_progress(stack):
    assert stack.live, "never saw run b's job waiting while run a's trained: " + stack.log("run-a")[-3000:]
    team = next(t for t in stack.live["platform"]["usage"] if t["team"] == TEAM)
    assert team["held"]["jobs"] == 1 and team["quota"]["jobs"] == 1 and team["waiting"] == 1
    progress = stack.live["run"]["progress"]
    assert progress["phase"] == "training" and 0 < progress["percent"] < 100 and progress["reporting"] == 1
    assert progress["examples_per_s"] > 0 and progress["ranks"][0]["age_s"] < 30
    assert stack.live["run"]["state"] == "RUNNING" and stack.live["run"]["mlflow"]["run_id"]  # linked while it runs
    html = (stack.scratch / "run-live.html").read_text()
    assert 'http-equiv="refresh"' in html and "examples/s" in html and "ETA" in html


def test_job_history_has_what_capacity_planning_needs(stack):
    for tag, row in _history(stack).items():
        assert row["team"] == TEAM and row["family"] == "pin_ranker" and row["backend"] == "local"
        # A local job runs on this machine whatever its team's node type (g5.12xlarge): its GPUs are this machine's.
        assert row["instance_type"] == LOCAL_MACHINE and row["nodes"] == 1 and row["gpus"] == local_gpus()
        assert row["try_number"] == 1 and row["retries"] == 0
        assert row["requested_at"] <= row["submitted_at"] <= row["started_at"] <= row["ended_at"]
        assert row["run_s"] > 0 and row["gpu_hours"] == pytest.approx(local_gpus() * row["run_s"] / 3600)
        assert row["queue_wait_s"] is not None and row["outcome"] == "SUCCEEDED" and row["failure_class"] is None
        assert row["model_version"] and row["mlflow_run_id"]
        assert (row["promoted"] is not None) == (tag == "run-a")  # run b's promote task is marked, not run
        assert row["console_url"].startswith(stack.url + "/pinflow/jobs/local/")


# -- the API -------------------------------------------------------------------------------------------------
def test_pages_api_needs_a_token(stack):
    run_id = stack.summary("run-a")["run_id"]
    paths = ["/pinflow/api/platform", "/pinflow/api/data-quality", "/pinflow/api/runs",
             f"/pinflow/api/runs/pin_ranker_training/{run_id}", "/pinflow/platform"]
    for path in paths:
        assert stack.request(path)[0] == 401, path
    assert stack.request(paths[0], token="not-a-token")[0] in (401, 403)
    token = stack.token()
    for path in paths:
        status, _, body = stack.request(path, token=token)
        assert status == 200, (path, body[:500])
    platform = json.loads(stack.request(paths[0], token=token)[2])
    team = next(t for t in platform["usage"] if t["team"] == TEAM)
    assert team["quota"]["jobs"] == 1 and team["pool"] == f"team-{TEAM}"
    assert (sum(platform["gpu_hours_by_team"].get(TEAM) or [0]) > 0) == (local_gpus() > 0)  # none on a CPU machine
    assert "SUCCEEDED" in platform["outcomes_by_day"]
    run = json.loads(stack.request(paths[3], token=token)[2])
    assert run["progress"]["step"] == run["progress"]["total_steps"] > 0 and run["progress"]["phase"] == "done"
    assert len(run["loss_curve"]) >= 2 and run["checkpoint"]["step"] == run["progress"]["step"]
    assert run["mlflow"]["run_id"] and run["promotion"]["reason"]
    quality = json.loads(stack.request(paths[1], token=token)[2])
    assert quality["cells"]["events"][RAW_DAYS[0]]["success"] is True
    assert quality["cells"]["events"][RAW_DAYS[1]]["success"] is False
    assert any(q["ds"] == RAW_DAYS[1] and q["failed_checks"] for q in quality["quarantine"])
    # Out-of-range days are a 422 naming the bound, not a 500; the app's OpenAPI document is served.
    for days in ("-5", "0", "100000000", "two"):
        status, _, body = stack.request(f"{paths[0]}?days={days}", token=token)
        assert status == 422 and b"days" in body, (days, status, body[:300])
    # The Models page's data: run a's promotion, if its gate promoted it (a tiny world), is a recorded move of
    # pin_ranker's champion alias; else the alias has not moved.
    families = {f["family"]: f for f in json.loads(stack.request("/pinflow/api/models", token=token)[2])}
    ranker = families["pin_ranker"]
    assert ranker["error"] is None and set(families) >= {"pin_ranker", "pin_content"}
    if _history(stack)["run-a"]["promoted"]:
        assert ranker["champion"] and [m["kind"] for m in ranker["moves"]] == ["promotion"]
        assert ranker["moves"][0]["moved_by"] == f"pin_ranker_training/{run_id}"
    else:
        assert ranker["champion"] is None and ranker["moves"] == []
    status, _, body = stack.request("/pinflow/openapi.json", token=token)
    assert status == 200 and "/api/platform" in json.loads(body)["paths"], body[:300]


def test_each_team_is_a_pool_whose_slots_are_its_jobs_quota(stack):
    assert f"created pool team-{TEAM}: 1 slot(s)" in stack.sync_pools or \
        f"updated pool team-{TEAM}: 1 slot(s)" in stack.sync_pools
    status, _, body = stack.request("/api/v2/pools", token=stack.token())
    pools = {p["name"]: p for p in json.loads(body)["pools"]}
    assert status == 200 and pools[f"team-{TEAM}"]["slots"] == 1 and pools[f"team-{TEAM}"]["include_deferred"]
    assert pools["team-ranking"]["slots"] == 4  # config/platform.yaml


def test_plugin_is_registered_with_its_app_and_views(stack):
    status, _, body = stack.request("/api/v2/plugins", token=stack.token())
    assert status == 200
    plugin = next(p for p in json.loads(body)["plugins"] if p["name"] == "pinflow")
    assert plugin["fastapi_apps"][0]["url_prefix"] == "/pinflow"
    routes = {v["url_route"]: v for v in plugin["external_views"]}
    assert {"pinflow-platform", "pinflow-runs", "pinflow-data-quality", "pinflow-models", "pinflow-run"} <= set(routes)
    assert routes["pinflow-run"]["destination"] == "dag_run"


def test_extra_links_are_http_and_resolve(stack):
    token = stack.token()
    run_id = stack.summary("run-a")["run_id"]
    status, _, body = stack.request(
        f"/api/v2/dags/pin_ranker_training/dagRuns/{run_id}/taskInstances/train/links", token=token)
    assert status == 200, body
    links = json.loads(body)["extra_links"]
    assert set(links) >= {"Training job", "MLflow run"} and all(
        str(url).startswith(("http://", "https://")) for url in links.values()), links
    # The job page (a local job: its node logs) and the MLflow run.
    status, _, page = stack.request(links["Training job"].removeprefix(stack.url), token=token)
    assert status == 200 and b"node 0" in page
    rows = _history(stack)
    mlflow = f"/pinflow/runs/pin_ranker_training/{run_id}/mlflow"
    status, headers, _ = stack.request(mlflow, token=token, follow=False)
    assert status == 307 and headers["location"].endswith(f"/runs/{rows['run-a']['mlflow_run_id']}")
    # Data Docs, served over HTTP by the plugin.
    status, _, page = stack.request(f"/pinflow/data-quality/docs/events/{RAW_DAYS[0]}", token=token)
    assert status == 200 and b"<html" in page.lower()
    # pinflow's own report of the partition (what the Data Docs link and the Data quality page open).
    status, _, page = stack.request(f"/pinflow/data-quality/report/events/{RAW_DAYS[1]}", token=token)
    assert status == 200 and b"FAILED" in page and b"Quarantined" in page and page.count(b"<tr>") > 5
    quality = json.loads(stack.request("/pinflow/api/data-quality", token=token)[2])
    report = next(q["report"] for q in quality["quarantine"] if q["ds"] == RAW_DAYS[1])
    status, _, page = stack.request(report.removeprefix(stack.url), token=token)
    assert status == 200 and b"FAILED" in page
    assert stack.request("/pinflow/files/raw/events/x.parquet", token=token)[0] == 404  # data is not served


# -- the browser ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Debian's chromium is not installed ({CHROMIUM}): "
                    "apt-get install chromium (make test's dev-tools does, as root)")
def test_pages_in_the_browser(stack):
    playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
    shots = Path(os.environ.get("PINFLOW_SCREENSHOTS") or stack.scratch / "screenshots")
    shots = shots if shots.is_absolute() else REPO / shots
    shots.mkdir(exist_ok=True)
    run_id = stack.summary("run-a")["run_id"]  # the run whose job trained every step (run b's: two)
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            # The UI polls the API: "networkidle" may never come, so wait for what each step needs instead.
            page.goto(f"{stack.url}/auth/login/", wait_until="domcontentloaded")
            page.locator("input[name=username]").wait_for(timeout=60_000)
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", stack.password)
            page.keyboard.press("Enter")
            page.wait_for_url(lambda url: "login" not in url, timeout=60_000)

            def plugin_page(route: str, title: str, shot: str, height: int) -> Any:
                page.goto(f"{stack.url}/plugin/{route}", wait_until="domcontentloaded")
                frame = page.frame_locator("iframe").first
                frame.locator("h1").filter(has_text=title).wait_for(timeout=60_000)
                page.set_viewport_size({"width": 1500, "height": height})
                page.screenshot(path=str(shots / shot), full_page=True)
                return frame

            frame = plugin_page("pinflow-platform", "Platform", "platform.png", 1900)
            assert frame.locator("td", has_text=TEAM).count() >= 1
            assert frame.locator("svg.chart").count() >= 5 and frame.locator("svg.chart rect.bar").count() >= 3

            frame = plugin_page("pinflow-runs", "Training runs", "training-runs.png", 700)
            assert frame.locator(f"a:has-text('{run_id}')").count() == 1
            frame.locator(f"a:has-text('{run_id}')").click()
            frame.locator("h1").filter(has_text=run_id).wait_for(timeout=60_000)
            page.set_viewport_size({"width": 1500, "height": 1900})
            page.screenshot(path=str(shots / "training-run.png"), full_page=True)
            assert frame.locator("svg.chart polyline.line").count() == 1  # the loss curve
            assert frame.locator("text=promoted").count() + frame.locator("text=not promoted").count() >= 1
            assert frame.locator("td", has_text="done").count() >= 1  # the rank's last phase

            # A champion history on the tiny world's versions (run a's, then run b's, as a promotion records them),
            # then a rollback to run a's as pinflow_rollback makes it: the Models page shows the moves.
            from core import config
            from services import champions
            from services import model_registry as registry

            rows = _history(stack)
            version_a, version_b = str(rows["run-a"]["model_version"]), str(rows["run-b"]["model_version"])
            client = registry.client(config.load().mlflow)
            for version, run in ((version_a, "run-a"), (version_b, "run-b")):
                with champions.model_lock("pin_ranker") as conn:
                    champions.move(client, "pin_ranker", version, kind="promotion", conn=conn,
                                   moved_by=f"pin_ranker_training/{rows[run]['run_id']}", reason="the pages' test")
            champions.rollback("pin_ranker", version_a, "version b ranks stale pins first (the pages' test)",
                               moved_by="admin via pinflow_rollback/manual__pages")
            frame = plugin_page("pinflow-models", "Models", "models.png", 900)
            assert frame.locator("h2", has_text="pin_ranker").count() == 1  # a section per family
            assert frame.locator(f"text=champion: version {version_a}").count() == 1
            assert frame.locator("td", has_text=re.compile("^rollback$")).count() == 1  # the kind of the last move

            frame = plugin_page("pinflow-data-quality", "Data quality", "data-quality.png", 1100)
            assert frame.locator("a.pass").count() >= 1 and frame.locator("a.fail").count() >= 1
            assert frame.locator("td", has_text="partition.").count() + frame.locator("td", has_text="action").count() >= 1
            # On a network without internet access (the usual data platform) the validation report reads whole:
            # every request outside this server is refused, and none is even made.
            outside: list[str] = []
            offline = browser.new_page(viewport={"width": 1500, "height": 1100})
            offline.context.add_cookies(page.context.cookies())

            def local_only(route: Any) -> None:
                if route.request.url.startswith(stack.url):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            offline.route("**/*", local_only)
            offline.goto(f"{stack.url}/pinflow/data-quality/report/events/{RAW_DAYS[1]}", wait_until="load")
            offline.locator("h1").filter(has_text="Validation of events").wait_for(timeout=60_000)
            assert offline.locator("table tr").count() > 5 and offline.locator("span.fail").count() >= 1
            offline.screenshot(path=str(shots / "validation-report.png"), full_page=True)
            offline.close()
            assert not outside, outside
            # What the pages showed while run a's job trained and run b's waited (the same code as the server's).
            for name, shot in (("platform-live.html", "platform-live.png"), ("run-live.html", "training-run-live.png")):
                live = browser.new_page(viewport={"width": 1400, "height": 900})
                live.set_content((stack.scratch / name).read_text())
                live.screenshot(path=str(shots / shot), full_page=True)
                live.close()
        finally:
            browser.close()
    for shot in ("platform.png", "training-runs.png", "training-run.png", "data-quality.png", "platform-live.png",
                 "training-run-live.png", "validation-report.png", "models.png"):
        assert (shots / shot).stat().st_size > 10_000, shot


if __name__ == "__main__":
    main()
