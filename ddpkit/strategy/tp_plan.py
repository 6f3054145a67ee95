"""Which layers tensor parallelism splits, and how: a plan read in any of its three forms, checked against
the model and the degree before any collective, and applied (torch's `parallelize_module`, ties kept).

    plan = read(model, "auto", degree=2)                  # a Hugging Face model's own base_model_tp_plan
    plan = read(model, {"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise"}, degree=2)
    plan = read(model, {"up": ColwiseParallel(), "down": RowwiseParallel()}, degree=2)   # torch styles
    apply(model, mesh["tensor"], plan)                     # parallelize_module, tied parameters tied again

Hugging Face keeps a model's plan as strings (`config.base_model_tp_plan` plus the head class's
`_tp_plan`, merged with the base model's prefix in `model.tp_plan`) and applies them with its own layer
classes; ddpkit translates the same strings into torch's styles (`STYLES`), so one mechanism serves every
model, and refuses a style it has no exact translation for, naming the layer. With sequence parallelism
(`read(..., sequence_parallel=True)`) the styles are derived so that the residual stream stays a DTensor
sharded along the sequence between layers (its layout is what ddpkit's one-process dropout reads): row-wise
layers and the embedding give Shard(1), the parent of each column-wise group gathers its input back, every
norm becomes `SequenceParallel`.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy import checkpointing, hf, tp_loss

ALIASES = {
    "sequence": "sequence_parallel",
    "colwise_replicate": "colwise_gather_output",
    "vocab": "embedding_rowwise",
}
KNOWN = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "colwise_rep",
    "rowwise_rep",
    "rowwise_split_input",
    "embedding_rowwise",
    "embedding_colwise",
    "sequence_parallel",
    "replicate",
)
EXAMPLE = (
    '{"blocks.*.attn.q": "colwise", "blocks.*.attn.o": "rowwise", "blocks.*.mlp.up": "colwise", '
    '"blocks.*.mlp.down": "rowwise"}'
)
Plan = dict[str, Any]  # module pattern -> torch ParallelStyle


def _style(name: str, sequence_parallel: bool, loss_parallel: bool = False) -> Any:
    """The torch style for one of transformers' (and ddpkit's) style names; None: left whole. Under loss
    parallel a head that would gather its logits keeps them sharded on the vocabulary (`tp_loss`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    sp = sequence_parallel
    seq = Shard(1)
    table: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel,
        "rowwise": lambda: (
            RowwiseParallel(output_layouts=seq, use_local_output=False) if sp else RowwiseParallel()
        ),
        "colwise_gather_output": lambda: (
            tp_loss.head_style(seq if sp else Replicate())
            if loss_parallel
            else ColwiseParallel(input_layouts=seq if sp else Replicate(), output_layouts=Replicate())
        ),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        # an nn.Embedding row-wise: its vocabulary split, the partial lookups summed (HF's embedding_rowwise)
        "embedding_rowwise": lambda: (
            RowwiseParallel(input_layouts=Replicate(), output_layouts=seq, use_local_output=False)
            if sp
            else RowwiseParallel(input_layouts=Replicate())
        ),
        "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
        "sequence_parallel": lambda: SequenceParallel(use_local_output=not sp),
    }
    return table[name]() if name in table else None


def hf_plan(model: nn.Module) -> dict[str, str]:
    """A Hugging Face model's whole plan with its real prefixes ({} when it has none); inside a PEFT
    model, the wrapped model's plan under its module path ("base_model.model.")."""
    where, hf_model = _hf_model(model)
    plan = dict(getattr(hf_model, "tp_plan", None) or {})
    if not plan:
        config = getattr(hf_model, "config", None)
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        prefix = getattr(hf_model, "base_model_prefix", "")
        inside = bool(prefix) and hasattr(hf_model, prefix)
        plan = {f"{prefix}.{k}" if inside else k: v for k, v in base.items()}
    return {f"{where}.{k}" if where else k: v for k, v in plan.items()}


def _hf_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(its module path, the Hugging Face model) inside `model`: the model itself unless it wraps one
    (a PEFT model holds it at base_model.model)."""
    import sys

    transformers = sys.modules.get("transformers")
    if transformers is None:
        return "", model
    for name, module in model.named_modules():
        if isinstance(module, transformers.PreTrainedModel):
            return name, module
    return "", model


def retarget_adapters(model: nn.Module, plan: Plan) -> Plan:
    """A plan written for a base model applied to its PEFT (LoRA) version: an entry that lands on a LoRA
    layer splits its `base_layer` the same way, and the adapters so that their product is split as the
    base's output is: a column-wise base splits lora_B column-wise (lora_A stays whole), a row-wise base
    splits lora_A row-wise (lora_B whole: its input, lora_A's partial output, is reduced first)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    found = matches(model, plan)
    lora = {n for n in found if hasattr(model.get_submodule(n), "base_layer")}
    if not lora:
        return plan
    out: Plan = {p: s for p, s in plan.items() if any(found[n] == p for n in found if n not in lora)}
    for name in sorted(lora):
        style, layer = plan[found[name]], model.get_submodule(name)
        out[f"{name}.base_layer"] = style
        for adapter in getattr(layer, "lora_A", {}):
            if isinstance(style, ColwiseParallel):
                out[f"{name}.lora_B.{adapter}"] = ColwiseParallel()
            elif isinstance(style, RowwiseParallel):
                out[f"{name}.lora_A.{adapter}"] = RowwiseParallel()
    return out


def read(
    model: nn.Module,
    plan: str | Mapping[str, Any],
    *,
    degree: int,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
) -> Plan:
    """{module pattern: torch ParallelStyle} from "auto", a short mapping or torch styles; refused with
    the fix: no plan, an unknown style, an entry that matches no module, a layer torch cannot split that
    way, features or heads that do not divide the degree, tied weights split two ways."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan == "auto":
        written: Mapping[str, Any] = hf_plan(model)
        if not written:
            raise problem(
                f"the {type(model).__name__} has no tensor-parallel plan of its own (only Hugging Face "
                "models with config.base_model_tp_plan do), so ddpkit does not know which layers to split",
                f"Pass TPOptions(plan={{...}}) naming each layer, e.g. plan={EXAMPLE}",
            )
    elif isinstance(plan, Mapping):
        written = plan
    else:
        raise problem(f"plan={plan!r} is not 'auto' or a mapping", f"Pass plan='auto' or e.g. {EXAMPLE}")
    out: Plan = {}
    names: dict[str, str] = {}
    for pattern, style in written.items():
        if isinstance(style, ParallelStyle):
            out[pattern] = style
            continue
        name = ALIASES.get(style, style) if isinstance(style, str) else style
        if name not in KNOWN:
            raise problem(
                f"the plan gives {pattern!r} the style {style!r}, which ddpkit does not know",
                f"Use one of {', '.join(sorted({*KNOWN, *ALIASES}))}, or a torch ParallelStyle "
                "(torch.distributed.tensor.parallel.ColwiseParallel(...), ...)",
            )
        names[pattern] = name
        made = _style(name, sequence_parallel, loss_parallel)
        if made is not None:
            out[pattern] = made
    if sequence_parallel and names:
        out.update(_sequence_extras(model, names))
    out = retarget_adapters(model, out)
    check(model, out, degree)
    if loss_parallel:
        tp_loss.heads(model, matches(model, out), out)  # a plan with no sharded head refused
    return out


def gather_sequence() -> Any:
    """The style of a column-wise group's parent under sequence parallelism: its input (first positional
    or `hidden_states=`, as Hugging Face's attention takes it), a DTensor sharded along the sequence,
    gathered whole (Replicate) before the split layers read it."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ParallelStyle

    class _Gather(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def whole(x: Any) -> Any:
                if isinstance(x, DTensor) and not all(p.is_replicate() for p in x.placements):
                    return x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
                return x

            def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                if args:
                    return (whole(args[0]), *args[1:]), kwargs
                if "hidden_states" in kwargs:
                    return args, {**kwargs, "hidden_states": whole(kwargs["hidden_states"])}
                return args, kwargs

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

    return _Gather()


def _sequence_extras(model: nn.Module, names: Mapping[str, str]) -> Plan:
    """What sequence parallelism adds to a plan of style names: the parents of column-wise layers gather
    their input; every norm not in the plan becomes SequenceParallel (a norm left whole would see a
    DTensor it cannot multiply: torch stops at the first forward, never silently). Keyed by the names
    without activation checkpointing's wrappers, as the plan's own entries are."""
    from torch.distributed.tensor.parallel import SequenceParallel

    found = matches(model, names)
    parents = sorted({n.rpartition(".")[0] for n, p in found.items() if names[p] == "colwise"})
    extras: Plan = {_plain_module(p): gather_sequence() for p in parents if p}
    for name, module in model.named_modules():
        if name and name not in found and _is_norm(module):
            extras[_plain_module(name)] = SequenceParallel(use_local_output=False)
    return extras


def matches(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, str]:
    """{module name: the first pattern naming it} (fnmatch over dotted names, as parallelize_module reads
    "*"; over the names without activation checkpointing's wrappers)."""
    found: dict[str, str] = {}
    for name, _ in model.named_modules():
        plain = _plain_module(name)
        for pattern in plan:
            if fnmatch.fnmatchcase(plain, pattern):
                found.setdefault(name, pattern)
    return found


def _plain_module(name: str) -> str:
    """A module's name without activation checkpointing's wrapper segments: a plan names the model's own
    layers ("blocks.*.attn.q"), whether or not `s.model(activation_checkpointing=...)` wrapped them."""
    return checkpointing.plain_name(f"{name}.").removesuffix(".") if name else name


def check(model: nn.Module, plan: Plan, degree: int) -> None:
    """Every refusal that can be made from the model's structure, before any collective."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    found = matches(model, plan)
    for pattern in plan:
        if pattern not in found.values():
            layers = sorted(
                {_wild(n) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
            )
            shown = ", ".join(layers[:8]) + (", ..." if len(layers) > 8 else "")
            raise problem(
                f"the tensor-parallel plan names {pattern!r}, which matches no module of the "
                f"{type(model).__name__}, so that layer would stay whole while its partners are split",
                f"Name a module (its linear and embedding layers: {shown}), or remove the entry",
            )
    for name, pattern in found.items():
        module, style = model.get_submodule(name), plan[pattern]
        split = isinstance(style, (ColwiseParallel, RowwiseParallel))
        if split and not isinstance(module, (nn.Linear, nn.Embedding)):
            raise problem(
                f"the plan splits {name!r} {_kind(style)}, but it is a {type(module).__name__}: torch splits "
                "only nn.Linear and nn.Embedding that way",
                f"Name the Linear inside it (e.g. a LoRA layer's {name}.base_layer), or give it "
                "sequence_parallel",
            )
        if isinstance(module, nn.Linear) and split:
            colwise = isinstance(style, ColwiseParallel)
            features = module.out_features if colwise else module.in_features
            what = "output" if colwise else "input"
            if features % degree:
                raise problem(
                    f"{name!r} has {features} {what} features, which do not split over the tensor-parallel "
                    f"degree {degree} ({_kind(style)}: each rank holds {what}_features / {degree})",
                    f"Choose a degree that divides {features}, or leave {name!r} out of the plan",
                )
    check_heads(model, degree)
    check_ties(model, plan)


def check_heads(model: nn.Module, degree: int) -> None:
    """Attention heads are split whole (a Hugging Face config says how many): each rank needs a whole
    number of query and key/value heads."""
    config: Any = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    for field, count in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if count % degree:
            fits = max(d for d in range(1, degree + 1) if count % d == 0)
            raise problem(
                f"the {type(model).__name__} has {count} heads (config.{field}), which do not split over "
                f"the tensor-parallel degree {degree}: its q/k/v projections are split by whole heads, so "
                f"each rank needs {count}/{degree} of them",
                f"Choose a degree that divides {count} (e.g. tensor={fits}), and put the other ranks in "
                "the data dimensions",
            )


def tp_dims(model: nn.Module, plan: Plan) -> dict[str, int | None]:
    """{parameter name: the dimension the plan splits it on over the tensor ranks, or None (whole)} for
    every parameter a style places (Colwise: Linear dim 0, Embedding dim 1; Rowwise: Linear weight dim 1,
    its bias whole, Embedding dim 0; other styles whole), every name a tied parameter has; names as
    `state_dict` gives them (no activation checkpointing wrapper), as ddpkit's shards are keyed."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, int | None] = {}
    found = matches(model, plan)
    for name, module in model.named_modules(remove_duplicate=False):
        style = plan.get(found[name]) if name in found else None
        embedding = isinstance(module, nn.Embedding)
        for attr in module._parameters:
            full = checkpointing.plain_name(f"{name}.{attr}" if name else attr)
            if isinstance(style, ColwiseParallel):
                out[full] = 1 if embedding else 0
            elif isinstance(style, RowwiseParallel):
                out[full] = 0 if embedding else (None if attr == "bias" else 1)
            else:
                out.setdefault(full, None)
    return out


def check_ties(model: nn.Module, plan: Plan) -> None:
    """Tied parameters (an embedding and its head) must be split the same way, or they come apart."""
    dims = tp_dims(model, plan)
    for owners in hf.tied_owners(model).values():
        names = [f"{m}.{a}" if m else a for m, a in owners]
        if len({dims.get(n) for n in names}) > 1:
            how = "; ".join(f"{n}: {_dim_text(dims.get(n))}" for n in names)
            raise problem(
                f"the tied parameters {', '.join(names)} (one weight) would be split in different ways "
                f"({how}), so they could not stay one weight",
                "Split both the same way (an embedding 'embedding_rowwise' with its head 'colwise': both "
                "by rows), or untie them in the model's config (tie_word_embeddings=False)",
            )


def apply(model: nn.Module, mesh: Any, plan: Plan) -> nn.Module:
    """parallelize_module over the tensor mesh, then every tie made again: torch's styles replace each
    module's parameter with a new DTensor parameter, so `lm_head.weight is embed.weight` would no longer
    hold and the head would train a copy (measured 70% off one process's gradient, without an error)."""
    from torch.distributed.tensor.parallel import parallelize_module

    ties = list(hf.tied_owners(model).values())
    found = matches(model, plan)  # each module by its real name: the patterns may skip wrappers
    parallelize_module(model, mesh, {name: plan[pattern] for name, pattern in found.items()})
    retie(model, ties)
    return model


def retie(model: nn.Module, ties: list[list[tuple[str, str]]]) -> None:
    """Each group of tied (module, attribute) pairs made one parameter again: the first owner's."""
    for owners in ties:
        (first, attr), rest = owners[0], owners[1:]
        shared = model.get_submodule(first)._parameters[attr]
        for name, other in rest:
            setattr(model.get_submodule(name), other, shared)


def column_layers(model: nn.Module, plan: Plan) -> tuple[list[str], list[str]]:
    """(column-wise layers whose output is a plain local shard, row-wise layers): between the two a
    tensor is a shard torch no longer knows the layout of (what the one-process dropout refuses in)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    cols, rows = [], []
    for name, pattern in matches(model, plan).items():
        style = plan[pattern]
        if isinstance(style, ColwiseParallel) and style.use_local_output:
            if isinstance(style.output_layouts[0], Shard):
                cols.append(name)
        elif isinstance(style, RowwiseParallel):
            rows.append(name)
    return cols, rows


def describe(model: nn.Module, plan: str | Mapping[str, Any]) -> str:
    """How the start-up line names the plan: "LlamaForCausalLM's own" or "7 entries"."""
    if plan == "auto":
        return f"{type(model).__name__}'s own"
    return f"{len(plan)} entries"


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Norm") or isinstance(module, (nn.LayerNorm, nn.RMSNorm))


def _wild(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _kind(style: Any) -> str:
    return "column-wise" if type(style).__name__.startswith("Colwise") else "row-wise"


def _dim_text(dim: int | None) -> str:
    return "whole" if dim is None else f"split on dim {dim}"


def guard_shapes(model: nn.Module, plan: Plan) -> None:
    """A shape error inside a linear or embedding layer of a TP model re-raised as one paragraph naming
    the layer and how the plan splits it: torch's own message names neither (a row-wise layer given
    column-wise fails inside its matmul with "a and b must have same reduction dim")."""
    found = matches(model, plan)
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            style = plan.get(found[name]) if name in found else None
            module.forward = _guarded(module.forward, name, style)  # type: ignore[method-assign]


def _guarded(forward: Callable[..., Any], name: str, style: Any) -> Callable[..., Any]:
    how = "left whole" if style is None else f"split {type(style).__name__}"

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return forward(*args, **kwargs)
        except RuntimeError as err:
            if not _shape_error(err):
                raise
            raise problem(
                f"the forward of {name!r} ({how} by the tensor-parallel plan) failed: {str(err).strip()}. "
                "Its input is not what its style expects: a layer between a column-wise and a row-wise one "
                "is split the wrong way, or missing from the plan (each column-wise layer's output must "
                "reach a row-wise layer)",
                "Compare the plan with the model's forward: q/k/v and gate/up column-wise, the projection "
                "after them (o, down) row-wise",
            ) from err

    return run


def _shape_error(err: RuntimeError) -> bool:
    text = str(err)
    return any(k in text for k in ("shape", "size", "reduction dim", "mat1 and mat2", "must match"))
