"""The optimizer step, sharded: each rank updates only the parameters it owns, then owners publish them.

    with ddpkit.session(shard_optimizer="auto") as s:   # the default
        ...
        s.step(opt)        # this rank steps its share of the parameters; every rank ends with all of them

Why: after DDP's all-reduce every rank holds the same averaged gradients and, in plain DDP, repeats the
same optimizer update on every parameter. On CPU ranks that repeated update competes for the cores with
everything else (AdamW on the 37.8M-parameter `mlp` takes longer than its forward pass). Here rank r
steps only the parameters it owns (a greedy split by size, whole tensors), so optimizer state exists
only there too, and then every rank receives the owners' new values: through shared memory when the
ranks share a machine (`ddpkit.parallel.shm_allreduce`), else by broadcasts from each owner.

How, without touching the user's optimizer: during `optimizer.step()` the gradients of the parameters
this rank does not own are set aside (`p.grad = None`), which every torch optimizer skips. The update
of each parameter is the same computation the unsharded step would do, by the same kernels on the
same values, so the weights are bitwise those of the unsharded step (tests/test_sharding.py).

"auto" shards the step of torch's per-parameter optimizers (SGD, Adam, AdamW, ...) on CPU ranks that
share a machine, once there are enough parameters for it to pay (`AUTO_MIN_PARAMETERS`, measured by
benchmarks/shard_breakeven.py; below it the step stays whole, silently); True shards any optimizer but
L-BFGS and SparseAdam (for per-parameter update rules only: one that reads other parameters, e.g. a
global trust ratio, must not be sharded); False never.
Checkpoints hold the full optimizer state (gathered at save, `full_state_dict`), so they load at any
world size, sharded or not. Only `s.step(opt)` shards: call it rather than `opt.step()` throughout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.errors import problem
from ddpkit.parallel.collectives import gather_state
from ddpkit.parallel.partition import partition
from ddpkit.step import shard_exchange

PER_PARAMETER = {
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "ASGD",
    "Adafactor",
}
NEVER = {"LBFGS", "SparseAdam"}
_BROADCAST_BUCKET = 256 * 2**20
# Below this many parameters the plain step is as fast as the sharded one (publishing costs a barrier
# and a copy per step). benchmarks/shard_breakeven.py, 2 ranks: AdamW sharded / plain 0.91 at 1M
# parameters (spread crossing 1), 0.73 at 4M; SGD with momentum (one cheap pass) 1.18 at 4M, 1.00 at 17M.
AUTO_MIN_PARAMETERS = 4_000_000
AUTO_MIN_PARAMETERS_BY_OPTIMIZER = {"SGD": 16_000_000}
# Publishing streams parameters through 2 buffers x ranks slots of this size; every byte of them ends
# up in each rank's resident memory, so they are smaller than the shm hook's 16 MiB (same speed).
PUBLISH_CHUNK_MB = 4.0


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the step may change: a frozen one (a PEFT model's base passed to the optimizer with
    `model.parameters()`) has no gradient and no state, so it is neither owned nor published."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


class ShardedStep:
    """One optimizer's split over the ranks of `group`, and the publishing of updated parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        group: Any,
        shm: Any | None,
        candidates: shard_exchange.Candidates | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.shm = shm  # a ShmAllReduce whose segment carries the parameters, or None: broadcasts
        self.params = _params(optimizer)
        self.ids = [id(p) for p in self.params]
        owners = partition([p.numel() for p in self.params], self.world)
        pairs = list(zip(self.params, owners, strict=True))
        self.owned = [[p for p, o in pairs if o == r] for r in range(self.world)]
        self.foreign = [p for p, o in pairs if o != self.rank]  # their gradients are set aside in step()
        self.drop_foreign_state()
        # ZeRO-2 on one machine: gradients reduce-scattered into each rank's share (None: DDP all-reduces)
        self.exchange = shard_exchange.claim(shm, group, self.params, owners, candidates)

    # -- the gradient exchange (`ddpkit.step.shard_exchange`); the Stepper calls these in this order --
    def reduce_gradients(self) -> None:
        """At `s.step`, first: this rank's share of the averaged gradients (when they were deferred)."""
        if self.exchange is not None:
            self.exchange.reduce()

    def agree_found_inf(self, flags: list[torch.Tensor]) -> None:
        """After fp16 unscaling (`LossScale.unscale` passes its flags): the overflow flags of the whole
        gradients, on every rank."""
        if self.exchange is not None:
            self.exchange.agree_found_inf(flags)

    def clip(self, params: list[Any], max_norm: float, whole: Callable[..., torch.Tensor]) -> torch.Tensor:
        """The total norm before clipping, computed on shards after a reduce-scatter, else `whole`'s."""
        if self.exchange is None:
            return whole(params, max_norm)
        return self.exchange.clip(params, max_norm, whole)

    def describe(self) -> str:
        shares = [sum(p.numel() for p in ps) for ps in self.owned]
        total = sum(shares) or 1
        via = "shared memory" if self.shm is not None else "broadcasts"
        grads = "; gradients reduce-scattered into each share" if self.exchange is not None else ""
        return (
            f"optimizer step sharded over {self.world} ranks ({type(self.optimizer).__name__}, "
            f"{sum(shares)} trainable elements; largest share {max(shares) / total:.0%}); new values "
            f"published through {via}{grads}"
        )

    def drop_foreign_state(self) -> None:
        """Forget optimizer state of parameters other ranks own (after a full load, or at the start)."""
        for p in self.foreign:
            self.optimizer.state.pop(p, None)

    def step(self, run: Callable[[], Any]) -> Any:
        """`run()` (the optimizer step) on this rank's parameters only, then publish them to every rank."""
        if [id(p) for p in _params(self.optimizer)] != self.ids:
            raise problem(
                "the optimizer's parameters changed after sharded steps began (add_param_group?)",
                "Build the optimizer with all its parameters before the first s.step, or pass "
                "shard_optimizer=False to ddpkit.session",
            )
        aside = [(p, p.grad) for p in self.foreign if p.grad is not None]
        for p, _ in aside:
            p.grad = None
        try:
            result = run()
        finally:
            for p, g in aside:
                p.grad = g
        self.publish()
        return result

    def publish(self) -> None:
        """Every rank gets the values of the parameters each owner just updated."""
        with torch.no_grad():
            if self.shm is not None:
                self.shm.all_gather_([[p.detach() for p in ps] for ps in self.owned])
                return
            for r, ps in enumerate(self.owned):
                if ps:
                    src = dist.get_global_rank(self.group, r)
                    dist._broadcast_coalesced(self.group, [p.detach() for p in ps], _BROADCAST_BUCKET, src)

    def full_state_dict(self) -> dict[str, Any] | None:
        """The unsharded `optimizer.state_dict()` on rank 0 (None elsewhere). Collective."""
        return gather_state(self.optimizer.state_dict(), self.rank, self.world, self.group)


def choose(
    optimizer: torch.optim.Optimizer,
    mode: bool | str,
    device: torch.device,
    *,
    timeout: float = 1800.0,
    report: Callable[[str], None] | None = None,
    candidates: shard_exchange.Candidates | None = None,
) -> ShardedStep | None:
    """A ShardedStep for the optimizer, or None when its step stays whole (collective: every rank calls it).

    The caller (the session's `Stepper`) calls it once per optimizer, at its first step, and keeps the
    answer; `report` is told when the step starts being sharded. `candidates`: the session's DDP models
    whose gradients the step may reduce-scatter (shard_optimizer="gradients"), else None."""
    name = type(optimizer).__name__
    decided: ShardedStep | None = None
    mode = True if mode == "gradients" else mode  # asked for, with its gradients reduce-scattered too
    if mode is True and name in NEVER:
        raise problem(
            f"shard_optimizer=True cannot shard {name} (its step is not per parameter)",
            "Pass shard_optimizer='auto' or False to ddpkit.session",
        )
    wanted = mode is True or (
        mode == "auto"
        and device.type == "cpu"
        and name in PER_PARAMETER
        and sum(p.numel() for p in _params(optimizer))
        >= AUTO_MIN_PARAMETERS_BY_OPTIMIZER.get(name, AUTO_MIN_PARAMETERS)
    )
    if wanted and dist.is_initialized() and dist.get_world_size() > 1:
        shm = _shared_memory(optimizer, device, timeout)
        if shm is not None or mode is True:
            decided = ShardedStep(optimizer, dist.group.WORLD, shm, candidates)
            if report is not None:
                report(f"ddpkit: {decided.describe()}")
    return decided


def _shared_memory(optimizer: torch.optim.Optimizer, device: torch.device, timeout: float) -> Any | None:
    """A shared-memory channel when every rank is on this machine and the parameters can use it."""
    from ddpkit.parallel.shm_allreduce import ShmAllReduce

    params = _params(optimizer)
    usable = device.type == "cpu" and all(p.is_contiguous() and p.device.type == "cpu" for p in params)
    # collective; `usable` is equal on all ranks
    state = ShmAllReduce(timeout=timeout, chunk_mb=PUBLISH_CHUNK_MB) if usable else None
    if state is None or not state.active:
        return None
    return state
