"""`serve`'s options for where the groups come from: the upstreams file, Docker, Swarm, Kubernetes,
and a relay of another eds-server (the registrations: options/registrations.py)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ..fields import MAX_UPSTREAMS_SIZE
from .parsing import Option, Refused, duration, host_port, ip, optional_duration, positive_int

if TYPE_CHECKING:
    from ..settings import SourceSettings
    from ..sources.kubernetes_map import KubernetesOptions

OPTIONS = (
    Option("--upstreams", "upstreams YAML file, watched for changes [EDS_UPSTREAMS]", metavar="FILE"),
    Option(
        "--startup-timeout",
        "answer Envoy after this even if a source never loaded (risk: Envoy drops the "
        "endpoints that source would give), or 'off': wait for every source [EDS_STARTUP_TIMEOUT] (default off)",
        "off",
        optional_duration,
        "DURATION",
    ),
    Option(
        "--debounce", "coalesce bursts of source changes into one version (default 50ms)", "50ms", duration, "DURATION"
    ),
    Option(
        "--max-upstreams-size",
        "largest upstreams file read; a bigger one is refused like a bad one [EDS_MAX_UPSTREAMS_SIZE] (default 4 MiB)",
        str(MAX_UPSTREAMS_SIZE),
        positive_int,
        "BYTES",
    ),
    # Docker discovery
    Option("--docker", "follow labelled containers [EDS_DOCKER=1]", kind="switch"),
    Option("--swarm", "follow labelled Swarm services, from a manager [EDS_SWARM=1]", kind="switch"),
    Option("--docker-host", "engine address (default: DOCKER_HOST, else the local socket)", metavar="URL"),
    Option("--docker-label-prefix", "label prefix (default eds)", "eds", metavar="PREFIX"),
    Option("--docker-network", "network whose address is used when a container has several", metavar="NAME"),
    Option(
        "--docker-host-address",
        "address of host-network (and published) ports (default 127.0.0.1)",
        "127.0.0.1",
        ip,
        "IP",
    ),
    Option(
        "--docker-address-mode",
        "container IP and port (network), or the published host port (published)",
        "network",
        choices=["network", "published"],
    ),
    # Kubernetes discovery
    Option("--kubernetes", "follow annotated Services and their EndpointSlices [EDS_KUBERNETES=1]", kind="switch"),
    Option(
        "--kubernetes-namespace",
        "follow only this namespace, repeatable (the variable takes a comma list); a "
        "namespaced Role is then enough (default: all namespaces)",
        metavar="NS",
        kind="list",
    ),
    Option(
        "--kubeconfig", "kubeconfig file (default: KUBECONFIG, else in-cluster, else ~/.kube/config)", metavar="FILE"
    ),
    Option(
        "--kubernetes-node-regions",
        "read Nodes for the locality region (topology.kubernetes.io/region); needs "
        "list/watch on nodes [EDS_KUBERNETES_NODE_REGIONS=1]",
        kind="switch",
    ),
    Option(
        "--kubernetes-annotation-prefix",
        "Service annotation prefix (default eds: eds.group, eds.port, ...)",
        "eds",
        metavar="PREFIX",
    ),
    # a relay (tiers; --workers N's workers are relays of their owner)
    Option(
        "--upstream-eds",
        "be a relay: serve the groups of the eds-server at HOST:PORT (over delta xDS, only the "
        "names asked for here, versions unchanged); takes no other source [EDS_UPSTREAM_EDS]",
        type=host_port,
        metavar="HOST:PORT",
    ),
    Option(
        "--upstream-eds-ca",
        "CA certificates to verify the upstream's (turns TLS to it on) [EDS_UPSTREAM_EDS_CA]",
        metavar="FILE",
    ),
    Option(
        "--upstream-eds-cert", "client certificate for the upstream (mTLS), PEM [EDS_UPSTREAM_EDS_CERT]", metavar="FILE"
    ),
    Option(
        "--upstream-eds-key", "its private key (default: in --upstream-eds-cert) [EDS_UPSTREAM_EDS_KEY]", metavar="FILE"
    ),
)


def settings(args: argparse.Namespace) -> SourceSettings:
    """The sources asked for, or Refused: a relay with another source, no source at all, Kubernetes
    that cannot work as started."""
    from ..settings import SourceSettings
    from ..sources.containers import DockerOptions
    from ..sources.relay import UpstreamOptions

    local = {
        "--upstreams": args.upstreams,
        "--docker": args.docker,
        "--swarm": args.swarm,
        "--kubernetes": args.kubernetes,
        "--state": args.state,
        "--admin-token": args.admin_token,
        "--registration-tokens": args.registration_tokens,
    }
    given = [flag for flag, value in local.items() if value]
    if args.upstream_eds is not None and given:
        raise Refused(
            f"--upstream-eds serves its upstream's groups unchanged (versions included) and takes no other "
            f"source: drop {', '.join(given)}, or give it to the upstream eds-server"
        )
    if args.upstream_eds is None and (args.upstream_eds_ca or args.upstream_eds_cert or args.upstream_eds_key):
        raise Refused("--upstream-eds-ca, --upstream-eds-cert and --upstream-eds-key need --upstream-eds")
    if args.upstream_eds is None and not given:
        raise Refused(
            "no source of endpoints: give --upstreams FILE, --docker, --swarm, --kubernetes and/or --state "
            "FILE with --admin-token (EDS_UPSTREAMS, EDS_DOCKER, EDS_SWARM, EDS_KUBERNETES, EDS_STATE, "
            "EDS_ADMIN_TOKEN), or --upstream-eds HOST:PORT to relay another eds-server"
        )
    kubernetes = _kubernetes(args) if args.kubernetes else None
    docker = DockerOptions(
        label_prefix=args.docker_label_prefix,
        network=args.docker_network,
        host_address=args.docker_host_address,
        address_mode=args.docker_address_mode,
    )
    relay = None
    if args.upstream_eds is not None:
        host, port = args.upstream_eds
        relay = UpstreamOptions(
            host, port, ca=args.upstream_eds_ca, cert=args.upstream_eds_cert, key=args.upstream_eds_key
        )
    return SourceSettings(
        upstreams=args.upstreams,
        max_upstreams_size=args.max_upstreams_size,
        docker=docker if args.docker else None,
        swarm=docker if args.swarm else None,
        docker_host=args.docker_host,
        kubernetes=kubernetes,
        upstream_eds=relay,
        debounce=args.debounce,
        startup_timeout=args.startup_timeout,
    )


def _kubernetes(args: argparse.Namespace) -> KubernetesOptions:
    """--kubernetes's options, or Refused when it could never work as started."""
    from ..sources.kubernetes_map import KubernetesOptions

    if args.kubeconfig and not os.path.isfile(args.kubeconfig):
        raise Refused(f"not starting: --kubeconfig {args.kubeconfig}: no such file")
    if not _installed("kubernetes_asyncio"):
        raise Refused("--kubernetes needs the kubernetes extra: pip install 'eds-server[kubernetes]'")
    from ..sources.kubernetes_config import missing_configuration

    if nothing := missing_configuration(args.kubeconfig):
        raise Refused(f"not starting: --kubernetes: {nothing}")
    return KubernetesOptions(
        annotation_prefix=args.kubernetes_annotation_prefix,
        namespaces=tuple(dict.fromkeys(args.kubernetes_namespace)),
        kubeconfig=args.kubeconfig,
        node_regions=args.kubernetes_node_regions,
    )


def _installed(module: str) -> bool:
    """Whether an optional dependency can be imported, without importing it (kubernetes_asyncio: ~1 s)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
