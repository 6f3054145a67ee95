"""The GPU acceptance script's tensor-parallel and CUDA-step checks on a machine without CUDA: each skips
with a line saying why (the CPU rehearsal, and a single GPU, where TP cannot run: NCCL refuses two ranks
on one device); the TP check's rank function, the part that is not CUDA's, trains TP(2) on two gloo ranks
to one process's weights."""

from __future__ import annotations

import pytest

from ddpkit.strategy import TPOptions
from ddpkit.tools import gpucheck, gpucheck_tp

NEW = ("tp-nccl", "tp-async", "plan-memory-cuda", "cuda-oom", "cuda-trace")


def test_each_new_check_is_listed_and_skips_on_the_cpu_with_its_reason(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DDPKIT_GPUCHECK_DEVICE", "cpu")
    assert gpucheck.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert set(NEW) <= set(listed)
    code = gpucheck.main(["--only", ",".join(NEW), "--keep", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = {line.split()[1]: line for line in out.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")}
    assert list(lines) == list(NEW)
    for line in lines.values():
        assert line.startswith("SKIP") and "CUDA only (rehearsal on the CPU): " in line, line
    assert "needs 2 GPUs" in lines["tp-nccl"] and "max_memory_allocated" in lines["plan-memory-cuda"]
    assert "0 passed, 0 failed, 5 skipped" in out and "ALL PASS" in out


@pytest.mark.parametrize("name", ["tp-nccl", "tp-async"])
def test_on_one_gpu_tensor_parallelism_says_why_it_does_not_run(tmp_path, monkeypatch, name: str) -> None:
    """With one GPU visible (the count is the context's: nothing touches CUDA before the skip)."""
    monkeypatch.setenv("DDPKIT_GPUCHECK_DEVICE", "cuda")
    ctx = gpucheck.Context(out=tmp_path, gpus=1)
    with pytest.raises(gpucheck.Skip, match="needs 2 GPUs, 1 visible: NCCL refuses two ranks on one device"):
        gpucheck_tp.CHECKS[name](ctx)


def test_the_tp_checks_ranks_train_to_one_process_weights_on_gloo(pool2) -> None:
    ref = gpucheck_tp._train(None)
    got = pool2.run(gpucheck_tp._train, TPOptions(tensor=2, plan=gpucheck_tp.PLAN), timeout=120)[0]
    assert got["mesh"].endswith("tensor 2"), got["mesh"]
    worst, where = gpucheck_tp._worst(got["weights"], ref["weights"])
    assert worst <= gpucheck_tp.TOLERANCE, (worst, where)
