"""Upstreams file texts more than one test reads: the shape the docs show, and a YAML alias bomb."""

from __future__ import annotations

DOCUMENTED = """\
groups:
  web:                       # = the Envoy cluster name, or its eds_cluster_config.service_name
    endpoints:
      - 10.0.0.5:8080        # shorthand host:port ([v6]:port for IPv6)
      - address: 10.0.0.6
        port: 8080
        weight: 3            # load_balancing_weight, >= 1
        health: draining     # healthy | unhealthy | draining | timeout | degraded | unknown
        region: eu-west-1    # locality: region, zone, subzone
        zone: eu-west-1a
        priority: 0
        hostname: web-2
        metadata: {version: v2}   # filter_metadata["envoy.lb"], for Envoy's subset load balancing
    localities:              # optional: per-locality load_balancing_weight (locality-weighted LB)
      - {region: eu-west-1, zone: eu-west-1a, weight: 2}
"""

# The "billion laughs": 9 levels of 10 aliases, ~10^9 strings once expanded, in ~600 bytes
BOMB = (
    "groups:\n  web:\n    endpoints:\n      - address: 127.0.0.1\n        port: 80\n        metadata:\n"
    "          a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    + "".join(f"          a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))
)
