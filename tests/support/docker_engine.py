"""A real, private Docker engine for tests: its own dockerd, socket and data root, plus busybox backends.

The engine runs as root with ``--storage-driver vfs --iptables=false --bridge=none --live-restore`` in a
short temp dir. No image registry is needed: the test image is ``docker import``-ed from a tarball holding
the static ``/bin/busybox`` and symlinks for its applets.

Backends use host networking and serve on ``127.0.0.1:PORT`` only. User-defined bridge networks may be
created (to look at ``docker inspect`` output) but nothing may ever send traffic to their addresses.

Typical use (the fixtures are registered by ``tests/conftest.py``)::

    def test_x(docker_cleanup: DockerEngine) -> None:
        port = free_port()
        cid = run_backend(docker_cleanup, "web-1", port, {"eds.group": "web"})
        assert http_get(port) == (200, "web-1")

``docker_engine`` (session) yields the started engine; ``docker_cleanup`` (function) yields the same
engine and afterwards removes the containers and networks the test created (and restarts dockerd if
the test left it stopped). Without dockerd, busybox or root the fixtures skip, unless ``CI`` is set:
then they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import io
import json
import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.support.ports import free_port
from tests.support.waiting import NOT_YET, wait_for_blocking

T = TypeVar("T")

IMAGE = "eds-test-busybox:1"
BUSYBOX = Path("/bin/busybox")
# Applets linked into the image (all are the one static busybox binary).
APPLETS = (
    "sh",
    "ash",
    "httpd",
    "sleep",
    "usleep",
    "mkdir",
    "echo",
    "printf",
    "touch",
    "rm",
    "test",
    "[",
    "cat",
    "true",
    "false",
    "kill",
    "ls",
    "ps",
    "env",
    "id",
    "hostname",
    "date",
    "wget",
    "timeout",
    "seq",
)
HEALTH_INTERVAL = "200ms"  # dockerd 20.10 rejects intervals under 1ms ("cannot be less than 1ms")
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; containerd adds ".ttrpc" to its own socket


class DockerError(RuntimeError):
    """A docker CLI call failed, or the engine did not come up / go down in time."""


# a docker command that fails until the engine catches up
NOT_YET_DOCKER: tuple[type[BaseException], ...] = (DockerError, *NOT_YET)


# --------------------------------------------------------------------------------------------------
# small helpers


def http_get(port: int, path: str = "/", timeout: float = 2.0) -> tuple[int, str]:
    """GET http://127.0.0.1:port/path directly (no proxies); returns (status, body). Loopback only."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Connection": "close"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def _is_static_elf(path: Path) -> bool:
    """True if ``path`` is an ELF executable without a program interpreter (PT_INTERP)."""
    try:
        data = path.read_bytes()[:65536]
    except OSError:
        return False
    if data[:4] != b"\x7fELF" or len(data) < 64:
        return False
    is64, little = data[4] == 2, data[5] == 1
    end = "<" if little else ">"
    if is64:
        (phoff,) = struct.unpack_from(end + "Q", data, 0x20)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x36)
    else:
        (phoff,) = struct.unpack_from(end + "I", data, 0x1C)
        phentsize, phnum = struct.unpack_from(end + "HH", data, 0x2A)
    for i in range(phnum):
        off = phoff + i * phentsize
        if off + 4 > len(data):
            return False
        (p_type,) = struct.unpack_from(end + "I", data, off)
        if p_type == 3:  # PT_INTERP: dynamically linked
            return False
    return True


def _find_exe(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        candidate = Path(d) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def unavailable_reason() -> str | None:
    """Why no private engine can be started here (None if it can be tried)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the Docker engine tests need root (dockerd runs with its own data root)"
    missing = [n for n in ("dockerd", "docker", "containerd", "runc") if _find_exe(n) is None]
    if missing:
        return f"missing {', '.join(missing)} (Debian: apt-get install docker.io)"
    if not _is_static_elf(BUSYBOX):
        return f"{BUSYBOX} is missing or not statically linked (Debian: apt-get install busybox-static)"
    return None


# --------------------------------------------------------------------------------------------------
# the engine


class DockerEngine:
    """A private dockerd (with its own containerd) in a short temp dir; see the module docstring."""

    def __init__(
        self,
        *,
        image: str = IMAGE,
        start_timeout: float = 60.0,
        live_restore: bool = True,
        storage_driver: str = "vfs",
        extra_args: Sequence[str] = (),
    ) -> None:
        self.image = image
        self.live_restore = live_restore  # Swarm mode refuses to run with --live-restore
        # vfs works on any file system; overlay2 (ext4, xfs) shares image layers between containers
        # instead of copying them, which the compose test's Python-sized images need.
        self.storage_driver = storage_driver
        self.extra_args = tuple(extra_args)
        self.start_timeout = start_timeout
        self.docker = _find_exe("docker") or "docker"
        self.dockerd = _find_exe("dockerd") or "dockerd"
        base = tempfile.gettempdir()
        if len(base) > 40:
            base = "/tmp"
        self.dir = Path(tempfile.mkdtemp(prefix="eds-dk-", dir=base))
        if len(str(self.dir / "exec/containerd/containerd.sock.ttrpc")) > _SOCKET_PATH_MAX:
            self.dir.rmdir()
            raise DockerError(f"temp dir path too long for unix sockets: {self.dir}")
        self.socket_path = self.dir / "docker.sock"
        self.log_path = self.dir / "dockerd.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DOCKER_HOST", "DOCKER_CONTEXT", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH")
        }
        self._env["DOCKER_CONFIG"] = str(self.dir / "cli")
        self._closed = False

    # -- properties

    @property
    def host(self) -> str:
        """The ``-H`` / DOCKER_HOST value for this engine: ``unix:///.../docker.sock``."""
        return f"unix://{self.socket_path}"

    @property
    def running(self) -> bool:
        """dockerd's process is alive (it may not answer yet)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running and self._proc is not None else None

    # -- lifecycle

    def start(self) -> None:
        """Start dockerd (if not running), wait (bounded) until it answers, import the image once."""
        if self._closed:
            raise DockerError("engine is closed")
        if not self.running:
            (self.dir / "cli").mkdir(exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                (self.dir / "docker.pid").unlink()
            cmd = [
                self.dockerd,
                "--host",
                self.host,
                "--data-root",
                str(self.dir / "data"),
                "--exec-root",
                str(self.dir / "exec"),
                "--pidfile",
                str(self.dir / "docker.pid"),
                "--storage-driver",
                self.storage_driver,
                "--iptables=false",
                "--bridge=none",
                *(["--live-restore"] if self.live_restore else []),
                *self.extra_args,
            ]
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=self._env,
                )
            try:
                wait_for_blocking(self._ping_or_die, timeout=self.start_timeout, interval=0.1, what="dockerd /_ping")
            except (DockerError, AssertionError) as exc:
                self._kill_dockerd()
                raise DockerError(f"{exc}\n--- dockerd log tail ---\n{self.log_tail()}") from None
            self.cli("version", "--format", "{{.Server.Version}}", timeout=30)
        self._ensure_image()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM dockerd, wait (bounded), then SIGKILL. Containers keep running (--live-restore)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._kill_dockerd()
        self._proc = None
        # dockerd stops the containerd it started; make sure (bounded) before anyone restarts it.
        cpid = self._read_pid(self.dir / "exec/containerd/containerd.pid")
        if cpid is not None and self._pid_is_ours(cpid):
            with contextlib.suppress(AssertionError):
                wait_for_blocking(lambda: not _pid_alive(cpid), timeout=10, interval=0.1, what="containerd exit")
            if _pid_alive(cpid):
                _kill(cpid, signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def engine_pids(self) -> list[int]:
        """dockerd and the containerd it started (the shims, and so the containers, are not included)."""
        cpid = self._read_pid(self.dir / "exec/containerd/containerd.pid")
        return [p for p in (self.pid, cpid) if p is not None and (p == self.pid or self._pid_is_ours(p))]

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP dockerd and its containerd for the block, SIGCONT after (whatever happens): the engine
        neither answers nor heartbeats, while its containers keep running."""
        pids = self.engine_pids()
        try:
            for pid in pids:
                _kill(pid, signal.SIGSTOP)
            yield
        finally:
            for pid in reversed(pids):
                _kill(pid, signal.SIGCONT)

    def close(self) -> None:
        """Remove every container and custom network, stop dockerd, kill leftovers, delete the dir."""
        if self._closed:
            return
        try:
            if not self.running and self.socket_path.parent.exists():
                with contextlib.suppress(Exception):  # containers outlive a stopped dockerd: restart to rm
                    self.start()
            if self.running:
                with contextlib.suppress(Exception):
                    self.remove_containers()
                with contextlib.suppress(Exception):
                    self.remove_networks()
            self.stop()
            self._kill_leftovers()
            self._unmount_all()
        finally:
            self._closed = True
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> DockerEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- CLI

    def cli(self, *args: str, timeout: float = 30, input: str | None = None) -> str:
        """Run ``docker -H <this engine> *args``; returns stdout stripped. Raises DockerError with stderr."""
        cmd = [self.docker, "-H", self.host, *args]
        try:
            res = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self._env,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise DockerError(f"{shlex.join(cmd[3:])}: timed out after {timeout}s") from exc
        if res.returncode != 0:
            raise DockerError(f"docker {shlex.join(cmd[3:])}: exit {res.returncode}: {res.stderr.strip()}")
        return res.stdout.strip()

    async def acli(self, *args: str, timeout: float = 30) -> str:
        """``cli`` for async tests (does not block the event loop)."""
        cmd = [self.docker, "-H", self.host, *args]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self._env
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise DockerError(f"{shlex.join(args)}: timed out after {timeout}s") from None
        if proc.returncode != 0:
            raise DockerError(f"docker {shlex.join(args)}: exit {proc.returncode}: {err.decode().strip()}")
        return out.decode().strip()

    def api_get(self, path: str, timeout: float = 10.0) -> Any:
        """GET on the engine's socket (e.g. ``/v1.41/containers/json?all=1``); returns decoded JSON."""
        conn = _UnixHTTPConnection(str(self.socket_path), timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise DockerError(f"GET {path}: {resp.status} {body[:500]!r}")
        return json.loads(body)

    def ping(self, timeout: float = 2.0) -> bool:
        """True if ``/_ping`` answers OK."""
        conn = _UnixHTTPConnection(str(self.socket_path), timeout)
        try:
            conn.request("GET", "/_ping")
            resp = conn.getresponse()
            return resp.status == 200 and resp.read() == b"OK"
        except OSError:
            return False
        finally:
            conn.close()

    # -- queries and cleanup

    def inspect(self, ref: str) -> dict[str, Any]:
        """``docker inspect`` of one container, as the object (not the list)."""
        data = json.loads(self.cli("container", "inspect", ref))
        assert isinstance(data, list) and len(data) == 1
        return dict(data[0])

    def container_ids(self, all: bool = True) -> list[str]:
        out = self.cli("ps", "-q", "--no-trunc", *(["-a"] if all else []))
        return out.split()

    def network_ids(self) -> list[str]:
        """User-defined networks (not host/none/bridge)."""
        return self.cli("network", "ls", "-q", "--no-trunc", "--filter", "type=custom").split()

    def remove_containers(self, ids: Sequence[str] | None = None) -> None:
        """``docker rm -f -v`` the given containers (default: all of this engine's)."""
        ids = list(self.container_ids() if ids is None else ids)
        if ids:
            self.cli("rm", "-f", "-v", *ids, timeout=60)

    def remove_networks(self, ids: Sequence[str] | None = None) -> None:
        ids = list(self.network_ids() if ids is None else ids)
        if ids:
            self.cli("network", "rm", *ids)

    def health(self, ref: str) -> str | None:
        """``State.Health.Status`` ("starting", "healthy", "unhealthy") or None without a healthcheck."""
        state = self.inspect(ref)["State"]
        health = state.get("Health")
        return str(health["Status"]) if health else None

    def wait_health(self, ref: str, status: str, timeout: float = 15.0) -> None:
        wait_for_blocking(
            lambda: self.health(ref) == status,
            timeout=timeout,
            interval=0.1,
            what=f"{ref} to be {status}",
            retry=NOT_YET_DOCKER,
        )

    def events(self, since: float, until: float | None = None, filters: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Events between two unix times (``until`` defaults to now), as decoded ``{{json .}}`` lines.

        ``filters`` are ``docker events --filter`` values, e.g. ``("container=ID", "event=die")``.
        """
        until = time.time() if until is None else until
        args = ["events", "--since", f"{since:.6f}", "--until", f"{until:.6f}", "--format", "{{json .}}"]
        for f in filters:
            args += ["--filter", f]
        out = self.cli(*args, timeout=max(30.0, until - time.time() + 30.0))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def wait_event(
        self,
        since: float,
        match: Callable[[dict[str, Any]], bool],
        *,
        filters: Sequence[str] = (),
        timeout: float = 15.0,
    ) -> dict[str, Any]:
        """Poll (bounded) for the first event since ``since`` for which ``match`` is true."""

        def probe() -> dict[str, Any] | None:
            return next((e for e in self.events(since, filters=filters) if match(e)), None)

        return wait_for_blocking(
            probe, timeout=timeout, interval=0.2, what="a matching docker event", retry=NOT_YET_DOCKER
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- internals

    def _ping_or_die(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise DockerError(f"dockerd exited with {self._proc.returncode}\n{self.log_tail()}")
        return self.ping(timeout=1.0)

    def _ensure_image(self) -> None:
        try:
            self.cli("image", "inspect", "--format", "{{.Id}}", self.image)
            return
        except DockerError:
            pass
        tar_path = self.dir / "busybox.tar"
        _write_busybox_tar(tar_path)
        self.cli("import", str(tar_path), self.image, timeout=120)
        tar_path.unlink()

    def _kill_dockerd(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)

    @staticmethod
    def _read_pid(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None

    def _pid_is_ours(self, pid: int) -> bool:
        return str(self.dir) + "/" in _cmdline(pid)

    def _kill_leftovers(self) -> None:
        """Last resort after stop(): kill processes started for this engine (their cmdline names our dir):
        containerd, shims, and the containers' init processes under those shims."""
        ours = [pid for pid in _pids() if self._pid_is_ours(pid)]
        if not ours:
            return
        children = [pid for pid in _pids() if _ppid(pid) in ours]
        for pid in children + ours:
            _kill(pid, signal.SIGKILL)
        with contextlib.suppress(AssertionError):
            wait_for_blocking(
                lambda: not any(_pid_alive(p) for p in children + ours),
                timeout=10,
                what="leftover engine processes to exit",
            )

    def _unmount_all(self) -> None:
        """dockerd leaves bind mounts (its data root, netns files) under our dir; unmount them."""
        prefix = str(self.dir) + "/"
        for _ in range(20):
            points = [p for p in _mount_points() if p.startswith(prefix) or p == str(self.dir)]
            if not points:
                return
            for point in sorted(points, key=len, reverse=True):
                res = subprocess.run(["umount", point], capture_output=True, timeout=30)
                if res.returncode != 0:
                    subprocess.run(["umount", "-l", point], capture_output=True, timeout=30)


def _write_busybox_tar(path: Path) -> None:
    """A root filesystem: /bin/busybox (static), applet symlinks, /www and /tmp."""
    with tarfile.open(path, "w") as tar:

        def add_dir(name: str, mode: int = 0o755) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, mode, int(time.time())
            tar.addfile(info)

        for d in ("bin", "www", "etc"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        data = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode, info.mtime = len(data), 0o755, int(time.time())
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname, link.mode = tarfile.SYMTYPE, "busybox", 0o777
            tar.addfile(link)
        passwd = b"root:x:0:0:root:/:/bin/sh\n"
        pinfo = tarfile.TarInfo("etc/passwd")
        pinfo.size, pinfo.mode = len(passwd), 0o644
        tar.addfile(pinfo, io.BytesIO(passwd))


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _mount_points() -> list[str]:
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            raw = line.split()[4]
            points.append(raw.encode().decode("unicode_escape"))  # \040 etc. are octal escapes
    return points


# --------------------------------------------------------------------------------------------------
# backends


def backend_script(name: str, port: int, *, drain_seconds: float = 0, start_healthy: bool = False) -> str:
    """The ``sh -c`` script of a backend: serves ``name`` as GET / on 127.0.0.1:port with busybox httpd.

    sh stays PID 1 and traps SIGTERM/SIGINT (PID 1 ignores signals it has no handler for), so
    ``docker stop`` ends it at once, or after ``drain_seconds`` during which httpd keeps serving.
    """
    on_term = "kill $pid; wait $pid; exit 0"
    if drain_seconds > 0:
        on_term = f"sleep {drain_seconds:g}; " + on_term
    lines = [
        f"trap '{on_term}' TERM INT",
        f"printf %s {shlex.quote(name)} > /www/index.html",
        *(["touch /healthy"] if start_healthy else []),
        f"httpd -f -p 127.0.0.1:{int(port)} -h /www &",
        "pid=$!",
        "wait $pid",
    ]
    return "\n".join(lines)


def run_backend(
    engine: DockerEngine,
    name: str,
    port: int,
    labels: Mapping[str, str],
    *,
    health_cmd: str | None = None,
    drain_seconds: float = 0,
    extra_args: Sequence[str] = (),
    start_healthy: bool = False,
    wait_ready: bool = True,
    ready_timeout: float = 15.0,
) -> str:
    """Run a labelled backend container (host network) named ``name``; returns its full id.

    GET / on 127.0.0.1:port answers 200 with body ``name``. With ``health_cmd`` (e.g.
    ``"test -f /healthy"``) the container gets a HEALTHCHECK every 200ms, 1 retry; flip it with
    ``docker exec NAME touch /healthy`` / ``rm /healthy`` (``start_healthy`` creates /healthy first).
    With ``drain_seconds`` > 0 the container exits that long after SIGTERM (use ``docker stop -t``
    longer than that). ``extra_args`` go to ``docker run`` before the image. With ``wait_ready`` this
    returns once the backend answers on its port (bounded).
    """
    args = ["run", "-d", "--name", name, "--network", "host"]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    if health_cmd is not None:
        args += [
            "--health-cmd",
            health_cmd,
            "--health-interval",
            HEALTH_INTERVAL,
            "--health-timeout",
            "5s",
            "--health-retries",
            "1",
        ]
    args += [
        *extra_args,
        engine.image,
        "sh",
        "-c",
        backend_script(name, port, drain_seconds=drain_seconds, start_healthy=start_healthy),
    ]
    cid = engine.cli(*args)
    if wait_ready:
        wait_for_blocking(
            lambda: http_get(port, timeout=1.0) == (200, name),
            timeout=ready_timeout,
            interval=0.1,
            what=f"backend {name} on 127.0.0.1:{port}",
        )
    return cid


async def arun_backend(engine: DockerEngine, name: str, port: int, labels: Mapping[str, str], **kwargs: Any) -> str:
    """``run_backend`` for async tests (runs in a thread)."""
    return await asyncio.to_thread(run_backend, engine, name, port, labels, **kwargs)


# --------------------------------------------------------------------------------------------------
# Swarm


def swarm_init(engine: DockerEngine, port: int | None = None) -> int:
    """``swarm init`` advertising and listening on 127.0.0.1:port (default: a free one); returns the port."""
    port = port or free_port()
    engine.cli(
        "swarm", "init", "--advertise-addr", f"127.0.0.1:{port}", "--listen-addr", f"127.0.0.1:{port}", timeout=60
    )
    return port


def swarm_join(worker: DockerEngine, manager: DockerEngine, manager_port: int, port: int | None = None) -> int:
    """Join ``worker`` to ``manager``'s swarm, listening on its own 127.0.0.1 port; returns that port.

    Two engines on one machine share everything but their listen ports: the worker's gossip port (7946,
    overlay networks only) is taken by the manager, so only host-networked tasks work on the worker.
    """
    port = port or free_port()
    token = manager.cli("swarm", "join-token", "-q", "worker")
    worker.cli(
        "swarm",
        "join",
        "--token",
        token,
        "--advertise-addr",
        f"127.0.0.1:{port}",
        "--listen-addr",
        f"127.0.0.1:{port}",
        f"127.0.0.1:{manager_port}",
        timeout=60,
    )
    return port


def swarm_remove_services(engine: DockerEngine) -> None:
    ids = engine.cli("service", "ls", "-q").split()
    if ids:
        engine.cli("service", "rm", *ids, timeout=60)


def swarm_close(*engines: DockerEngine) -> None:
    """Leave the swarm (workers first) and close the engines; best effort."""
    for engine in engines:
        with contextlib.suppress(Exception):
            if engine.running:
                engine.cli("swarm", "leave", "--force", timeout=60)
    for engine in engines:
        engine.close()


def node_states(manager: DockerEngine) -> dict[str, str]:
    """Role ("manager"/"worker", numbered if several) -> ``Status.State`` as the manager lists it now."""
    out: dict[str, str] = {}
    for node in sorted(manager.api_get("/v1.41/nodes", timeout=2), key=lambda n: str(n["ID"])):
        role = str((node.get("Spec") or {}).get("Role") or "?")
        key = role if role not in out else f"{role}-{len(out)}"
        out[key] = str((node.get("Status") or {}).get("State") or "?")
    return out


# --------------------------------------------------------------------------------------------------
# pytest fixtures (registered by tests/conftest.py: pytest_plugins = ["tests.support.docker_engine"])


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"Docker engine unavailable under CI: {reason}", pytrace=False)
    pytest.skip(f"Docker engine unavailable: {reason}")


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[DockerEngine]:
    """A started private DockerEngine for the session (skips, or fails under CI, if impossible)."""
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)
    engine = DockerEngine()
    try:
        engine.start()
    except Exception as exc:
        engine.close()
        _skip_or_fail(f"dockerd did not start: {exc}")
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def docker_cleanup(docker_engine: DockerEngine) -> Iterator[DockerEngine]:
    """The session engine; after the test, removes the containers/networks it created."""
    if not docker_engine.running:
        docker_engine.start()
    containers = set(docker_engine.container_ids())
    networks = set(docker_engine.network_ids())
    try:
        yield docker_engine
    finally:
        if not docker_engine.running:
            docker_engine.start()
        docker_engine.remove_containers([c for c in docker_engine.container_ids() if c not in containers])
        docker_engine.remove_networks([n for n in docker_engine.network_ids() if n not in networks])


@pytest.fixture(scope="module")
def swarm_pair() -> Iterator[tuple[DockerEngine, DockerEngine]]:
    """Two private engines on this machine in one Swarm: (manager, worker), both on 127.0.0.1 ports.

    No --live-restore (Swarm refuses it). After each module the services are removed and both leave.
    """
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)
    manager, worker = DockerEngine(live_restore=False), DockerEngine(live_restore=False)
    try:
        manager.start()
        worker.start()
        swarm_join(worker, manager, swarm_init(manager))
        wait_for_blocking(
            lambda: sorted(node_states(manager).values()) == ["ready", "ready"],
            timeout=30,
            what="both swarm nodes ready",
            retry=NOT_YET_DOCKER,
        )
    except Exception as exc:
        swarm_close(worker, manager)
        _skip_or_fail(f"two-node swarm did not start: {exc}")
    try:
        yield manager, worker
    finally:
        for engine in (manager, worker):
            if not engine.running:
                with contextlib.suppress(Exception):
                    engine.start()
        with contextlib.suppress(Exception):
            swarm_remove_services(manager)
        swarm_close(worker, manager)


@pytest.fixture(scope="session")
def swarm_engine() -> Iterator[DockerEngine]:
    """A private engine (no --live-restore: Swarm refuses it) in swarm mode, advertising 127.0.0.1."""
    reason = unavailable_reason()
    if reason is not None:
        _skip_or_fail(reason)
    engine = DockerEngine(live_restore=False)
    try:
        engine.start()
        swarm_init(engine)
    except Exception as exc:
        engine.close()
        _skip_or_fail(f"single-node swarm did not start: {exc}")
    try:
        yield engine
    finally:
        with contextlib.suppress(Exception):
            swarm_remove_services(engine)
        swarm_close(engine)


@pytest.fixture
def swarm(swarm_engine: DockerEngine) -> Iterator[DockerEngine]:
    if not swarm_engine.running:
        swarm_engine.start()
    yield swarm_engine
    if not swarm_engine.running:
        swarm_engine.start()
    swarm_remove_services(swarm_engine)
    node = swarm_engine.cli("node", "ls", "-q").split()[0]
    swarm_engine.cli("node", "update", "--availability", "active", node)
