"""The local backend's node supervisor: run one node's command and record how it ended.

    python operators/backends/local_node.py EXIT_FILE END_FILE -- ARGV...

Started by :class:`~operators.backends.local.LocalBackend` in a session of its own, so it outlives the Airflow
worker that submitted the job (a restarted worker reattaches through the files). It writes ``END_FILE``
(JSON: code, signal, whether the kernel OOM-killed a process meanwhile, start and end times) and then
``EXIT_FILE`` (the code alone, the marker that the node ended), each through a temporary file and a rename.

The code is the child's exit status, or minus the signal that killed it, as Python's ``subprocess`` reports it:
a shell's ``$?`` would say 137 both for an ``exit(137)`` (the job's documented OOM code) and for a SIGKILL from
outside (a lost node: INFRA), and only the kernel can say that a SIGKILL was its OOM killer's (the ``oom_kill``
counter of the cgroup's ``memory.events``, read before and after).

The supervisor ignores SIGTERM and SIGINT: a cancel signals the whole process group, the child stops, and the
supervisor still records its end. Run by path, not with ``-m``, so that it imports no package but the launcher's.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from training.launch import cgroup_oom_kills


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: local_node.py EXIT_FILE END_FILE -- ARGV...", file=sys.stderr)
        return 2
    exit_file, end_file, command = argv[0], argv[1], argv[3:]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    oom_before = cgroup_oom_kills()
    started = time.time()
    try:
        # The child gets the default dispositions back (Popen restores SIGPIPE etc.; SIG_IGN would be inherited).
        child = subprocess.Popen(command, preexec_fn=_default_signals)
        code = child.wait()
    except OSError as err:
        print(f"pinflow local node: cannot start {command[:3]}: {err}", file=sys.stderr)
        code = 127
    oom_after = cgroup_oom_kills()
    killed_by = signal.Signals(-code).name if code < 0 else ""
    record = {
        "code": code,
        "signal": killed_by,
        "oom_kill": oom_before is not None and oom_after is not None and oom_after > oom_before,
        "started_at": started,
        "ended_at": time.time(),
    }
    _write(end_file, json.dumps(record))
    _write(exit_file, f"{code}\n")
    return 128 - code if code < 0 else code


def _default_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
