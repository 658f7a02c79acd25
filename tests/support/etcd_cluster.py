"""A real etcd cluster on loopback for tests: Debian's `etcd` (3.4), N members, data under a tmp dir.

Members can be killed (SIGKILL), stopped and started again on the same ports and data, so tests can
take the leader away or all of etcd. Without the `etcd` binary the fixture skips, unless CI is set:
then it fails (CI installs `etcd-server`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import markers
from tests.support.ports import free_port


def etcd_binary() -> str:
    found = shutil.which("etcd")
    if found is None:
        reason = "needs Debian's etcd-server (apt-get install etcd-server; .ci/run does)"
        if os.environ.get("CI"):
            pytest.fail(f"etcd unavailable under CI: {reason}", pytrace=False)
        pytest.skip(reason)
    return found


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    tls: bool = False
    proc: asyncio.subprocess.Process | None = None
    cpu_seconds_before: float = 0.0  # CPU of earlier runs of this member (it may be restarted)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


@dataclass
class EtcdCluster:
    """`tls`: (certificate, key, CA) for the client port (https); `token`: sent with every call."""

    root: Path
    size: int = 3
    tls: tuple[Path, Path, Path] | None = None
    members: list[Member] = field(default_factory=list)
    token: str | None = None
    client_ca: Path | None = None  # set: etcd requires client certificates issued by it
    client: tuple[Path, Path] | None = None  # the certificate and key the tests' own calls present

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for i in range(self.size):
            self.members.append(
                Member(
                    f"n{i}",
                    free_port(),
                    free_port(),
                    self.root / f"n{i}",
                    self.root / f"etcd-n{i}.log",
                    tls=self.tls is not None,
                )
            )

    @property
    def endpoints(self) -> str:
        return ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def state(self, prefix: str = "/eds") -> str:
        return f"etcd://{self.endpoints}{prefix}"

    async def start_member(self, m: Member) -> None:
        markers.require("etcd", "a real etcd")
        initial = ",".join(f"{x.name}=http://127.0.0.1:{x.peer_port}" for x in self.members)
        with m.log_path.open("ab") as log:
            m.proc = await asyncio.create_subprocess_exec(
                etcd_binary(),
                "--name",
                m.name,
                "--data-dir",
                str(m.data_dir),
                "--listen-client-urls",
                m.url,
                "--advertise-client-urls",
                m.url,
                "--listen-peer-urls",
                f"http://127.0.0.1:{m.peer_port}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{m.peer_port}",
                "--initial-cluster",
                initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                f"eds-test-{self.members[0].peer_port}",
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
                *(["--cert-file", str(self.tls[0]), "--key-file", str(self.tls[1])] if self.tls else []),
                *(["--client-cert-auth", "--trusted-ca-file", str(self.client_ca)] if self.client_ca else []),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )

    async def start(self, timeout: float = 20.0, client: tuple[Path, Path] | None = None) -> None:
        self.client = client or self.client
        for m in self.members:
            if not m.running:
                await self.start_member(m)
        await self.wait_healthy(timeout)

    async def wait_healthy(self, timeout: float = 20.0) -> None:
        """Until a linearizable read succeeds (the cluster has a leader and quorum)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: object = None
        for _ in range(int(timeout / 0.1) + 1):  # bounded
            for m in self.members:
                if not m.running:
                    continue
                try:
                    await self.call(m, "/v3/kv/range", {"key": _b64(b"health")}, timeout=1.0)
                    return
                except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as e:
                    last = e
            if loop.time() > deadline:
                break
            await asyncio.sleep(0.1)
        raise RuntimeError(f"etcd cluster not healthy within {timeout}s: {last!r}\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        out = []
        for m in self.members:
            if m.log_path.exists():
                out += [f"{m.name}: {line}" for line in m.log_path.read_text(errors="replace").splitlines()[-lines:]]
        return "\n".join(out)

    async def call(self, m: Member, path: str, body: dict[str, Any], timeout: float = 3.0) -> dict[str, Any]:
        context = ssl.create_default_context(cafile=str(self.tls[2])) if self.tls else False
        if context and self.client:
            context.load_cert_chain(str(self.client[0]), str(self.client[1]))
        headers = {"Authorization": self.token} if self.token else None
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
            s.post(m.url + path, json=body, ssl=context, headers=headers) as r,
        ):
            reply: dict[str, Any] = await r.json(content_type=None)
        if "error" in reply:
            raise RuntimeError(f"{m.name}: {reply}")
        return reply

    async def events(self, prefix: str = "/eds/", quiet: float = 1.0) -> list[dict[str, Any]]:
        """Every change under `prefix` since the cluster began, as etcd's watch gives it (from revision 1,
        each with the key's previous value and lease), for a post-mortem; bounded by `quiet` seconds
        without a message."""
        end = bytearray(prefix.encode())
        end[-1] += 1
        body = {
            "create_request": {
                "key": _b64(prefix.encode()),
                "range_end": _b64(bytes(end)),
                "start_revision": "1",
                "prev_kv": True,
            }
        }
        out: list[dict[str, Any]] = []
        m = next(m for m in self.members if m.running)
        async with aiohttp.ClientSession() as s, s.post(m.url + "/v3/watch", json=body) as r:
            for _ in range(100_000):  # bounded, and by `quiet`
                try:
                    line = await asyncio.wait_for(r.content.readline(), quiet)
                except TimeoutError:
                    break
                if not line:
                    break
                for e in json.loads(line).get("result", {}).get("events", ()):
                    kv, prev = e.get("kv", {}), e.get("prev_kv", {})
                    out.append(
                        {
                            "type": e.get("type", "PUT"),
                            "key": base64.b64decode(kv.get("key", "")).decode(),
                            "revision": int(kv.get("mod_revision", 0)),
                            "lease": kv.get("lease"),
                            "value": base64.b64decode(kv.get("value", "")).decode(errors="replace"),
                            "prev_lease": prev.get("lease"),
                        }
                    )
        return out

    async def any_call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        last: Exception | None = None
        for m in self.members:
            if m.running:
                try:
                    return await self.call(m, path, body)
                except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as e:
                    last = e
        raise RuntimeError(f"no etcd member answered: {last!r}")

    async def keys(self, prefix: str = "/eds/") -> dict[str, bytes]:
        """Every key under `prefix` and its value, read linearizably."""
        end = bytearray(prefix.encode())
        end[-1] += 1
        reply = await self.any_call("/v3/kv/range", {"key": _b64(prefix.encode()), "range_end": _b64(bytes(end))})
        kvs = reply.get("kvs", [])
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in kvs}

    async def leader(self) -> Member:
        for m in self.members:
            if m.running:
                try:
                    status = await self.call(m, "/v3/maintenance/status", {}, timeout=1.0)
                except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError):
                    continue
                leader = status.get("leader")
                for x in self.members:
                    if x.running and x.proc is not None:
                        s = await self.call(x, "/v3/maintenance/status", {}, timeout=1.0)
                        if s["header"]["member_id"] == leader:
                            return x
        raise RuntimeError("no leader found")

    def cpu_seconds(self) -> float:
        """User + system CPU of every member, restarts included."""
        return sum(m.cpu_seconds_before + (_cpu(m.proc.pid) if m.running and m.proc else 0.0) for m in self.members)

    async def kill(self, m: Member, sig: int = signal.SIGKILL) -> None:
        if m.proc is not None and m.proc.returncode is None:
            m.cpu_seconds_before += _cpu(m.proc.pid)
            m.proc.send_signal(sig)
            await asyncio.wait_for(m.proc.wait(), 10)

    async def stop(self) -> None:
        for m in self.members:
            await self.kill(m, signal.SIGTERM)


def _cpu(pid: int) -> float:
    """User + system seconds of a running process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid: int) -> float:
    return _cpu(pid)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
