"""`ddpkit plan --memory`: will this model, at this batch, with this strategy, fit on that device, and
what is the largest micro-batch that does?

    ddpkit plan --memory --model hf:gpt2 --device h100 --world 8 --global-batch 512 --precision bf16
    ddpkit plan --memory --model mypkg.models:make_net --sample mypkg.data:sample --strategy fsdp --world 4 \\
        --global-batch 64 --device cpu --activation-checkpointing auto
    ddpkit plan --memory --model gpt --device-memory 0.2 --device cpu --world 2 --global-batch 64 --json -
    ddpkit plan --memory --model hf:llama --strategy tp --tensor-degree 8 --world 64 --global-batch 256 \\
        --precision bf16 --seq-len 2048 --device h100

One steady-state training step of rank 0 runs on fake tensors on this CPU (`ddpkit.plan.memory`):
the peak per rank, by category, for the asked micro-batch (default: the whole per-rank batch, no
accumulation); then the largest micro-batch that fits, with the accumulation that keeps the global
batch; when even micro-batch 1 does not fit, what would (FSDP, activation checkpointing, bf16), each
estimated the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ddpkit.errors import DdpkitError, problem
from ddpkit.parallel import layout as layouts

# The help of each layout degree's flag (`--<degree>-degree`); a degree added to `TOOL_DEGREES` gets
# its flag with the generic help.
DEGREE_HELP = {"shard": "hsdp: ranks that share one model state"}


def build_parser() -> argparse.ArgumentParser:
    from ddpkit.plan import devices, memory

    p = argparse.ArgumentParser(prog="ddpkit plan --memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        "--workload",
        dest="model",
        required=True,
        help="a workload (mlp, gpt, ...), hf:TYPE[,key=value...] or hf:CONFIG_PATH, or "
        "package.module:function returning an nn.Module or a Workload",
    )
    p.add_argument(
        "--sample",
        default=None,
        help="for a plain nn.Module: package.module:function (generator, n) -> (inputs, targets)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="hf models: tokens per sample (default: the config's)"
    )
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    p.add_argument(
        "--strategy",
        choices=memory.offered(),
        default="ddp",
        help="ddp, zero1 (DDP + ddpkit's sharded optimizer step), fsdp, hsdp (needs --shard-degree)",
    )
    for degree in layouts.TOOL_DEGREES:  # --shard-degree, and every degree the layout adds for the tools
        text = DEGREE_HELP.get(degree, f"ranks per {degree} group (default: the strategy's own rule)")
        p.add_argument(f"--{degree}-degree", type=int, default=None, help=text)
    p.add_argument(
        "--tp-plan",
        default="auto",
        metavar="auto|JSON|MODULE:NAME",
        help="tp: which layers split how: auto (a Hugging Face model's own plan), a JSON object "
        '{"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, or package.module:NAME of such a dict',
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="tp: norms and dropout split along the sequence (TPOptions(sequence_parallel=True))",
    )
    p.add_argument("--world", type=int, default=8, help="ranks in all")
    p.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step over all ranks")
    p.add_argument(
        "--micro-batch", type=int, default=None, help="per rank and forward (default: the per-rank batch)"
    )
    p.add_argument(
        "--activation-checkpointing",
        default=None,
        metavar="auto|CLASS",
        help="recompute these blocks' activations in the backward: auto, or a class name",
    )
    p.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd or package.module:function")
    p.add_argument("--device", default="h100", help=f"one of {', '.join(devices.NAMES)}")
    p.add_argument(
        "--device-memory",
        type=float,
        default=None,
        metavar="GB",
        help="the device's memory in GB (10^9 B), instead of a named device's",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the plan as JSON ('-': stdout only)")
    return p


def _device(ns: argparse.Namespace) -> Any:
    from ddpkit.plan import devices

    if ns.device_memory is not None:
        return devices.custom(ns.device_memory, kind="cpu" if ns.device == "cpu" else "cuda")
    return devices.named(ns.device, world=ns.world)


def make(ns: argparse.Namespace) -> dict[str, Any]:
    """The memory plan as a dict (what --json writes); `text` renders it."""
    from ddpkit.plan import memory, memory_fit, memory_models

    start = time.perf_counter()
    device = _device(ns)
    job = memory.MemoryJob(
        model=ns.model,
        micro_batch=ns.micro_batch or 1,
        seq_len=ns.seq_len,
        precision=ns.precision,
        strategy=ns.strategy,
        world=ns.world,
        shard_degree=ns.shard_degree,
        other_degrees=tuple(
            (d, v)
            for d in layouts.TOOL_DEGREES
            if d != "shard" and (v := getattr(ns, f"{d}_degree")) is not None
        ),
        activation_checkpointing=ns.activation_checkpointing,
        tp_plan=ns.tp_plan,
        sequence_parallel=ns.sequence_parallel,
        optimizer=ns.optimizer,
        sample=ns.sample,
        device_kind=device.kind,
    )
    readers = job.readers  # the ranks that read different batches: a tensor group reads one
    global_batch = ns.global_batch or readers * (ns.micro_batch or 1)
    options = memory_fit.splits(global_batch, readers)
    micro = ns.micro_batch or options[0][0]
    if (global_batch // readers) % micro:
        fits = ", ".join(str(m) for m, _ in options)
        raise problem(
            f"micro-batch {micro} does not divide the per-rank batch {global_batch // readers}",
            f"Pass one of {fits}, or another --global-batch",
        )
    job = replace(job, micro_batch=micro)
    capacity = device.memory
    asked = memory.estimate(job)
    fit, seen = memory_fit.largest_fit(
        job,
        global_batch,
        capacity,
        allowance=device.allowance,
        reserved=device.reserved,
        measured={micro: asked},
    )
    tried: list[dict[str, Any]] = []
    if fit is None:
        for alt in memory_fit.alternatives(job):
            try:
                b = memory.estimate(alt).with_device(device.allowance, device.reserved)
            except DdpkitError as err:  # e.g. "auto" finds no repeated block: say what to name
                tried.append({"job": alt.describe(), "total": None, "fits": False, "why": str(err)})
                continue
            tried.append({"job": alt.describe(), "total": b.total, "fits": b.total <= capacity})
    shown = asked.with_device(device.allowance, device.reserved)
    return {
        "model": memory.resolve_model(job).name,
        "parameters": memory_models.parameter_count(memory.resolve_model(job)),
        "job": job.describe(),
        "device": {
            "name": device.name,
            "memory": device.memory,
            "reserved": device.reserved,
            "allowance": device.allowance,
            "source": device.source,
        },
        "global_batch": global_batch,
        "micro_batch": micro,
        "accumulation": global_batch // readers // micro,
        "data_ranks": readers,
        "breakdown": shown.as_dict(),
        "estimates": {
            str(m): b.with_device(device.allowance, device.reserved).total for m, b in sorted(seen.items())
        },
        "largest_fit": None
        if fit is None
        else {
            "micro_batch": fit.micro_batch,
            "accumulation": fit.accumulation,
            "total": fit.breakdown.total,
        },
        "alternatives": tried,
        "seconds": time.perf_counter() - start,
    }


def text(plan: dict[str, Any]) -> str:
    from ddpkit.observe.memory_breakdown import Breakdown, gib

    dev = plan["device"]
    b = plan["breakdown"]
    breakdown = Breakdown(
        **{
            k: b[k]
            for k in (
                "parameters",
                "gradients",
                "optimizer_state",
                "activations",
                "fsdp_buffers",
                "temporaries",
                "allowance",
                "reserved",
            )
        }
    )
    lines = [
        f"model: {plan['model']}, {plan['parameters'] / 1e6:.1f}M parameters",
        f"step: {plan['job']}",
        f"device: {dev['name']}, {gib(dev['memory'])} ({dev['source']}); "
        f"runtime reserve {gib(dev['reserved'])}, "
        f"allocator allowance {dev['allowance']:.0%} of the tracked peak",
        "",
        breakdown.text(
            dev["memory"],
            title=f"peak per rank at micro-batch {plan['micro_batch']} (global batch "
            f"{plan['global_batch']} = {plan['micro_batch']} x {plan['accumulation']} accumulation x "
            f"{plan['global_batch'] // plan['micro_batch'] // plan['accumulation']} data-parallel ranks)",
        ),
        "",
    ]
    fit = plan["largest_fit"]
    if fit is not None:
        lines.append(
            f"largest micro-batch that fits: {fit['micro_batch']} with accumulation {fit['accumulation']} "
            f"({gib(fit['total'])} of {gib(dev['memory'])})"
        )
    else:
        lines.append(
            f"nothing fits: micro-batch 1 needs {gib(plan['estimates']['1'])} of {gib(dev['memory'])}"
        )
        for alt in plan["alternatives"]:
            if alt["total"] is None:
                lines.append(f"  {alt['job']}: not estimated: {alt['why']}")
                continue
            verdict = "fits" if alt["fits"] else "does not fit"
            lines.append(f"  {alt['job']}: {gib(alt['total'])}, {verdict}")
        lines.append("  or more ranks (FSDP divides the model state by them), or a smaller model or sequence")
    lines.append(
        f"estimated in {plan['seconds']:.1f} s: one step on fake tensors on this CPU per micro-batch "
        f"tried ({', '.join(plan['estimates'])})"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        plan = make(ns)
    except DdpkitError as err:
        print(f"ddpkit plan --memory: error: {err}", file=sys.stderr)
        return 2
    if ns.json != "-":
        print(text(plan))
    if ns.json:
        if ns.json == "-":
            print(json.dumps(plan, indent=2))
        else:
            with open(ns.json, "w") as f:
                json.dump(plan, f, indent=2)
            print(f"json: {ns.json}")
    return 0
