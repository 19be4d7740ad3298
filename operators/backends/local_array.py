"""The local backend's array runner: run an array job's children as parallel processes, a few at a time.

    python operators/backends/local_array.py ARRAY_JSON

Started by :class:`~operators.backends.local.LocalBackend` in a session of its own (so it outlives the Airflow
worker that submitted the job, and a cancel's signal to its process group reaches every child). ``ARRAY_JSON``
is the job's request: ``nodes`` (each child's argv, log, exit and end files and its ``PINFLOW_ARRAY_INDEX``),
``array.parallelism``, the environment, the node supervisor's path. Each child runs under the node supervisor
(``local_node.py``), which records how it ended; the runner only starts them, ``parallelism`` at a time, in index
order. A child that fails does not stop the others. On SIGTERM (a cancel) it starts no more children and waits
for the running ones, which got the same signal. Run by path, not with ``-m``: it imports nothing of pinflow.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: local_array.py ARRAY_JSON", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        request = json.load(f)
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    env = {**os.environ, **request["env"]}
    parallelism = max(1, int(request["array"]["parallelism"]))
    pending = list(enumerate(request["nodes"]))
    running: list[subprocess.Popen[bytes]] = []
    while (pending and not stopping) or running:
        while pending and not stopping and len(running) < parallelism:
            index, node = pending.pop(0)
            with open(node["log"], "ab") as log:
                running.append(subprocess.Popen(
                    [request["python"], "-P", request["supervisor"], node["exit_file"], node["end_file"], "--",
                     *node["argv"]],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**env, **node.get("env", {})}, cwd=request["cwd"],
                ))
            print(f"started array child {index} (pid {running[-1].pid})", flush=True)
        running = [proc for proc in running if proc.poll() is None]
        time.sleep(0.05)
    if stopping and pending:
        print(f"stopped: {len(pending)} array child(ren) never started", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
