"""Every admin answer is JSON, errors included, and says what to do."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.support.server_process import EdsServerProcess


async def test_admin_errors_are_json_with_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8081]\n")
    async with EdsServerProcess(path) as server, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{server.admin_port}"
        for method, where, status, hint in [
            ("GET", "/v1/registrations", 404, "--state FILE and/or --admin-token"),
            ("PUT", "/v1/groups/web/endpoints/vm-1", 404, "--state FILE and/or --admin-token"),
            ("GET", "/v1/nothing", 404, "/v1/groups"),
            ("GET", "/v1/groups/nope", 404, "GET /v1/groups"),
            ("POST", "/v1/groups", 405, "allowed: GET"),
        ]:
            async with s.request(method, base + where) as r:
                assert r.status == status, (method, where)
                assert r.content_type == "application/json", (method, where)
                body = await r.json()
                assert body["error"], body
                if hint is not None:
                    assert hint in body["hint"], body
        async with s.post(base + "/v1/groups") as r:
            assert r.headers["Allow"] == "GET,HEAD" or "GET" in r.headers["Allow"]
