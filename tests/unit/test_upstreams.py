"""The upstreams file (upstreams.py): the documented shape, every kind of bad input named by line and
field, the input bounds and incremental parsing.

Bounds, so a hostile or huge file cannot freeze or exhaust the server: regular files only (no FIFO,
no device behind a symlink), a size limit, no anchors or aliases, and `eds-server check` gives the
verdict the server gives. Incremental parsing, so an edit of a big file costs what changed: a
re-parse reuses the groups and endpoints whose text did not change, and gives exactly what a fresh
parse gives, problems and their lines included.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, note
from hypothesis import strategies as st

from eds_server import upstreams, yaml_nodes
from eds_server.encode import encode_group
from eds_server.model import Endpoint, Health, Locality
from eds_server.sources.upstreams_file import UpstreamsFileSource
from eds_server.store import Store
from tests.support.feeds import alone
from tests.support.strategies import examples, gen_files, render
from tests.support.upstreams_files import BOMB, DOCUMENTED


def problems(text: str) -> list[str]:
    with pytest.raises(upstreams.UpstreamsError) as e:
        upstreams.parse(textwrap.dedent(text), "upstreams.yaml")
    return [str(p) for p in e.value.problems]


def test_documented_shape() -> None:
    groups = upstreams.parse(DOCUMENTED)
    web = groups["web"]
    assert web.endpoints[0] == Endpoint("10.0.0.5", 8080)
    assert web.endpoints[1] == Endpoint(
        "10.0.0.6",
        8080,
        weight=3,
        health=Health.DRAINING,
        priority=0,
        locality=Locality("eu-west-1", "eu-west-1a"),
        hostname="web-2",
        metadata={"version": "v2"},
    )
    assert web.locality_weights == {Locality("eu-west-1", "eu-west-1a"): 2}


def test_ipv6_and_empty_groups() -> None:
    groups = upstreams.parse(
        "groups:\n  a:\n    endpoints: ['[2001:DB8::1]:80', {address: '::1', port: 81}]\n  c: {endpoints: []}\n"
    )
    assert [e.key for e in groups["a"].endpoints] == [("2001:db8::1", 80), ("::1", 81)]
    assert groups["c"].endpoints == ()
    assert upstreams.parse("groups: {}") == upstreams.parse("groups:") == {}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "groups:\n  web:\n    endpoints:\n      - 10.0.0.1:99999\n",
            "upstreams.yaml:4: groups.web.endpoints[0]: '99999' is not a port (1-65535)",
        ),
        # what YAML accepts and reads otherwise than it looks: refused, each saying how to write it
        (
            'groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, weight: "2"}\n',
            'upstreams.yaml:4: groups.web.endpoints[0].weight: "2" is quoted text, not a number: '
            "write it without quotes",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - 10.0.0.2: 80\n",
            "upstreams.yaml:4: groups.web.endpoints[0]: `10.0.0.2: 80` reads as a mapping in YAML (the space after the "
            "colon): write 10.0.0.2:80",
        ),
        (
            "groups:\n  web:\n    endpoints: ['10.0.0.2: 80']\n",
            "upstreams.yaml:3: groups.web.endpoints[0]: '10.0.0.2: 80' is not ADDRESS:PORT (no spaces: '10.0.0.2:80')",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 080}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].port: '080' is not a port (1-65535): write it without leading "
            "zeros",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 0120}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].port: 0120 is not a decimal number",
        ),
        (
            "groups:\n  web:\n    endpoints: [10.0.0.1:080]\n",
            "upstreams.yaml:3: groups.web.endpoints[0]: '080' is not a port (1-65535): write it without leading zeros",
        ),
        (
            "groups:\n  web:\n  api: {endpoints: []}\n",
            "upstreams.yaml:2: groups.web: empty (null): write `web: {endpoints: []}` for a group with no endpoints",
        ),
        (
            "groups:\n  web:\n    endpoints:\n",
            "upstreams.yaml:3: groups.web.endpoints: empty (null): write `endpoints: []`",
        ),
        # messages speak YAML, and name the key that was meant
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: }\n",
            "upstreams.yaml:4: groups.web.endpoints[0].port: null (an empty value) is not a port (1-65535)",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: true}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].port: true is not a port (1-65535)",
        ),
        (
            "groups:\n  api: [10.0.0.1:80]\n",
            "upstreams.yaml:2: groups.api: must be a mapping, not a list: did you mean `api: {endpoints: [...]}`?",
        ),
        (
            "groups:\n  web:\n    hosts: [10.0.0.1:80]\n",
            "upstreams.yaml:3: groups.web.hosts: unknown key (expected one of: endpoints, localities, health_check); "
            "did you mean `endpoints`?",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, wieght: 2}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].wieght: unknown key (expected one of: address, port, weight, "
            "health, priority, region, zone, subzone, hostname, metadata); did you mean `weight`?",
        ),
        (
            "groups:\n  web:\n    endpoints: [10.0.0.1:80\n",
            "upstreams.yaml:4:1: not valid YAML: did not find expected ',' or ']', while parsing a flow sequence "
            "(from line 3)",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 1}\n"
            "      - address: 10.0.0.2\n        port: 99999\n",
            "upstreams.yaml:6: groups.web.endpoints[1].port: 99999 is not a port (1-65535)",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - backend.local:80\n",
            "upstreams.yaml:4: groups.web.endpoints[0]: 'backend.local' is not an IP address",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, weight: 0}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].weight: 0 is not a weight",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, health: ok}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].health: 'ok' is not a health status",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - 10.0.0.1:80\n      - {address: 10.0.0.1, port: 80}\n",
            "upstreams.yaml:5: groups.web.endpoints[1]: duplicate endpoint 10.0.0.1:80",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, wieght: 2}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].wieght: unknown key",
        ),
        ("groups:\n  web:\n    endpionts: []\n", "upstreams.yaml:3: groups.web.endpionts: unknown key"),
        ("grups: {}\n", "upstreams.yaml:1: grups: unknown key"),
        ("groups:\n  web: {}\n  web: {}\n", "upstreams.yaml:3: groups.web: duplicate key"),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].port: missing",
        ),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, priority: 129}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].priority: 129 is not a priority (0-128)",
        ),
        (
            "groups:\n  web:\n    endpoints: [10.0.0.1:80]\n    localities: [{region: r}]\n",
            "upstreams.yaml:4: groups.web.localities[0].weight: missing",
        ),
        ("groups:\n  web:\n    endpoints: 10.0.0.1:80\n", "upstreams.yaml:3: groups.web.endpoints: must be a list"),
        ("groups:\n  web:\n    endpoints: [10.0.0.1:80\n", "upstreams.yaml:4:1: not valid YAML"),
        ("", "upstreams.yaml:1: file is empty"),
        (
            "groups:\n  web:\n    endpoints:\n      - {address: 10.0.0.1, port: 80, metadata: [1]}\n",
            "upstreams.yaml:4: groups.web.endpoints[0].metadata: must be a mapping",
        ),
    ],
)
def test_each_problem_names_file_line_and_field(text: str, expected: str) -> None:
    found = problems(text)
    assert any(p.startswith(expected) for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems("groups:\n  a:\n    endpoints: [example.com:80]\n  b:\n    endpoints: ['10.0.0.1:0']\n")
    assert [p.split(":")[1] for p in found] == ["3", "5"]


def test_weight_sum_over_uint32_is_refused() -> None:
    big = 2**32 - 1
    found = problems(
        f"groups:\n  web:\n    endpoints:\n      - {{address: 10.0.0.1, port: 1, weight: {big}}}\n"
        f"      - {{address: 10.0.0.2, port: 1, weight: 1}}\n"
    )
    assert "add up to" in found[0]


def test_unreadable_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(upstreams.UpstreamsError, match="cannot read"):
        upstreams.load(str(tmp_path / "missing.yaml"))


VALID = "groups:\n  web:\n    endpoints: [127.0.0.1:8080]\n"


def in_thread(fn: Callable[[], object], timeout: float = 20) -> object:
    """Run `fn` with a bound, so a read that blocks (a FIFO) fails the test instead of hanging it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn).result(timeout)
    finally:
        pool.shutdown(wait=False)


def problems_of(fn: Callable[[], object]) -> list[str]:
    with pytest.raises(upstreams.UpstreamsError) as e:
        in_thread(fn)
    return [str(p) for p in e.value.problems]


# -- anchors and aliases -------------------------------------------------------------------------
def test_libyaml_is_used() -> None:
    """The C loader is ~20x faster; the pure-Python fallback gives the same results, slowly."""
    assert yaml_nodes.LIBYAML


@pytest.mark.parametrize(
    ("text", "line", "what"),
    [
        (BOMB, 7, "anchor 'a0'"),
        ("groups:\n  web:\n    endpoints:\n      - &ep 127.0.0.1:80\n", 4, "anchor 'ep'"),
        ("groups:\n  web: {}\n  other: *web\n", 3, "alias 'web'"),  # an undefined alias: still an alias
    ],
)
def test_anchors_and_aliases_are_refused_with_their_line(text: str, line: int, what: str) -> None:
    [p] = problems_of(lambda: upstreams.parse(text, "up.yaml"))
    assert p.startswith(f"up.yaml:{line}: YAML {what}: anchors and aliases are not allowed"), p


def test_stars_and_ampersands_in_values_are_fine() -> None:
    text = "groups:\n  web:\n    endpoints:\n      - {address: 127.0.0.1, port: 80, metadata: {p: 'a*b&c'}}\n"
    assert upstreams.parse(text)["web"].endpoints[0].metadata == {"p": "a*b&c"}


# -- what is read ----------------------------------------------------------------------------------
def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    os.mkfifo(path)  # no writer: a plain open() would block forever
    [p] = problems_of(lambda: upstreams.read(str(path)))
    assert p == f"{path}: not a regular file (a FIFO or a device)"


def test_a_symlink_to_a_device_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    os.symlink("/dev/zero", path)
    [p] = problems_of(lambda: upstreams.read(str(path)))
    assert "not a regular file" in p


def test_a_symlink_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    (tmp_path / "real.yaml").write_text(VALID)
    os.symlink("real.yaml", tmp_path / "upstreams.yaml")  # ConfigMap mounts are symlinks
    assert upstreams.load(str(tmp_path / "upstreams.yaml"))["web"].endpoints


def test_size_limit(tmp_path: Path) -> None:
    path = tmp_path / "upstreams.yaml"
    path.write_text(VALID)
    assert upstreams.read(str(path), max_size=len(VALID)) == VALID.encode()
    [p] = problems_of(lambda: upstreams.read(str(path), max_size=len(VALID) - 1))
    assert p == f"{path}: larger than {len(VALID) - 1} bytes (raise the limit with --max-upstreams-size)"


# -- `check` and the server agree -----------------------------------------------------------------
def _case(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "upstreams.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text({"valid": VALID, "bomb": BOMB, "too-big": VALID + "#" * 200, "bad": VALID + "x: 1\n"}[kind])
    return path


@pytest.mark.parametrize("kind", ["valid", "bomb", "fifo", "dev-zero", "directory", "too-big", "bad"])
def test_check_gives_the_servers_verdict(tmp_path: Path, kind: str) -> None:
    path = _case(tmp_path, kind)
    limit = ["--max-upstreams-size", str(len(VALID) + 100)]
    checked = subprocess.run(
        [sys.executable, "-m", "eds_server", "check", str(path), *limit], capture_output=True, text=True, timeout=60
    )
    source = alone(UpstreamsFileSource, Store(encode_group), str(path), max_size=len(VALID) + 100)
    try:
        in_thread(source.load)
        server_problems = None
    except upstreams.UpstreamsError as e:
        server_problems = [str(p) for p in e.problems]
    if kind == "valid":
        assert checked.returncode == 0 and server_problems is None
    else:
        assert checked.returncode == 1 and server_problems
        assert checked.stderr.splitlines() == server_problems  # the same words, not only the same verdict


# -- incremental parsing ----------------------------------------------------------------------------
def file_text(groups: dict[str, list[str]]) -> str:
    out = ["groups:"]
    for name, eps in groups.items():
        out.append(f"  {name}:\n    endpoints:")
        out += [f"      - {{address: {ep}, port: 8080, weight: 1}}" for ep in eps]
    return "\n".join(out) + "\n"


def test_unchanged_groups_and_endpoints_are_reused() -> None:
    eps = [f"10.0.0.{i}" for i in range(1, 101)]
    groups = {"a": eps, "b": [f"10.0.2.{i}" for i in range(10)], "c": [f"10.0.3.{i}" for i in range(5)]}
    parser = upstreams.Parser()
    first = parser.parse(file_text(groups))
    assert parser.reused_groups == parser.reused_endpoints == 0
    groups["b"] = [*groups["b"][:9], "10.0.1.1"]  # one endpoint of b changes
    second = parser.parse(file_text(groups))
    assert parser.reused_groups == 2  # a and c: not walked at all
    assert parser.reused_endpoints == 9  # b: only its changed endpoint is checked
    assert second["a"] is first["a"] and second["c"] is first["c"]
    assert second == upstreams.parse(file_text(groups))


def test_an_edit_inside_one_flow_mapping_endpoint_is_spliced() -> None:
    eps = [f"10.0.0.{i}" for i in range(1, 101)]
    text = file_text({"a": eps, "b": eps[:3]})
    parser = upstreams.Parser()
    first = parser.parse(text)
    assert not parser.spliced
    for edit in (
        text.replace("10.0.0.7, port: 8080, weight: 1", "10.0.0.7, port: 8080, weight: 5"),
        text.replace("10.0.0.7, port: 8080, weight: 1", "10.0.0.7, port: 8080, weight: 5, health: draining"),
        text.replace("10.0.0.7, port: 8080, weight: 1", "10.0.9.9, port: 81"),
    ):
        got = parser.parse(edit)
        assert parser.spliced and got["b"] is first["b"]
        assert got == upstreams.parse(edit)
    # a problem, a duplicate, a comment or a second line inside the mapping: the full path, exact words
    for edit, spliced in (
        (text.replace("10.0.0.8, port: 8080", "10.0.0.8, port: 0"), False),
        (text.replace("10.0.0.8, port: 8080", "10.0.0.9, port: 8080"), False),
        (text.replace("10.0.0.8, port: 8080, weight: 1}", "10.0.0.8, port: 8080, weight: 1} # x"), False),
        (text.replace("10.0.0.8, port: 8080,", "10.0.0.8,\n        port: 8080,"), False),
    ):
        parser = upstreams.Parser()
        parser.parse(text)
        assert outcome(parser.parse, edit) == outcome(upstreams.parse, edit) and parser.spliced == spliced


def outcome(parse: Callable[[str, str], Any], text: str) -> object:
    """What a parse gives: the groups, or its problems as text."""
    try:
        return parse(text, "up.yaml")
    except upstreams.UpstreamsError as e:
        return [str(p) for p in e.problems]


SPLICE_NOISE = [
    "}",
    "{",
    ",",
    ":",
    " ",
    "#",
    "\n",
    "'",
    '"',
    "[",
    "]",
    "&a ",
    "*a",
    "!!str ",
    "0",
    "9",
    "weight: 2",
    "port",
    "health: draining",
    "10.0.0.1",
    "::1",
    "\t",
    "- ",
]


@examples(300)
@given(st.data())
def test_splicing_gives_what_a_fresh_parse_gives(data: st.DataObject) -> None:
    """Random edits, each inside or around one endpoint's flow mapping, applied one after another."""
    text = file_text({"a": ["10.0.0.1", "10.0.0.2", "10.0.0.3"], "b": ["10.0.0.4"]})
    parser = upstreams.Parser()
    parser.parse(text)
    for _ in range(3):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 6))
        noise = data.draw(st.lists(st.sampled_from(SPLICE_NOISE), max_size=3).map("".join))
        text = text[:at] + noise + text[at + cut :]
        note(repr(text))
        assert outcome(parser.parse, text) == outcome(upstreams.parse, text)


def test_reuse_keeps_problems_and_their_lines() -> None:
    parser = upstreams.Parser()
    good = file_text({"a": ["10.0.0.1"], "b": ["10.0.0.2"]})
    parser.parse(good)
    bad = good.replace("10.0.0.2, port: 8080", "10.0.0.2, port: 0")
    with pytest.raises(upstreams.UpstreamsError) as e:
        parser.parse(bad, "up.yaml")
    assert [str(p) for p in e.value.problems] == ["up.yaml:7: groups.b.endpoints[0].port: 0 is not a port (1-65535)"]
    # a group moved down by an edit above it is reused, and a problem below still names its own line
    moved = "groups:\n  new: {endpoints: [10.0.0.9:1]}\n" + bad.removeprefix("groups:\n")
    with pytest.raises(upstreams.UpstreamsError) as e:
        parser.parse(moved, "up.yaml")
    assert [p.line for p in e.value.problems] == [8] and parser.reused_groups == 1


def test_regression_an_endpoint_with_a_problem_is_never_reused() -> None:
    """An unknown key still yields an Endpoint (and a problem): it must not be remembered as valid."""
    bad = "groups:\n  a:\n    endpoints:\n      - {address: 10.0.0.3, port: 8080, eight: 1}\n"
    parser = upstreams.Parser()
    for _ in range(2):
        with pytest.raises(upstreams.UpstreamsError, match="eight: unknown key"):
            parser.parse(bad)


def test_the_same_text_at_another_indentation_is_not_reused() -> None:
    parser = upstreams.Parser()
    parser.parse("groups:\n  a:\n    endpoints:\n    - 10.0.0.1:80\n")
    groups = parser.parse("groups:\n    a:\n        endpoints:\n        - 10.0.0.1:80\n")
    assert parser.reused_endpoints == 0 and groups["a"].endpoints[0].port == 80


@examples(60, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_a_parser_with_history_gives_what_a_fresh_parse_gives(data: st.DataObject) -> None:
    parser = upstreams.Parser()
    for _ in range(3):
        text = render(data.draw, data.draw(gen_files()))
        note(text)
        assert outcome(parser.parse, text) == outcome(upstreams.parse, text)


@examples(300)
@given(st.text("ab", max_size=40), st.text("ab", max_size=40), st.integers(1, 8))
def test_common_suffix_in_chunks(a: str, b: str, step: int) -> None:
    """The splice's suffix scan, chunked and without reversed copies, finds the common suffix."""
    expected = next((i for i, (x, y) in enumerate(zip(a[::-1], b[::-1], strict=False)) if x != y), min(len(a), len(b)))
    assert upstreams._common_suffix(a, b, step) == expected
