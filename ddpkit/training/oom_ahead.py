"""`micro_batch="auto"` under FSDP and HSDP: the split chosen once, before the first step, from an
estimate of that step's peak memory on fake tensors.

    with ddpkit.session(micro_batch="auto", strategy="fsdp") as s:
        ddpkit.fit(s, model, opt, loader, train_step)   # the first batch: estimated, split if needed

Why ahead and not on the failure, as under DDP (`ddpkit.step.oom`): FSDP all-gathers each unit's
parameters in the forward and the backward, so a rank out of memory part-way leaves its peers inside a
collective, where no agreement can reach them. So `ddpkit.fit`, at its first loader batch (the first
time the micro-batch's shape is known), runs this rank's step once on fake tensors: the model rebuilt
from the meta skeleton FSDP kept at `s.model` (`ddpkit.strategy.fsdp.Blueprint`), sharded with the
same units and policy over a fake process group of the same ranks (torch's `fake` backend: no data
moves), the session's optimizer class with its defaults, the user's own `train_step` on a fake copy of
the batch, under the plan's tracker (`ddpkit.observe.step_memory`, the same as `ddpkit plan --memory`).
The smallest power of two of parts whose peak, with the allocator's allowance, fits this rank's
budget is this rank's choice; one all-reduce (max) over the ranks makes it every rank's. The split is
then the one an out-of-memory error causes under DDP (`AutoMicroBatch.parts`: pieces of n/parts, the
accumulation times parts, the global batch and the update unchanged), said in one line, logged to the
trackers (`micro_batch/size`, `micro_batch/parts`, `memory/estimate_mib`, `memory/budget_mib`) and
saved with the stepper's state, with the estimate: a resumed run starts at it and does not estimate
again.

The budget: `DDPKIT_STEP_MEMORY_MIB` (MiB a step's tensors may hold) when set; else on CUDA the GPU's
memory less 1 GiB (the context), on CPU ranks the cgroup limit (`ddpkit.strategy.rank_memory`) less
400 MiB of runtime; with neither (a CPU rank nothing limits) no estimate is made and nothing is split.
Cost: one fake build and one fake step per size tried (seconds on a CPU; docs/planning.md), once per
run; nothing per step. A step fake tensors cannot run (`.item()` or an `if` on a tensor in `train_step`,
a shape made from the data, an operator without a fake kernel) is advice lost, not an error: 1 part,
said in one line with the fake-tensor error and the split by hand (the session's accumulation doubled),
and an out-of-memory error later names it. HSDP is estimated as FSDP over its shard group: its
all-reduce across the replicas adds no tensor memory (torch 2.13's FSDP2, `foreach_reduce` in
`_fsdp_collectives.py`: `dist.all_reduce(reduce_output, group=all_reduce_group)` runs in place on the
reduce-scatter's output, which, reduced in fp32 as ddpkit's precision policies do, becomes the sharded
gradients themselves; `ddpkit plan --memory --strategy hsdp` runs that all-reduce on a 2-D fake mesh
and gets the same peak to the byte, tests/test_plan_memory.py).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpkit import names
from ddpkit.observe import step_memory
from ddpkit.observe.memory_breakdown import Breakdown
from ddpkit.step import micro_batches, oom
from ddpkit.strategy import rank_memory

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ddpkit.parallel.layout import Layout
    from ddpkit.strategy.fsdp import Blueprint
    from ddpkit.training.session import Session

MIB = 1 << 20
STEP_MEMORY_ENV = names.STEP_MEMORY_ENV


def budget(device: torch.device, env: Mapping[str, str]) -> tuple[int | None, float, str]:
    """Bytes this rank's step may hold, the allocator's allowance on top of the tracked peak, and where
    the figure comes from; (None, ..) when nothing limits the rank."""
    raw = env.get(STEP_MEMORY_ENV, "").strip()
    if raw:
        try:
            return int(float(raw) * MIB), step_memory.CPU_ALLOWANCE, STEP_MEMORY_ENV
        except ValueError:
            from ddpkit.errors import problem

            raise problem(
                f"{STEP_MEMORY_ENV}={raw!r} is not a number of MiB",
                f"Set e.g. {STEP_MEMORY_ENV}=20000, or unset it",
            ) from None
    if device.type == "cuda":
        total = torch.cuda.mem_get_info(device)[1]
        return total - step_memory.CUDA_RESERVED, step_memory.CUDA_ALLOWANCE, "the GPU's memory less 1 GiB"
    limit = rank_memory.limit_bytes()
    if limit is None:
        return None, step_memory.CPU_ALLOWANCE, "no cgroup limit"
    return limit - step_memory.CPU_RESERVED, step_memory.CPU_ALLOWANCE, "the cgroup limit less 400 MiB"


@contextlib.contextmanager
def fake_group(layout: Layout, device_type: str) -> Iterator[DeviceMesh]:
    """This rank's shard group (`layout.groups("shard")`: the world under FSDP, HSDP's shard degree) as a
    fake process group (torch's `fake` backend) and its 1-D mesh; made by every rank (creating groups is
    collective), destroyed after."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
    from torch.distributed.device_mesh import DeviceMesh

    groups = layout.groups("shard")
    mine, made = dist.new_subgroups_by_enumeration(groups, backend="fake")
    try:
        yield DeviceMesh.from_group(mine, device_type)
    finally:
        for group in made:
            dist.destroy_process_group(group)


def _fake_optimizer(optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    try:
        return type(optimizer)(params, **optimizer.defaults)
    except Exception:  # an optimizer whose constructor takes other arguments: Adam's two states per weight
        return torch.optim.AdamW(params)


def estimates(
    blueprint: Blueprint,
    mesh: DeviceMesh,
    optimizer: torch.optim.Optimizer,
    train_step: Callable[[nn.Module, Any], torch.Tensor],
    pieces: Callable[[int], Any],
    sizes: list[int],
    fits: Callable[[Breakdown], bool],
    forward_context: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> dict[int, Breakdown]:
    """The tracked peak of one step per number of parts in `sizes`, smallest first, until one `fits`: the
    model built and sharded once on fake tensors, its optimizer state made, then one tracked step each."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_map_only

    from ddpkit.strategy import fsdp_units  # FSDP's own loop: units, then the root (imported when used)

    out: dict[int, Breakdown] = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        model = step_memory.materialize(blueprint.skeleton, device)
        fsdp_units.shard(model, list(blueprint.units), **{**blueprint.kwargs, "mesh": mesh})
        params = [p for p in model.parameters() if p.requires_grad]
        opt = _fake_optimizer(optimizer, params)
        step_memory.warm_optimizer(params, opt, None, False)
        for parts in sizes:
            batch = tree_map_only(torch.Tensor, mode.from_tensor, pieces(parts))
            tracker = step_memory.peak_tracker(model, opt, sharded=True)
            with tracker:
                with forward_context():
                    loss = train_step(model, batch)
                loss.backward()
                del loss
                step_memory.owned_update(params, opt, None, False)
            del batch
            out[parts] = step_memory.fold(tracker, opt)
            if fits(out[parts]):
                break
    return out


def choose(
    s: Session,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_step: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
) -> None:
    """Before the first step of a `micro_batch="auto"` session under FSDP: estimate, agree, set the split
    (`AutoMicroBatch.parts`), say it, log it. Once per run: a session resumed with an estimate skips it.
    An estimate that fails (a `train_step` fake tensors cannot run: `.item()`, a shape made from the data,
    an operator without a fake kernel) is advice lost, not an error: 1 part, said in one line with why
    and how to split by hand."""
    auto: oom.AutoMicroBatch | None = s.stepper.oom
    if auto is None or not auto.ahead or auto.estimate:
        return
    start = time.perf_counter()
    n = micro_batches.batch_len(batch)
    limit, allowance, source = budget(s.device, os.environ)
    strategy = s.strategy
    inner = getattr(model, "_orig_mod", model)
    blueprint = cast("Blueprint | None", strategy.blueprint(inner))  # kept at s.model (`keep_blueprints`)
    sizes = [1 << i for i in range(max(1, n).bit_length()) if (1 << i) <= max(1, n)]
    found: dict[int, Breakdown] = {}
    why = ""
    failed = ""  # why this rank made no estimate although a budget is known
    own = 1
    if limit is not None and blueprint is not None and n > 0 and s.distributed:

        def largest_piece(parts: int) -> Any:
            return max((p for p, _ in micro_batches.split(batch, parts)), key=micro_batches.batch_len)

        def fits(b: Breakdown) -> bool:
            return b.with_device(allowance, 0).total <= limit

        try:
            layout = s.layout  # FSDP's shape is placed when it is built (`ddpkit.strategy.place`)
            assert layout is not None
            with fake_group(layout, s.device.type) as mesh:
                found = estimates(
                    blueprint,
                    mesh,
                    optimizer,
                    train_step,
                    largest_piece,
                    sizes,
                    fits,
                    s.stepper.autocast,
                    s.device,
                )
        except Exception as exc:  # the estimate is advice: a step it cannot run trains as the loader says
            found, failed = {}, failure(exc)
        fitting = [p for p, b in found.items() if fits(b)]
        own = min(fitting) if fitting else (max(found) if found else 1)
        if found and not fitting:
            why = "even one sample per micro-batch is estimated above the budget"
    elif limit is not None:
        failed = (
            "no FSDP blueprint of this model"
            if blueprint is None
            else "an empty micro-batch"
            if n <= 0
            else "not a distributed run"
        )
    row = torch.zeros(2 + s.world_size, dtype=torch.float64, device=s.device)
    row[0], row[1] = float(own), float(found[1].total if 1 in found else 0)
    row[2 + s.rank] = 1.0 if failed else 0.0  # which ranks made no estimate: every rank's line names them
    if s.distributed:
        dist.all_reduce(row, op=dist.ReduceOp.MAX)  # once per run: every rank takes the largest split
    parts = int(row[0].item())
    unestimated = [r for r in range(s.world_size) if row[2 + r] > 0]
    seconds = time.perf_counter() - start
    peak = found[min(found, key=lambda p: abs(p - parts))].total if found else 0
    estimate = {
        "micro_batch": n / parts,
        "peak": float(peak),
        "budget": float(limit or 0),
        "parts": float(parts),
        "whole": row[1].item(),
        "seconds": seconds,
        "failed": float(len(unestimated)),
    }
    auto.chose_ahead(parts, estimate, step=s.stepper.steps + 1, note=note(estimate, failed))
    if unestimated and len(unestimated) == s.world_size:
        _say_failed(s, n, unestimated, failed)
        return
    if unestimated:  # some ranks estimated: theirs is the split (FSDP's ranks hold alike)
        lost = f"rank(s) {unestimated} could not estimate{f' ({failed})' if failed else ''}"
        why = f"{why}; {lost}" if why else lost
    _say(s, n, parts, limit, source, row[1].item(), seconds, why)


# What a fake tensor cannot do, in the user's terms (torch._subclasses.fake_tensor's exceptions).
_CANNOT = {
    "DataDependentOutputException": "train_step reads a tensor's value (.item(), .tolist(), an `if` on a "
    "tensor), which fake tensors do not hold",
    "DynamicOutputShapeException": "train_step makes a shape from the data (a boolean mask, nonzero, "
    "unique), which fake tensors cannot know",
    "UnsupportedOperatorException": "an operator in the step has no fake-tensor kernel",
}


def failure(exc: BaseException) -> str:
    """Why the fake step failed, in one line: the exception's type, its first line, and what it means."""
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    name = type(exc).__name__
    return f"{name}: {first}" + (f"; {_CANNOT[name]}" if name in _CANNOT else "")


def _say_failed(s: Session, n: int, ranks: list[int], failed: str) -> None:
    """The one line of an estimate that could not be made on any rank: 1 part, why, and the hand split."""
    what = f"{s.strategy.describe()}, micro_batch='auto'"
    why = failed or f"rank {ranks[0]}'s fake step failed"
    s.print(
        f"ddpkit: {what}: the first step could not be estimated on fake tensors ({why}): no split, "
        f"micro-batches of {n} as the loader gives them; to split by hand, run the session with "
        f"accumulation={2 * s.accumulation} (micro-batches of {max(1, n // 2)} for the same global batch "
        f"{n * s.accumulation * s.world_size})"
    )
    s.log({"micro_batch/size": n, "micro_batch/parts": 1}, step=s.stepper.steps)


def note(e: Mapping[str, float], failed: str = "") -> str:
    """The estimate the split was chosen by, as the clause an out-of-memory error adds (`oom.explain`)."""
    if not e.get("budget") or not e.get("peak"):
        made = (
            f"the estimate before the first step failed ({failed})"
            if failed
            else ("no estimate was made before the first step")
        )
        return (
            " (FSDP all-gathers in the forward and backward, so ddpkit cannot re-run the step split "
            f"on every rank; {made})"
        )
    return (
        f" (FSDP all-gathers in the forward and backward, so ddpkit cannot re-run the step split on "
        f"every rank; before the first step it estimated this rank's peak at {e['peak'] / MIB:.0f} MiB "
        f"for micro-batch {e['micro_batch']:g} against a budget of {e['budget'] / MIB:.0f} MiB and chose "
        f"{int(e['parts'])} part(s): the step needed more than the estimate)"
    )


def _say(
    s: Session,
    n: int,
    parts: int,
    limit: int | None,
    source: str,
    whole: float,
    seconds: float,
    why: str,
) -> None:
    what = f"{s.strategy.describe()}, micro_batch='auto'"
    if limit is None:
        s.print(
            f"ddpkit: {what}: no memory budget known for this rank ({source}; set {STEP_MEMORY_ENV}): "
            f"micro-batches of {n} as the loader gives them"
        )
        return
    est = (
        f"the first step estimated on fake tensors at {whole / MIB:.1f} MiB per rank (max over ranks) "
        f"for micro-batch {n}, budget {limit / MIB:.1f} MiB ({source}, +10% allowance), in {seconds:.1f} s"
    )
    if parts == 1:
        s.print(f"ddpkit: {what}: {est}: no split{f' ({why})' if why else ''}")
    else:
        s.print(
            f"ddpkit: {what}: {est}: each loader micro-batch of {n} runs as {parts} parts of "
            f"{n / parts:g} (accumulation {s.stepper.accumulation} -> {s.stepper.blocks}; global batch "
            f"{n * s.accumulation * s.world_size} unchanged){f' ({why})' if why else ''}"
        )
    s.log(
        {
            "micro_batch/size": n / parts,
            "micro_batch/parts": parts,
            "memory/estimate_mib": whole / MIB,
            "memory/budget_mib": limit / MIB,
        },
        step=s.stepper.steps,
    )
