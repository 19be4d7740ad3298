"""Approval before the champion moves (``promotion: approval``), answered through a real ``airflow api-server``.

A family of one file (``tests/families/tiny_click.py``) configured with ``promotion: approval`` trains three times
through ``pin_ranker_training`` (``dag.test()`` in a subprocess, this file its driver, on the session's metadata
database). Each run's ``approve`` task waits in Airflow's ``awaiting_input`` state; the test reads the request
from the API server's human-in-the-loop endpoints, as the Required Actions page does, and:

1. lets the first run's short timeout pass (the scheduler's own timeout sweep resolves it as Reject);
2. rejects the second as the admin user;
3. approves the third.

Only the approved model becomes champion; the reviewer is recorded as the mover; each run's decision says what
happened; only the approved run emits the champion asset event that starts corpus inference.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
FAMILIES = REPO / "tests" / "families"
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03"]
DAG_ID = "pin_ranker_training"

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def main() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.asset import AssetEvent
    from airflow.models.dagrun import DagRunNote
    from airflow.utils.session import create_session

    dag = DagBag(dag_folder=str(REPO / "dags" / "pin_ranker_training.py")).dags[DAG_ID]
    conf = {"model": "tiny_click", "train_days": 2, "epochs": 2, "batch_size": 32, "nodes": 1, "procs_per_node": 1,
            **json.loads(sys.argv[1])}
    dr = dag.test(run_conf=conf)
    with create_session() as session:
        note = session.query(DagRunNote.content).filter(DagRunNote.dag_run_id == dr.id).scalar()
        events = [e.extra for e in session.query(AssetEvent).filter(AssetEvent.source_run_id == dr.run_id)]
    promote = dr.get_task_instance("promote")
    print("SUMMARY " + json.dumps({
        "run_id": dr.run_id, "state": str(dr.state), "tasks": {t.task_id: str(t.state) for t in dr.get_task_instances()},
        "decision": promote.xcom_pull(task_ids="promote", key="decision"), "note": note, "events": events,
    }), flush=True)


# -- the test ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Airflow:
    """An API server on the session's metadata database, and the drivers of the DAG runs."""

    def __init__(self, scratch: Path, home: Path, config: Path) -> None:
        self.scratch, self.port = scratch, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.password = secrets.token_urlsafe(12)
        passwords = scratch / "passwords.json"
        passwords.write_text(json.dumps({"admin": self.password}))
        passwords.chmod(0o600)
        self.env = {
            **os.environ, "PINFLOW_HOME": str(home), "PINFLOW_CONFIG": str(config),
            "PINFLOW_TRAINING__POLL_SECONDS": "0.5", "PINFLOW_TRAINING__PREFLIGHT": "false", "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(FAMILIES)]),
            "AIRFLOW__API__HOST": "127.0.0.1", "AIRFLOW__API__PORT": str(self.port), "AIRFLOW__API__BASE_URL": self.url,
            "AIRFLOW__API__WORKERS": "1", "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(32),
            "AIRFLOW__CORE__AUTH_MANAGER": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        }
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._token = ""

    def start(self, name: str, command: list[str]) -> subprocess.Popen[bytes]:
        with (self.scratch / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                    start_new_session=True)
        self.processes[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.scratch / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # and whatever is left of its group
            proc.wait(timeout=10)

    def api(self, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        req = urllib.request.Request(self.url + path, method=method, headers=headers,
                                     data=None if body is None else json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def login(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.processes["api-server"].poll() is None, self.log("api-server")[-5000:]
            with contextlib.suppress(OSError):
                status, body = self.api("/auth/token", "POST", {"username": "admin", "password": self.password})
                if status in (200, 201):
                    self._token = body["access_token"]
                    return
            time.sleep(1)
        pytest.fail(f"the API server did not answer in {timeout:.0f}s:\n{self.log('api-server')[-5000:]}")

    def pending_request(self, driver: str, timeout: float = 420) -> dict[str, Any]:
        """The run's approval request, once its approve task waits for an answer (what Required Actions lists)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = self.api(f"/api/v2/dags/{DAG_ID}/dagRuns/~/hitlDetails?response_received=false")
            assert status == 200, body
            # Answered only once the task is parked: on SQLite, Airflow's park reads "no response yet" and then
            # parks without a lock, so an answer that lands in between is recorded but resumes the task only at
            # its approval timeout (docs/training.md). A person answering from the UI is never that quick.
            if body["hitl_details"] and body["hitl_details"][0]["task_instance"]["state"] == "awaiting_input":
                return dict(body["hitl_details"][0])
            proc = self.processes[driver]
            assert proc.poll() is None, f"{driver} ended without asking for approval:\n{self.log(driver)[-6000:]}"
            time.sleep(1)
        pytest.fail(f"no approval request in {timeout:.0f}s:\n{self.log(driver)[-6000:]}")

    def finish(self, driver: str, timeout: float = 300) -> dict[str, Any]:
        proc = self.processes[driver]
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{driver} did not finish in {timeout:.0f}s:\n{self.log(driver)[-6000:]}")
        lines = [line for line in self.log(driver).splitlines() if line.startswith("SUMMARY ")]
        assert proc.returncode == 0 and lines, self.log(driver)[-6000:]
        return dict(json.loads(lines[-1].removeprefix("SUMMARY ")))


@pytest.fixture(scope="module")
def airflow(airflow_db, tmp_path_factory):
    from training.smoke_data import write_tiny_world

    scratch = tmp_path_factory.mktemp("approval")
    home = scratch / "home"
    write_tiny_world(home / "storage", DAYS, rows_per_day=120)
    config = scratch / "platform.yaml"
    config.write_text((REPO / "config" / "platform.yaml").read_text()
                      + "\nfamilies:\n  tiny_click: {module: tiny_click, params: {hidden: 4}, promotion: approval}\n")
    stack = Airflow(scratch, home, config)
    try:
        stack.start("api-server", [sys.executable, "-m", "airflow", "api-server", "--apps", "core"])
        stack.login()
        yield stack
    finally:
        stack.stop()


def _run(stack: Airflow, name: str, conf: dict[str, Any]) -> None:
    stack.start(name, [sys.executable, str(HERE), json.dumps(conf)])


def test_timeout_reject_and_approve_through_the_api_server(airflow: Airflow) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{Path(airflow.env['PINFLOW_HOME']) / 'mlflow' / 'mlflow.db'}"

    # 1. No answer within the run's timeout (~1 s): the scheduler's timeout sweep answers with the default, Reject.
    _run(airflow, "timeout", {"approval_timeout_h": 0.0003})
    request = airflow.pending_request("timeout")
    assert request["options"] == ["Approve", "Reject"] and request["defaults"] == ["Reject"]
    assert request["subject"].startswith("Make tiny_click v1 the champion (replacing none)?"), request["subject"]
    body = request["body"]
    assert "| head | candidate | champion | baseline |" in body and "Trained on 2026-11-01 to 2026-11-02 (2 days)" in body
    assert "/pinflow/runs/pin_ranker_training/" in body and "/mlflow)" in body
    time.sleep(2)
    sweep = subprocess.run(
        [sys.executable, "-c", "from airflow.jobs.job import Job; from airflow.jobs.scheduler_job_runner import "
         "SchedulerJobRunner; SchedulerJobRunner(job=Job()).check_awaiting_input_timeouts()"],
        env=airflow.env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert sweep.returncode == 0, sweep.stderr[-4000:]
    timed_out = airflow.finish("timeout")
    assert timed_out["tasks"] == {"plan_run": "success", "train": "success", "approve": "success",
                                  "promote": "skipped"}, timed_out
    assert timed_out["decision"]["reason"].startswith("no answer within the approval timeout (0.0003 h): the "
                                                      "champion stays unset"), timed_out["decision"]
    assert timed_out["events"] == [] and timed_out["note"].startswith("**Promotion**: tiny_click version 1 not promoted")
    assert "): no answer within the approval timeout" in timed_out["note"]

    # 2. Rejected by the admin user, through the API server.
    _run(airflow, "reject", {"approval_timeout_h": 2})
    request = airflow.pending_request("reject")
    assert request["subject"].startswith("Make tiny_click v2 the champion"), request["subject"]
    ti = request["task_instance"]
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{ti['dag_run_id']}/taskInstances/approve/-1/hitlDetails"
    status, answer = airflow.api(path, "PATCH", {"chosen_options": ["Maybe"]})
    assert status == 400, answer  # the options are Approve and Reject
    status, answer = airflow.api(path, "PATCH", {"chosen_options": ["Reject"]})
    assert status == 200 and answer["responded_by"]["name"] == "admin", answer
    rejected = airflow.finish("reject")
    assert rejected["tasks"]["promote"] == "skipped" and rejected["events"] == []
    assert rejected["decision"]["reason"].startswith("rejected by admin at "), rejected["decision"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    with pytest.raises(Exception, match="alias champion"):
        client.get_model_version_by_alias("tiny_click", "champion")
    assert client.get_model_version("tiny_click", "2").tags["promotion"].startswith("rejected: rejected by admin")

    # 3. Approved: the champion moves, recorded with the reviewer, and corpus inference is started.
    _run(airflow, "approve", {"approval_timeout_h": 2})
    request = airflow.pending_request("approve")
    ti = request["task_instance"]
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{ti['dag_run_id']}/taskInstances/approve/-1/hitlDetails"
    status, answer = airflow.api(path, "PATCH", {"chosen_options": ["Approve"]})
    assert status == 200, answer
    status, again = airflow.api(path, "PATCH", {"chosen_options": ["Reject"]})
    assert status == 409, again  # answered once
    approved = airflow.finish("approve")
    assert approved["tasks"]["promote"] == "success", approved
    assert approved["decision"]["promoted"] and approved["decision"]["approved_by"] == "admin"
    assert approved["events"] == [{"model": "tiny_click", "model_version": "3"}]
    assert approved["note"].startswith("**Promotion**: tiny_click version 3 promoted to champion"), approved["note"]
    assert str(client.get_model_version_by_alias("tiny_click", "champion").version) == "3"
    assert client.get_model_version("tiny_click", "3").tags["pinflow.approved_by"] == "admin"

    env = {k: v for k, v in airflow.env.items() if k.startswith("PINFLOW_")}
    moves = subprocess.run(
        [sys.executable, "-c", "import json; from services import job_history; "
         "print(json.dumps(job_history.alias_moves('tiny_click'), default=str))"],
        env={**os.environ, **env}, cwd=REPO, capture_output=True, text=True, timeout=120, check=True)
    [move] = json.loads(moves.stdout)
    assert (move["kind"], move["to_version"], move["from_version"]) == ("approval", "3", None)
    assert move["moved_by"] == f"admin (approved in {DAG_ID}/{approved['run_id']})"


if __name__ == "__main__":
    main()
