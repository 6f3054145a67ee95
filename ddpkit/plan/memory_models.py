"""What `ddpkit plan --memory` builds and feeds: a model's factory, a micro-batch of its inputs, its loss.

    spec = memory_models.resolve("hf:gpt2,n_layer=2", seq_len=128)
    model = spec.build(); loss = spec.loss(model, spec.batch(8))

The same three are used by the estimate on fake tensors (`ddpkit.plan.memory`) and by the real ranks
that validate it (benchmarks/plan_memory.py), so both run exactly one step of one model.
Accepted: a named workload (`ddpkit.tools.workloads`: its sample and loss), "hf:TYPE[,key=value...]" or
"hf:PATH" (a transformers causal LM from its config, offline: `AutoConfig.for_model(TYPE)` gives the
type's default configuration, e.g. GPT-2 124M; input_ids of the sequence length, labels = input_ids),
"package.module:function" returning an nn.Module (with a `sample`) or a Workload, or the factory itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.errors import problem


def import_ref(ref: Any, what: str) -> Any:
    """A "package.module:function" imported here, or the object itself."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise problem(
            f"{what} {ref!r} is not of the form package.module:function", f"Pass e.g. mypkg.train:{what}"
        )
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise problem(f"cannot load {what} {ref!r}: {err}", "Check the module path and PYTHONPATH") from err
    return obj


def cross_entropy(model: nn.Module, batch: Any) -> torch.Tensor:
    """(inputs, targets) batches: the mean cross-entropy of the model's output."""
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@dataclass(frozen=True)
class ModelSpec:
    """A model's factory, how to draw a micro-batch of it, and its loss."""

    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int], Any]  # micro-batch size -> batch (called under the fake mode)
    loss: Callable[[nn.Module, Any], torch.Tensor]


def _hf(spec: str, seq_len: int | None) -> ModelSpec:
    try:
        import transformers
    except ImportError as err:
        raise problem("an hf: model needs transformers", "pip install transformers") from err
    head, *pairs = spec.removeprefix("hf:").split(",")
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise problem(f"{pair!r} in {spec!r} is not key=value", "Write e.g. hf:gpt2,n_layer=2,n_embd=128")
        try:
            overrides[key] = int(value)
        except ValueError:
            try:
                overrides[key] = float(value)
            except ValueError:
                overrides[key] = value
    try:
        if "/" in head or head.endswith(".json"):
            cfg = transformers.AutoConfig.from_pretrained(head, local_files_only=True, **overrides)
        else:
            cfg = transformers.AutoConfig.for_model(head, **overrides)
    except (OSError, ValueError) as err:
        raise problem(
            f"cannot read the transformers config {head!r}: {err}",
            "Pass a model type (hf:gpt2, hf:llama,...) or a local config.json / directory",
        ) from err
    seq = _sequence(cfg, head, seq_len)

    def build() -> nn.Module:
        return transformers.AutoModelForCausalLM.from_config(cfg)

    return ModelSpec(
        f"{head} (transformers, from its config; sequence {seq})", build, _token_batch(cfg, seq), _lm_loss
    )


def _sequence(cfg: Any, name: str, seq_len: int | None) -> int:
    """The sequence length a transformers model is planned at: asked, else its positions."""
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    seq = seq_len or positions
    if seq is None:
        raise problem(f"the {name} config states no maximum sequence length", "Pass --seq-len")
    if positions and seq > positions:
        raise problem(
            f"sequence {seq} is longer than the model's {positions} positions", f"Pass --seq-len {positions}"
        )
    return seq


def _token_batch(cfg: Any, seq: int) -> Callable[[int], Any]:
    """input_ids of the sequence length over the config's vocabulary (labels = the same ids)."""

    def batch(n: int) -> Any:
        return torch.randint(0, cfg.vocab_size, (n, seq))

    return batch


def _lm_loss(model: nn.Module, ids: Any) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _hf_config(made: nn.Module) -> Any:
    """The config of a transformers language model (it states its vocabulary), else None."""
    cfg = getattr(made, "config", None)
    is_pretrained = any(c.__name__ == "PreTrainedModel" for c in type(made).__mro__)
    return cfg if is_pretrained and getattr(cfg, "vocab_size", None) else None


def _workload(wl: Any, seq_len: int | None) -> ModelSpec:
    if seq_len is not None:
        raise problem(
            f"the {wl.name} workload fixes its own input shape; --seq-len does not apply",
            "Leave --seq-len out, or pass a model factory whose sequence length you set",
        )
    g = torch.Generator().manual_seed(0)

    def batch(n: int) -> Any:
        return wl.sample(g, n)

    return ModelSpec(f"workload {wl.name}", wl.build, batch, wl.step_loss)


def _module(name: str, build: Callable[[], nn.Module], sample: Any) -> ModelSpec:
    if sample is None:
        raise problem(
            f"{name} returns a plain nn.Module: ddpkit cannot know its inputs",
            "Pass --sample package.module:function, a function (generator, n) -> (inputs, targets) "
            "(cross-entropy loss), or return a ddpkit.tools.workloads.Workload",
        )
    draw = import_ref(sample, "sample")
    g = torch.Generator().manual_seed(0)
    return ModelSpec(name, build, lambda n: draw(g, n), cross_entropy)


def resolve(spec: Any, *, seq_len: int | None = None, sample: Any = None) -> ModelSpec:
    """What `spec` names, as a factory, a batch and a loss (nothing is built yet)."""
    from ddpkit.tools import workloads

    if callable(spec):
        return _module(getattr(spec, "__qualname__", "model"), spec, sample)
    if spec.startswith("hf:"):
        return _hf(spec, seq_len)
    if spec in workloads.NAMED:
        return _workload(workloads.NAMED[spec], seq_len)
    module_name, sep, attr = spec.partition(":")
    if not sep:
        raise problem(
            f"model {spec!r} is neither a workload ({', '.join(workloads.NAMED)}), hf:TYPE nor "
            "package.module:function",
            "Pass e.g. --model mypkg.models:make_net or --model hf:gpt2",
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise problem(f"cannot load model {spec!r}: {err}", "Check the module path and PYTHONPATH") from err
    holder: dict[str, Any] = {}

    def build() -> nn.Module:  # called under the fake mode: a Workload's factory or the module itself
        made = fn()
        if isinstance(made, workloads.Workload):
            holder["workload"] = made
            return made.build()
        if not isinstance(made, nn.Module):
            raise problem(f"{spec} returned {type(made).__name__}", "Return an nn.Module or a Workload")
        cfg = _hf_config(made)
        if cfg is not None:  # a transformers model: its config says its inputs, as hf:TYPE's does
            holder["batch"] = _token_batch(cfg, _sequence(cfg, spec, seq_len))
        return made

    if sample is None:  # maybe a Workload or a transformers model: its own inputs and loss

        def batch(n: int) -> Any:
            if "batch" in holder:
                return holder["batch"](n)
            if "workload" not in holder:
                raise problem(
                    f"{spec} returns a plain nn.Module: ddpkit cannot know its inputs",
                    "Pass --sample package.module:function, (generator, n) -> (inputs, targets)",
                )
            return holder["workload"].sample(torch.Generator().manual_seed(0), n)

        def loss(model: nn.Module, b: Any) -> torch.Tensor:
            if "batch" in holder:
                return _lm_loss(model, b)
            return holder["workload"].step_loss(model, b)

        return ModelSpec(spec, build, batch, loss)
    return _module(spec, build, sample)


def parameter_count(spec: ModelSpec) -> int:
    """Parameters of the model (built on fake tensors: no memory)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = spec.build()
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
