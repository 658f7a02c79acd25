"""The HTTP/2 seam's version check: the fast path (other libraries' internals) runs only on the
versions its tests ran with, which are the ones constraints.txt installs; anything else runs the
stock path with one warning, or refuses to start when the fast path is demanded."""

from __future__ import annotations

import logging

import pytest

from eds_server.transport.h2 import compat
from tests.support.paths import ROOT


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().split()
    pairs = (line.split("==") for line in lines if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in pairs}


def test_verified_versions_are_the_pinned_ones() -> None:
    """Bumping a pin without re-verifying the fast path (and saying so in compat.py) fails here."""
    pinned = pins()
    for name, versions in compat.VERIFIED.items():
        assert pinned[name] in versions, f"{name} {pinned[name]} is pinned but not verified in compat.py"


def test_this_environment_runs_the_fast_path() -> None:
    assert compat.unverified() == []
    assert compat.fast_path("auto") and compat.fast_path("fast")
    assert not compat.fast_path("stock")


def test_other_versions_fall_back_to_the_stock_path_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    other = {**compat.VERIFIED, "h2": ("0.0.1",)}
    with caplog.at_level(logging.WARNING):
        assert compat.fast_path("auto", other) is False
    assert [r.message for r in caplog.records if "stock grpclib path" in r.message]
    assert "h2 4.4.1" in caplog.text and "docs/limits.md" in caplog.text


def test_the_fast_path_demanded_on_other_versions_refuses_to_start() -> None:
    with pytest.raises(compat.UnverifiedVersions, match=r"h2 4\.4\.1.*tested with.*h2 0\.0\.1"):
        compat.fast_path("fast", {**compat.VERIFIED, "h2": ("0.0.1",)})
    with pytest.raises(ValueError, match="expected one of auto, fast, stock"):
        compat.fast_path("quick")
