"""Token-weighted losses: the step's gradient is the mean over every valid token of the global batch.

    for batch in loader:                                   # variable-length, padded sequences
        with s.accumulate(model):
            logits = model(batch["input_ids"])
            loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                       ignore_index=-100, reduction="sum")
            s.backward(loss_sum, tokens=(batch["labels"] != -100).sum())
        s.step(opt, max_norm=1.0)

Why: a language model's loss is a mean over the valid tokens of the batch. Averaging each micro-batch
over its own tokens, then the micro-batches (÷k) and the ranks (DDP), weighs a micro-batch of 10 tokens
as much as one of 1,000, which is not the gradient of the whole batch (the transformers bug #34191).

How, without reading micro-batches ahead: each micro-batch back-propagates the SUM of its per-token
losses, times a constant `1/unit` that is the same on every rank and micro-batch of the step, so the
gradients pile up as sums. At `s.step`, before unscale, clipping and the optimizer, the step's token
count is all-reduced once (one int64) and the gradients, which DDP averaged over the W ranks, are
multiplied by W·unit/N_total:

    grad = (1/W) Σ_ranks Σ_micro ∇(loss_sum / unit) · W·unit/N_total = Σ_all tokens ∇ℓ / N_total

`unit` is a power of two near the tokens per micro-batch and rank of the previous step (for the
session's first step: of its first micro-batch, from one extra all-reduce, once), so the summed loss
keeps the size of a mean one (fp16 loss scaling does not overflow on a sum of thousands of tokens) and,
being a power of two, changes no rounding: only the final multiplication by W·unit/N rounds. FSDP
averages its sharded gradients over the ranks as DDP does, so the same factor applies to each shard;
ddpkit's sharded optimizer step sees the rescaled gradients like the plain one. A step whose
micro-batches hold no valid token anywhere is skipped on every rank (the decision comes from the all-reduced
count) and reported.

Under tensor parallelism the T ranks of a tensor group back-propagate the same tokens (they read one
batch) and the gradients are averaged over the D = W/T data-parallel ranks only: the count all-reduced
over the W ranks is T·N_total and the factor W·unit/(T·N_total) = D·unit/N_total, the global token mean
over the data-parallel world, as above (the tensor degree cancels; tests/test_tp_training.py).
`last_total` is then T·N_total, which only its being set is read from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ddpkit.errors import problem

if TYPE_CHECKING:
    from ddpkit.parallel.collectives import Ranks

Count = int | torch.Tensor


class TokenWeighting:
    """The token count of the step in progress, and the rescaling at its end (one per session)."""

    def __init__(self, *, distributed: bool, device: torch.device, report: Callable[[str], None]) -> None:
        self.distributed = distributed
        self.device = device
        self.report = report
        self.unit = 1.0  # power of two; the backward's loss_sum / unit keeps the size of a mean loss
        self.empty_steps = 0  # steps skipped because no rank had a valid token
        self.last_total: int | None = None  # the previous step's global token count
        self._count: Count = 0  # this rank's valid tokens since the last optimizer step
        self._with = 0  # s.backward calls with tokens= since the last optimizer step
        self._without = 0  # ... and without

    def prepare(self, loss: torch.Tensor, tokens: Count | None, accumulation: int) -> torch.Tensor:
        """The loss `s.backward` back-propagates: a mean loss / k, or a token sum / unit."""
        if tokens is None:
            self._without += 1
            self._check_mixed()
            return loss / accumulation if accumulation > 1 else loss
        if isinstance(tokens, torch.Tensor):
            if tokens.numel() != 1 or tokens.is_floating_point():
                raise problem(
                    f"tokens= got a {tuple(tokens.shape)} {tokens.dtype} tensor",
                    "Pass the number of valid tokens of the micro-batch: an int or an integer scalar "
                    "tensor such as (labels != -100).sum()",
                )
            tokens = tokens.detach().reshape(())
        elif not isinstance(tokens, numbers.Integral) or tokens < 0:
            raise problem(f"tokens={tokens!r} is not a count of tokens", "Pass an int >= 0")
        else:
            tokens = int(tokens)
        if loss.dim() != 0:
            raise problem(
                f"s.backward(loss, tokens=...) got a loss of shape {tuple(loss.shape)}",
                "Pass the SUM of the per-token losses as a scalar (reduction='sum'), not a mean",
            )
        self._with += 1
        self._check_mixed()
        self._count = self._count + tokens
        if self.last_total is None and self._with == 1:  # the session's first token step
            self.unit = _power_of_two(self._all_reduce(tokens) / self._world())
        return loss / self.unit if self.unit != 1 else loss

    def _check_mixed(self) -> None:
        if self._with and self._without:
            raise problem(
                f"one optimizer step mixed s.backward(loss) ({self._without} call(s)) with "
                f"s.backward(loss, tokens=n) ({self._with} call(s))",
                "Pass tokens= in every s.backward of the step (a micro-batch without valid tokens "
                "passes its zero loss sum and tokens=0), or in none",
            )

    def drop(self) -> None:
        """The step in progress abandoned (`Stepper.drop_step`): its counts forgotten."""
        self._count, self._with, self._without = 0, 0, 0

    def settle(self, optimizer: torch.optim.Optimizer, *, accumulation: int, joining: bool) -> bool:
        """At `s.step`, before unscale and clipping: the summed gradients scaled to the global token mean.

        A step of mean losses (no tokens=) is left alone. Otherwise the step's token count is
        all-reduced (every rank reaches this point of `s.step` in the same order, so the one
        collective cannot be mismatched). Returns False when no rank had a valid token: the caller
        skips the optimizer step.
        """
        if not self._with:
            self._without = 0
            return True
        if joining:
            raise problem(
                "s.backward(loss, tokens=n) inside `with s.join(model):`: ranks that ran out of data "
                "cannot take part in the token count's all-reduce",
                "Give every rank the same number of batches (s.loader pads them) and drop s.join, or "
                "use a mean loss under s.join",
            )
        world, total = self._world(), self._all_reduce(self._count)
        unit, self.unit = self.unit, _power_of_two(total / (world * accumulation))
        self._count, self._with, self._without = 0, 0, 0
        self.last_total = total
        if total == 0:
            self.empty_steps += 1
            self.report(
                f"ddpkit: optimizer step skipped: its micro-batches held no valid token on any rank "
                f"(tokens=0 everywhere; {self.empty_steps} such step(s) so far)"
            )
            return False
        factor = world * unit / total
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and _plain(grads):
            torch._foreach_mul_(grads, factor)
        else:
            for g in grads:
                g.mul_(factor)
        return True

    def state_dict(self) -> dict:
        """`unit` and the last count: a resumed fp16 run then scales its first step as the original did."""
        return {"unit": self.unit, "last_total": self.last_total, "empty_steps": self.empty_steps}

    def load_state_dict(self, state: dict) -> None:
        self.unit = float(state.get("unit", self.unit))
        self.last_total = state.get("last_total", self.last_total)
        self.empty_steps = int(state.get("empty_steps", self.empty_steps))

    def _world(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    def _all_reduce(self, count: Count) -> int:
        total = torch.as_tensor(count, dtype=torch.int64, device=self.device).reshape(1).clone()  # not the
        if self.distributed:  # caller's tensor: as_tensor returns it as is, and all_reduce writes in place
            dist.all_reduce(total)
        return int(total.item())


def _power_of_two(x: float) -> float:
    """The power of two nearest to x (at least 1): dividing by it is exact in binary floating point."""
    return 2.0 ** round(math.log2(x)) if x >= 1 else 1.0


def _plain(grads: list[torch.Tensor]) -> bool:
    """Plain tensors on one device (torch's fused multiply); FSDP's DTensors take the per-tensor path."""
    return all(type(g) is torch.Tensor for g in grads) and len({g.device for g in grads}) == 1


def global_mean(s: Ranks, loss_sum: torch.Tensor, tokens: Count) -> torch.Tensor:
    """For a loop without `s.backward`: the loss whose DDP-averaged gradient is the global token mean.

    `loss_sum * world / N_total`, N_total all-reduced here (one collective, before backward, on every
    rank). `ddpkit verify` uses it for losses that return `(loss_sum, tokens)`.
    """
    count = torch.as_tensor(tokens, dtype=torch.int64, device=s.device).reshape(1)
    if s.distributed:
        dist.all_reduce(count)
    total = int(count.item())
    if total == 0:
        raise problem(
            "the global batch holds no valid token on any rank (tokens=0 everywhere)",
            "Check the labels' padding value (ignore_index) and the batches",
        )
    return loss_sum * (s.world_size / total)
