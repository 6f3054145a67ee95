"""Rank functions for tests/test_adapters.py: real `peft` LoRA on real `transformers` models from tiny
configs, the pretrained base written by the test (`hf_ranks.pretrained`, seed 123: not the session's
initialisation), run in the shared rank pools. One process's run is built here from the same seed, so
the initial adapters compare bit for bit (same code, same generator stream)."""

from __future__ import annotations

import contextlib
import io
import math

import hf_ranks
import torch
from torch import nn

import ddpkit
from ddpkit.strategy import FSDPOptions
from ddpkit.strategy.checkpointing import plain_name
from ddpkit.strategy.hsdp_options import HSDPOptions

TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def lora(kind: str):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.0)


def get_peft(model: nn.Module, kind: str) -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(model, lora(kind))


def factory(kind: str, base: str, how: str):
    """ "pretrained": the base read by `from_pretrained` in the factory (what most scripts do);
    "config": the base built from its config, its weights given by `s.model(..., weights=base)`; "bf16":
    the same with the base cast to bf16 before get_peft_model (its adapters stay fp32)."""
    from peft import get_peft_model

    cls = hf_ranks.model_class(kind)
    if how == "pretrained":
        return lambda: get_peft_model(cls.from_pretrained(base), lora(kind))
    cfg = hf_ranks.config(kind)
    if how == "bf16":  # the base kept in bf16; peft casts the adapters to fp32 (autocast_adapter_dtype)
        return lambda: get_peft_model(cls(cfg).to(torch.bfloat16), lora(kind))
    if how == "bf16-cast":  # the whole PEFT model cast to bf16, adapters too: s.model keeps those fp32
        return lambda: get_peft_model(cls(cfg), lora(kind)).to(torch.bfloat16)
    return lambda: get_peft_model(cls(cfg), lora(kind))


def base_key(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def one_process(kind: str, base: str, how: str) -> nn.Module:
    """The same PEFT model in one process, from seed 0; "config": the base's weights copied in after."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = factory(kind, base, how)()
    if how == "bf16-cast":  # what s.model does to them: the bf16 adapters cast to fp32
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    if how != "pretrained":
        pretrained = hf_ranks.model_class(kind).from_pretrained(base).state_dict()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    p.copy_(pretrained[base_key(name)])
    return model


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters whole (gathered under FSDP: a collective), by their state_dict names."""
    out = {}
    for name, p in ddpkit.unwrap(model).named_parameters():
        if p.requires_grad:
            t = p.detach()
            out[plain_name(name)] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def _options(strategy: str) -> object:
    """ "fsdp": units by size (each block its own); "hsdp": the same, replicate 2 x shard 2 (4 ranks)."""
    if strategy == "hsdp":
        return HSDPOptions(replicate=2, shard=2, min_block_params=2_000)
    return FSDPOptions(min_block_params=2_000) if strategy == "fsdp" else strategy


def _steps(s, model, opt, first: int, last: int, accumulation: int = 2, world: int | None = None) -> None:
    """Steps `first`..`last - 1`; each micro-batch 4 rows per rank of `world` (the global batch of a run at
    that world size, split over this session's ranks)."""
    rows = 4 * (world or s.world_size)
    for step in range(first, last):
        for micro in range(accumulation):
            batch = hf_ranks._rows(
                hf_ranks.padded(step * accumulation + micro, rows=rows), s.rank, s.world_size
            )
            with s.accumulate(model):
                loss_sum, tokens = hf_ranks.token_sum(model, batch)
                counted = int(tokens)
                s.backward(loss_sum, tokens=tokens)
            assert int(tokens) == counted, (
                f"s.backward changed the caller's token count: {counted} -> {int(tokens)}"
            )
            s.step(opt)


def _loss_over(s, model, micro_batches: int) -> float:
    """The mean loss over every valid token of the first `micro_batches` global micro-batches (those a run
    trains on), without gradients; the sums all-reduced (every rank returns the global mean)."""
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for i in range(micro_batches):
            loss_sum, tokens = hf_ranks.token_sum(
                model, hf_ranks._rows(hf_ranks.padded(i, rows=4 * s.world_size), s.rank, s.world_size)
            )
            total += torch.stack([loss_sum.double(), tokens.double()])
    if s.world_size > 1:
        torch.distributed.all_reduce(total)
    return float(total[0] / total[1])


def _graphs() -> int:
    """Dynamo's graphs compiled so far in this process (0 when torch.compile was never imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def train(
    kind: str,
    strategy: str,
    how: str,
    base: str,
    steps: int = 4,
    out: str | None = None,
    shard_optimizer: object = "auto",
    options: dict | None = None,
    evaluate: bool = False,
) -> dict:
    """Token-weighted AdamW steps on the adapters (the optimizer given every parameter, as scripts do);
    the initial and final adapters gathered, the frozen base's gradients and optimizer state, the
    sharded step's note; `out`: the adapter directory and the merged model exported there; `options`:
    more keywords for `s.model` (activation_checkpointing=, compile=); `evaluate`: the loss over the
    micro-batches trained on, before and after."""
    printed, graphs_before = io.StringIO(), _graphs()
    chosen = _options(strategy)  # HSDP's degrees go to the session (its mesh), once
    with (
        contextlib.redirect_stdout(printed),
        ddpkit.session(
            seed=0,
            accumulation=2,
            shard_optimizer=shard_optimizer,
            strategy=chosen if strategy == "hsdp" else "auto",
        ) as s,
    ):
        model = s.model(
            factory(kind, base, how),
            strategy=None if strategy == "hsdp" else chosen,
            weights=None if how == "pretrained" else base,
            **(options or {}),
        )
        initial = trainable(model)
        inner = ddpkit.unwrap(model)
        frozen_start = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in inner.named_parameters()
            if not p.requires_grad
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [_loss_over(s, model, 2 * steps)] if evaluate else []
        _steps(s, model, opt, 0, steps)
        losses += [_loss_over(s, model, 2 * steps)] if evaluate else []
        frozen_moved = [
            n
            for n, p in inner.named_parameters()
            if not p.requires_grad
            and not torch.equal(
                (p.full_tensor() if hasattr(p, "full_tensor") else p).detach(), frozen_start[n]
            )
        ]
        frozen_grads = [n for n, p in inner.named_parameters() if not p.requires_grad and p.grad is not None]
        with_state = sorted(plain_name(n) for n, p in inner.named_parameters() if p in opt.state)
        dtypes = sorted({(p.requires_grad, str(p.dtype)) for p in inner.parameters()})
        dtypes += sorted(
            {("state", str(v.dtype)) for st in opt.state.values() for k, v in st.items() if k != "step"}
        )
        final = trainable(model)
        if out is not None:
            s.export(f"{out}/adapter", model)
            s.export(f"{out}/merged", model, merged=True)
        logits = None
        if out is not None:  # the module itself: under compile=, no second (no-grad, 2-row) graph for this
            with torch.no_grad():
                logits = inner(input_ids=hf_ranks.padded(99, rows=2)["input_ids"]).logits.detach().clone()
    graphs = _graphs() - graphs_before
    return {
        "initial": initial,
        "final": final,
        "frozen_moved": frozen_moved,
        "frozen_grads": frozen_grads,
        "with_state": with_state,
        "printed": printed.getvalue(),
        "logits": logits,
        "graphs": graphs,
        "dtypes": dtypes,
        "losses": losses,
    }


def train_one_process(
    kind: str,
    base: str,
    how: str,
    world: int,
    steps: int = 4,
    accumulation: int = 2,
    permuted: bool = False,
    rescaled: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """The same steps on the whole global batch in one process (the mean over all its valid tokens):
    the trainable parameters after each step. `permuted`: each batch's rows in another order, the noise
    floor's variant (only the order of the sums changes). `rescaled`: the other variant, the backward
    run on the token sum over a power of two near the tokens per micro-batch, the gradients multiplied
    by power/total before the step (the same gradient; only the roundings of a 16-bit backward change)."""
    model = one_process(kind, base, how)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    states = [{n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}]
    for step in range(steps):
        opt.zero_grad()
        parts = []
        for m in range(accumulation):
            batch = hf_ranks.padded(step * accumulation + m, rows=4 * world)
            if permuted:
                order = torch.randperm(4 * world, generator=torch.Generator().manual_seed(10_007 + step + m))
                batch = {k: v[order] for k, v in batch.items()}
            parts.append(hf_ranks.token_sum(model, batch))
        total = sum(float(n) for _, n in parts)
        if rescaled:
            unit = 2.0 ** round(math.log2(total / accumulation))
            (sum(loss for loss, _ in parts) / unit).backward()
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(unit / total)
        else:
            (sum(loss for loss, _ in parts) / total).backward()
        opt.step()
        states.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad})
    return states


def save_after_two_steps(
    kind: str, strategy: str, base: str, root: str, options: dict | None = None, world: int | None = None
) -> str | None:
    """2 steps from the pretrained base, then `s.save(root)`; the checkpoint's path. `world`: the global
    batch of a run at that world size (one process saving for a resume on more ranks)."""
    with ddpkit.session(seed=0, accumulation=2, verbose=False, log_to=None) as s:
        model = s.model(
            factory(kind, base, "config"), strategy=_options(strategy), weights=base, **(options or {})
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _steps(s, model, opt, 0, 2, world=world)
        saved = s.save(root, model=model, optimizer=opt)
    return None if saved is None else str(saved)


def save_and_resume(kind: str, strategy: str, base: str, root: str, options: dict | None = None) -> dict:
    """4 steps straight, saving (`s.save`) after step 2 on the way, as `ddpkit verify --resume`'s
    uninterrupted run does, against a fresh session that loads that checkpoint and runs the other 2: the
    final adapters of both (bitwise equal when resume is exact), and what the checkpoint holds."""
    more = options or {}
    with ddpkit.session(seed=0, accumulation=2, verbose=False, log_to=None) as s:
        model = s.model(factory(kind, base, "config"), strategy=_options(strategy), weights=base, **more)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _steps(s, model, opt, 0, 2)
        saved = s.save(root, model=model, optimizer=opt)
        _steps(s, model, opt, 2, 4)
        straight = trainable(model)
    with ddpkit.session(seed=5, accumulation=2, verbose=False) as s:  # another seed: the load must restore
        model = s.model(factory(kind, base, "config"), strategy=_options(strategy), weights=base, **more)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s.load(root, model=model, optimizer=opt)
        _steps(s, model, opt, 2, 4)
        resumed = trainable(model)
    return {"straight": straight, "resumed": resumed, "saved": None if saved is None else str(saved)}


# -- ddpkit verify on a PEFT model (`--model adapter_ranks:gpt2_lora --loss adapter_ranks:tuple_token_sum`)
def gpt2_lora() -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(hf_ranks.factory("gpt2")(), lora("gpt2"))


def tuple_token_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`hf_ranks.token_sum` with the model's tuple output (`return_dict=False`: logits, then the cache)."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], return_dict=False)[0]
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def resume_in_one_process(
    kind: str, base: str, root: str, world: int, steps: int = 4
) -> dict[str, torch.Tensor]:
    """Load the checkpoint `root` that a `world`-rank run saved after 2 steps into ONE process (another
    world size: the sharded adapters and their optimizer state read whole) and run the other steps on
    the same global batches; the final adapters."""
    with ddpkit.session(seed=5, accumulation=2, verbose=False, log_to=None) as s:
        model = s.model(factory(kind, base, "config"), weights=base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s.load(root, model=model, optimizer=opt)
        _steps(s, model, opt, 2, steps, world=world)
        return trainable(model)


def resume_on_ranks(
    kind: str, strategy: str, base: str, root: str, steps: int = 4
) -> dict[str, torch.Tensor]:
    """Load the checkpoint `root` (saved by one process on this run's global batch) on this session's
    ranks under `strategy` (FSDP: the whole adapters and AdamW state cut into shards) and run the other
    steps; the final adapters, gathered."""
    with ddpkit.session(seed=5, accumulation=2, verbose=False) as s:
        model = s.model(factory(kind, base, "config"), strategy=_options(strategy), weights=base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s.load(root, model=model, optimizer=opt)
        _steps(s, model, opt, 2, steps)
        return trainable(model)
