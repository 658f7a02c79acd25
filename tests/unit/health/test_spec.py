"""Health check specs: what is accepted, and what each refusal says."""

from __future__ import annotations

import pytest

from eds_server.health import spec
from eds_server.health.spec import HealthSpec, SpecError


def test_the_documented_form() -> None:
    got = spec.parse(
        {
            "http": "/health",
            "interval": "1s",
            "timeout": "500ms",
            "healthy_threshold": 2,
            "unhealthy_threshold": 2,
            "port": 9000,
            "expected_statuses": [200, "300-302"],
        }
    )
    assert got == HealthSpec(
        "http",
        path="/health",
        port=9000,
        interval=1.0,
        timeout=0.5,
        healthy_threshold=2,
        unhealthy_threshold=2,
        expected_statuses=((200, 200), (300, 302)),
    )
    assert got.expects(301) and not got.expects(500) and not got.expects(204)


def test_other_kinds_and_defaults() -> None:
    assert spec.parse({"tcp": True}) == HealthSpec("tcp")
    assert spec.parse({"grpc": {"service": "shop.Cart"}}) == HealthSpec("grpc", service="shop.Cart")
    assert spec.parse({"grpc": "true"}) == HealthSpec("grpc")
    assert spec.parse({"none": True}) is None
    https = spec.parse({"http": "/h", "tls": "true"})
    assert https == HealthSpec("http", path="/h", tls=True) and https.describe().startswith("https /h")
    assert spec.parse(spec.to_json(https)) == https
    grpcs = spec.parse({"grpc": "shop.Cart", "tls": True})
    assert grpcs == HealthSpec("grpc", service="shop.Cart", tls=True) and grpcs.describe().startswith("grpc tls shop")
    assert spec.parse(spec.to_json(grpcs)) == grpcs
    assert spec.parse({"http": "/", "interval": 0.5}).timeout == 0.5  # type: ignore[union-attr]
    labels = spec.parse({"http": "/h", "healthy_threshold": "3", "expected_statuses": "200,204"})
    assert labels is not None and labels.healthy_threshold == 3 and labels.expected_statuses == ((200, 200), (204, 204))


@pytest.mark.parametrize(
    ("raw", "field", "says"),
    [
        ({"htpp": "/health"}, "htpp", "unknown key"),
        ({"http": "health"}, "http", "write /health"),
        ({"http": "/a b"}, "http", "no spaces"),
        ({"http": "/", "unhealthy_threshold": 0}, "unhealthy_threshold", "1-100"),
        ({"http": "/", "interval": "fast"}, "interval", "write 1s"),
        ({"http": "/", "interval": "1s", "timeout": "2s"}, "timeout", "longer than the interval"),
        ({"http": "/", "tcp": True}, "tcp", "exactly one kind"),
        ({"interval": "1s"}, "http", "exactly one kind"),
        ({"tcp": True, "expected_statuses": [200]}, "expected_statuses", "only for http"),
        ({"http": "/", "expected_statuses": [700]}, "expected_statuses", "100-599"),
        ({"http": "/", "port": 0}, "port", "a port"),
        ({"tcp": "no"}, "tcp", "write true"),
        ({"tcp": True, "tls": True}, "tls", "only for http and grpc"),
    ],
)
def test_refusals_name_the_field(raw: dict[str, object], field: str, says: str) -> None:
    with pytest.raises(SpecError) as e:
        spec.parse(raw)
    assert e.value.field == field and says in str(e.value), str(e.value)


def test_a_spec_hashed_once_still_hashes_as_its_fields_do() -> None:
    """The hash is kept from construction: equal specs hash equal, every field tells specs apart, and
    a spec pickled or copied hashes as one made afresh."""
    import copy
    import dataclasses
    import pickle

    a = HealthSpec("http", path="/health", interval=1.0)
    assert hash(a) == hash(HealthSpec("http", path="/health", interval=1.0)) and {a: 1}[dataclasses.replace(a)] == 1
    edits = {
        "kind": "tcp",
        "path": "/other",
        "service": "s",
        "port": 9000,
        "interval": 2.0,
        "timeout": 0.5,
        "healthy_threshold": 3,
        "unhealthy_threshold": 4,
        "expected_statuses": ((200, 200),),
        "tls": True,
    }
    assert set(edits) == {f.name for f in dataclasses.fields(HealthSpec) if f.compare}
    for name, value in edits.items():
        b = dataclasses.replace(a, **{name: value})
        assert b != a and hash(b) != hash(a) and a not in {b}, name
    for again in (pickle.loads(pickle.dumps(a)), copy.copy(a), copy.deepcopy(a)):
        assert again == a and hash(again) == hash(a) and {a: 1}[again] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a._hash = 0  # type: ignore[misc]
