"""The sources' groups merged into the groups to serve: declaration order, readiness, staleness and
conflicts (a merge Envoy would reject keeps the last good version).

Holds what each source last gave, not the encodings (`encoded.py`) nor who listens
(`subscriptions.py`): `Store` asks `served` what a name's group now is and encodes it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Set

from . import envoy_checks
from .encoded import Resource
from .model import Group, merge_groups

log = logging.getLogger(__name__)

# Laid over each merged group before it is checked and encoded (the health checker's results).
Overlay = Callable[[Group], Group]

RELAYED = Group("")  # a relay source's entry for a name: its group is the resource's own
KEPT = Group("")  # what `served` returns when what is served stays as it is (compared by identity)


class SourceMerge:
    """Each declared source's last groups, merged first declared first (the first one's endpoint
    wins on a duplicate address), and what keeps a merge from being served."""

    def __init__(self) -> None:
        self._by_source: dict[str, dict[str, Group]] = {}  # in declaration order: the merge order
        self._order: list[str] = []  # every declared source, in declaration order
        self._pending: list[str] = []  # sources that have not delivered their first state
        self._forced_ready = False
        self.ready = True  # every declared source delivered, or forced (kept as a field: streams read it)
        self._stale: set[str] = set()  # sources that cannot currently reach what they follow
        self._conflicts: dict[str, str] = {}  # group -> why its merged state is not served
        self.overlay: Overlay | None = None  # health checks' results over the sources' health

    # -- sources -------------------------------------------------------------------------------
    def add_source(self, name: str) -> None:
        """Declare a source; not ready until each declared source has delivered."""
        if name in self._by_source or name in self._pending:
            raise ValueError(f"source {name!r} added twice")
        self._pending.append(name)
        self._order.append(name)
        self.ready = self._forced_ready

    def replace(self, source: str, groups: Mapping[str, Group]) -> Set[str]:
        """Everything `source` provides is now `groups`; the names to look at again (old and new)."""
        self._check_known(source)
        old = self._by_source.get(source, {})
        first = source not in self._by_source
        self._by_source[source] = dict(groups)
        if first:
            self._by_source = {s: self._by_source[s] for s in self._order if s in self._by_source}
        self._delivered(source)
        return old.keys() | groups.keys()

    def relay(self, source: str, names: Iterable[str], removed: Iterable[str]) -> None:
        """A relay source now gives `names` (as its upstream encoded them) and no longer `removed`."""
        self._check_known(source)
        groups = self._by_source.setdefault(source, {})
        self._delivered(source)
        for name in names:
            groups[name] = RELAYED
        for name in removed:
            groups.pop(name, None)

    def _check_known(self, source: str) -> None:
        if source not in self._by_source and source not in self._pending:
            raise KeyError(f"unknown source {source!r}")

    def _delivered(self, source: str) -> None:
        if source in self._pending:
            self._pending.remove(source)
            self.ready = self._forced_ready or not self._pending

    # -- the merge -----------------------------------------------------------------------------
    def served(self, name: str, current: Resource | None) -> Group | None:
        """What to serve for `name` now that `current` is served: None when no source gives it, `KEPT`
        when `current` stays (the same group, or a merge Envoy would reject: the last good version),
        else the group to encode (with nothing accepted yet, what of a rejected merge fits)."""
        parts = [g[name] for g in self._by_source.values() if name in g]
        if not parts:
            self._set_conflict(name, None, kept=False)
            return None
        group = merge_groups(name, parts)
        if self.overlay is not None:
            group = self.overlay(group)
        if current is not None and current.group == group:
            self._set_conflict(name, None, kept=True)
            return KEPT
        problems = envoy_checks.problems(group)
        self._set_conflict(name, "; ".join(problems) if problems else None, kept=current is not None)
        if problems:
            if current is not None:
                return KEPT  # Envoy would reject it: the last good version stays
            group = envoy_checks.fit(group)  # nothing accepted yet (a restart): what fits
        return group

    def _set_conflict(self, name: str, problem: str | None, *, kept: bool) -> None:
        before = self._conflicts.get(name)
        if problem == before:
            return
        if problem is None:
            del self._conflicts[name]
            log.info("group %s: sources no longer conflict; serving it again", name)
            return
        self._conflicts[name] = problem
        log.warning(
            "group %s: the merged endpoints of %s are not sent, Envoy would reject them: %s; serving %s",
            name,
            ", ".join(self.sources_of(name)),
            problem,
            "the last accepted version" if kept else "only the endpoints that fit",
        )

    def conflict(self, name: str) -> str | None:
        """Why the merged state of `name` is not what is served (None: it is)."""
        return self._conflicts.get(name)

    def conflicts(self) -> Mapping[str, str]:
        return self._conflicts

    def problems_with(self, source: str, name: str, part: Group | None) -> list[str]:
        """What Envoy would reject in group `name` if `source` gave `part` (None: nothing) for it."""
        parts: list[Group] = []
        for s, groups in self._by_source.items():
            if s != source and name in groups:
                parts.append(groups[name])
            elif s == source and part is not None:
                parts.append(part)
        if source not in self._by_source and part is not None:
            parts.append(part)
        return envoy_checks.problems(merge_groups(name, parts)) if parts else []

    # -- staleness and readiness ---------------------------------------------------------------
    def mark_stale(self, source: str, stale: bool) -> None:
        """A source lost (or regained) what it follows; its last state keeps being served."""
        if stale:
            self._stale.add(source)
        else:
            self._stale.discard(source)

    def is_stale(self, name: str) -> bool:
        return any(s in self._stale for s in self.sources_of(name))

    @property
    def pending_sources(self) -> tuple[str, ...]:
        return tuple(self._pending)

    def force_ready(self) -> bool:
        """Ready even though some sources never delivered (startup timeout); True if it was not."""
        if self.ready:
            return False
        self._forced_ready = self.ready = True
        return True

    # -- readers -------------------------------------------------------------------------------
    def sources_of(self, name: str) -> list[str]:
        return [s for s, groups in self._by_source.items() if name in groups]

    def endpoint_sources(self, name: str, served: Resource | None) -> dict[tuple[str, int], str]:
        """Which source gave each endpoint of a group (the first one, as in merging); `served` is
        what is served for it (a relay source's endpoints are its)."""
        out: dict[tuple[str, int], str] = {}
        for source, groups in self._by_source.items():
            group = groups.get(name)
            if group is RELAYED:
                group = served.group if served is not None else None
            for ep in group.endpoints if group is not None else ():
                out.setdefault(ep.key, source)
        return out
