"""Token-weighted losses (`s.backward(loss_sum, tokens=n)`): one global token mean at any ranks x k.

The proof: a small causal LM on variable-length, right-padded sequences, trained for a few steps with
(ranks, accumulation) = (1,1), (2,1), (1,4), (2,2), (3,2) (and FSDP at (2,2)), ends on the weights of
the one-process run within the calibrated noise (`ddpkit.verify.calibrate`, the rule `ddpkit verify`
applies), while the naive per-micro-batch token mean does not. `pytest -s -k proof` prints the table
that docs/equivalence.md quotes.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.errors import DdpkitError
from ddpkit.parallel.precision import PrecisionPlan
from ddpkit.tools.workloads import TinyGPT
from ddpkit.verify.calibrate import deviation, floor_summary, floors, limit
from ddpkit.verify.spec import Tolerance

VOCAB, SEQ, GLOBAL, STEPS = 32, 16, 12, 4  # 12 sequences per step split over 1..6 micro-batches x ranks
CLIP = 0.7  # some steps clip, some do not: a wrong scale shows, and so does clipping before the rescale


def sequences() -> list[torch.Tensor]:
    """Sequences of 2..17 tokens (1..16 predictions each): micro-batches hold very unequal token counts."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, SEQ + 2, (GLOBAL * STEPS,), generator=g)
    return [torch.randint(0, VOCAB, (int(n),), generator=g) for n in lengths]


def pad(seqs: list[torch.Tensor], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) right-padded to the longest sequence (or `length`); padding labels are -100."""
    t = length or max(len(s) - 1 for s in seqs)
    x = torch.zeros(len(seqs), t, dtype=torch.long)
    y = torch.full((len(seqs), t), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        x[i, : len(s) - 1], y[i, : len(s) - 1] = s[:-1], s[1:]
    return x, y


def model() -> TinyGPT:
    return TinyGPT(vocab=VOCAB, seq=SEQ, d=32, heads=2, layers=2)


def train(
    accumulation: int, mode: str, variant: str = "", strategy: str = "auto", precision: Any = "32"
) -> bytes:
    """Train STEPS steps in this process's session (world size from the environment); pickled result.

    mode "tokens": s.backward(loss_sum, tokens=n); "naive": s.backward(mean over the micro-batch's own
    tokens). variant "permuted": the noise-floor run (rows permuted, padded to SEQ).
    """
    data = sequences()
    with ddpkit.session(
        seed=0, accumulation=accumulation, verbose=False, strategy=strategy, precision=precision
    ) as s:
        net = s.model(model())
        opt = torch.optim.SGD(net.parameters(), lr=0.5)
        world, k = s.world_size, accumulation
        per_micro = GLOBAL // (world * k)
        states, norms = [], []
        for step in range(STEPS):
            batch = data[step * GLOBAL : (step + 1) * GLOBAL]
            if variant == "permuted":
                order = torch.randperm(GLOBAL, generator=torch.Generator().manual_seed(step))
                batch = [batch[i] for i in order]
            mine = batch[s.rank * GLOBAL // world : (s.rank + 1) * GLOBAL // world]
            for i in range(k):
                x, y = pad(mine[i * per_micro : (i + 1) * per_micro], SEQ if variant else None)
                x, y = x.to(s.device), y.to(s.device)
                with s.accumulate(net):
                    logits = net(x).flatten(0, 1).float()
                    if mode == "tokens":
                        s.backward(
                            F.cross_entropy(logits, y.flatten(), reduction="sum"), tokens=(y != -100).sum()
                        )
                    else:
                        s.backward(F.cross_entropy(logits, y.flatten()))  # mean over its own tokens
                info = s.step(opt, max_norm=CLIP)
            norms.append(float(info.grad_norm))
            full = s.strategy.full_state(net) if s.strategy.shards_state else ddpkit.unwrap(net).state_dict()
            states.append({n: t.detach().clone().cpu() for n, t in full.items()})
        return pickle.dumps({"states": states, "norms": norms, "world": world})


def run(config: tuple[int, int], mode: str, pools: dict, **kwargs: Any) -> dict:
    ranks, k = config
    if ranks == 1:
        return pickle.loads(train(k, mode, **kwargs))
    return pickle.loads(pools[ranks].run(functools.partial(train, k, mode, **kwargs), timeout=110)[0])


def worst(reference: list[dict], floor: list[dict], other: list[dict]) -> tuple[float, float]:
    """(max relative norm difference, max excess over the calibrated tolerance) over steps and tensors."""
    tol, rel, excess = Tolerance(), 0.0, 0.0
    for step, (ref, got) in enumerate(zip(reference, other, strict=True)):
        for name, a in ref.items():
            if not a.is_floating_point():
                continue
            dev = deviation(a, got[name])
            update = deviation(reference[step - 1][name], a) if step else None
            rel = max(rel, dev.rel_norm)
            excess = max(excess, limit(tol, a, floor[step][name], update).excess(dev))
    return rel, excess


@functools.cache
def _reference() -> tuple[dict, list[dict]]:
    reference = pickle.loads(train(1, "tokens"))
    permuted = pickle.loads(train(1, "tokens", "permuted"))
    return reference, floors(reference["states"], [permuted["states"]])


CONFIGS = [(1, 1), (2, 1), (1, 4), (2, 2), (3, 2)]


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_proof_token_weighted_matches_one_process_and_the_naive_mean_does_not(pool2, pool3) -> None:
    reference, floor = _reference()
    norms = reference["norms"]
    assert min(norms) < CLIP < max(norms), f"gradient norms {norms}: some steps must clip, some not"
    pools = {2: pool2, 3: pool3}
    rows = []
    for config in CONFIGS:
        tokens = worst(reference["states"], floor, run(config, "tokens", pools)["states"])
        naive = worst(reference["states"], floor, run(config, "naive", pools)["states"])
        rows.append((config, tokens, naive))
    print(f"\nnoise floor (rows permuted, padded to {SEQ}): {floor_summary(floor)}")
    print(
        "\n| ranks x accumulation | token-weighted: max rel diff | x tol | naive mean: max rel diff | x tol |"
    )
    print("|---|---|---|---|---|")
    for (ranks, k), (t_rel, t_x), (n_rel, n_x) in rows:
        print(f"| {ranks} x {k} | {t_rel:.2e} | {t_x:.2g} | {n_rel:.2e} | {n_x:.3g} |")
    for config, (_, t_excess), (_, n_excess) in rows:
        assert t_excess <= 1, f"token-weighted {config} is {t_excess:.3g} x its tolerance"
        if config != (1, 1):  # one micro-batch on one rank: the naive mean IS the global token mean
            assert n_excess > 10, f"the naive mean at {config} should fail, got {n_excess:.3g} x tol"


@pytest.mark.numerics
def test_fsdp_shards_take_the_same_rescale(pool2) -> None:
    reference, floor = _reference()
    fsdp = run((2, 2), "tokens", {2: pool2}, strategy="fsdp")
    rel, excess = worst(reference["states"], floor, fsdp["states"])
    print(f"\n| 2 x 2, FSDP | {rel:.2e} | {excess:.2g} | | |")
    assert excess <= 1, f"FSDP (2 ranks x 2) is {excess:.3g} x its tolerance"


@pytest.mark.numerics
def test_fp16_loss_scale_and_unit_leave_the_gradient_alone() -> None:
    """fp16 with a gradient scaler (CPU) at accumulation 3: the rescale comes before unscale and clip."""
    fp32 = pickle.loads(train(3, "tokens"))
    fp16 = pickle.loads(train(3, "tokens", precision=PrecisionPlan("16", "cpu")))
    for a, b in zip(fp32["states"][-1].values(), fp16["states"][-1].values(), strict=True):
        if a.is_floating_point():
            assert deviation(a, b).rel_norm < 2e-2  # fp16 autocast rounding, not a factor of k or N


def _empty_step() -> tuple[bool, bool, bool]:
    with ddpkit.session(seed=0, accumulation=2, verbose=False) as s:
        net = s.model(torch.nn.Linear(4, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        before = [p.detach().clone() for p in net.parameters()]
        for _ in range(2):
            with s.accumulate(net):
                s.backward(net(torch.ones(2, 4)).sum() * 0, tokens=0)
            info = s.step(opt)
        same = all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
        return info.skipped and not info.stepped, same, all(p.grad is None for p in net.parameters())


def test_a_step_without_any_valid_token_is_skipped_on_every_rank(pool2) -> None:
    assert _empty_step() == (True, True, True)
    assert pool2.run(_empty_step) == [(True, True, True)] * 2


def test_misuse_is_named() -> None:
    with ddpkit.session(seed=0, verbose=False) as s:
        net = s.model(torch.nn.Linear(4, 3))
        loss = net(torch.ones(2, 4)).sum()
        s.backward(loss, tokens=8)
        with pytest.raises(DdpkitError, match=r"mixed s\.backward"):
            s.backward(net(torch.ones(2, 4)).sum())
        with pytest.raises(DdpkitError, match="tokens= got"):
            s.backward(loss, tokens=torch.tensor(2.0))
        with pytest.raises(DdpkitError, match="SUM of the per-token losses"):
            s.backward(net(torch.ones(2, 4)), tokens=8)


# -- ddpkit verify names the naive per-micro-batch mean ------------------------------------------------
def lm() -> TinyGPT:
    return model()


def lm_batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8 sequences of the data above, padded together: each rank's half holds its own token count."""
    return pad(sequences()[step * 8 : (step + 1) * 8])


def naive_token_mean(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten())  # mean over this shard's valid tokens


@pytest.mark.numerics
def test_verify_fails_the_naive_token_mean_and_names_it(pool2) -> None:
    from ddpkit.verify import VerifySpec, verify

    spec = VerifySpec(model=lm, batches=lm_batches, loss=naive_token_mean, steps=3, batch_size=8)
    report = verify(spec, runner=pool2.run)
    assert not report.passed
    causes = [d for d in report.diagnoses if d.severity == "cause"]
    assert [d.code for d in causes] == ["token_mean"], report.render()
    counts = [int((y != -100).sum()) for y in lm_batches(0)[1].chunk(2)]
    assert f"{counts[0]}, {counts[1]} valid token(s)" in causes[0].message, causes[0].message
    assert "tokens=" in causes[0].fix


def token_sum(
    net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    return F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum"), (y != -100).sum()


@pytest.mark.numerics
def test_verify_passes_the_token_weighted_loss(pool2) -> None:
    from ddpkit.verify import VerifySpec, verify

    spec = VerifySpec(model=lm, batches=lm_batches, loss=token_sum, steps=3, batch_size=8)
    report = verify(spec, runner=pool2.run)
    assert report.passed, report.render()


def test_the_stepper_state_keeps_the_token_unit() -> None:
    """Saved with s.stepper, so a resumed fp16 run scales its first step as the uninterrupted one."""
    with ddpkit.session(seed=0, verbose=False) as s:
        net = s.model(torch.nn.Linear(4, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        s.backward(net(torch.ones(2, 4)).sum(), tokens=100)
        s.step(opt)
        state = s.stepper.state_dict()
    assert state["tokens"] == {"unit": 128.0, "last_total": 100, "empty_steps": 0}
    with ddpkit.session(seed=0, verbose=False) as s:
        s.stepper.load_state_dict(state)
        assert s.stepper.tokens.unit == 128.0 and s.stepper.tokens.last_total == 100
