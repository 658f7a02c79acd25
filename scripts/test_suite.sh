#!/usr/bin/env bash
# `make test`: the whole suite on both HTTP/2 paths, as CI runs it, in three passes.
#  1. Every test not marked `alone`, over TEST_JOBS workers (pytest -n; the Docker tests share one
#     worker and its dockerd). Beside them, in one more process, the gRPC, Envoy and HTTP/2 tests
#     again on the stock HTTP/2 path (STOCK_TESTS). These tests mostly wait on real processes
#     (Envoy, dockerd, etcd, timeouts), so they share the machine's cores well.
#  2. The `alone` tests (the attack matrix, memory and full-table tests, CPU-bound bounds), one at
#     a time: their bounds assume the CPU is theirs.
#  3. The same on the stock HTTP/2 path.
# Extra arguments go to the first pass's pytest. The stock pass's output is shown after the first.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${TEST_JOBS:-3}
read -r -a stock_tests <<<"${STOCK_TESTS:?set STOCK_TESTS to the stock path test files (Makefile)}"

stock_log=$(mktemp)
EDS_HTTP2=stock "$PY" -m pytest -m "not alone" "${stock_tests[@]}" >"$stock_log" 2>&1 &
stock=$!
main=
# Interrupted (Ctrl-C, CI's timeout): both passes go too, not on alone. The first pass runs in the
# background as well, so that the script's `wait`, unlike a command in the foreground, lets the
# trap run at once.
trap 'kill $main "$stock" 2>/dev/null; rm -f "$stock_log"' EXIT
trap 'exit 130' INT TERM
"$PY" -m pytest -n "$JOBS" --dist loadgroup -m "not alone" --durations=25 "$@" &
main=$!
wait "$main"
first=$?
wait "$stock"
stock_first=$?
echo "== beside it: the gRPC, Envoy and HTTP/2 tests on the stock HTTP/2 path (EDS_HTTP2=stock)"
cat "$stock_log"

"$PY" -m pytest -m alone --durations=10
alone=$?
EDS_HTTP2=stock "$PY" -m pytest -m alone "${stock_tests[@]}"
stock_alone=$?

echo "make test: fast path $first, stock path $stock_first, alone $alone, alone on the stock path $stock_alone (0: passed)"
for rc in "$first" "$stock_first" "$alone" "$stock_alone"; do
    [ "$rc" -eq 0 ] || exit "$rc"
done
