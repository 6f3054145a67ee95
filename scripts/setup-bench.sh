#!/usr/bin/env bash
# Create .venv-bench: the pinned torch, ddpkit and the peers the benchmarks compare with (accelerate,
# lightning; versions in pyproject's `bench` extra), kept apart so the test environment stays clean.
#   scripts/setup-bench.sh && .venv-bench/bin/python benchmarks/side_by_side.py --reps 3
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-bench
.venv-bench/bin/python -m pip install -q -c constraints.txt torch==2.13.0
.venv-bench/bin/python -m pip install -q -c constraints.txt -e ".[bench]"
# Bytecode for ddpkit's own modules, as pip writes it for a wheel: an editable install under
# PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) would otherwise compile every module from source in
# every rank at every start (measured: 25-40 ms of each rank's start-up; docs/performance.md, 2f).
.venv-bench/bin/python -m compileall -q ddpkit
