"""The demo: a small CNN learns scikit-learn's bundled digits (8x8 images) with DDP.

    ddpkit demo                          # 2 CPU ranks with gloo (or one rank per GPU)
    ddpkit run --nproc 3 -m ddpkit.tools.demo  # any launcher works: this module is an ordinary script
    python -m ddpkit.tools.demo                # one process

Written only with ddpkit's public API, as a user's script would be; the loop is `ddpkit.training.fit.fit`, and
rank 0 writes its log to OUT/log.jsonl and, when `tensorboard` is installed, event files to OUT/run
(`tensorboard --logdir OUT/run`). With stdout in a file, progress is one plain line at a time.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.errors import problem
from ddpkit.observe.metrics import Accuracy, MetricSet
from ddpkit.tools.plotting import pyplot
from ddpkit.training.fit import Callback, FitState, fit


class DigitsCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


DEMO_PACKAGES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib"}  # module -> the package to install


def require_demo_packages() -> None:
    """Stop with one paragraph when the demo's own packages are absent: training needs neither, so the core
    install leaves them to the `demo` extra, and a missing one should say so before any rank starts."""
    import importlib.util

    missing = [pkg for module, pkg in DEMO_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        verb = "are" if len(missing) > 1 else "is"
        raise problem(
            f"the demo needs {' and '.join(missing)}, which {verb} not installed: its data set is "
            "scikit-learn's bundled digits and it draws its loss curve with matplotlib; ddpkit's training "
            "itself needs neither, so a plain `pip install ddpkit` leaves them out",
            'Install them with `pip install "ddpkit[demo]"` (this repository\'s scripts/setup.sh does), '
            "then run `ddpkit demo` again",
        )


def digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 digits as (image, label) tensors, split into a train and a held-out test set."""
    require_demo_packages()
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=test_fraction, random_state=seed, stratify=digits.target
    )
    return TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_test], y[idx_test])


def train_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def eval_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], metrics: MetricSet) -> None:
    x, y = batch
    accuracy: Any = metrics["accuracy"]  # the Accuracy that `make_metrics` put there
    accuracy.update(model(x), y)  # correct and total, summed over ranks: every digit once


class EpochReport(Callback):
    """One line per epoch, from global rank 0."""

    def __init__(self, held_out: int) -> None:
        self.held_out = held_out

    def on_epoch_end(self, state: FitState) -> None:
        loss = sum(state.epoch_losses) / max(1, len(state.epoch_losses))
        state.s.print(
            f"epoch {state.epoch}: train loss {loss:.4f}, test accuracy {state.metrics['accuracy']:.2%} "
            f"({self.held_out} held-out digits)"
        )


def train(
    epochs: int = 12, batch_size: int = 64, lr: float = 3e-3, out: str = "ddpkit-demo", precision: str = "32"
) -> dict:
    start = time.perf_counter()
    # TensorBoard events (when installed) go to OUT/run; a new demo in the same OUT replaces the curve
    with ddpkit.session(seed=0, precision=precision, log_dir=os.path.join(out, "run")) as s:
        train_set, test_set = digits_split()
        model = s.model(DigitsCNN())
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        result = fit(
            s,
            model,
            opt,
            s.loader(train_set, batch_size=batch_size, shuffle=True),
            train_step,
            epochs=epochs,
            eval_loader=s.loader(test_set, batch_size=256, evaluation=True),
            eval_step=eval_step,
            metrics={"accuracy": Accuracy()},
            callbacks=[EpochReport(len(test_set))],
            log=os.path.join(out, "log.jsonl"),
        )
        accuracy = result.evals[-1]["accuracy"]
        seconds = time.perf_counter() - start
        if s.is_main:
            path = plot_losses(result.losses, result.steps // max(1, result.epochs), out)
            s.print(
                f"demo: {accuracy:.2%} test accuracy in {seconds:.1f} s on {s.world_size} rank(s); "
                f"loss curve {path}"
            )
    return {"accuracy": accuracy, "seconds": seconds, "losses": result.losses}


def plot_losses(losses: list[float], steps_per_epoch: int, out: str) -> str:
    plt = pyplot()
    os.makedirs(out, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(range(1, len(losses) + 1), losses, lw=1.5, color="#3366cc")
    for e in range(steps_per_epoch, len(losses), steps_per_epoch):
        ax.axvline(e + 0.5, color="#dddddd", lw=0.8, zorder=0)
    ax.set(xlabel="optimizer step (grey lines: epochs)", ylabel="train loss (mean over ranks)", yscale="log")
    ax.set_title("ddpkit demo: CNN on scikit-learn digits")
    fig.tight_layout()
    path = os.path.join(out, "loss.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def launch_demo(ns: argparse.Namespace, make_config: Callable[..., Any]) -> int:
    """`ddpkit demo`: this module through `ddpkit run`, 2 CPU ranks by default (or all GPUs)."""
    from ddpkit.cluster.launch import launch
    from ddpkit.cluster.topology import Hardware

    require_demo_packages()  # before any rank starts, in the launching process
    if ns.nproc is None:
        gpus = Hardware.detect().gpus if ns.device != "cpu" else 0
        ns.nproc = gpus or 2
    start = time.perf_counter()
    code = launch(make_config(ns, "ddpkit.tools.demo", ["--epochs", str(ns.epochs), "--out", ns.out], True))
    print(
        f"ddpkit demo: finished with exit code {code} in {time.perf_counter() - start:.1f} s "
        "(launch included)"
    )
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--out", default="ddpkit-demo")
    parser.add_argument("--precision", default="32", help="32, bf16 or 16 (see ddpkit.parallel.precision)")
    cli = parser.parse_args()
    train(epochs=cli.epochs, out=cli.out, precision=cli.precision)
