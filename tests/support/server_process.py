"""eds-server run as a real process through its command line, for integration tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.ports import free_port
from tests.support.waiting import wait_for


def write_atomically(path: Path, text: str) -> None:
    """How careful tools write: a temp file renamed over the target."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class RunAs:
    """Run the server as another user (the tests run as root), through util-linux ``setpriv``.

    It keeps one capability, CAP_DAC_READ_SEARCH, so that the interpreter can be read wherever it was
    installed (e.g. under /root); connecting to a unix socket needs *write* permission, which that
    capability does not grant, so the socket's owner, group and mode decide as for any user."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()

    def command(self) -> list[str]:
        groups = f"--groups={','.join(map(str, self.groups))}" if self.groups else "--clear-groups"
        return [
            "setpriv",
            f"--reuid={self.uid}",
            f"--regid={self.gid}",
            groups,
            "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search",
            "--",
        ]


class EdsServerProcess:
    """`python -m eds_server serve` on loopback ports; restartable on the same ports."""

    def __init__(
        self,
        upstreams: Path | None,
        *extra_args: str,
        workdir: Path | None = None,
        user: RunAs | None = None,
        open_files: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """`open_files`: the server's open-file limit, soft and hard (util-linux ``prlimit``); `env`:
        the server's environment (default: the tests')."""
        self.env = env
        self.upstreams = upstreams
        self.user = user
        self.open_files = open_files
        self.port = free_port()
        self.admin_port = free_port()
        self.extra_args = extra_args
        self.proc: asyncio.subprocess.Process | None = None
        logs = workdir or (upstreams.parent if upstreams else Path("."))
        self.log_path = logs / f"eds-server-{self.port}.log"  # kept for post-mortems
        self._log = self.log_path.open("ab")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def start(self, wait_ready: bool = True) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            *(["prlimit", f"--nofile={self.open_files}:{self.open_files}", "--"] if self.open_files else []),
            *(self.user.command() if self.user else []),
            sys.executable,
            "-m",
            "eds_server",
            "serve",
            *(["--upstreams", str(self.upstreams)] if self.upstreams else []),
            "--listen",
            f"127.0.0.1:{self.port}",
            "--admin",
            f"127.0.0.1:{self.admin_port}",
            *([] if "--log-level" in self.extra_args else ["--log-level", "debug"]),  # a flag is given once
            *self.extra_args,
            stdout=self._log,
            stderr=self._log,
            env=self.env,
        )
        if wait_ready:
            await self.wait_ready()

    async def wait_ready(self, timeout: float = 15.0) -> None:
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                assert self.proc is not None
                if self.proc.returncode is not None:  # not "not yet": it never will be
                    raise RuntimeError(f"eds-server exited with {self.proc.returncode}:\n{self.log_text()}")
                async with session.get(f"http://127.0.0.1:{self.admin_port}/readyz") as r:
                    return r.status == 200

            try:
                await wait_for(ready, timeout=timeout, interval=0.05, what="eds-server ready")
            except AssertionError:
                raise RuntimeError(f"eds-server not ready after {timeout}s:\n{self.log_text()}") from None

    async def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, and the exit code it gave (killed after `timeout`, which fails the caller)."""
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
                raise AssertionError(f"eds-server ignored SIGTERM for {timeout}s") from None
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def admin(self, path: str) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.admin_port}{path}") as r,
        ):
            return await r.json()

    async def __aenter__(self) -> EdsServerProcess:
        try:
            await self.start()
        except BaseException:  # never ready: stop it anyway (with --workers, its workers with it)
            if self.proc is not None and self.proc.returncode is None:
                with contextlib.suppress(AssertionError):
                    await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            if self.proc is not None and self.proc.returncode is None:
                code = await self.stop()
                assert code == 0, f"eds-server exited with {code}:\n{self.log_text()}"
        finally:
            self._log.close()


async def file_error(server: EdsServerProcess) -> str | None:
    """The file source's last error, from the admin API (which runs on the same loop as gRPC: a
    frozen loop answers nothing, so each call is bounded too)."""
    sources = (await asyncio.wait_for(server.admin("/v1/sources"), 10))["sources"]
    return next(s["last_error"] for s in sources if s["name"].startswith("file:"))


async def wait_error(server: EdsServerProcess, text: str, timeout: float = 10.0) -> str:
    error = await wait_for(
        lambda: file_error(server),
        lambda e: e and text in e,
        timeout=timeout,
        interval=0.05,
        what=f"a file error with {text!r}",
    )
    assert error is not None
    return error
