#!/usr/bin/env bash
# h2spec (https://github.com/summerwind/h2spec) against eds-server on both HTTP/2 paths, on loopback.
# Usage: scripts/h2spec.sh PATH_TO_H2SPEC [PORT]
# h2spec is not shipped or built here: build it yourself. Each path runs twice: with the default
# limits, and with --stream-budget raised, since h2spec's 5.1.2 case opens more streams without a
# request than one address may in 10 s and the cases after it then meet GOAWAY ENHANCE_YOUR_CALM.
# Prints each run's summary and the cases that failed; the full output is left in $OUT (a temp dir).
set -euo pipefail
h2spec=${1:?usage: scripts/h2spec.sh PATH_TO_H2SPEC [PORT]}
port=${2:-18991}
cd "$(dirname "$0")/.."
OUT=$(mktemp -d)
upstreams="$OUT/upstreams.yaml"
printf 'groups:\n  web:\n    endpoints:\n      - 127.0.0.1:8081\n' > "$upstreams"
run() {  # run MODE TAG [serve args]
    local mode=$1 tag=$2 pid
    shift 2
    .venv/bin/eds-server serve --upstreams "$upstreams" --listen "127.0.0.1:$port" --admin off \
        --http2 "$mode" "$@" > "$OUT/server-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do (echo > "/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
    timeout 600 "$h2spec" -h 127.0.0.1 -p "$port" -o 3 \
        --path /envoy.service.endpoint.v3.EndpointDiscoveryService/StreamEndpoints > "$OUT/h2spec-$tag.txt" 2>&1 || true
    kill "$pid"; wait "$pid" 2>/dev/null || true
    echo "== --http2 $mode $*: $(tail -1 "$OUT/h2spec-$tag.txt")"
    sed -n '/^Failures:/,$p' "$OUT/h2spec-$tag.txt" | grep '×' || true
    ! grep -q Traceback "$OUT/server-$tag.log" || echo "   (the server logged a traceback: $OUT/server-$tag.log)"
}
for mode in fast stock; do
    run "$mode" "$mode"
    run "$mode" "$mode-budget" --stream-budget 100000
done
echo "output: $OUT"
