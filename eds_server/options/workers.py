"""`serve`'s option for `--workers N`: processes that serve Envoy, fed by the one that runs the sources."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .parsing import Option

if TYPE_CHECKING:
    from ..settings import WorkerSettings


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: those it may run on, fewer if its cgroup's CPU quota (a
    container's `--cpus`, a pod's CPU limit) allows less time than that."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open(cpu_max, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))  # rounded up: 1.5 CPUs -> 2 workers
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here
    return cores


def count(value: str) -> int:
    """A count of worker processes; 'auto': the cores this process may use."""
    if value == "auto":
        return usable_cores()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: a number of processes (1-256), or auto")
    return n


OPTIONS = (
    Option(
        "--workers",
        "processes that serve Envoy on --listen (SO_REUSEPORT), fed by this one, which runs the "
        "sources; 'auto': one per usable core [EDS_WORKERS] (default 1: this process serves)",
        "1",
        count,
        "N|auto",
    ),
)


def settings(args: argparse.Namespace) -> WorkerSettings:
    from ..settings import WorkerSettings

    return WorkerSettings(count=args.workers)
