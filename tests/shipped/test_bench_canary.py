"""The bench's canary (bench/canary.py) is only a figure if each of its writes is matched to the
response that carried it: the matching alone, and the canary run against a real eds-server (its
registration API, its stream from an address of its own, the bench's load generator)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.paths import ROOT, bench_module


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, ModuleType]]:
    """bench/canary.py and bench/sidebyside.py, with bench/ importable as their scripts see it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    before = set(sys.modules)
    yield {"canary": bench_module("canary"), "sidebyside": bench_module("sidebyside")}
    for name in set(sys.modules) - before:  # bench/'s scripts, imported by their plain names
        if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == ROOT / "bench":
            del sys.modules[name]


def test_each_write_is_matched_to_the_first_response_at_or_after_it(bench: dict[str, ModuleType]) -> None:
    delays = bench["canary"].delays
    # 100 -> 150; 200 and 300 coalesced into the response at 310; 400 -> 400 (the same tick); 900: none
    got, missed = delays([100, 200, 300, 400, 900], [400, 310, 150, 50, 320])  # in any order
    assert got == pytest.approx([50e-9, 110e-9, 10e-9, 0.0])
    assert missed == 1
    assert delays([], [1, 2]) == ([], 0)
    assert delays([5], []) == ([], 1)


def test_the_canary_gets_its_changes_from_a_real_server(bench: dict[str, ModuleType], tmp_path: Path) -> None:
    canary, sidebyside = bench["canary"], bench["sidebyside"]
    path = tmp_path / "upstreams.yaml"
    sidebyside.write_atomically(path, sidebyside.upstreams_text([1, 1, 1]))
    with open(tmp_path / "server.log", "a") as log:
        server = sidebyside.Served(sidebyside.EDS_SERVER, path, log, extra=canary.ARGS, pin=False, env=canary.ENV)
        try:
            bird = canary.Canary(server.port, server.admin, 2000, log)
            try:
                with bird.changing():
                    deadline = time.monotonic() + 30  # bounded: ten writes at INTERVAL take about 0.5 s
                    while len(bird.written) < 10 and time.monotonic() < deadline:
                        time.sleep(0.05)
                figures = bird.figures()
            finally:
                bird.stop()
        finally:
            server.stop()
    assert figures["canary_changes"] >= 10, figures
    assert (figures["canary_missed"], figures["canary_refused"]) == (0, 0), figures
    assert figures["canary_p50_s"] <= figures["canary_p99_s"] <= figures["canary_max_s"]
    assert "127.0.0.2" in (tmp_path / "server.log").read_text()  # its stream came from its own address


def test_a_server_without_the_registration_api_is_named_at_the_first_answer(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """A 404 is an answer: the canary says what the server needs at once (its first write only), with
    the server's own hint, rather than asking again until its start-up bound."""
    canary, sidebyside = bench["canary"], bench["sidebyside"]
    path = tmp_path / "upstreams.yaml"
    sidebyside.write_atomically(path, sidebyside.upstreams_text([1]))
    with open(tmp_path / "server.log", "a") as log:
        server = sidebyside.Served(sidebyside.EDS_SERVER, path, log, pin=False)  # no registration API
        try:
            with pytest.raises(RuntimeError) as refused:
                canary.Canary(server.port, server.admin, 2000, log)
        finally:
            server.stop()
    said = str(refused.value)
    assert "HTTP 404" in said and "the registration API is off" in said, said
    assert "writes tried: 1)" in said, said
    assert "--registration-allow-cidr 127.0.0.0/8" in said and "EDS_ADMIN_TOKEN=" in said, said
