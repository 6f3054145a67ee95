"""Issue 21, item 1: FSDP builds the model shard by shard, and the shards are one process's weights.

`s.model(Net, strategy="fsdp")` runs the constructor on the meta device and gives each tensor its
values one at a time (`ddpkit.strategy.fsdp_init`); each rank keeps only its chunk. The tests gather
the shards once and compare them with `torch.manual_seed(0); Net()` built in the same process: the same
CPU kernels on the same generator stream, so equal bit for bit by construction (no tolerance).
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from fsdp_init_ranks import different_seeds_factory, export_streamed, initial, meta_module, trains

from ddpkit.strategy import fsdp_init


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.numerics
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("factory", ["net", "mixed"])
def test_factory_built_shards_are_one_process_initial_weights(pool2, pool3, world: int, factory: str) -> None:
    results = (pool2 if world == 2 else pool3).run(initial, factory, factory == "net")
    for rank, r in enumerate(results):
        assert _differ(r["fsdp"], r["one"]) == [], f"rank {rank} of {world}: initial weights differ"
        assert r["local"] <= r["total"] // world + 64, f"rank {rank} holds more than its share"


@pytest.mark.numerics
def test_a_model_built_whole_is_cut_into_the_same_shards(pool3) -> None:
    for r in pool3.run(initial, "mixed", False, True):
        assert _differ(r["fsdp"], r["one"]) == []


def _one_process_losses() -> list[float]:
    """The same training in one plain process: seed 0, the 6 global batches of 16 in order, clipping."""
    import torch.nn.functional as F
    from fsdp_train import data, net

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in torch.utils.data.DataLoader(data(), batch_size=16):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.numerics
def test_factory_built_model_trains_like_one_process_on_the_global_batch(pool2) -> None:
    # Each rank's loss over its 8 samples, averaged across the ranks, against one process's loss over
    # the same 16 samples on weights trained the same way: equal within rounding only when the ranks'
    # gradients were averaged every step (the averaged losses agree across ranks by construction,
    # so comparing the ranks with each other proves nothing).
    losses = pool2.run(trains)
    want = _one_process_losses()
    assert len(losses[0]) == len(want) == 6
    assert losses[0] == pytest.approx(want, rel=1e-4), (losses[0], want)
    assert want[-1] < want[0]


def test_ranks_that_draw_different_weights_are_a_clear_error(pool2) -> None:
    for message in pool2.run(different_seeds_factory):
        assert "different initial weights" in message and "seed" in message


def test_a_meta_module_without_its_factory_is_a_clear_error(pool2) -> None:
    for message in pool2.run(meta_module):
        assert "meta device" in message and "s.model(Net" in message


@pytest.mark.numerics
def test_build_keeps_a_quarter_and_leaves_the_generator_as_one_process_does() -> None:
    from ddpkit.tools import workloads

    torch.manual_seed(0)
    workloads.load("mlp").build()
    after_one_process = torch.rand(4)
    torch.manual_seed(0)
    module, shards, _ = fsdp_init.build(workloads.load("mlp").build, rank=1, world=4)
    assert torch.equal(torch.rand(4), after_one_process), "the generator was consumed otherwise"
    sizes = sorted(p.numel() * p.element_size() for p in module.parameters())
    assert all(p.is_meta for p in module.parameters())
    # memory itself (not build's own counter, `peak`): test_no_rank_ever_holds_the_whole_model_measured_by_the_kernel
    mine = sum(c.numel() * c.element_size() for c in shards.chunks.values())
    assert mine <= sum(sizes) / 4 * 1.01  # dim-0 chunks: uneven only by a row


@pytest.mark.numerics
def test_streamed_export_is_the_full_model(pool3, tmp_path) -> None:
    from fsdp_init_ranks import Mixed
    from safetensors.torch import load_file

    counts = pool3.run(export_streamed, str(tmp_path))
    streamed = load_file(tmp_path / "streamed.safetensors")
    gathered = load_file(tmp_path / "gathered.safetensors")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        one_process = {k: v.clone() for k, v in Mixed().state_dict().items()}  # never sharded, same seed
    one_process = {k: v for k, v in one_process.items() if k in streamed}  # BatchNorm's counter aside
    assert counts[0] == len(streamed) and set(one_process) == set(streamed)
    assert _differ(streamed, one_process) == []  # the streamed export is one process's model, bitwise
    assert _differ(streamed, gathered) == []  # s.export writes the same file
    Mixed().load_state_dict(streamed)  # a plain module reads it


RSS_JOB = """
import torch, ddpkit
from torch import nn

def kib(key):  # this process's resident memory as the kernel counts it, not ddpkit's own bookkeeping
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def big():  # 48 x 4 MiB weight matrices: 192 MiB
    return nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(48)])

with ddpkit.session(seed=0, verbose=False) as s:
    s.model(lambda: nn.Sequential(nn.Linear(8, 8)), strategy="fsdp")  # torch's one-time costs (~90 MiB)
    torch.manual_seed(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident size
    before = kib("VmRSS")
    model = s.model(big, strategy="fsdp")
    print(f"RANK {s.rank} GREW {kib('VmHWM') - before} MODEL {sum(p.numel() * 4 for p in model.parameters())}",
          flush=True)
"""


def test_no_rank_ever_holds_the_whole_model_measured_by_the_kernel(tmp_path: Path) -> None:
    # Each of 4 ranks builds a 192 MiB model through s.model(factory, strategy="fsdp"); the kernel's
    # peak resident size of each rank (VmHWM, reset just before) must stay well under the model: its
    # quarter plus the quarter being copied into FSDP's shards (measured 96-98 MiB; building the whole
    # model with factory() first: 247 MiB).
    # Known gap (issue 28, measured 2026-11-25): the FIRST s.model of a process is built before FSDP's
    # wrap sets cpu_allocator.return_freed_blocks(), so glibc's dynamic mmap threshold fragments the
    # heap with the freed temporaries: first-build growth 195-465 MiB per rank (one-time costs of ~90
    # MiB included), 179-180 MiB with return_freed_blocks() called before the build. The small model
    # built first here pays torch's one-time costs and sets that allocator mode.
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(RSS_JOB))
    done = run_cli("run", "--nproc", "4", str(script), timeout=90, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    grew = {
        int(r): (int(g), int(m)) for r, g, m in re.findall(r"RANK (\d) GREW (\d+) MODEL (\d+)", done.stdout)
    }
    assert sorted(grew) == [0, 1, 2, 3], done.stdout
    for rank, (growth, model) in grew.items():
        assert model == 48 * 2**22
        assert growth < 0.75 * model, (
            f"rank {rank}: peak RSS grew {growth / 2**20:.0f} MiB for a {model / 2**20:.0f} MiB model"
        )
