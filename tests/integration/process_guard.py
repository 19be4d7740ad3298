"""A fixture that fails a test if a process it started outlives it.

``no_orphans`` makes the test process a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``) for the test, so
that a process whose parent died (a torchrun worker whose agent was killed, a job node whose Airflow worker
exited) is re-parented to it instead of to PID 1 and stays visible. After the test it waits a few seconds
for every descendant that was not there before to end, then kills and reaps what is left and fails the test
naming each process. Import it into a test module: ``from process_guard import no_orphans  # noqa: F401``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> bool:
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _stat(pid: str) -> tuple[int, str] | None:
    """(parent pid, state letter) of a process, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0]


def descendants(root: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``root``: pid -> command line."""
    parents: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            found = _stat(entry.name)
            if found:
                parents.setdefault(found[0], []).append(int(entry.name))
                states[int(entry.name)] = found[1]
    out: dict[int, str] = {}
    todo = list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(parents.get(pid, []))
        if states.get(pid) != "Z":
            try:
                out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
            except OSError:
                continue
    return out


def _reap(before: set[int]) -> None:
    """Collect this process's zombie children that the test started (orphans re-parented here among them)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in before:
            found = _stat(entry.name)
            if found and found[0] == me and found[1] == "Z":
                try:
                    os.waitpid(int(entry.name), os.WNOHANG)
                except ChildProcessError:
                    pass


def leftovers(before: set[int], grace_seconds: float) -> dict[int, str]:
    deadline = time.monotonic() + grace_seconds
    while True:
        _reap(before)
        left = {pid: cmd for pid, cmd in descendants(os.getpid()).items() if pid not in before}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture
def no_orphans() -> Iterator[None]:
    """Fail the test if a process it started (or an orphan of one) is still alive after it; kill those."""
    before = set(descendants(os.getpid()))
    subreaper = _set_subreaper(True)
    try:
        yield
    finally:
        left = leftovers(before, grace_seconds=15.0)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        _reap(before)
        if subreaper:
            _set_subreaper(False)
    if left:
        pytest.fail("processes outlived the test (killed now):\n" + "\n".join(f"  {p}: {c}" for p, c in left.items()))
