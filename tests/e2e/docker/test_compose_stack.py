"""The compose stack run for real: compose.yaml with `docker compose` (or Compose v1, `docker-compose`) on
a private dockerd, with traffic from this host through Envoy's published listener while the stack is
scaled, restarted, half-stopped, crashed and misconfigured, and while a backend hangs (paused, then
frozen) until eds-server's health check, from compose.yaml's labels, takes it out. Not one request may
fail while its backend is alive. A backend that exits at once on SIGTERM (whoami does, as PID 1) cuts
the answer it is writing: Envoy has already passed the headers on and cannot retry. Such a cut (a
response begun, then ended short) is counted apart, allowed only in a phase that stops backends, at
most one per traffic thread per backend stopped. So is a request sent to a hung backend before it was
marked (it times out), at most one per traffic thread; every other failure fails the test.

Images are the real ones where a registry answers, otherwise stand-ins built under the same names by
``build-standins.sh`` (``$EDS_COMPOSE_STANDINS``, default ``../shared/compose-standins/`` beside the
checkout); without either the test is skipped, saying why. Two things differ from a laptop, both in a
small override file, both forced by the private engine (no default bridge, no NAT, so that the test
never touches the host's firewall): the image build uses the host's network (pip reaches PyPI), and
the engine's socket is mounted where compose.yaml mounts /var/run/docker.sock. With IP forwarding off,
two compose networks are as separate as Docker's firewall rules make them on a normal host.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.docker_engine import NOT_YET_DOCKER, DockerEngine, DockerError, unavailable_reason
from tests.support.paths import ROOT
from tests.support.ports import bindable
from tests.support.waiting import wait_for_blocking

LISTENER, ADMIN = 10000, 18001  # compose.yaml publishes these on the host's 127.0.0.1
STANDINS = Path(os.environ.get("EDS_COMPOSE_STANDINS", ROOT.parent / "shared/compose-standins/build-standins.sh"))
REQUESTS_MAX, TRAFFIC_SECONDS_MAX = 40_000, 900.0  # bounds of the traffic loop, far above what a run needs
STEP = 120.0  # bound of each wait for the stack to reach a state (a loaded 2-core host)
# compose.yaml's eds.health.* labels on web: a backend that stops answering is out of Envoy's rotation
# within unhealthy_threshold x interval + timeout (2 x 1 s + 0.5 s), well inside the traffic's 10 s
# timeout: each traffic thread can have sent it at most one request before then, which hangs and fails.
CHECK_BOUND = 2 * 1.0 + 0.5
OUT_MIN = 100  # answers required while a backend is held out (after it was marked), and after it is back


def _images() -> list[str]:
    """The images the stack and the checks use: the Dockerfile's base and compose.yaml's."""
    text = (ROOT / "compose.yaml").read_text()
    base = re.search(r"^FROM\s+(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base, "no FROM in the Dockerfile"
    return [
        base.group(1),
        *dict.fromkeys(re.findall(r"\b(?:envoyproxy/envoy|traefik/whoami|curlimages/curl):\S+", text)),
    ]


def _compose_command(env: dict[str, str]) -> list[str] | None:
    """`docker compose` (v2) if the CLI has it, else Debian's `docker-compose` (v1.29), else None."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True, env=env, timeout=30).returncode == 0
    ):
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    return [v1] if v1 else None


@dataclass
class Traffic:
    """GETs from this host to Envoy's listener on 127.0.0.1, alternating / and /api, on keep-alive
    connections from a few threads, bounded in count and time. Counts per phase: answers cut short apart
    (``cut``), every other non-200 or error in ``failed``."""

    workers: int = 2
    pause: float = 0.04
    phase: str = "start"
    ok: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    cut: Counter[str] = field(default_factory=Counter)
    answered: Counter[tuple[str, str]] = field(default_factory=Counter)  # (phase, whoami's Hostname) of "/"
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        deadline = time.monotonic() + TRAFFIC_SECONDS_MAX
        for i in range(self.workers):
            thread = threading.Thread(target=self._run, args=(i, deadline), daemon=True)
            thread.start()
            self._threads.append(thread)

    def wait_ok(self, phase: str, n: int) -> None:
        """Until `n` requests of `phase` have been answered (bounded)."""
        wait_for_blocking(
            lambda: self.ok[phase], lambda k: k >= n, timeout=STEP, interval=0.2, what=f"{n} answers in {phase!r}"
        )

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    @property
    def total(self) -> int:
        return sum(self.ok.values()) + sum(self.failed.values()) + sum(self.cut.values())

    def _run(self, worker: int, deadline: float) -> None:
        conn: http.client.HTTPConnection | None = None
        n = 0
        while not self._stop.is_set() and time.monotonic() < deadline and self.total < REQUESTS_MAX:
            path = "/api" if (n + worker) % 2 else "/"
            n += 1
            phase = self.phase
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", LISTENER, timeout=10)
                conn.request("GET", path)
                resp = conn.getresponse()
                body = resp.read().decode("utf-8", "replace")
                good = resp.status == 200 and (('"name": "api"' in body) if path == "/api" else "Hostname:" in body)
                outcome = None if good else f"{resp.status} {body[:120]!r}"
                host = re.search(r"^Hostname: (\S+)", body, re.M) if good and path == "/" else None
                cut = False
            except http.client.IncompleteRead as exc:  # headers passed on, then the backend went
                conn, outcome, cut = None, repr(exc), True
            except (OSError, http.client.HTTPException) as exc:
                conn, outcome, cut = None, repr(exc), False
            with self._lock:
                if outcome is None:
                    self.ok[phase] += 1
                    if host:
                        self.answered[phase, host.group(1)] += 1
                elif cut:
                    self.cut[phase] += 1
                    if len(self.failures) < 20:
                        self.failures.append(f"{phase} GET {path} (cut): {outcome}")
                else:
                    self.failed[phase] += 1
                    if len(self.failures) < 20:
                        self.failures.append(f"{phase} GET {path}: {outcome}")
            self._stop.wait(self.pause)
        if conn is not None:
            conn.close()


class Stack:
    """compose.yaml as project ``name`` on ``engine``, with the override file the private engine needs."""

    def __init__(self, engine: DockerEngine, compose: list[str], env: dict[str, str], override: Path) -> None:
        self.engine, self.compose, self.env, self.override = engine, compose, env, override

    def run(self, *args: str, gid: str | None = None, timeout: float = STEP, check: bool = True) -> str:
        env = self.env if gid is None else {**self.env, "DOCKER_GID": gid}
        files = ["-f", str(ROOT / "compose.yaml"), "-f", str(self.override)]
        proc = subprocess.run(
            [*self.compose, *files, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        out = proc.stdout + proc.stderr
        if check and proc.returncode != 0:
            raise DockerError(f"compose {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}")
        return out

    def ids(self, service: str) -> list[str]:
        return self.run("ps", "-q", service).split()

    def envoy_admin(self, path: str) -> str:
        """Envoy's admin, on the Envoy container's own loopback (as compose.yaml's healthcheck asks it)."""
        script = (
            "exec 3<>/dev/tcp/127.0.0.1/9901 && printf 'GET %s HTTP/1.1\\r\\nHost: x\\r\\nConnection: close"
            '\\r\\n\\r\\n\' "$0" >&3 && cat <&3'
        )
        return self.engine.cli("exec", self.ids("envoy")[0], "bash", "-c", script, path, timeout=30)

    def envoy_hosts(self) -> dict[str, int]:
        """Healthy hosts of each EDS cluster, as Envoy holds them."""
        text = self.envoy_admin("/clusters")
        return {
            c: len(re.findall(rf"^{c}::[^:]+:\d+::health_flags::healthy$", text, re.M)) for c in ("web", "api-cluster")
        }

    def wait_hosts(self, web: int) -> None:
        wait_for_blocking(
            self.envoy_hosts,
            lambda h: h == {"web": web, "api-cluster": 1},
            timeout=STEP,
            interval=0.5,
            what=f"Envoy to hold {web} web hosts and 1 api host",
            retry=NOT_YET_DOCKER,
        )

    def eds_server(self) -> dict[str, Any]:
        return self.engine.inspect(self.ids("eds-server")[0])

    def wait_eds_server_serving(self, *, restarts: int | None = None) -> None:
        """eds-server healthy (after ``restarts`` crash restarts), and both of Envoy's streams back and ACKed."""

        def state() -> tuple[object, ...]:
            info = self.eds_server()
            health = info["State"].get("Health", {}).get("Status")
            streams = json.loads(_get(ADMIN, "/v1/streams"))["streams"]
            acked = sorted(n for s in streams for n, v in s["names"].items() if v["acked"] and v["acked"] == v["sent"])
            return health, info["RestartCount"], acked

        want = ("healthy", restarts, ["api", "web"])
        wait_for_blocking(
            state,
            lambda s: s[0] == want[0] and s[2] == want[2] and (restarts is None or s[1] == restarts),
            timeout=STEP,
            interval=0.5,
            what=f"eds-server serving Envoy again {want}",
            retry=(*NOT_YET_DOCKER, KeyError, json.JSONDecodeError, http.client.HTTPException),
        )

    def backend_address(self, cid: str) -> str:
        """A backend's address on the project's "default" network: the one eds-server serves and checks."""
        nets = self.engine.inspect(cid)["NetworkSettings"]["Networks"]
        return str(next(n["IPAddress"] for name, n in nets.items() if name.endswith("_default")))

    def served(self, group: str, address: str) -> dict[str, Any] | None:
        """The endpoint at `address` in eds-server's /v1/groups/GROUP (its served health, its check)."""
        endpoints = json.loads(_get(ADMIN, f"/v1/groups/{group}"))["endpoints"]
        return next((e for e in endpoints if e["address"] == address), None)

    def wait_served(self, address: str, health: str, *, checked: bool) -> dict[str, Any]:
        """Until eds-server serves the web endpoint at `address` with `health` (and, if `checked`, its own
        check says so too); returns the endpoint."""

        def done(ep: dict[str, Any] | None) -> bool:
            return ep is not None and ep["health"] == health and (not checked or ep["check"]["checked"] == health)

        found = wait_for_blocking(
            lambda: self.served("web", address),
            done,
            timeout=STEP,
            interval=0.1,
            what=f"eds-server to serve web endpoint {address} {health}",
            retry=(*NOT_YET_DOCKER, KeyError, json.JSONDecodeError, http.client.HTTPException),
        )
        assert found is not None
        return found


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read().decode()
        if resp.status != 200:
            raise OSError(f"GET {path}: {resp.status}")
        return body
    finally:
        conn.close()


def _ensure_images(engine: DockerEngine, images: Sequence[str]) -> str:
    """Pull what a registry gives; build the rest as stand-ins. Returns how; skips if neither works."""
    missing: list[str] = []
    why = ""
    for image in images:
        if "timed out" in why:
            missing.append(image)  # a registry that does not answer: do not wait for it again
            continue
        try:
            engine.cli("pull", "-q", image, timeout=180)
        except DockerError as exc:
            why = str(exc)
            missing.append(image)
    if not missing:
        return "real images (pulled)"
    if not STANDINS.is_file():
        pytest.skip(f"no registry for {', '.join(missing)} ({why}) and no stand-in script at {STANDINS}")
    proc = subprocess.run(
        ["bash", str(STANDINS), str(ROOT)],
        env={**os.environ, "DOCKER_HOST": engine.host},
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode != 0:
        pytest.skip(f"stand-in images did not build ({STANDINS}):\n{(proc.stdout + proc.stderr)[-1500:]}")
    return f"stand-ins for {', '.join(missing)}" + (
        f"; pulled {len(images) - len(missing)}" if len(missing) < len(images) else ""
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"Docker engine unavailable: {reason}")
    busy = [p for p in (LISTENER, ADMIN) if not bindable(p)]
    if busy:
        pytest.skip(f"compose.yaml publishes 127.0.0.1:{LISTENER} and :{ADMIN}; busy here: {busy}")
    engine = DockerEngine(storage_driver="overlay2", extra_args=["--ip-forward=false"], start_timeout=90)
    try:
        engine.start()
    except DockerError:
        engine.close()  # overlay2 needs ext4 or xfs under the temp dir; vfs copies every layer but works anywhere
        engine = DockerEngine(extra_args=["--ip-forward=false"], start_timeout=90)
        engine.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
        env |= {
            "DOCKER_HOST": engine.host,
            "DOCKER_CONFIG": str(engine.dir / "cli"),
            "COMPOSE_PROJECT_NAME": f"edscompose{os.getpid()}",
            "DOCKER_GID": str(engine.socket_path.stat().st_gid),
        }
        compose = _compose_command(env)
        if compose is None:
            pytest.skip(
                "neither `docker compose` nor `docker-compose` is installed (Debian: apt-get install docker-compose)"
            )
        how = _ensure_images(engine, _images())
        override = tmp_path_factory.mktemp("compose") / "override.yaml"
        override.write_text(
            "services:\n  eds-server:\n    build: {context: ., network: host}\n"
            f"    volumes: ['{engine.socket_path}:/var/run/docker.sock']\n"
        )
        print(f"\ncompose: {' '.join(Path(c).name for c in compose)}; images: {how}")
        yield Stack(engine, compose, env, override)
    finally:
        engine.close()


def test_compose_stack_keeps_serving(stack: Stack) -> None:
    stack.run("up", "--build", "-d", timeout=900)
    stack.wait_hosts(3)
    stack.wait_eds_server_serving()
    traffic = Traffic(phase="up")
    traffic.start()
    try:
        _check_network_separation(stack)

        for how in ("paused", "frozen"):
            _backend_out(stack, traffic, how)

        traffic.phase = "scale up"
        stack.run("up", "-d", "--scale", "web=5")
        stack.wait_hosts(5)

        traffic.phase = "scale down"
        stack.run("up", "-d", "--scale", "web=2")
        stack.wait_hosts(2)

        traffic.phase = "restart eds-server"
        stack.run("restart", "eds-server")
        stack.wait_eds_server_serving()
        page = _get(ADMIN, "/")  # the streams resumed, ACKed, without a response to ACK: the page says so
        assert "ACKs, 0 NACKs of responses sent since start" in page and "(or held when it connected)" in page
        stack.run("up", "-d", "--scale", "web=3")  # a change after the restart reaches Envoy
        stack.wait_hosts(3)

        traffic.phase = "backend stopped"
        stopped = stack.ids("web")[0]
        stack.engine.cli("stop", stopped)
        stack.wait_hosts(2)

        traffic.phase = "kill -9 eds-server"
        pid = int(stack.eds_server()["State"]["Pid"])
        os.kill(pid, signal.SIGKILL)  # a crash: `restart: unless-stopped` starts it again (docker kill would not)
        stack.wait_eds_server_serving(restarts=1)
        stack.engine.cli("start", stopped)
        stack.wait_hosts(3)

        traffic.phase = "wrong DOCKER_GID"
        wrong = str(int(stack.env["DOCKER_GID"]) + 1)
        out = stack.run("up", "-d", gid=wrong, timeout=300, check=False)
        assert "unhealthy" in out, out  # what docs/docker.md's troubleshooting names
        said = next(line for line in out.splitlines() if "unhealthy" in line)
        print(said)
        named = re.search(r'Container "([0-9a-f]+)"', said)  # Compose v1 names the container by id
        assert named is None or stack.ids("eds-server")[0].startswith(named.group(1)), said  # not Envoy's
        stack.run("up", "-d", "--scale", "web=2")  # the right gid again; and a change to deliver
        stack.wait_eds_server_serving()
        stack.wait_hosts(2)
        traffic.phase = "end"
    finally:
        traffic.stop()
    summary = ", ".join(f"{p}: {traffic.ok[p]}" for p in traffic.ok)
    print(f"requests: {traffic.total}, failed {sum(traffic.failed.values())}, cut {dict(traffic.cut)} ({summary})")
    # a request sent to the backend in the window between its pause (or freeze) and its mark hangs: at most one
    # per traffic thread; every other request must be answered, those while it is held out included
    hung = {p: n for p, n in traffic.failed.items() if p in ("backend paused", "backend frozen")}
    assert not traffic.failed - Counter(hung), traffic.failures
    assert all(n <= traffic.workers for n in hung.values()), traffic.failures
    why = [f for f in traffic.failures if f.startswith(("backend paused GET", "backend frozen GET"))]
    print(f"failed before the mark (counted apart, at most {traffic.workers} each): {hung or 'none'} {why}")
    # backends stopped in each phase (scale 5 -> 2, one `docker stop`, scale 3 -> 2); nowhere else may an answer be cut
    stops = {"scale down": 3, "backend stopped": 1, "wrong DOCKER_GID": 1}
    assert all(n <= traffic.workers * stops.get(p, 0) for p, n in traffic.cut.items()), traffic.failures
    assert all(
        traffic.ok[p] > 0
        for p in (
            "up",
            "backend paused, marked",
            "backend paused, back",
            "backend frozen, marked",
            "backend frozen, back",
            "scale up",
            "scale down",
            "restart eds-server",
            "backend stopped",
            "kill -9 eds-server",
            "wrong DOCKER_GID",
        )
    ), traffic.ok


def _backend_out(stack: Stack, traffic: Traffic, how: str) -> None:
    """One web backend stops answering while traffic runs: `docker pause` ("paused": Docker says so, and
    eds-server's Docker source marks it unhealthy at once) or SIGSTOP of its process ("frozen": Docker
    still says running; only eds-server's health check, from compose.yaml's labels, sees it). Once
    eds-server marks it and Envoy holds it unhealthy, OUT_MIN requests, none failing; then it resumes,
    its checks pass again, and it answers again.

    Requests sent to it between the stop and the mark hang (its kernel still accepts connections) until
    the traffic's timeout: phase "backend HOW", counted apart by the caller."""
    cid = stack.ids("web")[0]
    address, hostname = stack.backend_address(cid), stack.engine.inspect(cid)["Config"]["Hostname"]
    before = stack.served("web", address)
    assert before and before["health"] == "healthy" and before["check"]["result"] == "pass", before
    pid = int(stack.engine.inspect(cid)["State"]["Pid"])
    traffic.phase = f"backend {how}"
    started = time.monotonic()
    if how == "paused":
        stack.engine.cli("pause", cid)
    else:
        os.kill(pid, signal.SIGSTOP)
    try:
        marked = stack.wait_served(address, "unhealthy", checked=how == "frozen")
        to_marked = time.monotonic() - started
        stack.wait_hosts(2)  # Envoy holds it as /failed_eds_health
        to_envoy = time.monotonic() - started
        traffic.phase = f"backend {how}, marked"
        traffic.wait_ok(traffic.phase, OUT_MIN)
        if how == "frozen":  # the check's own verdict, from its timeouts
            assert marked["check"]["result"] == "fail" and marked["check"]["in_a_row"] >= 2, marked
        else:  # and the checks agree with Docker
            stack.wait_served(address, "unhealthy", checked=True)
    finally:
        if how == "paused":
            stack.engine.cli("unpause", cid)
        else:
            os.kill(pid, signal.SIGCONT)
    traffic.phase = f"backend {how}, back"
    stack.wait_served(address, "healthy", checked=True)
    stack.wait_hosts(3)
    traffic.wait_ok(traffic.phase, OUT_MIN)
    wait_for_blocking(
        lambda: traffic.answered[traffic.phase, hostname], timeout=STEP, interval=0.2, what=f"an answer from {hostname}"
    )
    assert traffic.answered[f"backend {how}, marked", hostname] == 0
    print(
        f"backend {how}: eds-server marked it after {to_marked:.1f}s (the check's bound: {CHECK_BOUND:g}s), "
        f"Envoy after {to_envoy:.1f}s "
        f"({marked['check']}); failed before: {traffic.failed[f'backend {how}']}, "
        f"answered while out: {traffic.ok[f'backend {how}, marked']}"
    )


def _check_network_separation(stack: Stack) -> None:
    """From inside a backend (its network namespace), eds-server's xDS and admin ports and Envoy's admin
    are out of reach; from inside Envoy, eds-server's admin answers.

    A backend shares the "default" network with eds-server (which checks it from there): eds-server's
    address on it, and the name "eds-server" that resolves to it, are reached directly and must refuse
    both ports (eds-server listens on its control address alone). The alias `eds-control` does not
    resolve there. The control address itself is reached only through the host's routing, which
    Docker's firewall rules close on a normal host. This engine runs without them (the test leaves
    the host's firewall alone), so that address is checked only where this host does not forward
    between its interfaces (net.ipv4.ip_forward=0; other dockerds turn it on). The backends have no
    NET_RAW, without which they cannot hand eds-server a packet for its control address directly.
    """
    web, envoy = stack.ids("web")[0], stack.ids("envoy")[0]
    eds_nets = stack.eds_server()["NetworkSettings"]["Networks"]
    web_info = stack.engine.inspect(web)
    web_nets = web_info["NetworkSettings"]["Networks"]
    shared = set(eds_nets) & set(web_nets)
    assert len(shared) == 1 and next(iter(shared)).endswith("_default"), (sorted(eds_nets), sorted(web_nets))
    assert "NET_RAW" in (web_info["HostConfig"]["CapDrop"] or []), web_info["HostConfig"]["CapDrop"]
    control = {n["IPAddress"] for name, n in eds_nets.items() if name not in shared}
    hosts = ["eds-server", "eds-control", *(eds_nets[name]["IPAddress"] for name in shared)]
    if Path("/proc/sys/net/ipv4/ip_forward").read_text().strip() == "0":
        hosts += sorted(control)
    else:
        print("this host forwards between interfaces: eds-server's control address not checked from a backend")
    targets = [f"http://{host}:{port}/" for host in hosts for port in (18000, ADMIN)]
    targets.append("http://envoy:9901/ready")  # Envoy's admin is on its container's loopback
    curl = next(i for i in _images() if i.startswith("curlimages/curl:"))
    # curl's exit status 6 (no such name), 7 (no connection) or 28 (timed out): not reached. Anything
    # else, an HTTP error or a reply that is not HTTP/1 (the gRPC port) included, means it connected.
    script = 'for u in "$@"; do curl -s -m 3 -o /dev/null "$u"; case $? in 6|7|28) ;; *) echo "reached $u";; esac; done'
    out = stack.engine.cli(
        "run", "--rm", "--network", f"container:{web}", curl, "sh", "-c", script, "sh", *targets, timeout=120
    )
    assert "reached" not in out, out
    stack.engine.cli(
        "run",
        "--rm",
        "--network",
        f"container:{envoy}",
        curl,
        "-s",
        "-m",
        "10",
        "-o",
        "/dev/null",
        f"http://eds-control:{ADMIN}/readyz",
        timeout=60,
    )
