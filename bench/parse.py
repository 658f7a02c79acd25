"""Upstreams file parsing: CPU of upstreams.parse_bytes, fresh and after one endpoint changed.

    .venv/bin/python bench/parse.py [--endpoints 1000,10000] [--repeat 5]

One group of one-line flow-mapping endpoints (`- {address: A, port: 8080, weight: 1}`), as a
generated file would have. "fresh" is a parse by a new Parser (what `check` and the first load
do); "one change" is a re-parse by a Parser that parsed the previous version, with one endpoint's
weight changed (what a reload does). Prints medians and writes bench/results/parse.json. Run it
with another checkout's eds_server first on PYTHONPATH (from another directory) to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from eds_server import upstreams


def text(endpoints: int, changed: int = -1) -> bytes:
    lines = ["groups:", "  g0:", "    endpoints:"]
    for i in range(endpoints):
        weight = 2 if i == changed else 1
        lines.append(f"      - {{address: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}, port: 8080, weight: {weight}}}")
    return ("\n".join(lines) + "\n").encode()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", default="1000,10000")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    out = {}
    for n in map(int, args.endpoints.split(",")):
        data, changed = text(n), text(n, changed=n // 2)
        fresh, again = [], []
        for _ in range(args.repeat):
            t = time.process_time()
            upstreams.parse_bytes(data, "upstreams.yaml")
            fresh.append(time.process_time() - t)
            if hasattr(upstreams, "Parser"):  # absent before incremental parsing
                parser = upstreams.Parser()
                parser.parse_bytes(data, "upstreams.yaml")
                t = time.process_time()
                parser.parse_bytes(changed, "upstreams.yaml")
                again.append(time.process_time() - t)
        out[n] = {
            "bytes": len(data),
            "fresh_ms": statistics.median(fresh) * 1000,
            "one_change_ms": statistics.median(again) * 1000 if again else None,
        }
        one = f"{out[n]['one_change_ms']:.1f} ms" if again else "-"
        print(f"{n} endpoints ({len(data)} bytes): fresh {out[n]['fresh_ms']:.1f} ms, one endpoint changed {one}")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / "parse.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
