"""What would help when communication cannot be hidden, each option with its predicted gain.

The gains are the simulator's, at the largest N of the plan; each names its price: a bigger per-rank
batch needs memory (and, in strong scaling, a retuned learning rate), accumulation makes the global
batch k times larger, a compression hook costs gradient accuracy (figures from ddpkit/parallel/comm_hooks.py),
FSDP moves more bytes (3 collectives' worth against DDP's 2) to hold 1/N of the model state; on several nodes
HSDP holds 1/(ranks per node) of it and sends only one all-reduce of the node's shards between nodes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ddpkit.plan.planner import Planner
from ddpkit.plan.simulate import Options, Prediction
from ddpkit.strategy.choice import verdict

HIDDEN_SHARE = 0.05  # communication adding less than this share of the step counts as hidden
HOOK_COST = {  # measured in tests/test_comm_hooks.py, tabulated in ddpkit/parallel/comm_hooks.py
    "fp16": "relative error 3.2e-4 of the averaged gradient; overflows above 65504",
    "bf16": "relative error 2.4e-3 of the averaged gradient; fp32's range",
    "powersgd": "a rank-r approximation per step (1.3 relative error at rank 1), error feedback "
    "recovers it over steps: check convergence",
}


def _gain(new: Prediction, old: Prediction) -> str:
    return f"{new.samples_per_s / old.samples_per_s - 1:+.0%} throughput ({new.step_s * 1e3:.1f} ms/step)"


def advise(
    planner: Planner, n: int, opts: Options, at_n: Prediction, *, strong: bool, device_memory_gb: float | None
) -> list[dict[str, Any]]:
    """Advice items at n ranks: {"what", "gain", "cost", "samples_per_s", "step_s"}."""
    items: list[dict[str, Any]] = []
    share = at_n.exposed_s / at_n.step_s if at_n.step_s else 0.0

    def add(what: str, q: Prediction, cost: str) -> None:
        items.append(
            {
                "what": what,
                "gain": _gain(q, at_n),
                "cost": cost,
                "samples_per_s": q.samples_per_s,
                "step_s": q.step_s,
                "efficiency_gain": q.samples_per_s / at_n.samples_per_s - 1,
            }
        )

    if n > 1 and share >= HIDDEN_SHARE:
        items.append(
            {
                "what": f"communication cannot be hidden at N={n}: it adds {at_n.exposed_s * 1e3:.1f} ms of "
                f"{at_n.step_s * 1e3:.1f} ms per step ({share:.0%})",
                "gain": "",
                "cost": "",
            }
        )
        best = planner.best_bucket(n, opts)
        if best.options["bucket_cap_mb"] != opts.bucket_cap_mb and best.step_s < at_n.step_s * 0.99:
            add(f"bucket_cap_mb={best.options['bucket_cap_mb']:g}", best, "none")
        for factor in (2, 4):
            q = planner.predict(n, opts, batch_factor=factor)
            cost = f"x{factor} activation memory per device" + (
                "; a larger global batch (retune the learning rate)" if strong else ""
            )
            add(f"per-rank batch x{factor} ({q.per_rank_batch})", q, cost)
        for k in (2, 4):
            q = planner.predict(n, replace(opts, accumulation=k))
            add(
                f"accumulation={k} (one all-reduce per {k} micro-batches)",
                q,
                f"global batch x{k} per optimizer step (retune the learning rate)",
            )
        for q in planner.hook_sweep(n, opts):
            hook = q.options["hook"]
            name = f"comm_hook={hook!r}" + (
                f", rank {q.options['powersgd_rank']}" if hook == "powersgd" else ""
            )
            if q.step_s < at_n.step_s * 0.98:
                add(name, q, HOOK_COST[hook])
    elif n > 1:
        items.append(
            {
                "what": f"communication is hidden at N={n}: it adds {at_n.exposed_s * 1e3:.2f} ms of "
                f"{at_n.step_s * 1e3:.1f} ms ({share:.1%}); nothing to change",
                "gain": "",
                "cost": "",
            }
        )
    p = planner.profile_at(at_n.per_rank_batch)
    state = 2 * p.param_bytes + p.state_bytes  # parameters, gradients, optimizer state
    if device_memory_gb:
        cap = device_memory_gb * 1e9
        fsdp = planner.predict(n, replace(opts, strategy="fsdp"))
        sharded = state / n + max((b.bytes for b in p.buckets(opts.bucket_cap_mb)), default=0) * 2
        if verdict(int(state), int(cap), n).fsdp:
            add(
                f"FSDP: model state {state / 1e9:.1f} GB does not fit {device_memory_gb:g} GB per device "
                f"(activations not counted); sharded it is {sharded / 1e9:.2f} GB per device",
                fsdp,
                "3 collectives' bytes per step against DDP's 2",
            )
            items.extend(_hsdp(planner, n, opts, state, cap, fsdp, add))
        else:
            items.append(
                {
                    "what": f"memory: model state {state / 1e9:.2f} GB of {device_memory_gb:g} GB per device "
                    "(parameters, gradients, optimizer state; activations not counted): DDP fits, "
                    f"FSDP not needed (it would give {_gain(fsdp, at_n)})",
                    "gain": "",
                    "cost": "",
                }
            )
    return items


def _hsdp(
    planner: Planner, n: int, opts: Options, state: float, cap: float, fsdp: Prediction, add: Any
) -> list[dict[str, Any]]:
    """On several nodes, where FSDP is needed: HSDP (shard inside a node, replicate across nodes), with
    the bytes each node sends over the inter-node link per step against FSDP's, when the node's share of
    the model state fits (`add` appends that item); else a note that it does not fit."""
    layout = planner.cluster(n).layout(replace(opts, strategy="hsdp"))  # the builder's HSDP degrees
    if layout.replicate <= 1:  # one node: HSDP is FSDP
        return []
    shard = layout.shard
    per_device = state / shard
    if per_device > 0.8 * cap:
        what = (
            f"HSDP ({layout.describe()}) would hold {per_device / 1e9:.2f} GB of "
            "model state per device, over 80% of it: FSDP over all ranks"
        )
        return [{"what": what, "gain": "", "cost": ""}]
    hsdp = planner.predict(n, replace(opts, strategy="hsdp"))
    add(
        f"HSDP: shard inside each node ({shard} ranks), replicate across the {layout.replicate} nodes: "
        f"{per_device / 1e9:.2f} GB of model state per device; {hsdp.slow_link_bytes / 1e9:.2f} GB per "
        f"node over the inter-node link per step against FSDP's {fsdp.slow_link_bytes / 1e9:.2f} GB "
        f"(FSDP: {fsdp.step_s * 1e3:.1f} ms/step)",
        hsdp,
        f'model state sharded {shard} ways, not {n} (strategy="hsdp")',
    )
    return []
