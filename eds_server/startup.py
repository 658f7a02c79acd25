"""Start-up shared by the command line and the `--workers` processes: logging set up, and an App
started, or refused with its reasons logged. Both import it; it imports neither (arrows point
down). The standard library only at import: `eds-server --help` stays as quick as Python's start.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admin import WorkerAnswers
    from .app import App
    from .security import SecurityConfigError
    from .settings import Settings

log = logging.getLogger("eds_server")


_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


def utc_timestamp(created: float) -> str:
    """RFC 3339 in UTC with milliseconds (`2026-12-02T06:46:56.123Z`): log collectors on other
    hosts and zones read it without guessing, and lines within one second keep their order."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    """One JSON object per line; fields passed with `extra=` become keys of their own."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update((k, v) for k, v in vars(record).items() if k not in _STANDARD)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """`2026-12-02T06:46:56.123Z INFO eds_server: ...`: the time in UTC, and saying so (a bare local
    time is ambiguous across hosts and at a DST change), the same stamp as the JSON lines'."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return utc_timestamp(record.created)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("grpclib", "watchfiles", "hpack", "h2", "aiodocker"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


async def start_app(
    settings: Settings,
    extra_ports: Sequence[tuple[str, tuple[str, int] | None]] = (),
    workers: WorkerAnswers | None = None,
) -> App | None:
    """A started App, or None after logging why it could not start (the exit status is then 1)."""
    from . import gc_settings, ports, upstreams
    from .app import App
    from .security import SecurityConfigError
    from .sources.registrations import RegistrationStateError

    net, admin = settings.transport, settings.admin
    listen = None if settings.workers.listen_fd is not None else net.listen  # a worker's: bound by its owner
    taken = ports.every_unbindable(
        [
            ("--listen", listen),
            ("--admin", admin.address),
            ("--rest-listen", net.rest_listen),
            ("--metrics-listen", admin.metrics_listen),
            *extra_ports,
        ]
    )
    if taken:  # every one, so that moving one busy port does not only reveal the next
        log.error("not starting: %s", "; ".join(taken))
        return None
    app = App(settings)
    app.workers = workers
    try:
        await app.start()
    except upstreams.UpstreamsError as e:
        for problem in e.problems:
            log.error("%s", problem)
        log.error(
            "not starting: fix the upstreams file %s (check it with `eds-server check %s`)",
            settings.sources.upstreams,
            settings.sources.upstreams,
        )
        return None
    except SecurityConfigError as e:
        refuse_security(e)
        return None
    except (RegistrationStateError, OSError) as e:
        log.error("not starting: %s", e)
        await app.stop()
        return None
    gc_settings.tune()
    return app


def refuse_security(e: SecurityConfigError) -> None:
    """Why the TLS or authorization settings stop the start, one line per problem."""
    for reason in e.problems:
        log.error("%s", reason)
    log.error("not starting: fix the TLS or authorization settings")
