"""Paired fan-out cost of the xDS state machines: this tree against another git revision.

    .venv/bin/python bench/xds_pair.py [--base REV] [--streams N] [--changes N]

The other revision's `eds_server` is extracted (git archive) as a package named `eds_base`, so both
versions of `xds/` run in one process on one store. For each change, every stream of each version is
told of it, polls its response and ACKs it; the two versions take turns, swapping order each change,
so the noise of a shared machine falls on both alike. Prints CPU ms (process_time) per change for all
streams, the median of each and the median of the per-change ratios, and writes
bench/results/xds_pair.json. Only the sans-IO state machines are measured: no sockets, no encoding.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group
from eds_server.store import Store
from eds_server.xds.common import EDS_TYPE_URL

HERE = Path(__file__).resolve().parent


def extract(rev: str, into: Path) -> None:
    data = subprocess.run(
        ["git", "archive", rev, "eds_server"], cwd=HERE.parent, check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "eds_server").rename(into / "eds_base")


def streams(pkg: str, kind: str, store: Store, n: int) -> list[Any]:
    sotw, delta = importlib.import_module(f"{pkg}.xds.sotw"), importlib.import_module(f"{pkg}.xds.delta")
    out = []
    for _ in range(n):
        if kind == "sotw":
            s = sotw.SotwStream(store)
            s.receive(sotw.Request(has_node=True, resource_names=("g0",), type_url=EDS_TYPE_URL))
        else:
            s = delta.DeltaStream(store)
            s.receive(delta.DeltaRequest(has_node=True, type_url=EDS_TYPE_URL, subscribe=("g0",)))
        out.append(s)
    one_change(pkg, kind, out)
    return out


def one_change(pkg: str, kind: str, ss: list[Any]) -> float:
    """Every stream is told of the change, takes its response and ACKs it; CPU seconds."""
    sotw, delta = sys.modules[f"{pkg}.xds.sotw"], sys.modules[f"{pkg}.xds.delta"]
    t0 = time.process_time()
    for s in ss:
        s.changed({"g0"})
        r = s.poll()
        if kind == "sotw":
            s.receive(
                sotw.Request(
                    version_info=r.version_info, resource_names=("g0",), response_nonce=r.nonce, type_url=EDS_TYPE_URL
                )
            )
        else:
            s.receive(delta.DeltaRequest(response_nonce=r.nonce))
    return time.process_time() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="main", help="git revision to compare against (default main)")
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--changes", type=int, default=200)
    args = p.parse_args()
    out: dict[str, Any] = {"base": args.base, "streams": args.streams, "changes": args.changes}
    with tempfile.TemporaryDirectory() as tmp:
        extract(args.base, Path(tmp))
        sys.path.insert(0, tmp)
        for kind in ("sotw", "delta"):
            store = Store(encode_group)
            store.add_source("s")
            store.update("s", {"g0": Group("g0", (Endpoint("127.0.0.1", 1),))})
            base = streams("eds_base", kind, store, args.streams)
            this = streams("eds_server", kind, store, args.streams)
            tb, tt, ratios = [], [], []
            for i in range(args.changes):
                store.update("s", {"g0": Group("g0", (Endpoint("127.0.0.1", 2 + i),))})
                if i % 2:
                    b, t = one_change("eds_base", kind, base), one_change("eds_server", kind, this)
                else:
                    t, b = one_change("eds_server", kind, this), one_change("eds_base", kind, base)
                tb.append(b)
                tt.append(t)
                ratios.append(t / b)
            out[kind] = {
                "base_ms": 1e3 * statistics.median(tb),
                "this_ms": 1e3 * statistics.median(tt),
                "ratio_median": statistics.median(ratios),
            }
    print(f"\nxDS state machines, {args.streams} streams, {args.changes} changes (CPU ms per change, median)")
    print(f"  {'kind':6} {'base ' + args.base:>16} {'this tree':>10} {'ratio':>6}")
    for kind in ("sotw", "delta"):
        r = out[kind]
        print(f"  {kind:6} {r['base_ms']:16.2f} {r['this_ms']:10.2f} {r['ratio_median']:6.2f}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "xds_pair.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
