"""benchmarks/checkpoint_costs.py's `save` with another window width (that file belongs to the bench
owners; this only calls it). Its `lost` is a window's time minus the median window without a save, and
a background write still running when the window ends is waited for outside the timed window: with
windows too short for the write, the writer's CPU time after the window is never counted. A wider
window takes the whole write in.

    OMP_NUM_THREADS=1 ddpkit run --nproc 2 scripts/bench_background_window.py 12   # windows of 12 steps
"""

from __future__ import annotations

import sys
from pathlib import Path

import ddpkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import checkpoint_costs

if __name__ == "__main__":
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    sys.argv = sys.argv[:1]  # checkpoint_costs reads a strategy from argv[2]: the default (DDP)
    with ddpkit.session(seed=0, verbose=True) as session:
        checkpoint_costs.save(session, windows=5, width=width)
