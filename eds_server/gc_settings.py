"""Python's cyclic garbage collector, set for a server that holds many long-lived objects.

Each stream holds some fifty objects the collector walks (h2's and grpclib's state machines, the
call's task, the session). Python collects in three generations: with its defaults a young
collection every 700 new container objects, whose survivors are walked again in the middle
generation before they reach the oldest. Measured connecting 10,000 streams to two workers, a
quarter of the CPU went to collections with the defaults (5.3 s of CPU, 3.3-4.0 s with a higher
young threshold alone; `bench/run.py --only cores`, docs/performance.md). So, once started:

- everything made while starting (modules, the app) is collected once and frozen (`gc.freeze`):
  out of every collection of Python's;
- a young collection runs every 20,000 new objects (`YOUNG_THRESHOLD`), and its survivors are
  frozen at once, so each object is walked once while young, not again in the middle generation
  (connecting 10,000 streams: 70-74 ms of collection against 157-160, docs/performance.md);
- the old objects, all frozen, are collected by the rule Python keeps for its oldest generation:
  once the survivors frozen since the last such collection are more than a quarter of what it left
  (`OLD_GROWTH`), and at least 121 young collections have run since (`OLD_AFTER`, what Python's
  default thresholds for the older two generations come to), the event loop's next turn unfreezes
  everything, collects it in full and freezes what is left (`collect`). Garbage in a cycle that
  outlived a young collection now waits for the old collection (before, for the middle generation's next
  collection, 11 young ones at most), as garbage that had reached the oldest generation always
  did: bounded by the same rule. An object freed by its last reference goes at once, frozen or
  not, and a stream's objects are (the calls break their cycles as they end: handlers.py).

`collect` is that full collection, for whoever needs one now (the heap trim after streams ended).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from typing import Any

YOUNG_THRESHOLD = 20_000
# Python's own rule for its oldest generation, with its default thresholds for the older two (10 and
# 10): a full collection once the objects that reached it since the last are more than a quarter of
# what that left, and 11 middle collections of 11 young ones each have run since.
OLD_GROWTH = 0.25
OLD_AFTER = 121  # young collections


class Generations:
    """The collector's callback: survivors frozen, old collections made due."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.old = gc.get_freeze_count()  # objects left by the last old collection (or the start)
        self.grown = 0  # survivors frozen since
        self.young = 0  # young collections since
        self.due = False
        self.collecting = False
        self.old_collections = 0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase != "stop":
            return
        if self.collecting:  # our own old collection: `collect` counts what it leaves
            gc.freeze()
            return
        survivors = len(gc.get_objects(min(info["generation"] + 1, 2)))
        gc.freeze()
        self.grown += survivors
        self.young += 1
        if not self.due and self.young >= OLD_AFTER and self.grown > self.old * OLD_GROWTH:
            self.due = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
                self.loop.call_soon_threadsafe(self.collect_if_due)  # not in here: the collector is running

    def collect_if_due(self) -> None:
        if self.due:  # not if a collection ran meanwhile (the heap trim's)
            self.collect()

    def collect(self) -> int:
        self.collecting = True
        try:
            gc.unfreeze()
            found = gc.collect()
            gc.freeze()
        finally:
            self.collecting = False
        self.old, self.grown, self.young, self.due = gc.get_freeze_count(), 0, 0, False
        self.old_collections += 1
        return found


generations: Generations | None = None  # once tuned


def collect() -> int:
    """A full collection, frozen objects too; the number of unreachable objects found."""
    if generations is None:
        return gc.collect()
    return generations.collect()


def before_exit() -> None:
    """Once the server has stopped: what is left goes with the process, so the interpreter's last
    collection need not walk it (measured: 1.3 s for 59,000 objects on a loaded host, a third of
    that frozen first). Keeps SIGTERM-to-exit within --shutdown-timeout plus a fraction of a second."""
    global generations
    if generations is not None:
        gc.callbacks.remove(generations)
        generations = None
    gc.freeze()


def tune() -> None:
    """Once the server has started, on its event loop: collect, freeze what is left, raise the
    young threshold, and freeze each young collection's survivors from now on."""
    global generations
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
    if generations is None:
        generations = Generations(asyncio.get_running_loop())
        gc.callbacks.append(generations)
