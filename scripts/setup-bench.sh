#!/usr/bin/env bash
# Create .venv-bench: the pinned torch, ddpkit and the peers the benchmarks compare with (accelerate,
# lightning; versions in pyproject's `bench` extra), kept apart so the test environment stays clean.
#   scripts/setup-bench.sh && .venv-bench/bin/python benchmarks/side_by_side.py --reps 3
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-bench
.venv-bench/bin/python -m pip install -q -c constraints.txt torch==2.13.0
.venv-bench/bin/python -m pip install -q -c constraints.txt -e ".[bench]"
# ddpkit's bytecode, as in scripts/setup.sh (why: there); the benchmarks time start-up.
.venv-bench/bin/python -m compileall -q ddpkit
