"""The profiler switch: a trace per chosen rank and active window, that a trace viewer can open.

Two real gloo ranks (the shared pool) train a small MLP under DDP with `StepProfiler.build` for the
rank's options; each returns the files it wrote. A trace must be Chrome JSON (what Perfetto and
chrome://tracing read): `traceEvents`, complete events ("ph": "X") with a name, a start and a
duration, and the training ops (aten::addmm, the gloo all-reduce) among them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.observe.profiling import NullProfiler, ProfileOptions, StepProfiler


def _profiled(directory: str, options: dict, steps: int) -> dict:
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        profiler = StepProfiler.build({**options, "directory": directory}, s.rank, s.device)
        g = torch.Generator().manual_seed(s.rank)
        for _ in range(steps):
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
            with s.accumulate(model):
                s.backward(nn.functional.mse_loss(model(x), y))
            s.step(opt)
            if profiler is not None:
                profiler.step()
        if profiler is not None:
            profiler.stop()
        return {
            "kind": type(profiler).__name__,
            "traces": [str(p) for p in getattr(profiler, "traces", [])],
            "memory": [str(p) for p in getattr(profiler, "memory_views", [])],
            "describe": profiler.describe() if profiler is not None else "",
        }


def test_each_chosen_rank_writes_a_trace_that_opens_as_chrome_json(pool2, tmp_path: Path) -> None:
    options = {"ranks": "all", "wait": 1, "warmup": 1, "active": 2, "stacks": True}
    results = pool2.run(_profiled, str(tmp_path), options, 6, timeout=120)
    for rank, r in enumerate(results):
        assert r["traces"] == [str(tmp_path / f"rank{rank}-step4.trace.json")], r
        trace = json.loads(Path(r["traces"][0]).read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert events and all({"name", "ts", "dur", "pid", "tid"} <= set(e) for e in events)
        names = {e["name"] for e in events}
        assert "aten::addmm" in names and any("gloo" in n or "allreduce" in n for n in names), sorted(names)[
            :40
        ]
        steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
        assert [e["name"] for e in steps] == ["ProfilerStep#2", "ProfilerStep#3"]  # the active steps
        assert any(
            e.get("args", {}).get("Python id") is not None or e.get("cat") == "python_function"
            for e in trace["traceEvents"]
        ), "stacks=True records the Python functions"
    assert "no OOM snapshot on CPU" in results[0]["describe"]


def test_only_the_chosen_rank_profiles_and_memory_gives_the_memory_view(pool2, tmp_path: Path) -> None:
    options = {"ranks": (1,), "wait": 0, "warmup": 1, "active": 1, "memory": True}
    results = pool2.run(_profiled, str(tmp_path), options, 3, timeout=120)
    assert results[0]["kind"] == "NullProfiler" and results[0]["traces"] == []
    assert results[1]["kind"] == "StepProfiler" and len(results[1]["traces"]) == 1
    trace = json.loads(Path(results[1]["traces"][0]).read_text())
    assert any(e.get("name") == "[memory]" for e in trace["traceEvents"]), "profile_memory's events"
    view = Path(results[1]["memory"][0]).read_text()
    assert "CPU Mem" in view and "aten::" in view
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-step2.memory.txt", "rank1-step2.trace.json"]


def test_off_is_no_profiler_and_the_options_are_checked() -> None:
    assert StepProfiler.build(None, 0) is None and StepProfiler.build(False, 0) is None
    assert isinstance(StepProfiler.build({"ranks": (3,)}, 0), NullProfiler)
    assert ProfileOptions.of(True) == ProfileOptions()
    assert ProfileOptions.of({"ranks": [0, 2]}).ranks == (0, 2)
    with pytest.raises(ddpkit.DdpkitError, match="unknown key"):
        ProfileOptions.of({"rank": 0})
    with pytest.raises(ddpkit.DdpkitError, match="active=0"):
        ProfileOptions(active=0)


def _session_profiled(directory: str) -> list[str]:
    profile = {"ranks": "all", "wait": 0, "warmup": 1, "active": 1, "directory": directory}
    with ddpkit.session(seed=0, verbose=False, log_to=None, profile=profile) as s:
        model = s.model(nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            with s.accumulate(model):
                s.backward(model(torch.randn(8, 4)).square().mean())
            s.step(opt)  # the stepper advances the profiler's schedule
        return [p.name for p in s.profiler.traces]


def test_the_session_option_profiles_through_the_stepper(pool2, tmp_path: Path) -> None:
    assert pool2.run(_session_profiled, str(tmp_path), timeout=120) == [
        ["rank0-step2.trace.json"],
        ["rank1-step2.trace.json"],
    ]
