"""Files renamed into a directory, as Linux's inotify reports them (IN_MOVED_TO), at once.

A file renamed into place was written whole before the rename: careful tools (`mv` of a temp
file, most editors, configuration managers) and the kubelet's ConfigMap swap (`..data` renamed
over) make edits that way. The upstreams file source applies such an edit right away instead of
waiting for the writer to go quiet and reading the file again, which it must do for a file written
in place (a half-written file must never be served). Elsewhere than Linux, or when inotify is not
available (its limits reached), nothing is reported and every edit takes the careful path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import struct
from collections.abc import Callable

log = logging.getLogger("eds_server.sources.file")

IN_MOVED_TO = 0x00000080
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of NUL-padded name


def _libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes, libc.inotify_init1.restype = [ctypes.c_int], ctypes.c_int
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_add_watch.restype = ctypes.c_int
        return libc
    return None


_LIBC = _libc()
AVAILABLE = _LIBC is not None and hasattr(_LIBC, "inotify_init1")  # else every edit takes the careful path


def names(data: bytes) -> list[str]:
    """The names of the IN_MOVED_TO events in a read of an inotify descriptor."""
    out, pos = [], 0
    while pos + _EVENT.size <= len(data):
        _, mask, _, length = _EVENT.unpack_from(data, pos)
        pos += _EVENT.size
        name = data[pos : pos + length].rstrip(b"\0")
        pos += length
        if mask & IN_MOVED_TO:
            out.append(os.fsdecode(name))
    return out


class Renames:
    """Calls `renamed(name)` on the event loop for each file renamed into `directory`, until closed."""

    def __init__(self, directory: str, renamed: Callable[[str], None]) -> None:
        self._fd = -1
        self._renamed = renamed
        if not AVAILABLE or _LIBC is None:
            return
        fd = _LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            log.debug("inotify unavailable (%s): renames take the careful path", os.strerror(ctypes.get_errno()))
            return
        if _LIBC.inotify_add_watch(fd, os.fsencode(directory), IN_MOVED_TO) < 0:
            log.debug("cannot watch %s for renames (%s)", directory, os.strerror(ctypes.get_errno()))
            os.close(fd)
            return
        self._fd = fd
        asyncio.get_running_loop().add_reader(fd, self._read)

    @property
    def active(self) -> bool:
        return self._fd >= 0

    def _read(self) -> None:
        try:
            data = os.read(self._fd, 64 * 1024)
        except BlockingIOError:
            return
        except OSError:
            self.close()
            return
        for name in names(data):
            self._renamed(name)

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
