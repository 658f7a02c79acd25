"""The store: versions from content, one encode per change, readiness, merging sources."""

from __future__ import annotations

from eds_server.encode import encode_group
from eds_server.model import Endpoint, Group, Locality
from eds_server.store import EMPTY_CACHE_SIZE, Store


def group(name: str, *ports: int) -> Group:
    return Group(name, tuple(Endpoint("127.0.0.1", p) for p in ports))


def make(*sources: str) -> tuple[Store, list[frozenset[str] | None]]:
    store = Store(encode_group)
    for s in sources:
        store.add_source(s)
    seen: list[frozenset[str] | None] = []
    store.watch(seen.append)
    return store, seen


def test_not_ready_until_every_source_delivered() -> None:
    store, seen = make("a", "b")
    store.update("a", {"web": group("web", 1)})
    assert not store.ready and store.pending_sources == ("b",) and seen == []
    store.update("b", {})
    assert store.ready and seen == [None]  # everyone re-evaluates once on becoming ready


def test_force_ready_after_startup_timeout() -> None:
    store, seen = make("a")
    store.force_ready()
    assert store.ready and seen == [None]


def test_versions_follow_content_only() -> None:
    store, seen = make("a")
    store.update("a", {"web": group("web", 1, 2)})
    v1 = store.get("web").version
    assert store.update("a", {"web": group("web", 1, 2)}) == frozenset()  # identical: no change
    assert store.update("a", {"web": group("web", 2, 1)}) == frozenset()  # reordered: same bytes
    assert store.update("a", {"web": group("web", 1)}) == {"web"}
    assert store.update("a", {"web": group("web", 1, 2)}) == {"web"}
    assert store.get("web").version == v1  # same content, same version, even later
    other = Store(encode_group)  # another process or replica agrees
    other.add_source("x")
    other.update("x", {"web": group("web", 2, 1)})
    assert other.get("web").version == v1
    assert seen[-1] == {"web"}


def test_one_encode_per_changed_group() -> None:
    store, _ = make("a")
    groups = {f"g{i}": group(f"g{i}", i + 1) for i in range(10)}
    store.update("a", groups)
    assert store.encodes == 10
    store.update("a", {**groups, "g3": group("g3", 99)})
    assert store.encodes == 11
    store.update("a", {**groups, "g3": group("g3", 99)})
    assert store.encodes == 11  # nothing changed, nothing encoded


def test_removed_group_is_announced_and_served_empty() -> None:
    store, seen = make("a")
    store.update("a", {"web": group("web", 1)})
    assert store.update("a", {}) == {"web"}
    assert seen[-1] == {"web"}
    assert store.get("web").group.endpoints == ()
    assert "web" not in store.resources()


def test_sources_are_merged_first_source_wins() -> None:
    store, _ = make("a", "b")
    store.update("a", {"web": Group("web", (Endpoint("10.0.0.1", 80, weight=5),))})
    store.update("b", {"web": Group("web", (Endpoint("10.0.0.1", 80), Endpoint("10.0.0.2", 80)), {Locality("r"): 2})})
    merged = store.get("web").group
    assert [(e.address, e.weight) for e in merged.endpoints] == [("10.0.0.1", 5), ("10.0.0.2", None)]
    assert merged.locality_weights == {Locality("r"): 2}
    assert store.sources_of("web") == ["a", "b"]
    assert store.update("b", {}) == {"web"}
    assert len(store.get("web").group.endpoints) == 1


def test_unknown_name_gets_an_empty_assignment() -> None:
    store, _ = make()
    res = store.get("nope")
    assert res.group == Group("nope") and res.body == encode_group(Group("nope"))


def test_empty_assignments_for_unknown_names_are_cached_and_bounded() -> None:
    store, _ = make()
    x = store.get("x")
    assert store.get("x") is x
    first = store.get("n0")
    for i in range(1, EMPTY_CACHE_SIZE - 1):  # with "x" and "n0": the cache full
        store.get(f"n{i}")
    assert store.get("x") is x  # everything still cached; "x" now the most recently asked for
    store.get("n-more")  # one past the bound: the least recently asked for, "n0", goes
    again = store.get("n0")
    assert again is not first and again.body == first.body  # made afresh, alike
    assert store.get("x") is x


def test_followers_hear_only_of_their_names() -> None:
    store, _ = make("a")
    heard: dict[str, list[frozenset[str] | None]] = {"x": [], "y": []}

    def x(names: frozenset[str] | None) -> None:
        heard["x"].append(names)

    def y(names: frozenset[str] | None) -> None:
        heard["y"].append(names)

    store.follow(x, ["web", "api"])
    store.follow(y, ["api"])
    store.update("a", {"web": group("web", 1)})  # becomes ready: everyone hears None
    assert heard == {"x": [None], "y": [None]}
    store.update("a", {"web": group("web", 2), "api": group("api", 1)})
    assert heard["x"][-1] == {"web", "api"} and heard["y"][-1] == {"api"}
    store.follow(x, remove=["api"])
    store.update("a", {"web": group("web", 2), "api": group("api", 2)})
    assert heard["x"][-1] == {"web", "api"} and heard["y"][-1] == {"api"} and len(heard["x"]) == 2
    store.unfollow(x)
    store.unfollow(y)
    assert not list(store.followed()) and not store.subscriptions()


# -- merge-time validation: what Envoy would reject is never what is served ------------------------
MAX = 2**32 - 1


def weighted(name: str, *pairs: tuple[int, int], **kw: object) -> Group:
    return Group(name, tuple(Endpoint("127.0.0.1", p, weight=w, **kw) for p, w in pairs))  # type: ignore[arg-type]


def test_merged_weights_over_the_limit_keep_the_last_good_version() -> None:
    store, seen = make("file", "api")
    store.update("file", {"web": weighted("web", (1, MAX))})
    store.update("api", {})
    good = store.get("web")
    seen.clear()
    assert store.update("api", {"web": weighted("web", (2, MAX))}) == frozenset()
    assert store.get("web") is good and seen == []
    conflict = store.conflict("web")
    assert conflict and "priority 0 add up to 8589934590" in conflict
    assert store.conflicts() == {"web": conflict}
    store.update("api", {"web": weighted("web", (2, 1))})  # still one over
    assert store.get("web") is good
    store.update("file", {"web": weighted("web", (1, MAX - 1))})  # fits again: served, conflict gone
    assert store.get("web").version != good.version and store.conflict("web") is None
    assert {e.port for e in store.get("web").group.endpoints} == {1, 2}


def test_weights_count_per_priority_across_localities() -> None:
    a, b = Locality("r", "a"), Locality("r", "b")
    store, _ = make("x")
    store.update(
        "x",
        {
            "web": Group(
                "web",
                (
                    Endpoint("127.0.0.1", 1, weight=MAX, locality=a),
                    Endpoint("127.0.0.1", 2, weight=MAX, locality=b, priority=1),
                ),
            )
        },
    )
    assert store.conflict("web") is None  # two priorities: each fits
    store.update(
        "x",
        {
            "web": Group(
                "web",
                (Endpoint("127.0.0.1", 1, weight=MAX, locality=a), Endpoint("127.0.0.1", 2, weight=1, locality=b)),
            )
        },
    )
    assert "priority 0" in (store.conflict("web") or "")


def test_locality_weights_over_the_limit_per_priority() -> None:
    a, b = Locality("r", "a"), Locality("r", "b")
    eps = (Endpoint("127.0.0.1", 1, locality=a), Endpoint("127.0.0.1", 2, locality=b))
    store, _ = make("x")
    store.update("x", {"web": Group("web", eps, {a: MAX - 1, b: 1})})
    good = store.get("web")
    store.update("x", {"web": Group("web", eps, {a: MAX, b: 1})})
    assert store.get("web") is good and "locality weights in priority 0" in (store.conflict("web") or "")


def test_a_conflict_with_nothing_served_yet_serves_what_fits() -> None:
    """After a restart there is no last good version: the endpoints that fit, in source order."""
    store, _ = make("file", "api")
    store.update("file", {"web": weighted("web", (1, MAX))})
    store.update("api", {"web": weighted("web", (2, 5))})
    assert [e.port for e in store.get("web").group.endpoints] == [1]
    assert store.conflict("web")


def test_problems_with_a_source_part() -> None:
    store, _ = make("file", "api")
    store.update("file", {"web": weighted("web", (1, MAX - 1))})
    store.update("api", {})
    assert store.problems_with("api", "web", weighted("web", (2, 1))) == []
    assert store.problems_with("api", "web", weighted("web", (2, 2)))
    assert store.problems_with("api", "web", None) == []
    assert store.problems_with("file", "web", None) == []


def test_sources_merge_in_the_order_declared_whichever_delivers_first() -> None:
    store, _ = make("file", "docker", "registrations")
    mine = Group("web", (Endpoint("127.0.0.1", 1, weight=7),))
    theirs = Group("web", (Endpoint("127.0.0.1", 1, weight=3),))
    store.update("registrations", {"web": theirs})  # a state file loads at start, before Docker
    store.update("docker", {"web": mine})
    store.update("file", {})
    assert [e.weight for e in store.get("web").group.endpoints] == [7]  # Docker comes first
    assert store.sources_of("web") == ["docker", "registrations"]
    assert store.endpoint_sources("web") == {("127.0.0.1", 1): "docker"}
