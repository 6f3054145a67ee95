"""What tensor parallelism sends per sample: the activation collectives of each split layer, forward and
backward, read from the model and its plan on fake tensors (no device, no process group).

    fwd, bwd = collectives("gpt", plan, degree=2)       # ((kind, bytes per sample), ...) each
    Options(strategy="tp", tensor=2, tp_forward=fwd, tp_backward=bwd)   # ddpkit.plan.simulate

Megatron-LM's pattern, as torch's styles run it (`ColwiseParallel`, `RowwiseParallel`; Shoeybi et al.
2019, section 3): a row-wise layer's output is a partial sum on every tensor rank, all-reduced in the
forward; a column-wise layer's input is replicated, so the gradient of that input is a partial sum,
all-reduced in the backward (once per input: q, k and v read one tensor); a column-wise layer that
gathers its output (`colwise_gather_output`, a head) all-gathers it in the forward. With sequence
parallelism each all-reduce becomes a reduce-scatter and an all-gather of the same tensor (the row-wise
output reduce-scattered along the sequence, the column-wise input all-gathered; the backward the
mirror), the same bytes on a ring. The sizes are those of one sample in the model's own dtype: the
planner multiplies by the per-rank batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.errors import problem

Collective = tuple[str, float]  # ("allreduce" | "allgather" | "reduce_scatter", bytes per sample)


def collectives(
    spec: Any,
    plan: str | Mapping[str, Any],
    *,
    degree: int,
    sequence_parallel: bool = False,
    sample: Any = None,
) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, backward) collectives of one sample through the model `spec` names (a workload,
    hf:..., package.module:function; a plain module with its `sample`) split by `plan` over `degree`
    ranks; the plan's refusals (no plan, a layer that does not divide) as a session's."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ddpkit.plan import memory_models
    from ddpkit.strategy import tp_plan

    model_spec = memory_models.resolve(spec, sample=sample)
    forward: list[Collective] = []
    backward: list[Collective] = []
    # a column-wise input reduced once, however many layers read it (held: an id is not reused)
    seen: dict[int, Any] = {}

    def hook(style: Any) -> Any:
        def record(module: Any, args: tuple[Any, ...], out: Any) -> None:
            x = args[0] if args else None
            if isinstance(style, RowwiseParallel) and isinstance(out, torch.Tensor):
                size = float(out.numel() * out.element_size())
                forward.append(("reduce_scatter" if sequence_parallel else "allreduce", size))
                if sequence_parallel:
                    backward.append(("allgather", size))
            elif isinstance(style, ColwiseParallel) and isinstance(x, torch.Tensor) and x.is_floating_point():
                gathered = any(isinstance(p, Replicate) for p in _layouts(style))
                if gathered and isinstance(out, torch.Tensor):
                    forward.append(("allgather", float(out.numel() * out.element_size())))
                if id(x) not in seen:
                    seen[id(x)] = x
                    size = float(x.numel() * x.element_size())
                    backward.append(("reduce_scatter" if sequence_parallel else "allreduce", size))
                    if sequence_parallel:
                        forward.append(("allgather", size))

        return record

    with FakeTensorMode(allow_non_fake_inputs=False):
        model = model_spec.build()
        styles = tp_plan.read(model, plan, degree=degree, sequence_parallel=sequence_parallel)
        for name, pattern in tp_plan.matches(model, styles).items():
            model.get_submodule(name).register_forward_hook(hook(styles[pattern]))
        with torch.no_grad():
            model_spec.loss(model, model_spec.batch(1))
    return tuple(forward), tuple(backward)


def _layouts(style: Any) -> tuple[Any, ...]:
    """A column-wise style's output layouts (torch keeps them as a tuple)."""
    out = getattr(style, "output_layouts", ())
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def add_arguments(p: Any) -> None:
    """`ddpkit plan`'s tensor-parallel flags (the same names as `plan --memory`'s)."""
    p.add_argument(
        "--tensor-degree",
        type=int,
        default=None,
        help="tp: ranks that split each layer (default: a node's); each N is then data ranks x this",
    )
    p.add_argument(
        "--tp-plan",
        default="auto",
        metavar="auto|JSON|MODULE:NAME",
        help="tp: which layers split how (as plan --memory's --tp-plan)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="tp: norms split along the sequence")


def options(ns: Any, spec: Any, counts: list[int], per_node: int) -> tuple[dict[str, Any], list[int]]:
    """The simulator's tensor-parallel options from the flags ({} without tp), and the device counts
    the plan shows: 1 (the one-device base) and the multiples of the tensor degree."""
    given = ns.tensor_degree is not None or ns.tp_plan != "auto" or ns.sequence_parallel
    if ns.strategy != "tp":
        if given:
            raise problem(
                f"--tensor-degree, --tp-plan and --sequence-parallel are tensor parallelism's, not "
                f"{ns.strategy}'s",
                "Pass --strategy tp with them, or leave them out",
            )
        return {}, counts
    from ddpkit.plan.memory_tp import plan_of

    degree = ns.tensor_degree or per_node
    if degree < 1:
        raise problem(f"--tensor-degree {degree} is below 1", "Pass --tensor-degree 2 or more")
    if ns.counts:
        bad = [n for n in counts if n > 1 and n % degree]
        if bad:
            raise problem(
                f"device counts {bad} do not split into tensor groups of {degree}",
                f"Pass --counts of multiples of {degree}, or another --tensor-degree",
            )
    kept = [n for n in counts if n == 1 or n % degree == 0]
    fwd, bwd = collectives(spec, plan_of(ns.tp_plan), degree=degree, sequence_parallel=ns.sequence_parallel)
    return {"tensor": degree, "tp_forward": fwd, "tp_backward": bwd}, kept


def section(opts: Any) -> dict[str, Any]:
    """What the plan reports of tensor parallelism: the degree and each collective per sample."""
    return {
        "tensor_degree": opts.tensor,
        "forward": [{"kind": k, "bytes_per_sample": b} for k, b in opts.tp_forward],
        "backward": [{"kind": k, "bytes_per_sample": b} for k, b in opts.tp_backward],
    }
