"""What to check, validated: the `health_check:` of an upstreams group, or `eds.health.*` labels.

Plain data, no IO. Every check raises ValueError with a message that reads well after
"<where>: <field>: ", as fields.py does, so the file names its line and a label its name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Kind = Literal["http", "tcp", "grpc"]
KINDS = ("http", "tcp", "grpc", "none")
KEYS = (*KINDS, "port", "interval", "timeout", "healthy_threshold", "unhealthy_threshold", "expected_statuses", "tls")
MAX_THRESHOLD = 100
MIN_INTERVAL, MAX_INTERVAL = 0.1, 3600.0
MAX_PATH = 1024
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m)?")
_PATH = re.compile(r"/[\x21-\x7e]*")  # printable ASCII, no spaces: it goes on the request line as written
_SERVICE = re.compile(r"[\x20-\x7e]{0,127}")


@dataclass(frozen=True, slots=True)
class HealthSpec:
    """One kind of check with its timing. Defaults are HAProxy's rise 2 / fall 3; interval 5 s."""

    kind: Kind
    path: str = "/"  # http: the request path, sent to the endpoint's own address
    service: str = ""  # grpc: grpc.health.v1 service name ("" = the server as a whole)
    port: int | None = None  # None: the endpoint's own port
    interval: float = 5.0
    timeout: float = 1.0
    healthy_threshold: int = 2
    unhealthy_threshold: int = 3
    expected_statuses: tuple[tuple[int, int], ...] = ((200, 299),)  # inclusive ranges (http)
    tls: bool = False  # http, grpc: over TLS, the certificate not verified (liveness, not identity)
    # Hashed once: a spec is part of every target's key, looked up several times per check; the
    # generated __hash__ built and hashed a tuple of all ten fields each time.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (and copied) as its fields: the hash is made again where it is loaded (a string's
        hash differs from one process to the next)."""
        return (type(self), tuple(getattr(self, f.name) for f in fields(self) if f.init))

    def expects(self, status: int) -> bool:
        return any(lo <= status <= hi for lo, hi in self.expected_statuses)

    def describe(self) -> str:
        what = {
            "http": f"{'https' if self.tls else 'http'} {self.path}",
            "tcp": "tcp",
            "grpc": f"grpc{' tls' if self.tls else ''} {self.service or '(server)'}",
        }[self.kind]
        return f"{what} every {self.interval:g}s"


def duration(value: Any) -> float:
    """`1s`, `500ms`, `2m`, or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration (write 1s, 500ms or 2m)")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.fullmatch(value.strip())):
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    else:
        raise ValueError(f"{value!r} is not a duration (write 1s, 500ms or 2m)")
    if not MIN_INTERVAL / 10 <= seconds <= MAX_INTERVAL:
        raise ValueError(f"{value!r} is out of range (10ms to 1h)")
    return seconds


def _whole(value: Any, lo: int, hi: int, what: str) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{value!r} is not {what} ({lo}-{hi})")
    return value


def threshold(value: Any) -> int:
    return _whole(value, 1, MAX_THRESHOLD, "a count of checks in a row")


def port(value: Any) -> int:
    return _whole(value, 1, 65535, "a port")


def path(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_PATH or not _PATH.fullmatch(value):
        hint = f" (write /{value})" if isinstance(value, str) and value and not value.startswith("/") else ""
        raise ValueError(f"{value!r} is not a request path: it starts with / and has no spaces{hint}")
    return value


def flag(value: Any) -> bool:
    if value is True or value in ("true", "yes", "1"):
        return True
    raise ValueError(f"{value!r}: write true (or leave the key out)")


def grpc_service(value: Any) -> str:
    """`grpc: true` (the server as a whole), `grpc: NAME`, or `grpc: {service: NAME}`."""
    if value is True or value in ("true", ""):
        return ""
    if isinstance(value, Mapping):
        if set(value) - {"service"}:
            raise ValueError(f"unknown keys {sorted(set(value) - {'service'})} (expected: service)")
        value = value.get("service", "")
    if not isinstance(value, str) or not _SERVICE.fullmatch(value):
        raise ValueError(f"{value!r} is not a gRPC service name")
    return value


def statuses(value: Any) -> tuple[tuple[int, int], ...]:
    """`[200, 204]`, `200-299`, or a comma-separated text of either (labels)."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    out: list[tuple[int, int]] = []
    for item in items:
        text = str(item).strip()
        lo, _, hi = text.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(f"{item!r} is not an HTTP status or range (write 200 or 200-299)") from None
        if isinstance(item, bool) or not 100 <= a <= b <= 599:
            raise ValueError(f"{item!r} is not an HTTP status or range within 100-599")
        out.append((a, b))
    if not out:
        raise ValueError("empty: write at least one status (e.g. 200-299)")
    return tuple(out)


CHECKS: dict[str, Callable[[Any], Any]] = {
    "http": path,
    "tcp": flag,
    "grpc": grpc_service,
    "none": flag,
    "port": port,
    "interval": duration,
    "timeout": duration,
    "healthy_threshold": threshold,
    "unhealthy_threshold": threshold,
    "expected_statuses": statuses,
    "tls": flag,
}


class SpecError(ValueError):
    """A problem with one field (`field`) of a health check."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_field(key: str, value: Any) -> Any:
    """One field's checked value; SpecError names an unknown key and how to write a known one."""
    check = CHECKS.get(key)
    if check is None:
        raise SpecError(key, f"unknown key (expected one of: {', '.join(KEYS)})")
    try:
        return check(value)
    except ValueError as e:
        raise SpecError(key, str(e)) from None


def build(values: Mapping[str, Any]) -> HealthSpec | None:
    """Checked fields -> a spec (None for `none: true`); SpecError for what does not fit together."""
    kinds = [k for k in values if k in KINDS]  # as written: a second one is named where it stands
    if len(kinds) != 1:
        field = kinds[1] if len(kinds) > 1 else "http"
        raise SpecError(
            field,
            "exactly one kind: http: /PATH, tcp: true, grpc: SERVICE or none: true"
            + (f" (got {', '.join(kinds)})" if kinds else ""),
        )
    kind = kinds[0]
    if kind == "none":
        return None
    spec = HealthSpec(
        kind=kind,  # type: ignore[arg-type]
        path=values["http"] if kind == "http" else "/",
        service=values["grpc"] if kind == "grpc" else "",
        port=values.get("port"),
        interval=values.get("interval", 5.0),
        timeout=values.get("timeout", min(1.0, values.get("interval", 5.0))),
        healthy_threshold=values.get("healthy_threshold", 2),
        unhealthy_threshold=values.get("unhealthy_threshold", 3),
        expected_statuses=values.get("expected_statuses", ((200, 299),)),
        tls=values.get("tls", False),
    )
    if spec.interval < MIN_INTERVAL:
        raise SpecError("interval", f"{spec.interval:g}s is too short (at least {MIN_INTERVAL:g}s)")
    if spec.timeout > spec.interval:
        raise SpecError("timeout", f"{spec.timeout:g}s is longer than the interval ({spec.interval:g}s)")
    if "expected_statuses" in values and kind != "http":
        raise SpecError("expected_statuses", "only for http checks")
    if "tls" in values and kind == "tcp":
        raise SpecError("tls", "only for http and grpc checks")
    return spec


def to_json(spec: HealthSpec) -> dict[str, Any]:
    """The JSON form `parse` reads back (registrations, their state file, /v1/groups)."""
    kind: Any = {"http": spec.path, "tcp": True, "grpc": spec.service or True}[spec.kind]
    out: dict[str, Any] = {
        spec.kind: kind,
        "interval": spec.interval,
        "timeout": spec.timeout,
        "healthy_threshold": spec.healthy_threshold,
        "unhealthy_threshold": spec.unhealthy_threshold,
    }
    if spec.port is not None:
        out["port"] = spec.port
    if spec.tls:
        out["tls"] = True
    if spec.kind == "http":
        out["expected_statuses"] = [f"{lo}-{hi}" if lo != hi else lo for lo, hi in spec.expected_statuses]
    return out


def parse(raw: Mapping[str, Any]) -> HealthSpec | None:
    """A whole mapping (e.g. from labels: `{"http": "/health", "interval": "1s"}`)."""
    return build({key: check_field(key, value) for key, value in raw.items()})
