"""A TLS-terminating proxy on 127.0.0.1 in front of kube-apiserver that can stall the watch connections
alone, as a proxy or NAT in between that stalls or forgets one connection does.

The client (eds-server) trusts the proxy's own CA; the proxy reads each request line (the client
sends only GETs, which have no body), counts the requests by what they are (a watch, /livez, /readyz,
a list), and forwards the bytes to kube-apiserver over TLS checked with its CA. A connection is a
watch's while its latest request is a watch and the API server has not ended the (chunked) answer.
`stall_watches(marker)` stops forwarding, both ways and for good, on every such connection whose
request line holds `marker`: the API server's later events and its end of the watch never arrive, and
nothing is closed; every other connection (the heartbeat's /livez, the next watches) goes through.
Only 127.0.0.1 is ever connected to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.tls import CertAuthority

CHUNKED_END = b"\r\n0\r\n\r\n"  # the end of a chunked answer (after the head's or the last chunk's CRLF)


def what(request_line: str) -> str:
    """A request line as counted: watch, livez, readyz, list, or other."""
    target = request_line.split(" ")[1] if " " in request_line else request_line
    if "watch=1" in target or "watch=true" in target:
        return "watch"
    path = target.split("?", 1)[0]
    if path in ("/livez", "/readyz"):
        return path[1:]
    return "list" if path.startswith(("/api/", "/apis/")) else "other"


@dataclass
class Connection:
    request: str = ""  # the latest request line
    answered: bool = True  # the answer to it ended (a watch's: its last chunk came)
    tail: bytes = b""  # the last bytes of the answer so far
    stalled: asyncio.Event = field(default_factory=asyncio.Event)

    def in_watch(self) -> bool:
        return what(self.request) == "watch" and not self.answered


class WatchStallProxy:
    def __init__(self, target_port: int, target_ca: Path, directory: Path) -> None:
        self.target_port = target_port
        self.upstream = ssl.create_default_context(cafile=str(target_ca))
        ca = CertAuthority("watch stall proxy", directory)
        issued = ca.issue(directory / "watch-stall-proxy", ips=["127.0.0.1"], dns=["localhost"])
        self.ca = ca.cert_path
        self.tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.tls.load_cert_chain(str(issued.cert), str(issued.key))
        self.port = 0
        self.requests: Counter[str] = Counter()  # by what(): watch, livez, readyz, list, other
        self.stalled: list[str] = []  # the request lines of the watches stalled
        self.lines: list[str] = []  # every request line, in order
        self.connections: list[Connection] = []
        self._server: asyncio.Server | None = None
        self._closing = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> WatchStallProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.tls)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing.set()  # the held pumps end
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # the others' reads end
            writer.close()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    def kubeconfig(self, token: str) -> str:
        """A kubeconfig naming the proxy (its CA) as the API server, with `token`."""
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "proxied",
                "clusters": [
                    {
                        "name": "proxied",
                        "cluster": {"server": f"https://127.0.0.1:{self.port}", "certificate-authority": str(self.ca)},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": token}}],
                "contexts": [{"name": "proxied", "context": {"cluster": "proxied", "user": "admin"}}],
            }
        )

    def watches_in_flight(self, marker: str) -> list[Connection]:
        return [c for c in self.connections if c.in_watch() and marker in c.request and not c.stalled.is_set()]

    def stall_watches(self, marker: str) -> list[str]:
        """Stall every watch in flight whose request line holds `marker`; their request lines."""
        lines = []
        for conn in self.watches_in_flight(marker):
            conn.stalled.set()
            lines.append(conn.request)
        self.stalled.extend(lines)
        return lines

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = Connection()
        self.connections.append(conn)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.target_port, ssl=self.upstream, server_hostname="127.0.0.1"
            )
            self._writers.add(up_writer)
            pumps = [
                asyncio.create_task(self._requests(reader, up_writer, conn)),
                asyncio.create_task(self._answers(up_reader, writer, conn)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
            self._tasks.discard(task)

    async def _held(self, conn: Connection) -> None:
        """A stalled connection's bytes are never forwarded: its pumps wait here until the proxy closes."""
        if conn.stalled.is_set():
            await self._closing.wait()
            raise ConnectionResetError("proxy closed")

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection) -> None:
        """Client to API server, one request head at a time (GETs: no body)."""
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            await self._held(conn)
            conn.request = head.split(b"\r\n", 1)[0].decode(errors="replace")
            self.lines.append(conn.request)
            conn.answered, conn.tail = False, b""
            self.requests[what(conn.request)] += 1
            writer.write(head)
            await writer.drain()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: Connection) -> None:
        """API server to client, as it comes; a chunk that ends the answer marks it answered."""
        while data := await reader.read(65536):
            await self._held(conn)
            conn.tail = (conn.tail + data[-len(CHUNKED_END) :])[-len(CHUNKED_END) :]
            if conn.tail == CHUNKED_END or not conn.in_watch():
                conn.answered = True
            writer.write(data)
            with contextlib.suppress(ConnectionError):
                await writer.drain()
