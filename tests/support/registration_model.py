"""The registration API on one key, as a model for the linearizability checker.

What each answer promises (docs/registration-api.md, eds_server/registration_api.py):

- PUT answers 201 only if the key held nothing, 200 only if it held a registration (replaced,
  updated, or the same again: a renewal when it has a TTL); either way the key then holds the PUT's
  endpoint and TTL.
- DELETE answers 204 only if the key held a registration, 404 only if it held none; the key then
  holds nothing.
- GET answers 200 with the registration the key holds, or 404 if none. It is a linearizable read
  of etcd; `checkable` may still give each read an invocation `stale_read_bound` seconds earlier
  than it was made (a read from a view that may lag), and a read made after a write acknowledged by
  the same replica takes effect after that write.
- A 503, a timeout or a connection lost after the request was sent: the change may or may not have
  been made (the API says "may not have been made; retry"). Such a write returns at +infinity; a
  read without an answer says nothing and is left out. Any other answer is not in the model (the
  history test fails on it before checking).

TTLs are modelled: a registration with a TTL is a lease in etcd, granted or kept alive somewhere
between the call and the answer of the PUT that wrote or renewed it. So the key must still be
there until that PUT's call + TTL, and must be gone once `gone_by(answer, ttl)` has passed (the
answer + TTL + a bound, which the history test stretches over the faults that may delay a lease's
end). Expiry is a step the search may take before any operation whose interval allows it; a write
whose answer was lost never has to expire (it may have been applied at any time later).
`paused`: windows (from an etcd member's SIGSTOP to a bound past its SIGCONT) in which etcd's leases
are not linearizable: a leader resumed from SIGSTOP still answers keep-alives from its own lease
table, and revokes what it believes expired, until it learns another leader took over. A renewal
made in such a window promises nothing, and a lease set before one closed may end at any time after
it opened, until it is set again.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from tests.support.linearizability import INFINITY, Model, Operation

Value = tuple[int, int | None]  # (port, ttl): what a client PUT and what a GET shows
# (port, ttl, granted, renewed, answered): the registration, the call of the write that may have
# granted its lease, the call and answer times of the write or renewal that last set it (answered:
# INFINITY when that answer was lost); None: nothing under the key
State = tuple[int, int | None, float, float, float] | None
ALWAYS = (-math.inf, math.inf)
EXPIRY_BOUND = 3.0  # seconds past answer + TTL by which etcd has ended a lease (its lessor looks every 0.5 s)


@dataclass(frozen=True)
class Put:
    key: str
    port: int
    ttl: int | None
    # when the operation may take effect (its call and answer); set by `checkable`
    window: tuple[float, float] = field(default=ALWAYS, compare=False, repr=False)


@dataclass(frozen=True)
class Delete:
    key: str
    window: tuple[float, float] = field(default=ALWAYS, compare=False, repr=False)


@dataclass(frozen=True)
class Get:
    key: str
    window: tuple[float, float] = field(default=ALWAYS, compare=False, repr=False)


Input = Put | Delete | Get
UNKNOWN = "unknown"  # the output of a write whose outcome is not known


@dataclass(frozen=True)
class Read:
    status: int
    value: Value | None = None


def default_gone_by(answered: float, ttl: int) -> float:
    return answered + ttl + EXPIRY_BOUND


def stepper(
    gone_by: Callable[[float, int], float],
    paused: Sequence[tuple[float, float]] = (),
) -> Callable[[State, Input, object], Iterable[State]]:
    """The model's step, with `gone_by(answered, ttl)`: the time by which a lease set by a write
    answered at `answered` must have ended, and `paused` (see the module's docstring)."""

    def before(state: State, window: tuple[float, float]) -> list[State]:
        """What the key may hold when an operation within `window` takes effect: expired or not."""
        if state is None or state[1] is None:
            return [state]
        _, ttl, granted, renewed, answered = state
        called, returned = window
        # the lease may have ended before the operation's answer: in time, or early (a paused leader)
        may = renewed + ttl <= returned or any(
            granted < end and renewed < end and start <= returned for start, end in paused
        )
        must = called > gone_by(answered, ttl)  # it ended before the operation was made
        return [None] if must else [state, None] if may else [state]

    def step(state: State, input: Input, output: object) -> Iterable[State]:
        for held in before(state, input.window):
            for new in after(held, input, output):
                if (
                    new is not None
                    and held is not None
                    and new[:2] == held[:2]
                    and new[1] is not None
                    and any(input.window[0] < end and start < input.window[1] for start, end in paused)
                ):
                    new = (*new[:3], held[3], new[4])  # a renewal in a paused window: not trusted to renew
                yield new

    return step


def after(state: State, input: Input, output: object) -> Iterable[State]:
    if isinstance(input, Put):
        called, returned = input.window
        # the same registration again may be a renewal of the lease it is on: granted when that was
        granted = state[2] if state is not None and state[:2] == (input.port, input.ttl) else called
        new = (input.port, input.ttl, granted, called, math.inf if output == UNKNOWN else returned)
        if output == UNKNOWN:
            return [new]  # "did not happen" is the same operation linearized after everything
        if output == 201:
            return [new] if state is None else []
        if output == 200:
            return [new] if state is not None else []
        return []
    if isinstance(input, Delete):
        if output == UNKNOWN:
            return [None]
        if output == 204:
            return [None] if state is not None else []
        if output == 404:
            return [None] if state is None else []
        return []
    assert isinstance(output, Read)
    if output.status == 200:
        return [state] if state is not None and state[:2] == output.value else []
    if output.status == 404:
        return [state] if state is None else []
    return []


def by_key(history: Sequence[Operation]) -> list[list[Operation]]:
    parts: dict[str, list[Operation]] = {}
    for op in history:
        parts.setdefault(op.input.key, []).append(op)
    return [parts[k] for k in sorted(parts)]


def describe_state(state: State | Value) -> str:
    if state is None:
        return "<nothing>"
    if len(state) == 5 and state[1] is not None:
        return f"<port {state[0]} ttl {state[1]}, lease set in [{state[3]:.3f}, {state[4]:.3f}]>"
    return f"<port {state[0]} ttl {state[1]}>"


def describe_operation(op: Operation) -> str:
    i = op.input
    if isinstance(i, Put):
        what = f"PUT {i.key} port={i.port} ttl={i.ttl}"
    elif isinstance(i, Delete):
        what = f"DELETE {i.key}"
    else:
        what = f"GET {i.key}"
    out = op.output
    answer = (
        f"{out.status} {describe_state(out.value) if out.value else ''}".strip() if isinstance(out, Read) else str(out)
    )
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


def checkable(records: Sequence[Record], stale_read_bound: float) -> list[Operation]:
    """The records as the checker takes them (see the module's docstring), each input with the
    window in which it may take effect."""
    ops: list[Operation] = []
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
            # a view may lag etcd, but never behind a write this replica acknowledged before the read:
            # the read takes effect after those writes (the latest, and any that overlap it: the ones
            # before are before it in real time)
            mine = [w for w in acked[(r.replica, r.input.key)] if w[1] < r.call]
            latest = max(mine, default=None)
            after = tuple(j for _, ret, j in mine if ret >= latest[0]) if latest is not None else ()
            call = max(r.call - stale_read_bound, latest[0] if latest is not None else -math.inf)
            ops.append(
                Operation(client, replace(r.input, window=(call, r.ret)), r.output, call, r.ret, id=i, after=after)
            )
        else:
            ret = INFINITY if r.output == UNKNOWN else r.ret
            ops.append(Operation(client, replace(r.input, window=(r.call, ret)), r.output, r.call, ret, id=i))
    return ops


def registration_model(
    gone_by: Callable[[float, int], float] = default_gone_by, paused: Sequence[tuple[float, float]] = ()
) -> Model[State]:
    return Model(
        init=None,
        step=stepper(gone_by, paused),
        partition=by_key,
        describe_operation=describe_operation,
        describe_state=describe_state,
    )


REGISTRATION_MODEL: Model[State] = registration_model()
