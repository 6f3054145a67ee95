"""One process's initial weights under tensor parallelism (and FSDP x TP), bit for bit, without any rank
holding the whole model: FSDP's shard-by-shard build (`ddpkit.strategy.fsdp_init`) with another cut.

    module, shards, peak, probe = build(factory, plan_of, where)   # where: this rank's Piece
    shards = cut(module, dims, where)                              # a model the user built whole

`fsdp_init.ShardedInit` runs the factory on `meta`, gives every op that writes values real CPU values
(one full temporary at a time, the generator consumed as one process consumes it) and keeps each rank's
dim-0 chunk of a parameter once it is no longer written. Under TP a rank's part of a parameter is the
plan's piece (column-wise weights split on dim 0 over the tensor ranks, row-wise on dim 1, the rest
whole), then FSDP's dim-0 chunk of that piece over the shard ranks (what `fully_shard` keeps of a
DTensor: its local tensor cut on dim 0). The plan is written in final parameter names, which do not exist
yet while the constructor runs (a block is built before it is attached); so a dry run of the factory on
plain `meta` (no values drawn, the generator state put back) records the order of parameter registrations
and each one's final name, and the replay, the same constructor, registers the same parameters in the same
order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy import adapters, fsdp_init, hf


@dataclass(frozen=True)
class Piece:
    """Where this rank stands: its tensor coordinate of `tensor`, its shard coordinate of `shard`."""

    tensor_rank: int
    tensor: int
    shard_rank: int
    shard: int

    def keep(self, full: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's part of `full`: the tensor-parallel piece on `dim` (None: whole), then FSDP's
        dim-0 chunk of it (a copy: the full tensor is freed)."""
        piece = full
        if dim is not None and self.tensor > 1:
            parts = torch.chunk(full, self.tensor, dim=dim)  # DTensor's Shard cuts as torch.chunk does
            inside = self.tensor_rank < len(parts)
            piece = parts[self.tensor_rank] if inside else full.narrow(dim, 0, 0)
        return fsdp_init.chunk(piece, self.shard_rank, self.shard).clone()


def registration_names(factory: Callable[[], nn.Module]) -> tuple[list[str | None], nn.Module]:
    """The final name of each parameter registration, in the order the constructor makes them, and the
    meta model of the dry run (what the plan is read from). No value is drawn; the generator's state is
    put back anyway."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    order: list[tuple[nn.Module, str]] = []
    handle = register_module_parameter_registration_hook(lambda m, n, p: order.append((m, n)))
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            model = factory()
    finally:
        handle.remove()
    where: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        where.setdefault(id(m), name)
    names = [(f"{where[id(m)]}.{n}" if where[id(m)] else n) if id(m) in where else None for m, n in order]
    return names, model


class TPInit(fsdp_init.ShardedInit):
    """ShardedInit whose cut is the plan's piece then FSDP's chunk of it (`Piece.keep`)."""

    def __init__(self, names: list[str | None], dims: dict[str, int | None], where: Piece) -> None:
        super().__init__(where.shard_rank, where.shard)
        self.names, self.dims, self.where = names, dims, where
        self.count = 0
        self.name_of: dict[int, str] = {}

    def on_parameter(self, module: nn.Module, name: str, param: Any) -> None:
        index, self.count = self.count, self.count + 1
        super().on_parameter(module, name, param)
        if isinstance(param, torch.Tensor) and param.is_meta and not self.paused:
            final = self.names[index] if index < len(self.names) else None
            key = fsdp_init._key(param)
            if final is not None and key not in self.name_of:
                self.name_of[key] = final

    def _cut(self, key: int, whole: torch.Tensor) -> torch.Tensor:
        return self.where.keep(whole, self.dims.get(self.name_of.get(key, "")))

    def _flush(self, keep: set[int]) -> None:
        live = [k for k in self.full if k in self.params and self.params[k]() is not None]
        for k in [k for k in live if k not in keep]:
            whole = self._real(self.params[k](), overwrite=False)  # type: ignore[arg-type]  # live: above
            self.sums[k] = fsdp_init.checksum(whole)
            self.chunks[k] = self._cut(k, whole)
            del self.full[k], self.refs[k]

    def _regather(self, k: int) -> torch.Tensor:
        raise problem(
            f"the model's constructor wrote {self.name_of.get(k, 'a parameter')!r} again after it was cut "
            "to this rank's tensor-parallel piece, which ddpkit cannot gather back under TP",
            "Build the model whole and pass the module (s.model(net) with net = Net()), or write each "
            "parameter once in the constructor",
        )

    def finish(self, module: nn.Module) -> fsdp_init.Shards:
        """This rank's pieces, the buffers (whole) and the full tensors' checksums, by final name."""
        self._flush(set())
        self._prune()
        shards = fsdp_init.Shards()
        with torch.no_grad():
            for name, p in module.named_parameters():
                dim = self.dims.get(name)
                if not p.is_meta:  # built for real (an explicit device): cut here
                    shards.sums[name] = fsdp_init.checksum(p)
                    shards.chunks[name] = self.where.keep(p.detach().cpu(), dim)
                    continue
                k = fsdp_init._key(p)
                if k in self.full:  # values given by `p.data = t`: no op to see
                    whole = self._real(p, overwrite=False)
                    self.sums[k], self.chunks[k] = fsdp_init.checksum(whole), self.where.keep(whole, dim)
                shards.sums[name] = self.sums.get(k, 0)
                mine = self.chunks.get(k)
                if mine is None:
                    shards.never_written.append(name)
                    mine = self.where.keep(torch.zeros(p.shape, dtype=p.dtype), dim)
                shards.chunks[name] = mine
            for name, b in module.named_buffers():
                written = b.is_meta and fsdp_init._key(b) in self.full
                value = (
                    self._real(b, overwrite=False).clone() if written else torch.zeros(b.shape, dtype=b.dtype)
                )
                if not b.is_meta:
                    value = b.detach().cpu().clone()
                shards.buffers[name], shards.sums[f"buffer:{name}"] = value, fsdp_init.checksum(value)
        self.full.clear()
        self.refs.clear()
        return shards


def build(
    factory: Callable[[], nn.Module],
    dims_of: Callable[[nn.Module], dict[str, int | None]],
    where: Piece,
) -> tuple[nn.Module, fsdp_init.Shards, int]:
    """Run `factory` on the meta device (a dry run first, for the names; `dims_of(probe)` reads the
    plan's split dimensions from it); the meta module, this rank's pieces, the peak temporary bytes."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    names, probe = registration_names(factory)
    dims = dims_of(probe)
    del probe
    mode = TPInit(names, dims, where)
    handle = register_module_parameter_registration_hook(mode.on_parameter)
    try:
        with (
            torch.device("meta"),
            mode,
            fsdp_init._Constants(),
            fsdp_init._init_functions(mode),
            adapters.cast_on_meta(),
            hf.loading_as_is(functools.partial(fsdp_init._as_one_process, mode)),
        ):
            module = factory()
    finally:
        handle.remove()
    if not isinstance(module, nn.Module):
        raise problem(
            f"the model factory returned a {type(module).__name__}, not an nn.Module",
            "Pass a class or a function that builds the model, e.g. s.model(Net)",
        )
    shards = mode.finish(module)
    hf.check_written(module, shards.never_written)
    return module, shards, mode.peak_full


def cut(module: nn.Module, dims: dict[str, int | None], where: Piece) -> fsdp_init.Shards:
    """A model the user built whole: this rank's pieces of it, then the module moved to `meta` (ties kept)."""
    shards = fsdp_init.Shards()
    with torch.no_grad():
        for name, p in fsdp_init._named(module.named_parameters()):  # state_dict's names, as fill's
            shards.sums[name] = fsdp_init.checksum(p)
            shards.chunks[name] = where.keep(p.detach().cpu(), dims.get(name))
        for name, b in fsdp_init._named(module.named_buffers()):
            shards.buffers[name] = b.detach().cpu().clone()
            shards.sums[f"buffer:{name}"] = fsdp_init.checksum(b)
    ties = list(hf.tied_owners(module).values())
    module.to("meta")
    from ddpkit.strategy import tp_plan

    tp_plan.retie(module, ties)
    return shards
