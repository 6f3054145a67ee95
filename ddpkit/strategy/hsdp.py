"""HSDP, hybrid sharding: FSDP2 inside a node (fast links), replicas across nodes (one all-reduce of each
node's shard per step over the slow link). torchtitan's replicate x shard degrees, on one 2-D mesh.

    ddpkit.session(strategy="hsdp")                              # shard = a node's ranks, replicate = nodes
    ddpkit.session(strategy=HSDPOptions(replicate=2, shard=2))   # forced, e.g. 2 x 2 on 4 local ranks

The strategy is `ddpkit.strategy.fsdp.FSDP` given another layout of the same ranks: the mesh
`(("replicate", R), ("shard", S))` (`ddpkit.parallel.layout`, placed on the `Shape` once), which
`fully_shard` takes for HSDP. Ranks
`[k*S, (k+1)*S)` form shard group k (contiguous: with `S` dividing the local world size, inside a node);
rank r holds chunk `r % S` of every parameter (`FSDP.shard_index`), identical on the R replicas. Per step
FSDP2 reduce-scatters gradients inside the shard group, then all-reduces the shard across the replica
group; the optimizer state is sharded S ways.

Degrees: by default `shard` is the local world size and `replicate` the number of nodes (read from the
launcher by the session's `Shape`); either may be given, the other follows from the world size
(`ddpkit.parallel.layout.build`, the one rule). A shape whose degrees do not multiply to the world, or
whose shard groups would span nodes (unless `within_node=False`), is refused before any collective. The
shape is fixed for the session: options a single `s.model` passes must ask for the same one.

Checkpoints: DCP shards, as FSDP's (`ddpkit.checkpoint.dcp`; each replica group's pieces are written
once): an HSDP checkpoint resumes under FSDP at any world size, under HSDP at another shape, and under
DDP or in one process (read whole, optimizer included: a job that lost nodes resumes on the rest);
FSDP's and DDP's checkpoints load under HSDP as under FSDP (DDP's optimizer state refused, its weights
resharded).

Collectives go over the process group (gloo / NCCL), unless `HSDPOptions(shm=True)` on CPU ranks: then each
shard group's all-gathers and reduce-scatters go through a shared-memory segment of its own
(`ddpkit.parallel.fsdp_shm` over the group's ranks, which must share a machine, as `within_node` keeps
them), and only the replicas' all-reduce stays on the process group. "auto", the default, keeps the
process group under HSDP (FSDP's 1-D mesh takes shared memory by default; HSDP's way is asked for).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ddpkit.errors import problem
from ddpkit.parallel import fsdp_shm
from ddpkit.parallel.compiling import CompileBlock
from ddpkit.parallel.precision import PrecisionPlan, resolve_precision
from ddpkit.parallel.shape import Shape
from ddpkit.parallel.shm_allreduce import ShmAllReduce
from ddpkit.strategy import registry
from ddpkit.strategy.fsdp import FSDP
from ddpkit.strategy.fsdp_options import FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions


def build(options: HSDPOptions | None, shape: Shape, precision: PrecisionPlan) -> HSDP:
    """The registered builder (`ddpkit.strategy.registry`): the 2-D mesh from the degrees; fp16 refused."""
    return HSDP(options, shape, resolve_precision(precision, "", loss_scale=False))


class HSDP(FSDP):
    name = "hsdp"

    def __init__(
        self, options: HSDPOptions | None, shape: Shape, precision: PrecisionPlan | None = None
    ) -> None:
        opts = options or HSDPOptions()
        placed = registry.place(registry.Chosen(self.name, opts), shape)  # the degrees, before FSDP's part
        super().__init__(opts.fsdp(), placed, precision)
        self.hsdp_options = opts

    @property
    def degrees(self) -> tuple[int, int]:
        """(replicate, shard): the layout's data-parallel degrees."""
        layout = self.shape.layout
        assert layout is not None  # placed in __init__
        return layout.replicate, layout.shard

    def describe(self) -> str:
        assert self.shape.layout is not None
        return f"HSDP (fully_shard, {self.shape.layout.describe()})"

    def _shard(
        self, module: nn.Module, device: torch.device, options: object, compile_block: CompileBlock | None
    ) -> tuple[nn.Module, list[str]]:
        """`FSDP._shard` on the 2-D mesh. A model's own `HSDPOptions` must ask for this session's degrees
        (an "auto" session took them from the first model's options); the mesh is never re-made."""
        if isinstance(options, HSDPOptions):
            asked = registry.layout_of(registry.Chosen(self.name, options), self.shape)
            if (asked.replicate, asked.shard) != self.degrees:
                raise problem(
                    f"s.model asked for HSDP replicate {asked.replicate} x shard {asked.shard}, but this "
                    f"session's mesh is already replicate {self.degrees[0]} x shard {self.degrees[1]}",
                    "Pass the degrees once, to ddpkit.session(strategy=HSDPOptions(replicate=..., "
                    "shard=...)), and leave them out of s.model's options",
                )
            options = options.fsdp()
        replicate, shard = self.degrees
        self.notes.append(f"HSDP: {replicate} replica(s) x {shard} shard(s) ({self.shape.describe()})")
        return super()._shard(module, device, options, compile_block)

    def _collectives(self, modules: list[nn.Module], device: torch.device, opts: FSDPOptions) -> str:
        """The shard groups' all-gather and reduce-scatter through shared memory when `shm=True` on CPU
        ranks (a segment per shard group, mapped once: collective over the group); else the process
        group's. The note that says which."""
        if not dist.is_initialized():
            return ""
        backend = dist.get_backend()
        if opts.shm is not True:
            return (
                f"HSDP collectives over {backend} (HSDPOptions(shm=True): shard groups through shared memory)"
            )
        if device.type != "cpu":
            return "HSDPOptions(shm=True) changes nothing on GPU ranks (NCCL)"
        if self.shm_comms is None:
            group = _mesh(modules).get_group("shard")
            self.shm_comms = fsdp_shm.ShmComms(ShmAllReduce(group, chunk_mb=fsdp_shm.CHUNK_MB))
        note = fsdp_shm.attach(modules, self.shm_comms)
        return f"HSDP, in each shard group: {note}; the replicas' all-reduce over {backend}"


def _mesh(modules: list[nn.Module]) -> DeviceMesh:
    """The 2-D mesh `fully_shard` placed the parameters on (the one FSDP2's collectives use)."""
    for module in modules:
        for p in module.parameters():
            if isinstance(p, DTensor):
                return p.device_mesh
    raise problem("no sharded parameter to read HSDP's mesh from", "Pass a model with parameters")
