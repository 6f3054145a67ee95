"""Issue 33: every rank's step anatomy, the slow rank named with its cause, MFU in fit's output.

Real gloo ranks (the shared pool) run `fit` on a tiny model; one rank gets a planted sleep in its data
loading, or in its forward, and rank 0 must name that rank and that cause within 50 steps. A balanced
run of 500 steps must name nobody (the detector's thresholds are relative AND absolute, and must hold
for 3 gathers in a row: the noise of a shared 2-core machine moves neither). No timing is asserted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.observe.anatomy import StepAnatomy
from ddpkit.observe.flops import cpu_peak, gpu_peak
from ddpkit.observe.slowrank import SlowRankDetector
from ddpkit.training.fit import fit

DELAY = 0.03  # s: the planted sleep (the tiny model's step is ~1-3 ms)


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))


class _SlowLoader:
    """A loader whose batches come `delay` s late on one rank (a slow disk feeding that rank)."""

    def __init__(self, loader, delay: float) -> None:
        self.loader, self.delay = loader, delay

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            time.sleep(self.delay)
            yield batch


def _run(plant: str, steps: int, cache: str, log_dir: str | None = None) -> dict:
    os.environ["DDPKIT_CACHE_DIR"] = cache
    with ddpkit.session(
        seed=0, verbose=False, log_to="tensorboard" if log_dir else None, log_dir=log_dir
    ) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        slow = s.rank == 1
        loader = s.loader(_data(), batch_size=8, shuffle=True)
        if plant == "data" and slow:
            loader = _SlowLoader(loader, DELAY)

        def train_step(m: nn.Module, batch) -> torch.Tensor:
            x, y = batch
            out = m(x)
            if plant == "forward" and slow:
                time.sleep(DELAY)  # a slow host: its forward takes longer
            return nn.functional.cross_entropy(out, y)

        result = fit(s, model, opt, loader, train_step, max_steps=steps, progress=False, anatomy_every=10)
        return {"anatomy": result.anatomy, "steps": result.steps}


def _hand_loop(steps: int, cache: str) -> dict:
    """A loop written by hand (no fit): `ddpkit.StepMonitor.of(s)`, rank 1's forward 30 ms slower."""
    os.environ["DDPKIT_CACHE_DIR"] = cache
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        monitor = ddpkit.StepMonitor.of(s)
        logged, step = [], 0
        while step < steps:
            for x, y in s.loader(_data(), batch_size=8, shuffle=True):
                with s.accumulate(model):
                    loss = monitor.counting(lambda b: nn.functional.cross_entropy(model(b[0]), b[1]), (x, y))
                    if s.rank == 1:
                        time.sleep(DELAY)  # inside the forward's mark (s.backward marks it on entry)
                    s.backward(loss)
                s.step(opt)
                step += 1
                monitor.after_step(step)
                if step % 10 == 0:
                    logged.append(monitor.scalars())  # what the loop passes to s.log
                if step == steps:
                    break
        return {"logged": logged, "findings": monitor.summary()["findings"]}


def test_a_hand_written_loop_gets_mfu_per_rank_medians_and_the_slow_rank(pool2, tmp_path: Path) -> None:
    r0, _r1 = pool2.run(_hand_loop, 40, str(tmp_path), timeout=120)
    assert len(r0["logged"]) == 4
    last = r0["logged"][-1]
    assert last["flops_per_step"] > 0 and 0 < last["mfu"] < 1, last  # counted once, against the CPU peak
    assert last["anatomy/rank1/forward_ms"] > DELAY * 1e3 * 0.8, last  # every rank's medians, on rank 0
    assert [(f.rank, f.cause) for f in r0["findings"]] == [(1, "compute")], r0["findings"]


@pytest.mark.parametrize("plant,cause", [("data", "data"), ("forward", "compute")])
def test_slow_rank_named_with_its_cause(plant: str, cause: str, pool2, tmp_path: Path) -> None:
    r0, _r1 = pool2.run(_run, plant, 50, str(tmp_path), str(tmp_path / "tb"), timeout=120)
    findings = r0["anatomy"]["findings"]
    assert findings, f"no slow rank named in 50 steps; last table: {r0['anatomy']['ranks']}"
    first = findings[0]
    assert (first.rank, first.cause) == (1, cause), first.message()
    assert first.step <= 50 and first.excess_s > DELAY / 2
    assert first.host and "rank 1 on" in first.message()
    assert len({(f.rank, f.cause) for f in findings}) == len(findings)  # said once
    table = r0["anatomy"]["ranks"]
    assert table[0]["sync"] > table[1]["sync"]  # rank 0 waits for rank 1 in the all-reduce
    # the trackers: per-rank medians every 10 steps, the slow rank once, MFU (TensorBoard read back)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb" / "tensorboard"))
    acc.Reload()
    phase = "data" if plant == "data" else "forward"
    slow_ms = [e.value for e in acc.Scalars(f"anatomy/rank1/{phase}_ms")]
    assert [e.step for e in acc.Scalars(f"anatomy/rank0/{phase}_ms")] == [10, 20, 30, 40, 50]
    assert slow_ms[-1] > DELAY * 1e3 * 0.8  # the planted 30 ms, per step, on rank 1
    assert [(e.step, e.value) for e in acc.Scalars("anatomy/slow_rank")] == [(first.step, 1.0)]
    assert all(e.value > 0 for e in acc.Scalars("mfu"))


def test_balanced_run_names_nobody(pool2, tmp_path: Path) -> None:
    r0, _r1 = pool2.run(_run, "none", 500, str(tmp_path), timeout=120)
    assert r0["steps"] == 500
    assert r0["anatomy"]["findings"] == [], [f.message() for f in r0["anatomy"]["findings"]]
    table = r0["anatomy"]["ranks"]
    assert [row["steps"] for row in table] == [500, 500]  # every rank's medians were gathered
    assert all(row["backward"] > 0 and row["step"] >= row["busy"] for row in table)


def test_detector_thresholds_and_persistence() -> None:
    """Pure rules: relative AND absolute thresholds, the others must wait, 3 gathers in a row, said once."""

    def row(busy_extra: float = 0.0, sync: float = 0.001, data: float = 0.001) -> dict:
        r = {
            "steps": 20.0,
            "data": data + busy_extra,
            "forward": 0.002,
            "backward": 0.002,
            "sync": sync,
            "optimizer": 0.001,
            "other": 0.0005,
        }
        r["step"] = sum(r[k] for k in ("data", "forward", "backward", "sync", "optimizer", "other"))
        r["busy"] = r["step"] - r["sync"]
        return r

    det = SlowRankDetector(relative=0.1, absolute_s=0.005, persistence=3)
    slow = [row(sync=0.03), row(busy_extra=0.03)]
    assert [det.update(slow, ["a", "b"], i) for i in (10, 20)] == [None, None]
    found = det.update(slow, ["a", "b"], 30)
    assert found is not None and (found.rank, found.cause, found.host) == (1, "data", "b")
    assert det.update(slow, ["a", "b"], 40) is None  # said once
    small = [row(sync=0.004), row(busy_extra=0.004)]  # 4 ms: under the absolute threshold
    quiet = SlowRankDetector()  # one detector over 5 gathers: past its persistence of 3
    assert all(quiet.update(small, ["a", "b"], i) is None for i in range(5))
    no_wait = [row(sync=0.0), row(busy_extra=0.03, sync=0.001)]  # longer, but nobody waits for it
    unwaited = SlowRankDetector()
    assert all(unwaited.update(no_wait, ["a", "b"], i) is None for i in range(5))
    # Under DDP every rank's whole step is about the same (they meet in the all-reduce), and the rank that
    # waits can end its step a little later than the one it waited for: the slow rank is the one whose OWN
    # work (busy) is longest, here rank 1, although rank 0's whole step is 2 ms longer.
    waiting_longer = [row(sync=0.033), row(busy_extra=0.03)]
    assert waiting_longer[0]["step"] > waiting_longer[1]["step"]
    by_work = SlowRankDetector()
    found = [by_work.update(waiting_longer, ["a", "b"], i) for i in (10, 20, 30)][-1]
    assert found is not None and (found.rank, found.cause, found.host) == (1, "data", "b")


def test_anatomy_marks_split_backward_at_the_last_gradient() -> None:
    model = _net()
    anatomy = StepAnatomy()
    anatomy.watch(model)
    x = torch.randn(4, 6)
    anatomy.mark("data")
    loss = model(x).sum()
    anatomy.mark("forward")
    loss.backward()
    time.sleep(0.002)  # between the last gradient and the mark: counted as waiting
    anatomy.mark("backward")
    anatomy.stepped(applied=True)
    anatomy.end_step()  # a repeated end is no step
    anatomy.stepped(applied=False)  # an accumulation micro-batch's s.step: no step either
    assert anatomy.steps == 1
    med = anatomy.medians()
    assert (
        med["sync"] >= 0.002
        and med["backward"] > 0
        and med["busy"] == pytest.approx(med["step"] - med["sync"])
    )
    anatomy.unwatch()


def test_fit_shows_mfu_and_counts_flops(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
        result = fit(
            s, model, opt, s.loader(_data(), batch_size=16), step, max_steps=4, log=str(tmp_path / "l.jsonl")
        )
    # batch 16: forward 2*16*(6*16 + 16*2) = 4096; backward: both weight grads + layer 2's input grad
    assert result.anatomy["flops_per_step"] == 4096 + 2 * 16 * (6 * 16 + 2 * 16 * 2)
    assert result.anatomy["peak"].measured and "measured" in capsys.readouterr().out
    rows = [line for line in (tmp_path / "l.jsonl").read_text().splitlines()]
    assert '"mfu"' in rows[-1] and '"tflops"' in rows[-1]
    assert (tmp_path / "cpu_peak.json").exists()  # cached per machine: CPU model + threads


def test_flops_per_optimizer_step_count_every_micro_batch_of_an_accumulating_step(
    tmp_path: Path, monkeypatch
) -> None:
    """With accumulation=3 an optimizer step runs three micro-batches: its model FLOPs (and so the FLOP/s
    and MFU fit reports per step) are three micro-batches' worth, not the one micro-batch counted."""
    monkeypatch.setenv("DDPKIT_CACHE_DIR", str(tmp_path))
    with ddpkit.session(seed=0, verbose=False, log_to=None, accumulation=3) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
        loader = s.loader(_data(96), batch_size=48)  # micro-batches of 16, as in the test above
        result = fit(s, model, opt, loader, step, max_steps=2, log=str(tmp_path / "l.jsonl"))
    micro = 4096 + 2 * 16 * (6 * 16 + 2 * 16 * 2)  # one micro-batch of 16 (test_fit_shows_mfu_...)
    assert result.anatomy["flops_per_step"] == 3 * micro
    row = json.loads((tmp_path / "l.jsonl").read_text().splitlines()[-1])
    assert row["flops_per_step"] == 3 * micro
    # MFU is the FLOP/s of a whole optimizer step against the peak: the row's own rate over the peak
    assert row["mfu"] == pytest.approx(row["tflops"] * 1e12 / result.anatomy["peak"].flops, rel=1e-6)


def test_peak_table_and_cpu_cache(tmp_path: Path) -> None:
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16").flops == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA H100 PCIe", "bf16").flops == pytest.approx(756.5e12)
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "tf32").flops == pytest.approx(156e12)
    assert gpu_peak("NVIDIA GeForce GTX 1080", "fp32") is None and gpu_peak("Tesla T4", "bf16") is None
    calls: list[int] = []
    first = cpu_peak(1, directory=str(tmp_path), measure=lambda t: calls.append(t) or 1e9)
    again = cpu_peak(1, directory=str(tmp_path), measure=lambda t: calls.append(t) or 2e9)
    assert calls == [1] and first.flops == again.flops == 1e9 and again.measured


def _with_cache(cache: str, fn, *args):
    """On a pool rank: `fn(*args)` with DDPKIT_CACHE_DIR set, as a rank started from the test would have it."""
    before = os.environ.get("DDPKIT_CACHE_DIR")
    os.environ["DDPKIT_CACHE_DIR"] = cache
    try:
        return fn(*args)
    finally:
        if before is None:
            del os.environ["DDPKIT_CACHE_DIR"]
        else:
            os.environ["DDPKIT_CACHE_DIR"] = before


def test_trace_ranks_draws_every_rank_and_names_the_planted_one(
    pool2, tmp_path: Path, capsys, monkeypatch
) -> None:
    """`ddpkit trace --ranks`: one panel per rank over 40 steps, and fit's slow-rank report for a plant.

    The command's entry point in this process, its ranks the pool's (`ddpkit.spawn` would start two new
    interpreters, ~10 s of CPU for imports); `ddpkit trace` spawning its ranks is tests/test_trace.py's."""
    from ddpkit.tools import trace, trace_ranks

    cache = str(tmp_path / "cache")
    monkeypatch.setenv("DDPKIT_CACHE_DIR", cache)

    def on_the_pool(fn, nproc: int, args, **options) -> list:
        assert fn is trace_ranks.rank_main and nproc == 2 and options["threads"] == 1, (fn, nproc, options)
        return pool2.run(_with_cache, cache, fn, *args, timeout=120)

    monkeypatch.setattr(ddpkit, "spawn", on_the_pool)
    code = trace.main(
        ["--ranks", "--workload", "cnn", "--steps", "40", "--slow", "1:30:data", "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0
    ranks = json.loads((tmp_path / "ranks_anatomy.json").read_text())
    assert [len(r["history"]) for r in ranks] == [40, 40]  # every step of both ranks, 6 phases each
    assert all(len(row) == 6 for r in ranks for row in r["history"])
    assert (tmp_path / "ranks.png").stat().st_size > 10_000
    assert "slow rank: rank 1 on" in out and "in data loading" in out, out
    with pytest.raises(DdpkitError, match="RANK:MS:data"):
        trace.main(["--ranks", "--slow", "1:x:disk", "--out", str(tmp_path)])


def test_bad_options_are_one_paragraph_errors() -> None:
    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(_data(), batch_size=16)
        step = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
        with pytest.raises(DdpkitError, match="flops=-1 is not 'count'"):
            fit(s, model, opt, loader, step, max_steps=1, flops=-1)
        with pytest.raises(DdpkitError, match="anatomy every=0 is below 1"):
            fit(s, model, opt, loader, step, max_steps=1, anatomy_every=0, flops=None)
    with pytest.raises(DdpkitError, match="out of range"):
        SlowRankDetector(persistence=0)


def test_a_hand_loop_gets_its_steps_anatomy_through_the_session() -> None:
    """s.backward / s.step mark the phases (the session's hook lines); s.model watched the gradients."""
    with ddpkit.session(seed=0, verbose=False, log_to=None, accumulation=2) as s:
        model = s.model(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        applied = 0
        for x, y in s.loader(_data(), batch_size=8):
            with s.accumulate(model):
                s.backward(nn.functional.cross_entropy(model(x), y))
            applied += s.step(opt).stepped
        assert s.anatomy.steps == applied == 8  # 64 samples, global batch 8: 8 optimizer steps
        med = s.anatomy.medians()
        assert med["forward"] > 0 and med["backward"] > 0 and med["optimizer"] > 0
