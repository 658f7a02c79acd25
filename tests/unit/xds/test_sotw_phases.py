"""The SotW stream's phases: every transition in xds/sotw.py's TRANSITIONS is taken by the step
it names, and nothing else moves a phase (the property tests check that on every path, with
tests/support/sotw_checked.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from eds_server.xds.common import EDS_TYPE_URL
from eds_server.xds.sotw import TRANSITIONS, Phase, PhaseError, Request, Response, SotwStream, Step
from tests.support.sotw_checked import CheckedSotwStream
from tests.support.xds_view import View


def first(*names: str, version: str = "") -> Request:
    return Request(version_info=version, has_node=True, resource_names=names, type_url=EDS_TYPE_URL)


def latest(s: SotwStream, *names: str, error: str | None = None) -> Request:
    nonce = s.in_flight.nonce if s.in_flight is not None else ""
    return Request(resource_names=names, response_nonce=nonce, error_message=error)


def sent(s: SotwStream) -> Response:
    r = s.poll()
    assert r is not None
    return r


def view() -> View:
    v = View()
    v.set("web", b"web-1")
    return v


def new() -> SotwStream:
    return CheckedSotwStream(view())


def owes_empty() -> SotwStream:
    s = new()
    s.receive(first("*"))
    return s


def resuming() -> SotwStream:
    s = new()
    s.receive(first("web", version="web-0"))  # reconnecting with a version older than web-1
    return s


def idle() -> SotwStream:
    s = new()
    s.receive(first("web"))
    return s


def in_flight() -> SotwStream:
    s = idle()
    sent(s)
    return s


def in_flight_dropped() -> SotwStream:
    s = in_flight()
    s.receive(Request(resource_names=(), response_nonce="old"))  # written before the client read it
    return s


START: dict[Phase, Callable[[], SotwStream]] = {
    Phase.NEW: new,
    Phase.OWES_EMPTY: owes_empty,
    Phase.RESUMING: resuming,
    Phase.IDLE: idle,
    Phase.IN_FLIGHT: in_flight,
    Phase.IN_FLIGHT_DROPPED: in_flight_dropped,
}


def _resumed(s: SotwStream) -> None:
    assert isinstance(s.view, View)
    s.view.set("web", b"web-0")  # what the reconnecting client holds is current again
    s.changed(None)
    assert s.poll() is None  # nothing sent


STEPS: dict[Step, Callable[[SotwStream], object]] = {
    Step.FIRST: lambda s: s.receive(first("web")),
    Step.FIRST_RESUMING: lambda s: s.receive(first("web", version="web-1")),
    Step.FIRST_EMPTY: lambda s: s.receive(first()),
    Step.STALE: lambda s: s.receive(Request(resource_names=("web",), response_nonce="old")),
    Step.STALE_DROPPING: lambda s: s.receive(Request(resource_names=(), response_nonce="old")),
    Step.ANSWER: lambda s: s.receive(latest(s, "web")),
    Step.REQUEST: lambda s: s.receive(latest(s, *s.subscribed)),
    Step.RESUBSCRIBE: lambda s: s.receive(latest(s, *s.subscribed, "api")),
    Step.SEND: lambda s: (s.changed(None), sent(s)),
    Step.RESUMED: _resumed,
}


@pytest.mark.parametrize(("before", "step"), [k for k in TRANSITIONS if k[1] is not Step.NOTHING_DUE], ids=str)
def test_each_transition_is_taken_by_its_step(before: Phase, step: Step) -> None:
    s = START[before]()
    assert s.phase is before
    STEPS[step](s)
    assert s.phase is TRANSITIONS[before, step]


def test_a_resume_with_nothing_due_ends_idle() -> None:
    s = resuming()  # web-1 is due...
    s.sent["web"] = "web-1"  # ...unless this stream sent it already
    s.changed(None)
    assert s.poll() is None and s.phase is TRANSITIONS[Phase.RESUMING, Step.NOTHING_DUE]


def test_every_phase_is_reached_from_new_and_in_flight_is_left_only_by_its_answer() -> None:
    reached, todo = {Phase.NEW}, [Phase.NEW]
    while todo:
        here = todo.pop()
        for (before, _), after in TRANSITIONS.items():
            if before is here and after not in reached:
                reached.add(after)
                todo.append(after)
    assert reached == set(Phase)
    leaving = {(before, step) for (before, step), after in TRANSITIONS.items() if before is not after}
    assert {step for before, step in leaving if before in (Phase.IN_FLIGHT, Phase.IN_FLIGHT_DROPPED)} == {
        Step.ANSWER,
        Step.STALE_DROPPING,
    }
    assert not any(before is Phase.NEW for before, step in TRANSITIONS if not step.name.startswith("FIRST"))


def test_a_change_or_an_old_nonce_with_nothing_in_flight_moves_no_phase() -> None:
    for make in (owes_empty, resuming, idle):
        s = make()
        before = s.phase
        s.changed(None)
        s.receive(Request(resource_names=(), response_nonce="old"))
        assert s.phase is before


def test_a_first_request_without_node_leaves_the_stream_new() -> None:
    s = new()
    with pytest.raises(Exception, match="node"):
        s.receive(Request(resource_names=("web",)))
    assert s.phase is Phase.NEW and not s.wants_poll


def test_the_table_is_the_code_path_a_step_it_does_not_list_raises() -> None:
    """The stream moves only through TRANSITIONS: a phase the code put out of step with what it
    holds (here a response in flight while the phase says idle) raises at the next move, rather
    than moving on from a state the rules never allowed."""

    def out_of_step() -> SotwStream:
        s = SotwStream(view())  # unchecked: the check would catch the bug before the table does
        s.receive(first("web"))
        sent(s)
        s.phase = Phase.IDLE  # the bug: the response is still in flight
        return s

    s = out_of_step()
    with pytest.raises(PhaseError, match="ANSWER is no step from IDLE"):
        s.receive(latest(s, "web"))
    with pytest.raises(PhaseError, match="STALE is no step from IDLE"):
        out_of_step().receive(Request(resource_names=("web",), response_nonce="old"))
