"""Python's cyclic garbage collector, set for a server that holds many long-lived objects.

Each stream holds a few hundred objects that live as long as it does (h2's and grpclib's state
machines, buffers, the session), and with the collector's default, a young collection every 700
new container objects, the survivors of a burst are walked again and again: measured connecting
10,000 streams to two workers, about a quarter of the CPU went to collections (5.3 s of CPU with
the default, 3.3-4.0 s set as here; `bench/run.py --only cores`, docs/performance.md). So
everything made while starting (modules, the app) is frozen out of every collection, and a young
collection runs every 20,000 new objects instead. Garbage in cycles waits a little longer (at most
those 20,000 objects' worth). Start-up objects that later become cyclic garbage are never
collected; they are made once, so that is bounded. The older generations' thresholds are Python's.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000


def before_exit() -> None:
    """Once the server has stopped: what is left goes with the process, so the interpreter's last
    collection need not walk it (measured: 1.3 s for 59,000 objects on a loaded host, a third of
    that frozen first). Keeps SIGTERM-to-exit within --shutdown-timeout plus a fraction of a second."""
    gc.freeze()


def tune() -> None:
    """Once the server has started: collect, freeze what is left, raise the young threshold."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
