"""The upstreams file as a source: read at start, then re-read whenever its directory changes.

The directory is watched rather than the file so that atomic renames, editors that replace the
file, and Kubernetes ConfigMap symlink swaps are all seen. A bad version is reported and ignored:
the last good state keeps being served.
"""

from __future__ import annotations

import asyncio
import logging
import os

import watchfiles

from .. import upstreams
from ..model import Group
from ..store import Store

log = logging.getLogger("eds_server.sources.file")


class UpstreamsFileSource:
    def __init__(self, path: str, store: Store, *, debounce_ms: int = 50) -> None:
        self.path = path
        self.name = f"file:{path}"
        self.store = store
        self.debounce_ms = debounce_ms
        self.last_error: str | None = None
        self.reloads = 0
        self._last_text: bytes | None = None
        store.add_source(self.name)

    def load(self) -> dict[str, Group]:
        """First load: raise UpstreamsError so a bad file stops the server from starting."""
        with open(self.path, "rb") as f:
            data = f.read()
        groups = upstreams.parse(data.decode("utf-8", errors="replace"), self.path)
        self._last_text = data
        self.store.update(self.name, groups)
        log.info("loaded %s: %d groups", self.path, len(groups))
        return groups

    def reload(self) -> bool:
        """Re-read the file; apply it if it changed and is valid. True when the store changed."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except OSError as e:
            self._error(f"{self.path}:1: cannot read: {e.strerror or e}")
            return False
        if data == self._last_text:
            return False
        try:
            groups = upstreams.parse(data.decode("utf-8", errors="replace"), self.path)
        except upstreams.UpstreamsError as e:
            self._error(str(e))
            return False
        self._last_text = data
        self.last_error = None
        self.reloads += 1
        changed = self.store.update(self.name, groups)
        log.info(
            "reloaded %s: %d groups, changed: %s",
            self.path, len(groups), ", ".join(sorted(changed)) or "none",
        )  # fmt: skip
        return bool(changed)

    def _error(self, message: str) -> None:
        if message != self.last_error:
            for line in message.splitlines():
                log.error("%s (still serving the last good version)", line)
        self.last_error = message

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the file until `stop` is set."""
        directory = os.path.dirname(os.path.abspath(self.path))
        async for _ in watchfiles.awatch(
            directory,
            watch_filter=None,  # reloads are cheap and compare bytes first; never miss a rename
            stop_event=stop,
            debounce=self.debounce_ms,
            step=20,
            recursive=False,
        ):
            self.reload()
