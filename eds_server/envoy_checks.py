"""What Envoy refuses in a ClusterLoadAssignment beyond single fields, checked on whole groups.

Each source checks its own fields, but only the merged group (every source's endpoints together) is what
Envoy sees, so the store checks it again here before anything is encoded. Found with a real Envoy 1.40
(RING_HASH and MAGLEV clusters reject, with or without locality_weighted_lb_config; ROUND_ROBIN, also
locality-weighted, LEAST_REQUEST and RANDOM accepted):

- per priority, the endpoint weights (unset = 1) of all localities together must not pass uint32
  ("The sum of weights of all upstream hosts in a locality exceeds 4294967295", although the check
  spans every locality of the priority);
- per priority, the locality weights must not pass uint32 ("The sum of weights of all localities at
  the same priority exceeds 4294967295").

Priorities need not be contiguous: Envoy accepts 0 and 2 without 1 (an empty priority 1).
"""

from __future__ import annotations

from collections.abc import Iterable

from .fields import UINT32_MAX
from .model import Endpoint, Group, Locality


def _endpoint_sums(endpoints: Iterable[Endpoint]) -> dict[int, int]:
    sums: dict[int, int] = {}
    for ep in endpoints:
        sums[ep.priority] = sums.get(ep.priority, 0) + (ep.weight or 1)
    return sums


def _localities_by_priority(group: Group) -> dict[int, set[Locality]]:
    out: dict[int, set[Locality]] = {}
    for ep in group.endpoints:
        out.setdefault(ep.priority, set()).add(ep.locality)
    return out


def problems(group: Group) -> list[str]:
    """Why Envoy would reject this group's ClusterLoadAssignment (empty: it would not)."""
    out = [
        f"endpoint weights in priority {prio} add up to {total}, over Envoy's limit of {UINT32_MAX}"
        for prio, total in sorted(_endpoint_sums(group.endpoints).items())
        if total > UINT32_MAX
    ]
    if group.locality_weights:
        for prio, localities in sorted(_localities_by_priority(group).items()):
            total = sum(group.locality_weights.get(loc, 0) for loc in localities)
            if total > UINT32_MAX:
                out.append(f"locality weights in priority {prio} add up to {total}, over Envoy's limit of {UINT32_MAX}")
    return out


def fit(group: Group) -> Group:
    """The group cut down, in order, to what Envoy accepts: an endpoint that would push its priority
    past the limit is left out, and so is a locality weight. Used only when no accepted version of
    the group exists yet (a restart), so Envoy gets the endpoints that fit instead of a rejection."""
    sums: dict[int, int] = {}
    kept: list[Endpoint] = []
    for ep in group.endpoints:
        total = sums.get(ep.priority, 0) + (ep.weight or 1)
        if total <= UINT32_MAX:
            sums[ep.priority] = total
            kept.append(ep)
    weights = dict(group.locality_weights)
    by_priority: dict[int, set[Locality]] = {}
    for ep in kept:
        by_priority.setdefault(ep.priority, set()).add(ep.locality)
    for localities in by_priority.values():
        total = 0
        for loc in sorted(localities):
            w = weights.get(loc)
            if w is None:
                continue
            if total + w > UINT32_MAX:
                del weights[loc]  # shared by every priority it appears in: stays within the limit there too
            else:
                total += w
    return Group(group.name, tuple(kept), weights)
