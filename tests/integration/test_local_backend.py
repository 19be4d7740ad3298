"""The local backend with real torchrun agents: two "nodes" meeting through a c10d rendezvous.

Every test runs under ``no_orphans``: a process it started that outlives it fails the test.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from process_guard import descendants, no_orphans  # noqa: F401

from core.failures import ExitCode, FailureClass
from operators.backends import JobSpec, JobState, get_backend

WORKER = str(Path(__file__).with_name("allreduce_worker.py"))
pytestmark = pytest.mark.usefixtures("no_orphans")


def wait(backend, job_id, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = backend.status(job_id)
        if status.state.terminal:
            return status
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still running after {timeout}s:\n{backend.logs(job_id)}")


def make_spec(name, out, **env):
    return JobSpec(name=name, command=[WORKER], team="ranking", distributed=True, nodes=2, procs_per_node=1,
                   env={"WORKER_OUT": str(out), "OMP_NUM_THREADS": "1", **env})


@pytest.mark.integration
def test_two_nodes_rendezvous_and_all_reduce(tmp_path):
    backend = get_backend("local", home=str(tmp_path))
    job = backend.submit(make_spec("allreduce-ok", tmp_path))
    status = wait(backend, job)
    assert status.state is JobState.SUCCEEDED, backend.logs(job)
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["2 3.0", "2 3.0"]
    # Submitting the same name again finds the job instead of starting a second one.
    assert backend.submit(make_spec("allreduce-ok", tmp_path)) == job
    assert len(list((tmp_path / "jobs").iterdir())) == 1


@pytest.mark.integration
def test_worker_exit_code_classifies_the_job(tmp_path):
    backend = get_backend("local", home=str(tmp_path))
    job = backend.submit(make_spec("allreduce-nan", tmp_path, WORKER_FAIL_RANK="1", WORKER_EXIT=str(int(ExitCode.NAN_LOSS))))
    status = wait(backend, job)
    assert status.state is JobState.FAILED
    assert status.failure_class is FailureClass.USER
    assert int(ExitCode.NAN_LOSS) in status.exit_codes.values()


@pytest.mark.integration
def test_killed_node_is_infra_and_cancel_stops_everything(tmp_path):
    backend = get_backend("local", home=str(tmp_path))
    job = backend.submit(make_spec("allreduce-kill", tmp_path, WORKER_SLEEP="60"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.txt"))) < 2:
        assert time.monotonic() < deadline, backend.logs(job)
        time.sleep(0.2)
    # Kill node 1's whole process group, as a lost host would.
    pids = json.loads((tmp_path / "jobs" / job / "request.json").read_text())["pids"]
    os.killpg(pids[1], signal.SIGKILL)
    time.sleep(1)
    status = backend.status(job)
    assert status.state is JobState.FAILED and status.failure_class is FailureClass.INFRA, status
    backend.cancel(job)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pids[0]}").exists() and "Z" not in Path(f"/proc/{pids[0]}/stat").read_text().split()[2]:
        assert time.monotonic() < deadline, "node 0 still running after cancel"
        time.sleep(0.2)
    assert backend.status(job).failure_class is FailureClass.INFRA


def children(pid: int) -> list[int]:
    return [p for p in descendants(pid) if Path(f"/proc/{p}/stat").exists()
            and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid]


def wait_gone(pids, timeout=30.0):
    deadline = time.monotonic() + timeout
    while any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
              for p in pids):
        assert time.monotonic() < deadline, f"still running: {pids}"
        time.sleep(0.2)


@pytest.mark.integration
def test_sigkill_of_the_agent_is_infra_and_its_workers_die_with_it(tmp_path):
    """The agent (training.launch) SIGKILLed: recorded as a signal, classed INFRA (retried), not OOM; its workers,
    in sessions of their own, get SIGKILL from the kernel as their parent dies (no orphan keeps training)."""
    backend = get_backend("local", home=str(tmp_path))
    job = backend.submit(make_spec("agent-kill", tmp_path, WORKER_SLEEP="60"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.txt"))) < 2:
        assert time.monotonic() < deadline, backend.logs(job)
        time.sleep(0.2)
    supervisor = json.loads((tmp_path / "jobs" / job / "request.json").read_text())["pids"][0]
    (agent,) = children(supervisor)
    workers = children(agent)
    assert workers and all("training.launch" in descendants(agent)[w] or WORKER in descendants(agent)[w] for w in workers)
    os.kill(agent, signal.SIGKILL)
    wait_gone(workers, timeout=10)
    deadline = time.monotonic() + 30
    while not (status := backend.status(job)).state.terminal:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert status.failure_class is FailureClass.INFRA and "node-0 was killed by SIGKILL" in status.reason, status
    assert status.exit_codes["node-0"] == -signal.SIGKILL
    end = json.loads((tmp_path / "jobs" / job / "node-0.end.json").read_text())
    assert end["signal"] == "SIGKILL" and end["oom_kill"] is False
    backend.cancel(job)  # node 1 is still waiting for its peer


@pytest.mark.integration
def test_sigkill_of_a_scoring_process_is_infra(tmp_path):
    backend = get_backend("local", home=str(tmp_path))
    spec = JobSpec(name="score-kill", command=["-c", "import time; print('SCORER-UP', flush=True); time.sleep(60)"],
                   team="ranking")
    job = backend.submit(spec)
    supervisor = json.loads((tmp_path / "jobs" / job / "request.json").read_text())["pids"][0]
    deadline = time.monotonic() + 30
    while "SCORER-UP" not in backend.logs(job):
        assert time.monotonic() < deadline, backend.logs(job)
        time.sleep(0.1)
    (scorer,) = children(supervisor)
    os.kill(scorer, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not (status := backend.status(job)).state.terminal:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert status.failure_class is FailureClass.INFRA and "SIGKILL" in status.reason, status
    assert "lower batch_size" not in status.reason


@pytest.mark.integration
def test_cancel_leaves_no_process(tmp_path):
    backend = get_backend("local", home=str(tmp_path))
    job = backend.submit(make_spec("allreduce-cancel", tmp_path, WORKER_SLEEP="60"))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.txt"))) < 2:
        assert time.monotonic() < deadline, backend.logs(job)
        time.sleep(0.2)
    backend.cancel(job)
    status = backend.status(job)
    assert status.state is JobState.FAILED and status.failure_class is FailureClass.INFRA, status
    assert not [p for p, cmd in descendants(os.getpid()).items() if WORKER in cmd or "training.launch" in cmd]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _platform_env(platform: str, rank: int, port: int) -> dict[str, str]:
    if platform == "batch":
        env = {"AWS_BATCH_JOB_NUM_NODES": "2", "AWS_BATCH_JOB_NODE_INDEX": str(rank), "PINFLOW_RDZV_PORT": str(port)}
        if rank:  # Batch sets the main node's address on the other nodes only
            env["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"
        return env
    if platform == "trainjob":  # Kubeflow Trainer v2's Torch policy
        return {"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
                "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    # What the Kubeflow training operator sets with nprocPerNode: torchrun's view in PET_*, WORLD_SIZE in processes.
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_NNODES": "2", "PET_NODE_RANK": str(rank),
            "PET_NPROC_PER_NODE": "1", "WORLD_SIZE": "2", "RANK": str(rank)}


@pytest.mark.integration
@pytest.mark.parametrize("platform", ["batch", "trainjob", "pytorchjob"])
def test_entry_point_takes_the_rendezvous_from_the_platform(tmp_path, platform):
    """Two "nodes" started with exactly the variables AWS Batch, a TrainJob or a PyTorchJob sets, and nothing else."""
    import subprocess

    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_BATCH_", "MASTER_", "PET_", "WORLD_SIZE", "RANK"))}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "training.launch", "--nproc-per-node=1", f"--rdzv-id={platform}", "--", WORKER],
            env={**base, **_platform_env(platform, rank, port), "WORKER_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"},
            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert sorted(p.read_text() for p in tmp_path.glob("rank*.txt")) == ["2 3.0", "2 3.0"]
