"""The session: the one place where ddpkit has process-group side effects.

    with ddpkit.session(seed=0) as s:          # reads the launcher's env, picks the mode, joins the group
        model = s.model(Net())                 # on s.device; DDP only when s.world_size > 1
        train = s.loader(data, batch_size=64, shuffle=True)   # 64 is the global batch
        ...
        s.print("done")                        # printed once, by global rank 0

Training steps (`ddpkit.step.stepping`): `with s.accumulate(model): s.backward(loss)`, then `s.step(opt)`,
for mixed precision (`precision=`), gradient accumulation (`accumulation=`) and clipping (`max_norm=`).

One owner per concept: `precision=` is resolved once against the device (`ddpkit.parallel.precision`);
the cluster's shape is one `ddpkit.parallel.shape.Shape` value; the strategy (`ddpkit.strategy`: a name,
its options, or an instance) is chosen and built once from them (`ddpkit.training.choosing`: at the start,
or, for "auto", at the first `s.model`), then the `Stepper` that holds it, made from the strategy and
named parts (`ddpkit.step.stepping.StepParts`: accumulation, precision, ranks, the options' objects);
neither is replaced. The strategy and the stepper get typed values (the shape, the plan, `Limits`), not
the session; rank and output live in `RankContext`. `ddpkit.session(...)` opens one from the
environment (`ddpkit.training.opening`).

Seeding: every rank starts from the same `seed`, so models are initialised identically; once the model
is prepared, each rank's global generators move to a stream of its own (`rank_seed`), so dropout and
augmentation differ across ranks while the sampler's shuffle stays shared.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpkit.cluster import lifecycle, topology
from ddpkit.cluster.lifecycle import Limits
from ddpkit.cluster.preemption import NOTHING_TO_SAVE, Preemption, PreemptionOptions
from ddpkit.cluster.ranks import RankContext
from ddpkit.data import ShardedLoader, make_loader, plan_batch
from ddpkit.errors import problem
from ddpkit.names import WRITER_NICE_ENV
from ddpkit.observe.anatomy import StepAnatomy
from ddpkit.observe.profiling import ProfileOptions, StepProfiler
from ddpkit.observe.tracking import LogTo, Tracking
from ddpkit.parallel import compiling, cpu_allocator, modules
from ddpkit.parallel.precision import PrecisionPlan, device_supports_bf16, resolve_precision
from ddpkit.parallel.shape import Shape
from ddpkit.step import invariant, oom, spikes
from ddpkit.step.fingerprint import FINGERPRINT_EVERY, ReplicaFingerprints
from ddpkit.step.stepping import MicroBatch, StepInfo, StepParts, Stepper
from ddpkit.strategy import Choice, DDPOptions, Strategy, building, hf
from ddpkit.training.choosing import Choosing
from ddpkit.training.seeding import seed_everything

if TYPE_CHECKING:  # imported at the first save or load: a run that never saves never loads safetensors
    from ddpkit.checkpoint.checkpoints import Checkpoints
    from ddpkit.parallel.layout import Layout


class Session(RankContext):
    """A training session on one process; create it with `ddpkit.session(...)`."""

    def __init__(
        self,
        plan: topology.Placement,
        *,
        seed: int = 0,
        accumulation: int = 1,
        precision: str | PrecisionPlan = "32",
        limits: Limits | None = None,
        verbose: bool = True,
        shard_optimizer: bool | str = "auto",
        strategy: Choice = "auto",
        log_to: LogTo = "auto",
        log_dir: str | None = None,
        env: Mapping[str, str] | None = None,
        reproducible: str | None = None,
        chunk: int | None = None,  # any-world: ddpkit.step.invariant
        micro_batch: str | None = None,  # "auto": a step out of memory is re-run split (ddpkit.step.oom)
        spike_guard: spikes.SpikeGuard | None = None,  # a spiking step skipped on every rank (step.spikes)
        fingerprint_every: int = FINGERPRINT_EVERY,  # replicas compared every N steps (step.fingerprint)
        # torch.profiler on chosen ranks and steps (observe.profiling): True, a dict or ProfileOptions
        profile: ProfileOptions | Mapping[str, Any] | bool | None = None,
        global_batch: int | None = None,  # accumulation=Global(batch=...): the loaders' default batch
    ) -> None:
        if shard_optimizer not in (True, False, "auto", "gradients"):
            raise problem(
                f"shard_optimizer={shard_optimizer!r} is not True, False, 'auto' or 'gradients'",
                "Pass 'auto' (the default), True, False or 'gradients'",
            )
        if accumulation < 1:
            raise problem(f"accumulation={accumulation} is below 1", "Pass 1 (no accumulation) or more")
        super().__init__(plan, verbose=verbose)
        self.seed, self.accumulation = seed, accumulation
        self.global_batch = global_batch
        self.limits = limits or Limits()  # built once (ddpkit.session), passed down explicitly
        self._group: lifecycle.Membership | None = None  # this session's place in the process group
        self._checkpoints: Checkpoints | None = None  # made at the first save/load/export
        self._env = os.environ if env is None else env
        self.preemption = Preemption(PreemptionOptions.from_env(self._env), self._env)  # stop policy
        self.tracking = Tracking(log_to, log_dir, enabled=self.is_main)  # observe.tracking; opens lazily
        self.anatomy = StepAnatomy()  # where this rank's step time goes (observe.anatomy; fit reports it)
        self.profiler = StepProfiler.build(profile, self.rank, self.device)  # None when off
        self._on_close = contextlib.ExitStack()  # process-wide settings put back by close()
        self.precision = resolve_precision(
            precision, self.device.type, bf16_supported=device_supports_bf16(self.device)
        )
        self.invariant = invariant.configure(
            reproducible,
            chunk,
            seed=seed,
            precision=self.precision,
            accumulation=accumulation,
            rank=self.rank,
            world_size=self.world_size,
            phases=self.anatomy,
        )
        r = plan.ranks
        self.shape = Shape(
            self.device,
            rank=r.rank,
            world_size=r.world_size,
            local_rank=r.local_rank,
            local_world_size=r.local_world_size,
        )
        self._shard = shard_optimizer
        judge = spikes.judge_for(
            spike_guard,
            world=self.world_size,
            report=self.print,
            track=lambda values, step: self.log(values, step=step),
        )
        self._parts = StepParts(  # what the stepper is made of besides the strategy (`step.stepping`)
            accumulation=accumulation,
            precision=self.precision,
            ranks=self.shape,
            report=self.print,
            shard=shard_optimizer,
            timeout=self.limits.collective,
            invariant=self.invariant,
            micro_batch=oom.auto_for(
                micro_batch,
                rank=self.rank,
                world=self.world_size,
                distributed=self.distributed,
                device=self.device,
            ),
            spikes=judge,
            fingerprints=ReplicaFingerprints(fingerprint_every) if fingerprint_every else None,
            profiler=self.profiler,
        )
        self._choosing = Choosing(strategy, self.shape, self.precision)  # the strategy, built once
        self._stepper: Stepper | None = None  # made once, on the built strategy (`stepper`)

    def _global_batch(self, batch_size: int | None, per_rank: int | None, evaluation: bool) -> int | None:
        """The loader's global batch: the one given, or `Global(batch=...)`'s; a different one refused."""
        if self.global_batch is None or evaluation or per_rank is not None:
            return batch_size
        if batch_size is not None and batch_size != self.global_batch:
            raise problem(
                f"s.loader(batch_size={batch_size}) differs from the session's global batch "
                f"{self.global_batch} (accumulation=Global(batch=...))",
                f"Leave batch_size out (the loader takes {self.global_batch}), or pass the same",
            )
        return self.global_batch

    @property
    def is_main(self) -> bool:
        """True on global rank 0: the rank whose `s.print` prints and whose tracker logs. Not a guard for
        `s.save`, `s.load` or `s.export`: every rank calls those (rank 0 writes the shared files itself,
        every rank its own part), and one called under `if s.is_main:` is refused by name."""
        return self.rank == 0

    @property
    def rank_seed(self) -> int:
        """A seed distinct per data-parallel rank, derived from `seed`, for per-rank randomness: the
        ranks of one tensor-parallel group share it (they compute one batch together, and a dropout on
        a tensor they all hold whole must draw one mask)."""
        return self.seed + 1_000_003 * (self._data()[0] + 1)

    def _data(self) -> tuple[int, int]:
        """(this rank's data-parallel rank, the data-parallel ranks): how the batches split. Under tensor
        parallelism a tensor group reads one batch (`Layout.data_rank`); otherwise, and before an "auto"
        session's strategy is built, the global rank and world."""
        layout = self._choosing.layout if self._choosing.strategy is not None else None
        if layout is None or not self.distributed:
            return self.rank, self.world_size
        return layout.data_rank(self.rank), layout.data

    # -- life cycle -----------------------------------------------------------------------------
    def start(self) -> Session:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            cpu_allocator.prepare()  # huge pages asked for before any tensor; s.model decides per model
        self._group = lifecycle.join(self.plan, self.limits)
        self.preemption.arm(NOTHING_TO_SAVE if self.is_main else "")  # a flag once state is given to save
        seed_everything(self.seed)
        threads = torch.get_num_threads()
        detail = f", {threads} CPU thread(s) per rank" if self.device.type == "cpu" else ""
        self.print(f"ddpkit: {self._choosing.describe()}; {self.plan.describe()}{detail}")  # what was chosen
        precision = self.precision.note or (self.precision.describe() if self.precision.name != "32" else "")
        for note in (*self.plan.notes, precision):  # the Slurm batch-script trap; ranks sharing a GPU
            if note:
                self.print(f"ddpkit: {note}")
        return self

    def close(self) -> None:
        """Finish a background save, leave the process group (if this session created it). Safe twice."""
        try:
            if self.profiler is not None:
                self.profiler.stop()  # an active window cut short is written as it is
            self.tracking.close()
            if self._checkpoints is not None:
                self._checkpoints.close()
        finally:
            self.preemption.close()
            if self._group is not None:
                self._group.leave()
            self._group = None
            self._on_close.close()

    def log(self, values: Mapping[str, Any], *, step: int) -> None:
        """Scalars to the trackers of `log_to` at `step` (global rank 0; see `ddpkit.observe.tracking`)."""
        self.tracking.log(values, step)

    # -- training steps (ddpkit.step.stepping) ------------------------------------------------------
    @property
    def stepper(self) -> Stepper:
        """The step state (fp16 loss scale, optimizer steps); `s.save(..., stepper=s.stepper)` keeps it.
        Made once, on the session's strategy (built now if "auto" waited for an `s.model`)."""
        if self._stepper is None:
            self._stepper = Stepper(self._choosing.built(), self._parts)
        return self._stepper

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the fp16 gradient scaler skipped (inf/nan gradients) in this session."""
        return self.stepper.skipped

    def autocast(self) -> contextlib.AbstractContextManager:
        """The precision's autocast context (a no-op for "32"); `accumulate` enters it for you."""
        return self.precision.forward_context()

    def accumulate(self, model: nn.Module) -> contextlib.AbstractContextManager[MicroBatch]:
        """One micro-batch: autocast, and DDP's `no_sync` unless it is the k-th of `accumulation`.

        Run the forward and `s.backward(loss)` inside; call `s.step(opt)` after every block.
        """
        self._boundary()
        return self.stepper.accumulate(model)

    def backward(self, loss: torch.Tensor, *, tokens: int | torch.Tensor | None = None) -> None:
        """`loss.backward()` with the loss divided by `accumulation` (and scaled for fp16).

        `tokens=n`: `loss` is the SUM of the micro-batch's per-token losses over its n valid tokens;
        `s.step` then makes the gradient the mean over all tokens of the global batch (`ddpkit.step.tokens`).
        """
        self._boundary()
        self.anatomy.mark("forward")
        self.stepper.backward(loss, tokens)
        self.anatomy.mark("backward")

    def step(self, optimizer: torch.optim.Optimizer, *, max_norm: float | None = None) -> StepInfo:
        """After each micro-batch: on the k-th, unscale, clip to `max_norm`, step, zero_grad.

        On the first k-1 it does nothing and returns `StepInfo(stepped=False)`.
        """
        info = self.stepper.step(optimizer, max_norm)
        if self._checkpoints is not None:  # an optimizer step (info.stepped): agree on a preemption stop
            self._checkpoints.stepped(info.stepped)
        self.anatomy.stepped(info.stepped)  # the optimizer phase; a step when it applied
        return info

    def _boundary(self, body: bool | None = None) -> None:  # s.accumulate, s.backward, the loader's next
        if self._checkpoints is not None:  # batch (body: a batch ran since): a preemption saves (agrees)
            self._checkpoints.stop_at_boundary(body)

    @contextmanager
    def join(self, model: nn.Module, *joinables: object) -> Iterator[None]:
        """Train on per-rank iterables of different lengths without hanging (torch's `Join`).

        A rank that runs out of batches shadows the others' gradient all-reduces until all are done;
        each step averages the gradients of the ranks that still had a batch (not divided by the
        full world size, so finished ranks do not shrink it). At exit, the last rank to finish
        broadcasts its weights, so replicas are identical. Only DDP's own collectives are shadowed:
        no other collective (s.all_reduce, SyncBatchNorm) may run inside, and `s.step` takes the whole
        optimizer step on every rank (not sharded: a finished rank could not publish its share).
        Under FSDP it is an error (every rank takes part in every block's all-gather).
        """
        with self.strategy.join(model, joinables), self.stepper.joining():
            yield

    # -- a script's collectives: each tagged first (`_tagged`), so ranks that part are named --------------
    def all_reduce(self, value: float | torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce a number or tensor over all ranks ("sum", "mean", "max", "min"); a new tensor.

        Called from a script, it is tagged first (one store round trip, `lifecycle.Membership.agree`):
        a rank that calls it alone (under `if s.is_main:`) is named with where the others are, instead
        of meeting their gradient all-reduce. ddpkit's own per-step calls (fit's) are not tagged. So are
        `any_rank`, `all_ranks`, `gather`, `gather_object` and `barrier`."""
        self._tagged("s.all_reduce")
        return super().all_reduce(value, op)

    def any_rank(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank; tagged first, as `all_reduce` is."""
        self._tagged("s.any_rank")
        return super().any_rank(flag)

    def all_ranks(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on all ranks; tagged first, as `all_reduce` is."""
        self._tagged("s.all_ranks")
        return super().all_ranks(flag)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor concatenated along dim 0 in rank order; tagged first, as `all_reduce` is."""
        self._tagged("s.gather")
        return super().gather(tensor)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, in rank order; tagged first, as `all_reduce` is."""
        self._tagged("s.gather_object")
        return super().gather_object(obj)

    def barrier(self) -> None:
        """Wait for every rank; tagged first, as `all_reduce` is."""
        self._tagged("s.barrier")
        super().barrier()

    def _tagged(self, call: str) -> None:
        """Tag a collective the script called (its caller is the script, not ddpkit: `called_from_ddpkit`
        looks past this frame and the method's)."""
        if self._group is not None and not lifecycle.called_from_ddpkit(3):
            self._group.agree(call, patient=False, limit=self.limits.collective)

    # -- checkpoints (ddpkit.checkpoint.checkpoints) -------------------------------------------------------
    def save(self, path: str, **state: Any) -> Any:
        """Save the training state atomically; see `ddpkit.checkpoint.checkpoints.Checkpoints.save`.
        With fingerprints on, the replicas are compared first: drifted weights are never written. Before
        either, a save that writes is tagged (`Checkpoints.agree`), so a rank that reached it alone is
        refused by name instead of meeting the others' collectives."""
        ckpt = self.checkpoints
        if ckpt.due(state.get("every"), state.get("step")):
            ckpt.agree("s.save")  # before any collective: a rank that is elsewhere is named, not met
        self.stepper.check_replicas()
        return ckpt.save(path, **state)

    def load(self, path: str, **state: Any) -> Any:
        """Restore state saved by `save` into the given objects; see `ddpkit.checkpoint.checkpoints`."""
        return self.checkpoints.load(path, **state)

    @property
    def last_checkpoint(self) -> tuple[str, dict[str, Any]] | None:
        """(root, the objects given) of this session's last `save` that wrote or `load` that found a
        checkpoint: what `SpikeGuard(remedy="rollback")` loads again (the newest valid one in that root)."""
        return None if self._checkpoints is None else self._checkpoints.found

    def export(self, path: str, model: nn.Module, *, merged: bool = False) -> Any:
        """The full weights of `model` as one plain safetensors file (`ddpkit.checkpoint.checkpoints`); an HF
        model to a directory (no .safetensors suffix): one `from_pretrained` loads (`ddpkit.strategy.hf`).
        A PEFT model: its adapter directory, or with `merged=True` the adapters folded into the base. `path`
        may be an fsspec URL (`s3://bucket/run/hf`): written locally, then uploaded."""
        ckpt = self.checkpoints  # a URL (s3://...): written in a local cache, then uploaded by rank 0
        ckpt.agree("s.export")  # every rank, before the export's first collective
        return ckpt.export_to(
            path, lambda local: hf.export(ckpt.export, local, model, main=self.is_main, merged=merged)
        )

    @property
    def checkpoints(self) -> Checkpoints:
        """This session's `ddpkit.checkpoint.checkpoints.Checkpoints` (background saves, registered extra
        state). Made once, here: the session builds its strategy first (a save or load before s.model
        builds the session's choice), then hands the checkpoint wing a value, never a call back."""
        if self._checkpoints is None:
            from ddpkit.checkpoint.background import NICE
            from ddpkit.checkpoint.checkpoints import CheckpointContext, Checkpoints

            stepper = self.stepper  # the strategy, built by the session (once), and the stepper
            context = CheckpointContext(
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                strategy=stepper.strategy,
                optimizers=stepper,
                layout=self.layout,  # the manifest records it
                group=self._group,
                save_timeout=self.limits.save,
                say=self.print,
                barrier=self.barrier,
            )
            nice = int(self._env.get(WRITER_NICE_ENV, NICE))
            self._checkpoints = Checkpoints(context, preemption=self.preemption, writer_nice=nice)
        return self._checkpoints

    # -- building blocks ------------------------------------------------------------------------
    def model(
        self,
        module: nn.Module | Callable[[], nn.Module],
        *,
        strategy: Choice | None = None,
        sync_batchnorm: bool = False,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = True,
        broadcast_buffers: bool = True,
        comm_hook: str | None = None,
        comm_hook_options: Mapping[str, Any] | None = None,
        compile: bool | Mapping[str, Any] = False,
        weights: str | os.PathLike | None = None,
        activation_checkpointing: Any = None,
    ) -> nn.Module:
        """Move `module` to the device and prepare it for data-parallel training.

        `module` may be a factory (the class, or `lambda: Net(cfg)`): under FSDP, no rank then ever
        holds the whole model (`ddpkit.strategy.fsdp_init`); otherwise it is simply called.

        `strategy` (default: the session's, "auto"): "ddp" replicates the model and wraps it in DDP,
        which copies global rank 0's weights to every rank here, once; "fsdp" shards parameters,
        gradients and optimizer state over the ranks with FSDP2 (`FSDPOptions` for its settings; see
        `ddpkit.strategy.fsdp`). With one process the model is used as is. Build the optimizer from
        the returned model's parameters, after this call. The DDP keywords (`sync_batchnorm=True`:
        BatchNorm statistics over the global batch; `comm_hook`: a gradient compression, "fp16",
        "bf16", "powersgd", see `ddpkit.parallel.comm_hooks`; the DDP constructor's options) are sugar for
        `strategy=DDPOptions(...)`. `compile=True` (or a dict of torch.compile arguments) compiles the
        module, then wraps it (see `ddpkit.parallel.compiling`). `weights`: a safetensors file or a directory
        `save_pretrained` wrote, read into the model (FSDP: each rank its own rows; `strategy.weights`);
        `activation_checkpointing`: a block class or "auto", recomputed in the backward (`.checkpointing`).
        """
        sugar = DDPOptions(
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            sync_batchnorm=sync_batchnorm,
            comm_hook=comm_hook,
            comm_hook_options=comm_hook_options,
        )
        built, options = self._choosing.for_model(strategy, sugar)  # the session's strategy; these options
        stepper = self.stepper  # made on it before the model is prepared (micro_batch="auto" asks FSDP)
        model = building.prepare(
            built,
            module,
            options,
            compiling.CompileOptions.parse(compile),
            shard=self._shard,
            device=self.device,
            weights_from=weights,
            recompute=activation_checkpointing,
            world_size=self.world_size,
            distributed=self.distributed,
            on_close=self._on_close,
            say=self.print,
        )  # (how to prepare)
        stepper.adopt(modules.ddp_of(model))  # ZeRO-2's reduce-scatter, or any-world's guard (step.stepping)
        seed_everything(self.rank_seed)  # each rank's own stream from here on (the module docstring)
        self.anatomy.watch(model)  # its gradient hooks time the sync wait (observe.anatomy)
        return model

    @property
    def strategy(self) -> Strategy:
        """The session's strategy (built by the first `s.model`, or here from the session's choice)."""
        return self.stepper.strategy

    @property
    def layout(self) -> Layout | None:
        """How the ranks divide among the kinds of parallelism (`ddpkit.parallel.layout`), as placed for
        the session's strategy (built here if "auto" still waits, as `s.strategy` is); None for one
        process or a strategy given as an instance (not placed by ddpkit)."""
        self._choosing.built()
        return self._choosing.layout

    def loader(
        self,
        dataset: Any,
        batch_size: int | None = None,
        *,
        per_rank_batch_size: int | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        evaluation: bool = False,
        presplit: bool = False,
        **dataloader_kwargs: Any,
    ) -> ShardedLoader:
        """A sharded DataLoader over a map-style or iterable source; `batch_size` is the global batch.

        `evaluation=True` shards without padding so metrics summed over ranks are exact, and ignores
        accumulation. `presplit=True`: `dataset` is this rank's own part already (never split again).
        Iterable sources, Hugging Face data sets, the tail rule: see `ddpkit.data`.
        """
        accumulation = 1 if evaluation else self.accumulation
        batch_size = self._global_batch(batch_size, per_rank_batch_size, evaluation)
        if self.invariant is not None and not evaluation:  # any-world: the global order, contiguous shares
            shuffle, drop_last = self.invariant.loader_options(
                dataset, batch_size, shuffle, dataloader_kwargs
            )
        data_rank, data_ranks = self._data()  # tensor-parallel ranks of a group read one batch
        batch = plan_batch(batch_size, per_rank_batch_size, world_size=data_ranks, accumulation=accumulation)
        built = make_loader(
            dataset,
            batch,
            rank=data_rank,
            device=self.device,
            seed=self.seed,
            shuffle=shuffle,
            drop_last=drop_last,
            evaluation=evaluation,
            presplit=presplit,
            boundary=None if evaluation else self._boundary,  # before each batch: where a stop saves
            **dataloader_kwargs,
        )
        if not evaluation:
            group = self.world_size // data_ranks
            shared = (
                f"; the {group} tensor-parallel ranks of a group read the same batch" if group > 1 else ""
            )
            self.print(f"ddpkit: {batch.describe()}{shared}")
        return built
