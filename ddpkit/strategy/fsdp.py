"""FSDP2 (`torch.distributed.fsdp.fully_shard`): each rank holds 1/N of the parameters, gradients and
optimizer state; blocks are all-gathered for their forward and backward, gradients reduce-scattered.

    model = s.model(net, strategy="fsdp")                                  # blocks found by size
    model = s.model(net, strategy=FSDPOptions(blocks=(Block,), cpu_offload=True))

Blocks: each module of a class in `blocks` becomes its own FSDP unit (one all-gather per block, so only
one block is whole at a time); without `blocks`, every module whose parameters not yet in a unit reach
`min_block_params` becomes one, children first. The root takes what is left.

FSDP2 does not broadcast rank 0's weights as DDP does: every rank must build the same ones (ddpkit
seeds every rank alike). `wrap` compares a checksum of every parameter and buffer across ranks before
sharding and stops with the name of the first one that differs.

Precision: "bf16" computes in bf16 (`MixedPrecisionPolicy(param_dtype=bf16)`, from
`PrecisionPlan.fsdp_policy`) and reduces gradients in fp32; "16" (fp16 with a loss scale) is refused by
`ddpkit.parallel.precision.resolve_precision(..., loss_scale=False)` (in `build`): the scaler's inf check
would be per shard, so ranks could disagree about skipping a step. Micro-batches skip the reduce-scatter with
`set_requires_gradient_sync(False)`; the clipped norm is the all-reduced norm of the sharded gradients,
identical on every rank. `ddpkit.step.sharding` does not apply: the optimizer state is already sharded.

Collectives: on CPU ranks of one machine FSDP2's all-gather and reduce-scatter go through shared memory
(`ddpkit.parallel.fsdp_shm`, `FSDPOptions(shm="auto")`; one segment per session, closed with it), else over
the process group (gloo / NCCL); the note printed at `s.model` says which.

torch.compile (`s.model(..., compile=True)`): `wrap_compiling` compiles each unit in place before
`fully_shard`, torchtitan's order (why: `ddpkit.parallel.compiling`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.errors import problem
from ddpkit.observe import step_memory
from ddpkit.parallel import cpu_allocator, fsdp_shm
from ddpkit.parallel.collectives import Ranks, same_everywhere
from ddpkit.parallel.compiling import CompileBlock
from ddpkit.parallel.modules import unwrap
from ddpkit.parallel.precision import FP32, PrecisionPlan, resolve_precision
from ddpkit.parallel.shape import Shape
from ddpkit.strategy import adapters, fsdp_export, fsdp_init, fsdp_units, registry
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.fsdp_options import FSDPOptions


def build(options: FSDPOptions | None, shape: Shape, precision: PrecisionPlan) -> FSDP:
    """The registered builder (`ddpkit.strategy.registry`): fp16 is refused here, the one refusal."""
    return FSDP(options, shape, resolve_precision(precision, "", loss_scale=False))


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(getattr(model, "_orig_mod", model), FSDPModule)


@dataclasses.dataclass(frozen=True)
class Blueprint:
    """How a model was sharded, without its data: its meta `skeleton` (`observe.step_memory`), the units
    sharded on their own (names) and `fully_shard`'s keywords (mesh, precision policy, offload)."""

    skeleton: nn.Module
    units: tuple[str, ...]
    kwargs: Mapping[str, Any]


class FSDP(Strategy):
    name = "fsdp"
    shards_state = True
    grads_between_micro_batches = False  # FSDP keeps unsharded gradients aside until the synced one
    collective_forward = True  # each block's forward all-gathers its parameters

    def __init__(
        self, options: FSDPOptions | None, shape: Shape, precision: PrecisionPlan | None = None
    ) -> None:
        super().__init__()
        self.options = options or FSDPOptions()
        # its ranks and the layout it shards over (`ddpkit.parallel.layout`): placed here when not yet
        self.shape = registry.place(registry.Chosen(self.name, self.options), shape)
        self.precision = precision or FP32  # the one default plan; fp16: refused by `make`
        self._built: dict[int, fsdp_init.Shards] = {}  # modules `build` made, until `wrap` takes them
        self.shm_comms: fsdp_shm.ShmComms | None = None  # the shared-memory collectives, once opened
        # each wrapped model's meta skeleton, units and policy: what `micro_batch="auto"` rebuilds on fake
        # tensors to estimate its first step (`ddpkit.training.oom_ahead`); no tensor data is kept. Taken
        # only when that option asked for it (`keep_blueprints`): a copy per `s.model` otherwise.
        self._keep_blueprints = False
        self.blueprints: weakref.WeakKeyDictionary[nn.Module, Blueprint] = weakref.WeakKeyDictionary()

    def build(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """Run the model factory on the meta device, keeping this rank's shards of its initial weights
        (`ddpkit.strategy.fsdp_init`); `wrap` then shards the meta module and fills the shards."""
        cpu_allocator.return_freed_blocks()  # the build's full temporaries (CPU) go back when freed
        module, shards, peak = fsdp_init.build(factory, *self.shard_index())
        self._built[id(module)] = shards
        name = type(module).__name__
        self.notes.append(
            f"FSDP2: built {name} shard by shard (at most {peak / 2**20:.0f} MiB of full tensors at once)"
        )
        return module

    def shard_index(self) -> tuple[int, int]:
        """This rank's place on the layout's shard dimension: which dim-0 chunk it holds, of how many.
        1-D: (rank, world); a 2-D (replicate, shard) mesh: (rank % shard, shard)."""
        layout = self.shape.layout or registry.layout_of(registry.Chosen(self.name), self.shape)
        return layout.coordinate(self.shape.rank, "shard"), layout.shard

    def keep_blueprints(self) -> None:
        self._keep_blueprints = True

    def blueprint(self, model: nn.Module) -> Blueprint | None:
        return self.blueprints.get(model)

    def check_compile(self) -> None:
        """FSDP compiles per block (`wrap_compiling`): torch.compile is never applied to the whole model."""

    def check_loadable(self, saved: str, optimizers: Collection[str], path: object) -> None:
        if saved not in registry.sharded() and optimizers:
            raise problem(
                f"{path} was saved with strategy={saved!r}; its optimizer state ({', '.join(optimizers)}) "
                "cannot be loaded into FSDP's sharded optimizer",
                "Load only the model (the weights reshard) and start the optimizer afresh, or resume with "
                "the strategy it was saved with",
            )

    def describe(self) -> str:
        return "FSDP2 (fully_shard)"

    # -- the model ----------------------------------------------------------------------------------
    def wrap(self, module: nn.Module, device: torch.device, options: object = None) -> nn.Module:
        return self._shard(module, device, options, None)[0]

    def wrap_compiling(
        self, module: nn.Module, device: torch.device, options: object, compile_block: CompileBlock
    ) -> tuple[nn.Module, list[str]]:
        """`wrap` with torch.compile the torchtitan way: each FSDP unit (the blocks `fsdp_units.choose_units`
        picks) compiled in place BEFORE `fully_shard`, so that FSDP2's all-gather and reduce-scatter
        hooks stay eager around the compiled blocks (they are `torch._dynamo.disable`d). A model with no
        unit of its own (every parameter in the root) is compiled whole, in place. Returns the model
        and the names of the compiled modules ("" for the root)."""
        return self._shard(module, device, options, compile_block)

    def _shard(
        self, module: nn.Module, device: torch.device, options: object, compile_block: CompileBlock | None
    ) -> tuple[nn.Module, list[str]]:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if options is not None and not isinstance(options, FSDPOptions):
            raise problem(
                "DDP options (find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view, "
                "broadcast_buffers, sync_batchnorm, comm_hook) were passed with strategy='fsdp'",
                "Leave them out with FSDP, or pass strategy='ddp'",
            )
        opts = options or self.options  # this model's own options; the session's stay for the next model
        if is_fsdp(module):
            raise problem(
                "the model is already sharded with fully_shard", "Pass the plain nn.Module; ddpkit shards it"
            )
        rank, world = self.shard_index()
        shards = self._built.pop(id(module), None)
        if shards is None:
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                raise problem(
                    f"the {type(module).__name__} was built on the meta device: its initial weights were "
                    "never drawn, so ddpkit cannot give the shards the values one process would have",
                    "Pass the class or a function that builds it, e.g. s.model(Net, strategy='fsdp') or "
                    "s.model(lambda: Net(cfg)); ddpkit builds it shard by shard",
                )
            shards = fsdp_init.cut(module, rank, world)  # a model built whole: keep our chunks, free the rest
        check_identical(shards, self.shape)
        if device.type == "cpu" and cpu_allocator.return_freed_blocks():
            self.notes.append(
                "FSDP2 on CPU: freed blocks of 1 MiB or more go back to the kernel (peak memory"
                " follows the live shards; see ddpkit.strategy.rank_memory)"
            )
        mesh = self.shape.device_mesh()  # 1-D: ("shard", world); HSDP: ("replicate", R) x ("shard", S)
        mp = self.precision.fsdp_policy()
        offload: OffloadPolicy = OffloadPolicy()
        if opts.cpu_offload and device.type != "cpu":
            offload = CPUOffloadPolicy()
        elif opts.cpu_offload:
            self.notes.append("cpu_offload=True changes nothing on CPU ranks (the shards are on the CPU)")
        kwargs = dict(
            mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=opts.reshard_after_forward
        )
        units = fsdp_units.choose_units(module, opts)
        if self._keep_blueprints:
            self.blueprints[module] = Blueprint(step_memory.skeleton(module), tuple(units), kwargs)
        compiled: list[str] = []
        if compile_block is not None:  # before fully_shard: the torchtitan order (hooks outside the graphs)
            compiled = units or [""]
            for name in compiled:
                compile_block(module.get_submodule(name))
        fsdp_units.shard(module, units, **kwargs)
        note = self._collectives([module.get_submodule(n) for n in units] + [module], device, opts)
        self.notes.extend([note] if note else [])
        fsdp_init.fill(module, shards, device)  # only this rank's shards are ever allocated on the device
        total = sum(p.numel() for p in module.parameters())
        self.notes.append(
            f"FSDP2: {len(units)} block(s) sharded on their own + the root, over {world} ranks "
            f"({total / 1e6:.1f}M parameters, about {total / world / 1e6:.1f}M per rank)"
        )
        return module, compiled

    def _collectives(self, modules: list[nn.Module], device: torch.device, opts: FSDPOptions) -> str:
        """Shared-memory all-gather and reduce-scatter for CPU ranks of one machine (`fsdp_shm`);
        the note that says which path the collectives take. Collective (the segment is mapped once)."""
        if device.type != "cpu" or self.shape.world_size == 1:
            return "FSDPOptions(shm=True) changes nothing on GPU ranks (NCCL)" if opts.shm is True else ""
        if opts.shm is False:
            return f"FSDP2 collectives over {dist.get_backend()} (FSDPOptions(shm=False))"
        if self.shm_comms is None:
            self.shm_comms = fsdp_shm.open_comms()
        return fsdp_shm.attach(modules, self.shm_comms)

    def close(self) -> None:
        """Unmap the shared-memory segment (the session's end)."""
        if self.shm_comms is not None:
            self.shm_comms.close()

    def owns(self, model: nn.Module) -> bool:
        return is_fsdp(model)

    def eval_module(self, model: nn.Module) -> nn.Module:
        return model  # its forward all-gathers: evaluation must keep the ranks in step (ddpkit.fit does)

    # -- a training step ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def skip_sync(self, model: nn.Module) -> Iterator[None]:
        inner: Any = getattr(model, "_orig_mod", model)  # an FSDPModule
        inner.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            inner.set_requires_gradient_sync(True)

    def clip(self, params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The total norm over gradients grouped by mesh (torch's foreach ops take one mesh at a time:
        under FSDP x TP the split weights live on the 2-D mesh, the whole ones on the data mesh), each
        group's norm combined over its ranks (`full_tensor`: replicated dimensions counted once)."""
        params = [p for p in params if p.grad is not None]
        groups = by_mesh(params)
        norm = total_norm([[p.grad for p in group if p.grad is not None] for group in groups])
        for group in groups:
            nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def join(self, model: nn.Module, joinables: tuple[object, ...]) -> contextlib.AbstractContextManager:
        raise problem(
            "s.join is not supported with strategy='fsdp': every rank takes part in each block's all-gather, "
            "so a rank cannot stop early",
            "Give every rank the same number of batches (s.loader shards evenly; pass drop_last=True for "
            "an exact split)",
        )

    # -- checkpoints --------------------------------------------------------------------------------
    def full_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # collective; empty except on rank 0
        return adapters.saved_state(unwrap(model), state)  # tensors only

    def load_full_state(self, model: nn.Module, state: Mapping[str, torch.Tensor], *, strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        strict = adapters.check_loadable(unwrap(model), state, strict=strict)  # PEFT: no frozen base
        set_model_state_dict(
            model, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def write_full_state(self, model: nn.Module, path: Path, rank: int) -> int:
        return fsdp_export.write(model, path, rank)  # one gathered tensor at a time, never the model whole

    def sharded_state(self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": adapters.saved_state(unwrap(model), get_model_state_dict(model))}
        for name, opt in optimizers.items():
            state[name] = get_optimizer_state_dict(model, opt)
        return state

    def load_sharded_state(
        self, model: nn.Module, optimizers: Mapping[str, torch.optim.Optimizer], state: dict
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        strict = adapters.check_loadable(unwrap(model), state["model"], strict=True)  # PEFT: trainable only
        set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
        for name, opt in optimizers.items():
            set_optimizer_state_dict(model, opt, state[name])


def by_mesh(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by their gradient's DeviceMesh (plain tensors: one group), in first-seen order."""
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    return list(groups.values())


def total_norm(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The 2-norm over every group: each group's norm made whole over its mesh, then combined as
    sqrt(sum of squares) (one group: its norm as it is)."""
    from torch.distributed.tensor import DTensor

    norms = []
    for grads in groups:
        norm = nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        return norms[0]
    if not norms:
        return torch.zeros(())
    return torch.stack([n.double() for n in norms]).pow(2).sum().sqrt().to(norms[0].dtype)


def check_identical(shards: fsdp_init.Shards, ranks: Ranks) -> None:
    """Stop before sharding when the ranks built different weights (FSDP2 does not broadcast them).

    Each rank checksummed every full tensor while it briefly held it (built or cut one at a time), so
    one all-reduce of a vector of integers compares them all without any rank holding the model."""
    names, sums = shards.checksums()
    agree = same_everywhere(ranks, sums)
    if bool(agree.all()):
        return
    first = names[int((~agree).nonzero()[0])]
    raise problem(
        f"the ranks built different initial weights ({int((~agree).sum())} of {len(names)} tensors differ, "
        f"first {first!r}); FSDP2 does not copy global rank 0's weights to the others as DDP does",
        "Build the model on every rank from the same seed (ddpkit.session(seed=...) seeds all ranks alike; "
        "do not draw per-rank random numbers before s.model), or load the same weights everywhere",
    )
