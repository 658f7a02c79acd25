"""grpclib's per-connection Handler, letting go of each call as it ends and of itself once its
connection is gone, on both HTTP/2 paths.

grpclib keeps every connection's Handler in its server's `_handlers`, and each Handler keeps its
streams' tasks in `_tasks` and `_cancelled`; both are pruned only every tenth new connection or
stream. A closed connection's Handler, with the last streams it served, their finished tasks and the
frames a cancelled one keeps in its traceback, lived on until ten more connections came: on a quiet
server, for good (100 connections of 100 request streams left ~200 MB more behind each round:
tests/hostile/test_memory.py). And each call ended by a reset or by its connection
closing leaves a cycle, the stream's Wrapper holding the error it raised (`_error`), whose traceback
holds the frame holding the Wrapper: freed only by a full collection, which a quiet server rarely
runs. Here each task is dropped as it ends, with that error, and the Handler leaves the server's set
once closed with no task left. A call's task cancelled before it ran (its stream reset in the read
that opened it) never released its stream: the request data it never read stayed charged to the
connection's window (a client resetting such streams ran it dry for all its streams) and the stream
in grpclib's table; it is released here. Touches grpclib internals (private.py lists them).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, cast

import grpclib.protocol
import grpclib.server

_Headers = Any  # grpclib's header list


class ReleasingHandler(grpclib.server.Handler):
    """A connection's handler that drops each call's task as it ends, and leaves its server's set
    of handlers once closed with no task left (the set, not a copy: grpclib rebuilds it as it prunes)."""

    def __init__(self, like: grpclib.server.Handler, server: grpclib.server.Server) -> None:
        super().__init__(like.mapping, like.codec, like.status_details_codec, like.dispatch)
        self.server = server

    def __gc_collect__(self) -> None:
        """Nothing to prune: each call's task leaves as it ends (`ended`). grpclib's own pruning
        walks every call the connection holds on every tenth new one: quadratic in a connection's
        calls, and an Envoy opens one per EDS cluster on one connection (thousands)."""

    def accept(self, stream: grpclib.protocol.Stream, headers: _Headers, release_stream: Callable[[], Any]) -> None:
        release = Release(release_stream)
        super().accept(stream, headers, release)
        self._tasks[stream].add_done_callback(functools.partial(self.ended, stream, release))

    def ended(self, stream: grpclib.protocol.Stream, release: Release, task: asyncio.Task[None]) -> None:
        """A call's task ended: its stream is released if the task never did (a task cancelled
        before it ran, its stream reset in the same read that opened it: the request data it never
        read was not given back to the connection's window, and the stream stayed in grpclib's
        table); neither the stream nor the task are held any longer, nor the error its Wrapper
        raised (a cycle through that error's traceback)."""
        release()
        call_ended = getattr(stream.connection, "call_ended", None)  # the fast path's connections'
        if call_ended is not None and stream.id is not None:
            call_ended(stream.id)
        if self._tasks.get(stream) is task:
            del self._tasks[stream]
        self._cancelled.discard(task)
        wrapper = stream.wrapper
        if wrapper is not None:
            wrapper._error = None
            stream.wrapper = None
        self.leave_if_done()

    def close(self) -> None:
        super().close()
        self.loop.call_soon(self.leave_if_done)  # not at once: grpclib's server.close() walks the set

    def leave_if_done(self) -> None:
        if self.closing and not self._tasks and not self._cancelled:
            self.server._handlers.discard(self)


class Release:
    """grpclib's release_stream, called once: by the call's task as it ends, or after it."""

    __slots__ = ("done", "release_stream")

    def __init__(self, release_stream: Callable[[], Any]) -> None:
        self.release_stream = release_stream
        self.done = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.release_stream()


def releasing(server: grpclib.server.Server, handler: grpclib.protocol.AbstractHandler) -> ReleasingHandler:
    """The ReleasingHandler to use in place of `handler`, which grpclib's own protocol factory of
    `server` has just made (and added to its set of handlers, where the new one takes its place)."""
    mine = ReleasingHandler(cast(grpclib.server.Handler, handler), server)
    server._handlers.discard(handler)
    server._handlers.add(mine)
    return mine
