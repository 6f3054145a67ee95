"""The parallel layout: how a job's ranks divide among every kind of parallelism, as one frozen value.

    layout = build(("replicate", "shard"), shape)     # HSDP on 2 nodes x 4 ranks: replicate 2 x shard 4
    layout = build(("shard",), ClusterShape(8, 8))     # FSDP over 8 ranks, as plan and verify state one
    layout.describe(), layout.describe(short=True)     # "replicate 2 x shard 4", "2x4"
    layout.mesh                                        # (("replicate", 2), ("shard", 4)), outermost first
    layout.device_mesh("cpu")                          # torch's DeviceMesh (every rank calls it)
    layout.coordinate(rank, "shard")                   # this rank's chunk
    layout.groups("shard")                             # the contiguous shard groups

Degrees, outermost first (the mesh's order, as torchtitan's ParallelDims): replicate and shard (data
parallel: whole copies of the model state; one copy sharded), context (the sequence split) and tensor
(layers split), innermost so that a tensor group is consecutive ranks inside a node (the fast link);
pipeline is reserved (anything but 1 is refused). One default rule per degree (`build`); a layout is built
from values, never a process group, so the session, plan, verify, trace and bench build the same layout
from the same choice. Torch is imported only by `device_mesh`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.errors import problem

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DEGREES = ("replicate", "shard", "context", "tensor")  # the mesh's order, outermost first
DATA = ("replicate", "shard")  # the data-parallel degrees: ranks of different batches
RESERVED = ("pipeline",)  # named, not offered yet
TOOL_DEGREES = ("shard", "tensor")  # degrees the tools take by flag (`--shard-degree`, `--tensor-degree`)

Mesh = tuple[tuple[str, int], ...]  # (dimension name, size), outermost first


class Cluster(Protocol):
    """What `build` reads of a cluster: `ddpkit.parallel.shape.Shape` is one, `ClusterShape` another."""

    @property
    def world_size(self) -> int: ...

    @property
    def local_world_size(self) -> int: ...


@dataclass(frozen=True)
class ClusterShape:
    """A cluster stated by a tool (verify, plan, bench): its ranks and the ranks of one node."""

    world_size: int
    local_world_size: int


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Every degree of parallelism of a job, and the mesh dimensions its strategy spans.

    `dims` are the mesh's dimensions, ordered as `DEGREES`: those the strategy spans (a size of 1 is kept:
    HSDP 1 x 4 is still a 2-D mesh) plus every degree above 1; () is one process."""

    replicate: int = 1
    shard: int = 1
    context: int = 1
    tensor: int = 1
    pipeline: int = 1
    dims: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in (*DEGREES, *RESERVED):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise problem(
                    f"the layout's {name} degree {value!r} is not a positive whole number",
                    f"Pass {name}=1 or more",
                )
        if self.pipeline != 1:
            raise problem(
                f"pipeline parallelism (a pipeline degree of {self.pipeline}) is not offered",
                "Leave the pipeline degree at 1; use shard, tensor or context degrees instead",
            )
        unknown = [d for d in self.dims if d not in DEGREES]
        if unknown or list(self.dims) != sorted(set(self.dims), key=DEGREES.index):
            raise problem(
                f"the layout's dimensions {self.dims} are not distinct degrees in the order {DEGREES}",
                f"Name dimensions from {', '.join(DEGREES)}, outermost first, each once",
            )
        missing = [d for d in DEGREES if getattr(self, d) > 1 and d not in self.dims]
        if missing:
            raise problem(
                f"the layout's degrees {', '.join(f'{d} {getattr(self, d)}' for d in missing)} are not "
                f"dimensions of its mesh {self.dims}",
                "List every degree above 1 in dims",
            )

    @property
    def world(self) -> int:
        """The ranks the layout covers: the product of its degrees."""
        return math.prod(getattr(self, d) for d in DEGREES)

    @property
    def data(self) -> int:
        """The ranks that read different batches (replicate x shard); tensor and context ranks share one."""
        return self.replicate * self.shard

    @property
    def mesh(self) -> Mesh:
        """(dimension, size) for each of `dims`, outermost first."""
        return tuple((d, getattr(self, d)) for d in self.dims)

    @property
    def meshed(self) -> bool:
        """Two dimensions or more of size above 1: a mesh worth naming (HSDP 1 x 4 is 1-D in fact)."""
        return sum(size > 1 for _, size in self.mesh) >= 2

    def describe(self, *, short: bool = False) -> str:
        """ "replicate 2 x shard 4" (every dimension of the mesh, so every degree above 1), or "2x4"."""
        if short:
            return "x".join(str(size) for _, size in self.mesh)
        return " x ".join(f"{name} {size}" for name, size in self.mesh)

    def coordinate(self, rank: int, dim: str) -> int:
        """`rank`'s index along `dim` (row-major over `dims`: the last dimension varies fastest); 0 for a
        degree the mesh does not span."""
        self._known(dim)
        if dim not in self.dims:
            return 0
        inner = math.prod(size for name, size in self.mesh[self.dims.index(dim) + 1 :])
        return (rank // inner) % getattr(self, dim)

    def data_rank(self, rank: int) -> int:
        """`rank`'s place among the ranks that read different batches (replicate x shard, row-major): the
        ranks of one tensor (and context) group, innermost, share it and read the same batch."""
        return rank // (self.context * self.tensor)

    def groups(self, dim: str) -> list[list[int]]:
        """The groups of ranks that differ only along `dim` (HSDP 2 x 2: shard [[0, 1], [2, 3]], replicate
        [[0, 2], [1, 3]]), in rank order of their first member; one rank each for a degree not spanned."""
        self._known(dim)
        if dim not in self.dims:
            return [[r] for r in range(self.world)]
        sizes = [size for _, size in self.mesh]
        axis = self.dims.index(dim)
        others = [range(s) if i != axis else range(1) for i, s in enumerate(sizes)]
        found = []
        for corner in product(*others):
            found.append([_flat([*corner[:axis], k, *corner[axis + 1 :]], sizes) for k in range(sizes[axis])])
        return sorted(found)

    def device_mesh(self, device_type: str) -> DeviceMesh:
        """torch's `DeviceMesh` of `dims` (a collective: every rank calls it); its submeshes are named
        by degree: `mesh["shard"]`, `mesh["replicate", "shard"]`."""
        from torch.distributed.device_mesh import init_device_mesh

        if not self.dims:
            raise problem("a layout of one process has no mesh", "Build a mesh only for more than one rank")
        sizes = tuple(size for _, size in self.mesh)
        return init_device_mesh(device_type, sizes, mesh_dim_names=self.dims)

    def as_dict(self) -> dict[str, Any]:
        """The degrees and dims as plain values (a checkpoint's manifest records them)."""
        return {**{d: getattr(self, d) for d in (*DEGREES, *RESERVED)}, "dims": list(self.dims)}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Layout:
        """The layout `as_dict` wrote (a missing degree is 1)."""
        degrees = {d: int(values.get(d, 1)) for d in (*DEGREES, *RESERVED)}
        return cls(**degrees, dims=tuple(values.get("dims", ())))

    @classmethod
    def from_mesh(cls, dims: Mapping[str, int]) -> Layout:
        """The layout of a mesh described by sizes (a plug-in's `Shape.with_mesh(replicate=2, shard=4)`)."""
        unknown = [d for d in dims if d not in DEGREES]
        if unknown:
            raise problem(
                f"the mesh dimensions {unknown} are not degrees of the layout",
                f"Name mesh dimensions from {', '.join(DEGREES)}",
            )
        return cls(**dict(dims), dims=tuple(d for d in DEGREES if d in dims))

    def _known(self, dim: str) -> None:
        if dim not in DEGREES:
            raise problem(f"{dim!r} is not a degree of the layout", f"Ask for one of {', '.join(DEGREES)}")


def _flat(index: Sequence[int], sizes: Sequence[int]) -> int:
    """The rank at `index` of a row-major mesh of `sizes`."""
    rank = 0
    for i, size in zip(index, sizes, strict=True):
        rank = rank * size + i
    return rank


def build(
    dims: Sequence[str],
    cluster: Cluster,
    *,
    replicate: int | None = None,
    shard: int | None = None,
    context: int | None = None,
    tensor: int | None = None,
    within_node: bool = False,
    tensor_across_nodes: bool = False,
    asked_as: str = "Layout",
) -> Layout:
    """The one function that makes a layout: the strategy's `dims`, the user's degrees (None: not given)
    and the cluster's shape. One default rule per degree:

      tensor      as given; else, when the strategy spans tensor, the ranks of one node (the fast link);
                  a tensor group that spans nodes is refused unless `tensor_across_nodes`;
      context     as given, else 1;
      shard       as given; else, when the strategy also spans replicate and replicate is not given, the
                  ranks of one node left after tensor x context (HSDP: shard inside a node); else the
                  ranks left in the job (FSDP: all of them);
      replicate   as given, else the ranks left in the job;
      any degree the strategy does not span is 1 (giving it above 1 is refused).

    Refused with the fix: degrees that do not multiply to the world; with `within_node`, a shard x context
    x tensor group that does not divide a node. `asked_as` names the options in messages ("HSDPOptions")."""
    dims = tuple(d for d in DEGREES if d in dims)
    given = {"replicate": replicate, "shard": shard, "context": context, "tensor": tensor}
    _check_spanned(dims, given, asked_as)
    world, local = cluster.world_size, max(1, min(cluster.local_world_size, cluster.world_size))
    tensor = _tensor(dims, tensor, world, local, tensor_across_nodes, asked_as)
    context = context or 1
    inner = context * tensor
    if world % inner:
        raise problem(
            f"{_given(given, asked_as)} do not cover the {world} ranks of this job: context {context} x "
            f"tensor {tensor} = {inner} ranks do not divide it",
            f"Give context and tensor degrees whose product divides {world}",
        )
    world_d, local_d = world // inner, max(1, local // inner)
    if "replicate" in dims and "shard" in dims:
        replicate, shard = _cover(replicate, shard, world_d, local_d, given, asked_as)
        if within_node and local % (shard * inner):
            raise problem(
                f"{_given(given, asked_as)} make shard groups of {shard} ranks, which would span nodes of "
                f"{local} ranks: their all-gathers and reduce-scatters would cross the slow link every step",
                f"Pass a shard degree that divides {local} (e.g. shard={math.gcd(world, local)}), or "
                f"{asked_as}(within_node=False) to shard across nodes on purpose",
            )
    elif "shard" in dims:
        replicate, shard = 1, _whole("shard", shard, world_d, given, asked_as)
    elif "replicate" in dims:
        replicate, shard = _whole("replicate", replicate, world_d, given, asked_as), 1
    else:
        replicate, shard = 1, 1
        if world_d != 1:
            raise problem(
                f"{_given(given, asked_as)} span no data-parallel degree, but leave {world_d} of the "
                f"{world} ranks of this job unused",
                "Give degrees whose product is the world size, or a strategy that replicates or shards",
            )
    spanned = {"replicate": replicate, "shard": shard, "context": context, "tensor": tensor}
    return Layout(**spanned, dims=tuple(d for d in DEGREES if d in dims or spanned[d] > 1))


def _check_spanned(dims: tuple[str, ...], given: dict[str, int | None], asked_as: str) -> None:
    """A degree above 1 for a dimension the strategy does not span is a mistake, not a silent 1."""
    for name, value in given.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise problem(
                f"{asked_as}({name}={value!r}) is not a positive whole number",
                f"Pass {name}=1 or more, or leave it None (from the launcher)",
            )
        if value is not None and value > 1 and name not in dims:
            raise problem(
                f"{asked_as}({name}={value}) asks for a {name} degree, but the strategy spans only "
                f"{', '.join(dims) or 'one process'}",
                f"Leave {name} out, or choose a strategy that spans {name}",
            )


def _tensor(
    dims: tuple[str, ...], tensor: int | None, world: int, local: int, across: bool, asked_as: str
) -> int:
    """The tensor degree: as given, else a node's ranks when the strategy spans tensor; inside a node
    unless asked (its collectives run every layer, on the fast link)."""
    if "tensor" not in dims:
        return 1
    degree = tensor or local
    if not across and local % degree:
        raise problem(
            f"{asked_as}(tensor={degree}) makes tensor groups of {degree} ranks, which would span nodes of "
            f"{local} ranks: their collectives run in every layer and would cross the slow link",
            f"Pass a tensor degree that divides {local} (e.g. tensor={math.gcd(degree, local)}), or "
            f"{asked_as}(tensor_across_nodes=True) to split layers across nodes on purpose",
        )
    return degree


def _whole(name: str, value: int | None, world: int, given: dict[str, int | None], asked_as: str) -> int:
    """A strategy's one data-parallel degree: the ranks left in the job (as given, it must be them)."""
    if value is None or value == world:
        return world
    raise problem(
        f"{_given(given, asked_as)} do not cover the {world} ranks of this job: {name} {value}",
        f"Give degrees whose product is {world} (e.g. {asked_as}({name}={world})), or leave {name} None",
    )


def _given(given: dict[str, int | None], asked_as: str) -> str:
    """The degrees as the user wrote them: "the degrees of HSDPOptions(replicate=2)" (a None is left
    out: the user did not write it)."""
    written = [f"{n}={v}" for n, v in given.items() if v]
    default = f"{asked_as.removesuffix('Options')}'s default degrees"
    return f"the degrees of {asked_as}({', '.join(written)})" if written else default


def _cover(
    replicate: int | None,
    shard: int | None,
    world: int,
    local: int,
    given: dict[str, int | None],
    asked_as: str,
) -> tuple[int, int]:
    """(replicate, shard) whose product is `world`: the degree not given follows from the one given
    (both None: shard = a node's ranks); a degree that does not divide the world is refused."""
    if replicate and shard:
        if replicate * shard == world:
            return replicate, shard
        what = f"replicate {replicate} x shard {shard} = {replicate * shard} ranks"
    elif replicate or shard:
        one = replicate or shard or 1
        if world % one == 0:
            return (one, world // one) if replicate else (world // one, one)
        other = "shard" if replicate else "replicate"
        what = f"{other} would be {world}/{one} ranks (not a whole number)"
    else:
        if world % local == 0:
            return world // local, local
        what = f"nodes of unequal size (shard = the {local} ranks of this node)"
    example = math.gcd(world, local)  # divides the world and a node: a shape that is always accepted
    rest = ", or leave both None" if replicate or shard else ""
    raise problem(
        f"{_given(given, asked_as)} do not cover the {world} ranks of this job: {what}",
        f"Give degrees whose product is {world} (e.g. {asked_as}(replicate={world // example}, "
        f"shard={example}): shard inside each node, replicate across nodes){rest}",
    )
