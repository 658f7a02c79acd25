"""Ready, degraded or not ready: the one answer the status page, `/readyz` and `eds_state` share.

Ready alone hides a broken source: once every source has loaded, a file with a syntax error or an
unreachable Docker engine leaves the last good state served (fail static), so readiness must not
flap, but an operator must see that changes from that source no longer reach Envoy. Derived only
from what each source says of itself (`SourceStatus`), in one pure function, so the three views
cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

READY, DEGRADED, NOT_READY = "ready", "degraded", "not ready"
STATE_VALUES = {NOT_READY: 0, READY: 1, DEGRADED: 2}  # eds_state: 0 not ready, 1 ready, 2 degraded


@dataclass(frozen=True)
class Degraded:
    """A loaded source whose last state is served while it fails."""

    source: str
    reason: str

    def describe(self) -> str:
        return f"serving the last good state of {self.source} because {self.reason}"


@dataclass(frozen=True)
class ServingState:
    ready: bool
    pending: tuple[str, ...]  # sources not loaded yet (the server may be ready anyway: --startup-timeout)
    degraded: tuple[Degraded, ...]

    @property
    def name(self) -> str:
        if not self.ready:
            return NOT_READY
        return DEGRADED if self.degraded else READY

    @property
    def value(self) -> int:
        return STATE_VALUES[self.name]

    def describe(self, public: bool = False) -> str:
        """One line for a person: 'ready', 'not ready: waiting for ...', 'degraded: serving ...'.
        `public` (the --metrics-listen port): the kinds of source alone, no path, address or error
        (which may quote the file), and where to read the rest."""
        kind = source_kind if public else str
        if not self.ready:
            return f"{NOT_READY}: waiting for {', '.join(map(kind, self.pending)) or 'sources'}"
        if self.degraded and public:
            which = ", ".join(kind(d.source) for d in self.degraded)
            return f"{DEGRADED}: serving the last good state of {which} (why: /readyz or the status page on --admin)"
        if self.degraded:
            return f"{DEGRADED}: " + "; ".join(d.describe() for d in self.degraded)
        return READY


def source_kind(name: str) -> str:
    """A source's kind, without the path or address after it: `file:/etc/x.yaml` -> `file`."""
    return name.split(":", 1)[0]


def serving_state(ready: bool, sources: Iterable[Mapping[str, Any]]) -> ServingState:
    """`ready`: the store's (every source loaded, or the start-up timeout passed); `sources`: each
    source's `SourceStatus.as_json()`. A loaded source is degraded when it is stale (not followed)
    or its last load or connection failed; one not loaded yet is pending, never degraded."""
    pending: list[str] = []
    degraded: list[Degraded] = []
    for s in sources:
        name = str(s["name"])
        if not s.get("loaded"):
            pending.append(name)
            continue
        error = s.get("last_error")
        if error or s.get("stale"):
            degraded.append(Degraded(name, str(error) if error else "it is no longer followed"))
    return ServingState(ready, tuple(pending), tuple(degraded))
