"""A step that runs out of memory: with `ddpkit.session(micro_batch="auto")` every rank learns it in the
same micro-batch, the step is dropped (no gradient of it applied), and `ddpkit.fit` re-runs it with the
micro-batch halved and the accumulation doubled, so the weights are those of a run that started at the
smaller micro-batch (within the accumulation floor of tests/test_accumulate.py, 1e-5); without the
opt-in a one-paragraph error names the micro-batch and the fix.

Out of memory twice over: planted (`torch.OutOfMemoryError` raised in the forward or, from a gradient
hook, in the backward, on one rank only) and real (an address-space limit, `RLIMIT_AS`, on one rank:
the CPU allocator's malloc fails and torch raises its own error).
"""

from __future__ import annotations

import ctypes
import resource
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from recording import Recorder
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.step import micro_batches, oom

FLOOR = 1e-5  # k micro-batches of b against one batch of k*b (tests/test_accumulate.py)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _dataset(n: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g))


class _Planted:
    """`torch.OutOfMemoryError` on `rank` for micro-batches above `above` samples, from optimizer step
    `from_step` on, at the `at`-th micro-batch of a step (0-based), in the forward or the backward."""

    def __init__(self, rank: int, above: int, from_step: int, at: int, where: str) -> None:
        self.rank, self.above, self.from_step, self.at, self.where = rank, above, from_step, at, where
        self.fired = 0

    def __call__(self, s: ddpkit.Session, model: nn.Module, batch: tuple) -> torch.Tensor:
        x, y = batch
        out = model(x)
        boom = (
            s.rank == self.rank
            and len(x) > self.above
            and s.stepper.steps >= self.from_step
            and s.stepper.pending == self.at
        )
        if boom:
            self.fired += 1
            if self.where == "forward":
                raise torch.OutOfMemoryError("planted: CUDA out of memory. Tried to allocate 2.00 GiB")

            def hook(grad: torch.Tensor) -> torch.Tensor:
                raise torch.OutOfMemoryError("planted in the backward")

            out.register_hook(hook)
        return F.cross_entropy(out, y)


def train(per_rank: int, k: int, steps: int, planted: _Planted | None = None, auto: bool = True) -> dict:
    """fit with `per_rank` samples per loader micro-batch and accumulation k; the weights after it."""
    with ddpkit.session(
        seed=0, accumulation=k, verbose=False, micro_batch="auto" if auto else None, log_to=None
    ) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        loader = s.loader(_dataset(), batch_size=per_rank * s.world_size * k, shuffle=True)
        step = (lambda m, b: planted(s, m, b)) if planted else (lambda m, b: F.cross_entropy(m(b[0]), b[1]))
        result = ddpkit.fit(s, model, opt, loader, step, max_steps=steps, progress=False, flops=None)
        return {
            "params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()],
            "steps": result.steps,
            "parts": s.stepper.oom.parts if s.stepper.oom else None,
            "splits": s.stepper.oom.splits if s.stepper.oom else None,
            "accumulation": s.stepper.blocks,
            "fired": planted.fired if planted else 0,
            "last_oom": s.stepper.oom.last_oom if s.stepper.oom else None,
        }


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.numerics
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_oom_on_one_rank_reruns_the_step_split(where: str, pool2) -> None:
    """Rank 1 alone runs out of memory at the 2nd micro-batch of step 2 (the 1st one's gradients are
    already there): both ranks drop the step, split 16 -> 8, and the run ends equal to one that used
    micro-batches of 8 with twice the accumulation from the start."""
    planted = _Planted(rank=1, above=8, from_step=1, at=1, where=where)
    got = pool2.run(train, 16, 2, 5, planted)
    ref = pool2.run(train, 8, 4, 5)
    assert got[1]["fired"] == 1 and got[0]["fired"] == 0, "planted once, on rank 1 only"
    for r in got:
        assert r["steps"] == 5, "the dropped step is re-run, not skipped"
        assert r["parts"] == 2 and r["accumulation"] == 4, "micro-batch halved, accumulation doubled"
        assert r["splits"] == [{"step": 2, "parts": 2}]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], got[0]["params"], strict=True))
    # where rank 1's memory was, said to every rank: its model state counted from the live tensors
    # (fp32 weights; the first micro-batch's gradients; SGD's momentum from step 1), the failed allocation
    state = 4 * sum(p.numel() for p in _mlp().parameters())
    asked = 2 << 30 if where == "forward" else 0  # the planted forward error asks for 2.00 GiB
    for r in got:
        w = r["last_oom"][1]
        got_where = (w["parameters"], w["gradients"], w["optimizer_state"], w["failed"])
        assert got_where == (state, state, state, asked), w
        assert w["micro_batch"] >= 0 and list(r["last_oom"]) == [1]
    diff = _diff(got[0]["params"], ref[0]["params"])
    print(f"split after an OOM in the {where} vs micro-batch 8 from the start: max |diff| {diff:.2e}")
    assert diff < FLOOR, f"the split changed the training by {diff:.2e} (global batch or dropped grads?)"


def test_auto_without_an_oom_equals_plain_ddp(pool2) -> None:
    """The deferred gradient all-reduce of micro_batch='auto' gives DDP's numbers."""
    auto = pool2.run(train, 8, 2, 4)[0]["params"]
    plain = pool2.run(train, 8, 2, 4, None, False)[0]["params"]
    diff = _diff(auto, plain)
    print(f"micro_batch='auto' vs DDP's own all-reduce: max |diff| {diff:.2e}")
    assert diff < FLOOR


WIDE = 16384  # the real-OOM model: small weights (4.6 MiB), 128 KiB of activation per sample and tensor


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, WIDE), nn.ReLU(), nn.Linear(WIDE, 10))


def _vm_size() -> int:
    text = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("VmSize:"))) * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _address_limit(budget_mib: int) -> tuple[int, list[torch.Tensor]]:
    """This process's address space plus `budget_mib`, and the ballast that makes it bite. The pool's
    process ran other tests before, and ddpkit's CPU allocator settings (a 1 GiB trim threshold; for a
    big model, no mmap) keep their freed blocks in glibc's heap, hundreds of MiB of it in the middle of
    the heap where malloc_trim cannot return them: a step served from them needs no new address space,
    so whether the limit bit depended on which tests ran first (a run in pytest-xdist's order trained
    through it). The ballast takes that free memory in 1 MiB blocks (no page is touched, no new address
    space while free blocks remain), so the step's own need meets the limit. Keep the ballast alive
    until the limit is lifted. Then blocks of 32 MiB and more are mmapped again, as this module's sizes
    assume (a process that trained a big model keeps them in its heap: ddpkit's M_MMAP_MAX=0, one-way;
    later tests in this pool process get glibc's mmap for them, a matter of speed only)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc_trim(0)
    ballast: list[torch.Tensor] = []
    size = _vm_size()
    while libc.mallinfo2().fordblks >= 2 << 20:
        ballast.append(torch.empty(1 << 20, dtype=torch.uint8))
        if _vm_size() > size:  # that block was new address space: the free blocks left are smaller
            break
    libc.mallopt(-4, 65536)  # M_MMAP_MAX: glibc's default
    libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: 32 MiB, fixed (ddpkit's, without the dynamic raise)
    return _vm_size() + (budget_mib << 20), ballast


def train_under_address_limit(per_rank: int, budget_mib: int, auto: bool = True) -> dict:
    """Rank 1 gets an address-space limit of its current size + `budget_mib` once the model and the
    optimizer exist: micro-batches of `per_rank` need more, half of them less."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(4 * per_rank * 2, 64, generator=g), torch.randint(0, 10, (8 * per_rank,), generator=g)
    )
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with ddpkit.session(seed=0, verbose=False, micro_batch="auto" if auto else None, log_to=None) as s:
        model = s.model(_wide())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(data, batch_size=per_rank * s.world_size)
        try:
            if s.rank == 1:
                limit, _ballast = _address_limit(budget_mib)  # held until this function returns
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
            try:
                result = ddpkit.fit(
                    s,
                    model,
                    opt,
                    loader,
                    lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                    max_steps=3,
                    progress=False,
                    flops=None,
                )
            except DdpkitError as err:
                return {"error": str(err)}
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))  # the pool's process lives on
        return {
            "steps": result.steps,
            "parts": s.stepper.oom.parts if s.stepper.oom else None,
            "params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()],
        }


@pytest.mark.numerics
def test_a_real_allocation_failure_on_one_rank_is_survived(pool2) -> None:
    """malloc fails for real on rank 1 (RLIMIT_AS): 1024 samples need ~220 MiB of address space for
    activations and their gradients (64 MiB tensors: mmapped, so the limit sees each), the limit leaves
    160 MiB; the step re-runs as 2 x 512 (~110 MiB) on both ranks and training goes on."""
    got = pool2.run(train_under_address_limit, 1024, 160)
    for r in got:
        assert "error" not in r, r.get("error")
        assert r["steps"] == 3 and r["parts"] == 2, {k: v for k, v in r.items() if k != "params"}
    assert all(torch.equal(a, b) for a, b in zip(got[0]["params"], got[1]["params"], strict=True))


def test_without_the_opt_in_the_error_names_the_micro_batch_and_the_fix(pool2) -> None:
    """Rank 1 out of memory (a real malloc failure) without micro_batch='auto': one paragraph, not the
    allocator's trace."""
    got = pool2.run(train_under_address_limit_one_rank_error, 1024, 160)
    msg = got[1]
    assert "rank 1 ran out of memory" in msg and "micro-batch 1024" in msg, msg
    assert "micro-batch 512 with twice the accumulation" in msg and "micro_batch='auto'" in msg, msg
    assert "ddpkit plan --memory" in msg and "DefaultCPUAllocator" not in msg, msg


def train_under_address_limit_one_rank_error(per_rank: int, budget_mib: int) -> str:
    """As `train_under_address_limit` without the opt-in: rank 1's error text; rank 0 is ended by the
    gloo timeout of the pool in a real run, so here it only builds the session and waits for rank 1."""
    import torch.distributed as dist

    got = ""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with ddpkit.session(seed=0, verbose=False, log_to=None, strategy="ddp") as s:
        if s.rank == 1:
            model = _wide()  # a plain module on one rank: its step runs alone, no collective to leave hanging
            g = torch.Generator().manual_seed(0)
            x, y = torch.randn(per_rank, 64, generator=g), torch.randint(0, 10, (per_rank,), generator=g)
            try:
                limit, _ballast = _address_limit(budget_mib)  # held until this function returns
                resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
                with oom.guarded(None), oom.naming(per_rank, s.rank, None):
                    F.cross_entropy(model(x), y).backward()
            except DdpkitError as err:
                got = str(err)
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        dist.barrier()
    return got


def test_the_split_is_said_logged_saved_and_a_resume_starts_there(tmp_path: Path, capsys) -> None:
    """One process: a planted OOM splits 16 -> 8, said in one line and logged to the trackers; the
    checkpoint carries it; a new session resumes at 8."""
    ckpt = str(tmp_path / "ckpt")
    planted = _Planted(rank=0, above=8, from_step=0, at=0, where="forward")
    rec = Recorder()
    with ddpkit.session(micro_batch="auto", log_to=rec, env={}, hardware=ddpkit.Hardware(0, 2)) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(_dataset(), batch_size=16)
        ddpkit.fit(
            s, model, opt, loader, lambda m, b: planted(s, m, b), max_steps=2, progress=False, flops=None
        )
        assert s.stepper.oom.parts == 2 and s.stepper.blocks == 2
        s.save(ckpt, model=model, optimizer=opt, stepper=s.stepper)
    capsys_out = capsys.readouterr().out.splitlines()
    said = [line for line in capsys_out if "out of memory" in line]
    assert len(said) == 1, said
    assert (
        "micro-batch 16 per rank" in said[0]
        and "micro-batches of 8 (accumulation 1 -> 2; global batch 16 unchanged)" in said[0]
    )
    where = [line for line in capsys_out if "where rank 0's memory was when it ran out" in line]
    assert len(where) == 1 and "the allocation that failed 2048.0 MiB" in where[0], where
    params_mib = 4 * sum(p.numel() for p in _mlp().parameters()) / (1 << 20)
    logged = next(values for _, values in rec.seen if "micro_batch/size" in values)
    assert logged["micro_batch/size"] == 8.0 and logged["micro_batch/parts"] == 2
    assert logged["oom/parameters_mib"] == params_mib and logged["oom/failed_mib"] == 2048.0
    assert logged["oom/optimizer_state_mib"] == 0.0  # plain SGD keeps no state
    with ddpkit.session(
        micro_batch="auto", verbose=False, log_to=None, env={}, hardware=ddpkit.Hardware(0, 2)
    ) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.load(ckpt, model=model, optimizer=opt, stepper=s.stepper)
        assert s.stepper.oom.parts == 2 and s.stepper.blocks == 2, "resumed at the size that worked"


@pytest.mark.numerics
def test_split_pieces_and_weights() -> None:
    x, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    pieces = micro_batches.split({"x": x, "y": y, "n": 3}, 2)
    assert [p["x"].shape[0] for p, _ in pieces] == [2, 3] and pieces[0][0]["n"] == 3
    assert [w for _, w in pieces] == pytest.approx([0.8, 1.2])  # n_part x parts / n: the mean kept
    assert [w for _, w in micro_batches.split((torch.zeros(8, 3), torch.zeros(8)), 2)] == [1.0, 1.0]
    with pytest.raises(DdpkitError, match=r"cannot be split into 2 parts.*FSDP"):
        micro_batches.split(torch.zeros(1, 3), 2)


def test_what_counts_as_out_of_memory() -> None:
    assert oom.is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    cpu = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
        "to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)"
    )
    assert oom.is_oom(cpu) and not oom.is_oom(RuntimeError("shape mismatch"))
    text = str(oom.explain(cpu, rank=3, micro_batch=32))
    assert "rank 3 ran out of memory" in text and "8192.0 MiB" in text and "micro-batch 16" in text


def test_refusals_name_the_fix() -> None:
    with pytest.raises(DdpkitError, match="micro_batch=8 is not 'auto'"):
        ddpkit.session(micro_batch=8, env={}, hardware=ddpkit.Hardware(0, 2)).__enter__()  # type: ignore[arg-type]
    auto_any_world = ddpkit.session(
        micro_batch="auto",
        reproducible="any-world",
        chunk=4,
        verbose=False,
        env={},
        hardware=ddpkit.Hardware(0, 2),
    )
    with (
        pytest.raises(DdpkitError, match="micro_batch='auto' with reproducible='any-world'"),
        auto_any_world as s,
    ):
        s.stepper  # noqa: B018 (the stepper is built on first use)


def _other_error_on_rank_1() -> str:
    """micro_batch='auto': rank 1's forward raises a plain error; what each rank raises."""
    with ddpkit.session(seed=0, verbose=False, micro_batch="auto", log_to=None) as s:
        model = s.model(_mlp())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step(m: nn.Module, b: tuple) -> torch.Tensor:
            if s.rank == 1:
                raise ValueError("a bug in rank 1's data")
            return F.cross_entropy(m(b[0]), b[1])

        try:
            ddpkit.fit(
                s,
                model,
                opt,
                s.loader(_dataset(), batch_size=32),
                step,
                max_steps=2,
                progress=False,
                flops=None,
            )
        except Exception as err:
            return f"{type(err).__name__}: {err}"
    return ""


def test_another_error_on_one_rank_stops_every_rank_in_the_same_micro_batch(pool2) -> None:
    """No peer is left waiting in the next micro-batch's agreement: rank 1 raises its own error, rank 0
    a DdpkitError that names rank 1."""
    got = pool2.run(_other_error_on_rank_1)
    assert got[1] == "ValueError: a bug in rank 1's data", got
    assert got[0].startswith("DdpkitError: rank(s) [1] failed in this micro-batch"), got
