"""An HTTP backend to run inside a network namespace a test made (`ip netns exec NS python -m
tests.support.netns_backend ADDRESS PORT NAME HEALTH_FILE SECONDS`): `/health` answers the status
written in HEALTH_FILE (200 when it is missing or unreadable), anything else answers NAME. The file is
how the test, outside the namespace, flips the answer without a request of its own. It stops by itself
after SECONDS, so nothing outlives a test that died before its teardown.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from aiohttp import web


def health_status(path: Path) -> int:
    try:
        return int(path.read_text().strip() or "200")
    except (OSError, ValueError):
        return 200


async def main(address: str, port: int, name: str, health_file: Path, seconds: float) -> None:
    async def health(request: web.Request) -> web.Response:
        status = health_status(health_file)
        return web.Response(status=status, text=f"{name} {status}")

    async def other(request: web.Request) -> web.Response:
        return web.Response(text=name, headers={"x-backend": name})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", other)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, address, port).start()
        print("listening", flush=True)
        await asyncio.sleep(seconds)
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    address, port, name, health_file, seconds = sys.argv[1:6]
    asyncio.run(main(address, int(port), name, Path(health_file), float(seconds)))
