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
once closed with no task left. Touches grpclib internals (private.py lists them).
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

    def accept(self, stream: grpclib.protocol.Stream, headers: _Headers, release_stream: Callable[[], Any]) -> None:
        super().accept(stream, headers, release_stream)
        self._tasks[stream].add_done_callback(functools.partial(self.ended, stream))

    def ended(self, stream: grpclib.protocol.Stream, task: asyncio.Task[None]) -> None:
        """A call's task ended: neither its stream nor the task are held any longer, nor the error
        its Wrapper raised (a cycle through that error's traceback)."""
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


def releasing(server: grpclib.server.Server, handler: grpclib.protocol.AbstractHandler) -> ReleasingHandler:
    """The ReleasingHandler to use in place of `handler`, which grpclib's own protocol factory of
    `server` has just made (and added to its set of handlers, where the new one takes its place)."""
    mine = ReleasingHandler(cast(grpclib.server.Handler, handler), server)
    server._handlers.discard(handler)
    server._handlers.add(mine)
    return mine
