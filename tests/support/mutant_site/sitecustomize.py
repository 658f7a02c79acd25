"""Put a known bug back into this eds-server process (EDS_MUTANT names it): on the PYTHONPATH of the
history test's replicas only when tests/support/mutants.py runs them (see there)."""

import os

if os.environ.get("EDS_MUTANT"):
    from tests.support import mutants

    mutants.apply(os.environ["EDS_MUTANT"])
