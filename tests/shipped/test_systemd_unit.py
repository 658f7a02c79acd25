"""deploy/systemd: the unit passes systemd's own checks, with the usual hardening, and runs the
command line the env file configures."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

UNIT = ROOT / "deploy" / "systemd" / "eds-server.service"
ENV = ROOT / "deploy" / "systemd" / "eds-server.env"
ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(ANALYZE is None, reason="no systemd-analyze (Debian's systemd; .ci/run installs it)")
HARDENING = {
    "NoNewPrivileges": "yes",
    "CapabilityBoundingSet": "",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "DynamicUser": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "SystemCallFilter": "@system-service",
    "RestrictNamespaces": "yes",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectControlGroups": "yes",
}


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def _checkable(tmp_path: Path) -> Path:
    """The unit with its ExecStart and EnvironmentFile where they are in this checkout."""
    eds_server = Path(sys.executable).parent / "eds-server"
    text = UNIT.read_text().replace("/opt/eds-server/bin/eds-server", str(eds_server))
    text = text.replace("EnvironmentFile=/etc/eds-server/eds-server.env", f"EnvironmentFile={ENV}")
    unit = tmp_path / UNIT.name
    unit.write_text(text)
    return unit


@needs_systemd
def test_the_unit_verifies(tmp_path: Path) -> None:
    out = subprocess.run(
        [str(ANALYZE), "verify", "--man=no", str(_checkable(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


@needs_systemd
def test_the_units_exposure_is_low(tmp_path: Path) -> None:
    """systemd's own score of the sandbox (0 most locked down, 10 not at all): below 2 ("OK")."""
    out = subprocess.run(
        [str(ANALYZE), "security", "--offline=true", str(_checkable(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"Overall exposure level for \S+: ([\d.]+)", out.stdout)
    assert found, out.stdout + out.stderr
    assert float(found[1]) < 2.0, out.stdout


def test_the_unit_has_the_usual_hardening() -> None:
    settings = _settings(UNIT.read_text())
    for key, value in HARDENING.items():
        assert value in settings.get(key, []), key
    assert settings["ExecStart"] == ["/opt/eds-server/bin/eds-server serve"]


def test_systemd_waits_longer_than_the_shutdown_takes() -> None:
    """TimeoutStopSec is past --shutdown-timeout: systemd's SIGKILL never cuts a clean shutdown."""
    from eds_server.cli import build_parser
    from eds_server.options.parsing import duration

    stop = duration(_settings(UNIT.read_text())["TimeoutStopSec"][0])
    assert stop > build_parser().parse_args(["serve"]).shutdown_timeout + 5


def test_the_env_file_is_a_valid_configuration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every variable in it is one eds-server reads, every value parses, and the upstreams file it
    names (the example, installed beside it) passes `eds-server check`."""
    from eds_server.cli import _SUBCOMMANDS, build_parser
    from eds_server.options.parsing import BAD_BOOLEANS, env_var

    env = {k: v[0] for k, v in _settings(ENV.read_text()).items()}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = build_parser().parse_args(["serve"])
    assert not BAD_BOOLEANS
    known = {env_var(o) for a in _SUBCOMMANDS["serve"]._actions for o in a.option_strings if o.startswith("--")}
    assert set(env) <= known, set(env) - known
    assert args.upstreams == "/etc/eds-server/upstreams.yaml" and args.log_format == "json"
    proc = subprocess.run(
        [sys.executable, "-m", "eds_server", "check", str(ROOT / "examples" / "upstreams.yaml")],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr
