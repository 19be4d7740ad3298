"""The training operator through Airflow's own machinery on the local backend, with real torchrun.

Each test runs ``pin_ranker_training`` with ``dag.test()`` in a subprocess (this file is also its
driver: ``python test_training_operator.py run|resume``) on a tiny synthetic world, then checks the task
instance's state and tries in the metadata database and the job folders on disk:

- a worker killed in the middle → INFRA → Airflow retries (the retry policy) → the new job resumes from the
  last checkpoint and finishes;
- a NaN loss → USER → the task fails at once, without a retry;
- the task's worker killed while its job runs (sync and deferred paths) → the next try reattaches to the
  running job: one job in total.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from operators.jobs import read_heartbeats

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
DAYS = ["2026-11-01", "2026-11-02", "2026-11-03", "2026-11-04"]
# Small and quick, yet long enough to kill something in the middle: ~18 steps per epoch per rank.
OVERRIDES = {"epochs": 30, "batch_size": 16, "checkpoint_every": 40, "heartbeat_every_s": 0.5}


# -- the driver (runs in a subprocess) -----------------------------------------------------------------------
def _dag(options: dict) -> object:
    from datetime import timedelta

    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags")).dags["pin_ranker_training"]
    train = dag.task_dict["train"]
    train.retry_delay = timedelta(seconds=1)  # type: ignore[attr-defined]
    train.retry_exponential_backoff = 0  # type: ignore[attr-defined]
    train.overrides = {**OVERRIDES, **options.get("overrides", {})}  # type: ignore[attr-defined]
    train.deferrable = bool(options.get("deferrable", True))  # type: ignore[attr-defined]
    train.poll_seconds = 0.5  # type: ignore[attr-defined]
    return dag


def _summary(dr: object) -> dict:
    ti = dr.get_task_instance("train")  # type: ignore[attr-defined]
    return {"run_id": dr.run_id, "state": str(dr.state), "train_state": str(ti.state),  # type: ignore[attr-defined]
            "train_try": ti.try_number}


def _run(options: dict) -> dict:
    dag = _dag(options)
    conf = {"train_days": 3, "nodes": 1, "procs_per_node": 2}
    dr = dag.test(run_conf=conf, mark_success_pattern="promote")  # type: ignore[attr-defined]
    return _summary(dr)


def _resume(options: dict) -> dict:
    """A new worker after the old one died: the scheduler puts the orphaned try up for retry, the run goes on.

    The loop is dag.test()'s own (which always starts a new run), over the existing run.
    """
    from airflow import settings
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import DagRunState, TaskInstanceState

    dag = _dag(options)
    session = settings.Session()
    # The run the dead worker left behind: the newest running one.
    dr = (session.query(DagRun).filter(DagRun.dag_id == "pin_ranker_training", DagRun.state == DagRunState.RUNNING)
          .order_by(DagRun.id.desc()).first())
    # dag.test()'s own loop, so without the deadline alerts as operators.deadlines.DAG.test() (Airflow 3.3.2 looks
    # their encoded form up as database ids at the run's end).
    dag.deadline = None  # type: ignore[attr-defined]
    serialized = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    dr.dag = serialized
    ti = dr.get_task_instance("train", session=session)
    # What the scheduler does for a task whose worker stopped heartbeating: fail this try (which also
    # forgets a deferral's next method), retry it.
    ti.state = TaskInstanceState.UP_FOR_RETRY
    ti.end_date = ti.start_date
    ti.next_method = None
    ti.next_kwargs = None
    session.commit()
    run_pk = dr.id
    deadline = time.monotonic() + 600
    while dr.state == DagRunState.RUNNING and time.monotonic() < deadline:
        session.expire_all()
        dr = session.query(DagRun).filter(DagRun.id == run_pk).one()
        dr.dag = serialized
        schedulable, _ = dr.update_state(session=session)
        for s in schedulable:
            if s.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                s.try_number += 1
            s.state = TaskInstanceState.SCHEDULED
        session.commit()
        scheduled = [t for t in dr.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]
        for t in scheduled:
            if t.task_id == "promote":
                t.set_state(TaskInstanceState.SUCCESS)
            else:
                _run_task(ti=t, task=dag.task_dict[t.task_id], run_triggerer=True)  # type: ignore[attr-defined]
        if not scheduled:
            time.sleep(1)
    session.expire_all()
    return _summary(session.query(DagRun).filter(DagRun.id == run_pk).one())


def main() -> None:
    command, options = sys.argv[1], json.loads(sys.argv[2])
    summary = _run(options) if command == "run" else _resume(options)
    print("SUMMARY " + json.dumps(summary), flush=True)


# -- the tests ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(airflow_db, pinflow_home):
    from training.smoke_data import write_tiny_world

    root = pinflow_home / "storage"
    # Always this tiny world (it replaces only its days): the session's storage root may hold the e2e demo's
    # bigger world for the same days, which made each training job here ~7x longer.
    write_tiny_world(root, DAYS, rows_per_day=200)
    return pinflow_home


def driver(command: str, options: dict, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PINFLOW_TRAINING__POLL_SECONDS": "0.5", "OMP_NUM_THREADS": "1"}
    out = log.open("w")
    return subprocess.Popen([sys.executable, str(HERE), command, json.dumps(options)], stdout=out,
                            stderr=subprocess.STDOUT, env=env, cwd=REPO)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 600) -> dict:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in log.read_text().splitlines() if line.startswith("SUMMARY ")]
    assert lines, f"driver printed no summary (exit {proc.returncode}):\n{log.read_text()[-6000:]}"
    return json.loads(lines[-1][len("SUMMARY "):])


def new_jobs(home: Path, before: set[str]) -> list[Path]:
    return sorted((p for p in (home / "jobs").glob("train-*") if p.name not in before), key=lambda p: p.stat().st_mtime)


def jobs_now(home: Path) -> set[str]:
    return {p.name for p in (home / "jobs").glob("*")} if (home / "jobs").exists() else set()


def wait_for(predicate, what: str, proc: subprocess.Popen, log: Path, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert proc.poll() is None, f"driver ended before {what}:\n{log.read_text()[-6000:]}"
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-6000:]}")


def checkpoint_steps(home: Path) -> list[Path]:
    return sorted((home / "storage" / "models").glob("pin_ranker/*/checkpoints/step-*/COMPLETE.json"))


def worker_pids(job: Path) -> list[int]:
    """The training processes (torchrun's workers) of a local job, found by their RUN.json argument."""
    run_json = json.loads((job / "request.json").read_text())["nodes"][0]["argv"][-1]
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.train" in argv and run_json.encode() in argv and b"training.launch" not in argv:
            pids.append(int(proc.name))
    return pids


@pytest.mark.integration
# Extended (about 2.5 min): test_local_agent_kill.py runs the same retry and resume through this DAG after a SIGKILL
# of the agent, and test_train_torchrun.py's SIGKILL of a rank checks that the node exits INFRA; make test's budget.
@pytest.mark.extended
def test_killed_worker_is_retried_and_resumes_from_its_checkpoint(world, tmp_path):
    home, before = world, jobs_now(world)
    ckpts_before = set(checkpoint_steps(home))
    log = tmp_path / "driver.log"
    proc = driver("run", {}, log)
    job = wait_for(lambda: [j for j in new_jobs(home, before) if (j / "request.json").exists()], "the job", proc, log)[0]
    wait_for(lambda: set(checkpoint_steps(home)) - ckpts_before, "a checkpoint", proc, log)
    pids = wait_for(lambda: worker_pids(job), "the workers", proc, log)
    os.kill(pids[-1], signal.SIGKILL)  # a worker dies, as on a lost GPU or an OOM-killed neighbour
    summary = finish(proc, log)
    assert summary["train_state"] == "success" and summary["train_try"] == 2, summary
    jobs = new_jobs(home, before)
    assert len(jobs) == 2, jobs  # try 1's job, killed; try 2's job, resumed
    first = "\n".join(p.read_text(errors="replace") for p in jobs[0].glob("node-*.log"))
    second = "\n".join(p.read_text(errors="replace") for p in jobs[1].glob("node-*.log"))
    assert (jobs[0] / "node-0.exit").read_text().strip() == "75", first[-3000:]
    assert "resumed from" in second, second[-3000:]
    text = log.read_text()
    assert "InfraError" in text and "UserError" not in text


@pytest.mark.integration
def test_nan_loss_fails_at_once_without_retry(world, tmp_path):
    home, before = world, jobs_now(world)
    log = tmp_path / "driver.log"
    proc = driver("run", {"overrides": {"fail_nan_at_step": 3, "epochs": 1}}, log)
    summary = finish(proc, log)
    assert summary["train_state"] == "failed" and summary["train_try"] == 1, summary
    assert len(new_jobs(home, before)) == 1
    text = log.read_text()
    assert "UserError" in text and "exited with code 76" in text


@pytest.mark.integration
# The sync variant (about 2 min) is extended: the DAGs' training and trials defer, and both modes reattach through
# the same rule (ComputeJobOperator's task state store); it keeps make test within its budget.
@pytest.mark.parametrize("deferrable", [pytest.param(False, id="sync", marks=pytest.mark.extended),
                                        pytest.param(True, id="deferred")])
def test_restarted_worker_reattaches_to_its_running_job(world, tmp_path, deferrable):
    home, before = world, jobs_now(world)
    log = tmp_path / "driver.log"
    proc = driver("run", {"deferrable": deferrable}, log)
    job = wait_for(lambda: [j for j in new_jobs(home, before) if (j / "request.json").exists()], "the job", proc, log)[0]
    run_dir = home / "runs" / job.name
    wait_for(lambda: any(b.get("step", 0) >= 2 for b in read_heartbeats(run_dir)), "training steps", proc, log)
    proc.send_signal(signal.SIGKILL)  # the worker (and the in-line triggerer) dies; the job runs on
    proc.wait()
    log2 = tmp_path / "resume.log"
    summary = finish(driver("resume", {"deferrable": deferrable}, log2), log2)
    assert summary["train_state"] == "success" and summary["train_try"] == 2, (summary, log2.read_text()[-4000:])
    assert [j.name for j in new_jobs(home, before)] == [job.name]  # one job in total
    assert "reattaching to training job" in log2.read_text()


if __name__ == "__main__":
    main()
