"""The upstreams file as a source: read at start, then re-read whenever its directory changes.

The directory is watched rather than the file so that atomic renames, editors that replace the
file, and Kubernetes ConfigMap symlink swaps are all seen; a slow poll backs the watch up, and the
watch is re-armed if the directory itself is replaced. A file written in place is read once its
writer has gone quiet and again `debounce` later, so a half-written file is never served; a file
renamed into place (renames.py) was written whole and is applied at once. A bad version is reported and ignored: the
last good state keeps being served. Re-reads are read and parsed in a worker thread, so a big file
never stalls the event loop (keepalives, other streams); the first load, before serving, is not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

import watchfiles

from .. import fields, upstreams
from .base import Feed, SourceStatus
from .renames import Renames

log = logging.getLogger("eds_server.sources.file")


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


class UpstreamsFileSource:
    writer_waits = 0  # changes read again until their writer was done (a file renamed into place needs none)

    def __init__(
        self,
        feed: Feed,
        path: str,
        *,
        debounce: float = 0.05,
        poll_interval: float = 5.0,
        max_size: int = fields.MAX_UPSTREAMS_SIZE,
    ) -> None:
        self.path = path
        self.max_size = max_size
        self._parser = upstreams.Parser()  # remembers the last version: unchanged groups are reused
        self.name = f"file:{path}"
        self.feed = feed
        self.debounce = debounce  # seconds, as every source's
        self.poll_interval = poll_interval
        self.last_error: str | None = None
        self._last_bytes: bytes | None = None
        self._reloading = asyncio.Lock()  # one parse at a time: the parser keeps the last version
        self._renames_pending: set[asyncio.Task[bool]] = set()

    def status(self) -> SourceStatus:
        """Live while it watches the file; an invalid version is `last_error`, the last good one served."""
        return SourceStatus(self.name, self.feed.loaded(self.name), True, self.last_error)

    async def start(self) -> None:
        self.load()

    def _read(self) -> bytes:
        """Bounded: a regular file of at most max_size bytes (UpstreamsError otherwise)."""
        return upstreams.read(self.path, self.max_size)

    def load(self) -> None:
        """First load: raise UpstreamsError so a bad file stops the server from starting."""
        data = upstreams.read_required(self.path, self.max_size)
        groups = self._parser.parse_bytes(data, self.path)
        self._last_bytes = data
        self.feed.publish(self.name, groups)
        log.info("loaded %s: %s", self.path, fields.counted(len(groups), "group"))

    async def _read_settled(self, data: bytes) -> bytes:
        """The file's bytes once a writer has stopped changing them (a slow in-place write
        must not be applied half-written), from a first read of them."""
        self.writer_waits += 1
        for _ in range(20):  # bounded: a file rewritten non-stop is taken as last read
            await asyncio.sleep(max(0.02, self.debounce))
            again = await asyncio.to_thread(self._read)
            if again == data:
                break
            data = again
        return data

    async def reload(self, *, whole: bool = False) -> bool:
        """Re-read the file; apply it if it changed and is valid. True when the store changed.

        `whole`: it was just renamed into place, so it was written whole: no need to wait and read
        it again to be sure its writer has finished."""
        async with self._reloading:
            return await self._reload(whole)

    async def _reload(self, whole: bool = False) -> bool:
        try:
            data = await asyncio.to_thread(self._read)
            if data == self._last_bytes:
                return False
            if not whole:
                data = await self._read_settled(data)
        except FileNotFoundError:
            # Usually transient: an editor moved the file aside and is about to write it again.
            self._error(f"{self.path}: missing", level=logging.WARNING)
            return False
        except upstreams.UpstreamsError as e:  # not a regular file, too big, unreadable (upstreams.read)
            self._last_bytes = None  # the next readable version is looked at afresh
            self._error(str(e))
            return False
        if data == self._last_bytes:
            return False
        # A one-endpoint edit is spliced right here (about a millisecond at 1,000 endpoints);
        # anything else is parsed in a worker thread, so a large file cannot hold up the loop.
        try:
            text = upstreams.decode(data, self.path)
            groups = self._parser.splice(text, self.path)
            if groups is None:
                log.debug("parsing %s (%d bytes) in a worker thread", self.path, len(data))
                groups = await asyncio.to_thread(self._parser.parse_full, text, self.path)
        except upstreams.UpstreamsError as e:
            self._last_bytes = data  # reported once; the next edit is looked at afresh
            self._error(str(e))
            return False
        self._last_bytes = data
        self.last_error = None
        changed = self.feed.publish(self.name, groups)
        log.info(
            "reloaded %s: %s, changed: %s",
            self.path,
            fields.counted(len(groups), "group"),
            ", ".join(sorted(changed)) or "none",
        )
        return bool(changed)

    def _error(self, message: str, level: int = logging.ERROR) -> None:
        if message != self.last_error:
            for line in message.splitlines():
                log.log(level, "%s (still serving the last good version)", line)
        self.last_error = message

    def _renamed(self, name: str) -> None:
        """A file was renamed into the directory: ours (or the kubelet's `..data` swap) is whole now."""
        if name in (os.path.basename(self.path), "..data"):
            task = asyncio.get_running_loop().create_task(self.reload(whole=True))
            self._renames_pending.add(task)
            task.add_done_callback(self._renames_pending.discard)

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the file until `stop` is set."""
        directory = os.path.dirname(os.path.abspath(self.path))
        while not stop.is_set():
            identity = _identity(directory)
            renames = Renames(directory, self._renamed)  # the fast path for edits renamed into place
            try:
                async for _ in watchfiles.awatch(
                    directory,
                    watch_filter=None,  # reloads are cheap and compare bytes first
                    stop_event=stop,
                    debounce=max(1, round(self.debounce * 1000)),  # watchfiles counts milliseconds
                    step=20,
                    recursive=False,
                    rust_timeout=round(self.poll_interval * 1000),
                    yield_on_timeout=True,  # a slow poll, in case an event was missed
                ):
                    await self.reload()
                    if _identity(directory) != identity:
                        log.info("%s was replaced: watching it anew", directory)
                        break
            except Exception as e:  # e.g. the directory is gone, or inotify limits are reached
                self._error(f"{self.path}: cannot watch {directory}: {e}", level=logging.WARNING)
            finally:
                renames.close()
            if not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                with contextlib.suppress(Exception):
                    await self.reload()
