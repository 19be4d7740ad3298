"""Scratch folders of one process (DuckDB's spill files, torchrun's logs, Data Docs renders, shard caches).

A process removes its scratch folder when it ends, but a SIGKILL (the OOM killer, ``kill -9``, a node taken away)
skips every cleanup. So each folder is named for its host and process (``<prefix><host>.<pid>.<random>``), and making
one removes the folders of the same prefix that a process of this host left behind: those whose process is gone.
A folder of another host (a shared temp folder) or of a live process is never touched. Processes that share a temp
folder are expected to share a PID namespace or to differ in hostname (containers do, unless they share the host's
network namespace and its /tmp).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager


def _host() -> str:
    # A name part without the separators the folder name is parsed by (hostnames may hold dots).
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or no pid at all
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_abandoned(prefix: str, parent: str | None = None) -> list[str]:
    """Remove the scratch folders of ``prefix`` in ``parent`` (default: the system's temp folder) that a process of
    this host left when it was killed; the paths removed."""
    parent = parent or tempfile.gettempdir()
    pattern = re.compile(re.escape(prefix) + re.escape(_host()) + r"\.(\d+)\.[^.]+$")
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = pattern.match(name)
        if match and int(match.group(1)) != os.getpid() and not _running(int(match.group(1))):
            path = os.path.join(parent, name)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def make_scratch(prefix: str, parent: str | None = None) -> str:
    """A new scratch folder of this process (the caller removes it); first removes those killed processes left."""
    remove_abandoned(prefix, parent)
    return tempfile.mkdtemp(prefix=f"{prefix}{_host()}.{os.getpid()}.", dir=parent)


@contextmanager
def scratch(prefix: str, parent: str | None = None) -> Iterator[str]:
    """``make_scratch`` as a context: the folder is removed on leaving it."""
    path = make_scratch(prefix, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
