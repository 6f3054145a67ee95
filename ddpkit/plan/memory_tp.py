"""Tensor parallelism in the memory plan: rank 0's model split as the plan splits it, on fake tensors.

    job = MemoryJob(model="hf:llama,...", strategy="tp", world=8, other_degrees=(("tensor", 2),), ...)
    estimate(job)     # ddpkit.plan.memory: prepares the rank with `prepare` below, then one tracked step

The session's own steps, in its order (`ddpkit.strategy.tp.TP._shard`): the plan read and checked
(`tp_plan.read`: "auto" is a Hugging Face model's own `base_model_tp_plan`), the layers split over the
mesh's tensor dimension (`tp_plan.apply`, torch's `parallelize_module`: column-wise layers keep 1/T of
their rows, row-wise 1/T of their columns, norms and the layers the plan does not name stay whole), then
FSDP2 over the data dimensions (replicate x shard) with the session's units. So the parameters,
gradients and optimizer state a rank holds, and the activations of its step (a column-wise layer's
output is 1/T of the features; with sequence parallelism the norms' inputs 1/T of the sequence), come
from the same DTensor placements a session has, not from a formula.

Why it needs a hand: FSDP2 over a DTensor parameter joins the data mesh and the tensor mesh into one
(`DeviceMesh._concatenate`), which indexes the mesh's rank tensor, a real (non-fake) integer tensor of
`world` entries; under `FakeTensorMode` that op is refused ("Please convert all Tensors to
FakeTensors"). `real_mesh_ops` runs that one call outside the fake mode: the rank map is the only real
tensor it touches, and nothing of the model is allocated for real.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ddpkit.errors import problem
from ddpkit.parallel.layout import Layout

AUTO = "auto"
# Why a tensor-parallel estimate runs one whole untracked step before the tracked one (a data-parallel
# estimate only warms the optimizer): the first step over DTensors is not the steady step. Measured on
# the 64-256-128-16 MLP of tests/test_shapes_plan.py at micro-batch 8, TP(2): the first fake step's
# peak 605,600 B, the second's 564,056 B, and the real ranks' second step 564,056 B tracked (564,084 B
# at torch's CPU allocator); real ranks are measured at their second step too.
WARM = "one untracked step"


def plan_of(text: str) -> str | Mapping[str, Any]:
    """A plan as `--tp-plan` gives it: "auto", a JSON mapping ('{"0": "colwise", "2": "rowwise"}'), or
    package.module:NAME naming a mapping (its values style names or torch ParallelStyles)."""
    if text == AUTO:
        return AUTO
    if text.lstrip().startswith("{"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as err:
            raise problem(
                f"--tp-plan {text!r} is not valid JSON: {err}",
                "Write it as a JSON object, e.g. --tp-plan "
                '\'{"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}\'',
            ) from err
        if not isinstance(loaded, dict):
            raise problem(f"--tp-plan {text!r} is not a JSON object", "Pass {module pattern: style, ...}")
        return loaded
    from ddpkit.plan.memory_models import import_ref

    found = import_ref(text, "tp plan")
    if not isinstance(found, Mapping):
        raise problem(
            f"--tp-plan {text} is a {type(found).__name__}, not a mapping of module patterns to styles",
            "Name a dict {module pattern: style}, or pass auto or a JSON object",
        )
    return found


@contextlib.contextmanager
def real_mesh_ops() -> Iterator[None]:
    """FSDP2's join of the data and tensor meshes run outside the fake mode (see the module's text);
    restored after."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh._concatenate

    def concatenate(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return original(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        DeviceMesh._concatenate = staticmethod(original)  # type: ignore[method-assign]


def prepare(
    model: nn.Module,
    layout: Layout,
    mesh: Any,
    plan: str | Mapping[str, Any],
    sequence_parallel: bool,
    policy: Any,
) -> str:
    """Rank 0's model as a tensor-parallel session makes it: split by the plan over the tensor
    dimension, FSDP2 over the data dimensions; the plan's refusals (no plan, a layer that does not
    divide the degree) as the session's. Returns how many modules the plan split, for the step line."""
    from ddpkit.strategy import TPOptions, fsdp_units, tp_plan

    options = TPOptions(tensor=layout.tensor, plan=plan, sequence_parallel=sequence_parallel)
    styles = tp_plan.read(model, options.plan, degree=layout.tensor, sequence_parallel=sequence_parallel)
    split = len(tp_plan.matches(model, styles))
    tp_plan.apply(model, mesh["tensor"], styles)
    fsdp = options.fsdp()
    with real_mesh_ops():
        fsdp_units.shard(
            model,
            fsdp_units.choose_units(model, fsdp),
            mesh=mesh["replicate", "shard"],
            mp_policy=policy,
            reshard_after_forward=fsdp.reshard_after_forward,
        )
    return f"{split} module(s) split over tensor {layout.tensor}"
