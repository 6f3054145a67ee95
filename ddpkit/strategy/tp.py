"""Tensor parallelism: each layer the plan names split over the `tensor` ranks of a node (torch's
`parallelize_module`), FSDP2 over the data dimensions (replicate x shard) of the same mesh.

    ddpkit.session(strategy="tp")                                        # a node's ranks split each layer
    ddpkit.session(strategy=TPOptions(tensor=2))                         # FSDP(N/2) x TP(2)
    s.model(lambda: AutoModelForCausalLM.from_config(cfg), strategy=TPOptions(tensor=2))   # HF's own plan
    s.model(Net, strategy=TPOptions(tensor=2, plan={"blocks.*.attn.q": "colwise", ...}))

The layout (`ddpkit.parallel.layout`, dims replicate x shard x tensor, tensor innermost so that a tensor
group is consecutive ranks of a node) gives the 3-D mesh; the tensor submesh splits the layers, the data
submesh (replicate, shard) shards them with FSDP2: shard 1 is replicated data parallelism, DDP's arithmetic
(torch's DDP cannot hold tensor-parallel parameters: its only route, `_pre_dp_module_transform`, leaves
the split weights out of the module's parameters after one forward). Every rank of a tensor group reads
the same batch: the data is split by the data-parallel rank (`Layout.coordinate`), never the global rank.

What ddpkit adds to torch's styles: the plan read in three forms and refused before any collective where
it cannot work (`ddpkit.strategy.tp_plan`); tied weights tied again after the split; one process's initial
weights, bitwise, built piece by piece (`ddpkit.strategy.tp_init`); one process's dropout, or a refusal
(`ddpkit.strategy.tp_random`; under `compile=` the draws' dispatch mode is not held, since torch.compile
runs a block eagerly under one, and a dropout is refused instead); the gradient norm over gradients of
several meshes (`FSDP.clip`, grouped by mesh; torch's `clip_grad_norm_` refuses them); loss parallel, the
head's logits kept sharded for torch's `loss_parallel()` (`ddpkit.strategy.tp_loss`). Checkpoints are
FSDP's: DCP shards of DTensors, which load into any layout (TP, FSDP, HSDP, DDP, one process) and
convert to one safetensors file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ddpkit.errors import DdpkitError, problem
from ddpkit.parallel.compiling import CompileBlock
from ddpkit.parallel.layout import Layout
from ddpkit.parallel.precision import PrecisionPlan, resolve_precision
from ddpkit.parallel.shape import Shape
from ddpkit.strategy import fsdp_init, fsdp_units, registry, tp_init, tp_loss, tp_plan, tp_random
from ddpkit.strategy.fsdp import FSDP, check_identical
from ddpkit.strategy.fsdp_options import FSDPOptions
from ddpkit.strategy.tp_options import TPOptions


@dataclasses.dataclass(frozen=True)
class MeshNamed(Shape):
    """The placed shape of a tensor-parallel session: the start-up line names its mesh even when only the
    tensor degree is above 1 ("2 rank(s), mesh replicate 1 x shard 1 x tensor 2"), as it does for
    FSDP x TP: ranks that split layers read one batch, which the user must see."""

    def describe(self) -> str:
        base = super().describe()
        if self.layout is None or self.layout.meshed or self.layout.tensor == 1:
            return base
        return f"{base}, mesh {self.layout.describe()}"


def build(options: TPOptions | None, shape: Shape, precision: PrecisionPlan) -> TP:
    """The registered builder (`ddpkit.strategy.registry`): the 3-D mesh from the degrees; fp16 refused."""
    return TP(options, shape, resolve_precision(precision, "", loss_scale=False))


class TP(FSDP):
    name = "tp"

    def __init__(
        self, options: TPOptions | None, shape: Shape, precision: PrecisionPlan | None = None
    ) -> None:
        opts = options or TPOptions()
        placed = registry.place(registry.Chosen(self.name, opts), shape)
        super().__init__(opts.fsdp(), placed, precision)
        self.shape = MeshNamed(**{f.name: getattr(self.shape, f.name) for f in dataclasses.fields(Shape)})
        self.tp_options = opts
        self._mesh: Any = None
        self._factories: dict[int, tuple[Callable[[], nn.Module], torch.Tensor]] = {}  # to cut again
        self.draws: list[tp_random.OneProcessDraws] = []  # each wrapped model's mode (tests count its draws)

    # -- the layout ---------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        assert self.shape.layout is not None  # placed in __init__
        return self.shape.layout

    def mesh(self) -> Any:
        """The 3-D DeviceMesh (replicate, shard, tensor), made once (a collective: every rank's s.model)."""
        if self._mesh is None:
            self._mesh = self.shape.device_mesh()
        return self._mesh

    def data_mesh(self) -> Any:
        """The data submesh FSDP2 shards over: (replicate, shard), HSDP's form (replicate 1: FSDP's)."""
        return self.mesh()["replicate", "shard"]

    def piece(self) -> tp_init.Piece:
        rank, layout = self.shape.rank, self.layout
        return tp_init.Piece(
            layout.coordinate(rank, "tensor"), layout.tensor, layout.coordinate(rank, "shard"), layout.shard
        )

    def describe(self) -> str:
        return f"TP {self.layout.tensor} x FSDP2 ({self.layout.describe()})"

    # -- the model ----------------------------------------------------------------------------------
    def plan(self, module: nn.Module, options: TPOptions | None = None) -> tp_plan.Plan:
        """The model's plan as torch styles, checked (one paragraph naming the layer and the fix)."""
        opts = options or self.tp_options
        return tp_plan.read(
            module,
            opts.plan,
            degree=self.layout.tensor,
            sequence_parallel=opts.sequence_parallel,
            loss_parallel=opts.loss_parallel,
        )

    def build(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """The factory on the meta device, keeping this rank's pieces of one process's initial weights
        (`ddpkit.strategy.tp_init`); `wrap` splits, shards and fills the meta module.

        The pieces are cut by the session's plan (s.model's own options reach only `wrap`): a model
        whose own TPOptions split it otherwise is built again there, from the generator's state of this
        build (`_pieces`). A session plan this model cannot take (the default "auto" on a model without
        a plan of its own) is refused there only if the model brings no plan either."""

        def dims_of(probe: nn.Module) -> dict[str, int | None]:
            try:
                return tp_plan.tp_dims(probe, self.plan(probe))
            except DdpkitError:  # the session's plan does not fit: the model's own options may (wrap)
                return {}

        state = torch.get_rng_state()
        module, shards, peak = tp_init.build(factory, dims_of, self.piece())
        self._built[id(module)] = shards
        self._factories[id(module)] = (factory, state)
        self.notes.append(
            f"TP: built {type(module).__name__} piece by piece (at most {peak / 2**20:.0f} MiB of full "
            "tensors at once)"
        )
        return module

    def _shard(
        self, module: nn.Module, device: torch.device, options: object, compile_block: CompileBlock | None
    ) -> tuple[nn.Module, list[str]]:
        opts = self._options(options)
        plan = self.plan(module, opts)  # every refusal before any collective
        if compile_block is not None:  # no one-process draws inside compiled code: a dropout refused
            tp_random.refuse_compiled_draws(module, opts.random)
        shards = self._pieces(module, opts)
        if shards is None:
            if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
                raise problem(
                    f"the {type(module).__name__} was built on the meta device: its initial weights were "
                    "never drawn, so ddpkit cannot give the tensor-parallel pieces the values one process "
                    "would have",
                    "Pass the class or a function that builds it, e.g. s.model(Net, "
                    "strategy=TPOptions(...)); ddpkit builds it piece by piece",
                )
            shards = tp_init.cut(module, tp_plan.tp_dims(module, plan), self.piece())
        check_identical(shards, self.shape)
        named = tp_plan.describe(module, opts.plan)  # before fully_shard renames the class
        split = len(tp_plan.matches(module, plan))
        tp_plan.apply(module, self.mesh()["tensor"], plan)
        fsdp = opts.fsdp()
        units = fsdp_units.choose_units(module, fsdp)
        offload = self._offload(fsdp, device)
        compiled: list[str] = []
        if compile_block is not None:  # after the split, before fully_shard: torchtitan's order
            compiled = units or [""]
            for name in compiled:
                compile_block(module.get_submodule(name))
        fsdp_units.shard(
            module,
            units,
            mesh=self.data_mesh(),
            mp_policy=self.precision.fsdp_policy(),
            reshard_after_forward=fsdp.reshard_after_forward,
            offload_policy=offload,
        )
        fsdp_init.fill(module, shards, device)
        tp_plan.guard_shapes(module, plan)  # a wrong plan's shape error names the layer
        heads = tp_loss.heads(module, tp_plan.matches(module, plan), plan) if opts.loss_parallel else []
        tp_loss.guard(module, heads)  # a training forward outside loss_parallel() refused
        columns, rows = tp_plan.column_layers(module, plan)
        if compile_block is None:  # compiled code would run eagerly under its dispatch mode
            self.draws.append(tp_random.install(module, columns, rows, opts.random))
        layout = self.layout
        self.notes.append(
            f"TP: plan {named} ({split} modules split over tensor {layout.tensor}"
            + (", sequence parallel" if opts.sequence_parallel else "")
            + (f", loss parallel: the logits of {', '.join(heads)} stay sharded" if heads else "")
            + f"); FSDP2 over replicate {layout.replicate} x shard {layout.shard}, {len(units)} block(s) + "
            + ("the root; dropout as one process draws it" if compile_block is None else "the root, compiled")
            + (" (per-shard: in distribution only)" if opts.random == "per-shard" else "")
        )
        return module, compiled

    def _pieces(self, module: nn.Module, opts: TPOptions) -> fsdp_init.Shards | None:
        """The pieces `build` kept for `module` (None: the user built it whole), cut again by this
        model's own plan when it is not the session's: the factory replayed from the generator's state
        it first ran from (the same draws: one process's initial weights), the state after put back."""
        shards = self._built.pop(id(module), None)
        made = self._factories.pop(id(module), None)
        ours = (opts.plan, opts.sequence_parallel, opts.loss_parallel)
        session = self.tp_options
        if made is None or ours == (session.plan, session.sequence_parallel, session.loss_parallel):
            return shards
        factory, state = made
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        try:
            _, shards, _ = tp_init.build(
                factory, lambda probe: tp_plan.tp_dims(probe, self.plan(probe, opts)), self.piece()
            )
        finally:
            torch.set_rng_state(after)
        return shards

    def _offload(self, fsdp: FSDPOptions, device: torch.device) -> Any:
        """FSDP2's offload policy for the data dimensions: `cpu_offload` keeps the shards, their
        gradients and the optimizer step on the CPU of accelerator ranks, as FSDP's does; on CPU ranks
        it changes nothing (the shards are on the CPU already), which the start-up lines say."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if fsdp.cpu_offload and device.type != "cpu":
            return CPUOffloadPolicy()
        if fsdp.cpu_offload:
            self.notes.append("cpu_offload=True changes nothing on CPU ranks (the shards are on the CPU)")
        return OffloadPolicy()

    def _options(self, options: object) -> TPOptions:
        """This model's TP options: its own (the degrees must be the session's), else the session's."""
        if options is None:
            return self.tp_options
        if isinstance(options, FSDPOptions):
            raise problem(
                "s.model got FSDPOptions in a tensor-parallel session",
                "Pass TPOptions (its blocks, min_block_params, ... are FSDP's for the data dimensions)",
            )
        if not isinstance(options, TPOptions):
            raise problem(
                "DDP options (find_unused_parameters, static_graph, ...) were passed with strategy='tp'",
                "Leave them out with tensor parallelism, or pass strategy='ddp'",
            )
        asked = registry.layout_of(registry.Chosen(self.name, options), self.shape)
        if asked != self.layout:
            raise problem(
                f"s.model asked for the layout {asked.describe()}, but this session's mesh is already "
                f"{self.layout.describe()}",
                "Pass the degrees once, to ddpkit.session(strategy=TPOptions(tensor=...)), and leave them "
                "out of s.model's options",
            )
        return options

    def _collectives(self, modules: list[nn.Module], device: torch.device, opts: FSDPOptions) -> str:
        return ""
