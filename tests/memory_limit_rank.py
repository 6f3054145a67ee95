"""One rank of the memory-limit proof (tests/test_memory_limit.py): a 99M-parameter MLP (376 MiB of
weights, 1.5 GiB of training state with AdamW) trained for two steps under torchrun.

    DDPKIT_TEST_CGROUP=/sys/fs/cgroup/memory/.../ddpkit-limit torchrun --nproc-per-node 4 \\
        tests/memory_limit_rank.py fsdp OUT_DIR

Before importing torch, the rank moves itself into `$DDPKIT_TEST_CGROUP/rank<LOCAL_RANK>` (a cgroup
with a memory limit), so the kernel, not an assertion, enforces the limit on it. It writes
OUT_DIR/rank<r>.json with its peak RSS when it finishes.

`ddp`: first as a user would, `s.model(build)` with ddpkit's memory check on; the refusal it raises
is written to OUT_DIR/refused<r>.json, with the rank's resident set after it. Then, in the same
session, the check switched off (DDPKIT_MEMORY_CHECK=off), the same model is built again: DDP then
trains until the kernel kills the rank. One launch for both saves a launch's start-up (torch's import
on 4 ranks); the resident set after the refusal shows the refused build was freed (the test checks it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_cgroup = os.environ.get("DDPKIT_TEST_CGROUP")
if _cgroup:  # first thing: everything the rank allocates from here on counts against its limit
    Path(_cgroup, f"rank{os.environ['LOCAL_RANK']}", "cgroup.procs").write_text(str(os.getpid()))

import itertools  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import ddpkit  # noqa: E402
from ddpkit.errors import DdpkitError  # noqa: E402
from ddpkit.strategy import rank_memory  # noqa: E402

# 99M parameters; each 2048x2048 layer (16 MiB) one FSDP unit: small units keep FSDP's gathered
# blocks (its peak above the sharded state) small, so it fits a limit well below DDP's need
WIDTHS = (1024, *[2048] * 24, 10)


def build() -> nn.Module:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def main(strategy: str, out: str, steps: int = 2) -> None:
    with ddpkit.session(seed=0, strategy=strategy) as s:
        if strategy == "ddp":
            error = None
            try:
                s.model(build)
            except DdpkitError as refused:
                error = str(refused)
            # after the refusal (its traceback held the built model): what the refused build left
            rss = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
            Path(out, f"refused{s.rank}.json").write_text(json.dumps({"error": error, "rss": rss}))
            os.environ[rank_memory.OPT_OUT] = "off"  # the check off: DDP tries, and the kernel decides
        model = s.model(build)  # the factory: under FSDP no rank ever holds the whole model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(s.rank)
        losses = []
        for _ in range(steps):
            x, y = torch.randn(8, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (8,), generator=g)
            with s.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                s.backward(loss)
            s.step(opt)
            losses.append(float(s.all_reduce(loss.detach(), op="mean")))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        Path(out, f"rank{s.rank}.json").write_text(json.dumps({"peak_rss": peak, "losses": losses}))
        s.print(f"trained {steps} steps under {s.strategy.describe()}: losses {losses}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
