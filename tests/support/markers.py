"""The markers of the test that is running, so that a helper starting outside software can insist on
the marker that says so: `make test-fast` selects by marker, and a test that starts a real Envoy
without `envoy` would run there too, and fail on a machine without one. The folders under tests/e2e/
set these markers; a test elsewhere sets its own."""

from __future__ import annotations

running: frozenset[str] | None = None  # set by tests/conftest.py around each test; None outside one


def require(marker: str, what: str) -> None:
    """Refuse to start `what` in a test that does not carry `marker`."""
    if running is not None and marker not in running:
        raise RuntimeError(
            f"{what} started by a test without the `{marker}` marker: mark the test, or move it under tests/e2e/"
        )
