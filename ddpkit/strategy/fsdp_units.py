"""FSDP's unit rule, shared by the strategy and `plan --memory`: which submodules become FSDP units
(`choose_units`: the `blocks` named, else by size, children first, tied modules kept together), the
check that a tie lands in one unit, and the `fully_shard` of the units, then the root (`shard`).

    units = choose_units(model, FSDPOptions(min_block_params=1))   # e.g. ["blocks.0", "blocks.1", "head"]
    shard(model, units, mesh=mesh, mp_policy=policy)               # fully_shard each unit, then the root

Public for the tools (the tools contract allows this module): `plan --memory` lays a model out on fake
tensors by the same rule the session shards it with, instead of a copy of it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy import checkpointing, hf
from ddpkit.strategy.fsdp_options import FSDPOptions


def choose_units(module: nn.Module, opts: FSDPOptions) -> list[str]:
    """Names of the submodules that become FSDP units, children before parents: the session's FSDP and
    `plan --memory` choose them with this one rule."""
    chosen: list[str] = []
    if opts.blocks is not None:
        found = [n for n, m in module.named_modules() if n and isinstance(m, opts.blocks)]
        chosen = list(dict.fromkeys(checkpointing.unit_name(n) for n in found))  # a wrapper shards whole
        if not chosen:
            names = ", ".join(b.__name__ for b in opts.blocks)
            raise problem(
                f"blocks=({names}) matches no module of the {type(module).__name__}",
                "Name the class of the repeated blocks, or leave blocks=None to shard by size",
            )
    else:
        taken: set[int] = set()

        def visit(name: str, m: nn.Module) -> None:
            for child_name, child in m.named_children():
                visit(f"{name}.{child_name}" if name else child_name, child)
            if not name or type(m).forward is nn.Module.forward:  # ModuleList: fully_shard refuses
                return
            if checkpointing.unit_name(name) != name:  # inside a checkpoint wrapper: the wrapper's unit
                return
            free = [p for p in m.parameters() if id(p) not in taken]
            outside = not all(_inside(tied.get(id(p)), name) for p in free)  # it would split a tie
            if not outside and sum(p.numel() for p in free) >= opts.min_block_params:
                chosen.append(name)
                taken.update(id(p) for p in free)

        tied = {k: [m for m, _ in v] for k, v in hf.tied_owners(module).items()}
        visit("", module)
    nested = [n for n in chosen if any(n.startswith(f"{o}.") for o in chosen)]  # children first
    units = nested + [n for n in chosen if n not in nested]
    check_tied_in_one_unit(module, units)
    return units


def shard(module: nn.Module, units: list[str], **kwargs: Any) -> None:
    """`fully_shard` each unit (children first, as `choose_units` orders them), then the root, which
    takes every parameter left; `kwargs` are fully_shard's (mesh, mp_policy, offload_policy, ...)."""
    from torch.distributed.fsdp import fully_shard

    for name in units:
        fully_shard(module.get_submodule(name), **kwargs)
    fully_shard(module, **kwargs)


def _inside(owners: list[str] | None, unit: str) -> bool:
    """True unless a tied parameter is also held by a module outside `unit`: such a module cannot be a
    unit (a larger one, holding all the owners, takes the parameter; FSDP2 refuses one in two units)."""
    return owners is None or all(o == unit or o.startswith(f"{unit}.") for o in owners)


def _unit_of(name: str, units: list[str]) -> str:
    inner = [u for u in units if name == u or name.startswith(f"{u}.")]
    return max(inner, key=len) if inner else ""  # "": the root unit


def check_tied_in_one_unit(module: nn.Module, units: list[str]) -> None:
    """A clear error before sharding when tied modules (an embedding and an output head sharing one
    weight) would land in two FSDP units; FSDP2 would stop only at the first forward."""
    for owners in hf.tied_owners(module).values():
        where = {_unit_of(m, units) for m, _ in owners}
        if len(where) > 1:
            names = ", ".join(f"{m}.{a}" for m, a in owners)
            raise problem(
                f"the tied parameters {names} would be sharded in different FSDP units "
                f"({', '.join(repr(u or '<root>') for u in sorted(where))}); FSDP2 refuses a parameter "
                "shared between two units",
                "Leave blocks=None (ddpkit keeps tied modules in one unit), or name blocks that hold "
                "both tied modules or neither",
            )
