"""A network a test makes for itself: a fresh network namespace joined to this one by a veth pair,
10.213.N.1/30 here and 10.213.N.2/30 inside. For what must be reached at an address that is not
loopback (kube-apiserver refuses loopback addresses in EndpointSlices): traffic to 10.213.N.2 stays
on this pair, inside the machine, and nothing is routed anywhere else. Needs root and `ip`: without
them `private_link()` skips, saying which. The namespace and both ends of the pair are deleted on
exit, whatever happened inside.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Link:
    namespace: str  # `ip netns exec <namespace> ...` runs inside
    outside: str  # this namespace's address on the pair
    inside: str  # the namespace's address on the pair


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


def _free_subnet() -> int:
    """N such that 10.213.N.0/30 is on no interface and in no route here."""
    taken = _ip("-o", "addr").stdout + _ip("route").stdout
    start = os.getpid() % 250
    for i in range(250):  # bounded: the third octets there are
        n = (start + i) % 250
        if f"10.213.{n}." not in taken:
            return n
    raise RuntimeError("no free 10.213.N.0/30 here")


@contextlib.contextmanager
def private_link() -> Iterator[Link]:
    if os.geteuid() != 0:
        pytest.skip("a private network needs root (ip netns add, a veth pair)")
    if shutil.which("ip") is None:
        pytest.skip("a private network needs `ip` (iproute2)")
    tag = f"{os.getpid() % 100_000}"
    ns, out_if, in_if = f"eds-test-{tag}", f"edst{tag}o", f"edst{tag}i"  # interface names: 15 bytes at most
    n = _free_subnet()
    outside, inside = f"10.213.{n}.1", f"10.213.{n}.2"
    made = _ip("netns", "add", ns)
    if made.returncode != 0:
        pytest.skip(f"ip netns add refused here: {made.stderr.strip()}")
    try:
        steps = [
            ("link", "add", out_if, "type", "veth", "peer", "name", in_if),
            ("link", "set", in_if, "netns", ns),
            ("addr", "add", f"{outside}/30", "dev", out_if),
            ("link", "set", out_if, "up"),
            ("-n", ns, "addr", "add", f"{inside}/30", "dev", in_if),
            ("-n", ns, "link", "set", in_if, "up"),
            ("-n", ns, "link", "set", "lo", "up"),
        ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr.strip()}"
        yield Link(ns, outside, inside)
    finally:
        _ip("netns", "del", ns)  # takes its end of the pair, and so the pair, with it
        if _ip("link", "show", out_if).returncode == 0:
            _ip("link", "del", out_if)
