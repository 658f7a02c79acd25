"""The pieces sources share (sources/base.py): debounce, backoff, warn-once, liveness and status."""

from __future__ import annotations

import logging

import pytest

from eds_server.encode import encode_group
from eds_server.sources.base import Backoff, Debounce, Liveness, SourceStatus, WarnOnce
from eds_server.store import Store


def test_debounce_publishes_once_a_delay_after_the_first_change() -> None:
    d = Debounce(0.05)
    assert d.timeout(0.0, 10.0) == 10.0 and not d.due(0.0)  # nothing pending: wait for events only
    d.changed(1.00)
    d.changed(1.03)  # a burst: the first change starts the wait
    assert d.timeout(1.03, 10.0) == pytest.approx(0.02)
    assert not d.due(1.04)
    assert d.due(1.05) and not d.due(1.06)  # once
    assert d.timeout(2.0, 10.0) == 10.0


def test_backoff_grows_jittered_to_its_cap_and_resets() -> None:
    b = Backoff(0.2, 1.0)
    delays = [b.next() for _ in range(6)]
    assert 0.1 <= delays[0] <= 0.2 and all(0.5 <= d <= 1.0 for d in delays[3:])
    b.reset()
    assert b.next() <= 0.2


def test_warn_once_per_object_until_its_warning_changes(caplog: pytest.LogCaptureFixture) -> None:
    w = WarnOnce(logging.getLogger("test.warn"))
    with caplog.at_level(logging.WARNING, "test.warn"):
        w.update({"c1": "bad label", "c2": None})
        w.update({"c1": "bad label"})
        w.update({"c1": "worse label"})
        w.forget("c1")
        w.update({"c1": "worse label"})
    assert [r.getMessage() for r in caplog.records] == ["bad label", "worse label", "worse label"]


def test_liveness_marks_the_store_stale_and_logs_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    store = Store(encode_group)
    store.add_source("etcd")
    live = Liveness(store, "etcd", "etcd somewhere")
    with caplog.at_level(logging.INFO, "eds_server.sources"):
        live.lost("refused")
        live.lost("refused again")  # not logged again
        assert live.status() == SourceStatus("etcd", False, False, "refused again")
        assert not live.status().stale  # nothing loaded: waiting, not stale
        store.update("etcd", {})
        live.live("3 registrations")
        assert live.status().as_json() == {"name": "etcd", "loaded": True, "live": True, "stale": False,
                                           "last_error": None}  # fmt: skip
        live.lost("gone")
        stale = live.status(registrations=3).as_json()
        assert stale == {"name": "etcd", "loaded": True, "live": False, "stale": True, "registrations": 3,
                         "last_error": "gone"}  # fmt: skip
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "not loaded yet" in messages[0] and "stale" in messages[2]
