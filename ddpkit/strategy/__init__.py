"""Strategies: what data parallelism means for a model ("single", "ddp", "fsdp", or one registered).

    base           `Strategy`: the interface (wrap, skip_sync, clip, join, state dicts, checks of a kind)
    registry       the strategies by name (`register`, a `Builder` protocol) and the one reading of a choice
    single         one process: the model as is
    ddp            DistributedDataParallel: its construction (`wrap_model`) and the strategy
    ddp_options    `DDPOptions`
    fsdp           FSDP2 (`fully_shard`) over the shape's mesh
    fsdp_options   `FSDPOptions`
    fsdp_units     FSDP's unit rule (which submodules shard on their own) and its fully_shard loop, for
                   the strategy and `plan --memory`
    fsdp_init      a model factory built shard by shard on the meta device
    fsdp_export    FSDP's full weights streamed to one safetensors file
    hsdp           HSDP: FSDP2 on a 2-D mesh (shard inside a node, replicate across nodes)
    hsdp_options   `HSDPOptions`: the replicate and shard degrees plus FSDP's fields (`fsdp()`)
    tp             tensor parallelism (torch's parallelize_module) x FSDP2 over the data dimensions
    tp_options     `TPOptions`: the tensor degree, the plan, sequence parallel, random draws, FSDP's fields
    tp_plan        a plan read (HF's own, a short mapping, torch styles), checked and applied, ties kept
    tp_init        one process's initial weights, built piece by piece under TP
    tp_random      one process's dropout under TP (or a refusal naming the layer)
    tp_loss        loss parallel: a vocabulary-sharded head's logits kept sharded for torch's loss_parallel()
    building       what `s.model` does around `wrap`, in order (factory, recompute, memory, weights)
    checkpointing  activation checkpointing (`s.model(activation_checkpointing=...)`)
    rank_memory    whether a replicated model fits a rank (before it is wrapped)
    choice         when FSDP is worth it (model state vs a device's memory), for `bench tune` and `plan`
    weights        pretrained weights read whole (rank 0) or by rows (sharded)
    hf             Hugging Face models: blocks, `save_pretrained` directories
    adapters       PEFT (LoRA) models: trainable-only checkpoints, adapter and merged export

`make` turns what a user passed to `ddpkit.session(strategy=)` (a name, a registered strategy's options
such as `DDPOptions` / `FSDPOptions`, or a `Strategy` instance) and the cluster's `Shape` into the one
strategy object the session, the stepper and checkpoints ask; the session builds it once. "auto" is "ddp"
with more than one process; any name is "single" with one process (said once). `registry.names()` lists
every name a session accepts. A new strategy is a module with a `Builder` and one `register` call
(`ddpkit.strategy.registry`).

`FSDP` is imported when first asked for (`make` with "fsdp", or `ddpkit.strategy.FSDP`): a DDP session
does not load FSDP2's machinery before its first step.

Owns: how a model is wrapped, synchronised, clipped, saved and loaded for each kind of parallelism.
May import the parallel wing (what strategies are built from), the checkpoint format (`checkpoint.files`),
errors and names; never the facade, the stepper or the cluster wing.
"""

from __future__ import annotations

from typing import Any, Union

from ddpkit.errors import problem
from ddpkit.parallel.collectives import Ranks
from ddpkit.parallel.precision import FP32, PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp import DDP
from ddpkit.strategy.ddp_options import DDPOptions
from ddpkit.strategy.fsdp_options import FSDPOptions
from ddpkit.strategy.hsdp_options import HSDPOptions
from ddpkit.strategy.registry import (
    Builder,
    Chosen,
    distributed,
    entry,
    layout_of,
    options_for,
    place,
    register,
    resolve,
    sharded,
)
from ddpkit.strategy.single import Single
from ddpkit.strategy.tp_options import TPOptions

Choice = Union[str, DDPOptions, FSDPOptions, HSDPOptions, TPOptions, Strategy]  # noqa: UP007 (a runtime alias on Python 3.10)

__all__ = [
    "DDP",
    "FSDP",
    "Builder",
    "Choice",
    "Chosen",
    "DDPOptions",
    "FSDPOptions",
    "HSDPOptions",
    "Shape",
    "Single",
    "Strategy",
    "TPOptions",
    "distributed",
    "entry",
    "kind",
    "layout_of",
    "make",
    "options_for",
    "options_of",
    "place",
    "register",
    "resolve",
    "sharded",
]


def kind(strategy: Choice | Chosen, ranks: Ranks) -> str:
    """The strategy `make` builds for this choice on these ranks: "single", "ddp", "fsdp", ..."""
    chosen = resolve(strategy)
    if chosen.instance is not None:
        return chosen.name
    if not ranks.distributed:
        return "single"
    return "ddp" if chosen.name == "auto" else chosen.name


def options_of(strategy: Choice | None, sugar: DDPOptions) -> object:
    """The options one `s.model` call gives its model: `strategy=` when it is options, or the flat DDP
    keywords (sugar for `DDPOptions`); None: the strategy's own. Both at once is an error."""
    given = None if strategy is None else resolve(strategy).options
    if sugar == DDPOptions():
        return given
    if isinstance(given, DDPOptions):
        raise problem(
            "s.model got both strategy=DDPOptions(...) and DDP keywords (find_unused_parameters, ...)",
            "Put every DDP option into the DDPOptions, or pass only the keywords",
        )
    return sugar  # with FSDP, its wrap says that DDP options do not apply


def make(strategy: Choice | Chosen, shape: Shape, *, precision: PrecisionPlan | None = None) -> Strategy:
    """The strategy object for `strategy` on the ranks `shape` describes (placed here when it is not
    yet: `place`), carrying its options and, for FSDP, the precision checked against what FSDP can
    apply. An instance is used as it is."""
    chosen = resolve(strategy)
    if chosen.instance is not None:
        return chosen.instance
    if not shape.distributed:
        asked = chosen.name if chosen.name not in ("auto", "single") else None
        return Single(chosen.options if isinstance(chosen.options, DDPOptions) else None, asked=asked)
    if chosen.name == "single":
        raise problem(
            f"strategy='single' with {shape.world_size} processes would train unsynchronised replicas",
            "Pass strategy='ddp' or 'fsdp', or start one process",
        )
    from ddpkit.strategy.registry import registered

    name = "ddp" if chosen.name == "auto" else chosen.name
    placed = place(chosen, shape)  # every strategy is built on a placed shape (its layout)
    return registered[name].builder()(chosen.options, placed, precision or FP32)


def __getattr__(name: str) -> Any:
    if name == "FSDP":
        from ddpkit.strategy.fsdp import FSDP

        return FSDP
    raise AttributeError(f"module 'ddpkit.strategy' has no attribute {name!r}")
