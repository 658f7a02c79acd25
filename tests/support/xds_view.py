"""What the xDS state machines read resources from, without a store: a name unknown to it reads as
a body of its own ("empty:NAME"), so a test can tell every resource apart."""

from __future__ import annotations

from eds_server.encoded import Resource
from eds_server.model import Group


class View:
    withholds = False  # a store of a relay withholds names its upstream has not answered

    def __init__(self) -> None:
        self.ready = True
        self.bodies: dict[str, bytes] = {}

    def set(self, name: str, body: bytes) -> None:
        self.bodies[name] = body

    def get(self, name: str) -> Resource:
        body = self.bodies.get(name, b"empty:" + name.encode())
        return Resource(name, body.decode(), body, Group(name))
