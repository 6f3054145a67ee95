#!/usr/bin/env bash
# Create .venv with this repository's pinned torch (the CPU wheel on disk), ddpkit and the test tools.
# torch is installed first and pinned through constraints.txt, so no dependency can pull a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q -c constraints.txt torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
