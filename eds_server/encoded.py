"""The versioned, encoded resources: one ClusterLoadAssignment per group, encoded once per change.

What streams send is read from here; how a group came to be (which sources, what conflicts) and
who hears of a change are the concern of `source_merge.py` and `subscriptions.py`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from .model import Group

log = logging.getLogger(__name__)

Encoder = Callable[[Group], bytes]
EMPTY_CACHE_SIZE = 4096


def content_version(data: bytes) -> str:
    """A version that never stands for two contents, across restarts and replicas alike."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


@dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)
class Resource:
    """One encoded ClusterLoadAssignment. Compared by identity; `version` says if content differs."""

    name: str
    version: str
    body: bytes
    group: Group
    changed_at: float = 0.0  # time.monotonic() when this version entered the store


_GROUP = Resource.__dict__["group"]  # the slot, below the property that shadows it in Relayed


class Relayed(Resource):
    """A resource as a relay's upstream encoded it. Its Group is decoded when something asks for it
    (the admin pages, metrics), not on every change in every relay and worker: streams only send
    its bytes."""

    __slots__ = ("_decode",)
    _decode: Callable[[bytes], Group]

    @classmethod
    def make(cls, name: str, version: str, body: bytes, changed_at: float, decode: Callable[[bytes], Group]) -> Relayed:
        out = object.__new__(cls)  # the frozen dataclass's __init__ would set `group` through the property
        for field_name, value in (("name", name), ("version", version), ("body", body), ("changed_at", changed_at)):
            Resource.__dict__[field_name].__set__(out, value)
        _GROUP.__set__(out, None)
        object.__setattr__(out, "_decode", decode)
        return out

    @property
    def group(self) -> Group:
        group = _GROUP.__get__(self)
        if group is None:
            try:
                group = self._decode(self.body)
            except ValueError as e:
                log.warning("group %s: cannot read what the upstream sent (it is served as sent): %s", self.name, e)
                group = Group(self.name)
            _GROUP.__set__(self, group)
        return group  # type: ignore[no-any-return]


class EncodedResources:
    """Each served group's encoding and its content-derived version, and empty assignments for names
    no group has (so Envoy's cluster warms). Knows nothing of sources or streams."""

    def __init__(self, encode: Encoder) -> None:
        self._encode = encode
        # name -> what is served; the one dict for the life of this object (the Store reads it directly)
        self.by_name: dict[str, Resource] = {}
        self._empty: OrderedDict[str, Resource] = OrderedDict()  # LRU of empty CLAs for unknown names
        self.encodes = 0  # how many groups were encoded, for tests and metrics

    def get(self, name: str) -> Resource:
        """The CLA for `name`; a name with no group gets an empty CLA, so Envoy's cluster warms."""
        found = self.by_name.get(name)
        return found if found is not None else self.empty(name)

    def empty(self, name: str) -> Resource:
        """The empty CLA for `name`, kept for the most recently asked names."""
        found = self._empty.get(name)
        if found is not None:
            self._empty.move_to_end(name)
            return found
        group = Group(name)
        body = self._encode(group)
        empty = self._empty[name] = Resource(name, content_version(body), body, group)
        if len(self._empty) > EMPTY_CACHE_SIZE:
            self._empty.popitem(last=False)
        return empty

    def put(self, name: str, group: Group) -> bool:
        """Serve `group` as `name`, encoded; True if its bytes differ from what was served."""
        body = self._encode(group)
        self.encodes += 1
        version = content_version(body)
        current = self.by_name.get(name)
        if current is not None and current.version == version:
            self.by_name[name] = Resource(name, version, body, group)
            return False  # e.g. endpoints reordered: same bytes, nothing to push
        self.by_name[name] = Resource(name, version, body, group, time.monotonic())
        return True

    def put_encoded(self, name: str, resource: Resource) -> bool:
        """Serve a resource encoded elsewhere (a relay's upstream); True if its version is new."""
        current = self.by_name.get(name)
        if current is not None and current.version == resource.version:
            return False
        self.by_name[name] = resource
        return True

    def drop(self, name: str) -> bool:
        """Serve nothing for `name` any more; True if something was served."""
        return self.by_name.pop(name, None) is not None
