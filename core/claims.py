"""A process's claim on a folder (a checkpoint folder, the demo's home): a POSIX record lock on a file in it.

The kernel drops the lock when the process ends, however it ends (a SIGKILLed holder leaves no stale claim), and
forked children do not inherit it. The file holds who claimed it (host, pid, since when), for the message of the
process that finds it claimed.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import logging
import os
import socket

log = logging.getLogger(__name__)


class Claimed(Exception):
    """Another live process holds the claim: ``holder`` says which."""

    def __init__(self, path: str, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path, self.holder = path, holder


def hold(path: str) -> int | None:
    """Claim ``path`` (a lock file, created with its folder) until this process ends or closes the descriptor
    returned; :class:`Claimed` if another process holds it. None, with a warning, where the file cannot be locked
    (a read-only folder, another user's file, a file system without locks): the caller goes on unguarded."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # umask applies
    except OSError as err:
        log.warning("could not claim %s (%s): a second process given the same folder would not be stopped", path, err)
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        held = err.errno in (errno.EACCES, errno.EAGAIN)
        holder = os.pread(fd, 300, 0).decode(errors="replace").strip() if held else ""
        os.close(fd)
        if held:
            raise Claimed(path, holder or "another process") from None
        log.warning("could not claim %s (%s): a second process given the same folder would not be stopped", path, err)
        return None
    os.ftruncate(fd, 0)
    since = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}, since {since}".encode(), 0)
    return fd
