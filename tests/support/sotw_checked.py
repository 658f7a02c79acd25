"""A SotwStream that checks, on every call, that its phase moves only as xds/sotw.py's TRANSITIONS
allow and agrees with what it holds in flight: the property tests drive it through every path."""

from __future__ import annotations

from collections.abc import Iterable

from eds_server.xds.common import Event
from eds_server.xds.sotw import TRANSITIONS, Phase, Request, Response, SotwStream

ALLOWED = {(before, after) for (before, _), after in TRANSITIONS.items()}
IN_FLIGHT = {Phase.IN_FLIGHT, Phase.IN_FLIGHT_DROPPED}


def check_move(before: Phase, s: SotwStream) -> None:
    after = s.phase
    assert after == before or (before, after) in ALLOWED, f"{before} -> {after} is not in TRANSITIONS"
    assert (after in IN_FLIGHT) == (s.in_flight is not None), f"{after} with in_flight={s.in_flight}"


class CheckedSotwStream(SotwStream):
    def receive(self, req: Request) -> list[Event]:
        before = self.phase
        try:
            return super().receive(req)
        finally:
            check_move(before, self)

    def poll(self) -> Response | None:
        before = self.phase
        try:
            return super().poll()
        finally:
            check_move(before, self)

    def changed(self, names: Iterable[str] | None) -> None:
        before = self.phase
        super().changed(names)
        assert self.phase == before, "a change moved the phase"
