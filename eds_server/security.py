"""TLS for the gRPC port, and the authorization file: which groups a client may read.

The authorization file (``--authz FILE``)::

    rules:
      - match: {san_uri: "spiffe://example.org/ns/shop/*"}   # any of san_uri, san_dns, node_id, node_cluster
        groups: ["shop-*", "common"]
    default: deny                                            # or allow

A client may read the groups of every rule it matches (all keys of a `match` must match). A client
no rule matches may read every group with `default: allow`, none with `default: deny` (the default).
Patterns are exact strings where `*` stands for any run of characters, `/` and `.` included.

`san_uri` and `san_dns` are the client certificate's subject alternative names, verified by the TLS
handshake (only with ``--tls-client-ca``). `node_id` and `node_cluster` are what the client *says*
in its first request: anyone can claim any node, so rules on them scope well-behaved clients and
are not security.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .yaml_nodes import NodeWalker, Problem, YamlError, compose

MATCH_KEYS = ("san_uri", "san_dns", "node_id", "node_cluster")
RULE_KEYS = ("match", "groups")
TOP_KEYS = ("rules", "default")
DEFAULTS = ("allow", "deny")
# TLS 1.2 suites HTTP/2 allows (RFC 9113 9.2.2: ephemeral key exchange, AEAD); TLS 1.3 is unaffected.
H2_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20"


class SecurityConfigError(Exception):
    """A TLS or authorization file is not usable; `problems` says why, one line each."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


# -- TLS ----------------------------------------------------------------------------------------


def _readable(path: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise SecurityConfigError([f"{what} {path}: {e.strerror or e}"]) from None


def _no_password() -> str:
    raise SecurityConfigError(["encrypted"])


def http_ssl_context(cert: str, key: str | None = None) -> ssl.SSLContext:
    """A server context for the admin port (HTTP/1.1): the gRPC port's certificate and key, TLS
    1.2+, no client certificates (the registration API's writes carry their tokens)."""
    grpc_ctx = server_ssl_context(cert, key)  # the same checks, the same one-line errors
    del grpc_ctx
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_alpn_protocols(["http/1.1"])
    ctx.load_cert_chain(cert, key, password=_no_password)
    return ctx


def server_ssl_context(cert: str, key: str | None = None, client_ca: str | None = None) -> ssl.SSLContext:
    """A server context for gRPC: TLS 1.2+, ALPN h2, and client certificates required (and checked
    against `client_ca`) when `client_ca` is given. `key` may be left out when `cert` holds it too.

    Raises SecurityConfigError naming the file that cannot be used.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_ciphers(H2_TLS12_CIPHERS)
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    ctx.set_alpn_protocols(["h2"])
    _readable(cert, "TLS certificate")
    if key is not None:
        _readable(key, "TLS key")
    try:
        ssl.create_default_context(cadata=Path(cert).read_text(errors="replace"))
    except (ssl.SSLError, ValueError):
        raise SecurityConfigError([f"TLS certificate {cert}: no PEM certificate in it"]) from None
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except SecurityConfigError:
        raise SecurityConfigError([f"TLS key {key or cert}: encrypted; give an unencrypted key"]) from None
    except ssl.SSLError as e:
        if "KEY_VALUES_MISMATCH" in str(e):
            why = f"does not match the certificate {cert}"
        else:
            why = "no usable PEM private key in it" + ("" if key else " (give --tls-key)")
        raise SecurityConfigError([f"TLS key {key or cert}: {why}"]) from None
    if client_ca is not None:
        _readable(client_ca, "TLS client CA")
        try:
            ctx.load_verify_locations(cafile=client_ca)
        except ssl.SSLError:
            raise SecurityConfigError([f"TLS client CA {client_ca}: no PEM certificate in it"]) from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_sans(cert: dict[str, Any] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(URI SANs, DNS SANs) of a verified peer certificate, as `SSLSocket.getpeercert()` gives it."""
    uris: list[str] = []
    dns: list[str] = []
    for kind, value in (cert or {}).get("subjectAltName", ()):
        if kind == "URI":
            uris.append(value)
        elif kind == "DNS":
            dns.append(value.lower())
    return tuple(uris), tuple(dns)


# -- authorization ------------------------------------------------------------------------------


class Glob:
    """A pattern where `*` is any run of characters and everything else stands for itself, matched
    in linear time: the literal pieces between stars are found left to right, each once, never
    retried (a regex backtracks: `*-*-*-prod` against a long name cost seconds).

    Leftmost-first is enough: if a piece can be placed anywhere after its predecessor, it can be
    placed at the earliest spot, and that leaves the most room for the pieces after it.
    """

    __slots__ = ("exact", "pattern", "pieces", "prefix", "suffix")
    steps = 0  # str.find calls made by every Glob, for tests that count work

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        parts = pattern.split("*")
        self.exact = len(parts) == 1
        self.prefix, self.suffix = parts[0], parts[-1]
        self.pieces = tuple(p for p in parts[1:-1] if p)

    def match(self, name: str) -> bool:
        if self.exact:
            return name == self.pattern
        prefix, suffix = self.prefix, self.suffix
        if len(name) < len(prefix) + len(suffix) or not name.startswith(prefix) or not name.endswith(suffix):
            return False
        pos, end = len(prefix), len(name) - len(suffix)
        for piece in self.pieces:
            Glob.steps += 1
            found = name.find(piece, pos, end)
            if found < 0:
                return False
            pos = found + len(piece)
        return True

    def __repr__(self) -> str:
        return f"Glob({self.pattern!r})"


class _AnyOf:
    def __init__(self, patterns: Iterable[str]) -> None:
        self.globs = tuple(Glob(p) for p in dict.fromkeys(patterns))

    def match(self, name: str) -> bool:
        return any(g.match(name) for g in self.globs)


def _any_of(patterns: Iterable[str]) -> _AnyOf | None:
    any_of = _AnyOf(patterns)
    return any_of if any_of.globs else None


@dataclass(frozen=True)
class Rule:
    match: dict[str, str]  # key of MATCH_KEYS -> pattern
    groups: tuple[str, ...]  # patterns
    _compiled: dict[str, Glob] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        compiled = {k: Glob(p.lower() if k == "san_dns" else p) for k, p in self.match.items()}
        object.__setattr__(self, "_compiled", compiled)

    def matches(self, uris: tuple[str, ...], dns: tuple[str, ...], node_id: str, node_cluster: str) -> bool:
        candidates = {"san_uri": uris, "san_dns": dns, "node_id": (node_id,), "node_cluster": (node_cluster,)}
        return all(any(p.match(v) for v in candidates[k]) for k, p in self._compiled.items())


class Access:
    """What one client may read; callable on a name. `str()` says who it is and why, for logs."""

    def __init__(self, allowed: _AnyOf | None, everything: bool, who: str) -> None:
        self._allowed = allowed
        self._everything = everything
        self.who = who

    def __call__(self, name: str) -> bool:
        if self._everything:
            return True
        return self._allowed is not None and self._allowed.match(name)

    def __str__(self) -> str:
        return self.who


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...]
    default: str  # "allow" | "deny"
    source: str = "authz"

    @property
    def uses_certificates(self) -> bool:
        return any(k.startswith("san_") for r in self.rules for k in r.match)

    def for_client(self, cert: dict[str, Any] | None, node_id: str, node_cluster: str) -> Access:
        """The client's access, from its verified certificate (None without mTLS) and the node it
        claims. Shaped as EdsService.authorize expects."""
        uris, dns = peer_sans(cert)
        matched = [i for i, r in enumerate(self.rules) if r.matches(uris, dns, node_id, node_cluster)]
        who = f"san_uri={','.join(uris) or '-'} san_dns={','.join(dns) or '-'}" if cert else "no certificate"
        if not matched:
            return Access(None, self.default == "allow", f"{who}; no rule matched, default {self.default}")
        patterns = [g for i in matched for g in self.rules[i].groups]
        return Access(_any_of(patterns), False, f"{who}; rules {','.join(map(str, matched))}")


class _Walker(NodeWalker):
    def mapping(self, node: yaml.Node, path: str, allowed: tuple[str, ...]) -> dict[str, yaml.Node] | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, path, "must be a mapping")
            return None
        out: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            sub = f"{path}.{key}" if path else str(key)
            if not isinstance(key, str):
                self.problem(key_node, path, "keys must be plain strings")
            elif key in out:
                self.problem(key_node, sub, "duplicate key")
            elif key not in allowed:
                self.problem(key_node, sub, f"unknown key (expected one of: {', '.join(allowed)})")
            else:
                out[key] = value_node
        return out

    def string(self, node: yaml.Node, path: str) -> str | None:
        if not isinstance(node, yaml.ScalarNode) or node.tag != "tag:yaml.org,2002:str" or not node.value:
            self.problem(node, path, "must be a non-empty string (quote it if it starts with *)")
            return None
        return str(node.value)

    def strings(self, node: yaml.Node, path: str) -> tuple[str, ...] | None:
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, path, "must be a list of patterns")
            return None
        found = [self.string(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        return tuple(s for s in found if s is not None)


def parse_authz(text: str, filename: str = "authz") -> Policy:
    """The authorization file's text -> a Policy, or SecurityConfigError with every problem."""
    w = _Walker(filename)
    try:
        root = compose(text, filename)
    except YamlError as e:
        raise SecurityConfigError([str(p) for p in e.problems]) from None
    if root is None:
        raise SecurityConfigError([str(Problem(filename, 1, "", "empty file (write `rules: []` and a default)"))])
    top = w.mapping(root, "", TOP_KEYS) or {}
    default = "deny"
    if "default" in top:
        value = top["default"]
        if not isinstance(value, yaml.ScalarNode) or value.value not in DEFAULTS:
            w.problem(value, "default", f"must be one of: {', '.join(DEFAULTS)}")
        else:
            default = value.value
    rules: list[Rule] = []
    if "rules" not in top:
        w.problem(root, "rules", "missing (a list of {match, groups}; `rules: []` for none)")
    elif not isinstance(top["rules"], yaml.SequenceNode):
        w.problem(top["rules"], "rules", "must be a list of {match, groups}")
    else:
        for i, item in enumerate(top["rules"].value):
            rule = _rule(w, item, f"rules[{i}]")
            if rule is not None:
                rules.append(rule)
    if w.problems:
        raise SecurityConfigError([str(p) for p in w.sorted_problems()])
    return Policy(tuple(rules), default, filename)


def _rule(w: _Walker, node: yaml.Node, path: str) -> Rule | None:
    before = len(w.problems)
    keys = w.mapping(node, path, RULE_KEYS)
    if keys is None:
        return None
    for key in RULE_KEYS:
        if key not in keys:
            w.problem(node, f"{path}.{key}", "missing")
    match: dict[str, str] = {}
    if "match" in keys:
        before_match = len(w.problems)
        fields = w.mapping(keys["match"], f"{path}.match", MATCH_KEYS)
        if fields is not None and not fields and len(w.problems) == before_match:
            w.problem(keys["match"], f"{path}.match", f"names none of: {', '.join(MATCH_KEYS)} (use `default`)")
        for key, value in (fields or {}).items():
            pattern = w.string(value, f"{path}.match.{key}")
            if pattern is not None:
                match[key] = pattern
    groups = w.strings(keys["groups"], f"{path}.groups") if "groups" in keys else None
    if len(w.problems) > before or groups is None:
        return None
    return Rule(match, groups)


def load_authz(path: str) -> Policy:
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SecurityConfigError([f"authz file {path}: {getattr(e, 'strerror', None) or e}"]) from None
    return parse_authz(text, path)
