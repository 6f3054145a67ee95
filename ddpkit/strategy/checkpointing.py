"""Activation checkpointing, one switch: `s.model(net, activation_checkpointing=Block)` (or "auto").

    model = s.model(Net, strategy="fsdp", activation_checkpointing=Block)   # each Block recomputed
    model = s.model(lambda: GPT2LMHeadModel(cfg), activation_checkpointing="auto")

Each module of the named classes is wrapped in torch's `checkpoint_wrapper` with the NON-reentrant
implementation: its activations are not kept for the backward but recomputed then, trading compute for
memory. Why non-reentrant: the reentrant one runs the block's backward in a separate autograd pass, so
DDP sees a parameter "marked ready twice" and fails (or needs static_graph), and it drops gradients of
inputs that do not require grad (accelerate#3536, transformers#45518). Why here, before wrapping: DDP and
FSDP must see the wrapped module (FSDP2 shards the wrapper, torchtitan's order: the block's all-gather
happens before its checkpointed forward, and its recompute in the backward finds the parameters already
gathered). The wrapper changes no `state_dict` key (torch strips `_checkpoint_wrapped_module.`), so
checkpoints, `s.export` and `weights=` read and write the same names with or without it.

"auto": an HF model's `_no_split_modules` (the classes transformers itself never splits: its decoder
layers), else the class of the modules in the model's longest `nn.ModuleList` (the repeated blocks).
Recomputing the same kernels on the same inputs gives the same values, so the weights are bitwise those
of the run without checkpointing (tests/test_activation_checkpointing.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ddpkit.errors import problem

PREFIX = "_checkpoint_wrapped_module."  # torch's name of the wrapped module inside a CheckpointWrapper

Choice = Any  # a module class, a tuple of them, or "auto"


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' segment (what `state_dict` and ddpkit's shards use)."""
    return name.replace(PREFIX, "")


def classes(module: nn.Module, choice: Choice) -> tuple[type[nn.Module], ...]:
    if choice == "auto":
        return _auto(module)
    chosen = choice if isinstance(choice, tuple) else (choice,)
    if not chosen or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in chosen):
        raise problem(
            f"activation_checkpointing={choice!r} is not a module class, a tuple of them, or 'auto'",
            "Pass the class of the repeated block, e.g. activation_checkpointing=TransformerBlock",
        )
    return chosen


def _auto(module: nn.Module) -> tuple[type[nn.Module], ...]:
    names = set(getattr(module, "_no_split_modules", None) or ())
    found = {type(m) for m in module.modules() if type(m).__name__ in names}
    if not found:
        lists = [m for m in module.modules() if isinstance(m, nn.ModuleList) and len(m)]
        longest = max(lists, key=len, default=None)
        if longest is not None and len({type(m) for m in longest}) == 1:
            found = {type(longest[0])}
    if not found:
        raise problem(
            f"activation_checkpointing='auto' found no repeated block in the {type(module).__name__} (no "
            "_no_split_modules, no nn.ModuleList of one class)",
            "Name the block class: activation_checkpointing=MyBlock",
        )
    return tuple(sorted(found, key=lambda c: c.__name__))


def apply(module: nn.Module, choice: Choice) -> str:
    """Wrap every module of the chosen classes (non-reentrant); a note for the session to print."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wanted = classes(module, choice)
    if any(isinstance(m, CheckpointWrapper) for m in module.modules()):
        raise problem(
            "the model already holds checkpoint wrappers, and activation_checkpointing= was passed",
            "Pass one of the two: the plain model with activation_checkpointing=, or your wrapped "
            "model without it",
        )
    count = sum(isinstance(m, wanted) for m in module.modules())
    if not count:
        names = ", ".join(c.__name__ for c in wanted)
        raise problem(
            f"activation_checkpointing=({names}) matches no module of the {type(module).__name__}",
            "Name the class of the repeated blocks, or pass 'auto'",
        )
    apply_activation_checkpointing(
        module,
        checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, wanted),
    )
    names = ", ".join(c.__name__ for c in wanted)
    return (
        f"activation checkpointing: {count} {names} module(s) recompute their activations in the backward"
        + _no_cache_in_training(module)
    )


def _no_cache_in_training(module: nn.Module) -> str:
    """A Hugging Face model (a PEFT one too) whose config asks for a key-value cache: `use_cache=False` in
    its training forwards, as transformers' own gradient checkpointing does. Else each recomputed block
    appends its keys to the cache a second time and the backward stops in attention with a size mismatch
    (measured: GPT-2, transformers 5.24). Per call, not in the config: an exported model keeps its cache."""
    if not getattr(getattr(module, "config", None), "use_cache", False):
        return ""

    def no_cache(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if m.training:
            kwargs["use_cache"] = False
        return args, kwargs

    module.register_forward_pre_hook(no_cache, with_kwargs=True)
    return "; use_cache=False in training (a recomputed block would extend the key-value cache twice)"


def unit_name(name: str) -> str:
    """The FSDP unit for a block found inside a checkpoint wrapper: the wrapper (torchtitan's order)."""
    suffix = "." + PREFIX.rstrip(".")
    while name.endswith(suffix):
        name = name[: -len(suffix)]
    return name
