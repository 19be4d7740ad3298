"""SIGKILL of the local training agent in the middle of a run, through Airflow's own machinery.

``pin_ranker_training`` runs with ``dag.test()`` in a subprocess (the driver of ``test_training_operator.py``)
on a tiny synthetic world. Once the job has written a checkpoint, its ``training.launch`` agent is SIGKILLed
(as an out-of-memory kill from outside, a crashed runtime or an operator's ``kill -9`` would):

- the node's end is recorded as the signal, classed INFRA (not OOM: the kernel recorded no OOM kill), so the
  task's retry policy retries it;
- the agent's workers die with it (parent-death signal), so the killed run never finishes or registers;
- the retry's job resumes from the checkpoint and registers exactly one model version;
- no process of either job is left (``no_orphans``).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path

import pytest
from process_guard import descendants, no_orphans  # noqa: F401
from test_training_operator import (  # the driver and the world of the training operator's tests
    checkpoint_steps,
    driver,
    finish,
    jobs_now,
    new_jobs,
    wait_for,
    worker_pids,
    world,  # noqa: F401
)


def model_versions(home: Path) -> int:
    db = home / "mlflow" / "mlflow.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("select count(*) from model_versions").fetchone()[0])
        except sqlite3.OperationalError:  # no registry tables yet
            return 0


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def agent_of(job: Path) -> int | None:
    """The ``training.launch`` agent of the job's node 0: the child of its supervisor."""
    supervisor = json.loads((job / "request.json").read_text())["pids"][0]
    agents = [pid for pid, cmd in descendants(supervisor).items() if "training.launch" in cmd and "--worker" not in cmd]
    return agents[0] if agents else None


@pytest.mark.integration
def test_sigkill_of_the_agent_is_retried_resumes_and_registers_one_version(world, tmp_path, no_orphans):  # noqa: F811
    home, before = world, jobs_now(world)
    ckpts_before, versions_before = set(checkpoint_steps(home)), model_versions(home)
    log = tmp_path / "driver.log"
    proc = driver("run", {}, log)
    job = wait_for(lambda: [j for j in new_jobs(home, before) if (j / "request.json").exists()], "the job", proc, log)[0]
    wait_for(lambda: set(checkpoint_steps(home)) - ckpts_before, "a checkpoint", proc, log)
    workers = wait_for(lambda: worker_pids(job), "the workers", proc, log)
    agent = wait_for(lambda: agent_of(job), "the agent", proc, log)
    os.kill(agent, signal.SIGKILL)
    summary = finish(proc, log)

    assert summary["train_state"] == "success" and summary["train_try"] == 2, summary
    jobs = new_jobs(home, before)
    assert len(jobs) == 2, jobs  # try 1's job, killed; try 2's job, resumed
    first = "\n".join(p.read_text(errors="replace") for p in jobs[0].glob("node-*.log"))
    second = "\n".join(p.read_text(errors="replace") for p in jobs[1].glob("node-*.log"))
    assert (jobs[0] / "node-0.exit").read_text().strip() == str(-signal.SIGKILL), first[-3000:]
    assert json.loads((jobs[0] / "node-0.end.json").read_text())["oom_kill"] is False
    assert "resumed from" in second, second[-3000:]
    text = log.read_text()
    assert "InfraError" in text and "was killed by SIGKILL" in text and "OOMError" not in text
    # The killed run's workers died with their agent: no result, one registered version (the retry's).
    assert not [pid for pid in workers if running(pid)]
    assert not (home / "runs" / jobs[0].name / "result.json").exists()
    assert (home / "runs" / jobs[1].name / "result.json").exists()
    assert model_versions(home) - versions_before == 1
