"""Start a distributed job on one node: ``python -m training.launch [launch options] -- -m training.train ...``.

This is the container entry point on every backend. It derives torchrun's rendezvous from what the
platform sets, runs ``torchrun`` for this node, and exits with the code of the first worker that failed
(``core.failures.ExitCode``) instead of torchrun's bare 1, so every backend classifies the same way:

- local: ``--nnodes``, ``--node-rank`` and ``--rdzv-endpoint`` given by the local backend;
- AWS Batch multi-node: ``AWS_BATCH_JOB_NUM_NODES``, ``AWS_BATCH_JOB_NODE_INDEX`` and
  ``AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS`` (the main node's own address is not set on it);
- Kubeflow Trainer v2 TrainJob: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``;
- Kubeflow PyTorchJob: ``MASTER_ADDR``, ``MASTER_PORT``, and ``PET_NNODES`` / ``PET_NODE_RANK`` (set with
  ``nprocPerNode``) or else ``WORLD_SIZE`` (nodes) and ``RANK`` (node rank).

Workers die with their agent: torchrun starts each worker in a session of its own, so a SIGKILL of the agent
would leave them training (and registering a model) as orphans. Each worker is therefore started through
``python -m training.launch --worker -- <command>``, which asks the kernel for SIGKILL when its parent dies
(``prctl(PR_SET_PDEATHSIG)``) and then execs the command; the agent itself gets SIGTERM when the process that
started it dies (the local backend's node supervisor), which torchrun turns into stopping its workers.

A worker killed by a signal is INFRA (exit 75), unless the kernel says it ran out of memory: the ``oom_kill``
counter of this cgroup's ``memory.events`` (cgroup v2) rose while the workers ran, then the node exits 137 (OOM).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from core.failures import ExitCode, InfraError
from core.scratch import make_scratch

DEFAULT_PORT = 29400
AGENT_PID_ENV = "PINFLOW_AGENT_PID"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def cgroup_oom_kills(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The ``oom_kill`` counter of this process's cgroup v2 (``memory.events``, which counts descendants too).

    None when there is no cgroup v2 memory controller to read (cgroup v1, macOS): then no kill can be called OOM.
    """
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
        path = next(line.split("::", 1)[1] for line in lines if line.startswith("0::"))
        events = Path(root, path.lstrip("/"), "memory.events").read_text()
    except (OSError, StopIteration, IndexError):
        return None
    for line in events.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return None


def oom_killed_since(before: int | None) -> bool:
    """True if the kernel's OOM killer killed a process of this cgroup since the counter read ``before``."""
    after = cgroup_oom_kills()
    return before is not None and after is not None and after > before


def rendezvous_from_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """Node count, node rank and rendezvous endpoint from a platform's variables, if it set them."""
    if "AWS_BATCH_JOB_NUM_NODES" in env:
        index = env.get("AWS_BATCH_JOB_NODE_INDEX", "0")
        # Batch sets the main node's address on the other nodes only: the main node hosts the rendezvous.
        main = env.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS") or "127.0.0.1"
        return {
            "nnodes": env["AWS_BATCH_JOB_NUM_NODES"],
            "node_rank": index,
            "endpoint": f"{main}:{env.get('PINFLOW_RDZV_PORT', DEFAULT_PORT)}",
        }
    if "PET_MASTER_ADDR" in env and "PET_NNODES" in env:
        # Kubeflow Trainer v2 (the Torch ML policy): node count and rank, and the first node's address.
        return {
            "nnodes": env["PET_NNODES"],
            "node_rank": env.get("PET_NODE_RANK", "0"),
            "endpoint": f"{env['PET_MASTER_ADDR']}:{env.get('PET_MASTER_PORT', DEFAULT_PORT)}",
        }
    if "MASTER_ADDR" in env and ("PET_NNODES" in env or "WORLD_SIZE" in env):
        # With nprocPerNode set, the training operator sets PET_NNODES / PET_NODE_RANK (torchrun's view) and
        # WORLD_SIZE = nodes x processes; without it, WORLD_SIZE and RANK count nodes.
        return {
            "nnodes": env.get("PET_NNODES") or env["WORLD_SIZE"],
            "node_rank": env.get("PET_NODE_RANK") or env.get("RANK", "0"),
            "endpoint": f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', DEFAULT_PORT)}",
        }
    return None


def torchrun_args(
    command: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    rdzv_id: str = "pinflow",
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """The torchrun argument list for this node; explicit arguments win over the platform's variables."""
    found = rendezvous_from_env(env if env is not None else os.environ) or {}
    nnodes = nnodes if nnodes is not None else int(found.get("nnodes", 1))
    node_rank = node_rank if node_rank is not None else int(found.get("node_rank", 0))
    endpoint = rdzv_endpoint or found.get("endpoint")
    if nnodes == 1 and not endpoint:
        rdzv = ["--standalone"]
    else:
        if not endpoint:
            raise ValueError(
                f"a job on {nnodes} nodes needs a rendezvous endpoint: pass --rdzv-endpoint or run where "
                "AWS Batch, a TrainJob or a PyTorchJob sets the main node's address"
            )
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]
    return [
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        "--max-restarts=0",
        *rdzv,
        # Each worker through the shim that ties its life to the agent's (see the module's docstring).
        "-m", "training.launch", "--worker", "--",
        *command,
    ]


def exit_code_of_failures(exit_codes: Sequence[int], *, oom_killed: bool = False) -> int:
    """One exit code for a node from its workers' codes.

    A class code a worker chose (DATA, INFRA, NaN, OOM) wins; then a worker killed by a signal other than
    SIGTERM (killed from outside: lost node: INFRA; OOM only if ``oom_killed``, the kernel's own count of its
    OOM kills rose); then a bare 1 (an uncaught exception: USER); a SIGTERM alone last (INFRA). torchrun itself
    sends SIGTERM to the surviving workers once one fails, so a SIGTERM is usually a consequence, not the cause.
    """
    for pick in (lambda c: c > 1, lambda c: c < 0 and c != -signal.SIGTERM, lambda c: c == 1, lambda c: c != 0):
        chosen = [c for c in exit_codes if pick(c)]
        if chosen:
            if chosen[0] == -signal.SIGKILL and oom_killed:
                return int(ExitCode.OOM)
            return int(ExitCode.INFRA) if chosen[0] < 0 else chosen[0]
    return int(ExitCode.OK)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m training.launch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="worker processes on this node")
    parser.add_argument("--nnodes", type=int, default=None, help="nodes in the job (default: from the platform)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: from the platform)")
    parser.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous")
    parser.add_argument("--rdzv-id", default="pinflow", help="a job-unique rendezvous id")
    parser.add_argument(
        "--preflight", action="store_true",
        help="first run `-m training.preflight --config <the command's --config>` in the same world; "
        "if a check fails, exit with its code (65 DATA, 75 INFRA) without training",
    )
    parser.add_argument(
        "--worker", action="store_true",
        help="(what torchrun runs for each worker) die with the agent (PR_SET_PDEATHSIG), then exec the command",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command, e.g. -m training.train")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the worker command after --, e.g. -- -m training.train --config RUN.json")
    if args.worker:
        return become_worker(command)
    # The agent stops (torchrun stops its workers on SIGTERM) when whoever started it dies.
    set_parent_death_signal(signal.SIGTERM)
    os.environ[AGENT_PID_ENV] = str(os.getpid())

    claims: list[int] = []
    if _node_rank(args) == 0:  # one node holds the run's folders, before any worker (or preflight) writes
        try:
            claims = _claim_run_folders(command)
        except InfraError as err:
            print(f"pinflow launch: {err}", file=sys.stderr)
            return int(ExitCode.INFRA)
    try:
        return _run_steps(command, args)
    finally:
        for fd in claims:
            os.close(fd)


def _node_rank(args: argparse.Namespace) -> int:
    if args.node_rank is not None:
        return int(args.node_rank)
    return int((rendezvous_from_env(os.environ) or {}).get("node_rank", 0))


def _claim_run_folders(command: Sequence[str]) -> list[int]:
    """The run's folders claimed for this job (``training.runtime.hold_run_folders``); none when the command has no
    readable RUN.json (the workers then report what is wrong with it, classified)."""
    from training.config import RunConfig
    from training.runtime import hold_run_folders

    path = config_path(command)
    try:
        config = RunConfig.from_json(path) if path else None
    except Exception:  # noqa: BLE001 - the workers read it again and fail with its class and message
        return []
    return hold_run_folders(config.checkpoint_dir, config.output_dir) if config else []


def _run_steps(command: Sequence[str], args: argparse.Namespace) -> int:
    steps = [(command, args.rdzv_id)]
    if args.preflight:
        steps.insert(0, (preflight_command(command), f"{args.rdzv_id}-preflight"))
    for step, rdzv_id in steps:
        code = _run_torchrun(step, args, rdzv_id)
        if code != ExitCode.OK:
            return code
    return ExitCode.OK


def config_path(command: Sequence[str]) -> str | None:
    """The ``--config`` of a worker command (``--config X`` or ``--config=X``); None without one."""
    items = list(command)
    for i, item in enumerate(items):
        if item == "--config" and i + 1 < len(items):
            return items[i + 1]
        if item.startswith("--config="):
            return item.removeprefix("--config=")
    return None


def preflight_command(command: Sequence[str]) -> list[str]:
    """``-m training.preflight --config X`` for a worker command that has ``--config X``."""
    path = config_path(command)
    if path is None:
        raise ValueError(f"--preflight needs the worker command's --config RUN.json: {' '.join(command)}")
    return ["-m", "training.preflight", "--config", path]


def become_worker(command: Sequence[str]) -> int:
    """Tie this worker's life to its agent's, then replace this process by ``python -u <command>``.

    The parent-death signal survives ``exec``. If the agent is already gone (it died between starting this
    process and the ``prctl``), exit as INFRA instead of training as an orphan.
    """
    agent = int(os.environ.get(AGENT_PID_ENV, "0") or 0)
    set_parent_death_signal(signal.SIGKILL)
    if agent and os.getppid() != agent:
        print(f"pinflow launch: the agent (pid {agent}) is gone; not starting {' '.join(command[:2])}", file=sys.stderr)
        return int(ExitCode.INFRA)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-u", *command])
    return int(ExitCode.INFRA)  # not reached: execv replaces the process or raises


def _run_torchrun(command: Sequence[str], args: argparse.Namespace, rdzv_id: str) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import parse_args, run

    # torchrun's per-rank folders (its error files), which it would otherwise leave in /tmp after every job.
    logs = make_scratch("pinflow-torchrun-")
    torch_args = parse_args([
        f"--log-dir={logs}",
        *torchrun_args(
            command,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=rdzv_id,
        ),
    ])
    oom_kills, parent = cgroup_oom_kills(), os.getppid()
    try:
        run(torch_args)
    except ChildFailedError as err:
        codes = [failure.exitcode for _, failure in sorted(err.failures.items())]
        oom = oom_killed_since(oom_kills)
        code = exit_code_of_failures(codes, oom_killed=oom)
        print(f"pinflow launch: {' '.join(command[:2])} workers failed with exit codes {codes}"
              f"{' (the kernel OOM-killed a process: memory.events oom_kill rose)' if oom else ''}; node exits {code}",
              file=sys.stderr)
        return code
    except RendezvousError as err:
        # The nodes could not meet (the store's port taken, a node gone or late): the machines, not the code.
        print(f"pinflow launch: the rendezvous failed ({type(err).__name__}: {err}; {err.__cause__ or ''}); "
              f"node exits {int(ExitCode.INFRA)}", file=sys.stderr)
        return int(ExitCode.INFRA)
    except SignalException as err:
        # Stopped from outside (cancel, Batch timeout, pod deletion, the supervisor gone): torchrun has stopped
        # the workers; the node was taken away, not failed by its code.
        # The agent dies with whoever started it (PR_SET_PDEATHSIG): a shell that ended, a supervisor gone.
        cause = " (the process that started this job ended)" if os.getppid() != parent else ""
        print(f"pinflow launch: stopped by {err.sigval.name}{cause}; workers stopped; node exits {int(ExitCode.INFRA)}",
              file=sys.stderr)
        return int(ExitCode.INFRA)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return int(ExitCode.OK)


if __name__ == "__main__":
    sys.exit(main())
