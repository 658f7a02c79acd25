"""Where things are, whichever folder a test module sits in."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"  # recorded API output (docker/, kubernetes/, swarm/)


def bench_module(name: str) -> ModuleType:
    """A script of bench/ loaded as a module (bench/ is not a package: its scripts run by path)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
