"""The etcd mapping without an etcd: state URLs, key layout, request bodies, replies, conflict checks."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys

import pytest

from eds_server.model import Endpoint
from eds_server.sources import etcd_wire as wire
from eds_server.sources.etcd_kv import decode, encode
from eds_server.sources.etcd_leases import lease_ttl
from eds_server.sources.registrations import (
    Registration,
    RegistrationError,
    State,
    check_address,
    check_limits,
    check_put,
    check_weights,
)
from eds_server.sources.registrations_etcd import Turns


def b(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# -- the state URL ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "endpoints", "prefix"),
    [
        ("etcd://127.0.0.1:2379/eds", (("127.0.0.1", 2379),), "/eds"),
        ("etcd://a:1,b:2,c/eds/prod/", (("a", 1), ("b", 2), ("c", 2379)), "/eds/prod"),
        ("etcd://[::1]:2379,[fd00::2]/x", (("::1", 2379), ("fd00::2", 2379)), "/x"),
    ],
)
def test_state_urls(url: str, endpoints: tuple[tuple[str, int], ...], prefix: str) -> None:
    target = wire.parse_target(url)
    assert target.endpoints == endpoints and target.prefix == prefix
    assert wire.parse_target(str(target)) == target


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("etcd://127.0.0.1:2379", "a key prefix is needed"),
        ("etcd://127.0.0.1:2379/", "a key prefix is needed"),
        ("etcd://127.0.0.1:x/eds", "the port is not a number"),
        ("etcd://127.0.0.1:70000/eds", "out of range"),
        ("etcd://a:1,,b:2/eds", "an empty member address"),
        ("etcd://:2379/eds", "has no host"),
        ("etcd://h/eds?x=1", "may not hold"),
    ],
)
def test_bad_state_urls(url: str, message: str) -> None:
    with pytest.raises(wire.EtcdUrlError, match=message):
        wire.parse_target(url)


def test_a_file_path_is_not_etcd() -> None:
    assert not wire.is_etcd("/var/lib/eds/state.json") and not wire.is_etcd(None)
    assert wire.is_etcd("etcd://h:1/p")


# -- keys -------------------------------------------------------------------------------------------
def test_key_layout_keeps_each_group_in_its_own_range() -> None:
    keys = wire.KeyLayout("/eds")
    assert keys.key("web", "a") == b"/eds/registrations/web/a"
    # a group name may hold `/` and any printable character: percent-encoded, its range is its own
    assert keys.key("a/b", "x") == b"/eds/registrations/a%2Fb/x"
    assert keys.parse(keys.key("a/b", "x")) == ("a/b", "x")
    assert keys.parse(keys.key("wéb ☃", "id:1")) == ("wéb ☃", "id:1")
    start, end = keys.group("web"), wire.range_end(keys.group("web"))
    assert start <= keys.key("web", "zzz") < end
    assert not start <= keys.key("web2", "a") < end  # "web" does not hold "web2"
    assert not start <= keys.key("web/x", "a") < end
    assert keys.parse(b"/eds/other/web/a") is None and keys.parse(b"/eds/registrations/web") is None
    assert keys.parse(b"/eds/registrations/%ff/a") is None and keys.parse(b"/eds/registrations/\xff/a") is None


def test_range_end_is_etcds_prefix_end() -> None:
    assert wire.range_end(b"/a/") == b"/a0"
    assert wire.range_end(b"a\xff") == b"b"
    assert wire.range_end(b"\xff\xff") == b"\0"


# -- requests ---------------------------------------------------------------------------------------
def test_a_put_compares_the_whole_group_against_the_revision_it_was_checked_at() -> None:
    keys = wire.KeyLayout("/eds")
    group = keys.group("web")
    compare = wire.unchanged_since(group, wire.range_end(group), 41)
    body = wire.txn([compare], [wire.put(keys.key("web", "a"), b"{}", 7)])
    assert body == {
        "compare": [
            {
                "key": b("/eds/registrations/web/"),
                "range_end": b("/eds/registrations/web0"),
                "target": "MOD",
                "result": "LESS",
                "mod_revision": "42",
            }
        ],
        "success": [{"request_put": {"key": b("/eds/registrations/web/a"), "value": b("{}"), "lease": "7"}}],
        "failure": [],
    }
    assert wire.put(b"k", b"v") == {"request_put": {"key": b("k"), "value": b("v")}}  # no lease: none sent
    assert wire.txn([wire.held_at(b"k", 9)], [wire.delete(b"k")])["success"] == [
        {"request_delete_range": {"key": b("k"), "prev_kv": True}}
    ]
    assert wire.watch_request(b"/p/", b"/p0", 10) == {
        "create_request": {"key": b("/p/"), "range_end": b("/p0"), "start_revision": "10"}
    }


def test_a_renewal_compares_the_value_and_reads_the_lease_the_key_is_on_now() -> None:
    body = wire.txn([wire.value_is(b"k", b"v")], [wire.get(b"k")])
    assert body["compare"] == [{"key": b("k"), "target": "VALUE", "result": "EQUAL", "value": b("v")}]
    assert body["success"] == [{"request_range": {"key": b("k")}}]


def test_a_write_compares_the_key_as_the_view_holds_it() -> None:
    # a range compare sees only keys that exist: that a key was deleted since is compared on the key
    assert wire.held_at(b"k", 0) == {"key": b("k"), "target": "VERSION", "result": "EQUAL", "version": "0"}
    assert wire.held_at(b"k", 17) == {"key": b("k"), "target": "MOD", "result": "EQUAL", "mod_revision": "17"}


def test_the_probe_asks_for_one_key_in_a_revision_window_not_a_count() -> None:
    # etcd filters by mod revision only the keys it returns: a count would ignore the window
    body = wire.range_request(b"/p/", b"/p0", keys_only=True, limit=1, min_mod_revision=8, max_mod_revision=20)
    assert body == {
        "key": b("/p/"),
        "range_end": b("/p0"),
        "keys_only": True,
        "min_mod_revision": "8",
        "max_mod_revision": "20",
        "limit": "1",
    }


# -- replies ----------------------------------------------------------------------------------------
def test_replies_with_defaults_left_out() -> None:
    reply = {
        "header": {"revision": "12"},
        "kvs": [
            {
                "key": b("/k"),
                "create_revision": "3",
                "mod_revision": "12",
                "version": "2",
                "value": b("v"),
                "lease": "9",
            },
            {"key": b("/e"), "create_revision": "4", "mod_revision": "4", "version": "1"},  # empty value, no lease
        ],
        "count": "2",
    }
    assert wire.revision(reply) == 12
    assert wire.kvs(reply) == [wire.KeyValue(b"/k", b"v", 12, 3, 9), wire.KeyValue(b"/e", b"", 4, 4, 0)]
    assert wire.kvs({"header": {"revision": "1"}}) == []
    deleted = {
        "succeeded": True,
        "responses": [
            {
                "response_delete_range": {
                    "deleted": "1",
                    "prev_kvs": [{"key": b("/k"), "mod_revision": "5", "value": b("v")}],
                }
            }
        ],
    }
    assert wire.txn_deleted(deleted) == [wire.KeyValue(b"/k", b"v", 5, 0, 0)]


def test_errors_in_both_gateway_shapes() -> None:
    e = wire.error_of({"error": "etcdserver: leader changed", "message": "etcdserver: leader changed", "code": 14})
    assert e is not None and e.code == 14 and e.retryable
    e = wire.error_of(
        {"error": {"grpc_code": 3, "http_code": 400, "message": "etcdserver: invalid auth token", "code": 3}}
    )
    assert e is not None and e.auth_expired and not e.retryable
    e = wire.error_of({"code": 7, "message": "etcdserver: permission denied"})
    assert e is not None and not e.retryable and e.message == "etcdserver: permission denied"
    assert wire.error_of({"header": {}}) is None


def test_watch_messages() -> None:
    created = wire.watch_message(b'{"result":{"header":{"revision":"5"},"created":true}}')
    assert created.created and created.revision == 5 and not created.events
    line = json.dumps(
        {
            "result": {
                "header": {"revision": "8"},
                "events": [
                    {"kv": {"key": b("/a"), "mod_revision": "7", "create_revision": "7", "value": b("x")}},
                    {"type": "DELETE", "kv": {"key": b("/b"), "mod_revision": "8"}},
                ],
            }
        }
    ).encode()
    message = wire.watch_message(line)
    assert [(e.deleted, e.kv.key) for e in message.events] == [(False, b"/a"), (True, b"/b")]
    compacted = wire.watch_message(b'{"result":{"header":{"revision":"90"},"canceled":true,"compact_revision":"50"}}')
    assert compacted.canceled and compacted.compact_revision == 50
    with pytest.raises(wire.EtcdError, match="permission denied"):
        wire.watch_message(b'{"error":{"grpc_code":7,"message":"etcdserver: permission denied"}}')


# -- values and leases ------------------------------------------------------------------------------
def test_values_round_trip_and_bad_ones_are_refused() -> None:
    ep = Endpoint.from_fields({"address": "10.0.0.1", "port": 80, "weight": 3, "zone": "z"})
    value = encode("web", "a", ep, 10.0)
    assert decode(("web", "a"), value) == (ep, 10.0)
    assert decode(("web", "b"), encode("web", "b", ep, None)) == (ep, None)
    for bad, message in [
        (encode("web", "a", ep, None), "not those of its key"),  # under another key
        (b'{"group":"web","id":"b","endpoint":{"address":"10.0.0.1","port":0}}', "endpoint.port"),
        (b'{"group":"web","id":"b","endpoint":{"address":"10.0.0.1","port":1},"x":1}', "not a registration"),
        (b'{"group":"web","id":"b","endpoint":{"address":"10.0.0.1","port":1},"ttl":NaN}', "NaN"),
    ]:
        with pytest.raises(ValueError, match=message):
            decode(("web", "b"), bad)


def test_leases_are_whole_seconds_rounded_up() -> None:
    assert [lease_ttl(t) for t in (0.3, 1, 1.01, 10, 86400)] == [1, 1, 2, 10, 86400]


# -- the conflict rules, as both stores apply them --------------------------------------------------
def reg(group: str, id: str, port: int, weight: int | None = None, priority: int = 0) -> Registration:
    fields = {"address": "10.0.0.1", "port": port, "priority": priority, **({"weight": weight} if weight else {})}
    ep = Endpoint.from_fields(fields)
    return Registration(group, id, ep, None, line=encode(group, id, ep, None))


def test_one_id_per_address_in_a_group() -> None:
    state = State()
    state.add(reg("web", "a", 80))
    check_address(state, reg("web", "a", 80))  # itself again
    check_address(state, reg("api", "b", 80))  # another group
    with pytest.raises(RegistrationError, match="already registered in group 'web' as 'a'") as e:
        check_address(state, reg("web", "b", 80))
    assert e.value.status == 409 and e.value.field == "address"


def test_weights_of_one_priority_must_fit_envoys_limit() -> None:
    state = State()
    state.add(reg("web", "a", 1, weight=4_000_000_000))
    check_weights(state, reg("web", "b", 2, weight=294_967_295))  # exactly the limit
    check_weights(state, reg("web", "b", 2, weight=1_000_000_000, priority=1))  # another priority
    check_weights(state, reg("web", "a", 1, weight=4_294_967_295))  # replacing itself
    with pytest.raises(RegistrationError, match="over Envoy's limit") as e:
        check_weights(state, reg("web", "b", 2, weight=294_967_296))
    assert e.value.status == 409 and e.value.field == "weight"


def test_count_and_size_limits() -> None:
    state = State()
    state.add(reg("web", "a", 1))
    check_limits(state, reg("web", "a", 2), 1, 10_000)  # a replacement is not one more
    with pytest.raises(RegistrationError, match=r"registration limit reached \(1\)"):
        check_limits(state, reg("web", "b", 2), 1, 10_000)
    with pytest.raises(RegistrationError, match="state size"):
        check_put(state, reg("web", "b", 2), 10, state.size + 10)


async def test_turns_serialize_one_key_and_forget_it_after() -> None:
    turns = Turns()
    inside: list[str] = []
    most = 0

    async def one(key: str) -> None:
        nonlocal most
        async with turns.take(key):
            inside.append(key)
            most = max(most, inside.count("g"))
            for _ in range(3):  # a few turns of the loop: every other task tries to enter meanwhile
                await asyncio.sleep(0)
            inside.remove(key)

    await asyncio.gather(*(one("g") for _ in range(5)), one("h"))
    assert most == 1 and len(turns) == 0


# -- the command line -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--state", "etcd://127.0.0.1:2379"], "a key prefix is needed"),
        (["--state", "etcd://127.0.0.1:2379/eds", "--etcd-user", "eds"], "--etcd-user needs a password"),
        (["--state", "/tmp/state.json", "--etcd-ca", "/tmp/ca.pem"], "--etcd-ca needs --state etcd://"),
        (["--state", "etcd://h:1/eds", "--etcd-ca", "/nonexistent/ca.pem"], "--etcd-ca /nonexistent/ca.pem: no such"),
        (["--state", "etcd://h:1/eds", "--etcd-cert", "/nonexistent/c.pem"], "--etcd-cert /nonexistent/c.pem: no such"),
    ],
)
def test_etcd_settings_refused_in_one_line(args: list[str], message: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eds_server",
            "serve",
            "--admin-token",
            "x" * 16,
            "--listen",
            "127.0.0.1:0",
            "--admin",
            "127.0.0.1:0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and message in errors[0], out.stderr


def test_the_etcd_source_is_imported_only_when_configured() -> None:
    parts = ("registrations_etcd", "etcd_kv", "etcd_view", "etcd_follow", "etcd_leases")
    code = (
        "import sys, eds_server.cli, eds_server.app; "
        f"print([m for m in {parts!r} if 'eds_server.sources.' + m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "[]", out.stderr
