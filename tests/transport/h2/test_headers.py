"""RFC 9113 section 8 request header checks (transport/h2/headers.py), the pure part of what
transport/h2/test_attacks.py sends to a real server."""

from __future__ import annotations

import pytest
from hpack import HeaderTuple, NeverIndexedHeaderTuple

from eds_server.transport.h2 import headers as headers_module
from eds_server.transport.h2.headers import HeaderText, RequestCheck, request_problem, trailers_problem

GOOD = [
    (":method", "POST"),
    (":scheme", "http"),
    (":path", "/x.Y/Z"),
    (":authority", "a"),
    ("content-type", "application/grpc"),
    ("te", "trailers"),
]


def test_a_grpc_request_passes() -> None:
    assert request_problem(GOOD) is None
    assert request_problem([h for h in GOOD if h[0] != ":authority"]) is None  # optional


@pytest.mark.parametrize(
    ("headers", "why"),
    [
        ([h for h in GOOD if h[0] != ":path"], "no :path"),
        ([h for h in GOOD if h[0] != ":method"], "no :method"),
        ([h for h in GOOD if h[0] != ":scheme"], "no :scheme"),
        ([*GOOD[:2], (":path", ""), *GOOD[3:]], "invalid value of ':path'"),
        ([*GOOD, ("X-Upper", "1")], "invalid header name"),
        ([(":protocol", "x"), *GOOD], "unknown pseudo-header"),
        ([(":status", "200"), *GOOD], "unknown pseudo-header"),
        ([(":method", "POST"), *GOOD], "duplicated pseudo-header"),
        ([*GOOD, (":path", "/a")], "after a regular header"),
        ([*GOOD, ("connection", "keep-alive")], "connection-specific header 'connection'"),
        ([*GOOD, ("transfer-encoding", "chunked")], "connection-specific"),
        ([*GOOD[:5], ("te", "gzip")], "te other than 'trailers'"),
        ([*GOOD, ("x-a", "b\r\nc")], "invalid value of header 'x-a'"),
        ([*GOOD, ("x-a", " padded")], "invalid value"),
    ],
)
def test_malformed_requests_are_named(headers: list[tuple[str, str]], why: str) -> None:
    problem = request_problem(headers)
    assert problem is not None and why in problem


def test_a_connection_checks_a_repeated_header_list_once_and_every_other_one_fully(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection's check remembers the last list it passed: the same fields again (an Envoy's
    every stream) are not checked again; anything else is, a malformed list always, and a list
    that passed once does not let a malformed one through after it."""
    checked: list[object] = []

    def counted(fields: object) -> str | None:
        checked.append(fields)
        return request_problem(fields)  # type: ignore[arg-type]

    monkeypatch.setattr(headers_module, "request_problem", counted)
    check = RequestCheck()
    bad = [*GOOD, ("x-a", "b\r\nc")]
    assert [check(list(GOOD)) for _ in range(5)] == [None] * 5 and len(checked) == 1
    for _ in range(3):
        assert check(bad) is not None
    assert len(checked) == 4  # a refusal is never remembered
    other = [*GOOD, ("x-b", "1")]
    assert check(other) is None and check(GOOD) is None and len(checked) == 6  # only the last is remembered
    assert check([*GOOD[:5], ("te", "gzip")]) is not None


def test_a_connections_headers_become_text_once_while_they_repeat() -> None:
    """h2 hands a list of raw fields; it becomes text, each field keeping its tuple type. The same
    list again (an Envoy's every stream) gets the same tuples, decoded once, in a new list; another
    list is decoded anew; anything not ASCII raises as h2's own decoding did."""
    text = HeaderText()
    raw = [HeaderTuple(b":method", b"POST"), NeverIndexedHeaderTuple(b":path", b"/x.Y/Z")]
    first, again = text(raw), text(list(raw))
    assert first == again == [(":method", "POST"), (":path", "/x.Y/Z")]
    assert first is not again and all(a is b for a, b in zip(first, again, strict=True))
    assert [type(f) for f in first] == [HeaderTuple, NeverIndexedHeaderTuple]
    assert text([HeaderTuple(b":method", b"GET")]) == [(":method", "GET")]
    with pytest.raises(UnicodeDecodeError):
        text([HeaderTuple(b"x-name", "caf\u00e9".encode())])


def test_trailers_hold_no_pseudo_headers() -> None:
    assert trailers_problem([("grpc-status", "0")]) is None
    assert "in trailers" in (trailers_problem([(":path", "/")]) or "")
    assert "connection-specific" in (trailers_problem([("upgrade", "h2c")]) or "")
