"""The command line as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eds_server import __version__
from eds_server.cli import duration, host_port


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eds_server", *args],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_check_good_and_bad(tmp_path: Path) -> None:
    good = run("check", "examples/upstreams.yaml")
    assert good.returncode == 0 and "ok (2 groups, 3 endpoints)" in good.stdout
    bad = tmp_path / "upstreams.yaml"
    bad.write_text("groups:\n  web:\n    endpoints:\n      - 10.0.0.1:80\n"
                   "      - address: 10.0.0.6\n        port: 99999\n        weight: 0\n")  # fmt: skip
    out = run("check", str(bad))
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"{bad}:6: groups.web.endpoints[1].port: 99999 is not a port (1-65535)",
        f"{bad}:7: groups.web.endpoints[1].weight: 0 is not a weight (1-4294967295; Envoy rejects 0)",
    ]


def test_serve_refuses_a_bad_file_with_json_logs(tmp_path: Path) -> None:
    bad = tmp_path / "upstreams.yaml"
    bad.write_text("groups:\n  web:\n    endpoints: [web.internal:80]\n")
    out = run("serve", "--upstreams", str(bad), "--listen", "127.0.0.1:0", "--admin", "off",
              "--log-format", "json")  # fmt: skip
    assert out.returncode == 1
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert lines[0]["level"] == "info" and lines[0]["msg"].startswith(f"eds-server {__version__} starting")
    assert lines[1]["level"] == "error" and lines[1]["msg"].startswith(f"{bad}:3: groups.web.endpoints[0]")


def test_serve_without_a_source_says_how() -> None:
    out = run("serve")
    assert out.returncode == 2 and "--upstreams" in out.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:18000", ("127.0.0.1", 18000)), (":18000", ("0.0.0.0", 18000)),
     ("[::1]:5", ("::1", 5)), ("0.0.0.0:0", ("0.0.0.0", 0))],
)  # fmt: skip
def test_host_port(text: str, expected: tuple[str, int]) -> None:
    assert host_port(text) == expected


def test_duration() -> None:
    assert (duration("10"), duration("10s"), duration("500ms"), duration("2m")) == (10, 10, 0.5, 120)


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"eds-server {__version__}\n"
