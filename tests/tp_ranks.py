"""Tiny models and rank functions for the tensor-parallel tests (run in the shared rank pools; importable
by pickle): an MLP (the Megatron pair), a Llama-style GPT (GQA, SwiGLU, RMSNorm, tied or not) and a
Hugging Face Llama from its config; each trained the same way under a TP layout and in one process."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.strategy import hf
from ddpkit.strategy.tp_options import TPOptions

VOCAB = 64


class MLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, attn_dropout: float) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, d, bias=False)
        self.attn_dropout = attn_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # the local heads under TP
        k = self.k(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        p = self.attn_dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, dropout: float, attn_dropout: float) -> None:
        super().__init__()
        self.norm1 = RMSNorm(d)
        self.attn = Attention(d, heads, kv_heads, attn_dropout)
        self.drop1 = nn.Dropout(dropout)
        self.norm2 = RMSNorm(d)
        self.mlp = SwiGLU(d, 2 * d)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(
        self,
        d: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        tied: bool = False,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, heads, kv_heads, dropout, attn_dropout) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


GPT_PLAN = {
    "blocks.*.attn.q": "colwise",
    "blocks.*.attn.k": "colwise",
    "blocks.*.attn.v": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.gate": "colwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}
GPT_VOCAB_PLAN = {**GPT_PLAN, "tok": "embedding_rowwise", "lm_head": "colwise_gather_output"}
MLP_PLAN = {"up": "colwise", "down": "rowwise"}


def llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return LlamaConfig(**values)


def llama(**overrides: Any) -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(llama_config(**overrides))


def lora_llama(**overrides: Any) -> nn.Module:
    """The Llama with LoRA adapters (peft) on q, v, o and down: its plan retargets their base layers."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    config = LoraConfig(r=4, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(llama(**overrides), config)


def make(kind: str, **kw: Any) -> nn.Module:
    """The model `kind` names ("mlp", "gpt", "llama", "lora"), built from the current generator state."""
    if kind == "lora":
        return lora_llama(**kw)
    if kind == "mlp":
        return MLP(**kw)
    if kind == "gpt":
        return GPT(**kw)
    return llama(**kw)


def batches(kind: str, steps: int, rows: int = 8, seq: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    if kind == "mlp":
        return [torch.randn(rows, 16, generator=g) for _ in range(steps)]
    return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(steps)]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return model(x).square().mean()
    if kind in ("llama", "lora"):
        return model(input_ids=x, labels=x).loss
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered: a collective), by name without wrappers."""
    return {n: full(p) for n, p in ddpkit.unwrap(model).named_parameters()}


def train(
    kind: str,
    options: TPOptions | None,
    *,
    steps: int = 3,
    accumulation: int = 1,
    max_norm: float | None = 0.5,
    model_kw: dict | None = None,
    rows: int = 8,
    save: str | None = None,
    variant: str = "",
    reseed: int | None = None,
) -> dict:
    """`steps` AdamW steps of the README loop; `options` None: one process (this rank alone, no group).
    The global batch of `rows` is split by the data-parallel rank (the tensor ranks of a group read the
    same rows). Returns the weights after each step, the norms, the layout and the printed lines. `save`:
    a checkpoint root the model and AdamW are saved to at the end. `variant` (one process): a noise-floor
    run, "permuted" (the rows of each batch) or "features" (every Linear's input features summed in 3
    pieces: the order TP changes). `reseed`: every rank's generator seeded alike after s.model (the
    random draws of one tensor group from one stream, whatever the session's per-rank seeds)."""
    printed = io.StringIO()
    session: dict[str, Any] = dict(seed=0, accumulation=accumulation)
    if options is not None:
        session["strategy"] = options
    mode = FeatureSplit() if variant == "features" else contextlib.nullcontext()
    with contextlib.redirect_stdout(printed), ddpkit.session(**session) as s, mode:
        model = s.model(lambda: make(kind, **(model_kw or {})), strategy=options)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
        if reseed is not None:
            torch.manual_seed(reseed)
        layout = s.layout
        dp, dp_rank = (layout.data, dp_rank_of(layout, s.rank)) if layout is not None else (1, 0)
        states, norms = [weights(model)], []
        for x in batches(kind, steps * accumulation, rows):
            per = rows // dp
            mine = x[dp_rank * per : (dp_rank + 1) * per]
            if variant == "permuted":
                mine = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(3))]
            with s.accumulate(model):
                s.backward(loss_of(kind, model, mine))
            info = s.step(opt, max_norm=max_norm)
            if info.stepped:
                states.append(weights(model))
                if info.grad_norm is not None:
                    norms.append(float(info.grad_norm))
        if save is not None:
            s.save(save, model=model, optimizer=opt, step=steps)
        described = s.strategy.describe()
        inner = ddpkit.unwrap(model)
        placements = {
            n: [type(p).__name__ for p in t.placements]
            for n, t in inner.named_parameters()
            if hasattr(t, "placements")
        }
        tied = len(hf.tied_owners(inner))
        draws = [m.full_draws for m in getattr(s.strategy, "draws", [])]
    return {
        "states": states,
        "norms": norms,
        "printed": printed.getvalue(),
        "describe": described,
        "draws": draws,
        "placements": placements,
        "tied": tied,
        "layout": None if layout is None else layout.as_dict(),
    }


def resumed(kind: str, strategy: object, root: str, *, rows: int = 8) -> dict:
    """Load `root` (model and AdamW) under `strategy` (None: one process), then one more step on the
    next batch: the weights loaded and after that step, whole."""
    session: dict[str, Any] = dict(seed=0, verbose=False)
    if strategy is not None:
        session["strategy"] = strategy
    with ddpkit.session(**session) as s:
        model = s.model(lambda: make(kind), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        step = int(s.load(root, model=model, optimizer=opt, step=0)["step"])
        loaded = weights(model)
        layout = s.layout
        dp, dp_rank = (layout.data, dp_rank_of(layout, s.rank)) if layout is not None else (1, 0)
        x = batches(kind, step + 1, rows)[step]
        per = rows // dp
        s.backward(loss_of(kind, model, x[dp_rank * per : (dp_rank + 1) * per]))
        s.step(opt, max_norm=0.5)
        return {"loaded": loaded, "after": weights(model), "describe": s.strategy.describe()}


class FeatureSplit(torch.overrides.TorchFunctionMode):
    """A noise-floor variant for tensor parallelism: every F.linear's reduction over its input features
    summed in 3 pieces, an order TP(2) does not use (the rows-permuted floor never reorders those sums)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            parts = [F.linear(xc, wc) for xc, wc in zip(x.chunk(3, -1), w.chunk(3, -1), strict=True)]
            y = parts[0]
            for part in parts[1:]:  # in order, as one sum of 3 pieces (fewer when there are fewer features)
                y = y + part
            return y + b if b is not None else y
        return func(*args, **kwargs)


def excess(reference: list[dict], got: list[dict], variants: list[list[dict]]) -> tuple[float, str]:
    """The largest share of verify's tolerance (`ddpkit.verify.calibrate`: 10 x the floor the variants
    measured) any tensor at any step uses (<= 1 passes), and where."""
    from ddpkit.verify.calibrate import deviation, floors, limit
    from ddpkit.verify.spec import Tolerance

    tol, worst, where = Tolerance(), 0.0, ""
    floor = floors(reference, variants)
    for step, (ref, mine) in enumerate(zip(reference, got, strict=True)):
        for name, a in ref.items():
            update = deviation(reference[step - 1][name], a) if step else None
            used = limit(tol, a, floor[step][name], update).excess(deviation(a, mine[name]))
            if used > worst:
                worst, where = used, f"{name} at step {step}"
    return worst, where


def dp_rank_of(layout: Any, rank: int) -> int:
    """The data-parallel rank: the coordinates other than tensor, row-major (replicate, then shard)."""
    return layout.coordinate(rank, "replicate") * layout.shard + layout.coordinate(rank, "shard")


def one_process(kind: str, **kw: Any) -> dict:
    """`train` in this process alone (no process group: the reference)."""
    return train(kind, None, **kw)


def refused(kind: str, options: TPOptions, model_kw: dict | None = None) -> str:
    try:
        with ddpkit.session(seed=0, verbose=False, strategy=options) as s:
            model = s.model(lambda: make(kind, **(model_kw or {})), strategy=options)
            x = batches(kind, 1)[0]
            s.backward(loss_of(kind, model, x))
        return "no error"
    except ddpkit.DdpkitError as err:
        return str(err)


def loader_split(options: TPOptions) -> dict:
    """What the session's loader hands this rank (the first two batches' sample ids), its per-rank seed
    and the loader's line, under `options`."""
    printed = io.StringIO()
    data = torch.utils.data.TensorDataset(torch.arange(32))
    with contextlib.redirect_stdout(printed), ddpkit.session(seed=0, strategy=options) as s:
        batches = s.loader(data, batch_size=8, shuffle=True)
        ids = [b[0].tolist() for b, _ in zip(batches, range(2), strict=False)]
        return {"ids": ids, "rank_seed": s.rank_seed, "printed": printed.getvalue()}


def token_data(n: int = 64) -> torch.utils.data.TensorDataset:
    """Sequences of token ids for `ddpkit verify --data` (the Llama's own next-token loss: `lm_loss`)."""
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (n, 8), generator=g))


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    ids = batch[0]
    logits = model(input_ids=ids).logits  # from the outputs: verify's chunked variant joins them
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def wrong_llama() -> nn.Module:
    """The Llama with a planted wrong plan in its config: the attention's output projection (row-wise)
    given column-wise."""
    from transformers import LlamaForCausalLM

    config = llama_config()
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.o_proj": "colwise"}
    return LlamaForCausalLM(config)
