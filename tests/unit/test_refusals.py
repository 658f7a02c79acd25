"""Every refusal at start, run as a user runs it: `python -m eds_server ...` as a process, read as
the user reads it. Each row: the exit status, a line naming the file, flag or variable at fault,
and no traceback (a refused start is one clear line, not a stack the user must read through)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.paths import ROOT

TOKEN = "t" * 32
GOOD_STATE = '{"version": 1, "registrations": []}'
ENTRY = '{"group": "web", "id": "a", "endpoint": {"address": "127.0.0.1", "port": 8080}}'
LOOPBACK = ["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]


@dataclass(frozen=True)
class Refusal:
    name: str
    args: list[str]  # after `python -m eds_server`; {d} is the test's directory, {port} a held port
    status: int
    line: str  # a regex one stderr line must match: it names what is wrong
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # written under {d} first


def serve(*args: str, state: str | None = None) -> list[str]:
    out = ["serve", *LOOPBACK, *args]
    return out + (["--state", state, "--admin-token", TOKEN] if state else [])


# the refusals, one a line, read as a table: kept from the formatter
# fmt: off
TABLE = [
    # -- the command line -------------------------------------------------------------------------
    Refusal("misspelt top-level flag", ["--versoin"], 2, r"--versoin: did you mean --version\?"),
    Refusal("misspelt command", ["serv"], 2, r"invalid choice: 'serv'.*did you mean 'serve'\?"),
    Refusal("misspelt serve flag", ["serve", "--upstream", "x.yaml"], 2, r"--upstream: did you mean --upstreams\?"),
    Refusal("a flag given twice", ["serve", "--upstreams", "a", "--upstreams", "b"], 2, r"--upstreams given twice"),
    Refusal("a duration without unit", serve("--upstreams", "{d}/u.yaml", "--debounce", "10"), 2,
            r"--debounce.*'10' has no unit", files={"u.yaml": "groups: {}\n"}),
    Refusal("a bad address", ["serve", "--listen", "nowhere"], 2, r"--listen.*'nowhere' is not HOST:PORT"),
    Refusal("a bad value from the environment", ["serve", "--upstreams", "x"], 2,
            r"--debounce.*\(from EDS_DEBOUNCE='10'\)", env={"EDS_DEBOUNCE": "10"}),
    Refusal("an on/off variable neither", ["serve", "--upstreams", "x"], 2,
            r"EDS_DOCKER='ture' is neither on nor off", env={"EDS_DOCKER": "ture"}),
    Refusal("a bad choice from the environment", ["serve", "--upstreams", "x"], 2,
            r"--http2.*\(from EDS_HTTP2='quick'\)", env={"EDS_HTTP2": "quick"}),
    Refusal("bad --workers", ["serve", "--upstreams", "x", "--workers", "0"], 2, r"--workers.*'0'"),
    Refusal("a misspelt choice", ["serve", "--upstreams", "x", "--log-level", "debg"], 2,
            r"--log-level: invalid choice: 'debg'.*did you mean 'debug'\?"),
    Refusal("check with nothing", ["check"], 2, r"give one or more upstreams FILEs"),
    Refusal("check of a bad file", ["check", "{d}/u.yaml"], 1, r"\S*/u\.yaml:3: groups\.web\.endpoints\[0\]: "
            r"'h' is not an IP address", files={"u.yaml": "groups:\n  web:\n    endpoints: [h:80]\n"}),
    # -- the flags together (cli.main) --------------------------------------------------------------
    Refusal("no source", serve(), 2, r"no source of endpoints: give --upstreams FILE"),
    Refusal("relay with a source", serve("--upstream-eds", "127.0.0.1:1", "--upstreams", "x"), 2,
            r"--upstream-eds .* takes no other source: drop --upstreams"),
    Refusal("relay TLS without relay", serve("--upstreams", "x", "--upstream-eds-ca", "ca.pem"), 2,
            r"--upstream-eds-ca, .* need --upstream-eds"),
    Refusal("missing kubeconfig", serve("--kubernetes", "--kubeconfig", "{d}/nope"), 2,
            r"not starting: --kubeconfig \S*/nope: no such file"),
    Refusal("no Kubernetes configuration", serve("--kubernetes"), 2, r"not starting: --kubernetes: no Kubernetes",
            env={"HOME": "{d}", "KUBECONFIG": "", "KUBERNETES_SERVICE_HOST": ""}),
    Refusal("admin token without admin", ["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--admin-token",
            TOKEN], 2, r"--admin-token needs the admin HTTP"),
    Refusal("admin TLS without a certificate", serve("--upstreams", "x", "--admin-tls"), 2,
            r"--admin-tls needs --tls-cert"),
    Refusal("admin TLS without admin", ["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--upstreams", "x",
            "--admin-tls", "--tls-cert", "c.pem"], 2, r"--admin-tls needs the admin HTTP"),
    Refusal("TLS key without certificate", serve("--upstreams", "x", "--tls-key", "k.pem"), 2,
            r"--tls-key and --tls-client-ca need --tls-cert"),
    Refusal("authz with REST", serve("--upstreams", "x", "--authz", "a.yaml", "--rest-listen", "127.0.0.1:0"), 2,
            r"--authz does not cover --rest-listen"),
    Refusal("a short admin token", serve("--upstreams", "x", "--admin-token", "short"), 2,
            r"--admin-token is 5 characters"),
    Refusal("a bad CIDR", serve("--upstreams", "x", "--registration-allow-cidr", "10.0.0.0/33"), 2,
            r"10\.0\.0\.0/33"),
    Refusal("missing registration tokens file", serve("--upstreams", "x", "--registration-tokens", "{d}/nope"), 2,
            r"\S*/nope"),
    Refusal("etcd flag without etcd", serve("--upstreams", "x", "--etcd-ca", "ca.pem"), 2,
            r"--etcd-ca needs --state etcd://"),
    Refusal("a bad etcd URL", serve("--state", "etcd://", "--admin-token", TOKEN), 2, r"etcd://"),
    Refusal("etcd user without password", serve("--state", "etcd://127.0.0.1:2379/x", "--admin-token", TOKEN,
            "--etcd-user", "u"), 2, r"--etcd-user needs a password"),
    Refusal("etcd key without certificate", serve("--state", "etcd://127.0.0.1:2379/x", "--admin-token", TOKEN,
            "--etcd-key", "k.pem"), 2, r"--etcd-key needs --etcd-cert"),
    Refusal("missing etcd CA", serve("--state", "etcd://127.0.0.1:2379/x", "--admin-token", TOKEN, "--etcd-ca",
            "{d}/nope.pem"), 2, r"--etcd-ca \S*/nope\.pem: no such file"),
    Refusal("unusable etcd CA", serve("--state", "etcd://127.0.0.1:2379/x", "--admin-token", TOKEN, "--etcd-ca",
            "{d}/ca.pem"), 2, r"--etcd-ca, --etcd-cert, --etcd-key: cannot be used", files={"ca.pem": "x\n"}),
    Refusal("missing etcd password file", serve("--state", "etcd://127.0.0.1:2379/x", "--admin-token", TOKEN,
            "--etcd-user", "u", "--etcd-password-file", "{d}/nope"), 2, r"--etcd-password-file \S*/nope: No such"),
    Refusal("scoped tokens without admin", ["serve", "--listen", "127.0.0.1:0", "--admin", "off", "--upstreams", "x",
            "--registration-tokens", "{d}/t.yaml"], 2, r"--registration-tokens needs the admin HTTP",
            files={"t.yaml": f"tokens: [{{token: {TOKEN}, groups: [web]}}]\n"}),
    # -- the files and ports (start_app, the server's start) ------------------------------------------
    Refusal("a port in use", serve("--upstreams", "{d}/u.yaml", "--metrics-listen", "127.0.0.1:{port}"), 1,
            r"not starting: --metrics-listen 127\.0\.0\.1:\d+: address in use", files={"u.yaml": "groups: {}\n"}),
    Refusal("two ports in use, both named", ["serve", "--upstreams", "{d}/u.yaml", "--listen", "127.0.0.1:{port}",
            "--admin", "127.0.0.1:{port}"], 1, r"not starting: --listen 127\.0\.0\.1:\d+: address in use; "
            r"--admin 127\.0\.0\.1:\d+: address in use", files={"u.yaml": "groups: {}\n"}),
    Refusal("workers: two ports in use, both named", serve("--workers", "2", "--upstreams", "{d}/u.yaml",
            "--rest-listen", "127.0.0.1:{port}", "--metrics-listen", "127.0.0.1:{port}"), 1,
            r"not starting: --rest-listen 127\.0\.0\.1:\d+: address in use; --metrics-listen",
            files={"u.yaml": "groups: {}\n"}),
    Refusal("a host name that does not resolve", ["serve", "--upstreams", "{d}/u.yaml", "--listen",
            "eds-nowhere.invalid:0", "--admin", "127.0.0.1:0"], 1,
            r"not starting: --listen eds-nowhere\.invalid:0: cannot resolve 'eds-nowhere\.invalid'",
            files={"u.yaml": "groups: {}\n"}),
    Refusal("a missing upstreams file", serve("--upstreams", "{d}/nope.yaml"), 1, r"\S*/nope\.yaml"),
    Refusal("a bad upstreams file", serve("--upstreams", "{d}/u.yaml"), 1,
            r"not starting: fix the upstreams file \S*/u\.yaml",
            files={"u.yaml": "groups:\n  web: [\n"}),
    Refusal("an unusable TLS certificate", serve("--upstreams", "{d}/u.yaml", "--tls-cert", "{d}/c.pem"), 1,
            r"\S*/c\.pem", files={"u.yaml": "groups: {}\n", "c.pem": "not a certificate\n"}),
    Refusal("a bad authorization file", serve("--upstreams", "{d}/u.yaml", "--authz", "{d}/a.yaml"), 1,
            r"\S*/a\.yaml", files={"u.yaml": "groups: {}\n", "a.yaml": "rules: 7\n"}),
    Refusal("a truncated state file", serve(state="{d}/s.json"), 1, r"not starting: \S*/s\.json: not a valid state",
            files={"s.json": GOOD_STATE[:20]}),
    Refusal("a corrupted state file", serve(state="{d}/s.json"), 1, r"not starting: \S*/s\.json: not a valid state",
            files={"s.json": "\x00\x13garbage\xff"}),
    Refusal("an empty state file", serve(state="{d}/s.json"), 1, r"not starting: \S*/s\.json: not a valid state",
            files={"s.json": ""}),
    Refusal("a state file of another version", serve(state="{d}/s.json"), 1,
            r"not starting: \S*/s\.json: version: 9 is not a known", files={"s.json": '{"version": 9, '
                                                                            '"registrations": []}'}),
    Refusal("an invalid registration", serve(state="{d}/s.json"), 1,
            r"not starting: \S*/s\.json: registrations\[1\]: duplicate registration web/a",
            files={"s.json": f'{{"version": 1, "registrations": [{ENTRY}, {ENTRY}]}}'}),
    Refusal("a state file in a missing directory", serve(state="{d}/no/s.json"), 1,
            r"not starting: \S*/no/s\.json: cannot write the lock file"),
    Refusal("a state file that is a directory", serve(state="{d}/dir"), 1, r"not starting: \S*/dir: cannot read",
            files={"dir/x": ""}),
    Refusal("a state file in use", serve(state="{d}/held.json"), 1,
            r"not starting: \S*/held\.json: the state file is in use by process \d+"),
    Refusal("a missing relay CA", serve("--upstream-eds", "127.0.0.1:1", "--upstream-eds-ca", "{d}/nope.pem"), 1,
            r"not starting: --upstream-eds-ca \S*/nope\.pem: no such file"),
    Refusal("an unusable relay CA", serve("--upstream-eds", "127.0.0.1:1", "--upstream-eds-ca", "{d}/ca.pem"), 1,
            r"not starting: --upstream-eds-ca \S*/ca\.pem: cannot be used", files={"ca.pem": "x\n"}),
    Refusal("workers: --listen in use", ["serve", "--workers", "2", "--upstreams", "{d}/u.yaml", "--listen",
            "127.0.0.1:{port}", "--admin", "127.0.0.1:0"], 1,
            r"not starting: --listen 127\.0\.0\.1:\d+: address in use", files={"u.yaml": "groups: {}\n"}),
    Refusal("workers: a bad state file", serve("--workers", "2", state="{d}/s.json"), 1,
            r"not starting: \S*/s\.json: not a valid state", files={"s.json": "{"}),
    Refusal("workers: a bad upstreams file", serve("--workers", "2", "--upstreams", "{d}/u.yaml"), 1,
            r"not starting: fix the upstreams file \S*/u\.yaml", files={"u.yaml": "groups:\n  web: [\n"}),
    Refusal("workers: an unusable TLS certificate", serve("--workers", "2", "--upstreams", "{d}/u.yaml", "--tls-cert",
            "{d}/c.pem"), 1, r"\S*/c\.pem", files={"u.yaml": "groups: {}\n", "c.pem": "x\n"}),
]


def _fill(text: str, d: Path, port: int) -> str:
    return text.replace("{d}", str(d)).replace("{port}", str(port))


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


async def _holder(state: Path) -> asyncio.subprocess.Process:
    """A first eds-server holding `state`, for the second one to be refused."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "eds_server", *serve(state=str(state)), cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    async with asyncio.timeout(30):
        while b"serving EDS" not in (line := await proc.stderr.readline()):
            assert line, "the first eds-server did not start"
    return proc


async def _run(row: Refusal, d: Path, port: int, gate: asyncio.Semaphore) -> tuple[int | None, str, str]:
    for name, text in row.files.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(text.encode("latin-1"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDS_")}
    env.update({k: _fill(v, d, port) for k, v in row.env.items()})
    async with gate:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "eds_server", *(_fill(a, d, port) for a in row.args), cwd=ROOT, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            async with asyncio.timeout(30):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.send_signal(signal.SIGKILL)
            out, err = await proc.communicate()
            return None, out.decode(), err.decode()
    return proc.returncode, out.decode(), err.decode()


def test_every_refusal_is_one_line_and_no_traceback(tmp_path: Path, held_port: int) -> None:
    dirs = {row.name: tmp_path / f"case{i}" for i, row in enumerate(TABLE)}
    for d in dirs.values():
        d.mkdir()

    async def main() -> list[tuple[int | None, str, str]]:
        holder = await _holder(dirs["a state file in use"] / "held.json")
        try:
            gate = asyncio.Semaphore(4)  # two cores, shared: a few at a time
            return await asyncio.gather(*(_run(row, dirs[row.name], held_port, gate) for row in TABLE))
        finally:
            holder.terminate()
            await holder.wait()

    results = asyncio.run(main())
    wrong: list[str] = []
    for row, (status, out, err) in zip(TABLE, results, strict=True):
        named = any(re.search(row.line, line) for line in err.splitlines())
        problems = [
            *([f"exit {status}, not {row.status}"] if status != row.status else []),
            *(["a traceback"] if "Traceback" in err or "Traceback" in out else []),
            *([f"no line matching {row.line!r}"] if not named else []),
        ]
        if problems:
            wrong.append(f"{row.name}: {', '.join(problems)}\n    stderr: {err.strip()[-600:]}")
    assert not wrong, "\n".join(wrong)
    assert len(TABLE) == len({row.name for row in TABLE})
