"""Re-record the JSON fixtures in this folder from a private, real Docker engine (root needed).

    .venv/bin/python tests/data/docker/record.py

Prints every docker command it runs (README.md lists them). No traffic goes to any container
address: the bridge-network containers only run ``sleep 3600``; host-network backends serve on
127.0.0.1 and are only probed there.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))  # the repository: tests.support imports

from tests.support.docker_engine import (  # noqa: E402
    DockerEngine,
    backend_script,
    http_get,
    unavailable_reason,
)
from tests.support.waiting import wait_for_blocking  # noqa: E402

PORTS = {
    "eds-host": 18601,
    "ev-drain": 18611,
    "ev-kill": 18612,
    "ev-pause": 18613,
    "ev-rename": 18614,
    "ev-health": 18615,
}
PUBLISHED = (18081, 18082)


class Recorder:
    def __init__(self, engine: DockerEngine) -> None:
        self.engine = engine

    def docker(self, *args: str, timeout: float = 60) -> str:
        shown = [a if "\n" not in a else "<script>" for a in args]
        print("docker", shlex.join(shown), flush=True)
        return self.engine.cli(*args, timeout=timeout)

    def backend(
        self,
        name: str,
        labels: dict[str, str],
        *,
        drain: float = 0,
        health: list[str] | None = None,
        network: str = "host",
    ) -> str:
        args = ["run", "-d", "--name", name, "--network", network]
        for k, v in labels.items():
            args += ["--label", f"{k}={v}"]
        args += [*(health or []), self.engine.image, "sh", "-c", backend_script(name, PORTS[name], drain_seconds=drain)]
        cid = self.docker(*args)
        wait_for_blocking(lambda: http_get(PORTS[name], timeout=1.0) == (200, name), timeout=15, what=name)
        return cid

    def save(self, filename: str, ref: str) -> dict[str, Any]:
        info = self.engine.inspect(ref)
        print(
            f"  -> {filename}: docker inspect {ref}  (State.Status={info['State']['Status']}"
            f"{', Health=' + info['State']['Health']['Status'] if info['State'].get('Health') else ''})"
        )
        (HERE / filename).write_text(json.dumps(info, indent=2) + "\n")
        return info


def main() -> None:
    reason = unavailable_reason()
    if reason:
        sys.exit(reason)
    for port in (*PORTS.values(), *PUBLISHED):
        try:
            http_get(port, timeout=0.5)
        except OSError:
            continue
        sys.exit(f"port {port} on 127.0.0.1 is in use")

    with DockerEngine() as engine:
        r = Recorder(engine)
        r.docker("version", "--format", "client {{.Client.Version}} / engine {{.Server.Version}}")

        # (a) host network, eds labels, serving on 127.0.0.1:18601
        r.backend("eds-host", {"eds.group": "web", "eds.port": "18601", "eds.weight": "2"})
        r.save("host-network.json", "eds-host")

        # user-defined bridge networks (never sent traffic)
        r.docker("network", "create", "eds-net1")
        r.docker("network", "create", "eds-net2")

        # (b) one user network, EXPOSEd port
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-expose",
            "--network",
            "eds-net1",
            "--expose",
            "8080",
            "--label",
            "eds.group=api",
            engine.image,
            "sleep",
            "3600",
        )
        r.save("bridge-expose.json", "eds-expose")

        # (c) two user networks
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-two-nets",
            "--network",
            "eds-net1",
            "--network-alias",
            "api-a",
            "--label",
            "eds.group=api",
            "--label",
            "eds.port=8080",
            engine.image,
            "sleep",
            "3600",
        )
        r.docker("network", "connect", "--alias", "api-b", "eds-net2", "eds-two-nets")
        r.save("two-networks.json", "eds-two-nets")

        # (d) published ports
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-published",
            "--network",
            "eds-net1",
            "-p",
            f"127.0.0.1:{PUBLISHED[0]}:8080",
            "-p",
            f"{PUBLISHED[1]}:9090",
            "--label",
            "eds.group=api",
            "--label",
            "eds.port=8080",
            engine.image,
            "sleep",
            "3600",
        )
        r.save("published-ports.json", "eds-published")

        # (e) one container with a HEALTHCHECK, in each state
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-health",
            "--network",
            "host",
            "--label",
            "eds.group=web",
            "--health-cmd",
            "test -f /healthy",
            "--health-interval",
            "2s",
            "--health-timeout",
            "1s",
            "--health-retries",
            "1",
            engine.image,
            "sleep",
            "3600",
        )
        info = r.save("health-starting.json", "eds-health")
        assert info["State"]["Health"]["Status"] == "starting", "re-run: the first check ran too soon"
        r.docker("exec", "eds-health", "touch", "/healthy")
        engine.wait_health("eds-health", "healthy", timeout=20)
        r.save("health-healthy.json", "eds-health")
        r.docker("exec", "eds-health", "rm", "/healthy")
        engine.wait_health("eds-health", "unhealthy", timeout=20)
        r.save("health-unhealthy.json", "eds-health")

        # (f) paused
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-paused",
            "--network",
            "host",
            "--label",
            "eds.group=web",
            engine.image,
            "sleep",
            "3600",
        )
        r.docker("pause", "eds-paused")
        r.save("paused.json", "eds-paused")

        # (g) exited (stopped cleanly)
        r.docker(
            "run",
            "-d",
            "--name",
            "eds-exited",
            "--network",
            "host",
            "--label",
            "eds.group=web",
            engine.image,
            "sh",
            "-c",
            'trap "exit 0" TERM; sleep 3600 & wait',
        )
        r.docker("stop", "eds-exited")
        r.save("exited.json", "eds-exited")

        # the API's container list (what a source sees from GET /containers/json), all of the above
        print("GET /v1.41/containers/json?all=1  -> containers-list.json")
        listing = engine.api_get("/v1.41/containers/json?all=1")
        (HERE / "containers-list.json").write_text(json.dumps(listing, indent=2) + "\n")

        # ---- events (the containers above are removed first: their health checks would add events)
        r.docker(
            "rm",
            "-f",
            "eds-host",
            "eds-expose",
            "eds-two-nets",
            "eds-published",
            "eds-health",
            "eds-paused",
            "eds-exited",
        )
        time.sleep(1.1)  # a clean second boundary before the window
        since = time.time()
        print(f"# events window starts at {since:.6f}")
        r.backend("ev-drain", {"eds.group": "web"}, drain=1.0)
        r.docker("stop", "-t", "10", "ev-drain")
        r.backend("ev-kill", {"eds.group": "web"})
        r.docker("kill", "ev-kill")
        r.backend("ev-pause", {"eds.group": "web"})
        r.docker("pause", "ev-pause")
        r.docker("unpause", "ev-pause")
        r.backend("ev-rename", {"eds.group": "web"})
        r.docker("rename", "ev-rename", "ev-renamed")
        r.docker(
            "run",
            "-d",
            "--name",
            "ev-net",
            "--network",
            "eds-net1",
            "--label",
            "eds.group=api",
            engine.image,
            "sleep",
            "3600",
        )
        r.docker("network", "connect", "eds-net2", "ev-net")
        r.docker("network", "disconnect", "eds-net2", "ev-net")
        r.backend(
            "ev-health",
            {"eds.group": "web"},
            health=[
                "--health-cmd",
                "test -f /healthy",
                "--health-interval",
                "1s",
                "--health-timeout",
                "1s",
                "--health-retries",
                "1",
            ],
        )
        engine.wait_health("ev-health", "unhealthy", timeout=20)
        r.docker("exec", "ev-health", "touch", "/healthy")
        engine.wait_health("ev-health", "healthy", timeout=20)
        r.docker("exec", "ev-health", "rm", "/healthy")
        engine.wait_health("ev-health", "unhealthy", timeout=20)
        r.docker("rm", "-f", "ev-renamed")
        r.docker("rm", "ev-kill")
        time.sleep(0.5)
        until = time.time()
        print(f"# events window ends at {until:.6f}")
        print(f"docker events --since {since:.6f} --until {until:.6f} --format '{{{{json .}}}}'  -> events.jsonl")
        raw = engine.cli(
            "events", "--since", f"{since:.6f}", "--until", f"{until:.6f}", "--format", "{{json .}}"
        )  # the CLI's lines as they are
        lines = [line for line in raw.splitlines() if line.strip()]
        for line in lines:
            json.loads(line)
        (HERE / "events.jsonl").write_text("\n".join(lines) + "\n")
        print(f"  {len(lines)} events")


if __name__ == "__main__":
    main()
