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
in grpclib's table; it is released here. On the fast path, a call whose headers are plain (an
Envoy's: no deadline, nothing grpclib would answer with an error) starts without grpclib reading
them again for each call: they are read once while a connection's calls repeat them (dict, metadata
and deadline parsing, 12-15 us a stream). Touches grpclib internals (private.py lists them).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import grpclib.const
import grpclib.protocol
import grpclib.server
from grpclib.const import Status
from grpclib.encoding.base import GRPC_CONTENT_TYPE
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.metadata import decode_metadata
from grpclib.utils import Wrapper
from multidict import MultiDict

from ...events import NO_CONTEXT

_Headers = Any  # grpclib's header list
_grpclib_log = logging.getLogger("grpclib.server")  # a call's errors are logged as grpclib logs them


class ReleasingHandler(grpclib.server.Handler):
    """A connection's handler that drops each call's task as it ends, and leaves its server's set
    of handlers once closed with no task left (the set, not a copy: grpclib rebuilds it as it prunes)."""

    def __init__(self, like: grpclib.server.Handler, server: grpclib.server.Server, plain: bool = False) -> None:
        """`plain`: calls whose headers are plain (`PlainCall`) start without grpclib's reading of them."""
        super().__init__(like.mapping, like.codec, like.status_details_codec, like.dispatch)
        self.server = server
        self.plain = plain
        self._last: tuple[tuple[str, str], ...] | None = None  # the last headers found plain
        self._last_call: PlainCall | None = None

    def __gc_collect__(self) -> None:
        """Nothing to prune: each call's task leaves as it ends (`ended`). grpclib's own pruning
        walks every call the connection holds on every tenth new one: quadratic in a connection's
        calls, and an Envoy opens one per EDS cluster on one connection (thousands)."""

    def accept(self, stream: grpclib.protocol.Stream, headers: _Headers, release_stream: Callable[[], Any]) -> None:
        release = release_stream if isinstance(release_stream, Release) else Release(release_stream)
        release.handler, release.stream = self, stream
        call = self._plain(headers) if self.plain else None
        if call is None:
            super().accept(stream, headers, release)
        else:
            self._tasks[stream] = self.loop.create_task(self._serve_plain(stream, call, release))
        # `ended` reads no context variable: no copy of the context kept a stream
        self._tasks[stream].add_done_callback(release, context=NO_CONTEXT)

    def _plain(self, headers: _Headers) -> PlainCall | None:
        """The call the headers start, if plain: remembered while the headers repeat (an Envoy's
        every stream on a connection sends the same ones)."""
        fields = tuple(headers)
        if fields == self._last:
            return self._last_call
        call = PlainCall.of(fields, self.mapping, self.codec.__content_subtype__)
        if call is not None:
            self._last, self._last_call = fields, call
        return call

    async def _serve_plain(self, raw: grpclib.protocol.Stream, call: PlainCall, release: Release) -> None:
        """grpclib's request_handler for a plain call, the headers read already: the same server
        Stream, Wrapper, RecvRequest event, status and logging, with no deadline (none was asked)."""
        try:
            method = call.method
            async with grpclib.server.Stream(
                raw,
                call.path,
                method.cardinality,
                method.request_type,
                method.reply_type,
                codec=self.codec,
                status_details_codec=self.status_details_codec,
                dispatch=self.dispatch,
                deadline=None,
                user_agent=call.user_agent,
            ) as stream:
                wrapper = raw.wrapper = Wrapper()
                try:
                    with wrapper:
                        stream.metadata, method_func = await self.dispatch.recv_request(
                            MultiDict(call.metadata),  # each call its own, as grpclib's
                            method.func,
                            method_name=call.path,
                            deadline=None,
                            content_type=call.content_type,
                            user_agent=call.user_agent,
                            peer=stream.peer,
                        )
                        await method_func(stream)
                except GRPCError:
                    raise
                except TimeoutError:
                    if wrapper.cancel_failed:
                        _grpclib_log.exception("Failed to handle cancellation")
                        raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                    if wrapper.cancelled:
                        _grpclib_log.info("Deadline exceeded")
                        raise GRPCError(Status.DEADLINE_EXCEEDED) from None
                    _grpclib_log.exception("Timeout occurred")
                    raise
                except StreamTerminatedError as err:
                    if wrapper.cancel_failed:
                        _grpclib_log.exception("Failed to handle cancellation")
                    else:
                        _grpclib_log.info("Request was cancelled: %s", err)
                    raise
                except Exception:
                    _grpclib_log.exception("Application error")
                    raise
        except ProtocolError:
            _grpclib_log.exception("Application error")
        except Exception:
            _grpclib_log.exception("Server error")
        finally:
            release()

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


@dataclass(frozen=True, slots=True)
class PlainCall:
    """A call whose headers grpclib would start with no error and no deadline: POST, the server's
    gRPC content type, `te: trailers`, a method the server has, no grpc-timeout. Anything else
    (every error answer, a deadline) is started by grpclib's own request_handler, as always."""

    path: str
    method: grpclib.const.Handler
    content_type: str
    user_agent: str | None
    metadata: MultiDict[str]

    @classmethod
    def of(cls, fields: tuple[tuple[str, str], ...], mapping: Any, subtype: str) -> PlainCall | None:
        named = dict(fields)
        content_type = named.get("content-type")
        if named.get(":method") != "POST" or content_type is None or named.get("te") != "trailers":
            return None
        base, _, sub = content_type.partition("+")
        if base != GRPC_CONTENT_TYPE or (sub or "proto") != subtype or "grpc-timeout" in named:
            return None
        path = named.get(":path")
        if path is None or not dict.__contains__(
            mapping, path
        ):  # the table's own: an unknown method is grpclib's to answer
            return None
        metadata = cast(MultiDict[str], decode_metadata(fields))
        return cls(path, mapping[path], content_type, named.get("user-agent"), metadata)


class Release:
    """grpclib's release_stream, called once: by the call's task as it ends, or after it; and the
    task's done callback (given the task), which ends the call in its handler (`ended`). One object
    a stream where a partial of a bound method made three."""

    __slots__ = ("done", "handler", "release_stream", "stream")

    handler: ReleasingHandler
    stream: grpclib.protocol.Stream

    def __init__(self, release_stream: Callable[[], Any] | None = None) -> None:
        self.release_stream = release_stream
        self.done = False

    def __call__(self, task: asyncio.Task[None] | None = None) -> None:
        if task is not None:
            self.handler.ended(self.stream, self, task)
        elif not self.done:
            self.done = True
            self.release()

    def release(self) -> None:
        assert self.release_stream is not None
        self.release_stream()


class ProcessorRelease(Release):
    """grpclib's release_stream (the closure its EventsProcessor.register makes: a function, two
    cells, a dict and two tuples a stream) as a Release itself, doing what that closure does."""

    __slots__ = ("processor",)

    def __init__(self, processor: grpclib.protocol.EventsProcessor, stream: grpclib.protocol.Stream) -> None:
        super().__init__()
        self.processor = processor
        self.stream = stream

    def release(self) -> None:
        stream, processor = self.stream, self.processor
        assert stream.id is not None
        processor.streams.pop(stream.id)
        connection = processor.connection
        connection.stream_close_waiter.set()
        if not connection.is_closing():
            connection.ack(stream.id, stream.buffer.unacked_size())


def releasing(
    server: grpclib.server.Server, handler: grpclib.protocol.AbstractHandler, plain: bool = False
) -> ReleasingHandler:
    """The ReleasingHandler to use in place of `handler`, which grpclib's own protocol factory of
    `server` has just made (and added to its set of handlers, where the new one takes its place)."""
    mine = ReleasingHandler(cast(grpclib.server.Handler, handler), server, plain)
    server._handlers.discard(handler)
    server._handlers.add(mine)
    return mine
