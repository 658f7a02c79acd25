"""A linearizability checker for recorded histories: Wing & Gong's search with Lowe's memoization,
the way porcupine (the Go checker etcd's robustness tests use) does it.

A history is a list of `Operation`s, each with the time it was invoked, the time its answer came
and that answer. An operation whose answer never came (a timeout, a lost connection, a 503 that
says "may not have been made") returns at +infinity: it may have taken effect at any point after
its invocation, or never (linearized after everything else, where nothing observes it).

Besides real time, an operation may have to follow others (`Operation.after`).

The search keeps the history as a doubly linked list of call and return events sorted by time. It
walks the list: at a call, it tries to linearize that operation next (the model must accept its
input and output in the current state); at a return, the operation that returns there was not
linearized before it, so it backtracks. Every (set of linearized operations, model state) reached
is cached: reaching one again cannot lead anywhere new. Models may be nondeterministic (a step
gives a set of next states); the search runs on sets of states, which makes it deterministic.

Histories are split by the model (per key, for a key-value store) and each part is checked on its
own. The search is bounded by a step count and a deadline: past either, the verdict is UNKNOWN
(never a hang, never a false OK).
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

S = TypeVar("S", bound=Hashable)  # a model state: hashable, for the cache

INFINITY = math.inf


@dataclass(frozen=True)
class Operation:
    """One call as a client saw it. `ret` is INFINITY when its answer was lost (`unknown`).

    `after`: the `id`s of operations that must take effect before this one, an order known besides
    real time (a replica's view holds the writes it acknowledged, so its later reads follow them
    even when they overlap in time)."""

    client: Hashable
    input: Any
    output: Any
    call: float
    ret: float = INFINITY
    id: Hashable = None
    after: tuple[Hashable, ...] = ()

    @property
    def unknown(self) -> bool:
        return self.ret == INFINITY

    def __post_init__(self) -> None:
        if not self.ret >= self.call:
            raise ValueError(f"an operation returns before it is called: {self}")


@dataclass(frozen=True)
class Model(Generic[S]):
    """`step(state, input, output)`: the states the operation may leave behind if it takes effect
    in `state` with that answer; none: it cannot take effect there. `partition`: independent parts
    of a history (e.g. one per key), checked apart."""

    init: S
    step: Callable[[S, Any, Any], Iterable[S]]
    partition: Callable[[Sequence[Operation]], Iterable[Sequence[Operation]]] = lambda ops: [ops]
    describe_operation: Callable[[Operation], str] = repr
    describe_state: Callable[[S], str] = repr


def deterministic(step: Callable[[S, Any, Any], tuple[bool, S]]) -> Callable[[S, Any, Any], list[S]]:
    """A step of the form `(ok, next state)`, as a nondeterministic one."""

    def wrapped(state: S, input: Any, output: Any) -> list[S]:
        ok, after = step(state, input, output)
        return [after] if ok else []

    return wrapped


class Verdict(enum.Enum):
    OK = "linearizable"
    ILLEGAL = "NOT linearizable"
    UNKNOWN = "unknown (the search ran out of budget)"


@dataclass
class PartResult:
    """The verdict on one part. On ILLEGAL: the longest linearizable prefix found (`longest`, in its
    order), the model states after it and the operation whose return could not be passed."""

    verdict: Verdict
    operations: Sequence[Operation]
    longest: list[Operation] = field(default_factory=list)
    states: frozenset[Any] = frozenset()
    blocked: Operation | None = None
    steps: int = 0

    def explain(self, model: Model[Any], limit: int = 40) -> str:
        if self.verdict is not Verdict.ILLEGAL:
            return f"{self.verdict.value}: {len(self.operations)} operations, {self.steps} search steps"
        t0 = min(op.call for op in self.operations)

        def when(op: Operation) -> str:
            end = "?" if op.unknown else f"{op.ret - t0:.3f}"
            return f"[{op.call - t0:.3f}, {end}]"

        lines = [
            f"NOT linearizable: {len(self.operations)} operations; the longest linearizable prefix "
            f"has {len(self.longest)}:"
        ]
        shown = self.longest[-limit:]
        if len(shown) < len(self.longest):
            lines.append(f"  ... {len(self.longest) - len(shown)} earlier ones")
        lines += [f"  {when(op)} {model.describe_operation(op)}" for op in shown]
        lines.append("  leaving " + " or ".join(sorted(model.describe_state(s) for s in self.states)))
        if self.blocked is not None:
            lines.append(
                f"then {when(self.blocked)} {model.describe_operation(self.blocked)} returned, "
                "but neither it nor any operation invoked before that could take effect next:"
            )
            done = {id(op) for op in self.longest}
            pending = [op for op in self.operations if id(op) not in done and op.call <= self.blocked.ret]
            waiting = {o.id for o in pending if o.id is not None}
            for op in sorted(pending, key=lambda o: o.call)[:limit]:
                possible = any(True for s in self.states for _ in model.step(s, op.input, op.output))
                note = (
                    "  <- must follow one not placed yet"
                    if waiting & set(op.after)
                    else ""
                    if possible
                    else "  <- impossible in that state"
                )
                lines.append(f"  {when(op)} {model.describe_operation(op)}{note}")
        return "\n".join(lines)


@dataclass
class Result:
    verdict: Verdict
    parts: list[PartResult]
    model: Model[Any]

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK

    @property
    def illegal(self) -> list[PartResult]:
        return [p for p in self.parts if p.verdict is Verdict.ILLEGAL]

    def explain(self, limit: int = 40) -> str:
        if self.verdict is Verdict.OK:
            return f"linearizable: {sum(len(p.operations) for p in self.parts)} operations in {len(self.parts)} parts"
        bad = [p for p in self.parts if p.verdict is not Verdict.OK]
        return "\n\n".join(p.explain(self.model, limit) for p in bad)


class _Node:
    __slots__ = ("index", "is_call", "match", "next", "prev")

    def __init__(self, index: int, is_call: bool) -> None:
        self.index = index
        self.is_call = is_call
        self.match: _Node | None = None  # a call's return
        self.prev: _Node | None = None
        self.next: _Node | None = None


def _events(ops: Sequence[Operation]) -> _Node:
    """The head (a sentinel) of the list of call and return events by time; at equal times calls
    come first, so operations that touch are concurrent."""
    order = sorted(
        itertools.chain(((op.call, 0, i) for i, op in enumerate(ops)), ((op.ret, 1, i) for i, op in enumerate(ops)))
    )
    head = _Node(-1, False)
    calls: dict[int, _Node] = {}
    prev = head
    for _, kind, i in order:
        node = _Node(i, kind == 0)
        if kind == 0:
            calls[i] = node
        else:
            calls[i].match = node
        prev.next, node.prev = node, prev
        prev = node
    return head


def _lift(call: _Node) -> None:
    """Take an operation's call and return out of the list (it is linearized)."""
    assert call.prev is not None and call.next is not None and call.match is not None
    call.prev.next, call.next.prev = call.next, call.prev
    ret = call.match
    assert ret.prev is not None
    ret.prev.next = ret.next
    if ret.next is not None:
        ret.next.prev = ret.prev


def _unlift(call: _Node) -> None:
    ret = call.match
    assert ret is not None and ret.prev is not None and call.prev is not None and call.next is not None
    ret.prev.next = ret
    if ret.next is not None:
        ret.next.prev = ret
    call.prev.next = call
    call.next.prev = call


def check_part(
    model: Model[Any], ops: Sequence[Operation], max_steps: int = 2_000_000, deadline: float | None = None
) -> PartResult:
    """One part of a history; `deadline` is a `time.monotonic()` value."""
    ops = list(ops)
    head = _events(ops)
    index = {op.id: i for i, op in enumerate(ops) if op.id is not None}
    needs = [sum(1 << index[a] for a in set(op.after) if a in index) for op in ops]  # bitsets of `after`
    states: frozenset[Any] = frozenset([model.init])
    linearized = 0  # a bitset of operation indexes
    stack: list[tuple[_Node, frozenset[Any]]] = []
    cache: set[tuple[int, frozenset[Any]]] = set()
    interned: dict[frozenset[Any], frozenset[Any]] = {}  # one object per set of states: a smaller cache
    best: list[int] = []
    best_states = states
    blocked: int | None = None
    entry = head.next
    steps = 0
    while head.next is not None:
        steps += 1
        if steps > max_steps or (deadline is not None and steps % 1024 == 0 and time.monotonic() > deadline):
            return PartResult(Verdict.UNKNOWN, ops, steps=steps)
        assert entry is not None
        if entry.is_call:
            op = ops[entry.index]
            if needs[entry.index] & ~linearized:  # an operation it must follow is not placed yet
                entry = entry.next
                continue
            after = frozenset(itertools.chain.from_iterable(model.step(s, op.input, op.output) for s in states))
            if after:
                after = interned.setdefault(after, after)
                now = linearized | (1 << entry.index)
                if (now, after) not in cache:
                    cache.add((now, after))
                    stack.append((entry, states))
                    states, linearized = after, now
                    _lift(entry)
                    if len(stack) > len(best):
                        best, best_states, blocked = [n.index for n, _ in stack], states, None
                    entry = head.next
                    continue
            entry = entry.next
        else:
            if blocked is None and len(stack) == len(best):
                blocked = entry.index  # the first return the longest prefix could not get past
            if not stack:
                return PartResult(
                    Verdict.ILLEGAL,
                    ops,
                    [ops[i] for i in best],
                    best_states,
                    ops[blocked] if blocked is not None else None,
                    steps,
                )
            top, states = stack.pop()
            linearized &= ~(1 << top.index)
            _unlift(top)
            entry = top.next
    return PartResult(Verdict.OK, ops, steps=steps)


def check(
    model: Model[Any], history: Sequence[Operation], max_steps: int = 2_000_000, timeout: float | None = 60.0
) -> Result:
    """Every part of `history` (as `model.partition` splits it); ILLEGAL if any part is, else
    UNKNOWN if any part ran out of budget. Each part gets `max_steps` first, so that one hard part
    does not starve the others; unless one is ILLEGAL already, the parts that ran out then get ten
    times as many, within what is left of `timeout` (the cache grows with the steps: about 50 bytes
    each)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    parts = [check_part(model, part, max_steps, deadline) for part in model.partition(history) if part]
    if deadline is not None and all(p.verdict is not Verdict.ILLEGAL for p in parts):
        for i, part in enumerate(parts):
            if part.verdict is Verdict.UNKNOWN and time.monotonic() < deadline:
                parts[i] = check_part(model, part.operations, 10 * max_steps, deadline)
    verdicts = {p.verdict for p in parts}
    verdict = (
        Verdict.ILLEGAL
        if Verdict.ILLEGAL in verdicts
        else Verdict.UNKNOWN
        if Verdict.UNKNOWN in verdicts
        else Verdict.OK
    )
    return Result(verdict, parts, model)


def check_brute_force(model: Model[Any], history: Sequence[Operation]) -> bool:
    """Every order that respects real time, tried one by one: a reference for small histories only
    (the checker's tests compare against it)."""
    ok = True
    for part in model.partition(history):
        ops = list(part)
        full = (1 << len(ops)) - 1

        def search(done: int, states: frozenset[Any], ops: list[Operation] = ops, full: int = full) -> bool:
            if done == full:
                return True
            for i, op in enumerate(ops):
                if done & (1 << i):
                    continue
                # i may go next only if nothing still to go returned before i was called, or must
                # come before it
                if any(
                    not done & (1 << j) and (other.ret < op.call or (other.id is not None and other.id in op.after))
                    for j, other in enumerate(ops)
                ):
                    continue
                after = frozenset(itertools.chain.from_iterable(model.step(s, op.input, op.output) for s in states))
                if after and search(done | (1 << i), after):
                    return True
            return False

        ok = ok and search(0, frozenset([model.init]))
    return ok
