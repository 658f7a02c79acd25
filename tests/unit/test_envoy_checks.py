"""envoy_checks: the merged-group checks, and `fit` always giving a group Envoy accepts."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from eds_server import envoy_checks
from eds_server.model import Endpoint, Group, Locality

MAX = 2**32 - 1
LOCALITIES = [Locality("r", z) for z in "abc"]

endpoints = st.lists(
    st.builds(
        Endpoint,
        address=st.just("127.0.0.1"),
        port=st.integers(1, 65535),
        weight=st.one_of(st.none(), st.integers(1, MAX), st.sampled_from([MAX, MAX - 1, 2**31])),
        priority=st.integers(0, 2),
        locality=st.sampled_from(LOCALITIES),
    ),
    max_size=8,
    unique_by=lambda e: e.port,
)
locality_weights = st.dictionaries(st.sampled_from(LOCALITIES), st.sampled_from([1, 2**31, MAX - 1, MAX]))


@given(endpoints, locality_weights)
def test_fit_is_always_accepted_and_keeps_what_already_fits(eps: list[Endpoint], weights: dict[Locality, int]) -> None:
    group = Group("g", tuple(eps), weights)
    fitted = envoy_checks.fit(group)
    assert envoy_checks.problems(fitted) == []
    assert all(e in group.endpoints for e in fitted.endpoints)
    if not envoy_checks.problems(group):
        assert fitted == group


def test_the_limits_found_with_envoy() -> None:
    a, b = LOCALITIES[:2]
    assert envoy_checks.problems(Group("g", (Endpoint("127.0.0.1", 1, weight=MAX),))) == []
    two_localities = Group(
        "g", (Endpoint("127.0.0.1", 1, weight=MAX, locality=a), Endpoint("127.0.0.1", 2, locality=b))
    )
    assert envoy_checks.problems(two_localities) == [
        "endpoint weights in priority 0 add up to 4294967296, over Envoy's limit of 4294967295"
    ]
    gap = Group("g", (Endpoint("127.0.0.1", 1), Endpoint("127.0.0.1", 2, priority=2)))
    assert envoy_checks.problems(gap) == []  # Envoy accepts a gap in priorities
    unused = Group("g", (Endpoint("127.0.0.1", 1, locality=a),), {a: MAX, b: MAX})
    assert envoy_checks.problems(unused) == []  # a weight for a locality with no endpoints counts nowhere
