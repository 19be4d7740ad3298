"""Local backend requests (dry run), the launch contract, and failure classification."""

from __future__ import annotations

import socket
import sys

import pytest

from core.failures import ExitCode, FailureClass, classify_exit_code
from operators.backends import JobSpec, get_backend
from operators.backends.local import RENDEZVOUS_PORT_AT_SUBMIT, free_port, node_finding
from operators.jobs import job_name
from training.launch import cgroup_oom_kills, exit_code_of_failures, rendezvous_from_env, torchrun_args


def spec(**kw):
    base = dict(name="train-abc", command=["-m", "training.train", "--config", "/x/RUN.json"], team="ranking",
                distributed=True, nodes=2, procs_per_node=3)
    return JobSpec(**{**base, **kw})


@pytest.mark.unit
def test_local_dry_run_is_the_whole_request(tmp_path):
    request = get_backend("local", home=str(tmp_path)).dry_run(spec(), rendezvous_port=41234)
    port = 41234
    assert request == {
        "job_name": "train-abc",
        "job_dir": str(tmp_path / "jobs" / "train-abc"),
        "team": "ranking",
        "timeout_s": 6 * 3600,
        "env": {"PYTHONPATH": request["env"]["PYTHONPATH"], "PYTHONUNBUFFERED": "1"},
        "nodes": [
            {
                "argv": [sys.executable, "-m", "training.launch", "--nproc-per-node=3", "--nnodes=2",
                         f"--node-rank={rank}", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=train-abc",
                         "--", "-m", "training.train", "--config", "/x/RUN.json"],
                "log": str(tmp_path / "jobs" / "train-abc" / f"node-{rank}.log"),
                "exit_file": str(tmp_path / "jobs" / "train-abc" / f"node-{rank}.exit"),
                "end_file": str(tmp_path / "jobs" / "train-abc" / f"node-{rank}.end.json"),
            }
            for rank in range(2)
        ],
    }
    # Pure: the same spec gives the same request.
    assert get_backend("local", home=str(tmp_path)).dry_run(spec(), rendezvous_port=41234) == request
    # Without a port (what the operators' checks see): the port submit will find free, named.
    shown = get_backend("local", home=str(tmp_path)).dry_run(spec())["nodes"][1]["argv"][6]
    assert shown == f"--rdzv-endpoint=127.0.0.1:{RENDEZVOUS_PORT_AT_SUBMIT}"


@pytest.mark.unit
def test_a_one_node_job_needs_no_port_and_several_nodes_get_a_free_one(tmp_path):
    # One node: torchrun --standalone (the OS picks the store's port).
    argv = get_backend("local", home=str(tmp_path)).dry_run(spec(nodes=1))["nodes"][0]["argv"]
    assert argv[3:6] == ["--nproc-per-node=3", "--nnodes=1", "--node-rank=0"]
    assert not [a for a in argv if a.startswith("--rdzv-endpoint")]
    assert torchrun_args(argv[argv.index("--") + 1:], nproc_per_node=3, nnodes=1, node_rank=0, env={})[4] == "--standalone"
    # Several nodes: a port nothing listens on, a new one per job.
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # it was free


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"name": "Bad_Name"}, "name"),
        ({"nodes": 0}, "training.nodes"),
        ({"procs_per_node": 0}, "training.procs_per_node"),
        ({"distributed": False}, "distributed=True"),
        ({"command": []}, "command is empty"),
    ],
)
def test_invalid_spec_fails_before_submit_naming_the_setting(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        get_backend("local", home=str(tmp_path)).submit(spec(**change))
    assert not (tmp_path / "jobs").exists()


@pytest.mark.unit
def test_unknown_backend_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match="choose one of local"):
        get_backend("slurm", home=str(tmp_path))


@pytest.mark.unit
def test_job_names_are_deterministic_and_safe():
    a = job_name("train", "pin_ranker_training", "manual__2026-11-05T00:00:00+00:00", "try1")
    assert a == job_name("train", "pin_ranker_training", "manual__2026-11-05T00:00:00+00:00", "try1")
    assert a != job_name("train", "pin_ranker_training", "manual__2026-11-05T00:00:00+00:00", "try2")
    assert len(a) <= 63 and a.replace("-", "").isalnum() and a == a.lower()


@pytest.mark.unit
def test_rendezvous_from_platform_variables():
    batch_child = {"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "2",
                   "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"}
    assert rendezvous_from_env(batch_child) == {"nnodes": "4", "node_rank": "2", "endpoint": "10.0.0.5:29400"}
    batch_main = {"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "0"}
    assert rendezvous_from_env(batch_main)["endpoint"] == "127.0.0.1:29400"
    pytorchjob = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "1"}
    assert rendezvous_from_env(pytorchjob) == {"nnodes": "3", "node_rank": "1", "endpoint": "job-master-0:23456"}
    # Kubeflow Trainer v2's Torch policy (PET_MASTER_PORT is the Trainer's 29500).
    trainjob = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "8",
                "PET_MASTER_ADDR": "j-node-0-0.j", "PET_MASTER_PORT": "29500"}
    assert rendezvous_from_env(trainjob) == {"nnodes": "2", "node_rank": "1", "endpoint": "j-node-0-0.j:29500"}
    assert rendezvous_from_env({}) is None
    args = torchrun_args(["-m", "training.train"], nproc_per_node=8, env=pytorchjob)
    assert args[:3] == ["--nnodes=3", "--node-rank=1", "--nproc-per-node=8"]
    # Each worker through the shim that dies with the agent, then the command.
    assert args[4:] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "job-master-0:23456", "--rdzv-id", "pinflow",
                        "-m", "training.launch", "--worker", "--", "-m", "training.train"]
    assert torchrun_args(["x.py"], nproc_per_node=2, env={})[4] == "--standalone"
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        torchrun_args(["x.py"], nproc_per_node=2, nnodes=2, env={})


@pytest.mark.unit
def test_exit_codes_map_to_failure_classes():
    assert classify_exit_code(0) is None
    assert classify_exit_code(ExitCode.INFRA) is FailureClass.INFRA
    assert classify_exit_code(ExitCode.DATA) is FailureClass.DATA
    assert classify_exit_code(ExitCode.NAN_LOSS) is FailureClass.USER
    assert classify_exit_code(ExitCode.OOM) is FailureClass.OOM
    assert classify_exit_code(1) is FailureClass.USER
    assert classify_exit_code(-9) is FailureClass.INFRA
    # A node's code: the worker that chose a class beats peers that only saw it go (1) or were killed.
    assert exit_code_of_failures([1, ExitCode.NAN_LOSS]) == ExitCode.NAN_LOSS
    assert exit_code_of_failures([-9, 1]) == ExitCode.INFRA
    assert exit_code_of_failures([1, -9]) == ExitCode.INFRA
    assert exit_code_of_failures([1, 1]) == 1
    assert exit_code_of_failures([]) == 0
    # A SIGKILLed worker is OOM only if the kernel's OOM killer says so.
    assert exit_code_of_failures([-9, -15]) == ExitCode.INFRA
    assert exit_code_of_failures([-9, -15], oom_killed=True) == ExitCode.OOM


@pytest.mark.unit
def test_a_killed_node_is_infra_unless_the_kernel_oom_killed():
    killed = node_finding("node-0", -9, {"signal": "SIGKILL", "oom_kill": False})
    assert killed.failure_class is FailureClass.INFRA and killed.node_lost and "SIGKILL" in killed.message
    oom = node_finding("node-0", -9, {"signal": "SIGKILL", "oom_kill": True})
    assert oom.failure_class is FailureClass.OOM and "OOM killer" in oom.message
    assert node_finding("node-0", -15, {"oom_kill": True}).failure_class is FailureClass.INFRA
    # 137 as an exit code is the job's own OOM code (torch.OutOfMemoryError), 75 its INFRA.
    assert node_finding("node-0", 137, {}).failure_class is FailureClass.OOM
    assert node_finding("node-0", 75, {}).failure_class is FailureClass.INFRA


@pytest.mark.unit
def test_cgroup_oom_kill_counter(tmp_path):
    (tmp_path / "cgroup").write_text("0::/system.slice/job.scope\n")
    events = tmp_path / "root" / "system.slice" / "job.scope"
    events.mkdir(parents=True)
    (events / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroup_oom_kills(str(tmp_path / "cgroup"), str(tmp_path / "root")) == 2
    (tmp_path / "v1").write_text("12:memory:/docker/abc\n")  # cgroup v1: no evidence, so never OOM
    assert cgroup_oom_kills(str(tmp_path / "v1"), str(tmp_path / "root")) is None


@pytest.mark.unit
def test_sigterm_from_torchrun_is_a_consequence_not_the_cause():
    # torchrun SIGTERMs the surviving workers once one fails: the failing worker's code names the class.
    assert exit_code_of_failures([-15, 1]) == 1
    assert exit_code_of_failures([-15, -9]) == ExitCode.INFRA
    assert exit_code_of_failures([-15, -15]) == ExitCode.INFRA


@pytest.mark.unit
def test_preflight_runs_first_in_the_same_world(tmp_path):
    from training.launch import preflight_command

    argv = get_backend("local", home=str(tmp_path)).dry_run(spec(preflight=True))["nodes"][0]["argv"]
    assert argv[argv.index("--") - 1] == "--preflight"
    assert preflight_command(["-m", "training.train", "--config", "/r/RUN.json"]) == [
        "-m", "training.preflight", "--config", "/r/RUN.json"]
    with pytest.raises(ValueError, match="--config"):
        preflight_command(["-m", "training.train"])


@pytest.mark.unit
def test_nodes_that_cannot_meet_exit_as_infra(monkeypatch, capsys):
    # What a rendezvous port taken by another service gives (seen in CI before the ports were found free):
    # torch raises before any worker starts; the node is retried, not failed as the model code's fault.
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from training.launch import AGENT_PID_ENV, main

    def fail(_args):
        raise RendezvousConnectionError("The connection to the C10d store has failed.") from RuntimeError("Ping failed")

    monkeypatch.setattr(torch.distributed.run, "run", fail)
    monkeypatch.setattr("training.launch.set_parent_death_signal", lambda sig: True)
    monkeypatch.setenv(AGENT_PID_ENV, "")  # main() sets it: restored after the test
    code = main(["--nproc-per-node=2", "--nnodes=2", "--node-rank=1", "--rdzv-endpoint=127.0.0.1:1", "--",
                 "-m", "training.train"])
    assert code == ExitCode.INFRA and classify_exit_code(code) is FailureClass.INFRA
    assert "the rendezvous failed (RendezvousConnectionError" in capsys.readouterr().err
