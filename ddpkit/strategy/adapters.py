"""Models fine-tuned with adapters (`peft`: LoRA and the like) under ddpkit's strategies.

    model = s.model(lambda: get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(...)),
                    strategy="fsdp", weights="base/")     # the base's weights read into shards
    s.export("adapter/", model)                          # PeftModel.from_pretrained(base, "adapter/")
    s.export("merged/", model, merged=True)              # AutoModelForCausalLM.from_pretrained("merged/")

A PEFT model mixes a frozen base (`requires_grad=False`) with small trainable adapters. What ddpkit does
about each place where that matters, and why there:

- **Gradients.** DDP registers hooks only on parameters that require gradients, and FSDP2 reduce-scatters
  only the gradients a unit's parameters produced (`FSDPParamGroup.post_backward` skips parameters without
  one), so a unit mixing frozen and trainable parameters carries only the trainable gradients; nothing
  to lay out. ddpkit's sharded optimizer step partitions only the optimizer's trainable parameters
  (`ddpkit.step.sharding`): an `AdamW(model.parameters())` over the whole PEFT model would otherwise
  publish the frozen base to every rank at every step.
- **Checkpoints.** `s.save` keeps what training changes: the trainable parameters and their optimizer
  state (`saved_state`), not the frozen base, which `s.model` rebuilds from the pretrained weights; a
  load checks that every trainable tensor is there (`check_loadable`).
- **Export.** `export_adapter` writes the directory `PeftModel.from_pretrained(base, dir)` reads, with
  peft's own `save_pretrained` fed the gathered adapter tensors (under FSDP they are sharded DTensors,
  which peft cannot write), the files' names then stripped of activation checkpointing's wrapper segment
  (peft names the tensors by its walk over the modules, which has it); `export_merged` rebuilds the model
  on the `meta` device, assigns the gathered full state and lets peft's `merge_and_unload` fold the
  adapters into the base, then `save_pretrained`.
- **Optimizers.** `AdamW(model.parameters())` over a PEFT model is fine (torch's optimizers skip a
  parameter without a gradient: no state, no update). One whose parameters are ALL frozen is not: it
  steps nothing, silently, for the whole run (an optimizer built over the base before `get_peft_model`
  froze it is the usual way to get one); `check_optimizer` stops the first `s.step` with it.
- **Dtypes.** A base kept in bf16 trains with fp32 adapters (peft's default when the base is cast before
  `get_peft_model`); `adapters_in_fp32` casts a PEFT model's 16-bit adapters to fp32 at `s.model` (the
  whole model cast to bf16), so their gradients, reduction and AdamW state are fp32 too. FSDP2 accepts
  the mix in one unit (it requires one dtype among the trainable parameters only); `cast_on_meta` makes
  FSDP's shard-by-shard build round new adapters through the base's dtype as peft does on one process.
- **Pretrained weights.** `base_name` maps a PEFT model's names (`base_model.model.` prefix, LoRA's
  `.base_layer.`) to the base checkpoint's, so `weights=` reads the base into the wrapped layers.

`peft` is imported only when a PEFT model is already loaded (`sys.modules`): a plain model pays nothing.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.errors import problem
from ddpkit.strategy.checkpointing import plain_name

_PREFIX = "base_model.model."


def is_peft(module: Any) -> bool:
    """True for a `peft.PeftModel` (without importing peft when it is not loaded)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def trainable_names(module: nn.Module) -> list[str]:
    """The names of the parameters that require gradients (tied ones once), as `state_dict` names them:
    without activation checkpointing's `_checkpoint_wrapped_module.` (else a checkpoint would keep none)."""
    return [plain_name(n) for n, p in module.named_parameters() if p.requires_grad]


def saved_state(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint keeps of a model's state dict: all of it, except for a PEFT model, whose frozen
    base is left out (rebuilt from the pretrained weights at `s.model`; gigabytes per save otherwise)."""
    if not is_peft(module):
        return state
    keep = set(trainable_names(module))
    return {k: v for k, v in state.items() if k in keep}


def check_loadable(module: nn.Module, state: Mapping[str, Any], *, strict: bool) -> bool:
    """For a PEFT model: refuse a checkpoint lacking a trainable tensor (when `strict`); the `strict`
    to load with (False: the frozen base is not in the file by design). Other models: `strict` as is."""
    if not is_peft(module):
        return strict
    missing = [n for n in trainable_names(module) if n not in state]
    if strict and missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise problem(
            f"the checkpoint lacks {len(missing)} of the adapter model's trainable tensors ({shown}); a PEFT "
            "model's checkpoint holds its trainable parameters only",
            "Load a checkpoint saved from the same PEFT configuration (same target modules, rank and "
            "adapter name), or pass strict=False to keep the missing ones as they are",
        )
    return False


def adapters_in_fp32(module: nn.Module) -> str | None:
    """Keep a PEFT model's trainable parameters in fp32 when they arrive in 16 bits (the whole PEFT model
    cast with `.to(torch.bfloat16)`, or `get_peft_model(..., autocast_adapter_dtype=False)` over a bf16
    base); the frozen base stays as it is (bf16: half the memory). AdamW on bf16 weights drops every
    update below 1/256 of the weight, and the adapters are small (fp32 costs little): peft keeps them in
    fp32 by default for the same reason. Their gradients, reduction and optimizer state follow the
    parameters' dtype. A note saying what was cast, or None."""
    if not is_peft(module):
        return None
    low = [p for p in module.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if not low:
        return None
    was = sorted({str(p.dtype).removeprefix("torch.") for p in low})
    with torch.no_grad():
        for p in low:
            p.data = p.data.float()
    return (
        f"kept the PEFT model's {len(low)} trainable tensors in fp32 (they were {', '.join(was)}; "
        "AdamW on 16-bit weights drops small updates); the frozen base keeps its dtype"
    )


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Stop an optimizer that can train nothing: every parameter it holds is frozen (requires_grad=False),
    so each step would silently leave the model as it is. Local and the same on every rank (no
    collective): every rank raises together."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or any(p.requires_grad for p in params):
        return
    raise problem(
        f"the optimizer ({type(optimizer).__name__}) holds {len(params)} parameters and none of them "
        "requires a gradient: all are frozen (requires_grad=False), so s.step would never change the model. "
        "With a PEFT model this is an optimizer built over the base model before get_peft_model froze it, "
        "or over the base's parameters (get_base_model()); the adapters are in no optimizer",
        "Build the optimizer after s.model, from the model it returned: "
        "torch.optim.AdamW(model.parameters()) (torch skips the frozen ones: no state, no update) or "
        "[p for p in model.parameters() if p.requires_grad]",
    )


@contextlib.contextmanager
def cast_on_meta() -> Iterator[None]:
    """While FSDP's build runs a factory on `meta` (`ddpkit.strategy.fsdp_init.build`): peft casts a new
    adapter to its base layer's dtype (`_move_adapter_to_device_of_base_layer`) except on `meta`, where it
    skips the cast. On one process a LoRA A drawn in fp32 over a bf16 base is rounded to bf16 there (and
    cast back to fp32 by peft's `autocast_adapter_dtype`); built shard by shard it kept its unrounded
    draw, so the adapters started a bf16 ulp away from one process's. Here the skipped dtype cast runs on
    `meta` (the build replays it on the real values). Nothing when peft is not loaded."""
    peft = sys.modules.get("peft")
    layer = getattr(getattr(getattr(peft, "tuners", None), "tuners_utils", None), "BaseTunerLayer", None)
    original = getattr(layer, "_move_adapter_to_device_of_base_layer", None)
    if layer is None or original is None:
        yield
        return

    def move(self: Any, adapter_name: str, device: torch.device | None = None) -> None:
        original(self, adapter_name, device)
        _cast_meta_adapter(self, adapter_name)

    layer._move_adapter_to_device_of_base_layer = move
    try:
        yield
    finally:
        layer._move_adapter_to_device_of_base_layer = original


def _cast_meta_adapter(tuner_layer: Any, adapter_name: str) -> None:
    """peft's dtype cast of one adapter's modules to the base layer's floating dtype, for those on meta."""
    weight = getattr(tuner_layer.get_base_layer(), "weight", None)
    dtype = getattr(weight, "dtype", None)
    if dtype is None or not dtype.is_floating_point:
        return
    for attr in (*tuner_layer.adapter_layer_names, *tuner_layer.other_param_names):
        holder = getattr(tuner_layer, attr, None)
        if not isinstance(holder, nn.ModuleDict) or adapter_name not in holder:
            continue
        params = list(holder[adapter_name].parameters())
        if params and all(p.is_meta for p in params) and any(p.dtype != dtype for p in params):
            holder[adapter_name] = holder[adapter_name].to(dtype=dtype)


def base_name(name: str) -> str:
    """A PEFT model's parameter name as the base model's checkpoint writes it."""
    name = name.removeprefix(_PREFIX)
    return name.replace(".base_layer.", ".")


def added_by_peft(module: nn.Module, name: str) -> bool:
    """True for a tensor PEFT added to the base (so not in the base's checkpoint): one of an adapter
    layer's (`lora_A`, `lora_B`, `lora_embedding_A`, ...: peft's `adapter_layer_names`)."""
    markers: set[str] = set()
    for m in module.modules():
        markers.update(getattr(m, "adapter_layer_names", ()))
    return any(f".{marker}." in f".{name}" for marker in markers)


def gathered_trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every trainable parameter whole, on every rank (a collective under FSDP: one all-gather each), by
    its name in `named_parameters` (activation checkpointing's wrapper segment kept: peft picks the
    adapter's tensors by walking the model's modules, whose names have it)."""
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()
    return out


def export_adapter(module: nn.Module, path: str | Path, *, main: bool) -> Path:
    """The adapter directory `PeftModel.from_pretrained(base, path)` loads (`adapter_config.json`,
    `adapter_model.safetensors`), written by peft's `save_pretrained` on global rank 0. Collective."""
    state = gathered_trainable(module)  # every rank: the gathers are collectives
    target = Path(path)
    if main:
        target.mkdir(parents=True, exist_ok=True)
        module.save_pretrained(str(target), state_dict=state)  # type: ignore[operator]  # a PeftModel
        _plain_keys(target)
    _wait()
    return target


def _plain_keys(target: Path) -> None:
    """Rewrite the adapter files peft wrote under `target` with plain names. Under activation
    checkpointing peft names each tensor as the module walk found it (`h.0._checkpoint_wrapped_module.attn
    ...`: peft strips FSDP1's wrapper segment only), and `PeftModel.from_pretrained` on a plain base then
    finds none of them (a warning, the adapters left at their initial values)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for file in target.rglob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys, metadata = list(f.keys()), f.metadata()
            if not any(plain_name(k) != k for k in keys):
                continue
            tensors = {plain_name(k): f.get_tensor(k) for k in keys}
        save_file(tensors, str(file), metadata=metadata)


def export_merged(module: nn.Module, path: str | Path, *, main: bool) -> Path:
    """A merged model directory (`from_pretrained` of the base class loads it): the adapters folded into
    the base by peft's own `merge_and_unload`, on a twin built on `meta` and given the gathered weights
    (gathered one tensor at a time: a collective under FSDP). The twin costs the model once on rank 0."""
    import peft

    state = {}
    for name, t in module.state_dict().items():  # every rank: each sharded tensor is one all-gather
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if main:
            state[name] = whole.detach().cpu().clone()
        del whole
    target = Path(path)
    if not main:
        _wait()
        return target
    inner: Any = module
    base = inner.get_base_model()
    config = inner.peft_config[inner.active_adapter]
    with torch.device("meta"):
        twin = peft.get_peft_model(type(base)(base.config), config)
    twin.load_state_dict(dict(state), strict=False, assign=True)
    merged = twin.merge_and_unload()
    _copy_unsaved_buffers(merged, base)
    if getattr(base, "generation_config", None) is not None:  # the user's, not the defaults of the config
        merged.generation_config = copy.deepcopy(base.generation_config)
    still = [n for n, t in [*merged.named_parameters(), *merged.named_buffers()] if t.is_meta]
    if still:
        raise problem(
            f"the merged model has {len(still)} tensors the saved state lacks ({still[0]!r})",
            "Report this with the model class; export the adapter directory instead",
        )
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target))
    _wait()
    return target


def _copy_unsaved_buffers(merged: nn.Module, base: nn.Module) -> None:
    """Give the merged twin the trained model's buffers that no state dict holds (non-persistent: Llama's
    rotary `inv_freq`), left on `meta` by the build. A meta tensor cannot take real data in place
    (`.data =` raises), so the owner module's buffer is replaced (`setattr` keeps it non-persistent)."""
    trained = {plain_name(n): b for n, b in base.named_buffers()}
    for name, b in list(merged.named_buffers()):
        if b.is_meta and name in trained:
            owner, _, leaf = name.rpartition(".")
            setattr(merged.get_submodule(owner), leaf, trained[name].detach().cpu().clone())


def _wait() -> None:
    """Every rank returns once global rank 0 has written (a reader on any rank sees the whole directory)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
