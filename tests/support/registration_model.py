"""The registration API on one key, as a model for the linearizability checker.

What each answer promises (docs/registration-api.md, eds_server/registration_api.py):

- PUT answers 201 only if the key held nothing, 200 only if it held a registration (replaced,
  updated, or the same again: a renewal when it has a TTL); either way the key then holds the PUT's
  endpoint and TTL.
- DELETE answers 204 only if the key held a registration, 404 only if it held none; the key then
  holds nothing.
- GET answers 200 with the registration the key holds, or 404 if none. A replica answers reads from
  its view, which follows etcd's watch, so a read may see the key as it was a little earlier: the
  history gives each read an invocation `stale_read_bound` seconds earlier than it was made (a read
  may take effect anywhere from then to its answer), and a read made after a write acknowledged by
  the same replica takes effect after that write (that replica's view holds it once it answers).
- Another 4xx changes nothing. A 503, another 5xx, a timeout or a connection lost after the request
  was sent: the change may or may not have been made (the API says "may not have been made; retry").
  Such a write returns at +infinity; a read without an answer says nothing and is left out.

TTLs in the runs are long (an hour) so nothing expires during one: expiry is not modelled.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from tests.support.linearizability import INFINITY, Model, Operation

Value = tuple[int, int | None]  # (port, ttl): what a client PUT and what a GET shows
State = Value | None  # None: no registration under the key


@dataclass(frozen=True)
class Put:
    key: str
    port: int
    ttl: int | None


@dataclass(frozen=True)
class Delete:
    key: str


@dataclass(frozen=True)
class Get:
    key: str


Input = Put | Delete | Get
UNKNOWN = "unknown"  # the output of a write whose outcome is not known


@dataclass(frozen=True)
class Read:
    status: int
    value: Value | None = None


def step(state: State, input: Input, output: object) -> Iterable[State]:
    if isinstance(input, Put):
        new = (input.port, input.ttl)
        if output == UNKNOWN:
            return [new]  # "did not happen" is the same operation linearized after everything
        if output == 201:
            return [new] if state is None else []
        if output == 200:
            return [new] if state is not None else []
        return [state] if isinstance(output, int) and 400 <= output < 500 else []
    if isinstance(input, Delete):
        if output == UNKNOWN:
            return [None]
        if output == 204:
            return [None] if state is not None else []
        if output == 404:
            return [None] if state is None else []
        return [state] if isinstance(output, int) and 400 <= output < 500 else []
    assert isinstance(output, Read)
    if output.status == 200:
        return [state] if state == output.value else []
    if output.status == 404:
        return [state] if state is None else []
    return []


def by_key(history: Sequence[Operation]) -> list[list[Operation]]:
    parts: dict[str, list[Operation]] = {}
    for op in history:
        parts.setdefault(op.input.key, []).append(op)
    return [parts[k] for k in sorted(parts)]


def describe_state(state: State) -> str:
    return "<nothing>" if state is None else f"<port {state[0]} ttl {state[1]}>"


def describe_operation(op: Operation) -> str:
    i = op.input
    if isinstance(i, Put):
        what = f"PUT {i.key} port={i.port} ttl={i.ttl}"
    elif isinstance(i, Delete):
        what = f"DELETE {i.key}"
    else:
        what = f"GET {i.key}"
    out = op.output
    answer = f"{out.status} {describe_state(out.value) if out.value else ''}".strip() if isinstance(out, Read) \
        else str(out)  # fmt: skip
    return f"{op.client}: {what} -> {answer}"


@dataclass
class Record:
    """One call as a client made it: through which replica, what, the answer (a status, a Read,
    UNKNOWN; None: failed for sure, never sent or a read without an answer) and when."""

    client: str
    replica: str
    input: Input
    output: object
    call: float
    ret: float


def checkable(records: Sequence[Record], stale_read_bound: float,
              unchecked: Callable[[Record], bool] = lambda r: False) -> tuple[list[Operation], int]:  # fmt: skip
    """The records as the checker takes them (see the module's docstring), and how many reads were
    left out because `unchecked` said so."""
    ops: list[Operation] = []
    skipped = 0
    # (replica, key) -> (invoked, answered, index) of each write that replica acknowledged
    acked: dict[tuple[str, str], list[tuple[float, float, int]]] = collections.defaultdict(list)
    for i, r in enumerate(records):
        if r.output in (200, 201, 204):  # a 2xx write answers once this replica's view holds it
            acked[(r.replica, r.input.key)].append((r.call, r.ret, i))
    for i, r in enumerate(records):
        client = f"{r.client}@{r.replica}"
        if r.output is None:
            continue
        if isinstance(r.input, Get):
            if unchecked(r):
                skipped += 1
                continue
            # a view may lag etcd, but never behind a write this replica acknowledged before the read:
            # the read takes effect after those writes (the latest, and any that overlap it: the ones
            # before are before it in real time)
            mine = [w for w in acked[(r.replica, r.input.key)] if w[1] < r.call]
            latest = max(mine, default=None)
            after = tuple(j for _, ret, j in mine if ret >= latest[0]) if latest is not None else ()
            call = max(r.call - stale_read_bound, latest[0] if latest is not None else -math.inf)
            ops.append(Operation(client, r.input, r.output, call, r.ret, id=i, after=after))
        else:
            ret = INFINITY if r.output == UNKNOWN else r.ret
            ops.append(Operation(client, r.input, r.output, r.call, ret, id=i))
    return ops, skipped


REGISTRATION_MODEL: Model[State] = Model(
    init=None, step=step, partition=by_key, describe_operation=describe_operation, describe_state=describe_state
)
