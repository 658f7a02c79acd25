"""The bench's floor (bench/floor.py) is only a reference if it serves what eds-server serves, to every
stream, within the client's windows: its response bytes, a run with the bench's own load generator,
and a client whose stream window is smaller than a response; each for the Python floor and the C one."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from eds_server import upstreams
from eds_server.encode import encode_group
from eds_server.encoded import Resource, content_version
from eds_server.pb.envoy.service.discovery.v3 import DiscoveryResponse
from eds_server.xds.wire import discovery_response
from tests.support.paths import ROOT, bench_module
from tests.support.ports import free_port
from tests.support.server_process import write_atomically
from tests.support.waiting import wait_for_blocking

BENCH = ROOT / "bench"
GROUP = "groups:\n  g0:\n    endpoints:\n" + "".join(
    f"      - {{address: 10.0.0.{i}, port: 8080, weight: 1}}\n" for i in range(1, 4)
)


def floor_module() -> ModuleType:
    return bench_module("floor")


@pytest.fixture(params=["python", "native"])
def floor(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path, Path]]:
    """A floor process on a free port, Python or C (bench/floor.c): (process, port, upstreams file, its stderr)."""
    native = request.param == "native"
    if native and shutil.which("gcc") is None:
        pytest.skip("no gcc for bench/floor.c")
    path, log = tmp_path / "upstreams.yaml", tmp_path / "floor.log"
    write_atomically(path, GROUP)
    port = free_port()
    with open(log, "w") as err:
        p = subprocess.Popen(
            [
                sys.executable,
                str(BENCH / "floor.py"),
                *(["--native"] if native else []),
                "serve",
                "--upstreams",
                str(path),
                "--listen",
                f"127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_for_blocking(lambda: connects(port), retry=(OSError,), what="the floor listens")
        yield p, port, path, log
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=10)


def connects(port: int) -> bool:
    socket.create_connection(("127.0.0.1", port), 1).close()
    return True


def stats(p_log: Path) -> dict[str, int]:
    """The floor's last stats line."""
    lines = [line for line in p_log.read_text().splitlines() if line.startswith("floor: ")]
    if not lines:
        return {}
    words = lines[-1].removeprefix("floor: ").split(", ")
    return {k: int(v) for k, v in (w.rsplit(" ", 1) for w in words)}


def test_the_floor_sends_eds_servers_encoding_with_a_new_version_and_nonce(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    write_atomically(path, GROUP)
    mod = floor_module()
    middle = mod.Floor.encoded_group(path)
    group = upstreams.load(str(path))["g0"]
    body = encode_group(group)
    resource = Resource("g0", content_version(body), body, group)
    for version in (0, 1, 41):
        framed = mod.framed_response(middle, version)
        assert framed[0] == 0 and int.from_bytes(framed[1:5], "big") == len(framed) - 5
        expected = discovery_response(f"{version:016x}", [resource], str(version + 1))
        assert framed[5:] == expected
        decoded = DiscoveryResponse.parse(framed[5:])
        assert (decoded.version_info, decoded.nonce, len(decoded.resources)) == (f"{version:016x}", str(version + 1), 1)


def test_the_load_generator_gets_every_change_from_the_floor(
    floor: tuple[subprocess.Popen[bytes], int, Path, Path],
) -> None:
    process, port, path, log = floor
    gen = subprocess.Popen(
        [sys.executable, str(BENCH / "loadgen.py"), "--node-bytes", "2000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert gen.stdin is not None and gen.stdout is not None

    def ask(cmd: dict[str, object]) -> dict[str, object]:
        assert gen.stdin is not None and gen.stdout is not None
        gen.stdin.write(json.dumps(cmd) + "\n")
        gen.stdin.flush()
        reply: dict[str, object] = json.loads(gen.stdout.readline())
        return reply

    try:
        assert json.loads(gen.stdout.readline()) == {"ready": True}
        ask({"cmd": "open", "port": port, "conns": [["g0"] * 3, ["g0"] * 3], "node_every": False})
        assert ask({"cmd": "wait", "counts": {"g0": 1}, "timeout": 15})["remaining"] == 0
        for n in (2, 3):
            write_atomically(path, GROUP.replace("weight: 1", f"weight: {n}", 1))
            assert ask({"cmd": "wait", "counts": {"g0": n}, "timeout": 15})["remaining"] == 0
        dump = ask({"cmd": "dump"})
        assert dump["n_errors"] == 0
        streams = dump["streams"]
        assert isinstance(streams, list) and len(streams) == 6
        for _group, recv, _size in streams:
            assert [version for version, _t in recv] == [f"{k:016x}" for k in range(3)]
    finally:
        if gen.poll() is None:
            gen.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            gen.stdin.flush()
        gen.wait(timeout=10)

    def counted() -> dict[str, int]:
        process.send_signal(signal.SIGUSR1)
        return stats(log)

    got = wait_for_blocking(counted, lambda s: s.get("acks") == 18, what="every response ACKed")
    # the fixture's probe and the load generator's two; 6 streams x 3 responses
    assert (got["connections"], got["streams"], got["responses"], got["changes"]) == (3, 6, 18, 2)
    assert got["sendmsg_partial"] == 0


def test_the_floor_keeps_to_a_window_smaller_than_a_response(
    floor: tuple[subprocess.Popen[bytes], int, Path, Path],
) -> None:
    _, port, path, _ = floor
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    window = {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100}
    conn.local_settings = h2.settings.Settings(client=True, initial_values=window)
    conn.initiate_connection()
    request = b"\x00\x00\x00\x00\x02\x1a\x00"  # one message: names (3) = [""]
    sid = conn.get_next_available_stream_id()
    conn.send_headers(
        sid,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", "127.0.0.1"),
            (":path", "/envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ],
    )
    conn.send_data(sid, request)
    conn.ping(b"12345678")  # answered after the request: whatever the floor sends for it comes first
    with socket.create_connection(("127.0.0.1", port), 5) as sock:
        sock.settimeout(10)
        sock.sendall(conn.data_to_send())

        def until(done: type[h2.events.Event] | None, want_data: int = 0) -> list[h2.events.Event]:
            """Events until `done` (or `want_data` DATA bytes), bounded in reads."""
            seen: list[h2.events.Event] = []
            for _ in range(100):
                events = conn.receive_data(sock.recv(65536))  # h2 raises if the floor overran a window
                seen += events
                sock.sendall(conn.data_to_send())
                got = sum(len(e.data) for e in seen if isinstance(e, h2.events.DataReceived))
                if (done and any(isinstance(e, done) for e in seen)) or (want_data and got >= want_data):
                    return seen
            raise AssertionError(f"not reached: {seen}")

        first = until(h2.events.PingAckReceived)
        assert any(isinstance(e, h2.events.ResponseReceived) for e in first)
        assert not [e for e in first if isinstance(e, h2.events.DataReceived)]  # 100 bytes: no room
        mod = floor_module()
        size = len(mod.framed_response(mod.Floor.encoded_group(path), 0))
        assert size > 100
        conn.increment_flow_control_window(1 << 20, sid)
        conn.increment_flow_control_window(1 << 20)
        sock.sendall(conn.data_to_send())
        data = until(None, size)
        assert sum(len(e.data) for e in data if isinstance(e, h2.events.DataReceived)) == size
