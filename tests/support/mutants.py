"""Mutants as tests: each known bug of the etcd registrations, put back into the replicas, must make
the history tests (tests/e2e/etcd/test_registration_history.py: one replica without faults, then
the faults) fail, and the unmutated control must pass in the same run.

A bug is put back as a change of the installed code in the server processes only: the history test,
given EDS_HISTORY_MUTANT=NAME, starts its replicas with EDS_MUTANT=NAME and tests/support/mutant_site
first on their PYTHONPATH, whose sitecustomize.py calls `apply(NAME)` before eds_server runs; each
replica logs "mutant NAME applied", which the test requires before it goes on. Most mutants edit one
method's source (an exact text, so one that no longer matches the code fails loudly) and compile it
again in its module; the rest replace a function.

    python -m tests.support.mutants [NAME ...]   # or: make test-mutants

runs the control, then each mutant, with a fixed budget (MUTANT_SEEDS, MUTANT_SECONDS; failed runs'
histories and logs kept under /tmp/eds-mutant-runs, EDS_HISTORY_DIR), and prints a
table: killed (the test failed, and why) or SURVIVED. Exit status 1 if the control failed or a mutant
survived.
"""

from __future__ import annotations
import __future__

import asyncio
import inspect
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(__file__).resolve().parent / "mutant_site"
MUTANT_SEEDS = os.environ.get("EDS_MUTANT_SEEDS", "1,2")
MUTANT_SECONDS = os.environ.get("EDS_MUTANT_SECONDS", "20")
HISTORY = "tests/e2e/etcd/test_registration_history.py"
# every kind of operation through one replica, no fault, then the faults: a bug in a write's own
# compare shows at once in the first (seeds 1 and 2 of the second let it through in one run of two)
TESTS = (
    f"{HISTORY}::test_one_replica_without_faults_gives_a_linearizable_history",
    f"{HISTORY}::test_registration_history_is_linearizable_under_faults",
)


@dataclass(frozen=True)
class Mutant:
    what: str  # the bug, as it would be described in a report
    apply: Callable[[], None]


def _edit(cls: type, name: str, edits: dict[str, str], **helpers: Any) -> None:
    """Replace each key of `edits` (found exactly once) by its value in the source of `cls.name`, and
    compile it in its module, with `helpers` beside the module's own names."""
    function = getattr(cls, name)
    module = sys.modules[function.__module__]
    source = textwrap.dedent(inspect.getsource(function))
    for old, new in edits.items():
        if source.count(old) != 1:
            raise RuntimeError(f"mutant: {cls.__name__}.{name} no longer holds {old!r} exactly once")
        source = source.replace(old, new)
    flags = __future__.annotations.compiler_flag
    code = compile(
        source, f"<mutant of {module.__name__}.{cls.__name__}.{name}>", "exec", flags=flags, dont_inherit=True
    )
    scope: dict[str, Any] = {}
    exec(code, {**vars(module), **helpers}, scope)
    setattr(cls, name, scope[name])


def _compare_ignores_own_revision() -> None:
    from eds_server.sources.etcd_kv import RegistrationKV

    # the key's own compare replaced by the group's again
    own = "wire.held_at(etcd_key, key_at)"
    group = "wire.unchanged_since(group_range, wire.range_end(group_range), group_at)"
    _edit(RegistrationKV, "put_if", {own: group})


def _delete_answered_early() -> None:
    from eds_server.sources.etcd_kv import RegistrationKV

    tasks: set[asyncio.Task[Any]] = set()

    async def early(kv: Any, sent: Any) -> dict[str, Any]:
        """The delete's transaction sent, not waited for: answered as done at the view's revision."""
        task = asyncio.ensure_future(sent)
        tasks.add(task)
        task.add_done_callback(lambda t: (tasks.discard(t), t.cancelled() or t.exception()))
        return {"succeeded": True, "header": {"revision": str(kv._view_revision())}}

    _edit(
        RegistrationKV,
        "delete_if",
        {
            "reply = await self.client.call(": "reply = await _early(self, self.client.call(",
            "deadline=deadline,\n        once=True,\n    )": "deadline=deadline, once=True))",
        },
        _early=early,
    )


def _sent_again_after_timeout() -> None:
    from eds_server.sources.etcd_client import EtcdClient

    call = EtcdClient.call

    async def again(self: EtcdClient, path: str, body: dict[str, Any], **kw: Any) -> dict[str, Any]:
        kw["once"] = False  # a transaction whose answer was lost is sent to the next member
        return await call(self, path, body, **kw)

    EtcdClient.call = again  # type: ignore[method-assign]


def _read_from_view() -> None:
    from eds_server.sources.registrations import RegistrationError
    from eds_server.sources.registrations_etcd import EtcdRegistrationSource

    async def read(self: EtcdRegistrationSource, group: str, id: str) -> Any:
        if not self.liveness.loaded:
            raise RegistrationError(503, "registrations are not loaded from etcd yet")
        return self.get(group, id)

    EtcdRegistrationSource.read = read  # type: ignore[method-assign]


def _renewal_of_the_views_lease() -> None:
    """The code before renewals read etcd: a renewal keeps alive the lease this replica's view holds
    (however stale), and a replaced or deleted registration's lease is never revoked."""
    from eds_server.sources import etcd_kv
    from eds_server.sources.etcd_leases import Leases
    from eds_server.sources.registrations_etcd import EtcdRegistrationSource

    async def kept(self: EtcdRegistrationSource, group: str, id: str, ttl: float | None) -> Any:
        held = self.view.kvs.get((group, id))
        if ttl is None or held is None or not held.lease:
            return None  # written instead
        deadline = asyncio.get_running_loop().time() + etcd_kv.WRITE_DEADLINE
        if not await self.leases.keep_alive(held.lease, deadline):
            return None
        return held

    _edit(
        EtcdRegistrationSource,
        "put",
        {
            "held = await self._confirm(group, id, value, ttl, asyncio.get_running_loop().time() + WRITE_DEADLINE)": (
                "held = await _kept(self, group, id, ttl)"
            ),
        },
        _kept=kept,
    )

    async def never(self: Leases, lease: int, deadline: float) -> None:
        return None

    Leases.revoke = never  # type: ignore[method-assign]


def _renewal_without_keep_alive() -> None:
    from eds_server.sources.etcd_leases import Leases

    async def alive(self: Leases, lease: int, deadline: float) -> bool:
        return True  # "renewed", without asking etcd

    Leases.keep_alive = alive  # type: ignore[method-assign]


def _lease_a_second_short() -> None:
    from eds_server.sources import etcd_leases, etcd_view

    # where a lease is granted, and where the view says how long a registration has left
    etcd_leases.lease_ttl = etcd_view.lease_ttl = lambda ttl: max(1, int(ttl) - 1)


MUTANTS: dict[str, Mutant] = {
    "compare-ignores-own-revision": Mutant(
        "a write's compare ignores the key's own mod revision", _compare_ignores_own_revision
    ),
    "delete-answered-early": Mutant("a DELETE answered before etcd's answer", _delete_answered_early),
    "sent-again-after-timeout": Mutant(
        "a transaction sent again to the next member after a timeout", _sent_again_after_timeout
    ),
    "read-from-view": Mutant("a single-endpoint GET answered from the replica's view, not etcd", _read_from_view),
    "renewal-of-the-views-lease": Mutant(
        "a renewal keeps alive the lease its view holds; no lease revoked on delete or replace",
        _renewal_of_the_views_lease,
    ),
    "renewal-without-keep-alive": Mutant(
        "a renewal answered 200 without keeping the lease alive", _renewal_without_keep_alive
    ),
    "lease-a-second-short": Mutant("a lease granted one second shorter than the TTL", _lease_a_second_short),
}


def apply(name: str) -> None:
    """In a replica, before eds_server runs: put the bug back, and say so on stderr (its log)."""
    MUTANTS[name].apply()
    print(f"mutant {name} applied", file=sys.stderr, flush=True)


def server_env() -> dict[str, str] | None:
    """The replicas' environment when the history test runs a mutant (EDS_HISTORY_MUTANT), else None."""
    name = os.environ.get("EDS_HISTORY_MUTANT")
    if not name:
        return None
    if name not in MUTANTS:
        raise ValueError(f"no mutant {name!r}: one of {', '.join(MUTANTS)}")
    path = os.pathsep.join([str(SITE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "EDS_MUTANT": name, "PYTHONPATH": path}


def check_applied(log: str) -> None:
    name = os.environ.get("EDS_HISTORY_MUTANT")
    if name and f"mutant {name} applied" not in log:
        raise RuntimeError(f"mutant {name} not applied in a replica:\n{log[-2000:]}")


def shown() -> str:
    name = os.environ.get("EDS_HISTORY_MUTANT")
    return f" mutant={name}" if name else ""


@dataclass
class Outcome:
    name: str
    failed: bool
    seconds: float
    why: str


def run(name: str | None) -> Outcome:
    """The history test once, with `name` put back (None: the control)."""
    env = {
        "EDS_HISTORY_DIR": "/tmp/eds-mutant-runs",
        **os.environ,
        "EDS_HISTORY_SEEDS": MUTANT_SEEDS,
        "EDS_HISTORY_SECONDS": MUTANT_SECONDS,
    }
    env.pop("EDS_HISTORY_MUTANT", None)
    if name:
        env["EDS_HISTORY_MUTANT"] = name
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-s",
        "-p",
        "no:cacheprovider",
        "--no-header",
        *(["-x"] if name else []),
        *TESTS,
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - started
    out = done.stdout + done.stderr
    lines = [line for line in out.splitlines() if line.startswith("history seed=")]
    errors = [line[4:].strip() for line in out.splitlines() if line.startswith("E   ")]
    why = errors[0] if errors else ""
    failed = [line for line in lines if re.search(r"keys not linearizable: [1-9]", line)]
    if failed:
        seed = failed[0].split()[1]
        why = f"{seed}: " + (
            "NOT linearizable"
            if "(NOT linearizable)" in failed[0]
            else "the search ran out of budget (no verdict: the test fails)"
        )
    if done.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited with {done.returncode}:\n{out[-4000:]}")
    sys.stderr.write(out if done.returncode and not name else "\n".join(lines) + "\n")
    return Outcome(name or "control", done.returncode == 1, seconds, why[:300])


def main(argv: list[str]) -> int:
    names = argv or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        print(f"no mutant {unknown}: one of {', '.join(MUTANTS)}", file=sys.stderr)
        return 2
    print(f"mutants: seeds {MUTANT_SEEDS}, {MUTANT_SECONDS} s of load each; {', '.join(TESTS)}", flush=True)
    results = [run(None)]
    print(f"control: {'FAILED' if results[0].failed else 'passed'} in {results[0].seconds:.0f} s", flush=True)
    for name in names:
        results.append(outcome := run(name))
        print(
            f"{name}: {'killed' if outcome.failed else 'SURVIVED'} in {outcome.seconds:.0f} s: {outcome.why}",
            flush=True,
        )
    print("\n| mutant | bug put back | result | seconds |\n|---|---|---|---|")
    for r in results:
        what = MUTANTS[r.name].what if r.name in MUTANTS else "none (the control)"
        verdict = (
            ("FAILED" if r.failed else "passes") if r.name == "control" else ("killed" if r.failed else "SURVIVED")
        )
        print(f"| {r.name} | {what} | {verdict} | {r.seconds:.0f} |")
    bad = results[0].failed or any(not r.failed for r in results[1:])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
