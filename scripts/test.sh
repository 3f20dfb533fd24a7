#!/usr/bin/env bash
# What CI runs after installing (.ci/run and the README's Quick start): lint, the format
# check, then the whole suite. Extra arguments go to pytest. Run from anywhere.
# The browser test installs Debian's chromium itself (scripts/install-browser.sh) when
# it runs and none is there.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests bench gpu_tests
.venv/bin/ruff format --check src tests bench gpu_tests
# Three workers on two cores, stealing work from each other: a third of the time goes to
# subprocess tests waiting on their children (kills, restarts, torchrun), which the
# other workers fill.
.venv/bin/python -m pytest -q -n 3 --dist worksteal "$@"
