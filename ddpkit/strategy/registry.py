"""Which strategies exist, by name: the built-in ones and those registered from outside ddpkit.

    ddpkit.strategy.register("hsdp", build_hsdp, options=HSDPOptions)   # a new strategy: one registration
    ddpkit.session(strategy="hsdp")            # by name, or by its options: strategy=HSDPOptions(...)
    ddpkit.session(strategy=MyStrategy(...))   # or an instance, used as it is

A `Builder` takes values, never the session or the stepper: the options (None: its defaults), the
cluster's `Shape` (nodes, local ranks, world, a mesh description) and the `PrecisionPlan`; it returns a
`Strategy`. Built-in builders are named by "module:function" and imported when first used (a DDP session
does not import FSDP2). The session resolves a choice here once (`resolve`), at its start.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

from ddpkit.errors import problem
from ddpkit.names import STRATEGIES
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp_options import DDPOptions
from ddpkit.strategy.fsdp_options import FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions


class Builder(Protocol):
    """Builds one kind of strategy from values (mypy checks a registered function against this)."""

    def __call__(self, options: Any, shape: Shape, precision: PrecisionPlan) -> Strategy: ...


@dataclass(frozen=True)
class Entry:
    """A registered strategy: its name, how to build it, the type of its options (None: it has none)."""

    name: str
    build: Builder | str  # "module:function", imported at the first build
    options: type | None = None

    def builder(self) -> Builder:
        if isinstance(self.build, str):
            module, function = self.build.split(":")
            built: Builder = getattr(importlib.import_module(module), function)
            return built
        return self.build


BUILT_IN = (
    Entry("ddp", "ddpkit.strategy.ddp:build", DDPOptions),
    Entry("fsdp", "ddpkit.strategy.fsdp:build", FSDPOptions),
    Entry("hsdp", "ddpkit.strategy.hsdp:build", HSDPOptions),
)
registered: dict[str, Entry] = {e.name: e for e in BUILT_IN}  # process-wide: `register` adds to it


def register(name: str, build: Builder, *, options: type | None = None) -> None:
    """Make `name` (and, when given, instances of `options`) a strategy `ddpkit.session` accepts."""
    if name in STRATEGIES:
        raise problem(f"strategy {name!r} is built in", "Register your strategy under another name")
    registered[name] = Entry(name, build, options)


def names() -> tuple[str, ...]:
    """Every name a session accepts: "auto", "single" and each registered strategy."""
    return ("auto", "single", *registered)


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
    fits = [e for e in registered.values() if e.options is not None and isinstance(choice, e.options)]
    if fits:  # the most derived options class wins (HSDPOptions is an FSDPOptions)
        entry = max(fits, key=lambda e: len(e.options.__mro__) if e.options is not None else 0)
        return Chosen(entry.name, choice)
    if not isinstance(choice, str) or choice not in names():
        raise problem(
            f"strategy={choice!r} is not one of {', '.join(map(repr, names()))}",
            "Pass 'ddp' (replicas), 'fsdp' (sharded parameters), 'auto', a registered "
            "strategy's name or options, or a Strategy instance",
        )
    return Chosen(choice)
