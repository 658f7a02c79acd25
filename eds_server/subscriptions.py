"""Who follows which names, and the announcement of a change to them: the fan-out's first step.

Watchers are plain callbacks (a stream's, the health checker's), told which names changed; nothing
here knows of gRPC, of streams or of how a resource is made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set
from types import MappingProxyType

# Called with the names that changed, or None when everything should be looked at again
# (the store just became ready).
Watcher = Callable[[frozenset[str] | None], None]
# Called with the names that gained their first follower, and those that lost their last one.
Interest = Callable[[tuple[str, ...], tuple[str, ...]], None]


class Subscriptions:
    """Watchers told of every change, and followers told only of the names they follow, so a change
    costs its subscribers, not every open stream."""

    def __init__(self) -> None:
        self._watchers: dict[Watcher, None] = {}  # told of every change (ordered set)
        self._by_name: dict[str, dict[Watcher, None]] = {}  # told only of the names they follow
        self._following: dict[Watcher, set[str]] = {}
        self.interest: Interest | None = None  # told when the set of followed names changes

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher` on every change; returns the function that stops it."""
        self._watchers[watcher] = None

        def stop() -> None:
            self._watchers.pop(watcher, None)

        return stop

    def follow(self, watcher: Watcher, add: Iterable[str] = (), remove: Iterable[str] = ()) -> None:
        """Tell `watcher` of changes to these names only (and when everything is news)."""
        names = self._following.setdefault(watcher, set())
        by_name, new = self._by_name, []
        for name in add:
            names.add(name)
            followers = by_name.get(name)
            if followers is None:
                followers = by_name[name] = {}
                new.append(name)
            followers[watcher] = None
        gone = [name for name in remove if name in names and self._drop(name, watcher)]
        for name in remove:
            names.discard(name)
        if self.interest is not None and (new or gone):
            self.interest(tuple(new), tuple(gone))

    def unfollow(self, watcher: Watcher) -> None:
        gone = [name for name in self._following.pop(watcher, ()) if self._drop(name, watcher)]
        if self.interest is not None and gone:
            self.interest((), tuple(gone))

    def followed(self) -> Iterable[str]:
        """Every name some watcher follows."""
        return self._by_name.keys()

    def by_watcher(self) -> Mapping[Watcher, Set[str]]:
        """Each watcher that `follow`s, with the names it follows (read-only): once every stream is
        gone, empty (nothing held for a stream that left)."""
        return MappingProxyType(self._following)

    def _drop(self, name: str, watcher: Watcher) -> bool:
        """Stop telling `watcher` of `name`; True if nobody follows it any more."""
        followers = self._by_name.get(name)
        if followers is not None:
            followers.pop(watcher, None)
            if not followers:
                del self._by_name[name]
                return True
        return False

    def announce(self, names: frozenset[str] | None) -> None:
        """Tell the watchers, and the followers of `names` (None: every follower) of a change."""
        for watcher in list(self._watchers):
            watcher(names)
        if names is None:
            for watcher in list(self._following):
                watcher(None)
            return
        if len(names) == 1:  # the usual change: its followers all get the same set, no regrouping
            for watcher in list(self._by_name.get(next(iter(names)), ())):
                watcher(names)
            return
        followers: dict[Watcher, list[str]] = {}
        for name in names:
            for watcher in self._by_name.get(name, ()):
                followers.setdefault(watcher, []).append(name)
        for watcher, theirs in followers.items():
            watcher(frozenset(theirs))
