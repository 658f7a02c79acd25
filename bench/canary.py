"""A canary beside the fan-out: one well-behaved stream whose own group changes while thousands of
streams take theirs, so the bench shows what the load costs a client that asks for little.

The canary is one load-generator stream (bench/loadgen.py) on a connection of its own, from an address
of its own (127.0.0.2: another Envoy, not one of the fleet behind 127.0.0.1), subscribed to the group
`canary`. Its group is changed through eds-server's registration API every INTERVAL seconds (the
endpoint's port is the change's number), the way the hostile tests' canary changes it: a write that
takes effect at once, with no file watch or debounce in its delay. A change's delay is from just
before its write to the first response the stream receives after it (a later response carries every
earlier change: changes may be coalesced), CLOCK_MONOTONIC in both processes.

Its changes cost the server CPU (an HTTP request, a store update, one response), so the bench runs it
in changes of its own after the measured ones, never in the CPU per change it reports beside it.
eds-server only: the floors and go-control-plane have no registration API.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO, Any

from run import Workers, dist

GROUP = "canary"
ADDRESS = "127.0.0.2"  # the canary's own client address (loopback)
TOKEN = "bench-canary-token-0123456789"  # the admin token of the servers it runs beside
ARGS = ["--registration-allow-cidr", "127.0.0.0/8"]  # and EDS_ADMIN_TOKEN=TOKEN in their environment
ENV = {"EDS_ADMIN_TOKEN": TOKEN}
INTERVAL = 0.05  # seconds between its changes: several land inside each fan-out's delivery
GAP = 0.5  # seconds between the fan-out's changes while it runs (the ACKs read, as a settled server has)
BASE_PORT = 20000
# the canary's load generator shares the client core with the fleet's, which read 270 MB a change:
# ahead of them, its delay is the server's, not that core's queue (another Envoy has its own CPU)
NICE = -10
LAST_WAIT = 5.0  # seconds the last change may take to arrive once the writes stop


def delays(written: list[int], received: list[int]) -> tuple[list[float], int]:
    """Each change's delay in seconds (write to the first receipt at or after it, both in ns) and how
    many had no receipt after them."""
    received = sorted(received)
    out: list[float] = []
    missed = 0
    for t in written:
        i = bisect.bisect_left(received, t)
        if i == len(received):
            missed += 1
        else:
            out.append((received[i] - t) / 1e9)
    return out, missed


class Canary:
    """One stream on `canary`, and its changes written while `changing` runs."""

    def __init__(self, port: int, admin: int, node_bytes: int, log: IO[str]) -> None:
        self.admin = admin
        self.seq = 0
        self.written: list[int] = []
        self.refused = 0  # writes the API did not take
        self.why: list[str] = []  # the first few of them, why
        deadline, tries = time.monotonic() + 30, 1
        while (why := self.put()) is not None:  # the group exists before the stream asks for it
            if why.startswith("HTTP ") or time.monotonic() > deadline:  # an answer: asking again changes nothing
                raise RuntimeError(
                    f"the canary's first write was refused ({why}; writes tried: {tries}): the server needs "
                    f"{' '.join(ARGS)} and EDS_ADMIN_TOKEN={TOKEN} (canary.ARGS and canary.ENV)"
                )
            time.sleep(0.1)  # not listening yet: the admin port may still be starting
            tries += 1
        self.refused, self.why = 0, []
        self.workers = Workers(1, node_bytes, log)
        self.nice = 0
        with contextlib.suppress(PermissionError):  # not root: it queues with the fleet's load generators
            os.setpriority(os.PRIO_PROCESS, self.workers.procs[0].p.pid, NICE)
            self.nice = NICE
        try:
            self.workers.all(
                [{"cmd": "open", "port": port, "conns": [[GROUP]], "node_every": False, "sources": [ADDRESS]}]
            )
            (got,) = self.workers.all([{"cmd": "wait", "counts": {GROUP: 1}, "timeout": 30}])
            if got["remaining"]:
                raise RuntimeError("the canary's stream never got its first response")
        except BaseException:
            self.workers.stop()
            raise
        self.workers.dump(clear=True)
        self.written.clear()

    def put(self) -> str | None:
        """One change of the canary's group, its time taken just before the write; None if it was
        taken, else why not (an answer of the server's as "HTTP <status>: <body>")."""
        self.seq += 1
        body = json.dumps({"address": "127.0.0.1", "port": BASE_PORT + self.seq % 40000}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.admin}/v1/groups/{GROUP}/endpoints/canary",
            data=body,
            method="PUT",
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        t = time.monotonic_ns()
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                r.read()
        except urllib.error.HTTPError as e:
            why = f"HTTP {e.code}: {e.read()[:200].decode(errors='replace').strip()}"
        except (urllib.error.URLError, OSError) as e:
            why = str(e)[:200]
        else:
            self.written.append(t)
            return None
        self.refused += 1
        if len(self.why) < 3:
            self.why.append(why)
        return why

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Its group changes every INTERVAL seconds (from a thread) while the body runs."""
        stop = threading.Event()

        def write() -> None:
            while not stop.wait(INTERVAL):
                self.put()

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def figures(self) -> dict[str, Any]:
        """Its changes' delays since it was opened (the last one waited for, bounded)."""
        if self.written:
            last = self.written[-1]
            deadline = time.monotonic() + LAST_WAIT
            while time.monotonic() < deadline and not any(t >= last for t in self._received(clear=False)):
                time.sleep(0.05)
        got, missed = delays(self.written, self._received(clear=True))
        spread = dist(got)
        return {
            "canary_changes": len(self.written),
            "canary_nice": self.nice,
            "canary_missed": missed,
            "canary_refused": self.refused,
            "canary_refused_why": self.why,
            "canary_p50_s": spread["p50"],
            "canary_p99_s": spread["p99"],
            "canary_max_s": spread["max"],
        }

    def _received(self, clear: bool) -> list[int]:
        return [t for _, recv, _ in self.workers.dump(clear=clear)["streams"] for _, t in recv]

    def stop(self) -> None:
        self.workers.stop()
