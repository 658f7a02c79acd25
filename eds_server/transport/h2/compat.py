"""Which HTTP/2 path runs: the fast path (fast_*.py, direct.py, http.py: other libraries' internals)
only on the exact versions of those libraries its tests ran against; otherwise the stock path
(stock.py: grpclib's and aiohttp's public API), with one warning saying what that costs.

The versions are checked when a server is built, from the installed distributions' metadata, so
an `eds-server` installed beside a newer grpclib, h2, hpack, hyperframe or aiohttp keeps working instead
of running code no test saw. CI runs the gRPC and Envoy tests on both paths (EDS_HTTP2=stock).
"""

from __future__ import annotations

import logging
from importlib import metadata

log = logging.getLogger("eds_server.grpc")

# distribution -> versions whose internals the fast path was tested against (constraints.txt)
VERIFIED: dict[str, tuple[str, ...]] = {
    "grpclib": ("0.4.9",),
    "h2": ("4.4.1",),
    "hyperframe": ("6.1.0",),
    "hpack": ("4.2.0",),
    "aiohttp": ("3.14.5",),
}
MODES = ("auto", "fast", "stock")


def unverified(verified: dict[str, tuple[str, ...]] = VERIFIED) -> list[str]:
    """`name version` of each installed library the fast path was not tested with."""
    out = []
    for name, versions in verified.items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            version = "(not installed)"
        if version not in versions:
            out.append(f"{name} {version}")
    return out


class UnverifiedVersions(RuntimeError):
    """The fast path was asked for, on library versions it was not tested with."""


def fast_path(mode: str, verified: dict[str, tuple[str, ...]] = VERIFIED) -> bool:
    """Whether to run the fast path for `mode` (auto, fast or stock)."""
    if mode not in MODES:
        raise ValueError(f"HTTP/2 mode {mode!r}: expected one of {', '.join(MODES)}")
    if mode == "stock":
        return False
    others = unverified(verified)
    if not others:
        return True
    tested = ", ".join(f"{n} {'/'.join(v)}" for n, v in verified.items())
    if mode == "fast":
        raise UnverifiedVersions(
            f"--http2 fast: installed {', '.join(others)}, but the fast path was tested with {tested} only; "
            "install those versions (pip install -c constraints.txt) or use --http2 auto"
        )
    log.warning(
        "HTTP/2: stock grpclib path (installed %s; the fast path was tested with %s only): "
        "slower fan-out and fewer per-client limits, see docs/limits.md",
        ", ".join(others),
        tested,
    )
    return False
