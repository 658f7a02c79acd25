"""LeanEvent and LeanQueue behave as asyncio.Event and asyncio.Queue do, at a tenth of the memory while idle;
Wake is a LeanEvent for its one waiting task."""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc

from eds_server.events import LeanEvent, LeanQueue, Wake


async def test_it_wakes_every_waiter_once_set_and_blocks_again_once_cleared() -> None:
    for event in (LeanEvent(), asyncio.Event()):  # the same script passes on both
        woken: list[int] = []

        async def waiter(i: int, e: LeanEvent | asyncio.Event = event, out: list[int] = woken) -> None:
            assert await e.wait()
            out.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0)  # the waiters wait (the loop's turn, not a clock)
        assert not woken and not event.is_set()
        event.set()
        await asyncio.gather(*tasks)
        assert sorted(woken) == [0, 1, 2] and event.is_set()
        assert await event.wait()  # set: at once
        event.clear()
        late = asyncio.create_task(event.wait())
        await asyncio.sleep(0)
        assert not late.done()
        event.set()
        assert await late


async def test_a_cancelled_waiter_leaves_nothing_behind() -> None:
    event = LeanEvent()
    task = asyncio.create_task(event.wait())
    await asyncio.sleep(0)
    assert "waiters:1" in repr(event)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert "waiters:0" in repr(event) and event._waiters is None
    event.set()  # nobody to wake
    assert event.is_set()


def _bytes_each(make: type) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = [make() for _ in range(1000)]
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(kept) == 1000
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / 1000


def test_it_costs_a_tenth_of_an_asyncio_event() -> None:
    lean, stock = _bytes_each(LeanEvent), _bytes_each(asyncio.Event)
    assert lean * 5 < stock, (lean, stock)  # measured: ~100 against 857 bytes


async def test_the_queue_is_first_in_first_out_and_a_get_waits_for_a_put() -> None:
    for queue in (LeanQueue[int](), asyncio.Queue[int]()):  # the same script passes on both
        assert queue.empty() and queue.qsize() == 0
        with contextlib.suppress(asyncio.QueueEmpty):
            queue.get_nowait()
            raise AssertionError("an empty queue gave an item")
        waiting = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        assert not waiting.done()
        for i in (1, 2, 3):
            queue.put_nowait(i)
        assert await waiting == 1 and queue.qsize() == 2
        assert await queue.get() == 2 and queue.get_nowait() == 3 and queue.empty()


async def test_a_cancelled_get_woken_by_a_put_passes_the_item_on() -> None:
    for queue in (LeanQueue[str](), asyncio.Queue[str]()):
        first = asyncio.create_task(queue.get())
        second = asyncio.create_task(queue.get())
        await asyncio.sleep(0)
        queue.put_nowait("x")  # wakes the first...
        first.cancel()  # ...which leaves before it runs
        with contextlib.suppress(asyncio.CancelledError):
            await first
        assert await asyncio.wait_for(second, 5) == "x"  # bounded: a lost wake-up fails, not hangs
        assert queue.empty()


def test_the_queue_costs_a_tenth_of_an_asyncio_queue() -> None:
    lean, stock = _bytes_each(LeanQueue), _bytes_each(asyncio.Queue)
    assert lean * 10 < stock, (lean, stock)  # measured: ~100 against ~2,700 bytes


async def test_a_wake_wakes_its_task_once_set_and_blocks_it_again_once_cleared() -> None:
    wake = Wake()
    waiting = asyncio.ensure_future(wake.waiter())
    await asyncio.sleep(0)
    assert not waiting.done() and not wake.is_set()
    wake.set()
    await waiting
    assert wake.is_set()
    wake.set()  # set again: nothing waits, nothing happens
    wake.clear()
    again = wake.waiter()
    await asyncio.sleep(0)
    assert not again.done()
    wake.set()
    await again
    assert wake._waiter is None  # nothing kept once woken


async def test_a_wake_whose_waiter_was_cancelled_sets_without_error() -> None:
    wake = Wake()
    task = asyncio.create_task(_wait(wake))
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    wake.set()
    assert wake.is_set() and wake._waiter is None


async def _wait(wake: Wake) -> None:
    await wake.waiter()
