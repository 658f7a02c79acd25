"""Connecting streams in one process: eds-server's fast path and the load generator (bench/loadgen.py)
together, each stream an Envoy's (its HEADERS as Envoy encodes them, a 60 KB Node in its first
request) answered its first response; the CPU per stream, and the collector's share of it.

    .venv/bin/python bench/connect_cycle.py [--streams 4000] [--connections 4] [--runs 3] [--callgrind]

The client's work is in the figure too, the same for any two versions of the server: compare runs
of one version with another's (another checkout first on PYTHONPATH, run from another directory),
not with bench/run.py's connect figures, which are the server's alone, over real sockets to other
processes, with the kernel's part. The collector's share is timed with `gc.callbacks`, with the
server's collector settings (gc_settings.tune).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import in_process
import loadgen
import uvloop
from in_process import serving

from eds_server import gc_settings
from eds_server.model import Endpoint, Group

NODE = 60_000  # bytes of an Envoy's Node, about


async def one_run(streams: int, connections: int) -> tuple[float, float, int]:
    """CPU seconds per stream, the collector's seconds per stream, the collections."""
    group = Group("web", tuple(Endpoint("127.0.0.1", 1000 + p) for p in range(1000)))
    collecting = {"since": 0.0, "spent": 0.0, "count": 0}

    def timing(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting["since"] = time.process_time()
        else:
            collecting["spent"] += time.process_time() - collecting["since"]
            collecting["count"] += 1

    async with serving(group, streams) as (_store, port):
        generator = loadgen.Generator(NODE)
        gc_settings.tune()
        gc.callbacks.append(timing)
        try:
            start = time.process_time()
            await generator.open(port, [["web"] * (streams // connections)] * connections, node_every=False)
            done = await generator.wait({}, 120, {"web": 1})
            assert done["ok"], done
            spent = time.process_time() - start
        finally:
            gc.callbacks.remove(timing)
            generator.close()
    return spent / streams, collecting["spent"] / streams, int(collecting["count"])


def instructions(streams: int, connections: int) -> int:
    """Instructions of one run of this script under callgrind (the interpreter's start included)."""
    return in_process.instructions(
        __file__, "--streams", str(streams), "--connections", str(connections), "--runs", "1"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4_000)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--callgrind", action="store_true", help="instructions per stream (valgrind)")
    args = parser.parse_args()
    if args.callgrind:
        small = instructions(args.streams // 4, max(1, args.connections // 4))
        big = instructions(args.streams, args.connections)
        per = (big - small) / (args.streams - args.streams // 4)
        print(f"{per:,.0f} instructions a stream (streams {args.streams // 4:,} to {args.streams:,})")
        return
    per_stream = []
    for n in range(args.runs):
        cpu, collector, collections = uvloop.run(one_run(args.streams, args.connections))
        per_stream.append(cpu)
        gc_part = f"the collector {collector * 1e6:.1f} us ({collections} collections)"
        print(f"run {n + 1}: {cpu * 1e6:.1f} us a stream, {gc_part}")
    median = statistics.median(per_stream) * 1e6
    print(f"median {median:.1f} us a stream ({args.streams} streams, {args.connections} connections)")


if __name__ == "__main__":
    main()
