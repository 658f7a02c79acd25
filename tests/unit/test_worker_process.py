"""`--workers` processes as the kernel sees them: a worker never outlives its owner (whenever the
owner is killed), the owner holds the port from before it serves until it exits, a worker that
cannot start stops the owner with the reason, SIGHUP reloads rather than kills, the private
directory is removed on every exit path; and the pieces: steering, leftovers, summed counters."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eds_server.worker_process import BOOTSTRAP, DIRECTORY_PREFIX, LOCK_FILE, Steering, bind_listeners, remove_leftovers
from eds_server.workers import merge_metrics, served_samples
from tests.support.ports import bindable
from tests.support.server_process import EdsServerProcess, RunAs
from tests.support.tls import CertAuthority, client_context
from tests.support.waiting import wait_for

ROUNDS = 8  # owner kills, each at a random moment of a worker's first start or restart


def upstreams(tmp_path: Path) -> Path:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints:\n      - 127.0.0.1:9\n")
    return path


def workers_of(owner: int) -> dict[int, str]:
    """pid -> private directory of every live worker of `owner`, wherever it was reparented: its
    command line is the bootstrap, then the owner's pid, then the directory."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (
            len(argv) > 4
            and argv[1] == b"-c"
            and argv[2] == BOOTSTRAP.encode()
            and argv[3] == str(owner).encode()
            and state != "Z"
        ):
            found[int(entry)] = argv[4].decode()
    return found


async def test_an_owner_killed_at_any_moment_of_a_workers_start_leaves_no_process_and_no_port(
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    server = EdsServerProcess(upstreams(tmp_path), "--workers", "2", workdir=tmp_path)
    directories: set[str] = set()
    outcomes = collections.Counter()
    try:
        for round_ in range(ROUNDS):
            await server.start(wait_ready=round_ % 2 == 1)
            assert server.proc is not None
            owner = server.proc.pid
            if round_ % 2 == 1:  # a restart: kill a worker, then the owner while its successor starts
                victim = next(iter(workers_of(owner)))
                os.kill(victim, signal.SIGKILL)
            await asyncio.sleep(rng.uniform(0.0, 2.5))  # the kill comes at any moment of the start (not a wait)
            seen = workers_of(owner)
            directories.update(seen.values())
            outcomes[f"{len(seen)} workers up"] += 1
            server.proc.send_signal(signal.SIGKILL)
            await server.proc.wait()
            # no worker survives its owner, and the port is free for the next one
            await wait_for(
                lambda o=owner: not workers_of(o) and bindable(server.port),
                timeout=10,
                what="the workers gone and the port free",
            )
        await server.start()  # a new eds-server on the same ports, serving
        assert await server.stop() == 0
    finally:
        if server.proc is not None and server.proc.returncode is None:
            server.proc.kill()
    print(f"owner killed {ROUNDS} times: {dict(outcomes)}")
    for directory in directories:  # removed by the worker that saw its owner gone, or by the next start
        assert not os.path.exists(directory), directory


async def test_a_worker_that_cannot_start_stops_the_owner_with_the_reason(tmp_path: Path) -> None:
    server = EdsServerProcess(upstreams(tmp_path), "--workers", "2", workdir=tmp_path)
    await server.start(wait_ready=False)
    assert server.proc is not None
    owner, killed = server.proc.pid, set()

    def kill_worker_1() -> bool:
        """Every worker 1 dies at once; True once the owner has given up."""
        assert server.proc is not None
        for pid in workers_of(owner):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if len(argv) > 5 and argv[5] == b"1":  # a killed worker not reaped yet has an empty one
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        return server.proc.returncode is not None

    await wait_for(kill_worker_1, timeout=60, interval=0.01, what="the owner ended")
    assert await asyncio.wait_for(server.proc.wait(), 30) == 1
    log = server.log_text()
    assert "not serving: worker 1 failed to start 3 times in a row (last: killed by signal 9)" in log
    assert len(killed) == 3
    assert not workers_of(owner) and bindable(server.port)


async def test_sighup_reloads_without_a_restart_and_sigterm_drains_and_cleans_up(tmp_path: Path) -> None:
    async with EdsServerProcess(upstreams(tmp_path), "--workers", "2", workdir=tmp_path) as server:
        assert server.proc is not None
        workers = workers_of(server.proc.pid)
        assert len(workers) == 2
        server.proc.send_signal(signal.SIGHUP)
        await wait_for(
            lambda: server.log_text().count("SIGHUP: nothing to reload") == 2,
            timeout=10,
            what="both workers' reload lines",
        )
        assert workers_of(server.proc.pid) == workers  # the same processes: nothing restarted
        assert (await server.admin("/readyz"))["ready"]
        assert await server.stop() == 0
    assert "shutting down: draining the workers" in server.log_text()
    assert not any(os.path.exists(d) for d in workers.values())
    assert not workers_of(server.proc.pid)


def test_the_owner_holds_the_port_from_before_it_serves(tmp_path: Path) -> None:
    listeners = bind_listeners("127.0.0.1", 0, 2)
    port = listeners[0].getsockname()[1]
    try:
        assert {s.getsockname()[1] for s in listeners} == {port}
        assert not bindable(port)  # not even this user, without SO_REUSEPORT
        with pytest.raises(OSError):
            _bind_plain(port)
        # another user, with SO_REUSEPORT: Linux lets only the group's own user join it
        code = (
            "import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); "
            f"s.bind(('127.0.0.1', {port})); s.listen(1)"
        )
        other = subprocess.run(
            [*RunAs(65534, 65534).command(), sys.executable, "-c", code], capture_output=True, text=True, timeout=30
        )
        assert other.returncode == 1 and "Address already in use" in other.stderr
    finally:
        for sock in listeners:
            sock.close()
    assert bindable(port)


def _bind_plain(port: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_steering_sends_new_connections_to_the_chosen_sockets_then_back_to_the_hash() -> None:
    listeners = bind_listeners("127.0.0.1", 0, 3)
    port = listeners[0].getsockname()[1]
    steering = Steering(listeners)

    def spread(connections: int = 30) -> dict[int, int]:
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(connections)]
        counts: collections.Counter[int] = collections.Counter()
        for i, sock in enumerate(listeners):
            sock.setblocking(False)
            while True:
                try:
                    accepted, _ = sock.accept()
                except BlockingIOError:
                    break
                accepted.close()
                counts[i] += 1
        for client in clients:
            client.close()
        return dict(counts)

    try:
        assert steering.steer([2])
        assert spread() == {2: 30}
        assert steering.steer([0, 1])
        assert set(spread()) == {0, 1}
        steering.spread()
        assert sum(spread(60).values()) == 60
    finally:
        for sock in listeners:
            sock.close()


def test_leftovers_of_dead_owners_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    dead, live = tmp_path / f"{DIRECTORY_PREFIX}dead", tmp_path / f"{DIRECTORY_PREFIX}live"
    for d in (dead, live):
        d.mkdir()
        (d / LOCK_FILE).touch()
        os.utime(d / LOCK_FILE, (time.time() - 5, time.time() - 5))
    held = os.open(live / LOCK_FILE, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        assert remove_leftovers(str(tmp_path)) == [str(dead)]
        assert live.exists() and not dead.exists()
    finally:
        os.close(held)


def test_summed_counters_carry_on_and_gauges_do_not() -> None:
    kinds = {"eds_requests": ("counter", "Requests"), "eds_streams_open": ("gauge", "Open")}
    key = ("eds_requests", "eds_requests_total", ())
    gauge = ("eds_streams_open", "eds_streams_open", (("transport", "sotw"),))
    described = [{"worker": 1, "alive": True, "restarts": 1}, {"worker": 2, "alive": True, "restarts": 0}]
    text = merge_metrics("", [{key: 40.0 + 5.0, gauge: 0.0}, {key: 80.0, gauge: 3.0}], kinds, described)
    assert "eds_requests_total 125.0" in text
    assert 'eds_streams_open{transport="sotw"} 3.0' in text
    assert 'eds_worker_restarts_total{worker="1"} 1.0' in text


async def test_sighup_reloads_the_authorization_file_and_keeps_the_running_rules_on_a_bad_one(tmp_path: Path) -> None:
    """One process (no --workers) as well: a stream opened after the reload gets the new rules."""
    authz = tmp_path / "authz.yaml"
    authz.write_text('rules:\n  - match: {node_id: "envoy-*"}\n    groups: ["other"]\ndefault: deny\n')
    async with EdsServerProcess(upstreams(tmp_path), "--authz", str(authz), workdir=tmp_path) as server:
        assert server.proc is not None
        assert await _first_answer(server.port) == "PERMISSION_DENIED"
        authz.write_text("rules: [oops\n")
        server.proc.send_signal(signal.SIGHUP)
        await wait_for(lambda: "authorization not reloaded, the running rules kept" in server.log_text(), timeout=10)
        assert await _first_answer(server.port) == "PERMISSION_DENIED"
        authz.write_text('rules:\n  - match: {node_id: "envoy-*"}\n    groups: ["web"]\ndefault: deny\n')
        server.proc.send_signal(signal.SIGHUP)
        await wait_for(
            lambda: "authorization" in server.log_text() and "reloaded: 1 rules" in server.log_text(), timeout=10
        )
        assert await _first_answer(server.port) == "web"


async def _first_answer(port: int) -> str:
    """The first thing a delta stream for web from node envoy-1 gets: a resource name, or the status."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality
    from grpclib.exceptions import GRPCError

    from eds_server.sources.relay import DELTA_PATH, decode_response, encode_request
    from eds_server.transport.h2 import PassThroughCodec

    channel = Channel("127.0.0.1", port, codec=PassThroughCodec())
    try:
        async with channel.request(DELTA_PATH, Cardinality.STREAM_STREAM, bytes, bytes) as stream:
            await stream.send_message(encode_request("envoy-1", subscribe=["web"], node=True))
            received = decode_response(await asyncio.wait_for(stream.recv_message(), 10))
            await stream.cancel()
            return ",".join(name for name, _, _ in received.resources)
    except GRPCError as e:  # where it surfaces differs between the HTTP/2 paths
        return e.status.name
    finally:
        channel.close()


async def test_sighup_gives_new_tls_connections_the_new_certificate_on_every_worker(tmp_path: Path) -> None:
    ca = CertAuthority("test CA", tmp_path / "ca")
    first = ca.issue(tmp_path / "first", common_name="first", ips=["127.0.0.1"])
    second = ca.issue(tmp_path / "second", common_name="second", ips=["127.0.0.1"])
    cert, key = tmp_path / "server.pem", tmp_path / "server-key.pem"
    cert.write_bytes(first.cert.read_bytes())
    key.write_bytes(first.key.read_bytes())
    context = client_context(ca.cert_path)

    def names(connections: int = 8) -> set[str]:
        """The common names new connections are shown (8 connections: both workers, by the kernel's hash)."""
        seen = set()
        for _ in range(connections):
            with (
                socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw,
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                subject = dict(x[0] for x in tls.getpeercert()["subject"])
                seen.add(subject["commonName"])
        return seen

    async with EdsServerProcess(
        upstreams(tmp_path), "--workers", "2", "--tls-cert", str(cert), "--tls-key", str(key), workdir=tmp_path
    ) as server:
        assert server.proc is not None
        assert await asyncio.to_thread(names) == {"first"}
        cert.write_bytes(second.cert.read_bytes())
        key.write_bytes(second.key.read_bytes())
        server.proc.send_signal(signal.SIGHUP)
        await wait_for(
            lambda: server.log_text().count("SIGHUP: TLS certificate") == 2,
            timeout=10,
            what="both workers' reload lines",
        )
        assert await asyncio.to_thread(names) == {"second"}


def test_worker_metrics_are_summed_and_store_metrics_are_the_owners() -> None:
    own = (
        '# TYPE eds_streams_open gauge\neds_streams_open{transport="delta"} 2.0\n'
        "# TYPE eds_ready gauge\neds_ready 1.0\n"
        "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 100.0\n"
    )
    worker = (
        '# TYPE eds_streams_open gauge\neds_streams_open{transport="delta"} 5.0\n'
        "# TYPE eds_ready gauge\neds_ready 1.0\n"
        "# TYPE eds_responses_total counter\neds_responses_total 7.0\n"
        "# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes 10.0\n"
    )
    kinds: dict[str, tuple[str, str]] = {}
    counted, gauges = served_samples(worker, kinds)
    assert "eds_ready" not in kinds  # a store figure: the owner's
    merged = merge_metrics(
        own,
        [{**counted, **gauges}, {**counted, **gauges}],
        kinds,
        [{"worker": 1, "alive": True, "restarts": 0}, {"worker": 2, "alive": False, "restarts": 3}],
    )
    assert 'eds_streams_open{transport="delta"} 10.0' in merged  # the workers' streams, not the owner's links
    assert "eds_responses_total 14.0" in merged
    assert "eds_ready 1.0" in merged  # the owner's alone
    assert "process_resident_memory_bytes 120.0" in merged  # every process
    assert "eds_workers_alive 1.0" in merged and 'eds_worker_restarts_total{worker="2"} 3.0' in merged
