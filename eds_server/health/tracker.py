"""Rise and fall, counted as Envoy and HAProxy count them, and how a result meets a source's health.

Plain data, no IO, no clock: the checker hands in each result.

- A target is healthy after `healthy_threshold` passing checks in a row, unhealthy after
  `unhealthy_threshold` failing ones in a row; a result of the other kind starts the count again.
- A new target (a new endpoint, or every endpoint after eds-server starts) keeps what its source
  says until its checks decide. A first pass makes it healthy at once (Envoy too needs "only a
  single successful health check ... during startup", health_check.proto); failures need
  `unhealthy_threshold` in a row, as for any target. Envoy instead holds a new host out until its
  first pass; here that would flip every endpoint on each restart of eds-server, and a restart
  while the checker is cut off (tracker.CutOff needs two failures to see it) would empty clusters.
- Unlike Envoy, an unexpected HTTP status counts towards `unhealthy_threshold` like any failure
  (Envoy's HTTP checker marks it at once): one slow 500 does not take a backend out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import Health


@dataclass(frozen=True, slots=True)
class Result:
    """One check's outcome. `at` is wall-clock time (for people), `latency` in seconds."""

    ok: bool
    reason: str  # "HTTP 200", "HTTP 500", "connection refused", "timed out after 0.5s"
    latency: float
    at: float
    # Not a check at all: this process was too busy to send it (no TLS handshake slot came within the
    # check's interval). Not counted, either way, as a check whose timeout fired far too late.
    starved: bool = False


class Tracker:
    """One target's counts and its checked health (None until its first result)."""

    __slots__ = ("failures", "healthy", "last", "successes")

    def __init__(self) -> None:
        self.healthy: bool | None = None
        self.successes = 0
        self.failures = 0
        self.last: Result | None = None

    def record(self, result: Result, healthy_threshold: int, unhealthy_threshold: int) -> bool:
        """Count `result`; True if the checked health changed."""
        self.last = result
        if result.ok:
            self.successes, self.failures = self.successes + 1, 0
        else:
            self.successes, self.failures = 0, self.failures + 1
        before = self.healthy
        if before is None:
            self.healthy = True if result.ok else (False if self.failures >= unhealthy_threshold else None)
        elif before and self.failures >= unhealthy_threshold:
            self.healthy = False
        elif not before and self.successes >= healthy_threshold:
            self.healthy = True
        return self.healthy != before


def combine(source: Health, checked: bool | None) -> Health:
    """The health sent to Envoy: the worse of the source's and the check's; draining stays draining.

    A pass turns UNKNOWN into HEALTHY (Envoy treats both alike; the admin shows what is known) and
    leaves anything worse as the source says it."""
    if checked is None or source == Health.DRAINING:
        return source
    if not checked:
        return source if source in (Health.UNHEALTHY, Health.TIMEOUT) else Health.UNHEALTHY
    return Health.HEALTHY if source == Health.UNKNOWN else source


class CutOff:
    """Is the checker itself cut off? Every target with a result failing its latest check at once
    (at least two of them: one target failing says nothing of the checker) is the checker's fault,
    not the backends': its network, its loop. While it holds, checked health is frozen.

    With `unhealthy_threshold` >= 2 the freeze comes before any flip: a target needs two failures in
    a row, and by its second every other target has been checked (and failed) once since its first."""

    __slots__ = ("_failing", "_known")

    def __init__(self) -> None:
        self._known: set[object] = set()
        self._failing: set[object] = set()

    def record(self, key: object, ok: bool) -> None:
        self._known.add(key)
        if ok:
            self._failing.discard(key)
        else:
            self._failing.add(key)

    def forget(self, key: object) -> None:
        self._known.discard(key)
        self._failing.discard(key)

    @property
    def cut_off(self) -> bool:
        return len(self._known) >= 2 and len(self._failing) == len(self._known)

    @property
    def counts(self) -> tuple[int, int]:
        """(failing, with a result)"""
        return len(self._failing), len(self._known)
