"""The linearizability checker of tests/support (the history-checking fault test relies on it): known
linearizable and non-linearizable histories of a register and of the registration API, answers that
were lost, the budget, and agreement with a brute-force search on small random histories."""

from __future__ import annotations

import bisect
import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.linearizability import (
    INFINITY,
    Model,
    Operation,
    Verdict,
    check,
    check_brute_force,
    deterministic,
)
from tests.support.registration_model import (
    EXPIRY_BOUND,
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
    registration_model,
)
from tests.support.strategies import examples


def register_step(state: int, input: tuple[str, int], output: int | None) -> tuple[bool, int]:
    kind, value = input
    if kind == "write":
        return True, value
    return output == state, state


REGISTER: Model[int] = Model(init=0, step=deterministic(register_step))


def w(client: int, value: int, call: float, ret: float = INFINITY) -> Operation:
    return Operation(client, ("write", value), None, call, ret)


def r(client: int, value: int, call: float, ret: float) -> Operation:
    return Operation(client, ("read", 0), value, call, ret)


def verdict(model: Model[int], history: list[Operation]) -> Verdict:
    result = check(model, history)
    assert (result.verdict is Verdict.OK) == check_brute_force(model, history), history
    return result.verdict


def test_classic_register_histories() -> None:
    # sequential: a read after a write sees it
    assert verdict(REGISTER, [w(0, 1, 0, 10), r(1, 1, 20, 30)]) is Verdict.OK
    # a stale read: the write had returned before the read was invoked
    assert verdict(REGISTER, [w(0, 1, 0, 10), r(1, 0, 20, 30)]) is Verdict.ILLEGAL
    # concurrent with a slow write, reads may see old then new...
    assert verdict(REGISTER, [w(0, 1, 0, 100), r(1, 0, 10, 20), r(2, 1, 30, 40)]) is Verdict.OK
    # ...but never new then old (Herlihy & Wing's new-old inversion)
    assert verdict(REGISTER, [w(0, 1, 0, 100), r(1, 1, 10, 20), r(2, 0, 30, 40)]) is Verdict.ILLEGAL
    # two concurrent writes: readers agree on one order
    writes = [w(0, 1, 0, 100), w(1, 2, 0, 100)]
    assert verdict(REGISTER, [*writes, r(2, 1, 10, 20), r(3, 2, 30, 40)]) is Verdict.OK
    assert verdict(REGISTER, [*writes, r(2, 1, 10, 20), r(3, 2, 30, 40), r(2, 1, 50, 60)]) is Verdict.ILLEGAL
    # operations that touch (one returns when the other is invoked) are concurrent
    assert verdict(REGISTER, [w(0, 1, 0, 10), r(1, 0, 10, 20)]) is Verdict.OK
    # a value never written
    assert verdict(REGISTER, [w(0, 1, 0, 10), r(1, 3, 5, 8)]) is Verdict.ILLEGAL


def test_a_lost_answer_may_or_may_not_have_taken_effect() -> None:
    lost = w(0, 1, 0)  # no answer: returns at +infinity
    assert lost.unknown
    assert verdict(REGISTER, [lost, r(1, 0, 100, 110)]) is Verdict.OK  # never took effect
    assert verdict(REGISTER, [lost, r(1, 1, 100, 110)]) is Verdict.OK  # took effect, late
    assert verdict(REGISTER, [lost, r(1, 0, 10, 20), r(1, 1, 30, 40)]) is Verdict.OK
    # once seen, it cannot be undone
    assert verdict(REGISTER, [lost, r(1, 1, 10, 20), r(1, 0, 30, 40)]) is Verdict.ILLEGAL
    # and it cannot take effect before it was invoked
    assert verdict(REGISTER, [r(1, 1, 0, 5), w(0, 1, 10)]) is Verdict.ILLEGAL


def test_an_order_known_besides_real_time_is_kept() -> None:
    # a read overlapping a write may take effect before it, unless it must follow it (a replica's
    # view holds the writes that replica acknowledged)
    write = Operation(0, ("write", 1), None, 0, 10, id="w")
    assert verdict(REGISTER, [write, Operation(1, ("read", 0), 0, 5, 15, id="r")]) is Verdict.OK
    late = Operation(1, ("read", 0), 0, 5, 15, id="r", after=("w",))
    assert verdict(REGISTER, [write, late]) is Verdict.ILLEGAL
    assert "must follow" not in check(REGISTER, [write, late]).explain()
    assert verdict(REGISTER, [write, Operation(1, ("read", 0), 1, 5, 15, id="r", after=("w",))]) is Verdict.OK
    # naming an operation that is not in the history (or in another part) constrains nothing
    assert verdict(REGISTER, [write, Operation(1, ("read", 0), 0, 5, 15, after=("gone",))]) is Verdict.OK


def test_a_failure_names_the_longest_prefix_and_the_operation_that_could_not_be_placed() -> None:
    history = [w(0, 1, 0, 10), w(0, 2, 20, 30), r(1, 1, 40, 50)]
    result = check(REGISTER, history)
    assert result.verdict is Verdict.ILLEGAL
    [part] = result.illegal
    assert part.longest == history[:2]
    assert part.states == frozenset([2])
    assert part.blocked == history[2]
    text = result.explain()
    assert "longest linearizable prefix has 2" in text
    assert "leaving 2" in text
    assert "impossible in that state" in text


def test_the_registration_model_on_what_the_api_answers() -> None:
    k, ttl = "web/a", 3600
    ok = [
        Operation("c0", Put(k, 9001, ttl), 201, 0, 10),
        Operation("c1", Put(k, 9001, ttl), 200, 20, 30),  # a renewal
        Operation("c0", Get(k), Read(200, (9001, ttl)), 40, 50),
        Operation("c1", Delete(k), 204, 60, 70),
        Operation("c0", Delete(k), 404, 80, 90),
        Operation("c1", Get(k), Read(404), 100, 110),
        Operation("c0", Put(k, 9002, None), UNKNOWN, 120),  # a 503
        Operation("c1", Get(k), Read(404), 130, 140),
    ]
    assert check(REGISTRATION_MODEL, ok).verdict is Verdict.OK
    # an acknowledged DELETE, then a renewal through another replica answered 200: the key was gone
    lost = [
        Operation("c0", Put(k, 9001, ttl), 201, 0, 10),
        Operation("c0", Delete(k), 204, 20, 30),
        Operation("c1", Put(k, 9001, ttl), 200, 31, 40),
    ]
    result = check(REGISTRATION_MODEL, lost)
    assert result.verdict is Verdict.ILLEGAL
    assert "c1: PUT web/a port=9001 ttl=3600 -> 200  <- impossible in that state" in result.explain()
    # a renewal through B answered 200 after A changed the port, and the port A wrote stays
    kept = [
        Operation("c0", Put(k, 9001, ttl), 201, 0, 10),
        Operation("c0", Put(k, 9002, ttl), 200, 20, 30),
        Operation("c1", Put(k, 9001, ttl), 200, 31, 40),
        Operation("check", Get(k), Read(200, (9002, ttl)), 50, 60),
    ]
    assert check(REGISTRATION_MODEL, kept).verdict is Verdict.ILLEGAL
    # keys are independent: each is checked alone
    two = [
        Operation("c0", Put("web/a", 1, None), 201, 0, 10),
        Operation("c1", Put("web/b", 2, None), 201, 0, 10),
        Operation("c0", Get("web/b"), Read(200, (2, None)), 20, 30),
    ]
    result = check(REGISTRATION_MODEL, two)
    assert result.verdict is Verdict.OK and len(result.parts) == 2


def test_the_search_gives_up_with_unknown_rather_than_hanging() -> None:
    # many concurrent writes and reads that no order satisfies: more orders than the budget allows
    history = [w(i, i, 0, 100) for i in range(1, 13)] + [r(0, 99, 0, 100)]
    result = check(REGISTER, history, max_steps=500, timeout=None)
    assert result.verdict is Verdict.UNKNOWN
    assert "unknown" in result.explain()
    assert check(REGISTER, history, timeout=0.001).verdict is Verdict.UNKNOWN  # out of time
    assert check(REGISTER, history, max_steps=10**7).verdict is Verdict.ILLEGAL


def test_a_long_history_is_checked_quickly() -> None:
    # 2,000 operations, 4 clients, overlapping: the memoized search stays near linear
    history = []
    for i in range(500):
        t = i * 10.0
        history += [w(0, i, t, t + 12), r(1, i, t + 11, t + 13), r(2, i, t + 11.5, t + 25), w(3, i, t + 1, t + 2)]
    result = check(REGISTER, history)
    assert result.verdict is Verdict.OK, result.explain()
    assert result.parts[0].steps < 100 * len(history)


@st.composite
def small_register_histories(draw: st.DrawFn) -> list[Operation]:
    ops = []
    for i in range(draw(st.integers(1, 6))):
        call = draw(st.integers(0, 20))
        lost = draw(st.booleans()) and draw(st.booleans())
        ret = INFINITY if lost else call + draw(st.integers(0, 10))
        # sometimes an order known besides real time: after an earlier operation
        after = (draw(st.integers(0, i - 1)),) if i and draw(st.integers(0, 3)) == 0 else ()
        if draw(st.booleans()):
            ops.append(Operation(i, ("write", draw(st.integers(0, 2))), None, call, ret, id=i, after=after))
        elif not lost:  # a read without an answer says nothing
            ops.append(Operation(i, ("read", 0), draw(st.integers(0, 2)), call, ret, id=i, after=after))
    return ops


@given(small_register_histories())
@examples(400)
def test_agrees_with_a_brute_force_search_on_small_register_histories(history: list[Operation]) -> None:
    assert (check(REGISTER, history).verdict is Verdict.OK) == check_brute_force(REGISTER, history)


@st.composite
def small_registration_histories(draw: st.DrawFn) -> list[Operation]:
    ops = []
    for i in range(draw(st.integers(1, 7))):
        key = draw(st.sampled_from(["g/a", "g/b"]))
        call = draw(st.integers(0, 20))
        lost = draw(st.integers(0, 4)) == 0
        ret: float = INFINITY if lost else call + draw(st.integers(0, 10))
        kind = draw(st.sampled_from(["put", "delete", "get"]))
        if kind == "put":
            value = (draw(st.sampled_from([1, 2])), draw(st.sampled_from([None, 60])))
            out: object = UNKNOWN if lost else draw(st.sampled_from([200, 201, 409]))
            ops.append(Operation(i, Put(key, *value), out, call, ret))
        elif kind == "delete":
            ops.append(Operation(i, Delete(key), UNKNOWN if lost else draw(st.sampled_from([204, 404])), call, ret))
        elif not lost:
            seen = draw(st.sampled_from([None, (1, None), (2, 60)]))
            ops.append(Operation(i, Get(key), Read(404) if seen is None else Read(200, seen), call, ret))
    return ops


@given(small_registration_histories())
@examples(400)
def test_agrees_with_a_brute_force_search_on_small_registration_histories(history: list[Operation]) -> None:
    result = check(REGISTRATION_MODEL, history)
    assert result.verdict is not Verdict.UNKNOWN
    assert result.ok == check_brute_force(REGISTRATION_MODEL, history), result.explain()


def test_an_operation_cannot_return_before_it_is_called() -> None:
    try:
        Operation(0, ("read", 0), 0, 10, 5)
    except ValueError as e:
        assert "returns before it is called" in str(e)
    else:
        raise AssertionError("accepted")
    assert math.isinf(w(0, 1, 0).ret)


def test_the_registration_model_judges_expiry_from_the_lease_a_write_or_renewal_set() -> None:
    """A TTL of 4 s: a key must be there until its last acknowledged renewal's call + 4 s and gone
    by that renewal's answer + 4 s + the bound; in between either is linearizable."""
    k, ttl = "web/a", 4
    written = [
        Record("c0", "A", Put(k, 9001, ttl), 201, 0.0, 0.5),
        Record("c1", "B", Put(k, 9001, ttl), 200, 3.0, 3.5),  # a renewal: the lease now ends in [7, 7.5]
    ]

    def verdict(*later: Record) -> Verdict:
        return check(REGISTRATION_MODEL, checkable([*written, *later], stale_read_bound=0)).verdict

    assert verdict(Record("c2", "C", Get(k), Read(200, (9001, ttl)), 6.0, 6.5)) is Verdict.OK
    assert verdict(Record("c2", "C", Get(k), Read(404), 6.0, 6.5)) is Verdict.ILLEGAL  # the renewal not kept
    assert verdict(Record("c2", "C", Put(k, 9002, ttl), 201, 5.0, 5.5)) is Verdict.ILLEGAL
    assert verdict(Record("c2", "C", Get(k), Read(404), 7.2, 7.4)) is Verdict.OK  # expired, in time
    assert verdict(Record("c2", "C", Get(k), Read(200, (9001, ttl)), 9.0, 9.5)) is Verdict.OK  # within the bound
    late = 3.5 + ttl + EXPIRY_BOUND + 0.1
    assert verdict(Record("c2", "C", Get(k), Read(200, (9001, ttl)), late, late + 0.1)) is Verdict.ILLEGAL
    # a renewal whose answer was lost may have kept it alive at any time since
    lost = Record("c3", "A", Put(k, 9001, ttl), UNKNOWN, 4.0, 4.1)
    assert verdict(lost, Record("c2", "C", Get(k), Read(200, (9001, ttl)), late, late + 0.1)) is Verdict.OK
    # a renewal while an etcd leader was paused (from 2.9 to 3.2, and a bound) promises nothing, and
    # a lease set before may end at any time after that began, until it is set again
    paused = registration_model(paused=[(2.9, 3.2)])
    early = checkable([*written, Record("c2", "C", Get(k), Read(404), 6.0, 6.5)], stale_read_bound=0)
    assert check(paused, early).verdict is Verdict.OK
    again = Record("c1", "B", Put(k, 9001, ttl), 200, 4.0, 4.1)  # renewed after the window: kept again
    early = checkable([*written, again, Record("c2", "C", Get(k), Read(404), 6.0, 6.5)], stale_read_bound=0)
    assert check(paused, early).verdict is Verdict.ILLEGAL
    # no TTL: never expires
    forever = [
        Record("c0", "A", Put(k, 9001, None), 201, 0.0, 0.5),
        Record("c1", "B", Get(k), Read(200, (9001, None)), 100.0, 100.5),
    ]
    assert check(REGISTRATION_MODEL, checkable(forever, stale_read_bound=0)).verdict is Verdict.OK


def test_the_registration_model_rejects_answers_it_does_not_know() -> None:
    """Not "no change": a 409, 422 or 500 on a write is not an answer the clients should ever get."""
    k = "web/a"
    for status in (400, 409, 422, 500):
        ops = [Operation("c0", Put(k, 9001, None), 201, 0, 1), Operation("c1", Put(k, 9002, None), status, 2, 3)]
        assert check(REGISTRATION_MODEL, ops).verdict is Verdict.ILLEGAL


def simulate(seed: int, operations: int, lag: float, frozen: tuple[float, float] | None = None) -> list[Record]:
    """What the fault test records from a correct store: six clients, three replicas, two keys; each
    write takes effect at one point of its call, in one order; a replica's view is up to `lag`
    seconds behind that order but holds the writes it acknowledged; one write in 20 has its answer
    lost (a 503), and took effect or not. `frozen`: from when to when replica C's view stood still
    (a watch on a hung etcd member), its own writes included."""
    rng = random.Random(seed)
    planned = []  # (point of effect, client, replica, input, call, return)
    clock = [0.0] * 6
    for i in range(operations):
        client = i % 6
        call = clock[client] + rng.uniform(0, 0.05)
        ret = call + rng.uniform(0.005, 0.05)
        clock[client] = ret
        key = rng.choice(["g/a", "g/b"])
        op: Input = rng.choice([Put(key, rng.choice([1, 2]), rng.choice([None, 60])), Delete(key), Get(key)])
        planned.append((rng.uniform(call, ret), f"c{client}", rng.choice("ABC"), op, call, ret))
    changes: dict[str, list[tuple[float, Value | None]]] = {"g/a": [(-math.inf, None)], "g/b": [(-math.inf, None)]}
    acked: dict[tuple[str, str], list[tuple[float, float]]] = {}  # (replica, key) -> (point, return)
    records = []
    for point, client, replica, op, call, ret in sorted(planned, key=lambda p: p[0]):
        log = changes[op.key]
        if isinstance(op, Get):
            mine = [p for p, r in acked.get((replica, op.key), []) if r < call]
            seen_at = max(point - rng.uniform(0, lag), max(mine, default=-math.inf))
            if frozen is not None and replica == "C" and frozen[0] <= point <= frozen[1]:
                seen_at = frozen[0]
            held = log[bisect.bisect_right(log, seen_at, key=lambda c: c[0]) - 1][1]
            records.append(Record(client, replica, op, Read(404) if held is None else Read(200, held), call, ret))
            continue
        now = log[-1][1]
        lost = rng.random() < 0.05
        if isinstance(op, Put):
            status = 201 if now is None else 200
            after: Value | None = (op.port, op.ttl)
        else:
            status = 204 if now is not None else 404
            after = None
        if not lost or rng.random() < 0.5:
            log.append((point, after))
        if not lost:
            acked.setdefault((replica, op.key), []).append((point, ret))
        records.append(Record(client, replica, op, UNKNOWN if lost else status, call, ret))
    return sorted(records, key=lambda r: r.call)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_correct_store_with_lagging_views_passes_as_the_fault_test_records_it(seed: int) -> None:
    """The fault test's reading of a history (reads up to a bound behind, never behind what their
    replica acknowledged, lost answers at +infinity) accepts what a correct store does, in time,
    and rejects a view that stood still for longer than the bound."""
    records = simulate(seed, 1500, lag=0.5)
    for bound in (0.5, 6.0):  # 6 s: the fault test's, where each read may go before hundreds of writes
        ops = checkable(records, stale_read_bound=bound)
        result = check(REGISTRATION_MODEL, ops, timeout=60)
        assert result.verdict is Verdict.OK, result.explain()
    stale = simulate(seed, 1500, lag=0.5, frozen=(2.0, 4.0))
    assert check(REGISTRATION_MODEL, checkable(stale, stale_read_bound=0.5), timeout=60).verdict is Verdict.ILLEGAL


def test_a_part_that_runs_out_of_steps_gets_ten_times_as_many_in_the_time_left() -> None:
    hard = [w(i, i, 0, 100) for i in range(1, 11)] + [r(0, 99, 0, 100)]  # not linearizable, 33,000 steps
    split: Model[int] = Model(init=0, step=deterministic(register_step), partition=lambda ops: [ops[:3], ops])
    assert check(split, hard, max_steps=5000, timeout=None).verdict is Verdict.UNKNOWN
    assert check(split, hard, max_steps=1000, timeout=60).verdict is Verdict.UNKNOWN  # 10,000: not enough
    result = check(split, hard, max_steps=5000, timeout=60)
    assert result.verdict is Verdict.ILLEGAL
    assert [p.verdict for p in result.parts] == [Verdict.OK, Verdict.ILLEGAL]
