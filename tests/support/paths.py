"""Where things are, whichever folder a test module sits in."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
DATA = ROOT / "tests" / "data"  # recorded API output (docker/, kubernetes/, swarm/)
