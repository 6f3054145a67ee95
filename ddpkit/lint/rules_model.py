"""Rules about building and wrapping the model: DDP001, DDP002, DDP004, DDP010, DDP011, DDP012, DDP014."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from ddpkit.lint.models import contains_layer, origin, static_module
from ddpkit.lint.optimizers import (
    binding,
    helper_optimizers,
    model_texts,
    optimizer_params,
    optimizers_by_model,
    translate,
)
from ddpkit.lint.rule import Rule
from ddpkit.lint.script import Script, is_const, kwarg, last, unparse

Found = Iterator[tuple[ast.AST, str]]
_REPLACING = ("FullyShardedDataParallel", "FSDP", "fully_shard")
_BATCHNORMS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "BatchNorm", "LazyBatchNorm2d")
_HALF = ("torch.bfloat16", "torch.float16", "torch.half")


def _replaced(script: Script, call: ast.Call) -> tuple[set[str], str]:
    """The texts of the modules whose parameters `call` replaces (FSDP, fully_shard, s.model, or a
    file-local helper that does one of them to its argument or to `self.model`), and how."""
    if script.session_call(call, "model") or last(script.callee(call)) in _REPLACING:
        how = "s.model" if script.session_call(call, "model") else last(script.callee(call))
        return ({unparse(call.args[0])} if call.args else set()), how
    texts: set[str] = set()
    for fn in script.local_callees(call):
        bound = binding(script, call, fn)
        for inner in script.calls(fn):
            if inner.args and (
                script.session_call(inner, "model") or last(script.callee(inner)) in _REPLACING
            ):
                texts.add(translate(unparse(inner.args[0]), bound))
    return texts - {""}, unparse(call.func)


def optimizer_before_wrap(script: Script) -> Found:
    optimizers = [*optimizer_params(script), *helper_optimizers(script)]
    for opt, text in optimizers:
        for call in script.calls():
            if call is opt or not script.after(call, opt):
                continue
            replaced, how = _replaced(script, call)
            if text in replaced:
                yield (
                    opt,
                    f"`{text}.parameters()` went to the optimizer before `{how}({text})`, line {call.lineno}",
                )
            elif (
                isinstance(call.func, ast.Attribute)
                and call.func.attr == "to_empty"
                and unparse(call.func.value) == text
            ):
                yield (
                    opt,
                    f"`{text}.to_empty(...)` (line {call.lineno}) allocates new parameters",
                )


def batchnorm_per_rank(script: Script) -> Found:
    if not script.multi_rank or script.mentions("SyncBatchNorm") or script.mentions("convert_sync_batchnorm"):
        return
    for wrap in script.wraps:
        if not wrap.args:
            continue
        sync = script.keyword(wrap, "sync_batchnorm")
        if sync is not None and not is_const(sync, False):
            continue
        built = origin(script, wrap.args[0])
        if built is not None and contains_layer(script, built, _BATCHNORMS):
            yield (
                wrap,
                f"`{unparse(wrap.args[0])}` holds BatchNorm layers, normalised per rank on 1/N of the batch",
            )


def _roots(script: Script, wrap: ast.Call) -> set[str]:
    roots = {unparse(wrap.args[0])} if wrap.args and not isinstance(wrap.args[0], ast.Call) else set()
    stmt = script.parents.get(wrap)
    if isinstance(stmt, ast.Assign):
        for t in stmt.targets:
            roots |= {unparse(t), unparse(t) + ".module"}
    return roots


def _under(text: str, roots: set[str]) -> bool:
    return any(text == r or text.startswith(r + ".") or text.startswith(r + "[") for r in roots)


def _param_loop_var(node: ast.AST, roots: set[str]) -> str:
    """`p` in `for p in model.parameters()` (or `for name, p in model.named_parameters()`)."""
    it = node.iter if isinstance(node, ast.For) else None
    if not (isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute)):
        return ""
    if it.func.attr not in ("parameters", "named_parameters") or not _under(unparse(it.func.value), roots):
        return ""
    return unparse(node.target.elts[-1] if isinstance(node.target, ast.Tuple) else node.target)  # type: ignore[attr-defined]


def _false(node: ast.AST | None, falsy: set[str] | frozenset[str]) -> bool:
    return is_const(node, False) or (isinstance(node, ast.Name) and node.id in falsy)


def _change(
    node: ast.AST, roots: set[str], loop_vars: set[str], falsy: set[str] | frozenset[str] = frozenset()
) -> str:
    """What `node` does to the wrapped model's parameters, or ''. `falsy`: names that hold False
    (a helper's `trainable` parameter, called with False)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "requires_grad_"
    ):
        owner = unparse(node.func.value)
        frozen = node.args and _false(node.args[0], falsy)
        return f"`{unparse(node)}`" if frozen and (_under(owner, roots) or owner in loop_vars) else ""
    if not isinstance(node, ast.Assign):
        return ""
    for t in node.targets:
        if not isinstance(t, ast.Attribute):
            continue
        owner = unparse(t.value)
        if (
            t.attr == "requires_grad"
            and _false(node.value, falsy)
            and (_under(owner, roots) or owner in loop_vars)
        ):
            return f"`{unparse(t)} = {unparse(node.value)}`"
        if (
            t.attr not in ("data", "grad", "requires_grad")
            and _under(unparse(t), roots)
            and _constructs(node.value)
        ):
            return f"`{unparse(t)} = {unparse(node.value.func)}(...)`"  # type: ignore[attr-defined]
    return ""


def changed_after_wrap(script: Script) -> Found:
    """Only for a model an optimizer trains: a wrapped copy that is never trained (DINO's EMA teacher,
    wrapped for SyncBatchNorm, then frozen) never back-propagates, so nothing waits for its gradients."""
    trained = optimizers_by_model(script).keys()
    for wrap in script.wraps:
        roots = _roots(script, wrap)
        if not roots & trained:
            continue
        later = [n for n in ast.walk(script.scope(wrap)) if hasattr(n, "lineno") and script.after(n, wrap)]
        loop_vars = {v for v in (_param_loop_var(n, roots) for n in later) if v}
        for node in later:
            change = _change(node, roots, loop_vars) if roots else ""
            if not change and isinstance(node, ast.Call) and roots:
                change = _change_in_helper(script, node, roots)
            if change:
                yield node, f"{change} after `{unparse(wrap.func)}(...)` (line {wrap.lineno})"


def _change_in_helper(script: Script, call: ast.Call, roots: set[str]) -> str:
    """A file-local helper called with the wrapped model that freezes or replaces its parameters
    (`set_backbone_trainable(model.module, False)`), one call deep."""
    for fn in script.local_callees(call):
        bound = binding(script, call, fn)
        inner_roots = {p for p, text in bound.items() if _under(text, roots)} | {
            r for r in roots if r.startswith("self.")
        }
        if not inner_roots:
            continue
        falsy = {p for p, text in bound.items() if text == "False"}
        inner = list(ast.walk(fn))
        loop_vars = {v for v in (_param_loop_var(n, inner_roots) for n in inner) if v}
        for node in inner:
            change = _change(node, inner_roots, loop_vars, falsy)
            if change:
                return f"`{unparse(call)}` (its {change}, line {node.lineno})"  # type: ignore[attr-defined]
    return ""


def _constructs(value: ast.AST) -> bool:
    """A call that builds a module or parameter: `nn.Linear(...)`, `Parameter(...)`, `Head(...)`."""
    while (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Attribute)
        and value.func.attr in ("to", "cuda")
    ):
        value = value.func.value  # nn.Linear(4, 4).to(device)
    return isinstance(value, ast.Call) and last(unparse(value.func))[:1].isupper()


def _half(script: Script, dtype: ast.AST) -> bool:
    """torch.bfloat16/float16/half, or a name assigned one of them (also picked from a table:
    `dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]`)."""
    if script.qualname(dtype) in _HALF:
        return True
    value = script.value_of(dtype)
    return value is not dtype and any(script.qualname(n) in _HALF for n in ast.walk(value))  # type: ignore[arg-type]


def cast_with_fp32_optimizer(script: Script) -> Found:
    optimizers = optimizers_by_model(script)
    if not optimizers:
        return
    texts = model_texts(script)
    for call in script.calls():
        f = call.func
        if not isinstance(f, ast.Attribute):
            continue
        dtypes = [*call.args, *(k.value for k in call.keywords if k.arg == "dtype")]
        to_half = f.attr == "to" and any(_half(script, d) for d in dtypes)
        if not (to_half or (f.attr in ("half", "bfloat16") and not call.args)):
            continue
        stmt = script.parents.get(call)
        names = {unparse(f.value)}
        if isinstance(stmt, ast.Assign):
            names |= {unparse(t) for t in stmt.targets}
        model = next((n for n in sorted(names) if n in texts and n in optimizers), None)
        if model is None:
            continue
        opt = optimizers[model]
        # Cast, then train: the optimizer is built or a backward runs after the cast. A cast after the
        # last backward (half weights for export or inference) is not reported.
        trains_later = any(script.after(b, call) for b in script.method_calls("backward"))
        if script.after(opt, call) or trains_later:
            yield (
                call,
                f"`{unparse(call)}` casts the weights that `{unparse(opt.func)}` (line {opt.lineno}) updates",
            )


def data_parallel(script: Script) -> Found:
    for call in script.calls():
        name = script.callee(call)
        if name.startswith("torch.") and last(name) == "DataParallel":
            yield call, f"`{unparse(call.func)}` runs the replicas as threads of one process"


def unused_parameters_flag(script: Script) -> Found:
    peft = any(last(script.callee(c)) == "get_peft_model" for c in script.calls())
    for wrap in script.wraps:
        flag = script.keyword(wrap, "find_unused_parameters")
        if flag is None or not is_const(flag, True) or not wrap.args:
            continue
        if peft:  # the commonest reason people set it, and not one: frozen parameters are not "unused"
            yield (
                flag,
                (
                    "a PEFT model's frozen base (requires_grad=False) is not unused: DDP registers only "
                    "the trainable parameters (the adapters), which all get gradients"
                ),
            )
        elif static_module(script, wrap.args[0]):
            yield flag, f"`{unparse(wrap.args[0])}` has no branch, loop or unused submodule in forward"


_CHECKPOINTS = ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential")


def _under_ddp(script: Script) -> bool:
    """The file wraps a model in DDP (DDP(...), or s.model without strategy="fsdp") without
    static_graph=True, under which DDP supports reentrant backwards (its documentation)."""
    ddp = False
    sessions = [c for c in script.calls() if script.callee(c) in ("ddpkit.session", "ddpkit.session.session")]
    fsdp_session = any("fsdp" in unparse(script.keyword(c, "strategy")).lower() for c in sessions)
    for wrap in script.wraps:
        if script.session_call(wrap, "model"):
            strategy = script.keyword(wrap, "strategy")
            if "fsdp" in unparse(strategy).lower() or (strategy is None and fsdp_session):
                continue
        elif last(script.callee(wrap)) != "DistributedDataParallel":
            continue
        static = script.keyword(wrap, "static_graph")
        if static is not None and not is_const(static, False):
            return False
        ddp = True
    return ddp and not any(True for _ in script.method_calls("_set_static_graph"))


def _reentrant(script: Script, call: ast.Call) -> str:
    """How `call` checkpoints reentrantly ('' when it does not, or when it cannot be told)."""
    name = script.callee(call)
    if name in _CHECKPOINTS:
        flag = script.keyword(call, "use_reentrant")
        if flag is None and script.unknown_keywords(call):
            return ""  # **kwargs: not known here
        if flag is None:
            return "without use_reentrant, whose default is still the reentrant variant"
        return "with use_reentrant=True" if is_const(flag, True) else ""
    if last(name) == "checkpoint_wrapper":
        impl = kwarg(call, "checkpoint_impl")
        reentrant = impl is not None and last(unparse(impl)) == "REENTRANT"
        return "with CheckpointImpl.REENTRANT" if reentrant else ""
    if isinstance(call.func, ast.Attribute) and call.func.attr == "gradient_checkpointing_enable":
        options = kwarg(call, "gradient_checkpointing_kwargs")
        if isinstance(options, ast.Dict):
            for key, value in zip(options.keys, options.values, strict=True):
                if is_const(key, "use_reentrant") and is_const(value, True):
                    return "with use_reentrant=True"
    return ""


def reentrant_checkpoint(script: Script) -> Found:
    if not script.multi_rank or not _under_ddp(script):
        return
    for call in script.calls():
        how = _reentrant(script, call)
        if how:
            yield call, f"`{unparse(call.func)}(...)` {how}, in a model trained under DDP"


RULES = (
    Rule(
        "DDP001",
        "optimizer-before-wrap",
        "optimizer built before the model is sharded/prepared",
        "fully_shard/FSDP replace the parameters by sharded ones (measured: the optimizer's step then "
        "leaves the weights unchanged), to_empty allocates new ones, and ddpkit's s.model may do either "
        "(strategy='fsdp'); ddpkit documents: build the optimizer after s.model. DDP(...) and .to()/.cuda() "
        "keep the Parameter objects (measured), so they are not reported.",
        "build the optimizer after wrapping, from the wrapped model's parameters",
        optimizer_before_wrap,
    ),
    Rule(
        "DDP002",
        "batchnorm-per-rank",
        "BatchNorm normalised per rank",
        "Without SyncBatchNorm each rank normalises with the statistics of its own 1/N of the batch: the "
        "model trains differently from one process on the global batch, badly so for small per-rank batches.",
        "s.model(net, sync_batchnorm=True), or nn.SyncBatchNorm.convert_sync_batchnorm(net) before DDP",
        batchnorm_per_rank,
    ),
    Rule(
        "DDP004",
        "changed-after-wrap",
        "parameters replaced or frozen after wrapping",
        "DDP registers the parameters that need gradients when it wraps. A parameter frozen or a layer "
        "replaced afterwards stops the next step with 'Expected to have finished reduction in the prior "
        "iteration'; with find_unused_parameters=True the new layer is silently never averaged and the "
        "replicas drift apart (both measured on 2 gloo ranks, docs/lint.md).",
        "replace layers and set requires_grad before s.model(...)/DDP(...), or wrap again afterwards",
        changed_after_wrap,
    ),
    Rule(
        "DDP010",
        "half-weights-fp32-optimizer",
        "weights cast to bf16/fp16 under a torch optimizer",
        "The optimizer then updates bf16/fp16 weights in place: updates below the format's resolution "
        "(~0.4% of a weight in bf16) are lost and training silently diverges from fp32 "
        "(TensorAuto/OpenTau#181).",
        "keep fp32 weights and autocast (ddpkit: session(precision='bf16')), or FSDP MixedPrecision",
        cast_with_fp32_optimizer,
    ),
    Rule(
        "DDP011",
        "data-parallel",
        "torch.nn.DataParallel",
        "One process drives every GPU through threads (GIL-bound, the model re-broadcast every step); "
        "torch's documentation recommends DistributedDataParallel even on one machine.",
        "one process per GPU: `ddpkit run train.py` with s.model(net), or torchrun + DDP",
        data_parallel,
    ),
    Rule(
        "DDP012",
        "find-unused-parameters",
        "find_unused_parameters=True without an apparent need",
        "DDP then traverses the autograd graph after every forward; needed only when some parameters get "
        "no gradient in some steps (branches, unused heads or outputs); frozen parameters (a PEFT model's "
        "base) never need it. Reported when forward has no branch, loop or unused submodule and returns "
        "one value, or when the model comes from peft's get_peft_model.",
        "drop find_unused_parameters=True (DDP raises a clear error if a parameter really gets no gradient)",
        unused_parameters_flag,
        confidence="low",
    ),
    Rule(
        "DDP014",
        "reentrant-checkpoint",
        "reentrant activation checkpointing under DDP",
        "Reentrant checkpointing (use_reentrant=True, or torch.utils.checkpoint without use_reentrant, "
        "whose default it still is) re-runs the block's backward outside DDP's view. Measured on 2 gloo "
        "ranks: with find_unused_parameters=True, 'Expected to mark a variable ready only once'; a block "
        "whose input needs no gradient, 'Expected to have finished reduction in the prior iteration'; a "
        "layer checkpointed twice, replicas that silently differ.",
        "pass use_reentrant=False (ddpkit: s.model(net, activation_checkpointing=...) is non-reentrant)",
        reentrant_checkpoint,
    ),
)
