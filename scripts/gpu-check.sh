#!/usr/bin/env bash
# Prove ddpkit's CUDA paths on this machine's GPU(s): one line per check, a summary, exit 0 only when all pass.
# Without a CUDA device it prints "skipped: no CUDA device" and exits 0. See docs/gpu.md.
#
#   scripts/gpu-check.sh                         # all checks (a few minutes on one GPU)
#   scripts/gpu-check.sh --only demo,fp16-scaler # some of them; --list names them all
#
# On a GPU machine with torch preinstalled and no network, install ddpkit over it first:
#   pip install --no-deps -e .        (do NOT run scripts/setup.sh there: it installs a CPU torch)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
    py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then
    py=.venv/bin/python
else
    py=python3
fi
# ddpkit's own dependencies are not installed by --no-deps: name the missing ones before anything fails.
"$py" - <<'PY'
import importlib.util
needs = {"torch": "torch", "numpy": "numpy", "safetensors": "safetensors", "tqdm": "tqdm",
         "sklearn": "scikit-learn (the demo)", "matplotlib": "matplotlib (the demo's plot, trace)"}
missing = [name for mod, name in needs.items() if importlib.util.find_spec(mod) is None]
if missing:
    print("gpu-check: missing package(s): " + ", ".join(missing) + "; the checks that need them will fail")
PY
exec "$py" -m ddpkit.tools.gpucheck "$@"
