"""`GET /` on the admin port: what /v1/sources, /v1/groups and /v1/streams say, as one HTML page.

Rendered on the server from the same dicts the JSON endpoints return, no JavaScript (a meta refresh
reloads it), read-only. Everything shown is escaped: group names, node ids, NACK messages and label
values come from files, containers and clients. Long lists are cut, with a link to the full JSON, so
the page stays small however many groups or streams there are.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from .serving_state import DEGRADED, READY, ServingState

MOST_GROUPS = 200
MOST_ENDPOINTS = 50  # per group
MOST_STREAMS = 200
MOST_NAMES = 20  # per stream
MOST_HOSTNAME_CHARS = 80  # a label's text is unbounded; the group's JSON has all of it
REFRESH_SECONDS = 5

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fff}
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.15em;margin:1.4em 0 .4em}h3{font-size:1em;margin:1em 0 .3em}
table{border-collapse:collapse;margin:.3em 0}th,td{border:1px solid #d0d7de;padding:.25em .6em;text-align:left;
vertical-align:top}th{background:#f6f8fa;font-weight:600}code,.mono{font-family:ui-monospace,monospace;font-size:.92em}
.ok{color:#1a7f37}.bad{color:#cf222e;font-weight:600}.warn{color:#9a6700}.muted{color:#57606a}
tr.nack td{background:#ffebe9}h3 .muted{font-weight:normal}nav a{margin-right:1em}
.pill{border-radius:1em;padding:0 .6em;border:1px solid}
.pill.degraded{color:#7d4e00;background:#fff8c5;border-color:#d4a72c}
"""


def _n(count: int, thing: str) -> str:
    return f"{count} {thing}" + ("" if count == 1 else "s")


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _health(value: str) -> str:
    css = {"healthy": "ok", "unknown": "ok", "degraded": "warn", "draining": "warn"}.get(value, "bad")
    return f'<span class="{css}">{_e(value)}</span>'


def _check(ep: Mapping[str, Any]) -> str:
    """An endpoint's last health check, after its health (nothing when it is not checked)."""
    check = ep.get("check")
    if not check:
        return ""
    if check.get("result") is None:
        return ' <span class="muted check">(not checked yet)</span>'
    css = "ok" if check["result"] == "pass" else "bad"
    return (
        f' <span class="{css} check" title="{_e(check.get("spec", ""))}">({_e(check.get("reason"))}, '
        f"{_e(check.get('latency_ms'))} ms)</span>"
    )


def _hostname(ep: Mapping[str, Any]) -> str:
    """Which container, Swarm task or pod an address is (the Docker, Swarm and Kubernetes sources keep
    its name as Envoy's endpoint hostname, unless an `eds.hostname` label says otherwise): an IP alone
    says nothing once containers come and go."""
    name = str(ep.get("hostname") or "")
    if not name:
        return '<span class="muted">-</span>'
    if len(name) > MOST_HOSTNAME_CHARS:
        name = name[: MOST_HOSTNAME_CHARS - 1] + "\u2026"
    return _e(name)


def _locality(ep: Mapping[str, Any]) -> str:
    parts = [str(ep[k]) for k in ("region", "zone", "subzone") if ep.get(k)]
    return _e("/".join(parts)) if parts else '<span class="muted">-</span>'


def _table(head: Sequence[str], rows: Iterable[tuple[str, str]]) -> str:
    """rows: (row class, inner cells html)."""
    body = "".join(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>" for cls, cells in rows)
    return "<table><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + f"</tr>{body}</table>"


def _cut(shown: int, total: int, link: str) -> str:
    if total <= shown:
        return ""
    return f'<p class="muted">{shown} of {total} shown; all of them: <a href="{_e(link)}">{_e(link)}</a></p>'


def _sources(sources: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for s in sources:
        loaded = '<span class="ok">loaded</span>' if s.get("loaded") else '<span class="warn">waiting</span>'
        stale = s.get("stale", False)
        error = s.get("last_error")
        if stale:
            live = '<span class="bad">stale</span>'
        elif error and s.get("loaded"):  # it follows, but its last load failed: the last good state is served
            live = '<span class="warn">last load failed</span>'
        elif s.get("live", True):
            live = '<span class="ok">live</span>'
        else:
            live = '<span class="warn">not yet</span>'
        cls = "nack" if error or stale else ""
        rows.append(
            (
                cls,
                f'<td class="mono">{_e(s.get("name"))}</td><td>{loaded}</td><td>{live}</td>'
                f'<td class="mono">{_e(error) if error else "-"}</td>',
            )
        )
    if not rows:
        return "<p>No sources.</p>"
    return _table(("source", "state", "following", "last error"), rows)


def _nacks_by_group(streams: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Streams whose current NACK of a group stands (nacked set), by group."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for s in streams:
        for name, state in (s.get("names") or {}).items():
            if state.get("nacked"):
                out.setdefault(name, []).append(s)
    return out


def _groups(
    groups: Sequence[Mapping[str, Any]],
    total: int,
    streams: Sequence[Mapping[str, Any]],
    nack_counts: Mapping[str, int],
) -> str:
    if not groups:
        return "<p>No groups.</p>"
    nacked = _nacks_by_group(streams)
    parts = []
    for g in groups[:MOST_GROUPS]:
        name = str(g["name"])
        link = f"/v1/groups/{quote(name, safe='')}"
        eps = g.get("endpoints", [])
        flags = []
        if g.get("stale"):
            flags.append('<span class="bad">stale</span>')
        if name in nacked:
            who = ", ".join(str(s.get("node")) for s in nacked[name][:5])
            flags.append(f'<span class="bad nack-flag">NACKed by {_e(who)}</span>')
        if nack_counts.get(name):
            flags.append(f'<span class="muted">{_n(nack_counts[name], "NACK")} since start</span>')
        parts.append(
            f'<section class="group" data-group="{_e(name)}"><h3><a href="{_e(link)}">{_e(name)}</a> '
            f'<span class="muted">version <code>{_e(g.get("version"))}</code> · {_n(len(eps), "endpoint")} · '
            f"sources: {_e(', '.join(g.get('sources', [])) or '-')}</span> {' '.join(flags)}</h3>"
        )
        if g.get("error"):  # the sources' merged endpoints are held back: what is shown is the last accepted
            parts.append(
                f'<p class="bad conflict">held back, Envoy would reject the merged endpoints: '
                f'<span class="mono">{_e(g["error"])}</span>; serving the last accepted version</p>'
            )
        for s in nacked.get(name, [])[:5]:
            parts.append(
                f'<p class="bad">NACK from {_e(s.get("node"))} ({_e(s.get("peer"))}): '
                f'<span class="mono">{_e(s.get("last_nack") or "")}</span></p>'
            )
        rows = []
        for ep in eps[:MOST_ENDPOINTS]:
            address = f"[{ep['address']}]" if ":" in str(ep["address"]) else str(ep["address"])
            cells = (
                f'<td class="mono">{_e(address)}:{_e(ep["port"])}</td>'
                f'<td class="mono hostname">{_hostname(ep)}</td><td>{_health(str(ep["health"]))}{_check(ep)}</td>'
                f"<td>{_locality(ep)}</td><td>{_e(ep.get('weight', '-'))}</td><td>{_e(ep.get('priority', 0))}</td>"
                f'<td class="mono">{_e(ep.get("source") or "-")}</td>'
            )
            rows.append(("", cells))
        if rows:
            parts.append(_table(("endpoint", "hostname", "health", "locality", "weight", "priority", "source"), rows))
        parts.append(_cut(MOST_ENDPOINTS, len(eps), link) + "</section>")
    parts.append(_cut(min(MOST_GROUPS, len(groups)), total, "/v1/groups"))
    return "".join(parts)


def _streams(streams: Sequence[Mapping[str, Any]], total: int) -> str:
    if not streams:
        return "<p>No Envoy is connected.</p>"
    rows = []
    for s in streams[:MOST_STREAMS]:
        names = s.get("names") or {}
        lines = []
        for name in sorted(names)[:MOST_NAMES]:
            st = names[name]
            nack = f' <span class="bad">NACKed {_e(st["nacked"])}</span>' if st.get("nacked") else ""
            lines.append(
                f'<span class="mono">{_e(name)}</span>: sent <code>{_e(st.get("sent") or "-")}</code>, '
                f"ACKed <code>{_e(st.get('acked') or '-')}</code>{nack}"
            )
        count = max(len(names), int(s.get("names_total") or 0))  # the JSON may show only some names
        if count > min(len(names), MOST_NAMES):
            lines.append(f'<span class="muted">... {count} names</span>')
        nacked = any(st.get("nacked") for st in names.values())
        cells = (
            f'<td class="mono">{_e(s.get("node"))}<br><span class="muted">{_e(s.get("cluster"))}</span></td>'
            f'<td class="mono">{_e(s.get("peer"))}</td><td>{_e(s.get("transport"))}</td>'
            f"<td>{'<br>'.join(lines) or '-'}</td>"
            f'<td class="mono">{_e(s.get("last_nack") or "-")}</td>'
        )
        rows.append(("nack" if nacked else "", cells))
    head = "names: version sent / ACKed (or held when it connected) / NACKed"
    return _table(("node (cluster)", "peer", "transport", head, "last NACK"), rows) + _cut(
        min(MOST_STREAMS, len(streams)), total, "/v1/streams"
    )


def _registrations(regs: Sequence[Mapping[str, Any]] | None, total: int) -> str:
    """The registration API's endpoints, as /v1/registrations gives them (none: no registrations)."""
    if regs is None:
        return ""
    if not regs:
        return '<h2 id="registrations">Registrations</h2><p class="muted">none</p>'
    rows = []
    for r in regs:
        ttl = f"{r['ttl']:g} s, expires in {r['expires_in']:.0f} s" if "ttl" in r else "-"
        rows.append(
            (
                "",
                f'<td class="mono">{_e(r["id"])}</td><td>{_e(r["group"])}</td>'
                f'<td class="mono">{_e(r["address"])}:{int(r["port"])}</td><td>{_e(ttl)}</td>',
            )
        )
    return (
        '<h2 id="registrations">Registrations</h2>'
        + _table(("id", "group", "endpoint", "TTL"), rows)
        + _cut(len(regs), total, "/v1/registrations")
    )


def render(
    *,
    version: str,
    state: ServingState,
    sources: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    total_groups: int,
    total_endpoints: int,
    streams: Sequence[Mapping[str, Any]],
    stats: Mapping[str, Any],
    total_streams: int | None = None,
    registrations: Sequence[Mapping[str, Any]] | None = None,
    total_registrations: int = 0,
) -> str:
    """The whole page. `state`: ready, degraded or not ready, as `/readyz` says it. `groups`: the first
    MOST_GROUPS as /v1/groups/{name} gives them (with each endpoint's source); the totals count every
    group. `streams`: the first ones as /v1/streams gives them, of `total_streams` (default: all)."""
    total_streams = len(streams) if total_streams is None else total_streams
    css = {READY: "ok", DEGRADED: "degraded"}.get(state.name, "bad")
    # the header names the degraded sources; why (an error that may run to lines) is theirs, under Sources
    said = state.describe()
    if state.name == DEGRADED:
        said = (
            f"{DEGRADED}: serving the last good state of {', '.join(d.source for d in state.degraded)} (why: Sources)"
        )
    badge = (
        f'<span class="pill {css}" id="state" data-state="{_e(state.name)}" title="{_e(state.describe())}">'
        f"{_e(said)}</span>"
    )
    paths: tuple[str, ...] = ("/v1/sources", "/v1/groups", "/v1/streams", "/v1/stats", "/readyz", "/metrics")
    if registrations is not None:
        paths += ("/v1/registrations",)
    links = " ".join(f'<a href="{p}">{p}</a>' for p in paths)
    nacks = stats.get("nacks_by_group") or {}
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>eds-server {_e(version)}</title><style>{_CSS}</style></head><body>"
        f'<h1>eds-server <span class="muted">{_e(version)}</span> {badge}</h1>'
        f'<p class="muted">{_n(total_groups, "group")}, {_n(total_endpoints, "endpoint")}, '
        f"{_n(total_streams, 'stream')} · "
        # counted by this process, of the responses it sent: after a restart, a stream whose Envoy
        # already held the version is shown ACKed below (it said so) although nothing was sent to ACK
        f"{_n(int(stats.get('acks', 0)), 'ACK')}, {_n(int(stats.get('nacks', 0)), 'NACK')} of responses "
        "sent since start · "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}, reloads every {REFRESH_SECONDS} s</p>"
        f"<nav>JSON: {links}</nav>"
        f'<h2 id="sources">Sources</h2>{_sources(sources)}'
        f'<h2 id="groups">Groups</h2>{_groups(groups, total_groups, streams, nacks)}'
        f'<h2 id="streams">Streams</h2>{_streams(streams, total_streams)}'
        f"{_registrations(registrations, total_registrations)}"
        f"{_workers(stats.get('workers'))}"
        f"{_refused(stats)}"
        "</body></html>"
    )


def _workers(workers: Sequence[Mapping[str, Any]] | None) -> str:
    """With --workers N: each worker process, so one that keeps dying shows."""
    if not workers:
        return ""
    rows = "".join(
        f"<tr><td>{int(w['worker'])}</td><td>{_e(str(w.get('pid')))}</td>"
        f'<td class="{"" if w.get("alive") else "bad"}">{"up" if w.get("alive") else "down"}</td>'
        f"<td>{int(w.get('restarts') or 0)}</td><td>{_e(str(w.get('streams_open', '-')))}</td></tr>"
        for w in workers
    )
    return (
        '<h2 id="workers">Workers</h2><table><tr><th>worker</th><th>pid</th><th>state</th>'
        f"<th>restarts</th><th>streams</th></tr>{rows}</table>"
    )


def _refused(stats: Mapping[str, Any]) -> str:
    """What the gRPC port refused or shed, by reason (docs/limits.md), if anything."""
    refused = {k: v for k, v in (stats.get("refused_by_reason") or {}).items() if v}
    if not refused:
        return '<h2 id="refused">Refused</h2><p class="muted">nothing refused or shed</p>'
    rows = "".join(f"<tr><td>{_e(k)}</td><td>{int(v)}</td></tr>" for k, v in sorted(refused.items()))
    return (
        '<h2 id="refused">Refused</h2><p class="muted">connections, streams and frames refused or shed '
        "since start, by reason (the server log names each client)</p>"
        f"<table><tr><th>reason</th><th>count</th></tr>{rows}</table>"
    )
