"""Header blocks taken apart below the HTTP/2 library and put back together: for a path whose library
cannot be asked to refuse one stream's headers (stock: grpclib turns h2's checks off, then trusts
the headers). HPACK state is per connection and per direction, so a block cannot just be left out:
the client's encoder has changed its dynamic table. Here every block from the client is decoded by
our own decoder (in order, so it follows the client's table), checked, and passed on encoded anew
as literals without indexing, so h2's dynamic table stays empty and nothing h2 decodes depends on
an earlier block: a block refused is simply not passed, and both sides stay in step. Sans-IO,
hpack's and hyperframe's public API only.

Cost (stock is the slow path): one decode, check and encode per header block, that is per stream
opened (and per trailer block), never per message: about 470,000 instructions for an Envoy's
request headers, 1.9 times h2's own decoding of them (callgrind, docs/limits.md).
"""

from __future__ import annotations

from hpack import HPACKError, OversizedHeaderListError
from hyperframe.exceptions import HyperframeError
from hyperframe.frame import ContinuationFrame, HeadersFrame

from .headers import request_problem, trailers_problem
from .repeat_decoder import RepeatDecoder

END_STREAM = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY = 0x20

Fields = list[tuple[bytes, bytes]]


class BlockError(Exception):
    """A header block that breaks the connection (a connection error): `code` names the GOAWAY
    error code (h2.errors.ErrorCodes member name), `reason` the refusal's reason (limits.REASONS)."""

    def __init__(self, code: str, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.reason = reason


class HeaderRelay:
    """The client's header blocks of one connection, decoded, and encoded anew for the library."""

    __slots__ = ("_decoder", "max_frame_size", "priority")

    def __init__(self, max_frame_size: int, max_header_list_size: int) -> None:
        self._decoder = RepeatDecoder(max_header_list_size)
        self.max_frame_size = max_frame_size  # the library's SETTINGS_MAX_FRAME_SIZE: frames passed on fit it
        self.priority: tuple[int, int, bool] | None = None  # the last block's (depends on, weight, exclusive)

    def fields(self, payload: bytes, flags: int, rest: bytes) -> Fields:
        """The fields of a block whose HEADERS frame had `flags` and `payload` (padding and priority
        as sent), continued by the CONTINUATION payloads `rest`."""
        fragment = payload
        self.priority = None
        if flags & (PADDED | PRIORITY):
            frame = HeadersFrame(1, flags=_flag_names(flags))
            try:
                frame.parse_body(memoryview(payload))
            except HyperframeError as e:
                why = f"GOAWAY PROTOCOL_ERROR: HEADERS frame: {e}"
                raise BlockError("PROTOCOL_ERROR", "protocol_error", why) from e
            fragment = frame.data
            if flags & PRIORITY:  # passed on: the library refuses a stream that depends on itself
                self.priority = (frame.depends_on, frame.stream_weight, frame.exclusive)
        try:
            decoded = self._decoder.decode(fragment + rest if rest else fragment, raw=True)
        except OversizedHeaderListError as e:
            raise BlockError("ENHANCE_YOUR_CALM", "header_size", f"GOAWAY ENHANCE_YOUR_CALM: {e}") from e
        except HPACKError as e:
            raise BlockError("COMPRESSION_ERROR", "protocol_error", f"GOAWAY COMPRESSION_ERROR: {e}") from e
        return [(bytes(name), bytes(value)) for name, value in decoded]

    def frames(self, sid: int, fields: Fields, end_stream: bool) -> bytes:
        """`fields` as HEADERS (and CONTINUATION) frames for the library, from our encoder, with
        the priority the client's HEADERS frame carried (`fields` was called for it last)."""
        block = literal_block(fields)
        size = self.max_frame_size - 5  # room for the priority fields
        chunks = [block[i : i + size] for i in range(0, len(block), size)] or [b""]
        out = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            if i == 0:
                names = {"END_STREAM"} if end_stream else set()
                frame: HeadersFrame | ContinuationFrame = HeadersFrame(sid, chunk, flags=names)
                if self.priority is not None:
                    depends_on, weight, exclusive = self.priority
                    frame = HeadersFrame(
                        sid,
                        chunk,
                        flags={*names, "PRIORITY"},
                        depends_on=depends_on,
                        stream_weight=weight,
                        exclusive=exclusive,
                    )
            else:
                frame = ContinuationFrame(sid, chunk)
            if last:
                frame.flags.add("END_HEADERS")
            out.append(frame.serialize())
        return b"".join(out)


def literal_block(fields: Fields) -> bytes:
    """HPACK literals without indexing, new names, no Huffman (RFC 7541 section 6.2.2): nothing
    for a decoder to remember, and the cheapest to write."""
    out = bytearray()
    for name, value in fields:
        out.append(0)
        out += _length(len(name))
        out += name
        out += _length(len(value))
        out += value
    return bytes(out)


def _length(n: int) -> bytes:
    """A string length: a 7-bit prefix integer (RFC 7541 section 5.1), the Huffman bit clear."""
    if n < 127:
        return bytes((n,))
    out = bytearray((127,))
    n -= 127
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


def _flag_names(flags: int) -> set[str]:
    return {
        name
        for name, bit in (
            ("END_STREAM", END_STREAM),
            ("END_HEADERS", END_HEADERS),
            ("PADDED", PADDED),
            ("PRIORITY", PRIORITY),
        )
        if flags & bit
    }


def problem(fields: Fields, request: bool) -> str | None:
    """Why a request's (or trailers') fields are malformed (RFC 9113 section 8), or None. Names
    and values must be ASCII: the library decodes them as such and would fail otherwise."""
    try:
        text = [(name.decode("ascii"), value.decode("ascii")) for name, value in fields]
    except UnicodeDecodeError:
        return "a header name or value that is not ASCII"
    return request_problem(text) if request else trailers_problem(text)
