"""The session's strategy: chosen once from `strategy=`, built once from the cluster's shape, then the
`Stepper` that drives it; neither is replaced.

    choosing = Choosing(strategy, shape, precision, stepper=functools.partial(Stepper, ...))
    choosing.stepper()            # the strategy (built now if "auto" waited) and its stepper
    choosing.for_model("fsdp")    # s.model(strategy=...): this model's options, or the kind ("auto")
    choosing.describe()           # the start-up line: "strategy fsdp over 2 rank(s)"; HSDP adds its
                                  # mesh: "strategy hsdp over 4 rank(s), mesh replicate 2 x shard 2"

`strategy=` is read once (`ddpkit.strategy.resolve`: a name, a strategy's options, or an instance). A
session that names its strategy builds it at its start (fp16 under FSDP is refused there); an "auto"
session builds it at the first `s.model`, which may name the kind (its options may give the degrees),
or when it is first needed. The shape is placed once (`ddpkit.strategy.place`: the layout of the ranks,
`placed`), then the strategy built on it; it gets values (`ddpkit.parallel.shape.Shape`, the
`PrecisionPlan`), never the session. A layout or build refused here is recorded for `ddpkit run`
(`ddpkit.cluster.failures`), so the launcher prints its one paragraph once for the job.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpkit import strategy as strategies
from ddpkit.cluster import failures
from ddpkit.errors import DdpkitError, problem
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.step.stepping import Stepper
from ddpkit.strategy import Choice, Chosen, DDPOptions, Strategy


class Choosing:
    """One session's choice of strategy and the stepper built on it."""

    def __init__(
        self, strategy: Choice, shape: Shape, precision: PrecisionPlan, *, stepper: Callable[..., Stepper]
    ) -> None:
        self.chosen = strategies.resolve(strategy)  # the one reading of strategy=
        self.shape, self.precision = shape, precision
        self._new_stepper = stepper  # `Stepper` with the session's values, given `strategy=`
        self.strategy: Strategy | None = None
        self.placed: Shape | None = None  # the shape with its layout, once the strategy is built
        self._stepper: Stepper | None = None
        if self.chosen.name != "auto":
            self._build(self.chosen)

    def stepper(self) -> Stepper:
        return self._stepper or self._build(self.chosen)

    def for_model(self, strategy: Choice | None, sugar: DDPOptions) -> tuple[Stepper, object]:
        """`s.model(strategy=...)`: None or options for the session's strategy, or the first kind an
        "auto" session is asked for (another kind later is an error); with the model's own options
        (`strategy=` options or the DDP keywords, `sugar`; None: the strategy's)."""
        options = strategies.options_of(strategy, sugar)
        if strategy is None:
            return self.stepper(), options
        chosen = strategies.resolve(strategy)  # its options are the model's: the kind builds the strategy
        kind = chosen if chosen.instance is not None else Chosen(chosen.name)
        return self._build(kind, degrees_from=chosen), options

    def describe(self) -> str:
        """What was chosen and over which ranks; "auto" says what it becomes unless s.model names another."""
        built = self.strategy
        name = built.name if built is not None else f"{strategies.kind('auto', self.shape)} (auto)"
        shape = getattr(built, "shape", None)  # a plug-in may describe its own mesh (`Shape.with_mesh`)
        if not isinstance(shape, Shape):
            shape = self.placed or self.shape
        return f"strategy {name} over {shape.describe()}"  # a 2-D mesh in fact is named (`Layout.meshed`)

    def _build(self, choice: Chosen, *, degrees_from: Chosen | None = None) -> Stepper:
        """Build the strategy once: the shape placed by `degrees_from` (a model's own options, which may
        give the degrees) or the choice itself, then the strategy on it."""
        if self.strategy is None:
            self.strategy = self._make(choice, degrees_from or choice)
        elif (asked := strategies.kind(choice, self.shape)) != self.strategy.name:
            raise problem(
                f"this session's strategy is already {self.strategy.name!r} (set by ddpkit.session or the "
                f"first s.model), now {asked!r} was asked for",
                "Use one strategy per session (pass strategy= to ddpkit.session)",
            )
        if self._stepper is None:
            self._stepper = self._new_stepper(strategy=self.strategy)
        return self._stepper

    def _make(self, choice: Chosen, degrees_from: Chosen) -> Strategy:
        try:
            if choice.instance is None and self.shape.distributed and choice.name != "single":
                self.placed = strategies.place(degrees_from, self.shape)
            return strategies.make(choice, self.placed or self.shape, precision=self.precision)
        except DdpkitError as err:  # a mistake the user can fix: one paragraph under `ddpkit run`
            failures.record_failure(err, self.shape.rank, user_error=True)
            failures.hush(err)
            raise
