"""Rise/fall counting, the first result, combining with a source's health, and the cut-off guard."""

from __future__ import annotations

from eds_server.health.tracker import CutOff, Result, Tracker, combine
from eds_server.model import Health

OK, FAIL = Result(True, "HTTP 200", 0.001, 0.0), Result(False, "HTTP 500", 0.001, 0.0)


def run(tracker: Tracker, results: list[Result], rise: int = 2, fall: int = 3) -> list[bool | None]:
    out = []
    for r in results:
        tracker.record(r, rise, fall)
        out.append(tracker.healthy)
    return out


def test_a_first_pass_decides_at_once_failures_count_as_ever() -> None:
    assert run(Tracker(), [OK]) == [True]
    assert run(Tracker(), [FAIL, FAIL, FAIL]) == [None, None, False]  # the source's health until then
    assert run(Tracker(), [FAIL, OK]) == [None, True]


def test_fall_and_rise_need_that_many_in_a_row() -> None:
    t = Tracker()
    got = run(t, [OK, FAIL, FAIL, OK, FAIL, FAIL, FAIL, OK, FAIL, OK, OK])
    assert got == [True, True, True, True, True, True, False, False, False, False, True]


def test_record_says_when_it_changed() -> None:
    t = Tracker()
    assert t.record(OK, 1, 1) is True
    assert t.record(OK, 1, 1) is False
    assert t.record(FAIL, 1, 1) is True


def test_worse_wins_and_draining_stays() -> None:
    assert combine(Health.UNKNOWN, None) == Health.UNKNOWN  # no result yet: the source's
    assert combine(Health.UNKNOWN, True) == Health.HEALTHY
    assert combine(Health.HEALTHY, False) == Health.UNHEALTHY
    assert combine(Health.DEGRADED, True) == Health.DEGRADED
    assert combine(Health.DEGRADED, False) == Health.UNHEALTHY
    assert combine(Health.UNHEALTHY, True) == Health.UNHEALTHY
    assert combine(Health.TIMEOUT, False) == Health.TIMEOUT
    assert combine(Health.DRAINING, True) == Health.DRAINING
    assert combine(Health.DRAINING, False) == Health.DRAINING


def test_cut_off_needs_everyone_failing_and_at_least_two() -> None:
    c = CutOff()
    c.record("a", False)
    assert not c.cut_off  # one target failing says nothing of the checker
    c.record("b", True)
    assert not c.cut_off
    c.record("b", False)
    assert c.cut_off and c.counts == (2, 2)
    c.record("a", True)
    assert not c.cut_off
    c.forget("a")
    assert not c.cut_off  # one left
