"""The registration API checked from recorded histories, the way etcd's robustness tests and Jepsen
check databases: clients write and read a few keys through three replicas on a 3-member etcd
cluster while a nemesis breaks things, every operation is recorded with its invocation and answer
times, and the history of each key must be linearizable (tests/support/linearizability.py, with the
model of what each answer promises in tests/support/registration_model.py).

The clients: PUT, PUT with a TTL, a renewal (the TTL PUT of what a client last saw the key hold),
DELETE and GET (the registration API's read, from the replica's view), on random keys through
random replicas. The nemesis, one fault at a time, at random: SIGSTOP of an etcd member (the leader
too) then SIGCONT, an etcd member killed and restarted, replica C (which reaches etcd only through a
TCP proxy the test controls) cut off by resets or by a black hole, a replica paused (SIGSTOP) or
killed and restarted. After the faults heal, every replica's view, and the Envoy behind replica A,
must equal etcd within CONVERGE_SECONDS (the Envoy within ENVOY_SECONDS).

A GET of one registration is a linearizable read of its key in etcd (a replica cut off answers
503), so reads are held to linearizability like writes, through every fault (STALE_READ_SECONDS
is 0; the checker and the model also take views that may lag, as the lists answer from them).

Short run (in `make test`): EDS_HISTORY_SEEDS (default "1,2"), EDS_HISTORY_SECONDS of load each
(default 25), a frozen etcd member, and two runs of one replica without faults. Long run: `make
test-history` (seeds 1-20, 60 s each). `pytest -s` shows one summary line per run;
a failure prints the longest linearizable prefix of each key that is not, and where the whole
history was saved (EDS_HISTORY_DIR: a directory to keep failed runs' histories and logs in).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.envoy_harness import EdsCluster, EnvoyProcess, envoy_bootstrap
from tests.support.etcd_cluster import EtcdCluster, Member, etcd_binary
from tests.support.linearizability import INFINITY, Operation, check
from tests.support.registration_model import (
    REGISTRATION_MODEL,
    UNKNOWN,
    Delete,
    Get,
    Input,
    Put,
    Read,
    Record,
    Value,
    checkable,
)
from tests.support.server_process import EdsServerProcess
from tests.support.tcp_proxy import TcpProxy
from tests.support.waiting import wait_for


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        out += list(range(int(first), int(last or first) + 1))
    return out


SEEDS = _seeds(os.environ.get("EDS_HISTORY_SEEDS", "1,2"))
SECONDS = float(os.environ.get("EDS_HISTORY_SECONDS", "25"))
ONE_REPLICA_SECONDS = 10.0
FROZEN_SECONDS = 22.0
FAULT_KINDS = ("stop-leader", "stop-member", "kill-member", "reset-c", "black-hole-c", "pause-replica", "kill-replica")
EVERY_KIND = {"put": 2, "put-ttl": 2, "renew": 3, "delete": 2, "get": 4}  # the weights of each kind
CLIENTS = 6
GROUP = "web"
KEYS = ("k0", "k1", "k2", "k3")
PORTS_PER_KEY = 6  # values to choose from: enough that a stale read rarely shows what was written again since
TTL = 3600  # an hour: nothing expires during a run, so the model need not know about expiry
CLIENT_TIMEOUT = 10.0  # a write answers within about 4 s (503 past that); an answer later is lost
STALE_READ_SECONDS = 0.0  # a GET reads etcd: no lag allowed
CONVERGE_SECONDS = 15.0
ENVOY_SECONDS = 35.0  # Envoy's own reconnect backoff (up to 30 s) after its replica was away
TOKEN = "history-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

pytestmark = pytest.mark.envoy


def port_of(key: str, choice: int) -> int:
    """Each key has its own ports: two keys never hold the same address:port (that would be a 409
    across keys, which a per-key model cannot see)."""
    assert 0 <= choice < PORTS_PER_KEY <= 10
    return 20000 + 10 * KEYS.index(key) + choice


def value_of(registration: dict[str, Any]) -> Value:
    """(port, ttl) of a registration as the API shows it."""
    ttl = registration.get("ttl")
    return registration["port"], None if ttl is None else int(ttl)


@dataclass
class Fault:
    kind: str
    target: str
    replica: str | None  # the replica whose reads are not checked meanwhile
    start: float
    end: float = INFINITY


@dataclass
class Rig:
    seed: int
    cluster: EtcdCluster
    replicas: dict[str, EdsServerProcess]
    proxy: TcpProxy
    envoy: EnvoyProcess
    http: aiohttp.ClientSession
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    known: dict[str, Value] = field(default_factory=dict)  # what a client last saw each key hold
    kinds: dict[str, int] = field(default_factory=lambda: dict(EVERY_KIND))
    fault_kinds: tuple[str, ...] = FAULT_KINDS

    def url(self, replica: str, key: str) -> str:
        return f"http://127.0.0.1:{self.replicas[replica].admin_port}/v1/groups/{GROUP}/endpoints/{key}"

    async def call(self, replica: str, op: Input) -> Any:
        url = self.url(replica, op.key)
        try:
            if isinstance(op, Get):
                async with self.http.get(url) as r:
                    if r.status == 200:
                        return Read(200, value_of(await r.json()))
                    return Read(404) if r.status == 404 else None
            if isinstance(op, Put):
                body = {"address": "127.0.0.1", "port": op.port, **({"ttl": op.ttl} if op.ttl else {})}
                async with self.http.put(url, json=body, headers=AUTH) as r:
                    await r.read()
                    return UNKNOWN if r.status >= 500 else r.status
            async with self.http.delete(url, headers=AUTH) as r:
                await r.read()
                return UNKNOWN if r.status >= 500 else r.status
        except (aiohttp.ClientError, OSError, TimeoutError):
            # Not "never sent" even when the last error is a refused connection: aiohttp sends a PUT or
            # DELETE (idempotent methods) a second time when the first connection drops, so a write a
            # replica applied just before it was killed ends in "connection refused" on the retry.
            return None if isinstance(op, Get) else UNKNOWN

    async def client(self, n: int, until: float) -> None:
        rng = random.Random(f"{self.seed}/client/{n}")
        for _ in range(100_000):  # bounded, and by the time
            if time.monotonic() >= until:
                return
            key = rng.choice(KEYS)
            replica = rng.choice(sorted(self.replicas))
            kind = rng.choices(list(self.kinds), list(self.kinds.values()))[0]
            op: Input
            if kind == "put":
                op = Put(key, port_of(key, rng.randrange(PORTS_PER_KEY)), None)
            elif kind == "put-ttl":
                op = Put(key, port_of(key, rng.randrange(PORTS_PER_KEY)), TTL)
            elif kind == "renew":
                port, _ = self.known.get(key, (port_of(key, 0), TTL))
                op = Put(key, port, TTL)
            elif kind == "delete":
                op = Delete(key)
            else:
                op = Get(key)
            call = time.monotonic()
            output = await self.call(replica, op)
            ret = time.monotonic()
            self.records.append(Record(f"c{n}", replica, op, output, call, ret))
            if isinstance(output, Read) and output.value is not None:
                self.known[key] = output.value
            elif isinstance(op, Put) and output in (200, 201):
                self.known[key] = (op.port, op.ttl)
            await asyncio.sleep(rng.uniform(0, 0.05))

    async def nemesis(self, until: float) -> None:
        rng = random.Random(f"{self.seed}/nemesis")
        kinds = [k for k in self.fault_kinds if "C" in self.replicas or not k.endswith("-c")]
        order: list[str] = []
        for _ in range(10_000):  # bounded, and by the time
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            if time.monotonic() >= until - 2:
                return
            if not order:  # every kind once, in a random order, then again: a short run sees them all
                order = rng.sample(kinds, len(kinds))
            kind = order.pop()
            # some members frozen for longer than reads may lag (STALE_READ_SECONDS) plus the time a
            # write waits for the view: its watchers must notice, and move
            long = kind.startswith("stop") and rng.random() < 0.3
            hold = rng.uniform(10.0, 14.0) if long else rng.uniform(1.0, 4.0) if kind.startswith("stop") \
                else rng.uniform(0.5, 3.0)  # fmt: skip
            await self.fault(kind, hold, rng)

    async def fault(self, kind: str, hold: float, rng: random.Random, member: Member | None = None) -> None:
        if kind in ("stop-leader", "stop-member", "kill-member"):
            if member is None:
                member = await self.cluster.leader() if kind == "stop-leader" or rng.random() < 0.5 else \
                    rng.choice(self.cluster.members)  # fmt: skip
            fault = Fault(kind, member.name, None, time.monotonic())
            self.faults.append(fault)
            assert member.proc is not None
            if kind == "kill-member":
                await self.cluster.kill(member)
                await asyncio.sleep(hold)
                await self.cluster.start_member(member)
            else:
                member.proc.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(hold)
                finally:  # a member left stopped would ignore the SIGTERM at the end
                    member.proc.send_signal(signal.SIGCONT)
            await self.member_up(member)  # before the next fault: never two members away at once
        elif kind in ("reset-c", "black-hole-c"):
            self.faults.append(fault := Fault(kind, "C", "C", time.monotonic()))
            self.proxy.reset() if kind == "reset-c" else self.proxy.black_hole()
            try:
                await asyncio.sleep(hold)
            finally:
                self.proxy.heal()
        else:
            name = rng.choice(sorted(self.replicas))
            server = self.replicas[name]
            assert server.proc is not None
            self.faults.append(fault := Fault(kind, name, name, time.monotonic()))
            if kind == "pause-replica":
                server.proc.send_signal(signal.SIGSTOP)
                try:
                    await asyncio.sleep(hold)
                finally:
                    server.proc.send_signal(signal.SIGCONT)
            else:
                server.proc.kill()
                await server.proc.wait()
                await asyncio.sleep(hold)
                await server.start(wait_ready=False)
                await server.wait_ready(timeout=30)
        fault.end = time.monotonic()

    async def member_up(self, member: Member) -> None:
        async def answers() -> bool:
            await self.cluster.call(member, "/v3/kv/range", {"key": "aGVhbHRo"}, timeout=1.0)  # linearizable
            return True

        await wait_for(answers, timeout=30, interval=0.1, what=f"etcd member {member.name} answering",
                       retry=(aiohttp.ClientError, OSError, TimeoutError, RuntimeError))  # fmt: skip

    def save(self, ops: list[Operation], failed: bool) -> Path:
        """The history as the checker saw it, one operation a line, and the faults, for a post-mortem:
        beside the logs, or (a failed run, with EDS_HISTORY_DIR set) with copies of the replicas'
        logs in a folder of that directory, which outlives pytest's temporary ones."""
        logs = self.replicas[min(self.replicas)].log_path.parent
        where = os.environ.get("EDS_HISTORY_DIR")
        if failed and where:
            folder = Path(where) / f"{logs.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            folder.mkdir(parents=True, exist_ok=True)
            for server in self.replicas.values():
                shutil.copy(server.log_path, folder)
            logs = folder
        path = logs / f"history-{self.seed}.jsonl"
        with path.open("w") as f:
            for fault in self.faults:
                f.write(json.dumps({"fault": fault.kind, "target": fault.target, "start": fault.start,
                                    "end": fault.end}) + "\n")  # fmt: skip
            for op in ops:
                f.write(json.dumps({"client": op.client, "input": repr(op.input), "output": repr(op.output),
                                    "call": op.call, "return": None if op.unknown else op.ret}) + "\n")  # fmt: skip
        return path

    async def etcd_view(self) -> dict[str, Value]:
        out = {}
        for key, value in (await self.cluster.keys(f"/eds/registrations/{GROUP}/")).items():
            entry = json.loads(value)
            out[key.rsplit("/", 1)[1]] = value_of({**entry["endpoint"], "ttl": entry.get("ttl")})
        return out

    async def replica_view(self, name: str) -> dict[str, Value]:
        url = f"http://127.0.0.1:{self.replicas[name].admin_port}/v1/groups/{GROUP}/endpoints"
        async with self.http.get(url) as r:
            body = await r.json()
        return {reg["id"]: value_of(reg) for reg in body["registrations"]}


def history(rig: Rig, final: dict[str, Value], at: float) -> list[Operation]:
    """The records as the checker takes them, then etcd's own linearizable read of each key."""
    ops, _ = checkable(rig.records, STALE_READ_SECONDS)
    for key in KEYS:
        value = final.get(key)
        ops.append(Operation("etcd", Get(key), Read(200, value) if value else Read(404), at, at))
    return ops


@contextlib.asynccontextmanager
async def rig(tmp_path: Path, seed: int, names: str = "ABC") -> AsyncIterator[Rig]:
    """Replicas A and B reach etcd directly, C through the proxy; the Envoy is behind the first."""
    etcd_binary()  # skip (or fail under CI) first
    cluster = EtcdCluster(tmp_path / "etcd")
    common = ("--admin-token", TOKEN, "--registration-allow-cidr", "127.0.0.0/8")
    try:
        await cluster.start()
        async with contextlib.AsyncExitStack() as stack:
            proxy = await stack.enter_async_context(TcpProxy([m.client_port for m in cluster.members]))
            proxied = f"etcd://{','.join(f'127.0.0.1:{p}' for p in proxy.ports)}/eds"
            replicas = {name: EdsServerProcess(None, "--state", proxied if name == "C" else cluster.state(), *common,
                                               workdir=tmp_path) for name in names}  # fmt: skip
            for server in replicas.values():
                await stack.enter_async_context(server)
            envoy = await stack.enter_async_context(
                EnvoyProcess(envoy_bootstrap(replicas[names[0]].port, [EdsCluster(GROUP)]))
            )
            http = await stack.enter_async_context(aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT), connector=aiohttp.TCPConnector(force_close=True)
            ))  # fmt: skip
            await envoy.wait_live()
            yield Rig(seed, cluster, replicas, proxy, envoy, http)
    finally:
        for m in cluster.members:  # a member left stopped would ignore SIGTERM
            if m.proc is not None and m.proc.returncode is None:
                m.proc.send_signal(signal.SIGCONT)
        await cluster.stop()


async def run(r: Rig, seconds: float, nemesis: bool) -> None:
    """Load (and faults) for `seconds`; then, healed, every replica's view and the Envoy must equal
    etcd, and the history of every key must be linearizable. Prints one summary line."""
    until = time.monotonic() + seconds
    await asyncio.gather(*(r.client(n, until) for n in range(CLIENTS)), *([r.nemesis(until)] if nemesis else []))

    # healed (each fault heals itself): every replica's view and the Envoy equal etcd
    await r.cluster.wait_healthy()
    healed = time.monotonic()
    final = await r.etcd_view()
    diverged: list[str] = []
    for name in sorted(r.replicas):
        try:
            await wait_for(lambda n=name: r.replica_view(n), lambda v: v == final, timeout=CONVERGE_SECONDS,
                           interval=0.1, what=f"replica {name}'s view equal to etcd's {final}")  # fmt: skip
        except AssertionError as e:
            diverged.append(str(e))
    converged = time.monotonic() - healed
    ports = {port for port, _ in final.values()}
    try:
        await r.envoy.wait_for(lambda: r.envoy.hosts(GROUP), lambda hosts: {h.port for h in hosts} == ports,
                               timeout=ENVOY_SECONDS, interval=0.1)  # fmt: skip
    except AssertionError as e:
        diverged.append(f"the Envoy: {e}")
    diverged += [f"etcd changed while nothing wrote: {now}" for now in [await r.etcd_view()] if now != final]

    ops = history(r, final, time.monotonic())
    # a first look at every key (an anomaly is usually found within it), then the time left for any
    # key that needs a longer search to be proved linearizable
    result = check(REGISTRATION_MODEL, ops, max_steps=300_000, timeout=120)
    outputs = collections.Counter(
        "failed" if rec.output is None else "unknown" if rec.output == UNKNOWN else "ok" for rec in r.records
    )
    faults = collections.Counter(f.kind for f in r.faults)
    print(f"\nhistory seed={r.seed} replicas={''.join(sorted(r.replicas))}: {len(r.records)} operations "
          f"({outputs['ok']} ok, {outputs['failed']} failed, {outputs['unknown']} unknown), {len(r.faults)} faults "
          f"({', '.join(f'{k} {v}' for k, v in sorted(faults.items())) or 'none'}), "
          f"views {'equal to etcd' if not diverged else 'NOT equal to etcd'} {converged:.2f} s after healing, "
          f"keys not linearizable: {len(result.illegal)} of {len(result.parts)} ({result.verdict.value})")  # fmt: skip
    failed = not result.ok or bool(diverged)
    saved = r.save(ops, failed)
    if failed:  # etcd's own record of every change (with each key's lease before it), beside the history
        with (saved.parent / f"etcd-events-{r.seed}.jsonl").open("w") as out:
            out.writelines(json.dumps(e) + "\n" for e in await r.cluster.events())
    assert result.ok, f"{result.explain()}\n(the whole history: {saved})"
    assert not diverged, "\n".join(diverged)


@pytest.mark.parametrize("seed", SEEDS)
async def test_registration_history_is_linearizable_under_faults(tmp_path: Path, seed: int) -> None:
    async with rig(tmp_path, seed) as r:
        await run(r, SECONDS, nemesis=True)


async def test_one_replica_without_faults_writing_without_ttl_gives_a_linearizable_history(tmp_path: Path) -> None:
    """The control: the same clients, recording, checks and bounds, on what holds today (PUTs without
    a TTL and GETs through one replica, no fault). A checker or harness that cries wolf fails here."""
    async with rig(tmp_path, 0, names="A") as r:
        r.kinds = {"put": 1, "get": 1}
        await run(r, ONE_REPLICA_SECONDS, nemesis=False)


async def test_the_etcd_member_the_watches_are_on_frozen_gives_a_linearizable_history(tmp_path: Path) -> None:
    """Every replica tries the members in the order given, so their watches start on the first: frozen
    (SIGSTOP) for 14 s, quorum remains. Before the fixes: writes answered 200 after waiting 3 s for
    the view, and reads through both replicas showed the value before them until SIGCONT."""
    async with rig(tmp_path, 0, names="AB") as r:
        r.kinds = {"put": 1, "get": 3}

        async def freeze() -> None:
            await asyncio.sleep(3)
            await r.fault("stop-member", 14.0, random.Random(0), member=r.cluster.members[0])

        await asyncio.gather(freeze(), run(r, FROZEN_SECONDS, nemesis=False))


async def test_one_replica_without_faults_gives_a_linearizable_history(tmp_path: Path) -> None:
    """Every kind of operation through one replica, no fault. Before the fixes: a PUT concurrent with
    a DELETE (which does not wait for the group's turn) recreates the key but answers 200, as a
    replacement: the group's compare, on the mod revisions of the keys there are, does not see a key
    that was deleted."""
    async with rig(tmp_path, 0, names="A") as r:
        await run(r, ONE_REPLICA_SECONDS, nemesis=False)
