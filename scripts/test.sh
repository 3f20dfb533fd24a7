#!/usr/bin/env bash
# What CI runs after installing (.ci/run and the README's Quick start): lint, the format
# check, then the whole suite. Extra arguments go to pytest. Run from anywhere.
# The browser test installs Debian's chromium itself (scripts/install-browser.sh) when
# it runs and none is there.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests bench gpu_tests
.venv/bin/ruff format --check src tests bench gpu_tests
.venv/bin/mypy  # [tool.mypy] in pyproject.toml; cache in .mypy_cache
# Megatron-Bridge's callback module is the oracle of tests/test_megatron_bridge_oracle.py.
# --no-deps: only its standard-library callbacks.py is used; its dependencies (Megatron-Core,
# Transformer Engine, CUDA builds) are gigabytes the tests never import.
.venv/bin/pip show -q megatron-bridge >/dev/null 2>&1 ||
  .venv/bin/pip install -q --no-deps -c constraints.txt megatron-bridge
# Bytecode once, before the workers start. Where PYTHONDONTWRITEBYTECODE is set (as on our
# machines) nothing is cached otherwise: each worker and each `hookloop train` or torchrun
# rank the tests start would compile src/hookloop from source again.
.venv/bin/python -m compileall -q src tests
# pytest keeps its assertion-rewritten test modules only where bytecode may be written:
# without it, each of the workers rewrites all of tests/ again (~2.5 s of CPU apiece).
export PYTHONDONTWRITEBYTECODE=
# OpenMP threads that wait for work sleep instead of spinning: on two cores shared by three
# workers and their training processes, spinning doubled the CPU time of a training loop.
# Same thread count, same work split, same numbers.
export OMP_WAIT_POLICY=passive
# Three workers on two cores, stealing work from each other: a third of the time goes to
# subprocess tests waiting on their children (kills, restarts, torchrun), which the
# other workers fill.
# The twenty slowest tests close the report, so that a slow newcomer shows in CI's log.
.venv/bin/python -m pytest -q -n 3 --dist worksteal --durations=20 "$@"
