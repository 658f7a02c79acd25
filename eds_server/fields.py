"""Checks for single endpoint fields, shared by every source (file, container labels, ...).

Each takes the raw value and returns the checked one or raises ValueError with a message that reads
well after "<where>: <field>: ".
"""

from __future__ import annotations

import ipaddress
from typing import Any

from .model import Health

UINT32_MAX = 2**32 - 1
HEALTH_NAMES = {h.name.lower(): h for h in Health}


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{value!r} is not {what}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not {what}") from None


def ip(value: Any) -> str:
    """An IP literal, normalised (Envoy resolves nothing in EDS: a hostname would be rejected)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{value!r} is not an IP address")
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
    raise ValueError(f"{value!r} is not a health status (one of {', '.join(HEALTH_NAMES)})")


def text(value: Any, what: str = "a string") -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{value!r} is not {what}")
    return str(value)


def host_port(value: str) -> tuple[str, int]:
    """`10.0.0.5:8080` or `[2001:db8::1]:8080`."""
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
