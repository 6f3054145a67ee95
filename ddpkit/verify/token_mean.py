"""The `token_mean` diagnosis: a loss averaged over a count that each rank takes of its own shard.

A language model's loss is a mean over the valid (non-padding) tokens. On one process that is the mean
over the global batch's N tokens; DDP averages the ranks' means over their own n_r tokens, which weighs
every shard 1/W instead of n_r/N. The fingerprint, tested here in this process at the initial weights
on the first global batch: the full batch's gradient g is a weighted sum of the shards' gradients g_r,
g = Σ w_r g_r, with weights that sum to 1 but are not equal (w_r = n_r/N), while DDP used their plain
mean. A loss averaged over rows (w_r = 1/W) fits with equal weights, a summed one with weights 1, and
batch-wide operations such as BatchNorm fit no weights at all, so none of them is mistaken for it.
"""

from __future__ import annotations

from typing import Any

import torch

import ddpkit
from ddpkit.data import to_device
from ddpkit.verify.report import Diagnosis, Report
from ddpkit.verify.run import Trajectory, map_rows, shard
from ddpkit.verify.spec import VerifySpec, build_data, build_loss, build_model, resolve

IGNORE_INDEX = -100  # the label of padding in torch's cross_entropy and Hugging Face's collators


def diagnose_token_mean(spec: VerifySpec, single: Trajectory, ranks: Any, report: Report) -> list[Diagnosis]:
    """[the `token_mean` cause] when the failure is the per-shard token mean, else []."""
    if report.passed or single.batchnorm or not single.states or any(r.error for r in ranks):
        return []
    if [r.batch_hashes[0][0] for r in ranks if r.batch_hashes] != single.batch_hashes[0]:
        return []  # other data per rank: the data_mismatch diagnosis says so
    try:
        return _diagnose(spec, single)
    except Exception:  # a diagnosis must never break the report it explains
        return []


def _diagnose(spec: VerifySpec, single: Trajectory) -> list[Diagnosis]:
    session = ddpkit.session(seed=spec.seed, device=spec.device, env={}, verbose=False)
    with torch.random.fork_rng(), session as s:  # in this process, at the single run's first weights
        whole, parts = _first_batch(spec, s)
        net = build_model(spec).to(s.device)
        net.load_state_dict(single.states[0], strict=False)
        loss_fn = build_loss(spec)
        full = _grad(net, loss_fn, whole)
        shards = torch.stack([_grad(net, loss_fn, p) for p in parts])
    weights = torch.linalg.lstsq(shards.T, full.unsqueeze(1)).solution.squeeze(1)
    size = float(full.norm())
    if size == 0:
        return []
    fitted = float((shards.T @ weights - full).norm()) / size
    uniform = float((shards.mean(0) - full).norm()) / size
    w = [float(v) for v in weights]
    if not (uniform > 1e-3 and fitted < 0.1 * uniform and abs(sum(w) - 1) < 0.02):
        return []
    counts = _valid_tokens(parts)
    total = sum(counts)
    said = ", ".join(f"rank {r}: {v:.1%}" for r, v in enumerate(w))
    tokens = (
        f" The labels hold {', '.join(str(n) for n in counts)} valid token(s) per shard (labels != "
        f"{IGNORE_INDEX}), {total} in all: the weights are those counts over their total."
        if total and all(abs(n / total - v) < 0.01 for n, v in zip(counts, w, strict=True))
        else ""
    )
    return [
        Diagnosis(
            "token_mean",
            "cause",
            "the loss is a mean over a count each rank takes of its own shard (a per-micro-batch token "
            "mean, e.g. cross_entropy with ignore_index over padded sequences): in the single run each "
            f"shard weighs its share of the global count ({said}), but DDP averages the ranks' means "
            f"with equal weights 1/{spec.nproc}, so shards with few tokens count as much as full ones "
            f"(the full-batch gradient is {fitted:.1e} from the weighted fit, {uniform:.2g} from DDP's "
            f"equal-weight mean).{tokens} Gradient accumulation has the same flaw across micro-batches.",
            "back-propagate the SUM of the per-token losses and pass the micro-batch's count: "
            "s.backward(F.cross_entropy(logits, labels, reduction='sum'), tokens=(labels != -100).sum()); "
            "s.step then all-reduces the count once and scales the gradient to the global token mean "
            "(ddpkit.step.tokens, any ranks x accumulation).",
        )
    ]


def _first_batch(spec: VerifySpec, s: ddpkit.Session) -> tuple[Any, list[Any]]:
    """The first global batch of the single run, and each rank's shard of it (as the ranks read it)."""
    if spec.data is not None:
        loader = s.loader(build_data(spec), batch_size=spec.batch_size, shuffle=spec.shuffle, drop_last=True)
        whole = next(iter(loader))
        parts = [shard(whole, r, spec.nproc, interleaved=True) for r in range(spec.nproc)]
    else:
        whole = to_device(resolve(spec.batches, "batches")(0), s.device)
        parts = [shard(whole, r, spec.nproc, interleaved=False) for r in range(spec.nproc)]
    if spec.precision == "fp64":
        whole, parts = _double(whole), [_double(p) for p in parts]
    return whole, parts


def _double(batch: Any) -> Any:
    return map_rows(batch, lambda t: t.double() if t.is_floating_point() else t)


def _grad(net: torch.nn.Module, loss_fn: Any, batch: Any) -> torch.Tensor:
    """The flattened gradient of the loss on `batch` (float64), the parameters' order."""
    net.zero_grad(set_to_none=True)
    loss = loss_fn(net, batch)
    (loss[0] / loss[1] if isinstance(loss, tuple) else loss).backward()
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().reshape(-1).cpu()
            for p in net.parameters()
        ]
    )


def _valid_tokens(parts: list[Any]) -> list[int]:
    """Per shard, the labels that are not IGNORE_INDEX, when one integer tensor of the batch holds some."""
    counts = []
    for part in parts:
        found = [t for t in _tensors(part) if not t.is_floating_point() and bool((t == IGNORE_INDEX).any())]
        if len(found) != 1:
            return []
        counts.append(int((found[0] != IGNORE_INDEX).sum()))
    return counts


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in _tensors(v)]
    return []
