"""Team quotas on a real (SQLite) job history: the arithmetic, atomic admission, reconciling forgotten rows, the
quota trigger, the training operator deferring while its team has no room and submitting when it has, the pool
routing policy."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.config import LOCAL_MACHINE, PlatformConfig, QuotaConfig, TeamConfig
from core.failures import ConfigError, FailureClass
from operators import quotas
from operators.backends import JobState, JobStatus
from operators.backends.resources import local_gpus
from operators.quotas import Amount
from services import job_history as history

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path):
    return f"sqlite:///{tmp_path / 'history.db'}"


def hold(url, name, team="t", state=history.RUNNING, nodes=1, gpus=8, backend="local", job_id=None, **extra):
    history.upsert(name, url, team=team, state=state, nodes=nodes, gpus=gpus, backend=backend,
                   job_id=job_id if job_id is not None else name, dag_id="d", run_id=name, **extra)


def test_shortfall_names_each_limit_that_would_be_passed():
    quota = QuotaConfig(jobs=2, nodes=4, gpus=16)
    assert quotas.shortfall(quota, Amount(1, 2, 8), Amount(1, 2, 8)) == []
    short = quotas.shortfall(quota, Amount(2, 3, 8), Amount(1, 2, 16))
    assert short == ["jobs 2 held + 1 asked > quota 2", "nodes 3 held + 2 asked > quota 4",
                     "gpus 8 held + 16 asked > quota 16"]
    assert quotas.shortfall(QuotaConfig(), Amount(100, 100, 100), Amount(1, 64, 512)) == []  # no limits


def test_a_job_bigger_than_the_whole_quota_can_never_run():
    why = quotas.never_fits("ranking", QuotaConfig(nodes=8), Amount(1, 16, 128))
    assert why and "nodes=16 > quota 8" in why and "teams.ranking.quota" in why
    assert quotas.never_fits("ranking", QuotaConfig(nodes=8), Amount(1, 8, 64)) is None


def test_admission_counts_admitted_submitted_and_running_jobs_of_the_team_only(url):
    quota = QuotaConfig(jobs=2, gpus=16)
    hold(url, "a", state=history.SUBMITTED)
    hold(url, "other-team", team="u", gpus=64)
    hold(url, "ended", state=history.SUCCEEDED)
    assert quotas.try_admit("b", "t", quota, Amount(1, 1, 8), url).admitted
    refused = quotas.try_admit("c", "t", quota, Amount(1, 1, 8), url)
    assert not refused.admitted and refused.held == Amount(2, 2, 16)
    assert "a (submitted" in refused.holders and refused.shortfall[0].startswith("jobs 2 held")
    assert "team t is at its quota" in refused.message("t", quota)
    history.mark_ended("local", "a", history.SUCCEEDED, url=url)
    admitted = quotas.try_admit("c", "t", quota, Amount(1, 1, 8), url)
    assert admitted.admitted and history.get("c", url)["state"] == history.ADMITTED


def test_concurrent_admissions_never_pass_the_quota(url):
    quota = QuotaConfig(jobs=2)
    history.engine(url)  # the table, before the race
    results: list[bool] = []

    def admit(i: int) -> None:
        results.append(quotas.try_admit(f"job-{i}", "t", quota, Amount(1, 1, 0), url).admitted)

    threads = [threading.Thread(target=admit, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 6 + [True] * 2
    assert len(history.rows(url=url, states=history.ACTIVE)) == 2


def test_the_wait_for_quota_is_recorded(url):
    quota = QuotaConfig(jobs=1)
    hold(url, "a")
    quotas.request("b", {"team": "t", "nodes": 1, "gpus": 0}, url)
    assert not quotas.try_admit("b", "t", quota, Amount(1, 1, 0), url).admitted
    first_asked = history.get("b", url)["requested_at"]
    quotas.request("b", {"team": "t", "nodes": 1, "gpus": 0}, url)  # the task resumes: still the first request
    assert history.get("b", url)["requested_at"] == first_asked
    history.mark_ended("local", "a", history.FAILED, failure_class="INFRA", url=url)
    verdict = quotas.try_admit("b", "t", quota, Amount(1, 1, 0), url)
    assert verdict.admitted and verdict.waited_s > 0
    assert history.get("b", url)["quota_wait_s"] == pytest.approx(verdict.waited_s)


class Scripted:
    name = "local"

    def __init__(self, states):
        self.states = states

    def status(self, job_id):
        state = self.states[job_id]  # KeyError (a LookupError): the backend does not know the job
        return JobStatus(job_id, state, FailureClass.INFRA if state is JobState.FAILED else None,
                         "node-0 lost" if state is JobState.FAILED else "", created_at=100.0, started_at=160.0,
                         ended_at=400.0 if state.terminal else None)


def test_reconcile_closes_the_rows_of_jobs_that_ended_unrecorded(url, monkeypatch):
    hold(url, "running")
    hold(url, "failed", gpus=8)
    hold(url, "vanished")
    hold(url, "admitted-long-ago", state=history.ADMITTED, job_id="")
    monkeypatch.setattr(quotas, "ABANDON_AFTER_S", -1.0)
    backend = Scripted({"running": JobState.RUNNING, "failed": JobState.FAILED})
    assert quotas.reconcile("t", url, backends={"local": backend}) == 3
    states = {r["job_name"]: r for r in history.rows(url=url)}
    assert states["running"]["state"] == history.RUNNING
    assert states["failed"]["state"] == history.FAILED and states["failed"]["failure_class"] == "INFRA"
    assert states["failed"]["run_s"] == 240 and states["failed"]["gpu_hours"] == pytest.approx(8 * 240 / 3600)
    assert states["vanished"]["state"] == history.LOST
    assert states["admitted-long-ago"]["state"] == history.ABANDONED


def test_a_running_job_no_task_watches_is_cancelled_as_orphaned(url, monkeypatch):
    """Issue 37, 2: the runner of a task was killed after submit (no retry left, or ``airflow dags test`` killed): its
    job ran on, unwatched, and its row said RUNNING forever. A job its task still watches is left alone."""
    import datetime as dt

    now = history.now()
    hold(url, "orphan", watched_at=now - dt.timedelta(minutes=20))
    hold(url, "watched", watched_at=now - dt.timedelta(minutes=1))
    hold(url, "older-row")  # written before the column: never judged
    backend = Scripted({"orphan": JobState.RUNNING, "watched": JobState.RUNNING, "older-row": JobState.RUNNING})
    cancelled: list[str] = []
    backend.cancel = cancelled.append  # type: ignore[attr-defined]
    assert quotas.reconcile("t", url, backends={"local": backend}, orphan_after_s=0) == 0  # 0: never
    assert quotas.reconcile("t", url, backends={"local": backend}, orphan_after_s=900) == 1
    rows = {r["job_name"]: r for r in history.rows(url=url)}
    assert cancelled == ["orphan"] and rows["orphan"]["state"] == history.CANCELLED
    assert rows["orphan"]["reason"].startswith("orphaned: no task watched it for 20 min")
    assert rows["watched"]["state"] == rows["older-row"]["state"] == history.RUNNING
    with history.engine(url).connect() as conn:
        assert quotas.held(conn, "t")[0].jobs == 2  # the orphan no longer holds quota


def test_reconcile_records_why_a_job_that_ended_unwatched_stopped(url, tmp_path):
    """Issue 37, 2: a job whose lease expired (its task was gone) exits INFRA saying so in its failure file; the row
    that reconcile ends carries that reason, not only the exit code."""
    run = tmp_path / "runs" / "lease-gone"
    run.mkdir(parents=True)
    (run / "failure-rank0.json").write_text(json.dumps({"message": "no task has watched this job for 400 s"}))
    hold(url, "lease-gone", output_dir=str(run))
    hold(url, "no-file", output_dir=str(tmp_path / "runs" / "none"))
    backend = Scripted({"lease-gone": JobState.FAILED, "no-file": JobState.FAILED})
    assert quotas.reconcile("t", url, backends={"local": backend}) == 2
    rows = {r["job_name"]: r for r in history.rows(url=url)}
    assert rows["lease-gone"]["reason"] == "node-0 lost: no task has watched this job for 400 s"
    assert rows["no-file"]["reason"] == "node-0 lost" and rows["no-file"]["state"] == history.FAILED


def test_a_waiting_task_marks_its_job_watched(url, monkeypatch):
    from operators.jobs import wait_for_job

    hold(url, "job-1", state=history.SUBMITTED)
    monkeypatch.setattr(history, "default_url", lambda: url)
    monkeypatch.setattr(history, "WATCH_EVERY_S", 0.0)
    backend = Scripted({"job-1": JobState.RUNNING})
    polls = iter([JobState.RUNNING, JobState.SUCCEEDED])

    def status(job_id):
        backend.states[job_id] = next(polls)
        return Scripted.status(backend, job_id)

    backend.status = status  # type: ignore[method-assign]
    assert history.rows(url=url)[0]["watched_at"] is None
    wait_for_job(backend, "job-1", sleep=lambda s: None)
    assert history.rows(url=url)[0]["watched_at"] is not None


def test_quota_trigger_serializes_plain_values_and_fires_when_there_is_room(url, monkeypatch):
    trigger = quotas.QuotaTrigger(team="t", job_name="b", need={"jobs": 1, "nodes": 1, "gpus": 0}, poll_seconds=0.01,
                                  url=url)
    classpath, kwargs = trigger.serialize()
    assert classpath == "operators.quotas.QuotaTrigger"
    json.dumps(kwargs)
    from airflow.sdk._shared.module_loading import import_string

    assert import_string(classpath)(**kwargs).serialize() == (classpath, kwargs)

    cfg = PlatformConfig(teams={"t": TeamConfig(queue="q", share="s", quota=QuotaConfig(jobs=1)),
                                "ranking": TeamConfig(queue="r", share="r")})
    monkeypatch.setattr("core.config.read", lambda *a, **k: cfg)
    monkeypatch.setattr(quotas, "reconcile", lambda team, url=None, backends=None: 0)
    hold(url, "a")
    checks = []
    real_check = trigger._check

    def check():
        checks.append(1)
        if len(checks) == 3:  # the holder ends while the trigger waits
            history.mark_ended("local", "a", history.SUCCEEDED, url=url)
        return real_check()

    trigger._check = check  # type: ignore[method-assign]

    async def first_event():
        return await anext(trigger.run())

    event = asyncio.run(asyncio.wait_for(first_event(), 10)).payload
    assert event["room"] is True and event["job_name"] == "b" and event["team"] == "t" and len(checks) == 3


def test_the_policy_routes_a_training_task_to_its_runs_team_pool(monkeypatch):
    from operators import policy

    monkeypatch.setattr(policy, "_pools", lambda dag_run: {"default_pool", "team-ranking", "team-content"})
    ti = SimpleNamespace(operator="DistributedTrainingOperator", pool="default_pool", dag_id="d", task_id="train")
    policy.task_instance_mutation_hook(ti, SimpleNamespace(conf={"team": "content"}))
    assert ti.pool == "team-content"
    policy.task_instance_mutation_hook(ti, SimpleNamespace(conf={}))  # a scheduled run: the default team
    assert ti.pool == "team-ranking"
    missing = SimpleNamespace(operator="DistributedTrainingOperator", pool="default_pool", dag_id="d", task_id="train")
    policy.task_instance_mutation_hook(missing, SimpleNamespace(conf={"team": "nobody"}))
    assert missing.pool == "default_pool"  # no such pool: Airflow would never schedule the task
    other = SimpleNamespace(operator="PythonOperator", pool="default_pool")
    policy.task_instance_mutation_hook(other, SimpleNamespace(conf={"team": "content"}))
    assert other.pool == "default_pool"
    policy.task_instance_mutation_hook(ti, None)  # before the run exists: nothing to route on
    assert ti.pool == "team-ranking"
    trial = SimpleNamespace(operator="HpoTrialOperator", pool="default_pool", dag_id="pinflow_hpo", task_id="trial")
    policy.task_instance_mutation_hook(trial, SimpleNamespace(conf={"team": "content"}))
    assert trial.pool == "team-content"  # an HPO study's trials are its team's jobs too


def test_a_pool_per_team_with_the_jobs_quota_as_slots():
    assert quotas.team_pool("ranking") == "team-ranking"
    assert quotas.pool_slots(TeamConfig(queue="q", share="s", quota=QuotaConfig(jobs=3))) == 3
    assert quotas.pool_slots(TeamConfig(queue="q", share="s")) == -1  # Airflow's unlimited


def test_the_training_form_offers_the_configured_teams(tmp_path):
    from core import config

    cfg = config.read(home=tmp_path, environ={"PINFLOW_TEAMS__VISION__QUEUE": "vision",
                                              "PINFLOW_TEAMS__VISION__SHARE": "vision"})
    param = quotas.team_param(cfg)
    assert param.value == cfg.training.team == "ranking"
    assert param.schema["enum"] == ["content", "ranking", "vision"]  # config/platform.yaml's, and the added one

    # The form's param, as the DAG file builds it.
    spec = importlib.util.spec_from_file_location("_pinflow_training_dag", REPO / "dags" / "pin_ranker_training.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    form = module.dag.params.get_param("team")
    assert form.schema["enum"] == sorted(config.load().teams) and form.value == config.load().training.team
    assert module.dag.task_dict["train"].team == "{{ params.team }}"


def test_wait_for_room_refuses_a_job_that_can_never_fit(url):
    team = TeamConfig(queue="q", share="s", quota=QuotaConfig(nodes=2))
    with pytest.raises(ConfigError, match="could never run"):
        quotas.wait_for_room(SimpleNamespace(log=None), job_name="x", team="t", team_config=team,
                             need=Amount(1, 4, 0), fields={}, deferrable=True, poll_seconds=1, resume_method="r",
                             url=url)


# -- the training operator behind its team's quota -------------------------------------------------------------
class FakeBackend:
    name = "local"

    def __init__(self):
        self.jobs: dict[str, JobState] = {}

    def dry_run(self, spec):
        return {}

    def ping(self):
        pass

    def find(self, name):
        return name if name in self.jobs else None

    def submit(self, spec):
        self.jobs[spec.name] = JobState.RUNNING
        return spec.name

    def status(self, job_id):
        return JobStatus(job_id, self.jobs[job_id], created_at=100.0, started_at=100.0)

    def cancel(self, job_id):
        pass

    def console_url(self, job_id):
        return f"file:///jobs/{job_id}"


class TI:
    dag_id, task_id, map_index, try_number = "pin_ranker_training", "train", -1, 1

    def __init__(self, run_id):
        self.run_id = run_id
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


def test_the_operator_defers_while_its_team_is_full_and_submits_when_there_is_room(url, monkeypatch):
    from airflow.sdk.exceptions import TaskDeferred

    from core import config
    from operators.training import DistributedTrainingOperator

    base = config.read()
    teams = {**base.teams, "ranking": base.teams["ranking"].model_copy(update={"quota": QuotaConfig(jobs=1)})}
    cfg = base.model_copy(update={"teams": teams, "job_history": base.job_history.model_copy(update={"url": url})})
    monkeypatch.setattr(config, "load", lambda: cfg)
    backend = FakeBackend()
    monkeypatch.setattr("operators.backends.get_backend", lambda name, cfg=None, home=None: backend)
    monkeypatch.setattr(DistributedTrainingOperator, "_preflight", lambda self, backend, tracking_uri: None)
    monkeypatch.setattr(DistributedTrainingOperator, "_pin_inputs", lambda self, run, pins_dir: {})  # no partitions here
    monkeypatch.setattr("core.storage.write_json", lambda path, payload: None)

    def op():
        return DistributedTrainingOperator(task_id="train", plan={"train_days": ["2026-11-01"], "eval_ds": "2026-11-02"},
                                           backend="local", nodes=1, procs_per_node=2, team="ranking")

    first, second = {"ti": TI("run-1")}, {"ti": TI("run-2")}
    with pytest.raises(TaskDeferred) as running:
        op().execute(first)
    assert running.value.trigger.serialize()[0] == "operators.triggers.ComputeJobTrigger"
    # The MLflow run link is there (http) from submission on; the job's page too.
    assert first["ti"].xcom["_link_MlflowRunLink"].endswith("/pinflow/runs/pin_ranker_training/run-1/mlflow")
    assert first["ti"].xcom["_link_JobConsoleLink"].startswith("http")
    with pytest.raises(TaskDeferred) as waiting:
        op().execute(second)
    classpath, kwargs = waiting.value.trigger.serialize()
    assert classpath == "operators.quotas.QuotaTrigger" and waiting.value.method_name == "execute_after_quota"
    # A local job runs on this machine whatever the team's node type (p5.48xlarge): its GPUs are this machine's.
    assert kwargs["need"] == {"jobs": 1, "nodes": 1, "gpus": local_gpus()} and len(backend.jobs) == 1
    assert [r["state"] for r in history.rows(url=url)] == [history.SUBMITTED, history.WAITING]

    job = running.value.trigger.serialize()[1]
    backend.jobs[job["job_id"]] = JobState.SUCCEEDED
    with pytest.raises(Exception, match="result.json"):  # the fake job wrote none; its end is recorded all the same
        op().execute_complete(first, {**{k: job[k] for k in ("backend", "job_id", "output_dir")}, "state": "SUCCEEDED"})
    with pytest.raises(TaskDeferred) as resumed:
        op().execute_after_quota(second, {"team": "ranking", "job_name": kwargs["job_name"], "waited_s": 3.0})
    assert resumed.value.trigger.serialize()[0] == "operators.triggers.ComputeJobTrigger" and len(backend.jobs) == 2
    rows = {r["run_id"]: r for r in history.rows(url=url)}
    assert rows["run-1"]["state"] == history.SUCCEEDED and rows["run-2"]["state"] == history.SUBMITTED
    assert rows["run-2"]["quota_wait_s"] > 0 and rows["run-2"]["submitted_at"] >= rows["run-1"]["ended_at"]
    assert rows["run-2"]["team"] == "ranking" and rows["run-2"]["instance_type"] == LOCAL_MACHINE


@pytest.mark.parametrize(("visible", "expected"), [("0,1", 2), ("3", 1), ("", 0), ("-1", 0)])
def test_a_local_job_counts_the_gpus_cuda_lets_it_see(monkeypatch, visible, expected):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert local_gpus() == expected
