"""The embedded default backend: the job's processes run on this machine.

A distributed job starts one ``training.launch`` agent per node, the agents meeting through a c10d
rendezvous on localhost (several agents stand for several nodes). Every job has a folder
``<home>/jobs/<name>/`` holding its request, each node's pid, log and exit code, so a restarted Airflow
worker finds the job again and never starts it twice.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from core import storage
from core.failures import FailureClass, Finding, classify_exit_code, decide
from operators.backends.base import JobSpec, JobState, JobStatus, launch_command

REPO_ROOT = Path(__file__).resolve().parents[2]
# The node wrapper: run the command, then record its exit code atomically, even if the worker that
# started it is gone by then.
_WRAPPER = '"$@"; code=$?; echo $code > "$0.tmp" && mv "$0.tmp" "$0"; exit $code'


class LocalBackend:
    name = "local"

    def __init__(self, home: str | os.PathLike[str]) -> None:
        self.jobs_dir = Path(home) / "jobs"

    def job_dir(self, job_id: str) -> Path:
        return self.jobs_dir / job_id

    def dry_run(self, spec: JobSpec) -> dict[str, Any]:
        spec.validate()  # the team is checked by the operator; the local machine serves every team
        job_dir = self.job_dir(spec.name)
        if spec.distributed:
            # A fixed port per job name keeps the dry run pure; collisions across jobs are unlikely.
            port = 20000 + zlib.crc32(spec.name.encode()) % 20000
            nodes = [
                launch_command(spec, python=sys.executable, rendezvous=(
                    f"--nnodes={spec.nodes}", f"--node-rank={rank}", f"--rdzv-endpoint=127.0.0.1:{port}",
                ))
                for rank in range(spec.nodes)
            ]
        else:
            nodes = [launch_command(spec, python=sys.executable)]
        return {
            "job_name": spec.name,
            "job_dir": str(job_dir),
            "team": spec.team,
            "timeout_s": spec.timeout_s,
            "env": {"PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", **spec.env},
            "nodes": [
                {"argv": argv, "log": str(job_dir / f"node-{rank}.log"), "exit_file": str(job_dir / f"node-{rank}.exit")}
                for rank, argv in enumerate(nodes)
            ],
        }

    def find(self, job_name: str) -> str | None:
        return job_name if (self.job_dir(job_name) / "request.json").exists() else None

    def submit(self, spec: JobSpec) -> str:
        existing = self.find(spec.name)
        if existing:
            return existing
        request = self.dry_run(spec)
        job_dir = self.job_dir(spec.name)
        job_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **request["env"]}
        pids = []
        for node in request["nodes"]:
            with open(node["log"], "ab") as log:
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, node["exit_file"], *node["argv"]],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env=env, cwd=REPO_ROOT, start_new_session=True,
                )
            pids.append(proc.pid)
        request["pids"] = pids
        # Written last: a job folder without request.json was never started.
        storage.write_json(str(job_dir / "request.json"), request)
        return spec.name

    def _request(self, job_id: str) -> dict[str, Any]:
        path = self.job_dir(job_id) / "request.json"
        if not path.exists():
            raise LookupError(f"local job {job_id!r} not found: no {path}")
        return json.loads(path.read_text())

    def status(self, job_id: str) -> JobStatus:
        request = self._request(job_id)
        codes: dict[str, int | None] = {}
        lost = []
        for rank, (node, pid) in enumerate(zip(request["nodes"], request["pids"], strict=True)):
            exit_file = Path(node["exit_file"])
            _reap(pid)
            if exit_file.exists():
                codes[f"node-{rank}"] = int(exit_file.read_text().strip() or 1)
            else:
                codes[f"node-{rank}"] = None
                if not _alive(pid):
                    lost.append(rank)
        decided = decide(
            Finding(classify_exit_code(code) or FailureClass.USER, f"{node} exited with code {code}")
            for node, code in codes.items() if code not in (None, 0)
        )
        if decided is not None:
            return JobStatus(job_id, JobState.FAILED, decided.failure_class, decided.message, codes)
        if lost:
            reason = f"node(s) {lost} disappeared without an exit code (process killed or host lost)"
            return JobStatus(job_id, JobState.FAILED, FailureClass.INFRA, reason, codes)
        if all(code == 0 for code in codes.values()):
            return JobStatus(job_id, JobState.SUCCEEDED, None, "", codes)
        return JobStatus(job_id, JobState.RUNNING, None, "", codes)

    def logs(self, job_id: str, tail: int = 50) -> str:
        request = self._request(job_id)
        parts = []
        for rank, node in enumerate(request["nodes"]):
            path = Path(node["log"])
            lines = path.read_text(errors="replace").splitlines()[-tail:] if path.exists() else []
            parts.append(f"--- node {rank} ({path}) ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def ping(self) -> None:
        self.jobs_dir.mkdir(parents=True, exist_ok=True)

    def console_url(self, job_id: str) -> str:
        return self.job_dir(job_id).as_uri()

    def cancel(self, job_id: str, grace_seconds: float = 20.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after ``grace_seconds``) and return once they are gone,
        so a retry never finds the cancelled job still running."""
        request = self._request(job_id)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in request["pids"]:
                try:
                    os.killpg(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline:
                for pid in request["pids"]:
                    _reap(pid)
                if not any(_alive(pid) for pid in request["pids"]):
                    return
                time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> None:
    """Collect our own finished child, so it does not linger as a zombie that looks alive."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
