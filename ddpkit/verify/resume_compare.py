"""How `ddpkit verify --resume` compares two runs' snapshots, and what a difference says was not saved.

A snapshot (`ddpkit.verify.resume`) is `key -> tensor or plain value`, keys in the order the state acts
on training: the samples of the global batch, the loss, the weights, the optimizer (its state and
learning rates), s.stepper, every object the script keeps, then the RNG states. The first key that
differs, and whether that was right after `s.load` or after a step, points at the missing state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.data import ShardedLoader
from ddpkit.verify import calibrate
from ddpkit.verify.run import bits
from ddpkit.verify.spec import Tolerance


def kind(obj: Any) -> str:
    if isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
        return "scheduler"
    if isinstance(obj, torch.amp.GradScaler):
        return "scaler"
    if isinstance(obj, torch.Generator):
        return "generator"
    if isinstance(obj, ShardedLoader):
        return "loader"
    if isinstance(obj, nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    return "other"


def tensors(snaps: list[dict]) -> list[dict[str, torch.Tensor]]:
    return [
        {k: v for k, v in snap.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
        for snap in snaps
    ]


def _world_bound(key: str, kinds: Mapping[str, str]) -> bool:
    """Values that legitimately depend on the world size: RNG streams, per-rank loader positions."""
    head = key.split(".", 1)[0]
    return head == "rng" or kinds.get(head) in ("loader", "generator")


def compare(
    full: list[dict], resumed: list[dict], floor: Any, tol: Tolerance, steps: int
) -> tuple[int, dict | None]:
    """(values compared, the first difference: step, key, detail) in snapshot order."""
    count = 0
    if len(resumed) != len(full):
        return 0, {
            "step": steps,
            "key": "steps",
            "detail": f"{len(resumed)} snapshots, expected {len(full)}",
        }
    for i, (a, b) in enumerate(zip(full, resumed, strict=True)):
        kinds = a.get("_kinds", {})
        for key, want in a.items():
            if key.startswith("_") or key == "step" or (i == 0 and key in ("data.global_batch", "loss")):
                continue
            if floor is not None and _world_bound(key, kinds):
                continue
            count += 1
            if key not in b:
                return count, {"step": a["step"], "key": key, "detail": "missing after the resume"}
            got = b[key]
            if isinstance(want, torch.Tensor):
                if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                    return count, {
                        "step": a["step"],
                        "key": key,
                        "detail": f"{_brief(want)} vs {_brief(got)}",
                    }
                if floor is not None and want.is_floating_point():
                    update = calibrate.deviation(full[i - 1][key], want) if i else None
                    dev = calibrate.deviation(want, got)
                    if calibrate.limit(tol, want, floor[i].get(key, (0.0, 0.0)), update).excess(dev) > 1:
                        return count, {"step": a["step"], "key": key, "detail": _detail(want, got)}
                elif not torch.equal(bits(want), bits(got)):
                    return count, {"step": a["step"], "key": key, "detail": _detail(want, got)}
            elif floor is not None and isinstance(want, float) and key == "loss":
                if abs(want - got) > 1e-3 * max(abs(want), 1e-12):
                    return count, {"step": a["step"], "key": key, "detail": f"{want!r} vs {got!r}"}
            elif want != got:
                return count, {"step": a["step"], "key": key, "detail": f"{want!r} vs {got!r}"}
    return count, None


def _brief(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)


def _detail(want: torch.Tensor, got: torch.Tensor) -> str:
    differ = bits(want) != bits(got)
    if not want.is_floating_point():
        return f"{int(differ.sum())} of {want.numel()} element(s) differ"
    diff = (want.double() - got.double()).abs().reshape(-1)
    i = int(diff.argmax())
    return (
        f"{int(differ.sum())} of {want.numel()} element(s) differ, largest at [{i}]: uninterrupted "
        f"{float(want.reshape(-1)[i]):.9g}, resumed {float(got.reshape(-1)[i]):.9g}"
    )


def culprit(diff: dict, meta: Mapping[str, Any], *, save_at: int, dataset: bool) -> tuple[str, str]:
    """(what was most likely not saved, the fix) from the first value that differs; `meta` is a
    snapshot of the uninterrupted run (its object kinds and saved names), `dataset`: read by a loader."""
    key, step, k = diff["key"], diff["step"], save_at
    head = key.split(".", 1)[0]
    kinds, saved = meta.get("_kinds", {}), set(meta.get("_saved", ()))
    save_it = "pass it to s.save(...) and s.load(...) under the same name"
    if head == "data":
        if dataset and "loader" not in kinds.values():
            return (
                "the data position: the resumed run trained on other samples at step "
                f"{step}, so the loader's position (epoch, samples consumed) was not saved",
                "pass loader=<your s.loader(...)> to s.save and s.load",
            )
        return (
            f"the data position: the resumed run trained on other samples at step {step}",
            "save the loader (or whatever picks the batches) and restore it before training on",
        )
    if head == "optimizer" and ".param_groups." in key:
        schedulers = [n for n, kind in kinds.items() if kind == "scheduler"]
        named = f" ({', '.join(schedulers)})" if schedulers else ""
        if schedulers and all(n in saved for n in schedulers):
            what = f"the learning-rate schedule{named}: saved, but after the resume it sets other values"
        else:
            what = (
                f"the learning-rate scheduler{named}: {key} differs after step {step} although the "
                "optimizer was restored, so the scheduler restarted from its first step: it was not saved"
            )
        return what, "pass scheduler=<your scheduler> to s.save and s.load"
    if head in kinds:
        kind = kinds[head]
        label = {
            "scheduler": "the LR scheduler",
            "module": "the extra model (an EMA or averaged copy)",
            "generator": "the random generator",
            "scaler": "the GradScaler (fp16 loss scale)",
            "loader": "the loader's position",
            "optimizer": "the optimizer",
        }.get(kind, "the state")
        if head in saved:
            return (
                f"{label} `{head}`: passed to s.save, but it differs {_when(step, k)}",
                "build it before s.load and let s.load restore it; do not rebuild or reset it afterwards",
            )
        return f"{label} `{head}`: not saved, so it differs {_when(step, k)}", f"{save_it} ({head}={head})"
    if head == "stepper":
        return (
            "s.stepper (the fp16 loss scale and the optimizer step count) was not saved",
            "pass stepper=s.stepper to s.save and s.load",
        )
    if head == "rng":
        return (
            "a random number generator: its state differs, so something drew random numbers that the "
            "checkpoint does not cover (a generator of your own, or draws between s.load and training)",
            "save every torch.Generator you use (s.save(..., gen=g)); s.save keeps the global ones",
        )
    if head == "optimizer":
        return (
            "the optimizer's state (momentum, Adam moments, step counts) was not saved or not restored",
            "pass optimizer=opt to s.save and s.load",
        )
    if head == "model" and step == k:
        return "the model's weights were not restored by s.load", "pass model=model to s.save and s.load"
    unsaved = [n for n in kinds if n not in saved]
    hint = f" (not saved: {', '.join(unsaved)})" if unsaved else ""
    return (
        f"{key} drifts from step {step} on, though every value compared matched before: state outside "
        f"the checkpoint changes the training{hint}",
        "save every object whose state changes during training: scheduler, EMA, generators, loader",
    )


def _when(step: int, k: int) -> str:
    return "right after s.load" if step == k else f"after step {step}"
