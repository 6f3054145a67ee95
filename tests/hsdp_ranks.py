"""Rank functions for the HSDP tests (run in the shared rank pools; importable by pickle)."""

from __future__ import annotations

import contextlib
import io

import torch
import torch.nn.functional as F
from fsdp_train import Block, data, full_params, net, train

import ddpkit
from ddpkit.strategy import FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions


def trained(replicate: int, shard: int) -> dict:
    """The README loop under HSDP(replicate x shard), with what a user would check that HSDP was on:
    the mesh of every parameter and this rank's local shards (bitwise, for the replica comparison)."""
    options = HSDPOptions(replicate=replicate, shard=shard, min_block_params=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), ddpkit.session(seed=0, strategy=options) as s:
        model = s.model(lambda: _net(), strategy=options)
        meshes = {
            name: (
                tuple(p.device_mesh.mesh_dim_names or ()),
                tuple(p.device_mesh.shape),
                [type(pl).__name__ for pl in p.placements],
            )
            for name, p in model.named_parameters()
        }
        describe = s.strategy.describe()
    result = train(options, steps=4, accumulation=2)  # its own session: the same options, trained
    with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
        model = s.model(lambda: _net(), strategy=options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s.rank))  # other data on every rank
        s.backward(model(x).square().mean())
        s.step(opt)
        local = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
        whole = full_params(model)
    return {
        **result,
        "meshes": meshes,
        "printed": printed.getvalue(),
        "describe": describe,
        "local": local,
        "whole_after_step": whole,
    }


def _net() -> torch.nn.Module:
    from fsdp_train import net

    return net()


def refused(replicate: int | None, shard: int | None, within_node: bool = True) -> str:
    try:
        with ddpkit.session(
            seed=0,
            verbose=False,
            strategy=HSDPOptions(replicate=replicate, shard=shard, within_node=within_node),
        ):
            return "no error"
    except ddpkit.DdpkitError as err:
        return str(err)


def strategy_of(kind: str, replicate: int | None = None, shard: int | None = None) -> object:
    """The strategy: "hsdp" (with its degrees), "fsdp" (blocks as HSDP's), or a name ("ddp", "single") as it is."""
    if kind == "hsdp":
        return HSDPOptions(replicate=replicate, shard=shard, blocks=(Block,))
    if kind == "fsdp":
        return FSDPOptions(blocks=(Block,))
    return kind


def _moments(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg and exp_avg_sq of every parameter, whole (DTensors gathered: a collective)."""
    out = {}
    for name, p in ddpkit.unwrap(model).named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            t = opt.state[p][key].detach()
            out[f"{name}:{key}"] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def checkpointed(
    root: str,
    kind: str,
    degrees: tuple,
    stop: int | None,
    resume: bool,
    steps: int = 6,
    loader: bool = True,
    go_on: bool = False,
) -> dict:
    """Train `steps` steps under `strategy_of(kind, *degrees)`; stop after `stop` (saving model, AdamW,
    step and, with `loader`, the loader to `root`), or resume from `root` and finish. Returns the whole
    weights and moments (gathered), this rank's local shards and what ran. `go_on`: after the save at
    `stop`, train on to `steps` in the same session (an uninterrupted run that saved on the way), its
    local shards and moments at the end under "end"."""
    strategy = strategy_of(kind, *degrees)
    shard_optimizer = False if kind == "ddp" else "auto"  # DDP: every rank keeps all the moments, compared
    with ddpkit.session(seed=0, verbose=False, strategy=strategy, shard_optimizer=shard_optimizer) as s:
        model = s.model(net, strategy=strategy)  # the factory: built shard by shard
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = s.loader(data(), batch_size=12, shuffle=True)
        state = {"model": model, "optimizer": opt, **({"loader": batches} if loader else {})}
        done = int(s.load(root, **state, step=0)["step"]) if resume else 0
        it = iter(batches)
        for _ in range((stop if stop is not None else steps) - done):
            x, y = next(it)
            s.backward(F.cross_entropy(model(x), y))
            s.step(opt, max_norm=1.0)
        if stop is not None:
            s.save(root, **state, step=stop)
        out = {
            "params": full_params(model),
            "moments": _moments(model, opt),
            "local": _local(model),
            "strategy": s.strategy.describe(),
            "done": done,
        }
        if go_on:
            for _ in range(steps - stop):
                x, y = next(it)
                s.backward(F.cross_entropy(model(x), y))
                s.step(opt, max_norm=1.0)
            out["end"] = {"local": _local(model), "moments": _moments(model, opt)}
        return out


def _local(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's local shards (a DTensor's local part; a plain tensor whole), copied."""
    return {
        n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for n, p in ddpkit.unwrap(model).named_parameters()
    }


def initial_mixed() -> dict:
    """`fsdp_init_ranks.Mixed` built shard by shard under HSDP (2 x 2): its later `ln.weight.mul_(0.5)`
    gathers a sharded parameter back (over the shard group's chunks, not the world's). The initial
    weights gathered, and one process's from the same seed."""
    from fsdp_init_ranks import Mixed, _state

    options = HSDPOptions(replicate=2, shard=2, blocks=(torch.nn.Linear,))
    with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
        model = s.model(Mixed, strategy=options)
        torch.manual_seed(0)
        return {"hsdp": _state(model), "one": _state(Mixed())}


def hf_weights(kind: str, root: str) -> dict:
    """s.model(factory, weights=root) under HSDP (2 x 2): the weights gathered, and the elements this
    rank holds (its shard group's share: rows by its place on the shard dimension)."""
    from hf_ranks import _state, factory

    options = HSDPOptions(replicate=2, shard=2, min_block_params=10_000)
    with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
        model = s.model(factory(kind), strategy=options, weights=root)
        local = sum(p.to_local().numel() for p in ddpkit.unwrap(model).parameters())
        return {"got": _state(model), "local": local}


def background_roundtrip(root: str) -> dict:
    """An HSDP (2 x 2) background save (shards copied in the call, written by the writer thread over its
    own group), training going on meanwhile, then a load into a fresh model: the weights and moments at
    the call, and the loaded ones."""
    strategy = strategy_of("hsdp", 2, 2)
    with ddpkit.session(seed=0, verbose=False, strategy=strategy) as s:
        model = s.model(net, strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = iter(s.loader(data(), batch_size=12, shuffle=True))

        def steps(k: int) -> None:
            for _ in range(k):
                x, y = next(batches)
                s.backward(F.cross_entropy(model(x), y))
                s.step(opt)

        steps(2)
        at_call = {"params": full_params(model), "moments": _moments(model, opt)}
        s.save(root, model=model, optimizer=opt, step=2, background=True)
        steps(2)  # while the writer saves the copy
        s.checkpoints.wait()
        torch.manual_seed(1)  # every rank alike (after s.model each rank's generator is its own)
        fresh = s.model(net, strategy=strategy)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        s.load(root, model=fresh, optimizer=fresh_opt)
        return {
            "at_call": at_call,
            "loaded": {"params": full_params(fresh), "moments": _moments(fresh, fresh_opt)},
            "moved": full_params(model),
        }
