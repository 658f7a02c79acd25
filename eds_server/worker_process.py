"""The process side of `--workers N`: a worker started bound to its owner's life, the listening
sockets the owner binds and hands over, where new connections go, and the owner's private directory.

- Bound to the owner: the worker's first statement, before any module of ours is imported, asks the
  kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG); the next checks that its parent
  is still the owner whose pid it was given, which catches an owner that died before the prctl. The
  worker also looks for that pid once a second while it runs.
- Sockets: the owner binds one SO_REUSEPORT listening socket per worker on `--listen` before it says
  anything is served, holds them all for its whole life and hands each worker its own (an inherited
  descriptor). The port is never free while the owner lives: no other user can bind it (Linux lets
  only the same user join a SO_REUSEPORT group) and a bind failure stops the start at once.
- Steering: the kernel spreads new connections over the sockets by a hash of their addresses. While
  a worker is down, or when a fresh one should take load, a classic BPF program on the group sends
  new connections to chosen sockets instead (SO_ATTACH_REUSEPORT_CBPF; no privilege needed).
- The private directory (0700) holds the settings, the owner's socket and the workers' admin sockets.
  The owner holds a lock on a file in it: a directory whose lock nobody holds is a dead owner's, and
  is removed at the next start; a worker whose owner is gone removes it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import glob
import logging
import os
import select
import shutil
import socket
import struct
import tempfile
import time

log = logging.getLogger("eds_server.workers")

DIRECTORY_PREFIX = "eds-server-workers-"
LOCK_FILE = "owner.lock"
SO_ATTACH_REUSEPORT_CBPF = 51  # Linux 4.5
SO_DETACH_REUSEPORT_BPF = 68  # Linux 5.2

# `python -c` of a worker: argv is OWNER_PID then worker_main's arguments. The parent-death signal
# is set before anything else runs (ctypes only: libc's prctl, PR_SET_PDEATHSIG = 1), SIGHUP and
# SIGINT are ignored until the worker's loop handles them (a terminal's signals reach the whole
# process group; the owner forwards what it should), then the owner is checked to be alive.
BOOTSTRAP = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
    "signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(75)\n"
    "from eds_server.workers import worker_main\n"
    "sys.exit(worker_main(sys.argv[1:]))\n"
)
OWNER_GONE = 75  # the exit status of a worker that found its owner gone before it ran


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on one address, in one SO_REUSEPORT group, in worker order (the
    order a steering program's indices refer to). Port 0: the first socket's port for all. One
    address: an IPv6 literal (`::` takes IPv4 too), else IPv4. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    out: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(1024)
            port = sock.getsockname()[1]
    except OSError:
        for sock in out:
            sock.close()
        raise
    return out


class Steering:
    """Where the kernel sends new connections among the owner's listening sockets."""

    def __init__(self, sockets: list[socket.socket]) -> None:
        self.sockets = sockets
        self.to: tuple[int, ...] | None = None  # socket indices; None: the kernel's hash over all
        self._program: ctypes.Array[ctypes.c_ubyte] | None = None  # kept alive while attached

    def steer(self, indices: list[int]) -> bool:
        """New connections to these sockets only, at random among them; False if the kernel refused."""
        if tuple(indices) == self.to:
            return True
        if not indices or len(indices) == len(self.sockets):
            self.spread()
            return True
        program = _program(indices)
        fprog = struct.pack("HL", len(program) // 8, ctypes.addressof(program))
        try:
            self.sockets[0].setsockopt(socket.SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, fprog)
        except OSError as e:
            log.debug("cannot steer new connections: %s", e)
            return False
        self._program, self.to = program, tuple(indices)
        return True

    def spread(self) -> None:
        """Back to the kernel's hash over every socket."""
        if self.to is None:
            return
        with contextlib.suppress(OSError):
            self.sockets[0].setsockopt(socket.SOL_SOCKET, SO_DETACH_REUSEPORT_BPF, 0)
        self._program, self.to = None, None


def _program(indices: list[int]) -> ctypes.Array[ctypes.c_ubyte]:
    """Classic BPF: A = random % len(indices); return indices[A]."""
    ld_random = (0x20, 0, 0, 0xFFFFF000 + 56)  # ld [SKF_AD_OFF + SKF_AD_RANDOM]
    mod = (0x94, 0, 0, len(indices))  # alu mod #k
    body = [ld_random, mod]
    for position, index in enumerate(indices):
        body += [(0x15, 0, 1, position), (0x06, 0, 0, index)]  # jeq #position ? ret #index : next
    body.append((0x06, 0, 0, indices[0]))
    code = b"".join(struct.pack("HBBI", *instruction) for instruction in body)
    return (ctypes.c_ubyte * len(code)).from_buffer_copy(code)


def make_private_directory() -> tuple[str, int]:
    """A fresh private directory and the descriptor of the lock its owner holds while it lives;
    first removes what owners that died without cleaning up left behind."""
    remove_leftovers()
    directory = tempfile.mkdtemp(prefix=DIRECTORY_PREFIX)  # 0700
    lock = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return directory, lock


def remove_leftovers(parent: str | None = None) -> list[str]:
    """Remove this user's worker directories whose owner is gone (nobody holds their lock)."""
    removed = []
    for directory in glob.glob(os.path.join(parent or tempfile.gettempdir(), DIRECTORY_PREFIX + "*")):
        lock = os.path.join(directory, LOCK_FILE)
        try:
            if os.stat(directory).st_uid != os.getuid():
                continue
            if not os.path.exists(lock):  # an owner killed before it made its lock, or one making it now
                if time.time() - os.stat(directory).st_mtime > 10:
                    shutil.rmtree(directory, ignore_errors=True)
                    removed.append(directory)
                continue
            if time.time() - os.stat(lock).st_mtime < 0.5:
                continue  # an owner between making its lock and taking it
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # gone meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live owner's
        finally:
            os.close(fd)
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    if removed:
        log.info("removed %d private directories of --workers owners that died: %s", len(removed), ", ".join(removed))
    return removed


def owner_alive(pid: int, status: int) -> bool:
    """Whether our owner `pid` lives: it is still our parent (an orphan is adopted by pid 1 or a
    subreaper) and still holds the other end of our `status` pipe."""
    if os.getppid() != pid:
        return False
    poll = select.poll()
    poll.register(status, select.POLLOUT)
    return not any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def told_to_stop(control: int) -> bool:
    """Whether the owner wrote "stop" on our control pipe (an orderly stop, not its death)."""
    poll = select.poll()
    poll.register(control, select.POLLIN)
    if not any(events & select.POLLIN for _, events in poll.poll(0)):
        return False
    try:
        return os.read(control, 64).startswith(b"stop")
    except OSError:
        return False
