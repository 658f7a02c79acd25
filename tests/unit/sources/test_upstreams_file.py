"""The upstreams file source on a real filesystem: every way a file gets replaced is seen."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from eds_server import upstreams
from eds_server.encode import encode_group
from eds_server.sources.upstreams_file import UpstreamsFileSource
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.waiting import wait_for


def text(*ports: int) -> str:
    return "groups:\n  web:\n    endpoints: [" + ", ".join(f"127.0.0.1:{p}" for p in ports) + "]\n"


class Running:
    def __init__(self, path: Path) -> None:
        self.store = Store(encode_group)
        self.source = alone(UpstreamsFileSource, self.store, str(path), debounce=0.05, poll_interval=0.3)
        self.seen: list[list[int]] = []
        self.store.watch(lambda _: self.seen.append(self.ports()))

    def ports(self) -> list[int]:
        return [e.port for e in self.store.get("web").group.endpoints]

    async def wait_ports(self, expected: list[int], timeout: float = 5.0) -> None:
        await wait_for(self.ports, lambda ports: ports == expected, timeout=timeout, what=f"ports {expected}")


@contextlib.asynccontextmanager
async def following(path: Path) -> AsyncIterator[Running]:
    """The source loaded from `path` and following it, until the block ends."""
    r = Running(path)
    r.source.load()
    stop = asyncio.Event()
    watching = asyncio.Event()
    reload = r.source.reload

    async def noted_reload(*, whole: bool = False) -> bool:
        try:
            return await reload(whole=whole)
        finally:
            watching.set()

    # the watcher is up once it has reloaded: it does at its first poll (0.3 s), if not sooner; the
    # test starts right after that reload (none under way), its next poll 0.3 s away
    setattr(r.source, "reload", noted_reload)  # noqa: B010 (a method, for this source only)
    task = asyncio.create_task(r.source.run(stop))
    await asyncio.wait_for(watching.wait(), 10)
    try:
        yield r
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    path = tmp_path / "upstreams.yaml"
    path.write_text(text(1))
    async with following(path) as r:
        yield r


async def test_in_place_write(running: Running) -> None:
    Path(running.source.path).write_text(text(1, 2))
    await running.wait_ports([1, 2])


async def test_atomic_rename(running: Running, tmp_path: Path) -> None:
    tmp = tmp_path / ".upstreams.yaml.swp"
    tmp.write_text(text(3))
    os.replace(tmp, running.source.path)
    await running.wait_ports([3])


async def test_bad_edit_keeps_last_good_state_then_recovers(running: Running) -> None:
    path = Path(running.source.path)
    path.write_text(text(1) + "    bogus: 1\n")
    await wait_for(lambda: running.source.last_error)
    assert running.source.last_error and "groups.web.bogus: unknown key" in running.source.last_error
    assert running.ports() == [1]
    path.write_text(text(4))
    await running.wait_ports([4])
    assert running.source.last_error is None


async def test_deleted_file_keeps_last_good_state(running: Running) -> None:
    os.unlink(running.source.path)
    await wait_for(lambda: running.source.last_error, lambda e: "missing" in (e or ""), what="the file missed")
    assert running.ports() == [1]
    Path(running.source.path).write_text(text(5))
    await running.wait_ports([5])


async def test_configmap_symlink_swap(tmp_path: Path) -> None:
    """Kubernetes mounts: upstreams.yaml -> ..data/upstreams.yaml, ..data -> ..<timestamp>."""
    mount = tmp_path / "mount"
    mount.mkdir()
    (mount / "..v1").mkdir()
    (mount / "..v1" / "upstreams.yaml").write_text(text(6))
    os.symlink("..v1", mount / "..data")
    os.symlink("..data/upstreams.yaml", mount / "upstreams.yaml")
    async with following(mount / "upstreams.yaml") as r:
        (mount / "..v2").mkdir()
        (mount / "..v2" / "upstreams.yaml").write_text(text(7))
        os.symlink("..v2", mount / "..data_tmp")
        os.replace(mount / "..data_tmp", mount / "..data")  # the kubelet's atomic swap
        await r.wait_ports([7])


async def test_slow_in_place_write_is_not_applied_half_done(running: Running) -> None:
    with open(running.source.path, "w") as f:
        f.write("groups:\n  web:\n    endpoints:\n      - 127.0.0.1:2\n")  # valid on its own
        f.flush()
        await asyncio.sleep(0.01)  # the writer's pause (nothing is waited for): the source must wait it out
        f.write("      - 127.0.0.1:3\n")
    await running.wait_ports([2, 3])
    assert [2] not in running.seen


async def test_replaced_directory_is_watched_anew(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "upstreams.yaml").write_text(text(1))
    async with following(conf / "upstreams.yaml") as r:
        os.rename(conf, tmp_path / "conf.old")
        conf.mkdir()
        (conf / "upstreams.yaml").write_text(text(8))
        await r.wait_ports([8])
        (conf / "upstreams.yaml").write_text(text(9))  # and the new directory is followed
        await r.wait_ports([9])


def test_first_load_refuses_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [1.2.3.4:0]\n")
    source = alone(UpstreamsFileSource, Store(encode_group), str(path))
    with pytest.raises(upstreams.UpstreamsError) as e:
        source.load()
    assert str(e.value.problems[0]).startswith(f"{path}:3: groups.web.endpoints[0]")


async def test_unreadable_file_keeps_last_good_state(running: Running) -> None:
    path = Path(running.source.path)
    os.unlink(path)
    path.mkdir()  # as root, permissions do not stop reads: a directory in its place does
    await wait_for(lambda: "cannot read" in (running.source.last_error or ""))
    assert "cannot read" in (running.source.last_error or "") and running.ports() == [1]
    path.rmdir()
    path.write_text(text(6))
    await running.wait_ports([6])


async def test_truncated_mid_write_then_completed(running: Running) -> None:
    path = Path(running.source.path)
    full = text(2, 3)
    path.write_text(full[: len(full) // 2])  # a writer that stopped half-way: invalid YAML
    await wait_for(lambda: running.source.last_error)
    assert running.source.last_error and running.ports() == [1]
    path.write_text(full)
    await running.wait_ports([2, 3])


async def test_a_file_renamed_into_place_is_applied_without_waiting_for_a_writer(
    running: Running, tmp_path: Path
) -> None:
    from eds_server.sources import renames

    if not renames.AVAILABLE:
        pytest.skip("no inotify here: every edit takes the careful path")
    waits = running.source.writer_waits
    tmp = tmp_path / ".upstreams.yaml.tmp"
    tmp.write_text(text(4, 5))
    os.replace(tmp, running.source.path)  # written whole, then renamed: nothing to wait for
    await running.wait_ports([4, 5])
    assert running.source.writer_waits == waits
    Path(running.source.path).write_text(text(6))  # in place: read again once its writer is done
    await running.wait_ports([6])
    assert running.source.writer_waits > waits  # at least once (a truncate and a write may come as two events)


async def test_the_kubelets_swap_is_applied_without_waiting(tmp_path: Path) -> None:
    mount = tmp_path / "mount"
    (mount / "..v1").mkdir(parents=True)
    (mount / "..v1" / "upstreams.yaml").write_text(text(1))
    os.symlink("..v1", mount / "..data")
    os.symlink("..data/upstreams.yaml", mount / "upstreams.yaml")
    async with following(mount / "upstreams.yaml") as r:
        waits = r.source.writer_waits
        (mount / "..v2").mkdir()
        (mount / "..v2" / "upstreams.yaml").write_text(text(7))
        os.symlink("..v2", mount / "..data_tmp")
        os.replace(mount / "..data_tmp", mount / "..data")
        await r.wait_ports([7])
        assert r.source.writer_waits == waits


def test_rename_events_are_read_from_inotifys_records() -> None:
    from eds_server.sources.renames import IN_MOVED_TO, names

    def record(mask: int, name: bytes) -> bytes:
        padded = name + b"\0" * (16 - len(name))
        return struct.pack("iIII", 1, mask, 7, len(padded)) + padded

    data = record(IN_MOVED_TO, b"upstreams.yaml") + record(0x2, b"other") + record(IN_MOVED_TO, b"..data")
    assert names(data) == ["upstreams.yaml", "..data"]
    assert names(data[:10]) == []  # a partial record is not read
