"""One writer per run directory: an ``flock`` held by the process that writes it.

The process that writes a run directory (rank 0 under torchrun) takes an exclusive
``fcntl.flock`` on ``RUN_DIR/.trajgrad-lock`` before it reads or changes anything there,
and writes into that file who it is: process id, host and start time (UTC). A second
writer (a second ``trajgrad train --resume R``, a new run with ``--overwrite`` into a run
that is still going) is refused with one line naming the holder::

    run_dir: runs/x is being written by another trajgrad process (pid 4242 on host-a,
    started 2026-12-06 08:59:01 UTC); wait for it to end, or stop it first

The kernel releases the lock when the holder's process ends, however it ends (``kill
-9`` included), so nothing stale is left to clean: a later writer takes the lock and
overwrites the holder record. The lock belongs to the open file description: a child
made by ``fork`` without ``exec`` shares it until it exits; children started with
``exec`` do not (the descriptor is close-on-exec).

Process ids are not used to decide anything (they are reused, in containers often):
they are only shown. Locks on network file systems are as reliable as the server's
``flock`` emulation.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

__all__ = ["LOCK_FILE", "RunDirLock", "RunDirLocked", "lock_run_dir"]

LOCK_FILE = ".trajgrad-lock"
_HOLDER_WAIT_S = 0.5  # how long a refused writer waits for a just-started holder's record


class RunDirLocked(ValueError):
    """The run directory is being written by another process (the message names it)."""


class RunDirLock:
    """A held lock on a run directory; :meth:`release` (or the process's end) frees it."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the last descriptor releases the flock

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The holder's record as one phrase (it may still be writing it: waits briefly)."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        try:
            data = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
            started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(data["started"])))
            return f"pid {int(data['pid'])} on {data.get('host') or '?'}, started {started}"
        except (ValueError, KeyError, TypeError, OSError):
            if time.monotonic() >= deadline:
                return "its record is not readable"
            time.sleep(0.02)


def lock_run_dir(run_dir) -> Optional[RunDirLock]:
    """Take the run directory's lock, or raise :class:`RunDirLocked` naming the holder.

    Returns None when ``run_dir`` is not an existing directory (there is nothing to lock
    yet; the caller's own checks say what is wrong with it).

    Raises:
      RunDirLocked: another live process holds the lock (a ``ValueError`` naming
        ``run_dir``, the holder's pid, host and start time).
    """
    path = Path(run_dir)
    if not path.is_dir():
        return None
    fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            os.close(fd)
            raise
        holder = _holder(fd)
        os.close(fd)
        raise RunDirLocked(
            f"run_dir: {path} is being written by another trajgrad process ({holder}); "
            "wait for it to end, or stop it first"
        ) from None
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}) + "\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode("utf-8"), 0)
    os.fsync(fd)
    return RunDirLock(path, fd)
