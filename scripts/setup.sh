#!/usr/bin/env bash
# Create .venv with this repository's pinned torch (the CPU wheel on disk), ddpkit and the test tools.
# torch is installed first and pinned through constraints.txt, so no dependency can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# pip compiles all ~23,000 modules it installs to bytecode, one core for ~100 s (measured: `compileall -j 0`
# of site-packages, 89 s of CPU); Python compiles the few thousand that a run imports at their first import and
# keeps them. Where bytecode is never written (PYTHONDONTWRITEBYTECODE set) pip compiles them, as it does.
compile="--no-compile"
[ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && compile="--compile"
.venv/bin/python -m pip install -q "$compile" -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q "$compile" -c constraints.txt -e ".[test]"
# Bytecode for ddpkit's own modules, as pip writes it for a wheel: an editable install under
# PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) would otherwise compile every module from source in
# every rank at every start (measured: 25-50 ms of each rank's start-up; docs/performance.md, 2f).
.venv/bin/python -m compileall -q ddpkit
