"""A source built alone, as the App builds each of its sources: fed through an Aggregator over a
store, and declared to it (so the store waits for its first state, as in a server)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from eds_server.sources.aggregator import Aggregator
from eds_server.store import Store


class _Named(Protocol):
    name: str


P = ParamSpec("P")
S = TypeVar("S", bound=_Named)


def alone(make: Callable[Concatenate[Aggregator, P], S], store: Store, *args: P.args, **kwargs: P.kwargs) -> S:
    """`make(feed, *args, **kwargs)`, its feed an Aggregator over `store` that declared it alone."""
    feed = Aggregator(store)
    source = make(feed, *args, **kwargs)
    feed.declare([source.name])
    return source
