"""Rank functions for the FSDP tests (run in the shared rank pools; importable by pickle)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.strategy import FSDPOptions


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def net(d: int = 16, blocks: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(8, d), *[Block(d) for _ in range(blocks)], nn.Linear(d, 4))


def data(n: int = 96, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
    )


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered: a collective), on every rank."""
    out = {}
    for name, p in ddpkit.unwrap(model).named_parameters():
        t = p.detach()
        out[name] = (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()
    return out


def train(
    strategy, steps: int = 6, accumulation: int = 2, max_norm: float | None = 1.0, precision="32"
) -> dict:
    """The README loop; the same under every strategy."""
    with ddpkit.session(seed=0, verbose=False, accumulation=accumulation, precision=precision) as s:
        model = s.model(net(), strategy=strategy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = s.loader(data(), batch_size=16, shuffle=True)
        norms, losses = [], []
        it = iter(loader)
        for _ in range(steps * accumulation):
            x, y = next(it)
            with s.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                s.backward(loss)
            info = s.step(opt, max_norm=max_norm)
            if info.stepped and info.grad_norm is not None:
                norms.append(float(info.grad_norm))
            losses.append(float(s.all_reduce(loss.detach(), op="mean")))
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        return {
            "params": full_params(model),
            "norms": norms,
            "losses": losses,
            "local": local,
            "strategy": s.strategy.name,
        }


def different_init() -> str:
    with ddpkit.session(seed=0, verbose=False) as s:
        torch.manual_seed(s.rank)  # a per-rank seed before the model: the trap FSDP2 does not forgive
        try:
            s.model(net(), strategy="fsdp")
        except ddpkit.DdpkitError as err:
            return str(err)
    return "no error"


def fit_and_evaluate() -> dict:
    def step(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def eval_step(model, batch, metrics):
        x, y = batch
        out = model(x)
        metrics["loss"].update(F.cross_entropy(out, y, reduction="none"))
        metrics["accuracy"].update(out, y)

    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net(), strategy=FSDPOptions(blocks=(Block,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        train_loader = s.loader(data(), batch_size=16, shuffle=True)
        evals = s.loader(data(37, seed=1), batch_size=8, evaluation=True)  # shards of unequal length
        result = ddpkit.fit(s, model, opt, train_loader, step, epochs=1)
        metrics = ddpkit.evaluate(
            s, model, evals, eval_step, {"loss": ddpkit.Mean(), "accuracy": ddpkit.Accuracy()}
        )
        return {"steps": result.steps, "metrics": metrics, "params": full_params(model)}


def evaluate_in_one_process(params: dict[str, torch.Tensor]) -> dict:
    """The reference: the same weights, the whole evaluation set, one plain process, no ddpkit."""
    model = net()
    model.load_state_dict(params)
    x, y = data(37, seed=1).tensors
    with torch.no_grad():
        out = model(x)
    loss = F.cross_entropy(out, y, reduction="none")
    return {"loss": float(loss.mean()), "accuracy": float((out.argmax(1) == y).float().mean())}


def _run(s, model, opt, loader, steps: int) -> None:
    it = iter(loader)
    for _ in range(steps):
        x, y = next(it)
        with s.accumulate(model):
            s.backward(F.cross_entropy(model(x), y))
        s.step(opt, max_norm=1.0)


def resumable(root: str, stop: int | None, resume: bool, steps: int = 6) -> dict:
    """Train `steps` steps; stop after `stop` (saving), or resume from `root` and finish."""
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net(), strategy=FSDPOptions(blocks=(Block,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = s.loader(data(), batch_size=12, shuffle=True)
        done = 0
        if resume:
            done = s.load(root, model=model, optimizer=opt, loader=loader, step=0)["step"]
        todo = (stop if stop is not None else steps) - done
        _run(s, model, opt, loader, todo)
        if stop is not None:
            s.save(root, model=model, optimizer=opt, loader=loader, step=stop)
            s.export(f"{root}/export/model.safetensors", model)
        state = opt.state_dict()["state"]
        moments = sorted((k, v["exp_avg"].to_local().clone()) for k, v in state.items()) if state else []
        return {"params": full_params(model), "moments": moments}


def ddp_checkpoint_into_fsdp(root: str) -> str:
    """Save model and optimizer under DDP, then load both under FSDP: "loaded", or the error's message."""
    with ddpkit.session(seed=0, verbose=False, strategy="ddp") as s:
        model = s.model(net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        s.save(root, model=model, optimizer=opt, step=1)
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net(), strategy=FSDPOptions(blocks=(Block,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            s.load(root, model=model, optimizer=opt, step=0)
        except ddpkit.DdpkitError as err:
            return str(err)
        return "loaded"


def units_per_model() -> list[list[str]]:
    """Three models in one session: each one's sharded blocks follow its own FSDPOptions (or the session's)."""
    from torch.distributed.fsdp import FSDPModule

    with ddpkit.session(seed=0, verbose=False, strategy=FSDPOptions(min_block_params=10**9)) as s:
        nets = [net(), net(), net()]  # built before s.model, which seeds each rank on its own after
        fine = s.model(nets[0], strategy=FSDPOptions(min_block_params=1))  # every Linear its own unit
        session_default = s.model(nets[1])  # the session's options: no block is large enough
        by_class = s.model(nets[2], strategy=FSDPOptions(blocks=(Block,)))
        return [
            sorted(n for n, m in ddpkit.unwrap(model).named_modules() if n and isinstance(m, FSDPModule))
            for model in (fine, session_default, by_class)
        ]


def background_save_and_load(root: str) -> dict:
    """An FSDP background save (copied shards, saved by the writer), training going on meanwhile, then a load into a
    fresh model: the loaded weights are the ones of the call."""
    from ddpkit.checkpoint import dcp as checkpoint_dcp

    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        first, second = net(), net()  # both before s.model, which seeds each rank on its own after
        model = s.model(first)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = s.loader(data(), batch_size=16, shuffle=True)
        _run(s, model, opt, loader, 2)
        at_call = full_params(model)
        calls = []
        original = checkpoint_dcp.stage

        def counted(*args, **kwargs):
            calls.append(1)
            return original(*args, **kwargs)

        checkpoint_dcp.stage = counted
        try:
            s.save(root, model=model, optimizer=opt, step=2, background=True)
        finally:
            checkpoint_dcp.stage = original
        _run(s, model, opt, loader, 2)  # training goes on while the shards are written
        after = full_params(model)
        changed = any(not torch.equal(at_call[k], after[k]) for k in at_call)
        s.checkpoints.wait()
        fresh = s.model(second)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        s.load(root, model=fresh, optimizer=fresh_opt)
        loaded = full_params(fresh)
        differ = [k for k in at_call if not torch.equal(at_call[k], loaded[k])]
        return {"async": bool(calls), "changed_after": changed, "differ": differ}
