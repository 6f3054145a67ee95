"""The session's strategy: chosen once from `strategy=`, built once from the cluster's shape; never
replaced (the session makes its `Stepper` on it: `ddpkit.step.stepping`).

    choosing = Choosing(strategy, shape, precision)
    choosing.built()              # the strategy (built now if "auto" waited)
    choosing.for_model("fsdp")    # s.model(strategy=...): the strategy and this model's options
    choosing.layout               # how the ranks divide (`ddpkit.parallel.layout`), once placed
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

from ddpkit import strategy as strategies
from ddpkit.cluster import failures
from ddpkit.errors import DdpkitError, problem
from ddpkit.parallel.layout import Layout
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.parallel.shape import Shape
from ddpkit.strategy import Choice, Chosen, DDPOptions, Strategy


class Choosing:
    """One session's choice of strategy, built once."""

    def __init__(self, strategy: Choice, shape: Shape, precision: PrecisionPlan) -> None:
        self.chosen = strategies.resolve(strategy)  # the one reading of strategy=
        self.shape, self.precision = shape, precision
        self.strategy: Strategy | None = None
        self.placed: Shape | None = None  # the shape with its layout, once the strategy is built
        if self.chosen.name != "auto":
            self._build(self.chosen)

    def built(self) -> Strategy:
        """The session's strategy; an "auto" session that has not met an `s.model` naming a kind builds
        its own choice now."""
        return self._build(self.chosen) if self.strategy is None else self.strategy

    def for_model(self, strategy: Choice | None, sugar: DDPOptions) -> tuple[Strategy, object]:
        """`s.model(strategy=...)`: None or options for the session's strategy, or the first kind an
        "auto" session is asked for (another kind later is an error); with the model's own options
        (`strategy=` options or the DDP keywords, `sugar`; None: the strategy's)."""
        options = strategies.options_of(strategy, sugar)
        if strategy is None:
            return self.built(), options
        chosen = strategies.resolve(strategy)  # its options are the model's: the kind builds the strategy
        kind = chosen if chosen.instance is not None else Chosen(chosen.name)
        return self._build(kind, degrees_from=chosen), options

    def describe(self) -> str:
        """What was chosen and over which ranks; "auto" says what it becomes unless s.model names another."""
        built = self.strategy
        name = built.name if built is not None else f"{strategies.kind('auto', self.shape)} (auto)"
        return f"strategy {name} over {self._where().describe()}"  # a 2-D mesh in fact is named (`meshed`)

    @property
    def layout(self) -> Layout | None:
        """The layout the start-up line names: the placed shape's, or a plug-in's own (`Shape.with_mesh`);
        None before the strategy is built, for one process, or for an instance with no shape of its own."""
        return self._where().layout

    def _where(self) -> Shape:
        shape = getattr(self.strategy, "shape", None)  # a plug-in may describe its own mesh (`with_mesh`)
        return shape if isinstance(shape, Shape) else self.placed or self.shape

    def _build(self, choice: Chosen, *, degrees_from: Chosen | None = None) -> Strategy:
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
        return self.strategy

    def _make(self, choice: Chosen, degrees_from: Chosen) -> Strategy:
        try:
            if choice.instance is None and self.shape.distributed and choice.name != "single":
                self.placed = strategies.place(degrees_from, self.shape)
            return strategies.make(choice, self.placed or self.shape, precision=self.precision)
        except DdpkitError as err:  # a mistake the user can fix: one paragraph under `ddpkit run`
            failures.record_failure(err, self.shape.rank, user_error=True)
            failures.hush(err)
            raise
