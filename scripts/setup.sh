#!/usr/bin/env bash
# Create .venv with this repository's pinned torch (the CPU wheel on disk), ddpkit and the test tools.
# torch is installed first and pinned through constraints.txt, so no dependency can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# pip compiles the ~23,000 modules it installs to bytecode one after another, on one core. Without it,
# Python compiles the few thousand that a run imports, at their first import, and keeps them; where bytecode
# is never written (PYTHONDONTWRITEBYTECODE set, as on this project's CI machines) every module is compiled
# here instead, by one process per core (measured: docs/testing.md, "CI's time").
.venv/bin/python -m pip install -q --no-compile -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test]"
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # as pip would, a file that does not compile (test data, another Python's syntax) is skipped
  .venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages > /dev/null || true
fi
# Bytecode for ddpkit's own modules, as pip writes it for a wheel: an editable install under
# PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) would otherwise compile every module from source in
# every rank at every start (measured: 25-50 ms of each rank's start-up; docs/performance.md, 2f).
.venv/bin/python -m compileall -q ddpkit
