"""Request header checks of RFC 9113 section 8 (h2spec's section 8.1.2), which grpclib turns off
in h2 and then trusts: a request without `:path` raised KeyError in grpclib's handler and was never
answered. A malformed request is answered RST_STREAM PROTOCOL_ERROR and goes no further. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

REQUEST_PSEUDO = frozenset((":method", ":scheme", ":path", ":authority"))
REQUIRED_PSEUDO = (":method", ":scheme", ":path")
CONNECTION_SPECIFIC = frozenset(("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"))
_NAME_FORBIDDEN = frozenset(" \t\r\n\x00:" + "".join(chr(c) for c in range(0x41, 0x5B)) + "\x7f")
_VALUE_FORBIDDEN = frozenset("\r\n\x00")


def _bad_value(value: str) -> bool:
    return bool(value) and (value[0] in " \t" or value[-1] in " \t" or not _VALUE_FORBIDDEN.isdisjoint(value))


def _bad_field(name: str, value: str) -> str | None:
    """What is wrong with one regular field, if anything."""
    if not name or not _NAME_FORBIDDEN.isdisjoint(name):
        return f"invalid header name {name[:40]!r}"
    if name in CONNECTION_SPECIFIC:
        return f"connection-specific header {name!r}"
    if name == "te" and value != "trailers":
        return "te other than 'trailers'"
    if _bad_value(value):
        return f"invalid value of header {name!r}"
    return None


def request_problem(headers: Iterable[tuple[str, str]]) -> str | None:
    """Why a request's header block is malformed, or None."""
    seen: set[str] = set()
    regular = False
    for name, value in headers:
        if name.startswith(":"):
            if regular:
                return f"pseudo-header {name!r} after a regular header"
            if name not in REQUEST_PSEUDO:
                return f"unknown pseudo-header {name[:40]!r}"
            if name in seen:
                return f"duplicated pseudo-header {name!r}"
            if _bad_value(value) or (name == ":path" and not value):
                return f"invalid value of {name!r}"
            seen.add(name)
        else:
            regular = True
            problem = _bad_field(name, value)
            if problem:
                return problem
    for name in REQUIRED_PSEUDO:
        if name not in seen:
            return f"no {name} pseudo-header"
    return None


class HeaderText:
    """A connection's received header lists as text, for grpclib and the checks here. h2 decodes
    each field of each list itself (a generator, two decodes and a new tuple a field: 8-10 us for
    an Envoy's eight); on the fast path h2 hands them raw, and a list that repeats the last one (an
    Envoy's every stream after a connection's first) gets the last one's text again, a new list of
    the same tuples. ASCII only: anything else raises UnicodeDecodeError, as h2's own decoding did
    (grpclib's setting). Holds one list, raw and as text."""

    __slots__ = ("_raw", "_text")

    def __init__(self) -> None:
        self._raw: tuple[tuple[bytes, bytes], ...] | None = None
        self._text: list[tuple[str, str]] = []

    def __call__(self, headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, str]]:
        raw = tuple(headers)
        if raw != self._raw:
            # each field's own tuple type (hpack's HeaderTuple, or its never-indexed kind), as h2 keeps
            self._text = [cast(Any, type(field))(field[0].decode("ascii"), field[1].decode("ascii")) for field in raw]
            self._raw = raw
        return list(self._text)


class RequestCheck:
    """request_problem for one connection's requests, remembering the last header list it found
    well formed: an Envoy's streams on one connection all send the same fields (one per EDS
    cluster), checked once, not once a stream (8-10 us each). Holds one list: what a header block
    may hold, at most."""

    __slots__ = ("_fine",)

    def __init__(self) -> None:
        self._fine: tuple[tuple[str, str], ...] | None = None

    def __call__(self, headers: Iterable[tuple[str, str]]) -> str | None:
        fields = tuple(headers)
        if fields == self._fine:
            return None
        found = request_problem(fields)
        if found is None:
            self._fine = fields
        return found


def trailers_problem(headers: Iterable[tuple[str, str]]) -> str | None:
    """Why a trailer block is malformed (pseudo-headers may not appear in one), or None."""
    for name, value in headers:
        if name.startswith(":"):
            return f"pseudo-header {name[:40]!r} in trailers"
        problem = _bad_field(name, value)
        if problem:
            return problem
    return None
