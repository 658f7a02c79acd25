"""`health_check:` in the upstreams file: applied to every endpoint of its group, bad input named by
file, line and field, and kept through the one-endpoint splice path."""

from __future__ import annotations

import pytest

from eds_server import upstreams
from eds_server.health.spec import HealthSpec

GOOD = """groups:
  web:
    health_check: {http: /health, interval: 1s, timeout: 500ms, healthy_threshold: 2, unhealthy_threshold: 2}
    endpoints:
      - {address: 127.0.0.1, port: 80}
      - {address: 127.0.0.2, port: 80}
  plain:
    endpoints: [127.0.0.3:80]
"""


def test_every_endpoint_of_the_group_gets_the_check() -> None:
    groups = upstreams.parse(GOOD, "u.yaml")
    want = HealthSpec("http", path="/health", interval=1.0, timeout=0.5, healthy_threshold=2, unhealthy_threshold=2)
    assert {ep.check for ep in groups["web"].endpoints} == {want}
    assert groups["plain"].endpoints[0].check is None


def test_a_spliced_endpoint_keeps_its_groups_check() -> None:
    parser = upstreams.Parser()
    parser.parse(GOOD, "u.yaml")
    groups = parser.parse(GOOD.replace("127.0.0.2, port: 80", "127.0.0.2, port: 81"), "u.yaml")
    assert parser.spliced and groups["web"].endpoints[1].port == 81
    assert groups["web"].endpoints[1].check == groups["web"].endpoints[0].check is not None


@pytest.mark.parametrize(
    ("check", "expected"),
    [
        ("      htpp: /health\n", "u.yaml:4: groups.web.health_check.htpp: unknown key (expected one of: http, tcp"),
        (
            "      http: health\n",
            "u.yaml:4: groups.web.health_check.http: 'health' is not a request path: it starts "
            "with / and has no spaces (write /health)",
        ),
        (
            "      http: /h\n      unhealthy_threshold: 0\n",
            "u.yaml:5: groups.web.health_check.unhealthy_threshold: 0 is not a count of checks in a row (1-100)",
        ),
        ("      interval: 1s\n", "u.yaml:4: groups.web.health_check.http: exactly one kind"),
        (
            "      http: /h\n      interval: 1s\n      timeout: 2s\n",
            "u.yaml:6: groups.web.health_check.timeout: 2s is longer than the interval (1s)",
        ),
        ("      tcp: true\n      http: /\n", "u.yaml:5: groups.web.health_check.http: exactly one kind"),
    ],
)
def test_bad_input_names_file_line_and_field(check: str, expected: str) -> None:
    text = f"groups:\n  web:\n    health_check:\n{check}    endpoints: [127.0.0.1:80]\n"
    with pytest.raises(upstreams.UpstreamsError) as e:
        upstreams.parse(text, "u.yaml")
    assert len(e.value.problems) == 1 and str(e.value).startswith(expected), str(e.value)
