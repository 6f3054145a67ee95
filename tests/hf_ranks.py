"""Rank functions for tests/test_hf_*.py: real `transformers` models from tiny configs (no downloads),
run in the shared rank pools (importable by pickle). One process's model is built in the same process
from the same seed, so the initial weights compare bit for bit (same init code, same generator)."""

from __future__ import annotations

import torch
from fsdp_train import full_params
from torch import nn

import ddpkit
from ddpkit.strategy import FSDPOptions

VOCAB = 96


def config(kind: str):
    """A tiny config of each family: GPT-2 (tied head), Llama (tied or not), Qwen2, BERT (tied MLM head)."""
    import transformers as tf

    small = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if kind == "gpt2":
        return tf.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **small,
        )  # no dropout: the ranks compare to one process
    if kind in ("llama", "llama-tied"):
        return tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=kind == "llama-tied",
            **small,
        )
    if kind == "qwen2":
        return tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **small,
        )
    if kind == "bert":
        return tf.BertConfig(
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **small,
        )
    if kind == "vit":  # its _init_weights draws trunc_normal_ (cls token, position embeddings)
        return tf.ViTConfig(
            image_size=8,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=3,
        )
    raise ValueError(kind)


def model_class(kind: str) -> type[nn.Module]:
    import transformers as tf

    return {
        "gpt2": tf.GPT2LMHeadModel,
        "llama": tf.LlamaForCausalLM,
        "llama-tied": tf.LlamaForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "bert": tf.BertForMaskedLM,
        "vit": tf.ViTForImageClassification,
    }[kind]


def factory(kind: str):
    cfg, cls = config(kind), model_class(kind)
    return lambda: cls(cfg)


def one_process(kind: str, seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory(kind)()


def batch(kind: str, rank: int, world: int, n: int = 4, length: int = 12) -> dict:
    """The same global batch on every rank (seeded), then this rank's rows; BERT: masked-LM labels."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (n * world, length), generator=g)
    mine = ids[rank * n : (rank + 1) * n]
    return {"input_ids": mine, "labels": mine.clone()}


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    out = full_params(model)
    out.update({f"buffer:{n}": b.detach().clone() for n, b in ddpkit.unwrap(model).named_buffers()})
    return out


def _ddp_state(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = ddpkit.unwrap(model)
    out = {n: p.detach().clone() for n, p in inner.named_parameters()}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in inner.named_buffers()})
    return out


def initial(kind: str, strategy: str, whole: bool, min_block_params: int = 10_000) -> dict:
    """The model's initial weights under `strategy` (gathered), and one process's from the same seed;
    with the units FSDP chose, whether the tied parameters are still one, and the first loss."""
    with ddpkit.session(seed=0, verbose=False) as s:
        chosen: object = FSDPOptions(min_block_params=min_block_params) if strategy == "fsdp" else strategy
        model = s.model(factory(kind)() if whole else factory(kind), strategy=chosen)
        inner = ddpkit.unwrap(model)
        state = _state(model) if strategy == "fsdp" else _ddp_state(model)
        units = sorted(n for n, m in inner.named_modules() if type(m).__name__.startswith("FSDP"))
        tied = [(a, b) for a, b in _tied_names(kind) if inner.get_parameter(a) is inner.get_parameter(b)]
        loss = model(**batch(kind, s.rank, s.world_size)).loss
        return {
            "got": state,
            "one": _state(one_process(kind)),
            "units": units,
            "tied": tied,
            "loss": float(loss.detach()),
        }


def initial_fsdp_factory(kind: str) -> dict:
    """The initial weights of FSDP's shard-by-shard build (gathered) against one process's; the names of
    those that differ, and one process's whole state (to see what its init drew)."""
    with ddpkit.session(seed=0, verbose=False) as s:
        got = _state(s.model(factory(kind), strategy=FSDPOptions(min_block_params=10_000)))
    one = _state(one_process(kind))
    assert got.keys() == one.keys(), sorted(set(got) ^ set(one))
    return {"differ": [k for k in one if not torch.equal(got[k], one[k])], "one": one}


def _tied_names(kind: str) -> list[tuple[str, str]]:
    return {
        "gpt2": [("lm_head.weight", "transformer.wte.weight")],
        "llama-tied": [("lm_head.weight", "model.embed_tokens.weight")],
        "qwen2": [("lm_head.weight", "model.embed_tokens.weight")],
        "bert": [("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")],
        "llama": [],
    }[kind]


# -- ddpkit verify on an HF model (`--model hf_ranks:gpt2 --batches hf_ranks:padded --loss hf_ranks:token_sum`)
def gpt2() -> nn.Module:
    return factory("gpt2")()


def llama_tied() -> nn.Module:
    return factory("llama-tied")()


def padded(step: int, rows: int = 8, length: int = 12) -> dict:
    """A global batch of padded sequences of different lengths (labels -100 on the padding)."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(2, length + 1, (rows,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, 2)  # pad_token_id
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": ids.masked_fill(~mask, -100)}


def token_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token loss and its token count: (loss_sum, tokens), the global token mean's parts."""
    import torch.nn.functional as F

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def _rows(batch: dict, rank: int, world: int) -> dict:
    n = batch["input_ids"].shape[0] // world
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def train(
    kind: str, strategy: str, whole: bool, root: str | None = None, steps: int = 3, accumulation: int = 2
) -> dict:
    """The README recipe: padded sequences, the summed loss with `s.backward(..., tokens=)`, SGD with
    momentum; the final weights gathered. `root`: exported there (`s.export`) for `from_pretrained`."""
    with ddpkit.session(seed=0, verbose=False, accumulation=accumulation) as s:
        chosen: object = FSDPOptions(min_block_params=10_000) if strategy == "fsdp" else strategy
        model = s.model(factory(kind)() if whole else factory(kind), strategy=chosen)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            for micro in range(accumulation):
                batch = _rows(
                    padded(step * accumulation + micro, rows=4 * s.world_size), s.rank, s.world_size
                )
                with s.accumulate(model):
                    loss_sum, tokens = token_sum(model, batch)
                    s.backward(loss_sum, tokens=tokens)
                s.step(opt)  # steps on the last micro-batch of the k
        if root is not None:
            s.export(root, model)
        return {"final": full_params(model), "token_weighted": s.stepper.tokens.last_total is not None}


def train_one_process(kind: str, world: int, steps: int = 3, accumulation: int = 2) -> dict:
    """The same steps in one process on the whole global batch: the mean over all its valid tokens."""
    model = one_process(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        parts = [
            token_sum(model, padded(step * accumulation + m, rows=4 * world)) for m in range(accumulation)
        ]
        total = sum(float(n) for _, n in parts)
        (sum(loss for loss, _ in parts) / total).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def initial_all(kind: str) -> dict:
    """`initial` for the three builds (FSDP from the factory, FSDP built whole, DDP), compared here:
    the names of the tensors that differ from one process's, the FSDP units, the ties kept, the loss."""
    out = {}
    for strategy, whole in (("fsdp", False), ("fsdp", True), ("ddp", False)):
        r = initial(kind, strategy, whole)
        differ = sorted(k for k in r["one"] if k not in r["got"] or not torch.equal(r["got"][k], r["one"][k]))
        out[f"{strategy}-{'whole' if whole else 'factory'}"] = {
            "differ": differ,
            "compared": len(r["one"]),
            "units": r["units"],
            "tied": r["tied"],
            "loss": r["loss"],
        }
    return out


def split_tie() -> str:
    """blocks= naming the embedding alone: its weight is tied to the head, which stays in the root."""
    with ddpkit.session(seed=0, verbose=False) as s:
        try:
            s.model(factory("gpt2"), strategy=FSDPOptions(blocks=(nn.Embedding,)))
        except ddpkit.DdpkitError as err:
            return str(err)
    return "no error"


def small_units(kind: str) -> dict:
    """The size rule with units as small as the embedding itself: the tied embedding must not become
    a unit of its own (it shares its weight with the head); a forward and backward run."""
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(factory(kind), strategy=FSDPOptions(min_block_params=3000))
        inner = ddpkit.unwrap(model)
        model(**batch(kind, s.rank, s.world_size)).loss.backward()
        units = sorted(n for n, m in inner.named_modules() if type(m).__name__.startswith("FSDP"))
        return {
            "units": units,
            "tied": [
                (a, b) for a, b in _tied_names(kind) if inner.get_parameter(a) is inner.get_parameter(b)
            ],
        }


def pretrained(kind: str, root: str, shard_size: str | None = None) -> nn.Module:
    """Other weights than the seed-0 init (seed 123), written with save_pretrained to `root`."""
    model = one_process(kind, seed=123)
    model.save_pretrained(root, **({"max_shard_size": shard_size} if shard_size else {}))
    return model


def load(kind: str, strategy: str, weights: str) -> dict:
    """s.model(factory, weights=...): the weights as the ranks hold them (gathered), and the rows this
    rank holds of each parameter (FSDP: its own share only)."""
    with ddpkit.session(seed=0, verbose=False) as s:
        chosen: object = FSDPOptions(min_block_params=10_000) if strategy == "fsdp" else strategy
        model = s.model(factory(kind), strategy=chosen, weights=weights)
        inner = ddpkit.unwrap(model)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in inner.parameters())
        state = _state(model) if strategy == "fsdp" else _ddp_state(model)
        return {
            "got": state,
            "local": local,
            "tied": [
                (a, b) for a, b in _tied_names(kind) if inner.get_parameter(a) is inner.get_parameter(b)
            ],
        }
