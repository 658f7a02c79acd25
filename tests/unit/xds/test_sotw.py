"""The SotW state machine, driven directly: no sockets, no store, just requests and changes."""

from __future__ import annotations

import pytest

from eds_server.xds.common import (
    EDS_TYPE_URL,
    Ack,
    Nack,
    ProtocolError,
    StaleNonce,
    SubscriptionLimits,
    response_version,
)
from eds_server.xds.sotw import Request, SotwStream
from tests.support.xds_view import View


def first(*names: str, version: str = "") -> Request:
    return Request(version_info=version, has_node=True, resource_names=names, type_url=EDS_TYPE_URL)


def ack(resp_nonce: str, *names: str, version: str = "", error: str | None = None) -> Request:
    return Request(
        version_info=version,
        resource_names=names,
        response_nonce=resp_nonce,
        type_url=EDS_TYPE_URL,
        error_message=error,
    )


@pytest.fixture
def view() -> View:
    v = View()
    v.set("web", b"web-1")
    return v


def test_first_request_answers_every_name_known_or_not(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web", "nope"))
    r = s.poll()
    assert r is not None
    assert [x.name for x in r.resources] == ["web", "nope"]
    assert r.resources[1].body == b"empty:nope"  # an unknown name still gets a (empty) CLA
    assert r.version_info == response_version(r.resources)
    assert s.poll() is None  # one response in flight at most


def test_first_request_needs_node(view: View) -> None:
    with pytest.raises(ProtocolError) as e:
        SotwStream(view).receive(Request(resource_names=("web",)))
    assert e.value.status == "INVALID_ARGUMENT"


def test_later_requests_may_omit_node_and_type_url(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    events = s.receive(Request(version_info=r.version_info, resource_names=("web",), response_nonce=r.nonce))
    assert events == [Ack(r.version_info, ("web",))]
    assert s.acked == {"web": "web-1"}


@pytest.mark.parametrize(
    "req",
    [
        Request(has_node=True, type_url="type.googleapis.com/envoy.config.cluster.v3.Cluster"),
        Request(has_node=True, resource_names=tuple(f"n{i}" for i in range(11))),
        Request(has_node=True, resource_names=("x" * 101,)),
    ],
)
def test_bad_requests_are_protocol_errors(view: View, req: Request) -> None:
    with pytest.raises(ProtocolError):
        SotwStream(view, SubscriptionLimits(max_names=10, max_name_length=100)).receive(req)


def test_not_ready_sends_nothing_until_ready(view: View) -> None:
    view.ready = False
    s = SotwStream(view)
    s.receive(first("web"))
    assert s.poll() is None
    view.ready = True
    s.changed(None)
    assert s.poll() is not None


def test_changes_while_in_flight_coalesce(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r1 = s.poll()
    assert r1 is not None
    for body in (b"web-2", b"web-3", b"web-4"):
        view.set("web", body)
        s.changed({"web"})
        assert s.poll() is None
    s.receive(ack(r1.nonce, "web", version=r1.version_info))
    r2 = s.poll()
    assert r2 is not None and r2.version_info == "web-4" and r2.nonce != r1.nonce
    assert s.poll() is None


def test_only_subscribed_changes_are_pushed(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    s.receive(ack(r.nonce, "web"))
    view.set("other", b"o-2")
    s.changed({"other"})
    assert s.poll() is None


def test_unchanged_content_is_not_resent(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    s.receive(ack(r.nonce, "web"))
    s.changed({"web"})  # told of a change whose content is the same
    assert s.poll() is None


def test_nack_is_recorded_and_that_version_not_resent(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r1 = s.poll()
    assert r1 is not None
    s.receive(ack(r1.nonce, "web"))
    view.set("web", b"web-bad")
    s.changed({"web"})
    r2 = s.poll()
    assert r2 is not None
    events = s.receive(ack(r2.nonce, "web", version="web-1", error="bad endpoint"))
    assert events == [Nack("web-bad", ("web",), "bad endpoint")]
    assert s.nacked == {"web": "web-bad"} and s.acked == {"web": "web-1"}
    s.changed({"web"})
    assert s.poll() is None  # not sent again
    view.set("web", b"web-good")
    s.changed({"web"})
    r3 = s.poll()
    assert r3 is not None and r3.version_info == "web-good"


def test_stale_nonce_is_ignored(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    assert s.receive(ack("not-" + r.nonce, "web", "api")) == [StaleNonce("not-" + r.nonce)]
    assert list(s.subscribed) == ["web"] and s.in_flight is r


def test_subscription_change_answers_added_and_drops_removed(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web", "api"))
    r1 = s.poll()
    assert r1 is not None
    s.receive(ack(r1.nonce, "web", "api", "new"))
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["new"]
    s.receive(ack(r2.nonce, "new"))
    view.set("web", b"web-2")
    s.changed({"web"})
    assert s.poll() is None  # web is no longer subscribed
    s.receive(ack(r2.nonce, "new", "web"))
    r3 = s.poll()
    assert r3 is not None and [x.name for x in r3.resources] == ["web"]  # re-added: answered


def test_group_appearing_later_is_pushed(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("late"))
    r1 = s.poll()
    assert r1 is not None and r1.resources[0].body == b"empty:late"
    s.receive(ack(r1.nonce, "late"))
    view.set("late", b"late-1")
    s.changed({"late"})
    r2 = s.poll()
    assert r2 is not None and r2.resources[0].body == b"late-1"


def test_reconnect_with_current_version_sends_nothing(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web", version="web-1"))
    assert s.poll() is None
    assert s.acked == {"web": "web-1"}
    view.set("web", b"web-2")
    s.changed({"web"})
    r = s.poll()
    assert r is not None and r.version_info == "web-2"


def test_reconnect_with_old_version_gets_current(view: View) -> None:
    s = SotwStream(view)
    s.receive(first("web", version="web-0"))
    r = s.poll()
    assert r is not None and r.version_info == "web-1"


def test_ack_records_no_version_for_names_dropped_meanwhile(view: View) -> None:
    """Nothing is kept for unsubscribed names, however often a client drops and ACKs."""
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    for i in range(20):  # bounded
        names = tuple(f"n{i}-{j}" for j in range(10))
        s.receive(ack(r.nonce, *names))  # ACK, and a new set of names
        r = s.poll()
        assert r is not None
        assert s.receive(ack("", *())) == [StaleNonce("")]  # "drop all" written before r was seen
    s.receive(ack(r.nonce))  # ACKs r and drops everything
    assert not s.acked and not s.sent and not s.subscribed


def test_empty_nonce_after_a_response_is_stale(view: View) -> None:
    """An empty nonce after a response: the protocol treats it as stale, not as a subscription change."""
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    assert s.receive(ack("", "web", "api")) == [StaleNonce("")]
    assert list(s.subscribed) == ["web"] and s.in_flight is r
    s.receive(ack(r.nonce, "web", "api"))  # the answer to r carries the client's current names
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["api"]


def test_a_name_a_stale_request_dropped_is_sent_again_when_listed_again(view: View) -> None:
    """The client dropped `web` before it saw r, so it ignored `web` in r, although it ACKs r as a
    whole. Listed again, `web` is newly requested: the protocol says the server must resend it."""
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    assert s.receive(ack("", "api")) == [StaleNonce("")]  # drops web; written before r was seen
    assert list(s.subscribed) == ["web"] and s.in_flight is r  # still stale: nothing changes yet
    s.receive(ack(r.nonce, "web", "api", version=r.version_info))
    assert "web" not in s.acked  # it may hold nothing: it ignored the copy in r
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["web", "api"]


def test_regression_resubscribing_after_a_stale_unsubscribe_is_answered(view: View) -> None:
    """Found by unit/test_properties.py::test_sotw_stream_against_a_client_model (the minimal example):
    a one-name stream resumed at the current version, then `a` changed; the client unsubscribed from
    everything before it saw that response (so ignored `a` in it), then ACKed it asking for `a` again.
    Without an answer it never got `a` (nothing else would ever send the version it lacks)."""
    view.ready = False
    s = SotwStream(view)
    s.receive(first("a", version="empty:a"))  # resumes: it holds the current version
    view.ready = True
    s.changed(None)
    assert s.poll() is None  # the reconnect shortcut: nothing to send
    view.set("a", b"a=0")
    s.changed({"a"})
    r1 = s.poll()
    assert r1 is not None and r1.version_info == "a=0"
    assert s.receive(Request(resource_names=())) == [StaleNonce("")]  # drops everything, before seeing r1
    s.receive(ack(r1.nonce, "a", version="a=0"))  # saw r1 (ignored `a`), asks for `a` again, ACKs r1
    r2 = s.poll()
    assert r2 is not None and [(x.name, x.version) for x in r2.resources] == [("a", "a=0")]
    s.receive(ack(r2.nonce, "a", version="a=0"))
    assert s.acked == {"a": "a=0"} and s.poll() is None


def test_a_name_dropped_and_asked_again_before_the_response_was_read(view: View) -> None:
    """Both stale requests came before the client read r (they carry no nonce), so it wanted `web`
    when r arrived: r answered it, and its NACK of r blocks that version as usual (found by the
    property test with more examples). `api` was not in r: the client lost it and gets it again."""
    view.set("api", b"api-1")
    s = SotwStream(view)
    s.receive(first("api"))
    r0 = s.poll()
    assert r0 is not None
    s.receive(ack(r0.nonce, "api", "web"))
    r = s.poll()
    assert r is not None and [x.name for x in r.resources] == ["web"]
    assert s.receive(ack(r0.nonce)) == [StaleNonce(r0.nonce)]  # drops both
    assert s.receive(ack(r0.nonce, "api", "web")) == [StaleNonce(r0.nonce)]  # and asks for both again
    s.receive(ack(r.nonce, "api", "web", error="bad web"))
    assert s.nacked == {"web": "web-1"}
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["api"]  # not the rejected web again


def test_a_bundle_asked_again_before_it_was_read_is_still_sorted_out_one_at_a_time(view: View) -> None:
    """The same for a rejected bundle: each of its resources is resent alone."""
    view.set("api", b"api-1")
    s = SotwStream(view)
    s.receive(first("web", "api"))
    r = s.poll()
    assert r is not None and len(r.resources) == 2
    assert s.receive(ack("")) == [StaleNonce("")]
    assert s.receive(ack("", "web", "api")) == [StaleNonce("")]
    s.receive(ack(r.nonce, "web", "api", error="bad"))
    r2 = s.poll()
    assert r2 is not None and len(r2.resources) == 1


def test_a_stale_request_with_nothing_in_flight_changes_nothing(view: View) -> None:
    """No well-behaved client sends an old nonce once it has answered our latest response: nothing
    is learnt from it, and nothing is sent again."""
    s = SotwStream(view)
    s.receive(first("web"))
    r = s.poll()
    assert r is not None
    s.receive(ack(r.nonce, "web"))
    assert s.receive(ack("old", *())) == [StaleNonce("old")]
    s.receive(ack(r.nonce, "web"))
    assert s.poll() is None and s.acked == {"web": "web-1"}


def test_reconnect_of_a_multi_name_stream_answers_every_name(view: View) -> None:
    """A reconnect is answered in full: the version digest does not say which names the client still holds."""
    view.set("api", b"api-1")
    s = SotwStream(view)
    s.receive(first("web", "api"))
    r1 = s.poll()
    assert r1 is not None
    # the client drops "api" (no response), then reconnects asking for both with r1's version
    s2 = SotwStream(view)
    s2.receive(first("web", "api", version=r1.version_info))
    r2 = s2.poll()
    assert r2 is not None and sorted(x.name for x in r2.resources) == ["api", "web"]


def test_multi_name_streams_never_send_a_bare_resource_version(view: View) -> None:
    """A multi-name stream's version is always a digest, so a resource's own version proves what a
    one-name stream holds."""
    view.set("api", b"api-1")
    s = SotwStream(view)
    s.receive(first("web", "api"))
    r1 = s.poll()
    assert r1 is not None
    s.receive(ack(r1.nonce, "web", "api"))
    view.set("web", b"web-2")
    s.changed({"web"})
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["web"]
    assert r2.version_info != "web-2" and r2.version_info == response_version(r2.resources, digest=True)
    # a client that then drops "api" and reconnects asking for "web" alone gets it
    s2 = SotwStream(view)
    s2.receive(first("web", version=r2.version_info))
    r3 = s2.poll()
    assert r3 is not None and r3.version_info == "web-2"


@pytest.mark.parametrize("names", [("*",), ()])
def test_wildcard_and_empty_first_request_get_an_empty_answer(view: View, names: tuple[str, ...]) -> None:
    """EDS has no wildcard; never a CLA named "*", never a client left waiting."""
    s = SotwStream(view)
    s.receive(first(*names))
    r = s.poll()
    assert r is not None and r.resources == () and not s.subscribed
    s.receive(ack(r.nonce, "*", "web"))
    r2 = s.poll()
    assert r2 is not None and [x.name for x in r2.resources] == ["web"]
    assert list(s.subscribed) == ["web"]


def test_a_rejected_bundle_is_sorted_out_one_resource_at_a_time(view: View) -> None:
    """A NACK of several resources: each is resent alone, and only the good ones again."""
    view.set("api", b"api-1")
    s = SotwStream(view)
    s.receive(first("web", "api"))
    r1 = s.poll()
    assert r1 is not None
    s.receive(ack(r1.nonce, "web", "api", version=r1.version_info, error="one of them is bad"))
    seen = []
    for _ in range(4):  # bounded
        r = s.poll()
        if r is None:
            break
        assert len(r.resources) == 1
        seen.append(r.resources[0].name)
        bad = r.resources[0].name == "api"
        s.receive(ack(r.nonce, "web", "api", error="api is bad" if bad else None))
    assert seen == ["web", "api"]
    assert s.acked == {"web": "web-1"} and s.nacked == {"api": "api-1"}
