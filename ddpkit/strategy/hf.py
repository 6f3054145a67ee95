"""Hugging Face `transformers` models (and models written the same way) under ddpkit's strategies.

Three things such a model does that a plain `nn.Module` does not, and what ddpkit does about each:

1. **Initialisation deferred on `meta`.** A `PreTrainedModel` runs `post_init()` at the end of its
   constructor; `init_weights()` there asks `get_torch_context_manager_or_global_device()` and, on
   `meta`, skips `initialize_weights()` (its `_init_weights`: normal(0, 0.02) embeddings, scaled
   projections, ones for norms). FSDP's shard-by-shard build (`fsdp_init.build`) runs the constructor
   under `torch.device("meta")`, so HF would skip it and the shards would hold only the modules' own
   `reset_parameters` values: silently other weights. `real_init()` makes that one question
   answer "no device context" while ddpkit builds, so HF runs its own initialisation at its own place
   in the constructor, on the values ddpkit replays: the same generator stream as one process, the same
   code, equal bit for bit by construction. `transformers.initialization` also keeps its own references
   to `torch.nn.init`'s functions (captured at import), four of which return early on a meta tensor;
   those are pointed at ddpkit's replaying versions for the build too.
2. **Tied parameters** (`lm_head.weight is wte.weight`, `_tied_weights_keys`): one `nn.Parameter`
   registered in two modules. `tied_owners` finds every module holding each shared parameter, so that
   `fsdp_init.cut` keeps them one parameter and FSDP's unit rule keeps their owners in one unit (FSDP2
   refuses a parameter managed by two units at the first forward).
3. **A check that the initialisation ran**: after the build, every parameter of an HF model must have
   been written; one never written means its init was skipped, and ddpkit refuses (naming it) rather
   than hand out zeros.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch import nn

from ddpkit.errors import problem

_DEVICE_QUESTION = "get_torch_context_manager_or_global_device"
_ANSWERS: list[Callable[[], Any]] = []  # the real answer while `real_init` replaces it (`loading_as_is`)


def is_hf(module: Any) -> bool:
    """True for a `transformers.PreTrainedModel` (without importing transformers when it is not loaded)."""
    hf = sys.modules.get("transformers.modeling_utils")
    return hf is not None and isinstance(module, hf.PreTrainedModel)


@contextlib.contextmanager
def real_init(replay: Callable[[Callable], Callable], names: tuple[str, ...]) -> Iterator[None]:
    """While ddpkit builds a model on `meta`: HF runs its own weight initialisation as on the CPU.

    `replay(fn)` wraps one of `torch.nn.init`'s functions so that it runs on the real values of a meta
    tensor (`fsdp_init`); `names` are those that return early on `meta`. Nothing is changed when
    transformers is not imported (a plain model does not need it)."""
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None:
        yield
        return
    if not hasattr(utils, _DEVICE_QUESTION):
        version = getattr(sys.modules.get("transformers"), "__version__", "?")
        raise problem(
            f"ddpkit cannot build this transformers version ({version}) shard by shard: its "
            f"`{_DEVICE_QUESTION}` is gone, so ddpkit cannot make `post_init` run the model's own "
            "initialisation on meta tensors and the shards would hold other weights than one process's",
            "Build the model whole and pass it (s.model(Model(cfg), strategy='fsdp')), or use a "
            "transformers version ddpkit tests (see the `hf` extra in pyproject.toml)",
        )
    original = getattr(utils, _DEVICE_QUESTION)
    table = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", {})
    saved = {n: table[n] for n in names if n in table}
    setattr(utils, _DEVICE_QUESTION, lambda: None)  # "no device context": init_weights initialises
    _ANSWERS.append(original)
    for n, fn in saved.items():
        table[n] = replay(fn)
    try:
        yield
    finally:
        _ANSWERS.pop()
        setattr(utils, _DEVICE_QUESTION, original)
        table.update(saved)


@contextlib.contextmanager
def loading_as_is(outside: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """While ddpkit builds a model on `meta`: `PreTrainedModel.from_pretrained` (and every `Auto*` class's,
    which call it) runs inside `outside()`, i.e. as on one process (`fsdp_init._as_one_process`). Nothing
    is changed when transformers is not imported."""
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is None:
        yield
        return
    cls = utils.PreTrainedModel
    original = cls.__dict__["from_pretrained"]  # a classmethod

    def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
        replaced = getattr(utils, _DEVICE_QUESTION)
        if _ANSWERS:  # transformers' own answer: it decides where from_pretrained builds and loads
            setattr(utils, _DEVICE_QUESTION, _ANSWERS[-1])
        try:
            with outside():
                return original.__func__(klass, *args, **kwargs)
        finally:
            setattr(utils, _DEVICE_QUESTION, replaced)

    cls.from_pretrained = classmethod(functools.wraps(original.__func__)(from_pretrained))
    try:
        yield
    finally:
        cls.from_pretrained = original


def check_written(module: nn.Module, never_written: list[str]) -> None:
    """Refuse an HF model some of whose parameters its initialisation never wrote (it was skipped)."""
    if not never_written or not is_hf(module):
        return
    shown = ", ".join(never_written[:5]) + (", ..." if len(never_written) > 5 else "")
    raise problem(
        f"the {type(module).__name__} built shard by shard left {len(never_written)} parameter(s) never "
        f"initialised ({shown}): its own initialisation did not run on them under ddpkit's meta-device "
        "build, so the shards would not be one process's weights",
        "Build the model whole and pass it (s.model(Model(cfg), strategy='fsdp')); ddpkit cuts it into "
        "shards. Please report the model class",
    )


def tied_owners(module: nn.Module) -> dict[int, list[tuple[str, str]]]:
    """Every parameter registered in more than one place: id -> [(module name, attribute), ...]."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        for attr, p in m._parameters.items():
            if p is not None and (name, attr) not in owners.get(id(p), []):
                owners.setdefault(id(p), []).append((name, attr))
    return {k: v for k, v in owners.items() if len(v) > 1}


def export(
    write: Callable[[str | Path, nn.Module], Any],
    path: str | Path,
    model: nn.Module,
    *,
    main: bool,
    merged: bool = False,
) -> Any:
    """`s.export`: an HF model exported to a directory (a path without `.safetensors`) becomes one
    `from_pretrained` loads: `model.safetensors` (written by `write`, streamed under FSDP) plus the
    config, written by global rank 0. A PEFT model: the adapter directory `PeftModel.from_pretrained`
    loads, or with `merged=True` the adapters folded into the base, a directory the base class's
    `from_pretrained` loads (`ddpkit.strategy.adapters`). Anything else: `write(path, model)` as before."""
    from ddpkit.parallel.modules import unwrap
    from ddpkit.strategy import adapters

    if not isinstance(model, nn.Module):  # s.export(model, path): a swapped call, or no model at all
        swapped = " and a model as the path" if isinstance(path, nn.Module) else ""
        raise problem(
            f"s.export got a {type(model).__name__} as the model{swapped}",
            "Call s.export(path, model): the path first, then the model, e.g. s.export('runs/final', model)",
        )
    target = Path(path)
    inner: Any = unwrap(model)  # a transformers PreTrainedModel (config, generation_config)
    if adapters.is_peft(inner) and target.suffix != ".safetensors":
        written = (adapters.export_merged if merged else adapters.export_adapter)(inner, target, main=main)
        return written if main else None
    if merged:
        raise problem(
            f"merged=True asks to fold adapters into the base, but the {type(inner).__name__} is not a PEFT "
            "model (or the path ends in .safetensors)",
            "Leave merged out, or export a model made by peft.get_peft_model to a directory",
        )
    if not is_hf(inner) or target.suffix == ".safetensors":
        return write(path if "://" in str(path) else target, model)  # a URL: Path() would fold its //
    written = write(target / "model.safetensors", model)  # every rank (a collective under FSDP)
    if main:
        saved_config(inner).save_pretrained(target)
        if getattr(inner, "generation_config", None) is not None and inner.can_generate():
            inner.generation_config.save_pretrained(target)
    return target if written is not None else None


def saved_config(model: Any) -> Any:
    """The model's config as `save_pretrained` writes it: with `architectures` (the class that tools
    reading config.json build: pipelines, vLLM) and `dtype` (the weights' dtype). A copy: the model's own
    config is left as it is."""
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard's class: FSDP<name>
    config.dtype = str(model.dtype).removeprefix("torch.")
    return config
