#!/usr/bin/env bash
# docs/status-page.png, taken again: the browser test that renders `eds-server demo`'s status page in
# Debian's headless chromium, with EDS_WRITE_STATUS_PICTURE=1 so that it also writes the picture.
# Needs `make setup` and chromium (apt-get install chromium). Commit the new picture if it changed.
set -euo pipefail
cd "$(dirname "$0")/.."
EDS_WRITE_STATUS_PICTURE=1 .venv/bin/python -m pytest -q \
    "tests/e2e/browser/test_status_page.py::test_the_demos_status_page_is_the_picture_the_docs_show"
git status --short docs/status-page.png
