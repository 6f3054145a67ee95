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
# The ~190 other packages: uv (from the same registry) installs them in parallel, where pip does one after
# another (measured: set-up 179 s with pip, 85 s with uv; docs/testing.md, "CI's time"). Where uv cannot be
# had, pip does it all. torch stays pip's, above: pip reads this machine's pip configuration (its index and
# the CPU wheel's location), which uv does not, and uv then sees torch installed and keeps it.
# pip's own index, if this machine names one, is uv's too; if uv fails anyway (another index set-up), pip
# installs what is left.
index="${PIP_INDEX_URL:-$(.venv/bin/python -m pip config get global.index-url 2> /dev/null || true)}"
if ! { .venv/bin/python -m pip install -q --no-compile uv &&
       UV_DEFAULT_INDEX="${index:-https://pypi.org/simple}" \
         .venv/bin/uv pip install -q --python .venv/bin/python -c constraints.txt -e ".[test]"; }; then
  echo "setup: uv could not install the packages; pip installs them (slower)"
  .venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test]"
fi
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
  # only what a ddpkit run imports (scripts/runtime_packages.py: torch, numpy, sympy, ...), as pip would: a
  # file that does not compile, or a package's own test suite, is skipped; the extras' packages
  # (transformers, moto, the trackers) are compiled by the test suite at their first import there
  .venv/bin/python scripts/runtime_packages.py |
    xargs -d '\n' .venv/bin/python -m compileall -q -j 0 -x '/tests/' > /dev/null || true
fi
# Bytecode for ddpkit's own modules, as pip writes it for a wheel: an editable install under
# PYTHONDONTWRITEBYTECODE=1 (set on some CI machines) would otherwise compile every module from source in
# every rank at every start (measured: 25-50 ms of each rank's start-up; docs/performance.md, 2f).
.venv/bin/python -m compileall -q ddpkit
