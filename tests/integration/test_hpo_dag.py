"""The HPO DAG through Airflow's own machinery on the local backend, with real torchrun jobs.

One study of 6 trials, 2 at a time (three rounds), of the content family on a tiny world (``pinflow_hpo`` run with
``dag.test()`` in a subprocess: this file is also its driver, ``python test_hpo_dag.py``). Deferred trial tasks
get their triggers run in background threads, as a triggerer would, so the two trials of a round train at once.
The driver then clears and re-runs the whole DAG run (in the same process: one Airflow start-up, not two).
Trials are tiny (40 steps, a checkpoint every 5).

- trials run as training jobs (one per trial, in parallel per round) and their evaluation reaches the study;
- a trial whose training worker is SIGKILLed once its first checkpoint exists (trial 1, round 0) fails its try
  (INFRA), is retried, and its second try's job resumes from the checkpoint: one MLflow run for the trial;
- a trial that learns slowly (enqueued: lr 0.0002) is pruned from its intermediate losses: its job is cancelled
  and its task succeeds with the trial recorded as pruned;
- the best trial beats the baseline (the family's defaults) on the metric; its model is registered and goes
  through the promotion gate; MLflow has the study's parent run with a child run per trial; the run's note is the
  study's summary (the listener of ``operators.run_notes``);
- the re-run of the DAG run continues the same study: no trial is asked or trained again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03"]
LOGICAL_DATE = "2026-11-10T00:00:00+00:00"
CONF = {
    "model": "pin_content", "n_trials": 6, "parallel_trials": 2, "metric": "mean_auc", "direction": "maximize",
    "search_space": {"lr": {"type": "float", "low": 0.0002, "high": 0.1, "log": True}},
    # Trial 1 (round 0) learns fast, trial 2 (round 1, after two completed trials) slowly: it is pruned.
    # Trials 3-5 are the sampler's.
    "enqueue": [{"lr": 0.05}, {"lr": 0.0002}],
    "fixed": {"epochs": 4, "batch_size": 16, "checkpoint_every": 5, "heartbeat_every_s": 0.5,
              "debug_step_sleep_s": 0.05, "params": {"width": 32}},
    "train_days": 2, "nodes": 1, "procs_per_node": 1, "backend": "local",
}

pytestmark = pytest.mark.integration


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def _fire(ti_id: object, trigger: object, next_method: str) -> None:
    """What a triggerer does: run the trigger to its first event, then put the task back up for scheduling."""
    import asyncio

    from airflow.models.taskinstance import TaskInstance
    from airflow.sdk.serde import serialize
    from airflow.utils.session import create_session
    from airflow.utils.state import TaskInstanceState

    async def first() -> object:
        return await anext(trigger.run(), None)  # type: ignore[attr-defined]

    try:
        event = asyncio.run(first())
    except BaseException:  # a trigger that fails fails its task, as in the triggerer
        with create_session() as session:
            session.get(TaskInstance, ti_id).state = TaskInstanceState.FAILED
        raise
    with create_session() as session:
        ti = session.get(TaskInstance, ti_id)
        ti.next_method = next_method
        ti.next_kwargs = {"event": serialize(event.payload)}  # type: ignore[attr-defined]
        ti.state = TaskInstanceState.SCHEDULED


def _run_task(*, ti: object, task: object, run_triggerer: bool = False) -> object:
    """``dag.test()``'s ``_run_task``, except that a deferred task's trigger runs in a thread (a triggerer)."""
    from uuid import UUID

    from airflow.sdk._shared.module_loading import import_string
    from airflow.sdk.api.datamodels._generated import TaskInstance as TaskInstanceSDK
    from airflow.sdk.execution_time.comms import DeferTask
    from airflow.sdk.execution_time.supervisor import run_task_in_process
    from airflow.sdk.serde import deserialize
    from airflow.serialization.serialized_objects import create_scheduler_operator
    from airflow.utils.state import TaskInstanceState

    ti.set_state(TaskInstanceState.QUEUED)  # type: ignore[attr-defined]
    sdk_ti = TaskInstanceSDK(
        id=UUID(str(ti.id)), task_id=ti.task_id, dag_id=ti.dag_id, run_id=ti.run_id,  # type: ignore[attr-defined]
        try_number=ti.try_number, map_index=ti.map_index, dag_version_id=UUID(str(ti.dag_version_id)),  # type: ignore[attr-defined]
    )
    result = run_task_in_process(ti=sdk_ti, task=task)
    ti.set_state(result.ti.state)  # type: ignore[attr-defined]
    ti.task = create_scheduler_operator(result.ti.task)  # type: ignore[attr-defined]
    if ti.state == TaskInstanceState.DEFERRED and isinstance(result.msg, DeferTask):  # type: ignore[attr-defined]
        trigger = import_string(result.msg.classpath)(**deserialize(result.msg.trigger_kwargs))
        threading.Thread(target=_fire, args=(ti.id, trigger, result.msg.next_method), daemon=True).start()  # type: ignore[attr-defined]
    return result


def _dag() -> object:
    from datetime import timedelta

    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / "pinflow_hpo.py")).dags["pinflow_hpo"]
    for task in dag.tasks:  # type: ignore[attr-defined]
        if task.task_id.endswith(".trial"):
            task.partial_kwargs["retry_delay"] = timedelta(seconds=1)
            task.partial_kwargs["retry_exponential_backoff"] = 0
    return dag


def _summary(dr: object) -> dict:
    tis = dr.get_task_instances()  # type: ignore[attr-defined]
    return {
        "run_id": dr.run_id, "state": str(dr.state),  # type: ignore[attr-defined]
        "tasks": {f"{t.task_id}[{t.map_index}]": [str(t.state), t.try_number] for t in tis},
        "summary": next((t.xcom_pull(task_ids="summary") for t in tis if t.task_id == "summary"), None),
    }


def _rerun(dag: object) -> object:
    """Clear the DAG run and run it again (what *Clear* on the run does), with ``dag.test()``'s loop: dag.test()
    itself always makes a new run."""
    from airflow import settings
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import clear_task_instances
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import DagRunState, TaskInstanceState

    session = settings.Session()
    dr = session.query(DagRun).filter(DagRun.dag_id == "pinflow_hpo").order_by(DagRun.id.desc()).first()
    serialized = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    clear_task_instances(dr.get_task_instances(session=session), session, dag_run_state=DagRunState.RUNNING)
    session.commit()
    run_pk = dr.id
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        session.expire_all()
        dr = session.query(DagRun).filter(DagRun.id == run_pk).one()
        if dr.state != DagRunState.RUNNING:
            break
        dr.dag = serialized
        schedulable, _ = dr.update_state(session=session)
        for ti in schedulable:
            if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                ti.try_number += 1
            ti.state = TaskInstanceState.SCHEDULED
        session.commit()
        scheduled = [t for t in dr.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]
        for ti in scheduled:
            _run_task(ti=ti, task=dag.task_dict[ti.task_id])  # type: ignore[attr-defined]
        if not scheduled:
            time.sleep(0.5)
    return dr


def main() -> None:
    """Run the DAG (``dag.test()``), then clear and re-run the same DAG run: a ``SUMMARY <name>`` line after each."""
    import datetime as dt

    import airflow.sdk.definitions.dag as dag_module
    from airflow.models.dagrun import DagRun, DagRunNote
    from airflow.utils.session import create_session

    dag_module._run_task = _run_task  # type: ignore[assignment]
    dag = _dag()
    runs = {"run": lambda: dag.test(logical_date=dt.datetime.fromisoformat(LOGICAL_DATE), run_conf=CONF),  # type: ignore[attr-defined]
            "rerun": lambda: _rerun(dag)}
    for name, run in runs.items():
        dr = run()
        with create_session() as session:
            summary = _summary(session.query(DagRun).filter(DagRun.id == dr.id).one())
            summary["note"] = session.query(DagRunNote.content).filter(DagRunNote.dag_run_id == dr.id).scalar()
        print(f"SUMMARY {name} " + json.dumps(summary, default=str), flush=True)
        if summary["state"] != "success":
            break


# -- the test -----------------------------------------------------------------------------------------------
def _finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> dict[str, dict]:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summaries = {}
    for line in log.read_text().splitlines():
        if line.startswith("SUMMARY "):
            name, _, payload = line[len("SUMMARY "):].partition(" ")
            summaries[name] = json.loads(payload)
    assert summaries, f"driver printed no summary (exit {proc.returncode}):\n{log.read_text()[-8000:]}"
    return summaries


@pytest.fixture
def hpo_env(airflow_db, pinflow_home, tmp_path):
    """The driver's environment: its own storage root (a tiny world), MLflow store and study storage."""
    from training.smoke_data import write_tiny_world

    write_tiny_world(tmp_path / "storage", DAYS, rows_per_day=40, pins=160, row_group_size=16)
    return {
        # No PYTHONPATH: pinflow is installed (editable); the source tree on sys.path would also show Airflow its
        # egg-info, and so every entry-point plugin twice.
        **os.environ, "OMP_NUM_THREADS": "1",
        "PINFLOW_STORAGE_ROOT": str(tmp_path / "storage"),
        "PINFLOW_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "PINFLOW_MLFLOW__ARTIFACT_ROOT": str(tmp_path / "artifacts"),
        "PINFLOW_HPO__STORAGE_URL": f"sqlite:///{tmp_path / 'optuna.db'}",
        "PINFLOW_HPO__REPORT_EVERY_STEPS": "2",
        "PINFLOW_HPO__PRUNE_WARMUP_STEPS": "10",  # of 40: the first steps' losses are alike
        "PINFLOW_HPO__MAX_ROUNDS": "3",  # the 3 rounds of 6 trials, 2 at a time: no rounds to skip
        "PINFLOW_TRAINING__POLL_SECONDS": "0.3",
        "PINFLOW_TRAINING__PREFLIGHT": "false",
    }


def _driver(env: dict, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(HERE)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def _trial_job(home: Path, trial: int, try_number: int) -> Path | None:
    """The run folder (and job name) of a trial's try, once its job has been submitted."""
    for run_json in (home / "runs").glob("train-pinflow-hpo-*/RUN.json"):
        tags = json.loads(run_json.read_text())["tags"]
        if (tags["hpo_trial"], tags["try"]) == (str(trial), str(try_number)):
            return run_json.parent if (home / "jobs" / run_json.parent.name / "request.json").exists() else None
    return None


def _kill_after_first_checkpoint(home: Path, trial: int, proc: subprocess.Popen, log: Path) -> None:
    """SIGKILL the training worker (torchrun's child) of the trial's first try once it has a checkpoint."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"driver ended before trial {trial} was killed:\n{log.read_text()[-6000:]}"
        run_dir = _trial_job(home, trial, 1)
        if run_dir is not None:
            assert not (run_dir / "result.json").exists(), f"trial {trial} trained to its end before the kill"
            checkpoints = Path(json.loads((run_dir / "RUN.json").read_text())["checkpoint_dir"])
            run_json = json.loads((home / "jobs" / run_dir.name / "request.json").read_text())["nodes"][0]["argv"][-1]
            if list(checkpoints.glob("step-*/COMPLETE.json")):
                for pid_dir in Path("/proc").glob("[0-9]*"):
                    try:
                        argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
                    except OSError:
                        continue
                    if b"training.train" in argv and run_json.encode() in argv and b"training.launch" not in argv:
                        os.kill(int(pid_dir.name), signal.SIGKILL)
                        return
        time.sleep(0.1)
    raise AssertionError(f"trial {trial}: no worker with a checkpoint to kill:\n{log.read_text()[-6000:]}")


def test_a_study_of_training_jobs_prunes_resumes_and_promotes(hpo_env, pinflow_home, tmp_path, monkeypatch):
    import optuna
    from mlflow import MlflowClient

    home = pinflow_home
    log = tmp_path / "run.log"
    proc = _driver(hpo_env, log)
    _kill_after_first_checkpoint(home, 1, proc, log)
    summaries = _finish(proc, log)
    summary = summaries["run"]
    assert summary["state"] == "success", json.dumps(summary["tasks"], indent=1)
    text = log.read_text()

    # The study: 6 trials, each a training job, values from their evaluation; the slow one pruned (a sampled one
    # may be too).
    storage = optuna.storages.RDBStorage(hpo_env["PINFLOW_HPO__STORAGE_URL"])
    study_names = [s.study_name for s in optuna.get_all_study_summaries(storage)]
    assert len(study_names) == 1, study_names
    study = optuna.load_study(study_name=study_names[0], storage=storage)
    states = {t.number: t.state.name for t in study.trials}
    assert sorted(states) == list(range(6)) and [states[n] for n in range(3)] == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert {states[n] for n in range(3, 6)} <= {"COMPLETE", "PRUNED"}, (states, text[-6000:])
    complete = [t for t in study.trials if t.state.name == "COMPLETE"]
    for trial in complete:
        result = trial.user_attrs["pinflow.result"]
        assert trial.value == pytest.approx(result["metrics"]["mean_auc"])
        assert trial.intermediate_values, trial.number  # its curve reached the study
    assert study.trials[0].user_attrs.get("baseline") and study.trials[0].params == {"lr": 0.003}
    assert [study.trials[1].params["lr"], study.trials[2].params["lr"]] == [0.05, 0.0002]
    assert study.best_trial.value > study.trials[0].value  # beats the family's defaults

    # Two trials at once: round 0's jobs overlapped in time.
    jobs = {}
    for run_dir in (home / "runs").glob("train-pinflow-hpo-*"):
        config = json.loads((run_dir / "RUN.json").read_text())
        jobs[(int(config["tags"]["hpo_trial"]), int(config["tags"]["try"]))] = run_dir
    assert sorted(jobs) == [(0, 1), (1, 1), (1, 2), (2, 1), (3, 1), (4, 1), (5, 1)], sorted(jobs)

    def span(run_dir: Path) -> tuple[float, float]:
        end = run_dir / "result.json" if (run_dir / "result.json").exists() else max(run_dir.glob("heartbeat-*"))
        return (run_dir / "RUN.json").stat().st_mtime, end.stat().st_mtime

    (start0, end0), (start1, end1) = span(jobs[(0, 1)]), span(jobs[(1, 1)])
    assert start1 < end0 and start0 < end1, "round 0's trials did not train at the same time"

    # The killed trial: its first job died, its task's try 2 resumed from the trial's checkpoint and finished.
    assert summary["tasks"]["round_0.trial[1]"] == ["success", 2], summary["tasks"]
    assert not (jobs[(1, 1)] / "result.json").exists() and (jobs[(1, 2)] / "result.json").exists()
    resumed = "".join(p.read_text(errors="replace") for p in (home / "jobs" / jobs[(1, 2)].name).glob("node-*.log"))
    assert "resumed from" in resumed, resumed[-3000:]

    # The pruned trial's job was cancelled; its task succeeded.
    assert summary["tasks"]["round_1.trial[0]"] == ["success", 1], summary["tasks"]
    assert not (jobs[(2, 1)] / "result.json").exists()  # cancelled before it finished
    assert "pruned at step" in text

    # The summary, promotion and MLflow: a parent run and a child run per trial.
    result = summary["summary"]
    counts = {s.lower(): list(states.values()).count(s) for s in set(states.values())}
    assert result["trials"] == counts, result
    assert result["best"]["number"] == study.best_trial.number and result["gain_over_baseline"] > 0
    assert result["promotion"]["model_version"] and result["promotion"]["promoted"]
    assert summary["note"] == result["note"] and f"best: trial {result['best']['number']}" in summary["note"]
    client = MlflowClient(hpo_env["PINFLOW_MLFLOW__TRACKING_URI"], hpo_env["PINFLOW_MLFLOW__TRACKING_URI"])
    parent = client.get_run(result["mlflow_parent_run_id"])
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    # One run per trial: the killed trial's second try went on with its first try's run.
    assert sorted(int(r.data.tags["pinflow.hpo.trial"]) for r in children) == list(range(6))
    assert all("lr" in r.data.params for r in children)
    version = client.get_model_version("pin_content", result["promotion"]["model_version"])
    assert version.run_id == study.best_trial.user_attrs["pinflow.result"]["mlflow_run_id"]
    assert len(client.search_model_versions("name='pin_content'")) == 1  # trials do not register their models

    # The driver then cleared and re-ran the DAG run: the same study went on, nothing was asked or trained twice.
    rerun = summaries["rerun"]
    assert rerun["state"] == "success", json.dumps(rerun["tasks"], indent=1)
    study = optuna.load_study(study_name=study_names[0], storage=storage)
    assert {t.number: t.state.name for t in study.trials} == states
    assert len(list((home / "runs").glob("train-pinflow-hpo-*"))) == len(jobs)
    assert rerun["summary"]["best"] == result["best"] and rerun["note"].count("**Optuna study**") == 1
    assert len(client.search_model_versions("name='pin_content'")) == 1

    # The pages show the run as a study (issue 34): each trial with its state, value and job (the killed trial's
    # two tries), the best so far; the runs list counts trials, not tries.
    import sys
    from types import SimpleNamespace

    from core import config
    from operators import hpo
    from services import job_history as history

    sys.path.insert(0, str(REPO / "plugins"))
    from pinflow_ui import pages, web

    for key in ("PINFLOW_HPO__STORAGE_URL", "PINFLOW_STORAGE_ROOT", "PINFLOW_MLFLOW__TRACKING_URI"):
        monkeypatch.setenv(key, hpo_env[key])
    run_id = next(r["run_id"] for r in history.rows(dag_id="pinflow_hpo")
                  if hpo.study_name("pinflow_hpo", r["run_id"]) == study_names[0])
    data = pages.training_run(config.load(), "pinflow_hpo", run_id)
    view = data["study"]
    assert {t["number"]: t["state"].upper() for t in view["trials"]} == states
    assert [t["tries"] for t in view["trials"][:3]] == [1, 2, 1] and view["trials"][0]["baseline"]
    assert view["best"]["number"] == study.best_trial.number and sum(t["best"] for t in view["trials"]) == 1
    assert next(r for r in web.training_runs() if r["run_id"] == run_id)["trials"] == 6
    html = web.render_run(SimpleNamespace(scope={"root_path": "/pinflow"}), data)  # type: ignore[arg-type]
    assert f"best so far: trial {study.best_trial.number}" in html and ">pruned<" in html


if __name__ == "__main__":
    main()
