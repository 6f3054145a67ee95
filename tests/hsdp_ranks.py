"""Rank functions for the HSDP tests (run in the shared rank pools; importable by pickle)."""

from __future__ import annotations

import contextlib
import io

import torch
from fsdp_train import full_params, train

import ddpkit
from ddpkit.strategy.hsdp_options import HSDPOptions


def trained(replicate: int, shard: int) -> dict:
    """The README loop under HSDP(replicate x shard), with what a user would check that HSDP was on:
    the mesh of every parameter and this rank's local shards (bitwise, for the replica comparison)."""
    options = HSDPOptions(replicate=replicate, shard=shard, min_block_params=1)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), ddpkit.session(seed=0, strategy=options) as s:
        model = s.model(lambda: _net(), strategy=options)
        meshes = {
            name: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape),
                   [type(pl).__name__ for pl in p.placements])
            for name, p in model.named_parameters()
        }  # fmt: skip
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
    return {**result, "meshes": meshes, "printed": printed.getvalue(), "describe": describe, "local": local,
            "whole_after_step": whole}  # fmt: skip


def _net() -> torch.nn.Module:
    from fsdp_train import net

    return net()


def refused(replicate: int | None, shard: int | None, within_node: bool = True) -> str:
    try:
        with ddpkit.session(seed=0, verbose=False,
                            strategy=HSDPOptions(replicate=replicate, shard=shard, within_node=within_node)):  # fmt: skip
            return "no error"
    except ddpkit.DdpkitError as err:
        return str(err)


def verify_rank(spec: object, replicate: int, shard: int) -> bytes:
    """`ddpkit.verify`'s rank under HSDP(replicate x shard): the spec says "fsdp" (its names are DDP and
    FSDP); on the ranks the strategy becomes the HSDP options, the rest of the check unchanged."""
    from ddpkit.verify.run import ddp_rank

    object.__setattr__(spec, "strategy", HSDPOptions(replicate=replicate, shard=shard, min_block_params=1))
    return ddp_rank(spec)  # type: ignore[arg-type]


def resume_refused(path: str) -> str:
    """An HSDP checkpoint saved, then loaded under HSDP: refused with a clear message (not supported yet)."""
    options = HSDPOptions(replicate=2, shard=2, min_block_params=1)
    with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
        model = s.model(_net, strategy=options)
        opt = torch.optim.AdamW(model.parameters())
        s.save(path, model=model, optimizer=opt)
        try:
            s.load(path, model=model, optimizer=opt)
        except ddpkit.DdpkitError as err:
            return str(err)
    return "no error"
