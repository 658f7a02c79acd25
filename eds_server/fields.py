"""Checks for single endpoint fields, shared by every source (file, container labels, ...).

Each takes the raw value and returns the checked one or raises ValueError with a message that reads
well after "<where>: <field>: ".
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import Any

from .model import Health


def counted(n: int, noun: str) -> str:
    """`1 group`, `2 groups`, `0 groups`: log lines and answers read as English."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


UINT32_MAX = 2**32 - 1
MAX_METADATA_DEPTH = 20  # Envoy parses protobuf with a nesting limit; a Struct level is two messages
HEALTH_NAMES = {h.name.lower(): h for h in Health}
_DECIMAL = re.compile(r"0|[1-9][0-9]*")
MAX_NAME_LENGTH = 1024  # a group's name, in the upstreams file and the registration API
# --max-upstreams-size: ~80,000 one-line endpoints; parsing peaks ~65 MB per MB. Here, not in
# upstreams.py, so the command line can show it without importing YAML.
MAX_UPSTREAMS_SIZE = 4 * 1024 * 1024


def show(value: Any) -> str:
    """A value as the file or the JSON that held it spells it: `null`, `true`, not Python's None, True."""
    if value is None:
        return "null (an empty value)"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _int(value: Any, what: str) -> int:
    """A whole number, or one written in decimal as text (container labels and annotations are
    text). `" 80"`, `"+80"`, `"8_0"` and `"080"` are refused: Python's int() would take them, and
    a leading zero reads as octal elsewhere (YAML 1.1 `0120` is 80)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{show(value)} is not {what}")
    if isinstance(value, str):
        if not _DECIMAL.fullmatch(value):
            hint = ": write it without leading zeros" if value.isdigit() else ""
            raise ValueError(f"{show(value)} is not {what}{hint}")
        return int(value)
    return value


def ip(value: Any) -> str:
    """An IP literal, normalised (Envoy resolves nothing in EDS: a hostname would be rejected)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{show(value)} is not an IP address")
    text = value[1:-1] if value.startswith("[") and value.endswith("]") else value
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise ValueError(
            f"{value!r} is not an IP address (EDS needs IP literals; Envoy does not resolve names here)"
        ) from None


def port(value: Any) -> int:
    n = _int(value, "a port (1-65535)")
    if not 1 <= n <= 65535:
        raise ValueError(f"{value!r} is not a port (1-65535)")
    return n


def weight(value: Any) -> int:
    n = _int(value, f"a weight (1-{UINT32_MAX})")
    if not 1 <= n <= UINT32_MAX:
        raise ValueError(f"{value!r} is not a weight (1-{UINT32_MAX}; Envoy rejects 0)")
    return n


def priority(value: Any) -> int:
    n = _int(value, "a priority (0-128)")
    if not 0 <= n <= 128:  # the bound in Envoy's endpoint_components.proto
        raise ValueError(f"{value!r} is not a priority (0-128)")
    return n


def health(value: Any) -> Health:
    if isinstance(value, str) and value.lower() in HEALTH_NAMES:
        return HEALTH_NAMES[value.lower()]
    raise ValueError(f"{show(value)} is not a health status (one of {', '.join(HEALTH_NAMES)})")


def is_unicode(text: str) -> bool:
    """Encodable as UTF-8 (a lone surrogate, which JSON and YAML escapes can spell, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text(value: Any, what: str = "a string") -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float) or not is_unicode(str(value)):
        raise ValueError(f"{show(value)} is not {what}")
    return str(value)


def host_port(value: str) -> tuple[str, int]:
    """`10.0.0.5:8080` or `[2001:db8::1]:8080`."""
    if value != "".join(value.split()):
        raise ValueError(f"{value!r} is not ADDRESS:PORT (no spaces: {''.join(value.split())!r})")
    if value.startswith("["):
        host, sep, rest = value[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"{value!r} is not ADDRESS:PORT ([v6]:PORT for IPv6)")
        port_text = rest[1:]
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"{value!r} is not ADDRESS:PORT ([v6]:PORT for IPv6)")
    return ip(host), port(port_text)


def address_port(address: str, port: int) -> str:
    """What `host_port` reads: `10.0.0.5:8080`, `[2001:db8::1]:8080`."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _first_bad(value: Any) -> Any:
    """The first value a protobuf Struct cannot hold (or a non-finite number), or None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, str):
        return None if is_unicode(value) else value
    if isinstance(value, int | float):  # a Struct holds numbers as doubles
        try:
            return None if math.isfinite(float(value)) else value
        except OverflowError:
            return value
    if isinstance(value, list):
        return next((b for b in map(_first_bad, value) if b is not None), None)
    if isinstance(value, dict):
        for k, v in value.items():
            bad = k if not isinstance(k, str) or not is_unicode(k) else _first_bad(v)
            if bad is not None:
                return bad
        return None
    return value


def _depth(value: Any) -> int:
    """Nesting depth, without recursion: a 64 KiB JSON body can nest deep."""
    depth = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:  # bounded: every value is visited once
        v, level = stack.pop()
        if isinstance(v, dict | list):
            depth = max(depth, level + 1)
            stack.extend((c, level + 1) for c in (v.values() if isinstance(v, dict) else v))
    return depth


def metadata(value: Any) -> dict[str, Any]:
    """filter_metadata["envoy.lb"]: a mapping of JSON values, as a protobuf Struct can carry."""
    if not isinstance(value, dict):
        raise ValueError(f"{show(value)} is not a mapping")
    if _depth(value) > MAX_METADATA_DEPTH:
        raise ValueError(f"nested more than {MAX_METADATA_DEPTH} levels deep")
    bad = _first_bad(value)
    if bad is not None:
        raise ValueError(
            f"{show(bad)} cannot be carried in metadata "
            "(strings, finite numbers, booleans, null, lists and mappings only)"
        )
    return dict(value)


# Every endpoint field and its check, as the upstreams file and the registration API spell them.
ENDPOINT_CHECKS: dict[str, Callable[[Any], Any]] = {
    "address": ip,
    "port": port,
    "weight": weight,
    "health": health,
    "priority": priority,
    "region": text,
    "zone": text,
    "subzone": text,
    "hostname": text,
    "metadata": metadata,
}
ENDPOINT_KEYS = tuple(ENDPOINT_CHECKS)
