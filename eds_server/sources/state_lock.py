"""One process holds a registration state file: an OS lock on `<state file>.lock`, holding its pid.

Two servers given one state file would each keep their own registrations and overwrite the other's
on every write, acknowledging changes that a restart then loses. The lock is on a separate file
because the state file itself is replaced (renamed over) on every write. `flock` locks go away with
the process, crash or `kill -9` included, so a stale lock file never blocks a restart.

Within one process, sources on the same file share the hold (tests load a file twice; a server has
one source per file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass

_held: dict[str, _Hold] = {}  # real path of the lock file -> this process's hold


class StateLockError(Exception):
    """Another process holds the state file."""


@dataclass
class _Hold:
    fd: int
    users: int


def lock_path(state_path: str) -> str:
    return state_path + ".lock"


class StateLock:
    """Holds `<state_path>.lock` from `acquire()` until `release()` (or the process ends)."""

    def __init__(self, state_path: str) -> None:
        self.path = lock_path(state_path)
        self._key: str | None = None

    def acquire(self) -> None:
        """Raise StateLockError naming the holder, or OSError if the lock file cannot be made."""
        if self._key is not None:
            return
        key = os.path.realpath(self.path)
        hold = _held.get(key)
        if hold is not None:
            hold.users += 1
            self._key = key
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"process {holder}" if holder else "another process"
                raise StateLockError(
                    f"the state file is in use by {who} (it holds {self.path}): one state file belongs to one "
                    "eds-server; replicas share registrations through --state etcd://..."
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = _Hold(fd, 1)
        self._key = key

    def release(self) -> None:
        key, self._key = self._key, None
        if key is None or (hold := _held.get(key)) is None:
            return
        hold.users -= 1
        if hold.users == 0:
            del _held[key]
            with contextlib.suppress(OSError):
                os.close(hold.fd)  # the lock goes with it; the file stays (removing it would race a new holder)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
