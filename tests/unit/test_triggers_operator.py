"""The training operator's decisions around its trigger, on a scripted backend and a fake task state store:
submit or reattach, defer with ids only, classify the event, never reattach an ended job."""

from __future__ import annotations

import pytest

from core.failures import FailureClass, InfraError, UserError
from operators.backends import JobState, JobStatus
from operators.compute_job import JobRef
from operators.training import DistributedTrainingOperator


class Backend:
    name = "local"

    def __init__(self):
        self.jobs: dict[str, JobState] = {}
        self.submitted: list[str] = []
        self.cancelled: list[str] = []

    def dry_run(self, spec):
        return {}

    def ping(self):
        pass

    def find(self, name):
        return name if name in self.jobs else None

    def submit(self, spec):
        self.submitted.append(spec.name)
        self.jobs[spec.name] = JobState.RUNNING
        return spec.name

    def status(self, job_id):
        state = self.jobs[job_id]
        klass = FailureClass.USER if state is JobState.FAILED else None
        return JobStatus(job_id, state, klass, "node-0 exited with code 76" if klass else "")

    def logs(self, job_id, tail=50):
        return "loss is nan"

    def cancel(self, job_id):
        self.cancelled.append(job_id)

    def console_url(self, job_id):
        return f"file:///jobs/{job_id}"


class Store(dict):
    def set(self, key, value, retention=None):
        self[key] = value

    def delete(self, key):
        self.pop(key, None)


class TI:
    dag_id, run_id = "pin_ranker_training", "manual__2026-12-01"

    def __init__(self, try_number):
        self.try_number = try_number
        self.xcom: dict = {}

    def xcom_push(self, key, value):
        self.xcom[key] = value


@pytest.fixture
def backend(monkeypatch):
    fake = Backend()
    monkeypatch.setattr("operators.backends.get_backend", lambda name, cfg=None, home=None: fake)
    monkeypatch.setattr(DistributedTrainingOperator, "_preflight", lambda self, backend, tracking_uri: None)
    monkeypatch.setattr(DistributedTrainingOperator, "_pin_inputs", lambda self, run, pins_dir: {})  # no partitions here
    monkeypatch.setattr("core.storage.write_json", lambda path, payload: None)
    return fake


def operator():
    return DistributedTrainingOperator(task_id="train", plan={"train_days": ["2026-11-01"], "eval_ds": "2026-11-02"},
                                       backend="local", nodes=1, procs_per_node=2)


def run(op, try_number, store):
    from airflow.sdk.exceptions import TaskDeferred

    context = {"ti": TI(try_number), "task_state_store": store}
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context)
    classpath, kwargs = deferred.value.trigger.serialize()
    assert classpath == "operators.triggers.ComputeJobTrigger" and deferred.value.method_name == "execute_complete"
    return kwargs, context


@pytest.mark.unit
def test_first_try_submits_records_and_defers_with_ids_only(backend):
    store = Store()
    kwargs, context = run(operator(), 1, store)
    assert backend.submitted == [kwargs["job_id"]] == [operator().job_name(context, 1)]
    assert store["training_job"]["job_id"] == kwargs["job_id"]
    assert set(kwargs) == {"backend", "job_id", "output_dir", "poll_seconds", "stall_seconds", "queue_timeout_seconds",
                           "home", "shard_markers"}
    assert kwargs["queue_timeout_seconds"] == 86400 and kwargs["shard_markers"] is None  # one job: no shards counted  # training.queue_timeout_seconds
    # http(s) only: a local job's folder is the plugin's job page; the MLflow run link is there from submission.
    assert context["ti"].xcom["_link_JobConsoleLink"].endswith(f"/pinflow/jobs/local/{kwargs['job_id']}")
    assert context["ti"].xcom["_link_MlflowRunLink"].endswith("/pinflow/runs/pin_ranker_training/manual__2026-12-01/mlflow")


@pytest.mark.unit
def test_a_rerun_while_the_job_runs_reattaches(backend):
    store = Store()
    first, _ = run(operator(), 1, store)
    again, _ = run(operator(), 2, store)
    assert again["job_id"] == first["job_id"] and len(backend.submitted) == 1


@pytest.mark.unit
def test_an_ended_job_is_never_reattached(backend):
    store = Store()
    first, _ = run(operator(), 1, store)
    backend.jobs[first["job_id"]] = JobState.FAILED
    second, _ = run(operator(), 2, store)
    assert second["job_id"] != first["job_id"] and backend.submitted == [first["job_id"], second["job_id"]]


@pytest.mark.unit
def test_a_job_submitted_but_not_recorded_is_found_by_its_name(backend):
    run(operator(), 1, Store())  # the worker died before recording: a fresh store
    second, _ = run(operator(), 2, Store())
    assert len(backend.submitted) == 1 and second["job_id"] == backend.submitted[0]


@pytest.mark.unit
def test_events_are_rechecked_and_classified(backend):
    store = Store()
    kwargs, context = run(operator(), 1, store)
    event = {k: kwargs[k] for k in ("backend", "job_id", "output_dir")}
    backend.jobs[kwargs["job_id"]] = JobState.FAILED
    with pytest.raises(UserError, match="code 76"):
        operator().execute_complete(context, {**event, "state": "FAILED"})
    assert "training_job" not in store  # ended: a retry submits anew
    store.set("training_job", event)
    with pytest.raises(InfraError, match="no progress"):
        operator().execute_complete(context, {**event, "state": "STALLED", "reason": "made no progress for 300s"})
    assert "training_job" not in store
    store.set("training_job", event)
    with pytest.raises(InfraError, match="longer than the queue timeout"):
        operator().execute_complete(context, {**event, "state": "QUEUE_TIMEOUT",
                                              "reason": "job j waited 90000s queued (RUNNABLE) without starting, longer "
                                                        "than the queue timeout of 86400s"})
    assert "training_job" not in store


@pytest.mark.unit
def test_the_instance_type_param_reaches_the_job_spec(backend, monkeypatch):
    """The operator sends no resources of its own: the backend derives them from the instance type."""
    seen = []
    monkeypatch.setattr(backend, "dry_run", lambda spec: seen.append(spec) or {})
    op = operator()
    op.instance_type = "p4d.24xlarge"
    run(op, 1, Store())
    spec = seen[-1]
    assert (spec.instance_type, spec.cpus_per_node, spec.memory_gb_per_node, spec.gpus_per_node, spec.image) == (
        "p4d.24xlarge", None, None, None, "")


@pytest.mark.unit
def test_on_kill_cancels_the_job_it_waits_for(backend):
    op = operator()
    op._attach({"ti": TI(1)}, JobRef("local", "j1", output_dir="/o"))  # type: ignore[arg-type]
    op.on_kill()
    assert backend.cancelled == ["j1"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"team": "search"}, "team 'search' is not under teams:"),
        ({"overrides": {"lr": -1.0}}, "RUN.json of train-"),
        ({"overrides": {"strategy": "zero3"}}, "strategy: 'zero3' is not one of 'ddp', 'fsdp'"),
        ({"procs_per_node": 0}, "procs_per_node=0"),
    ],
)
def test_a_bad_setting_fails_at_once_as_user_error_before_submitting(backend, change, says):
    """An unknown team or a bad param is USER (no retry) and nothing is submitted."""
    from core.failures import ConfigError

    op = operator()
    for name, value in change.items():
        setattr(op, name, value)
    with pytest.raises(ConfigError, match=says) as err:
        op.execute({"ti": TI(1), "task_state_store": Store()})  # type: ignore[arg-type]
    assert err.value.failure_class is FailureClass.USER
    assert backend.submitted == []
