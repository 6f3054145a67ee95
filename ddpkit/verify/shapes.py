"""The shapes verify runs its N-rank side at: a world size and a strategy, laid out by the library's one
builder (`ddpkit.parallel.layout.build`, through `ddpkit.strategy.layout_of`).

    part = Part.of(4, "hsdp", {"shard": None})    # HSDP(2x2): verify's choice of shape, see below
    part.layout                                   # Layout(replicate=2, shard=2, dims=("replicate", "shard"))
    part.describe(), part.session_strategy()      # "HSDP(2x2)", HSDPOptions(replicate=2, shard=2)

Verify's choice of shape (not a second rule): its ranks all run on this machine, so it states the
cluster it lays the strategy out on. A strategy that spans both replicate and shard (HSDP), given no
degree, runs a real 2-D mesh: verify states its N ranks as two nodes of N/2 (an odd N is refused), and
the builder's default (shard inside a node, replicate across nodes) gives 2 replicas of N/2 shards. Given
a degree (`--shard-degree`), one machine of N ranks, and the builder takes the degree as given.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

from ddpkit import strategy as strategies
from ddpkit.errors import problem
from ddpkit.parallel import layout as layouts
from ddpkit.parallel.layout import ClusterShape, Layout


def given_degrees(ns: argparse.Namespace, prefix: str = "") -> dict[str, int | None]:
    """The layout degrees given by `ddpkit verify`'s `--<prefix><degree>-degree` flags (None: not
    given), by degree name: every degree of `TOOL_DEGREES`."""
    return {d: getattr(ns, f"{prefix}{d}_degree", None) for d in layouts.TOOL_DEGREES}


def spans_data_mesh(name: str) -> bool:
    """True for a strategy that spans both replicate and shard (HSDP): the one verify runs as 2-D."""
    dims = strategies.entry(name).dims
    return "replicate" in dims and "shard" in dims


def takers(degree: str) -> list[str]:
    """The registered strategies whose options take `degree` (HSDPOptions' shard): who a flag is for."""
    found = []
    for name in strategies.distributed():
        options = strategies.entry(name).options
        if options is not None and degree in getattr(options, "__dataclass_fields__", {}):
            found.append(name)
    return found


def foreign(strategy: str, given: Mapping[str, int | None]) -> tuple[str, int, list[str]] | None:
    """The first degree given that `strategy`'s options do not take, its value, and the strategies
    whose options do (["hsdp"] for shard); None when every degree given is the strategy's."""
    for degree, value in given.items():
        owners = takers(degree)
        if value is not None and strategy not in owners:
            return degree, value, owners
    return None


def whose(owners: list[str], flag: str) -> tuple[str, str]:
    """("HSDP's", "Pass --strategy hsdp with it, or leave it out") for a refused degree's message, named
    by the first strategy registered that takes it (the built-in one before a plug-in); ("no
    strategy's", "Leave it out") when none does. `flag` is "--strategy" or "--resume-strategy"."""
    if not owners:
        return "no strategy's", "Leave it out"
    return f"{owners[0].upper()}'s", f"Pass {flag} {owners[0]} with it, or leave it out"


def cluster(world: int, strategy: str, given: Mapping[str, int | None]) -> ClusterShape:
    """Verify's choice of cluster for `world` ranks on this machine (module docstring): two nodes of
    world/2 for a 2-D strategy given no degree, else one machine."""
    if spans_data_mesh(strategy) and all(v is None for v in given.values()):
        return ClusterShape(world, world // 2)
    return ClusterShape(world, world)


@dataclass(frozen=True)
class Part:
    """The shape one part of a check runs at: `world` ranks under `strategy`, laid out as `layout`. One
    rank is one process, whatever the strategy's name."""

    world: int
    strategy: str = "ddp"
    layout: Layout = field(default_factory=Layout)

    @classmethod
    def of(cls, world: int, strategy: str, given: Mapping[str, int | None]) -> Part:
        """The part, or a paragraph naming the fix for a strategy or degree that cannot run on `world`."""
        names = strategies.distributed()
        if strategy not in names:
            raise problem(f"strategy {strategy!r} is not one verify runs", f"Pass one of {', '.join(names)}")
        if world == 1:
            return cls(world, "single")
        if spans_data_mesh(strategy):
            shard = given.get("shard")
            odd = shard is None and world % 2  # the default, half the ranks, is no degree on an odd world
            shard = shard or world // 2
            if odd or shard < 1 or world % shard:
                raise problem(
                    f"HSDP over {world} ranks cannot have shard groups of {shard} ranks: the shard degree "
                    "must divide the world size (replicas x shard = ranks)",
                    f"Pass a shard degree dividing {world} (e.g. 4 ranks, shard degree 2: HSDP(2x2))",
                )
        options = {d: v for d, v in given.items() if v is not None}
        chosen = strategies.Chosen(strategy, _options(strategy, options))
        return cls(world, strategy, strategies.layout_of(chosen, cluster(world, strategy, given)))

    @property
    def degrees(self) -> tuple[int, int]:
        """(replicate, shard) of the data-parallel mesh: HSDP's (2, 2), FSDP's (1, N), DDP's (N, 1)."""
        return self.layout.replicate, self.layout.shard

    def describe(self) -> str:
        """As the report names it: DDP(2), FSDP(4), HSDP(2x2) (replicas x shards), one process."""
        if self.strategy == "single":
            return "one process"
        return f"{self.strategy.upper()}({self.layout.describe(short=True)})"

    def session_strategy(self) -> strategies.Choice:
        """What `ddpkit.session(strategy=...)` gets: the strategy's options asking for exactly this
        layout's degrees (HSDPOptions(replicate=2, shard=2)), or its name when they take none. A
        registered strategy's options are outside `Choice`'s union, yet the session reads them through
        the registry: hence the cast."""
        if self.strategy == "single":
            return "auto"
        return cast("strategies.Choice", strategies.options_for(self.strategy, self.layout))


def _options(strategy: str, degrees: Mapping[str, int]) -> object:
    """The strategy's options with the degrees given (None: its defaults; the builder's rule fills in)."""
    options = strategies.entry(strategy).options
    return options(**degrees) if options is not None and degrees else None
