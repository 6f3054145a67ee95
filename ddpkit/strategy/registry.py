"""Which strategies exist, by name: the built-in ones and those registered from outside ddpkit.

    ddpkit.strategy.register("mine", build_mine, options=MyOptions, dims=("shard",))  # one registration
    ddpkit.session(strategy="hsdp")            # by name, or by its options: strategy=HSDPOptions(...)
    ddpkit.session(strategy=MyStrategy(...))   # or an instance, used as it is
    layout_of(Chosen("hsdp"), shape)           # the layout it spans on these ranks (`parallel.layout.build`)

A `Builder` takes values, never the session or the stepper: the options (None: its defaults), the
cluster's `Shape` (nodes, local ranks, world, a mesh description) and the `PrecisionPlan`; it returns a
`Strategy`. Built-in builders are named by "module:function" and imported when first used (a DDP session
does not import FSDP2); the built-in ones come from `ddpkit.names.BUILT_IN_STRATEGIES`. Each entry
states the layout degrees it spans (`dims`), so the session places its shape (`place`) and the tools lay
out any registered strategy (`layout_of`) by the one rule. The session resolves a choice here once
(`resolve`), at its start.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Protocol

from ddpkit.errors import problem
from ddpkit.names import BUILT_IN_STRATEGIES, STRATEGIES
from ddpkit.parallel.layout import DEGREES, Cluster, Layout, build
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.strategy.base import Strategy


class Builder(Protocol):
    """Builds one kind of strategy from values (mypy checks a registered function against this)."""

    def __call__(self, options: Any, shape: Shape, precision: PrecisionPlan) -> Strategy: ...


@dataclass(frozen=True)
class Entry:
    """A registered strategy: its name, how to build it, the type of its options (None: it has none) and
    the layout degrees it spans, outermost first (a plug-in's default: a replicating strategy)."""

    name: str
    build: Builder | str  # "module:function", imported at the first build
    options: type | None = None
    dims: tuple[str, ...] = ("replicate",)

    def builder(self) -> Builder:
        if isinstance(self.build, str):
            module, function = self.build.split(":")
            built: Builder = getattr(importlib.import_module(module), function)
            return built
        return self.build


def _built_in(name: str, dims: tuple[str, ...]) -> Entry:
    """A built-in entry by the naming convention of `ddpkit.names.BUILT_IN_STRATEGIES`."""
    options = getattr(importlib.import_module(f"ddpkit.strategy.{name}_options"), f"{name.upper()}Options")
    return Entry(name, f"ddpkit.strategy.{name}:build", options, dims)


BUILT_IN = tuple(_built_in(name, dims) for name, dims in BUILT_IN_STRATEGIES.items())
registered: dict[str, Entry] = {e.name: e for e in BUILT_IN}  # process-wide: `register` adds to it


def register(
    name: str, build: Builder, *, options: type | None = None, dims: tuple[str, ...] = ("replicate",)
) -> None:
    """Make `name` (and, when given, instances of `options`) a strategy `ddpkit.session` accepts; `dims`
    are the layout degrees it spans (`ddpkit.parallel.layout.DEGREES`), which the tools read too."""
    if name in STRATEGIES:
        raise problem(f"strategy {name!r} is built in", "Register your strategy under another name")
    unknown = [d for d in dims if d not in DEGREES]
    if unknown or not dims:
        raise problem(
            f"strategy {name!r} registered with dims={dims!r}, which are not degrees of the layout",
            f"Pass dims from {', '.join(DEGREES)}, e.g. dims=('shard',)",
        )
    registered[name] = Entry(name, build, options, tuple(d for d in DEGREES if d in dims))


def names() -> tuple[str, ...]:
    """Every name a session accepts: "auto", "single" and each registered strategy."""
    return ("auto", "single", *registered)


def entry(name: str) -> Entry:
    """The registered strategy `name` ("auto" is ddp's), or a clear error."""
    found = registered.get("ddp" if name == "auto" else name)
    if found is None:
        raise problem(
            f"strategy {name!r} is not registered", f"Use one of {', '.join(map(repr, distributed()))}"
        )
    return found


def distributed() -> tuple[str, ...]:
    """Every registered strategy (over several ranks): what verify, plan and trace offer."""
    return tuple(registered)


def sharded() -> tuple[str, ...]:
    """The registered strategies whose layout spans "shard": their checkpoints hold model and optimizer
    as DCP shards, so any of them loads into the others."""
    return tuple(name for name, e in registered.items() if "shard" in e.dims)


@dataclass(frozen=True)
class Chosen:
    """A user's choice, read once: the strategy's name and its options (None: its defaults), or an
    instance to use as it is."""

    name: str
    options: object = None
    instance: Strategy | None = None


def resolve(choice: object) -> Chosen:
    """The one reading of `strategy=`: a name, a registered strategy's options, or a `Strategy` (a
    `Chosen` is read already: passed on as it is)."""
    if isinstance(choice, Chosen):
        return choice
    if isinstance(choice, Strategy):
        return Chosen(choice.name, instance=choice)
    by_options = {e.options: e for e in reversed(registered.values()) if e.options is not None}
    for cls in type(choice).__mro__:  # the most specific registered options class (a subclass resolves)
        if cls in by_options:
            return Chosen(by_options[cls].name, choice)
    if not isinstance(choice, str) or choice not in names():
        raise problem(
            f"strategy={choice!r} is not one of {', '.join(map(repr, names()))}",
            "Pass 'ddp' (replicas), 'fsdp' (sharded parameters), 'auto', a registered "
            "strategy's name or options, or a Strategy instance",
        )
    return Chosen(choice)


def layout_of(chosen: Chosen, cluster: Cluster) -> Layout:
    """The one call of `ddpkit.parallel.layout.build` for a strategy: its dims (an instance: its
    registered name's, else a replicating one's), the degrees its options name (fields called like a
    degree: HSDPOptions' replicate and shard), and the cluster. One rank: one process, `Layout()`."""
    if cluster.world_size <= 1:
        return Layout()
    name = "ddp" if chosen.name == "auto" else chosen.name
    found = registered.get(name)
    dims = found.dims if found is not None else ("replicate",)
    options = chosen.options if chosen.options is not None else _defaults(found)
    degrees = {d: getattr(options, d) for d in DEGREES if hasattr(options, d)}
    kind = type(options).__name__ if options is not None else name
    return build(
        dims,
        cluster,
        **degrees,
        within_node=getattr(options, "within_node", False),
        tensor_across_nodes=getattr(options, "tensor_across_nodes", False),
        asked_as=kind,
    )


def place(chosen: Chosen, shape: Shape) -> Shape:
    """`shape` laid out for this strategy (`layout_of`); a shape already placed is kept as it is."""
    return shape if shape.layout is not None else shape.with_layout(layout_of(chosen, shape))


def options_for(name: str, layout: Layout) -> object:
    """The strategy's options asking for exactly `layout`'s degrees (HSDPOptions(replicate=2, shard=2)),
    or the name when its options take no degree (a tool hands this to `ddpkit.session(strategy=)`)."""
    found = entry(name)
    if found.options is None or not dataclasses.is_dataclass(found.options):
        return name
    fields = {f.name for f in dataclasses.fields(found.options)}
    degrees = {d: getattr(layout, d) for d in DEGREES if d in fields}
    return found.options(**degrees) if degrees else name


def _defaults(found: Entry | None) -> object:
    """A strategy's default options (where its degrees and within_node default), or None."""
    if found is None or found.options is None:
        return None
    try:
        return found.options()
    except TypeError:  # a plug-in's options with required fields: no defaults to read
        return None
