"""The collector settings a started server runs with (each test in a process of its own: they are
global): start-up objects frozen, each young collection's survivors frozen so the middle generation
never walks them again, and the old objects collected by Python's rule for its oldest generation."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run(code: str) -> list[str]:
    script = textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


PRELUDE = """
import asyncio, gc, weakref
from eds_server import gc_settings

class Node:  # one of a cycle
    def __init__(self): self.me = self
"""


def tuned(body: str, before: str = "") -> list[str]:
    """What `body` prints, run on an event loop in a process of its own once the server's settings
    are in force (`before`: run first, before them)."""
    lines = [*before.strip().splitlines(), "gc_settings.tune()", *textwrap.dedent(body).strip().splitlines()]
    main = "async def main():\n" + "".join(f"    {line}\n" for line in lines)
    return run(PRELUDE + main + "asyncio.run(main())\n")


def test_tune_freezes_the_start_up_objects_and_raises_the_young_threshold() -> None:
    out = tuned(
        "print(gc.get_threshold()[0], gc.get_threshold()[1:] == older, gc.get_freeze_count() > 1000)",
        before="older = gc.get_threshold()[1:]",
    )
    assert out == ["20000", "True", "True"]


def test_a_young_collections_survivors_are_frozen_and_never_walked_again() -> None:
    out = tuned(
        """
before = gc.get_freeze_count()
kept = [[] for _ in range(30_000)]
gc.collect(0)
print(gc.get_freeze_count() - before >= 30_000, len(gc.get_objects(1)), len(gc.get_objects(2)))
"""
    )
    assert out == ["True", "0", "0"]


def test_cycles_among_old_objects_are_collected_once_they_grew_a_quarter_after_121_young_collections() -> None:
    out = tuned(
        """
generations = gc_settings.generations
cycle = Node()
dead = weakref.ref(cycle)
gc.collect(0)  # survives, frozen: old
del cycle  # garbage in a cycle, among the old objects
kept = []
grow = int(generations.old * gc_settings.OLD_GROWTH) // 100 + 1
for i in range(gc_settings.OLD_AFTER - 2):  # grown enough, not enough young collections yet
    kept.extend([] for _ in range(grow))
    gc.collect(0)
await asyncio.sleep(0)
print(dead() is not None, generations.old_collections)
gc.collect(0)
await asyncio.sleep(0)  # the old collection, on the loop's next turn
print(dead() is None, generations.old_collections, generations.grown, generations.young)
"""
    )
    assert out == ["True", "0", "True", "1", "0", "0"]


def test_an_old_collection_waits_for_a_quarter_more_old_objects() -> None:
    out = tuned(
        """
generations = gc_settings.generations
for i in range(gc_settings.OLD_AFTER * 2):  # young collections, nothing surviving
    gc.collect(0)
await asyncio.sleep(0)
print(generations.old_collections, generations.young >= gc_settings.OLD_AFTER * 2)
"""
    )
    assert out == ["0", "True"]


def test_collect_collects_cycles_among_frozen_objects_and_freezes_what_is_left() -> None:
    out = tuned(
        """
cycle = Node()
dead = weakref.ref(cycle)
gc.collect(0)
del cycle
gc.collect()  # Python's own full collection does not see frozen objects
print(dead() is not None, gc_settings.collect() >= 1, dead() is None, len(gc.get_objects()) < 100)
"""
    )
    assert out == ["True", "True", "True", "True"]


def test_an_old_collection_due_is_not_run_again_after_another_full_one() -> None:
    out = tuned(
        """
generations = gc_settings.generations
kept = []
grow = int(generations.old * gc_settings.OLD_GROWTH) // 100 + 1
for i in range(gc_settings.OLD_AFTER):
    kept.extend([] for _ in range(grow))
    gc.collect(0)
print(generations.due)
gc_settings.collect()  # the heap trim's, say, before the loop's turn
await asyncio.sleep(0)
print(generations.old_collections, generations.due)
"""
    )
    assert out == ["True", "1", "False"]
