"""The rank side of the tensor-parallel memory plan's validation (tests/test_plan_tp_ranks.py; run in the
shared rank pools, importable by pickle): a real `ddpkit.session(strategy=TPOptions(...))` trains the step
`ddpkit plan --memory --strategy tp` estimates, and measures the second (steady-state) step twice: torch's
memory tracker on its real tensors (`ddpkit.plan.memory_live.track_step`, the plan's categories) and the
peak of torch's CPU allocator (the profiler's memory events, benchmarks/plan_memory.py's measure: the
CPU ranks' counterpart of `torch.cuda.max_memory_allocated`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("plan_memory_bench", REPO / "benchmarks" / "plan_memory.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure(job: Any) -> dict[str, Any]:
    """Two steps of `job` (a MemoryJob) on this rank's real tensors: the tracked breakdown and the
    allocator's peak of the second step, with the layout the session built."""
    import ddpkit
    from ddpkit.plan import memory, memory_tp
    from ddpkit.plan.memory_live import track_step
    from ddpkit.strategy.tp_options import TPOptions

    bench = _bench()
    spec = memory.resolve_model(job)
    layout = job.layout
    options = TPOptions(
        tensor=layout.tensor,
        replicate=layout.replicate,
        shard=layout.shard,
        plan=memory_tp.plan_of(job.tp_plan),
        sequence_parallel=job.sequence_parallel,
    )
    with ddpkit.session(seed=0, strategy=options) as s:
        with bench._allocator_log() as log:
            batch = spec.batch(job.micro_batch)
            model = s.model(spec.build)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            for i in range(2):
                with torch.profiler.record_function(f"ddpkit_step_{i}"):
                    if i == 1:
                        with track_step(model, opt) as step:
                            spec.loss(model, batch).backward()
                            opt.step()
                            opt.zero_grad()
                    else:
                        spec.loss(model, batch).backward()
                        opt.step()
                        opt.zero_grad()
        got = s.layout
        assert step.breakdown is not None
        return {
            "tracked": step.breakdown.as_dict(),
            "allocator": bench._allocator_peak(log),
            "layout": (got.replicate, got.shard, got.tensor),
            "rank": s.rank,
        }
