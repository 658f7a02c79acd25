# Sourced by wheel_smoke.sh and sizes.sh: from the checkout's root, build the wheel into a scratch
# directory removed on exit. Sets PYTHON (the venv's, else python3), work (the scratch directory)
# and wheel (the built file).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$work/dist" .
wheel=$(ls "$work"/dist/eds_server-*.whl)
