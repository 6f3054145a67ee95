"""What to verify: the user's model, data, loss and optimizer, and the tolerances of the verdict.

Everything the ranks need travels inside one `VerifySpec`, which is sent to new processes. So every
callable in it must be importable by name: a top-level function, or a `"module:function"` string that
each process imports for itself (what `ddpkit verify --model mypkg.models:make_net` passes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddpkit import strategy as strategies
from ddpkit.errors import problem
from ddpkit.parallel.precision import ALIASES, PrecisionPlan, canonical
from ddpkit.verify import shapes

FLOOR_VARIANTS = ("permuted", "chunked", "threads", "features")  # features: tensor parallelism's
# The library's precision names (`ddpkit.parallel.precision`: "32", "bf16", "16" and their spellings), plus
# "fp64", verify's own: the whole comparison in float64, to tell rounding from a real difference.
PRECISIONS: tuple[str, ...] = ("fp64", *ALIASES)


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """How far DDP may be from one process, as a multiple of the measured noise floor.

    The noise floor is how far the single-process run moves from itself when only the order of its
    sums changes (rows permuted, the batch forwarded in pieces, another thread count). Per tensor and
    step, DDP passes if

      ||ddp - single|| / ||single|| <= max(floor_multiple * floor_rel_norm, eps_multiple * eps,
                                           update_fraction * ||update|| / ||single||)
      max |ddp - single|            <= max(floor_multiple * floor_max_abs, eps_multiple * eps * max|single|,
                                           update_fraction * max|update|)

    - the floors are the largest deviation the reference variants showed up to that step;
    - `eps` is the machine epsilon of the parameters' dtype (fp32: 1.19e-7, fp64: 2.2e-16): a floor of
      zero (an exactly representable run) does not demand bitwise equality;
    - `update` is what the single run's step changed in that tensor: a few reference runs can miss a
      rare discrete event (a ReLU or max-pool switching sides after one rounding) that moves some
      elements by a few dozen ulps, while real mistakes move weights by a sizeable part of an update
      and grow step after step. Before the first step there is no update, so no such allowance.
    Integer buffers (BatchNorm's num_batches_tracked) must match exactly.
    """

    floor_multiple: float = 10.0
    eps_multiple: float = 8.0
    update_fraction: float = 0.01

    def __post_init__(self) -> None:
        if self.floor_multiple < 1 or self.eps_multiple < 0 or not 0 <= self.update_fraction < 1:
            raise problem(
                f"tolerance floor_multiple={self.floor_multiple}, eps_multiple={self.eps_multiple}, "
                f"update_fraction={self.update_fraction} is out of range",
                "Use floor_multiple >= 1 (default 10), eps_multiple >= 0 (default 8) and "
                "0 <= update_fraction < 1 (default 0.01)",
            )

    def min_rel(self, dtype: torch.dtype) -> float:
        return self.eps_multiple * torch.finfo(dtype).eps


@dataclass(frozen=True, kw_only=True)
class VerifySpec:
    """One equivalence check: DDP over `nproc` ranks against one process on the global batch.

    model:      () -> nn.Module, built in every process with the same seed.
    data:       a map-style or iterable Dataset, or () -> one; read with ddpkit's sharded loader (the global
                batch `batch_size`, DistributedSampler, drop_last so every step is a full batch).
    batches:    (step) -> the global batch of that step (tensor, tuple or dict of tensors, rows on
                dim 0); rank r gets the r-th contiguous slice. Give `data` or `batches`, not both.
    loss:       (model, batch) -> scalar tensor, or "cross_entropy" / "mse" for (x, y) batches.
    optimizer:  (parameters) -> Optimizer, or "sgd" / "adamw" with `optimizer_options` (lr, ...).
    after_wrap: optional (module, session) -> None, the code your script runs between s.model and
                the first step (loading a checkpoint, re-initialising a head); runs in every process.
    floor:      the reference variants whose spread is the noise floor: "permuted" (the global batch's
                rows in another order), "chunked" (forward in nproc + 1 pieces, skipped for models
                with BatchNorm), "threads" (another CPU thread count).
    """

    model: Callable[[], nn.Module] | str
    data: Dataset | Callable[[], Dataset] | str | None = None
    batches: Callable[[int], Any] | str | None = None
    loss: Callable[[nn.Module, Any], torch.Tensor] | str = "cross_entropy"
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | str = "sgd"
    optimizer_options: Mapping[str, float] = field(default_factory=dict)
    nproc: int = 2
    steps: int = 10
    batch_size: int = 32
    shuffle: bool = True
    precision: str = "fp32"
    seed: int = 0
    device: str = "cpu"
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    # or "fsdp": FSDP2 over nproc ranks against the same single process; "hsdp"; any registered strategy
    # (`ddpkit.strategy.distributed()`)
    strategy: str = "ddp"
    # hsdp: ranks per shard group (None: nproc // 2, i.e. 2 replicas); the replicas are nproc // shard.
    # Forced on the one machine verify starts its ranks on, as HSDPOptions(replicate=..., shard=...)
    # (`ddpkit.verify.shapes`: verify's choice of shape, laid out by the library's builder).
    shard: int | None = None
    # Other layout degrees by name (`--<degree>-degree` of `ddpkit.parallel.layout.TOOL_DEGREES`).
    other_degrees: tuple[tuple[str, int], ...] = ()
    compile: bool = False  # the DDP/FSDP side runs s.model(..., compile=True); the reference eager
    # None: every rank runs optimizer.step() on every parameter (plain DDP). Else both sides step with
    # s.step(opt) in ddpkit.session(shard_optimizer=...): True/"auto" the sharded step, "gradients" its
    # reduce-scatter (ddpkit.step.shard_exchange), checked against one process like any other path.
    shard_optimizer: bool | str | None = None
    after_wrap: Callable[[nn.Module, Any], None] | str | None = None
    floor: tuple[str, ...] = ("permuted", "chunked")
    tolerance: Tolerance = field(default_factory=Tolerance)
    timeout: float = 300.0

    def __post_init__(self) -> None:
        if (self.data is None) == (self.batches is None):
            raise problem(
                "give exactly one of data (a Dataset or a function returning one) and batches "
                "(a function step -> global batch)",
                "Pass data=... for a data set read by a sharded loader, or batches=... for batches you build",
            )
        if self.nproc < 2:
            raise problem(
                f"nproc={self.nproc}: DDP with fewer than 2 ranks has nothing to compare",
                "Pass nproc=2 or more",
            )
        if self.strategy not in strategies.distributed():
            names = " or ".join(map(repr, strategies.distributed()))
            raise problem(f"strategy={self.strategy!r} is not {names}", f"Pass strategy={names}")
        if self.strategy != "ddp" and (
            self.sync_batchnorm or self.find_unused_parameters or self.static_graph
        ):
            raise problem(
                "sync_batchnorm, find_unused_parameters and static_graph are DDP-only options",
                f"Leave them out with --strategy {self.strategy}",
            )
        self._check_shard()
        if self.shard_optimizer not in (None, True, False, "auto", "gradients"):
            raise problem(
                f"shard_optimizer={self.shard_optimizer!r} is not True, 'auto' or 'gradients'",
                "Pass --shard-optimizer true, auto or gradients, or leave it out",
            )
        if self.shard_optimizer is not None and self.strategy != "ddp":
            raise problem(
                f"shard_optimizer with strategy={self.strategy!r}: FSDP already shards the step",
                f"Leave --shard-optimizer out with --strategy {self.strategy}",
            )
        if self.steps < 1:
            raise problem(f"steps={self.steps} is below 1", "Pass steps=1 or more (default 10)")
        if self.batch_size < self.nproc or self.batch_size % self.nproc:
            nearest = self.nproc * max(1, round(self.batch_size / self.nproc))
            raise problem(
                f"global batch {self.batch_size} does not split evenly over {self.nproc} ranks",
                f"Use a multiple of {self.nproc}, e.g. {nearest}",
            )
        if self.precision not in PRECISIONS:
            raise problem(f"precision={self.precision!r} is not known", f"Use one of {', '.join(PRECISIONS)}")
        unknown = set(self.floor) - set(FLOOR_VARIANTS)
        if not self.floor or unknown:
            raise problem(
                f"floor={self.floor!r} names no known reference variant",
                f"Use some of {', '.join(FLOOR_VARIANTS)}, e.g. floor=('permuted', 'chunked')",
            )
        if isinstance(self.optimizer, str) and self.optimizer in OPTIMIZERS:
            bad = set(self.optimizer_options) - {"lr", "momentum", "weight_decay", "eps", "betas"}
            if bad:
                raise problem(
                    f"optimizer option(s) {sorted(bad)} are not known", "Use lr, momentum, weight_decay"
                )
        elif self.optimizer_options:
            raise problem(
                "optimizer_options apply to the built-in optimizers only",
                "Set the options inside your optimizer factory, or use optimizer='sgd' / 'adamw'",
            )
        for name in ("model", "data", "batches", "loss", "optimizer", "after_wrap"):
            _check_sendable(name, getattr(self, name))

    def given(self) -> dict[str, int | None]:
        """The layout degrees given (`shard` and `other_degrees`; None: not given, the builder's rule)."""
        return {"shard": self.shard, **dict(self.other_degrees)}

    def _check_shard(self) -> None:
        wrong = shapes.foreign(self.strategy, self.given())
        if wrong is not None:
            degree, value, owners = wrong
            owner, fix = shapes.whose(owners, "--strategy")
            raise problem(f"{degree}={value} (--{degree}-degree) is {owner}, not {self.strategy}'s", fix)
        if not shapes.spans_data_mesh(self.strategy):
            return
        asked = "nproc // 2" if self.shard is None else self.shard
        shard = self.nproc // 2 if self.shard is None else self.shard
        odd = self.shard is None and self.nproc % 2
        if odd or not isinstance(shard, int) or shard < 1 or self.nproc % shard:
            raise problem(
                f"HSDP over {self.nproc} ranks cannot have shard groups of {asked} ranks: the shard "
                "degree must divide nproc (replicas x shard = nproc)",
                f"Pass --shard-degree N with N dividing {self.nproc} (e.g. --nproc 4 --shard-degree 2: 2 "
                "replicas of 2 shards)",
            )

    @property
    def part(self) -> shapes.Part:
        """The N-rank side's shape: `nproc` ranks under `strategy`, laid out by the library's builder
        on verify's choice of cluster (`ddpkit.verify.shapes`)."""
        return shapes.Part.of(self.nproc, self.strategy, self.given())

    @property
    def degrees(self) -> tuple[int, int]:
        """HSDP's (replicate, shard) for the ranks verify starts; (1, nproc) for FSDP, (nproc, 1) for DDP."""
        return self.part.degrees

    def session_strategy(self) -> Any:
        """What the N-rank side passes as `strategy=`: the name, or HSDP's options with the degrees."""
        return self.part.session_strategy()

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the parameters are stored in (autocast keeps them fp32)."""
        return torch.float64 if self.precision == "fp64" else torch.float32

    def precision_plan(self, device_type: str) -> PrecisionPlan:
        """The library's plan for this precision, as asked (no CPU fallback: verify measures it)."""
        return PrecisionPlan(canonical(self.precision) or "32", device_type, self.precision)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.precision_plan("cpu").autocast_dtype


def _check_sendable(name: str, value: Any) -> None:
    if isinstance(value, str) or not callable(value) or isinstance(value, (nn.Module, Dataset)):
        return
    qualname = getattr(value, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise problem(
            f"{name}={value!r} cannot be sent to the DDP ranks (lambdas and nested functions are not "
            "importable in new processes)",
            f"Define it at the top level of a .py module, or pass {name}='module:function'",
        )


def resolve(ref: Any, what: str) -> Any:
    """A `module:function` string imported here (in this process), or the object itself."""
    if not isinstance(ref, str):
        return ref
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise problem(
            f"{what} {ref!r} is not of the form module:function", f"Pass e.g. mypkg.train:make_{what}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise problem(
            f"cannot import module {module_name!r} for {what} {ref!r}: {exc}",
            "Run from the folder that contains it, or add that folder to PYTHONPATH",
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise problem(f"module {module_name!r} has no {attr!r} (for {what} {ref!r})", "Check the name")
        obj = getattr(obj, part)
    return obj


def _xy(batch: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise problem(
            f"the built-in loss {what!r} expects (input, target) batches, got {type(batch).__name__}",
            "Pass loss=your_function(model, batch) -> scalar tensor",
        )
    return batch[0], batch[1]


def cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    """The built-in "cross_entropy" loss: mean over the batch, as DDP's averaging expects."""
    x, y = _xy(batch, "cross_entropy")
    return F.cross_entropy(model(x), y)


def mse(model: nn.Module, batch: Any) -> torch.Tensor:
    """The built-in "mse" loss: mean over the batch and the outputs."""
    x, y = _xy(batch, "mse")
    return F.mse_loss(model(x), y)


LOSSES: dict[str, Callable[[nn.Module, Any], torch.Tensor]] = {"cross_entropy": cross_entropy, "mse": mse}
OPTIMIZERS: dict[str, tuple[type, float]] = {
    "sgd": (torch.optim.SGD, 0.1),
    "adamw": (torch.optim.AdamW, 1e-3),
    "adam": (torch.optim.Adam, 1e-3),
}


def build_loss(spec: VerifySpec) -> Callable[[nn.Module, Any], torch.Tensor]:
    if isinstance(spec.loss, str) and ":" not in spec.loss:
        if spec.loss not in LOSSES:
            raise problem(f"loss {spec.loss!r} is not built in", "Use cross_entropy, mse or module:function")
        return LOSSES[spec.loss]
    return resolve(spec.loss, "loss")


def build_optimizer(spec: VerifySpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    if isinstance(spec.optimizer, str) and ":" not in spec.optimizer:
        if spec.optimizer not in OPTIMIZERS:
            raise problem(
                f"optimizer {spec.optimizer!r} is not built in", "Use sgd, adamw, adam or module:function"
            )
        cls, lr = OPTIMIZERS[spec.optimizer]
        return cls(params, **{"lr": lr, **spec.optimizer_options})
    return resolve(spec.optimizer, "optimizer")(params)


def build_model(spec: VerifySpec) -> nn.Module:
    model = resolve(spec.model, "model")()
    if not isinstance(model, nn.Module):
        raise problem(f"the model factory returned {type(model).__name__}", "Return an nn.Module")
    return model.to(spec.dtype) if spec.precision == "fp64" else model


def build_data(spec: VerifySpec) -> Dataset:
    data = resolve(spec.data, "data")
    if callable(data) and not isinstance(data, Dataset):
        data = data()
    needed = spec.batch_size * spec.steps
    if not hasattr(data, "__len__"):  # an iterable source: s.loader splits it (ddpkit.data.streams)
        return data
    if len(data) < spec.batch_size:
        raise problem(
            f"the data set has {len(data)} samples, fewer than the global batch {spec.batch_size}",
            f"Use a smaller batch_size or more data ({needed} samples give {spec.steps} distinct steps)",
        )
    return data
