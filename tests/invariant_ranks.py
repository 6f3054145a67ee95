"""Rank functions for tests/test_invariant.py (top level, so the pool's spawned ranks can import them).

One pool of 4 gloo ranks runs every world size: subgroups {0}, {0, 1} and {0, 1, 2, 3} (every rank
creates every group, as torch requires); a rank outside the world size of a run sits it out.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.data import make_loader, plan_batch
from ddpkit.step import invariant
from ddpkit.tools.workloads import TinyGPT, TutorialCNN

STEPS, BATCH, CHUNK = 8, 32, 4  # 8 steps: every mutant of the mode changes a hash at the first


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4)
    )


def _gpt() -> nn.Module:
    return TinyGPT(vocab=64, seq=16, d=32, heads=2, layers=2)


def workload(name: str) -> tuple[Any, Any, Any]:
    """(model factory, data set of STEPS global batches, loss_fn(module, batch) -> mean loss)."""
    g = torch.Generator().manual_seed(1)
    n = STEPS * BATCH
    if name == "mlp":
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)
        )
        return _mlp, data, lambda m, b: F.cross_entropy(m(b[0]), b[1])
    if name == "cnn":
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        )
        return TutorialCNN, data, lambda m, b: F.cross_entropy(m(b[0]), b[1])
    tokens = torch.randint(0, 64, (n, 17), generator=g)
    data = torch.utils.data.TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return _gpt, data, lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())


def weights_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _groups() -> dict[int, Any]:
    return {w: dist.new_group(list(range(w))) for w in (1, 2, 4)}


def _train(name: str, world: int, group: Any, mode: str) -> tuple[str, dict[str, int]]:
    build, data, loss_fn = workload(name)
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rank = dist.get_rank(group)
    batch = plan_batch(BATCH, None, world_size=world)
    counters: dict[str, int] = {}
    torch.manual_seed(1000 + rank)  # each rank's own global stream, as ddpkit's session leaves it
    if mode == "any-world":
        mode_state = invariant.configure("any-world", CHUNK, seed=0, group=group)
        assert mode_state is not None
        options: dict[str, Any] = {}
        shuffle, drop_last = mode_state.loader_options(data, BATCH, True, options)
        loader = make_loader(
            data,
            batch,
            rank=rank,
            device=torch.device("cpu"),
            seed=0,
            shuffle=shuffle,
            drop_last=drop_last,
            **options,
        )
        for b in loader:
            mode_state.step(model, opt, b, loss_fn)
        counters = vars(mode_state.counters)
    else:  # plain DDP on each rank's contiguous share: the same samples, DDP's sums
        loader = make_loader(
            data,
            batch,
            rank=rank,
            device=torch.device("cpu"),
            seed=0,
            drop_last=True,
            sampler=invariant.global_order(data, True),
        )
        wrapped = nn.parallel.DistributedDataParallel(model, process_group=group) if world > 1 else model
        for b in loader:
            loss_fn(wrapped, b).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return weights_hash(model), dict(counters)


def train_all(names: list[str], modes: list[str]) -> dict[str, Any]:
    """{f"{name}/{mode}/{world}": (hash, counters)} from every rank inside that world size."""
    groups = _groups()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for name in names:
        for mode in modes:
            for world, group in groups.items():
                if rank < world:
                    out[f"{name}/{mode}/{world}"] = _train(name, world, group, mode)
                dist.barrier()
    return out


def session_run(root: str | None, steps: int, save_at: int | None, load: bool, env: dict | None) -> str:
    """The MLP (with dropout) through `ddpkit.session(reproducible="any-world")`: `steps` steps; saves at
    `save_at` (model, optimizer, loader, the mode's step counter), or with `load` resumes from there."""
    import ddpkit

    with ddpkit.session(reproducible="any-world", chunk=CHUNK, seed=0, verbose=False, env=env) as s:
        build, data, loss_fn = workload("mlp")
        torch.manual_seed(0)
        model = s.model(build())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = s.loader(data, batch_size=BATCH, shuffle=True)
        state = dict(model=model, optimizer=opt, loader=loader, invariant=s.invariant)
        done = 0
        if load:
            s.load(root, **state)
            done = s.invariant.counters.steps
        for batch in loader:
            if done == steps:
                break
            s.invariant.step(model, opt, batch, loss_fn)
            done += 1
            if done == save_at and not load:
                s.save(root, **state)
        return weights_hash(ddpkit.unwrap(model))


def anatomy_of_steps(steps: int, env: dict | None) -> dict[str, float]:
    """`s.invariant.step` marks the session's step anatomy: the steps counted, their phases timed."""
    import ddpkit

    with ddpkit.session(reproducible="any-world", chunk=CHUNK, seed=0, verbose=False, env=env) as s:
        build, data, loss_fn = workload("mlp")
        model = s.model(build())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for done, batch in enumerate(s.loader(data, batch_size=BATCH, shuffle=True)):
            if done == steps:
                break
            s.invariant.step(model, opt, batch, loss_fn)
        return {"steps": s.anatomy.steps, **s.anatomy.medians()}


def ddp_loops_refused() -> list[str]:
    """A loop written for DDP in an any-world session: `loss.backward()` through the DDP model, then
    `s.backward` and `s.step`; each must fail with its paragraph instead of training another run.
    (`s.invariant.step` runs the inner module: `session_run` and the tests above train with it.)"""
    import ddpkit

    said = []
    with ddpkit.session(reproducible="any-world", chunk=CHUNK, seed=0, verbose=False) as s:
        build, data, _ = workload("mlp")
        model = s.model(build())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = next(iter(s.loader(data, batch_size=BATCH, shuffle=True)))
        for attempt in ("plain", "s.backward", "s.step"):
            try:
                if attempt == "plain":  # DDP's forward, then its all-reduce in the backward: the guard
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                elif attempt == "s.backward":  # refused before any backward
                    s.backward(torch.zeros((), requires_grad=True))
                else:
                    s.step(opt)
                said.append(f"{attempt}: no error")
            except Exception as err:  # the comm hook's error reaches the caller through autograd
                said.append(f"{attempt}: {type(err).__name__}: {err}")
    return said
