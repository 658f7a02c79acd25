"""The fused path of a SotW stream that follows one name (`SotwStream.changed_due`, `_poll_one`,
`ack_one` through `session.sotw_ack`) against the general machine: random sequences of changes,
polls, ACKs, NACKs, stale requests, subscribe and unsubscribe, a full window (a due response left
to the task's later poll), readiness, withholding and close, driven through both, must give the
same responses, events, errors and state after every step."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, note
from hypothesis import strategies as st

from eds_server.protowire import length_delimited, string_field
from eds_server.xds import wire
from eds_server.xds.common import EDS_TYPE_URL, Nonces, ProtocolError, StreamState, SubscriptionLimits
from eds_server.xds.session import SOTW, sotw_ack
from eds_server.xds.sotw import Phase, Response, SotwStream
from tests.support.strategies import examples
from tests.support.xds_view import View

NAMES = ("a", "b", "c")


class HeldView(View):
    """A view that, when withholding (a relay's store), holds nothing for "c"."""

    def resources(self) -> dict[str, bytes]:
        return {n: b for n, b in self.bodies.items() if n != "c"}


class GeneralSotwStream(SotwStream):
    """The same machine with every fused step taken the general way."""

    def changed_due(self, names: frozenset[str] | None) -> bool:
        return StreamState.changed_due(self, names)

    def poll(self) -> Response | None:
        return self._poll_any()


def request_bytes(
    version: str, names: tuple[str, ...], nonce: str, *, node: bool = False, error: str | None = None
) -> bytes:
    """A DiscoveryRequest as Envoy writes it (fields in number order)."""
    out = string_field(1, version)
    if node:
        out += length_delimited(2, string_field(1, "envoy-1"))
    out += b"".join(string_field(3, n) for n in names) + string_field(4, EDS_TYPE_URL) + string_field(5, nonce)
    if error is not None:
        out += length_delimited(6, string_field(2, error))
    return out


def summary(s: SotwStream) -> dict[str, Any]:
    flight = s.in_flight
    return {
        "phase": s.phase,
        "subscribed": list(s.subscribed),
        "sent": s.sent,
        "acked": s.acked,
        "nacked": s.nacked,
        "dirty": s._dirty,
        "suspects": s._suspects,
        "dropped": s._dropped,
        "unwanted": s._unwanted,
        "last_nonce": s._last_nonce,
        "resume": s._resume_version,
        "in_flight": shown(flight),
        "wants_poll": s.wants_poll,
    }


def shown(r: Response | None) -> Any:
    return None if r is None else (r.version_info, tuple((x.name, x.version) for x in r.resources), r.nonce)


NAME_LISTS = st.lists(st.sampled_from(NAMES), max_size=3).map(lambda xs: tuple(dict.fromkeys(xs)))
ONE_NAME = st.sampled_from(NAMES).map(lambda n: (n,))
LISTS = st.one_of(ONE_NAME, ONE_NAME, ONE_NAME, NAME_LISTS, st.just(("*",)))
# (name, window full, back to its first content: a version sent and rejected before comes back)
CHANGE = st.tuples(st.just("change"), st.sampled_from(NAMES), st.booleans(), st.sampled_from([False, False, True]))
ACK = st.tuples(st.just("ack"), st.sampled_from([False, False, False, True]))  # (with the Node)
OPS = st.one_of(  # the fan-out's own steps (a change, its poll, its ACK) weighted up
    CHANGE,
    CHANGE,
    CHANGE,
    ACK,
    ACK,
    ACK,
    st.tuples(st.just("change all"), st.booleans()),
    st.tuples(st.just("poll")),
    st.tuples(st.just("poll")),
    st.tuples(st.just("ack other version")),
    st.tuples(st.just("nack")),
    st.tuples(st.just("stale"), LISTS, st.sampled_from(["", "0", "1"])),
    st.tuples(st.just("request"), LISTS),  # the latest nonce: subscribe and unsubscribe
    st.tuples(st.just("ready"), st.sampled_from([True, True, False])),
    st.tuples(st.just("withholds"), st.sampled_from([False, False, True])),
)


class Pair:
    """One client's requests to both machines; each step's outputs compared."""

    def __init__(self, first: tuple[str, ...], version: str) -> None:
        self.view = HeldView()
        for name in NAMES:
            self.view.set(name, f"{name}-0".encode())
        limits = SubscriptionLimits()
        self.fused = SotwStream(self.view, limits, Nonces())
        self.general = GeneralSotwStream(self.view, limits, Nonces())
        self.closed = False
        self.bumps = 0
        self.both_request(request_bytes(version, first, "", node=True), first=True)

    def compare(self) -> None:
        assert summary(self.fused) == summary(self.general)

    def both_request(self, data: bytes, first: bool = False) -> None:
        """The session's receive: the fused one tries the plain ACK first."""
        outcomes = []
        for s, fused in ((self.fused, True), (self.general, False)):
            try:
                acked = sotw_ack(s, data) if fused and not first else None
                if acked is not None:
                    outcomes.append(("ack", acked))
                else:
                    request, _ = SOTW.decode(data, s.limits.max_names)
                    events = s.receive(request)
                    acks = [e.names for e in events if type(e).__name__ == "Ack"]
                    others = [e for e in events if type(e).__name__ != "Ack"]
                    outcomes.append(("ack", acks[0]) if acks and not others else ("events", events))
            except ProtocolError as e:
                outcomes.append(("error", (e.status, e.message)))
        note(f"  -> {outcomes[0]}")
        assert outcomes[0] == outcomes[1]

    def both_poll(self) -> None:
        a, b = shown(self.fused.poll()), shown(self.general.poll())
        note(f"  poll -> {a}")
        assert a == b

    def step(self, op: tuple[Any, ...]) -> None:
        note(repr(op))
        kind = op[0]
        if kind == "close":
            self.closed = True  # the call ends: changes still reach the machine, nothing is polled
        elif kind in ("change", "change all"):
            if kind == "change":
                self.bumps += 1
                self.view.set(op[1], f"{op[1]}-{0 if op[3] else self.bumps}".encode())
                names: frozenset[str] | None = frozenset((op[1],))
            else:
                names = None
            due = self.fused.changed_due(names)
            assert due == self.general.changed_due(names)
            full = op[2 if kind == "change" else 1]  # a full window: the task polls later ("poll")
            if due and not full and not self.closed:
                self.both_poll()
        elif kind == "poll":
            if not self.closed:
                self.both_poll()
        elif kind == "ready":
            self.view.ready = op[1]
        elif kind == "withholds":
            self.view.withholds = op[1]
        elif not self.closed:
            self.request(op)
        self.compare()

    def request(self, op: tuple[Any, ...]) -> None:
        flight = self.general.in_flight
        nonce = flight.nonce if flight is not None else self.general._last_nonce
        names = tuple(self.general.subscribed) or ("*",)
        if op[0] == "ack":
            version = flight.version_info if flight is not None else "v"
            if flight is not None and len(flight.resources) == 1 and not op[1] and names == (flight.resources[0].name,):
                data = wire.plain_ack(version, names[0], nonce)  # what the fused path recognises
                assert data == request_bytes(version, names, nonce)
            else:
                data = request_bytes(version, names, nonce, node=op[1])
        elif op[0] == "ack other version":
            data = request_bytes("other", names, nonce)
        elif op[0] == "nack":
            data = request_bytes("v", names, nonce, error="rejected")
        elif op[0] == "stale":
            data = request_bytes("v", op[1], op[2] if op[2] != nonce else "")
        else:
            data = request_bytes("v", op[1], nonce)
        self.both_request(data)


# a rejected bundle narrowed to one name: that name goes out alone (a suspect), and its plain ACK
# clears the suspicion on the fused path too
@example(
    first=("a", "b"),
    resume="",
    ops=[("poll",), ("nack",), ("request", ("a",)), ("poll",), ("ack", False), ("change", "a", False, False)],
    close=None,
)
@examples(1000, suppress_health_check=[HealthCheck.too_slow])
@given(
    first=LISTS,
    resume=st.sampled_from(["", "a-0", "b-0", "junk"]),
    ops=st.lists(OPS, min_size=10, max_size=60),
    close=st.none() | st.none() | st.integers(20, 60),
)
def test_the_fused_path_gives_what_the_general_machine_gives(
    first: tuple[str, ...], resume: str, ops: list[tuple[Any, ...]], close: int | None
) -> None:
    pair = Pair(first, resume)
    pair.compare()
    for i, op in enumerate(ops):
        pair.step(("close",) if i == close else op)


def test_the_fused_path_is_taken() -> None:
    """The usual stream takes it: a change answered by `_poll_one`, the ACK recognised by its bytes."""
    view = View()
    view.set("a", b"a-0")
    s = SotwStream(view)
    s.receive(SOTW.decode(request_bytes("", ("a",), "", node=True), 10)[0])
    r = s.poll()
    assert r is not None and s.phase is Phase.IN_FLIGHT
    assert sotw_ack(s, wire.plain_ack(r.version_info, "a", r.nonce)) == ("a",)
    assert s.phase is Phase.IDLE and s.acked == {"a": "a-0"}
    view.set("a", b"a-1")
    assert s.changed_due(frozenset(("a",)))
    r = s._poll_one()
    assert r is not None and r.version_info == "a-1" and s.phase is Phase.IN_FLIGHT
    # anything but the plain ACK of the response in flight is left to the general read
    assert sotw_ack(s, wire.plain_ack(r.version_info, "a", "999")) is None
    assert sotw_ack(s, request_bytes(r.version_info, ("a",), r.nonce, node=True)) is None
    assert s.phase is Phase.IN_FLIGHT
