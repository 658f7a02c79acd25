"""The collector settings a started server runs with (in a process of its own: they are global)."""

from __future__ import annotations

import subprocess
import sys


def test_tune_freezes_the_start_up_objects_and_raises_the_young_threshold() -> None:
    code = (
        "import gc\n"
        "from eds_server import gc_settings\n"
        "older = gc.get_threshold()[1:]\n"
        "gc_settings.tune()\n"
        "print(gc.get_threshold()[0], gc.get_threshold()[1:] == older, gc.get_freeze_count() > 1000)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["20000", "True", "True"]
