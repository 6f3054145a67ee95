"""Strategies: what data parallelism means for a model ("single", "ddp", "fsdp"); see `base.Strategy`.

`make` turns what a user passed (to `ddpkit.session(strategy=)` or `s.model(strategy=)`: a name,
`DDPOptions` or `FSDPOptions`) into the one strategy object the session, the stepper and checkpoints
ask; the session builds it once. "auto" is "ddp" with more than one process; any name is "single" with
one process (said once). `NAMES` is the one list of names; tools that compare or simulate N ranks offer
`DISTRIBUTED`.

`FSDP` is imported when first asked for (`make` with "fsdp", or `ddpkit.strategy.FSDP`): a DDP session
does not load FSDP2's machinery before its first step.

Owns: how a model is wrapped, synchronised, clipped, saved and loaded for each kind of parallelism.
May import the step wing's lower pieces (precision, collectives, wrap, compiling), the checkpoint
format (`checkpoint.files`), errors and names; never the facade, the stepper or the cluster wing.
"""

from __future__ import annotations

from typing import Any, Union

from ddpkit.errors import problem
from ddpkit.names import DISTRIBUTED, STRATEGIES
from ddpkit.step.collectives import Ranks
from ddpkit.step.precision import FP32, PrecisionPlan, resolve_precision
from ddpkit.step.wrap import DDPOptions
from ddpkit.strategy.base import Strategy
from ddpkit.strategy.ddp import DDP
from ddpkit.strategy.fsdp_options import FSDPOptions
from ddpkit.strategy.single import Single

NAMES = STRATEGIES  # the one list (`ddpkit.names`)

Choice = Union[str, DDPOptions, FSDPOptions]  # noqa: UP007 (a runtime alias on Python 3.10)

__all__ = ["DDP", "DISTRIBUTED", "FSDP", "NAMES", "Choice", "DDPOptions", "FSDPOptions", "Single",
           "Strategy", "check_name", "kind", "make", "options_of"]  # fmt: skip


def check_name(strategy: Any) -> str:
    """The strategy's name ("auto", "single", "ddp", "fsdp"), or a clear error for anything else."""
    if isinstance(strategy, FSDPOptions):
        return "fsdp"
    if isinstance(strategy, DDPOptions):
        return "ddp"
    if strategy not in NAMES:
        raise problem(f"strategy={strategy!r} is not one of {', '.join(map(repr, NAMES))}",
                      "Pass 'ddp' (replicas), 'fsdp' (sharded parameters) or 'auto'")  # fmt: skip
    return strategy


def kind(strategy: Choice, ranks: Ranks) -> str:
    """The strategy `make` builds for this choice on these ranks: "single", "ddp" or "fsdp"."""
    name = check_name(strategy)
    if not ranks.distributed:
        return "single"
    return "ddp" if name == "auto" else name


def options_of(strategy: Choice | None, sugar: DDPOptions) -> DDPOptions | FSDPOptions | None:
    """The options one `s.model` call gives its model: `strategy=` when it is options, or the flat DDP
    keywords (sugar for `DDPOptions`); None: the strategy's own. Both at once is an error."""
    given = strategy if isinstance(strategy, (DDPOptions, FSDPOptions)) else None
    if sugar == DDPOptions():
        return given
    if isinstance(given, DDPOptions):
        raise problem(
            "s.model got both strategy=DDPOptions(...) and DDP keywords (find_unused_parameters, ...)",
            "Put every DDP option into the DDPOptions, or pass only the keywords",
        )
    return sugar  # with FSDP, its wrap says that DDP options do not apply


def make(strategy: Choice, ranks: Ranks, *, precision: PrecisionPlan | None = None) -> Strategy:
    """The strategy object for `strategy` on these ranks, carrying its options (`DDPOptions`,
    `FSDPOptions`) and, for FSDP, the precision checked against what FSDP can apply."""
    name = check_name(strategy)
    options = strategy if isinstance(strategy, (DDPOptions, FSDPOptions)) else None
    if not ranks.distributed:
        asked = name if name in DISTRIBUTED else None
        return Single(options if isinstance(options, DDPOptions) else None, asked=asked)
    if name == "fsdp":
        plan = resolve_precision(precision or FP32, "", loss_scale=False)  # no fp16: the one refusal
        from ddpkit.strategy.fsdp import FSDP

        return FSDP(options if isinstance(options, FSDPOptions) else None, ranks, plan)
    if name == "single":
        raise problem(
            f"strategy='single' with {ranks.world_size} processes would train unsynchronised replicas",
            "Pass strategy='ddp' or 'fsdp', or start one process",
        )
    return DDP(options if isinstance(options, DDPOptions) else None)


def __getattr__(name: str) -> Any:
    if name == "FSDP":
        from ddpkit.strategy.fsdp import FSDP

        return FSDP
    raise AttributeError(f"module 'ddpkit.strategy' has no attribute {name!r}")
