"""Issue 37, item 2: killing the runner must not leave a job that registers a model nobody decided on.

``pin_ranker_training`` runs with ``dag.test()`` in a subprocess (the driver of ``test_training_operator.py``) on a
tiny synthetic world, with a lease of a few seconds (``PINFLOW_JOB_HISTORY__LEASE_S``). The driver is SIGKILLed as
soon as its job is submitted (as a killed ``airflow dags test`` is): nothing renews the job's lease any more, so the
job, which runs on, stops before it registers (INFRA, exit 75, saying why), registers no model version and writes no
result; the next reconcile ends its job history row. No process is left (``no_orphans``). A retry that reattaches
to the job renews its lease at once: the adopted job registers its model (the job checks only at its end, so a lease
that lapsed while no runner was there does not stop a job adopted before that end).
"""

from __future__ import annotations

import json
import signal

import pytest
from process_guard import no_orphans  # noqa: F401
from test_local_agent_kill import model_versions
from test_training_operator import driver, finish, jobs_now, new_jobs, wait_for, world  # noqa: F401

from operators.jobs import read_heartbeats

LEASE_S = 4  # at least 3 x the drivers' poll of 0.5 s; far shorter than starting and training the tiny job


@pytest.mark.integration
def test_a_job_whose_runner_was_killed_registers_nothing_and_its_row_ends(
    world, tmp_path, monkeypatch, no_orphans,  # noqa: F811
):
    from operators import quotas
    from services import job_history

    monkeypatch.setenv("PINFLOW_JOB_HISTORY__LEASE_S", str(LEASE_S))
    monkeypatch.setenv("PINFLOW_TRAINING__POLL_SECONDS", "0.5")  # as the driver's (a lease needs 3 polls)
    home, before, versions_before = world, jobs_now(world), model_versions(world)
    log = tmp_path / "driver.log"
    proc = driver("run", {"overrides": {"epochs": 2}}, log)
    job = wait_for(lambda: [j for j in new_jobs(home, before) if (j / "request.json").exists()], "the job", proc, log)[0]
    # Its row names the job (mark_submitted) before the runner dies: what reconcile then asks the backend about.
    row = wait_for(lambda: (r := job_history.get(job.name)) and r["job_id"] and r, "the submitted row", proc, log)
    proc.send_signal(signal.SIGKILL)  # the runner (and its in-line triggerer) dies; the job runs on, unwatched
    proc.wait()
    run_dir = home / "runs" / job.name
    assert json.loads((run_dir / "RUN.json").read_text())["lease_s"] == LEASE_S
    assert (run_dir / "LEASE.json").exists()

    exit_file = job / "node-0.exit"
    wait_for(exit_file.exists, "the job's end", _Alive(), log, timeout=300)
    node_log = "\n".join(p.read_text(errors="replace") for p in job.glob("node-*.log"))
    assert exit_file.read_text().strip() == "75", node_log[-4000:]  # INFRA: a retry resumes from its checkpoint
    assert "no task has watched this job for" in node_log and "not registering" in node_log, node_log[-4000:]
    failure = json.loads((run_dir / "failure-rank0.json").read_text())
    assert failure["failure_class"] == "INFRA" and "its task is gone" in failure["message"]
    assert not (run_dir / "result.json").exists()
    assert model_versions(home) == versions_before  # no orphan model version

    assert job_history.get(job.name)["state"] in job_history.ACTIVE  # nobody recorded its end ...
    assert quotas.reconcile(row["team"]) >= 1  # ... until the next reconcile
    ended = job_history.get(job.name)
    assert ended["state"] == job_history.FAILED and ended["failure_class"] == "INFRA" and ended["ended_at"], ended
    assert "its task is gone" in ended["reason"], ended["reason"]


@pytest.mark.integration
@pytest.mark.extended  # test_training_operator's reattach test, with a lease shorter than the runner's absence
def test_a_retry_that_reattaches_renews_the_lease_and_the_adopted_job_registers(
    world, tmp_path, monkeypatch, no_orphans,  # noqa: F811
):
    monkeypatch.setenv("PINFLOW_JOB_HISTORY__LEASE_S", str(LEASE_S))
    monkeypatch.setenv("PINFLOW_TRAINING__POLL_SECONDS", "0.5")
    home, before, versions_before = world, jobs_now(world), model_versions(world)
    log = tmp_path / "driver.log"
    proc = driver("run", {}, log)
    job = wait_for(lambda: [j for j in new_jobs(home, before) if (j / "request.json").exists()], "the job", proc, log)[0]
    run_dir = home / "runs" / job.name
    wait_for(lambda: any(b.get("step", 0) >= 2 for b in read_heartbeats(run_dir)), "training steps", proc, log)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = (run_dir / "LEASE.json").stat().st_mtime
    log2 = tmp_path / "resume.log"
    summary = finish(driver("resume", {}, log2), log2)
    assert summary["train_state"] == "success" and summary["train_try"] == 2, (summary, log2.read_text()[-4000:])
    assert [j.name for j in new_jobs(home, before)] == [job.name]  # adopted, not resubmitted
    assert (run_dir / "LEASE.json").stat().st_mtime > killed_at  # renewed by the retry
    assert (run_dir / "result.json").exists() and model_versions(home) == versions_before + 1


class _Alive:
    """``wait_for`` checks that its process still runs: here the driver is dead on purpose and the job is waited for."""

    def poll(self) -> None:
        return None
