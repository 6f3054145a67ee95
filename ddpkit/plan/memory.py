"""The peak memory per rank of one real training step, computed on fake tensors on this CPU.

    job = MemoryJob(model="hf:gpt2", micro_batch=8, seq_len=1024, precision="bf16", strategy="fsdp", world=8)
    b = estimate(job)            # a Breakdown: parameters, gradients, optimizer state, activations, ...

How: the model is built from its factory under `torch._subclasses.FakeTensorMode` (shapes and dtypes,
no storage), prepared as a rank of the asked strategy, and one whole step (forward, loss, backward,
optimizer step, zero_grad) runs under torch's memory tracker, which records what is live at every op
and by category (`torch.distributed._tools.mem_tracker.MemTracker`; for FSDP
`fsdp2_mem_tracker.FSDPMemTracker`). So activations, the backward's temporaries and FSDP's all-gather
buffers come from the model's own code, not from a formula. The optimizer's state is created by one
untracked update on zero gradients first, so the tracked step is a steady-state step, not the first.

Each strategy is rank 0 of a world of `world` ranks, as ddpkit sets it up:

- "ddp": the whole model on every rank; the gradients live in DDP's all-reduce buckets, allocated when
  DDP wraps the model and kept between steps (ddpkit's `gradient_as_bucket_view=True`), so they are
  held through the forward too;
- "zero1": DDP plus ddpkit's sharded optimizer step (`ddpkit.session(shard_optimizer=True)`): whole
  tensors split greedily by size over the ranks, optimizer state only for this rank's; rank 0 gets the
  largest tensor, so it is the heaviest rank when one tensor dominates;
- "fsdp": FSDP2's `fully_shard` over a fake process group of `world` ranks (torch's `fake` backend: its
  collectives return at once), units chosen by the session's own rule (`ddpkit.strategy.fsdp_units`
  with `FSDPOptions()`: the activation-checkpointed blocks, else every module of 1M parameters or more,
  children first, never splitting tied weights), mixed precision as the session's
  (`PrecisionPlan.fsdp_policy`: bf16 compute, fp32 reduction);
- "hsdp": the same on a (replicate, shard) mesh: `shard_degree` ranks share one copy of the model
  state (ddpkit's HSDP, `strategy="hsdp"`).

Every strategy is laid out by the library's builder (`ddpkit.strategy.layout_of`, the session's call):
plan states its cluster as nodes of the shard group it was given (`MemoryJob.layout`), and the fake
mesh is that layout's (`Layout.device_mesh`). A registered strategy is offered by its name: one whose
layout spans "shard" is estimated as FSDP2 on its mesh, any other as DDP.

Precision: "bf16" and "fp16" run the forward under CPU autocast (ddpkit's DDP precision: fp32 weights,
low-precision compute); fp16's loss scaler is left out (its inf check reads values, which fake tensors
do not have; it holds one scalar). CPU autocast casts the same op classes as CUDA's for matmuls and
convolutions; a GPU's fused kernels (flash attention's saved statistics) may keep slightly other
tensors. Not counted: the CUDA context and NCCL's buffers (the device's `reserved`), the allocator's
fragmentation (its `allowance`), ddpkit's shared-memory segments on CPU ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit import strategy as strategies
from ddpkit.errors import problem
from ddpkit.observe.memory_breakdown import Breakdown
from ddpkit.observe.step_memory import fold, owned_update, peak_tracker, warm_optimizer
from ddpkit.parallel.layout import ClusterShape, Layout
from ddpkit.parallel.partition import partition
from ddpkit.parallel.precision import PrecisionPlan, canonical
from ddpkit.plan import memory_models
from ddpkit.plan.memory_models import ModelSpec

PRECISIONS = {"fp32": None, "32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "16": torch.float16}
OPTIMIZERS = ("adamw", "adam", "sgd")
ZERO1 = "zero1"  # plan's own name: DDP plus ddpkit's sharded optimizer step (not a strategy of its own)


def offered() -> tuple[str, ...]:
    """The strategies plan --memory estimates: every registered one (`ddpkit.strategy.distributed()`,
    one registered from outside too) and zero1."""
    names = strategies.distributed()
    return ("ddp", ZERO1, *(n for n in names if n != "ddp"))


def _registered(strategy: str) -> str:
    """The registered strategy a plan's name lays out as (zero1: DDP's layout)."""
    return "ddp" if strategy == ZERO1 else strategy


def takes(strategy: str, degree: str) -> bool:
    """Whether the strategy's options take `degree` (HSDPOptions' shard): a flag for it applies."""
    options = strategies.entry(_registered(strategy)).options
    return options is not None and degree in getattr(options, "__dataclass_fields__", {})


def spans_tensor(strategy: str) -> bool:
    """Whether the strategy's layout splits layers (TP): estimated as the plan splits them, FSDP2 over
    the data dimensions (`ddpkit.plan.memory_tp`)."""
    return "tensor" in strategies.entry(_registered(strategy)).dims


def spans_shard(strategy: str) -> bool:
    """Whether the strategy's layout shards the model state (FSDP, HSDP): estimated as FSDP2."""
    return "shard" in strategies.entry(_registered(strategy)).dims


@dataclass(frozen=True, kw_only=True)
class MemoryJob:
    """One step to estimate: the model, the micro-batch per rank, the precision and the strategy.

    `model`: a named workload (mlp, gpt, cnn, bn, small), "hf:TYPE[,key=value...]" (a transformers
    model from its config, offline: e.g. "hf:gpt2" is GPT-2 124M, "hf:gpt2,n_layer=2"), "hf:PATH" (a
    config.json or a directory holding one), or "package.module:function" returning an nn.Module (a
    factory as `ddpkit verify --model` takes) or a `ddpkit.tools.workloads.Workload`; or the factory itself.
    `sample`: for a plain nn.Module, "package.module:function" (generator, n) -> (inputs, targets).
    """

    model: str | Callable[[], Any]
    micro_batch: int
    seq_len: int | None = None
    precision: str = "fp32"
    strategy: str = "ddp"
    world: int = 1
    shard_degree: int | None = None  # hsdp: ranks per shard group (None: all of them, i.e. fsdp)
    # Other layout degrees by name (`--<degree>-degree` of `ddpkit.parallel.layout.TOOL_DEGREES`).
    other_degrees: tuple[tuple[str, int], ...] = ()
    activation_checkpointing: str | None = None  # "auto" or a block class's name
    # Tensor parallelism (a strategy spanning "tensor"): the plan as `--tp-plan` gives it ("auto", a
    # JSON object, package.module:NAME; `ddpkit.plan.memory_tp.plan_of`) and sequence parallelism.
    tp_plan: str = "auto"
    sequence_parallel: bool = False
    optimizer: str = "adamw"
    sample: str | Callable[[torch.Generator, int], Any] | None = None
    device_kind: str = "cuda"  # the optimizer's implementation torch picks there: foreach on CUDA

    def __post_init__(self) -> None:
        if self.micro_batch < 1:
            raise problem(f"micro-batch {self.micro_batch} is below 1", "Pass a micro-batch of 1 or more")
        if self.world < 1:
            raise problem(f"world size {self.world} is below 1", "Pass --world 1 or more")
        if self.strategy not in offered():
            raise problem(f"strategy {self.strategy!r} is not known", f"Use one of {', '.join(offered())}")
        if self.precision not in PRECISIONS:
            raise problem(f"precision {self.precision!r} is not known", "Use fp32, bf16 or fp16")
        if spans_shard(self.strategy) and PRECISIONS[self.precision] is torch.float16:
            raise problem(
                "fp16 with FSDP: ddpkit refuses it (the loss scaler's inf check would be per shard)",
                "Use bf16 with FSDP, or fp16 with DDP",
            )
        if self.optimizer not in OPTIMIZERS and ":" not in self.optimizer:
            raise problem(
                f"optimizer {self.optimizer!r} is not known",
                f"Use one of {', '.join(OPTIMIZERS)} or package.module:function (params -> optimizer)",
            )
        self._check_degrees()

    def given(self) -> dict[str, int | None]:
        """The layout degrees given (`shard_degree` and `other_degrees`; None: not given)."""
        return {"shard": self.shard_degree, **dict(self.other_degrees)}

    def _check_degrees(self) -> None:
        """Refused before any estimate, each in one line naming the flag: a degree the strategy does
        not take, and a shard degree a 2-D strategy needs but was not given or does not divide; a
        a tensor degree that does not divide the world."""
        for degree, value in self.given().items():
            if value is not None and not takes(self.strategy, degree):
                owners = [n for n in offered() if n != ZERO1 and takes(n, degree)]
                whose = owners[0].upper() if owners else "no strategy"  # the first registered (HSDP)
                fix = f"Pass --strategy {owners[0]} with it, or leave" if owners else "Leave"
                raise problem(  # fsdp would otherwise be estimated on HSDP's 2-D mesh and called FSDP
                    f"--{degree}-degree {value} is {whose}'s, not {self.strategy}'s",
                    f"{fix} it out with --strategy {self.strategy}",
                )
        if not spans_tensor(self.strategy) and (self.tp_plan != "auto" or self.sequence_parallel):
            flag = "--sequence-parallel" if self.sequence_parallel else f"--tp-plan {self.tp_plan}"
            raise problem(
                f"{flag} is tensor parallelism's, not {self.strategy}'s",
                f"Pass --strategy tp --tensor-degree T with it, or leave it out with "
                f"--strategy {self.strategy}",
            )
        if spans_tensor(self.strategy):
            self._check_tensor()
        elif takes(self.strategy, "shard"):
            shard = self.shard_degree
            if shard is None:
                raise problem(
                    f"{self.strategy} needs its shard degree: the ranks that share one copy of the "
                    "model state",
                    f"Pass --shard-degree K with {self.world} = replicas x K, e.g. the ranks of one node",
                )
            if shard < 1 or self.world % shard:
                raise problem(
                    f"{self.strategy} needs a shard degree that divides the world size {self.world} "
                    f"(got {shard})",
                    f"Pass --shard-degree K with {self.world} = replicas x K, e.g. the ranks of one node",
                )

    def _check_tensor(self) -> None:
        """A tensor-parallel job: degrees that divide the world (the shard degree is optional: the
        data ranks left, as the session's)."""
        tensor = self.given().get("tensor") or self.world
        shard = self.shard_degree or 1
        if tensor < 1 or self.world % (tensor * shard):
            raise problem(
                f"{self.strategy} needs tensor x shard degrees that divide the world size {self.world} "
                f"(got tensor {tensor}, shard {self.shard_degree or 'the rest'})",
                f"Pass --tensor-degree T (and --shard-degree K) with {self.world} = replicas x K x T",
            )

    @property
    def layout(self) -> Layout:
        """The job's layout, by the session's one call (`ddpkit.strategy.layout_of`): plan states its
        cluster as nodes of the shard group it was given (`--shard-degree`), else of the whole world."""
        name = _registered(self.strategy)
        options = strategies.entry(name).options
        degrees = {d: v for d, v in self.given().items() if v is not None}
        chosen = strategies.Chosen(name, options(**degrees) if options is not None and degrees else None)
        node = self.world if spans_tensor(self.strategy) else self.shard_degree or self.world
        return strategies.layout_of(chosen, ClusterShape(self.world, node))

    @property
    def readers(self) -> int:
        """The ranks that read different batches (`Layout.data`): every rank, except that the ranks of
        one tensor group read the same batch; the global batch splits over these."""
        return self.layout.data

    def describe(self) -> str:
        layout = self.layout
        if self.strategy == ZERO1:
            strat = "DDP + sharded optimizer step (ZeRO-1)"
        elif spans_tensor(self.strategy):  # "TP 2 x FSDP2 (replicate 1 x shard 2)", the session's line
            sp = ", sequence parallel" if self.sequence_parallel else ""
            strat = f"TP {layout.tensor}{sp} x FSDP2 (replicate {layout.replicate} x shard {layout.shard})"
        elif layout.meshed or len(layout.dims) > 1:  # a 2-D mesh, as replicate x shard: "HSDP (2 x 4)"
            strat = f"{self.strategy.upper()} ({' x '.join(str(size) for _, size in layout.mesh)})"
        else:
            strat = {"ddp": "DDP", "fsdp": "FSDP2"}.get(self.strategy, self.strategy.upper())
        seq = f", sequence {self.seq_len}" if self.seq_len else ""
        ac = (
            f", activation checkpointing ({self.activation_checkpointing})"
            if self.activation_checkpointing
            else ""
        )
        return (
            f"{strat} over {self.world} rank(s), micro-batch {self.micro_batch}{seq}, {self.precision}, "
            f"{self.optimizer}{ac}"
        )


def resolve_model(job: MemoryJob) -> ModelSpec:
    """The job's model as a factory, a micro-batch and a loss (`ddpkit.plan.memory_models`)."""
    return memory_models.resolve(job.model, seq_len=job.seq_len, sample=job.sample)


# -- preparing the rank ---------------------------------------------------------------------------
def _checkpointing(model: nn.Module, choice: str | None) -> None:
    if not choice:
        return
    from ddpkit.strategy import checkpointing

    wanted: Any = choice
    if choice != "auto":
        found = {type(m) for m in model.modules() if type(m).__name__ == choice}
        if not found:
            raise problem(
                f"activation checkpointing: no module of class {choice!r} in the {type(model).__name__}",
                "Name the class of the repeated blocks, or pass auto",
            )
        wanted = tuple(found)
    checkpointing.apply(model, wanted)


def _optimizer(name: str, params: Any, device_kind: str) -> torch.optim.Optimizer:
    """The optimizer as torch builds it on the target device: on CUDA tensors its default is the
    foreach implementation (one kernel per op over all tensors, with temporaries the size of the whole
    parameter list), on CPU tensors the loop over parameters (temporaries of one tensor at a time)."""
    foreach = device_kind == "cuda"
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=1e-4, foreach=foreach)
    from ddpkit.plan.memory_models import import_ref

    return import_ref(name, "optimizer")(params)


@contextlib.contextmanager
def fake_world(layout: Layout) -> Iterator[Any]:
    """A fake process group of the layout's ranks in this process (torch's `fake` backend: collectives
    return at once, nothing is sent), as rank 0, and the layout's device mesh, the session's
    (`Layout.device_mesh`: the same dimensions and names); torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise problem(
            "the memory plan runs in a process that already has a process group",
            "Run `ddpkit plan --memory` (or estimate()) outside a ddpkit session",
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world)
    try:
        yield layout.device_mesh("cpu")
    finally:
        dist.destroy_process_group()


def _zero1_owned(model: nn.Module, world: int) -> set[int]:
    """The parameters rank 0 owns under the sharded step: the step's own rule (`parallel.partition`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    owners = partition([p.numel() for p in params], world)
    return {id(p) for p, r in zip(params, owners, strict=True) if r == 0}


def estimate(job: MemoryJob) -> Breakdown:
    """The tracked peak of one steady-state step of rank 0, by category (no device allowances)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = resolve_model(job)
    sharded = spans_shard(job.strategy)
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(fake_world(job.layout)) if sharded else None
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        model = spec.build()
        _checkpointing(model, job.activation_checkpointing)
        if sharded:
            from ddpkit.strategy.fsdp_units import choose_units, shard

            policy = PrecisionPlan(canonical(job.precision) or "32", "cpu").fsdp_policy()
            if spans_tensor(job.strategy):
                from ddpkit.plan import memory_tp

                plan = memory_tp.plan_of(job.tp_plan)
                memory_tp.prepare(model, job.layout, mesh, plan, job.sequence_parallel, policy)
            else:
                shard(model, choose_units(model, strategies.FSDPOptions()), mesh=mesh, mp_policy=policy)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _optimizer(job.optimizer, params, job.device_kind)
        owned = _zero1_owned(model, job.world) if job.strategy == ZERO1 else None
        keep_grads = not sharded  # DDP's buckets hold the gradients from the wrap on
        warm_optimizer(params, opt, owned, keep_grads)
        if spans_tensor(job.strategy):  # a whole untracked step first: see ddpkit.plan.memory_tp.WARM
            _run_step(model, opt, spec, job, owned, keep_grads, job.micro_batch)
        return _tracked_step(model, opt, spec, job, owned, keep_grads)
    raise AssertionError("unreachable")


def _run_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    spec: ModelSpec,
    job: MemoryJob,
    owned: set[int] | None,
    keep_grads: bool,
    micro_batch: int,
) -> None:
    """Forward, loss, backward, optimizer step, zero_grad: what a training step does, in its order."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = PRECISIONS[job.precision]
    batch = spec.batch(micro_batch)  # the micro-batch itself is live through the step
    cast = (
        torch.autocast("cpu", dtype=dtype)
        if dtype is not None and not spans_shard(job.strategy)
        else contextlib.nullcontext()
    )
    with cast:
        loss = spec.loss(model, batch)
    loss.backward()
    del loss
    owned_update(params, opt, owned, keep_grads)
    del batch


def _tracked_step(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    spec: ModelSpec,
    job: MemoryJob,
    owned: set[int] | None,
    keep_grads: bool,
) -> Breakdown:
    tracker = peak_tracker(model, opt, sharded=spans_shard(job.strategy))
    with tracker:
        _run_step(model, opt, spec, job, owned, keep_grads, job.micro_batch)
    return fold(tracker, opt)
