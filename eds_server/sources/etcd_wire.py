"""etcd v3's gRPC-JSON gateway, as plain data: the state URL, the key layout, request bodies, replies.

No IO here (etcd_client.py sends these), so every rule is unit-tested without an etcd. The gateway
speaks the v3 protobuf messages as JSON: keys and values base64, int64 fields as decimal strings,
fields at their default value (0, false, empty) left out.

Key layout, under the prefix P of `etcd://HOST:PORT/P`:

    P/registrations/<group, percent-encoded>/<id>  ->  {"group", "id", "endpoint", "ttl"?} (JSON)

A group's keys share one range (the percent-encoding keeps `/` out of it), so "nothing in this
group changed since revision R" is one compare on that range; the key of a registration with a
TTL is attached to its own lease.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

SCHEME = "etcd://"
DEFAULT_PORT = 2379
REGISTRATIONS = "registrations"


class EtcdUrlError(ValueError):
    """An `etcd://` state that cannot be used."""


class EtcdError(Exception):
    """An error answer from etcd (`code` is the gRPC status code, 0 when there was none)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    @property
    def retryable(self) -> bool:
        """Worth trying again, on this or another member: no leader, leader changed, timed out,
        unavailable (gRPC UNAVAILABLE 14, DEADLINE_EXCEEDED 4)."""
        text = self.message.lower()
        return self.code in (4, 14) or any(
            s in text for s in ("leader changed", "no leader", "timed out", "unavailable", "not capable")
        )

    @property
    def not_applied(self) -> bool:
        """Refused before it was proposed (no leader, a member that cannot serve it): a change sent
        again cannot be applied twice. "Timed out" and "leader changed" may still be committed."""
        text = self.message.lower()
        return any(s in text for s in ("no leader", "not capable"))

    @property
    def auth_expired(self) -> bool:
        return "invalid auth token" in self.message.lower()


@dataclass(frozen=True)
class EtcdTarget:
    """Where the state is: the members to try, in order, and the key prefix (no trailing slash)."""

    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    def __str__(self) -> str:
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{SCHEME}{hosts}{self.prefix}"


def is_etcd(state: str | None) -> bool:
    return state is not None and state.startswith(SCHEME)


def parse_target(state: str) -> EtcdTarget:
    """`etcd://HOST:PORT[,HOST:PORT...]/PREFIX` (IPv6 hosts in brackets; port 2379 by default)."""
    if not is_etcd(state):
        raise EtcdUrlError(f"{state!r} is not an etcd:// state")
    rest = state[len(SCHEME) :]
    hosts, slash, prefix = rest.partition("/")
    prefix = "/" + prefix.strip("/")
    if not slash or prefix == "/":
        raise EtcdUrlError(f"{state}: a key prefix is needed, e.g. etcd://127.0.0.1:2379/eds-server")
    if any(c in prefix for c in "?#") or any(ord(c) < 0x20 for c in prefix):
        raise EtcdUrlError(f"{state}: the prefix {prefix!r} may not hold ?, # or control characters")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise EtcdUrlError(f"{state}: an empty member address")
        if part.startswith("["):
            host, _, tail = part[1:].partition("]")
            port_text = tail[1:] if tail.startswith(":") else ""
            if tail and not tail.startswith(":"):
                raise EtcdUrlError(f"{state}: {part!r} is not HOST:PORT")
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise EtcdUrlError(f"{state}: {part!r} has no host")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise EtcdUrlError(f"{state}: {part!r}: the port is not a number") from None
        if not 0 < port < 65536:
            raise EtcdUrlError(f"{state}: {part!r}: the port is out of range")
        endpoints.append((host, port))
    return EtcdTarget(tuple(endpoints), prefix)


# -- keys -------------------------------------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


def range_end(prefix: bytes) -> bytes:
    """The end of the range of every key starting with `prefix` (etcd's `--prefix`)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyLayout:
    prefix: str  # no trailing slash

    @property
    def all(self) -> bytes:
        """Every registration's key starts with this."""
        return f"{self.prefix}/{REGISTRATIONS}/".encode()

    def group(self, group: str) -> bytes:
        """Every key of one group starts with this (and no other group's does)."""
        return self.all + quote(group, safe="").encode() + b"/"

    def key(self, group: str, id: str) -> bytes:
        return self.group(group) + id.encode()

    def parse(self, key: bytes) -> tuple[str, str] | None:
        """(group, id) of a registration key; None for a key of something else under the prefix."""
        if not key.startswith(self.all):
            return None
        try:
            group, slash, id = key[len(self.all) :].decode("utf-8").partition("/")
            if not slash or not group or not id or "/" in id:
                return None
            return unquote(group, errors="strict"), id
        except UnicodeDecodeError:
            return None  # not written by eds-server


# -- requests ---------------------------------------------------------------------------------------
def range_request(
    key: bytes,
    end: bytes | None = None,
    *,
    count_only: bool = False,
    min_mod_revision: int = 0,
    max_mod_revision: int = 0,
    keys_only: bool = False,
    serializable: bool = False,
    limit: int = 0,
) -> dict[str, Any]:
    """A range; etcd applies the mod-revision filters to the keys it returns, not to `count_only`."""
    body: dict[str, Any] = {"key": b64(key)}
    if end is not None:
        body["range_end"] = b64(end)
    if count_only:
        body["count_only"] = True
    if keys_only:
        body["keys_only"] = True
    if min_mod_revision:
        body["min_mod_revision"] = str(min_mod_revision)
    if max_mod_revision:
        body["max_mod_revision"] = str(max_mod_revision)
    if limit:
        body["limit"] = str(limit)
    if serializable:
        body["serializable"] = True
    return body


def unchanged_since(key: bytes, end: bytes, revision: int) -> dict[str, Any]:
    """Compare: no key in [key, end) was written after `revision` (true for an empty range)."""
    return {
        "key": b64(key),
        "range_end": b64(end),
        "target": "MOD",
        "result": "LESS",
        "mod_revision": str(revision + 1),
    }


def held_at(key: bytes, mod_revision: int) -> dict[str, Any]:
    """Compare: the key was last written at `mod_revision`; 0: the key does not exist. (A range
    compare sees only the keys that exist: a delete since does not fail it, this does.)"""
    if not mod_revision:
        return {"key": b64(key), "target": "VERSION", "result": "EQUAL", "version": "0"}
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}


def value_is(key: bytes, value: bytes) -> dict[str, Any]:
    """Compare: the key holds exactly `value` (false for a missing key)."""
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return {"request_put": body}


def delete(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key), "prev_kv": True}}


def get(key: bytes, end: bytes | None = None, *, keys_only: bool = False, min_mod_revision: int = 0) -> dict[str, Any]:
    return {"request_range": range_request(key, end, keys_only=keys_only, min_mod_revision=min_mod_revision)}


def txn(
    compare: list[dict[str, Any]],
    success: list[dict[str, Any]],
    failure: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {"compare": compare, "success": success, "failure": failure or []}


def watch_request(key: bytes, end: bytes, start_revision: int) -> dict[str, Any]:
    return {"create_request": {"key": b64(key), "range_end": b64(end), "start_revision": str(start_revision)}}


# -- replies ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Event:
    deleted: bool
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchMessage:
    revision: int  # the store's revision when this was sent
    events: tuple[Event, ...] = ()
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0  # set: the start revision was compacted away: list again
    reason: str = ""


def _int(value: Any) -> int:
    return int(value) if value not in (None, "") else 0


def error_of(reply: Any) -> EtcdError | None:
    """The error a gateway reply carries (`{"error": ..., "code": N}`), or None."""
    if isinstance(reply, dict) and ("error" in reply or ("code" in reply and "message" in reply)):
        err = reply.get("error")
        message = err.get("message", "") if isinstance(err, dict) else (err or reply.get("message", ""))
        code = err.get("code", 0) if isinstance(err, dict) else reply.get("code", 0)
        return EtcdError(str(message) or "error", _int(code))
    return None


def revision(reply: dict[str, Any]) -> int:
    return _int(reply.get("header", {}).get("revision"))


def key_value(obj: dict[str, Any]) -> KeyValue:
    return KeyValue(
        unb64(obj.get("key", "")),
        unb64(obj.get("value", "")),
        _int(obj.get("mod_revision")),
        _int(obj.get("create_revision")),
        _int(obj.get("lease")),
    )


def kvs(reply: dict[str, Any]) -> list[KeyValue]:
    return [key_value(kv) for kv in reply.get("kvs", ())]


def txn_range(reply: dict[str, Any], index: int = 0) -> list[KeyValue]:
    """The kvs of the `index`th response of a transaction, a range."""
    responses = reply.get("responses", ())
    return kvs(responses[index].get("response_range", {})) if len(responses) > index else []


def txn_deleted(reply: dict[str, Any], index: int = 0) -> list[KeyValue]:
    responses = reply.get("responses", ())
    deleted = responses[index].get("response_delete_range", {}) if len(responses) > index else {}
    return [key_value(kv) for kv in deleted.get("prev_kvs", ())]


def watch_message(line: bytes) -> WatchMessage:
    """One line of the `/v3/watch` stream; raises EtcdError for an error line."""
    obj = json.loads(line)
    err = error_of(obj)
    if err is not None:
        raise err
    result = obj.get("result", {})
    events = tuple(Event(e.get("type") == "DELETE", key_value(e.get("kv", {}))) for e in result.get("events", ()))
    return WatchMessage(
        revision(result),
        events,
        bool(result.get("created")),
        bool(result.get("canceled")),
        _int(result.get("compact_revision")),
        str(result.get("cancel_reason", "")),
    )
