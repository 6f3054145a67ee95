"""`ddpkit lint`, this round: the rules for iterable datasets (DDP013) and reentrant activation
checkpointing (DDP014), the lines ddpkit recommends that were reported (DDP003, DDP009), and the
package's own imports (no cycle inside ddpkit/lint/). Static: nothing is imported from the scripts.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ddpkit.lint import lint_source

ROOT = Path(__file__).resolve().parents[1]


def test_the_lint_package_imports_one_way() -> None:
    """The registry imports the rule modules and the rule modules import `Rule` from `rule.py`: no
    module of ddpkit/lint/ reaches itself through its imports (it did through rules.py before)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    mods = import_graph.modules(ROOT / "ddpkit")
    edges = {
        name: import_graph.imports_of(name, path) & mods.keys()
        for name, path in mods.items()
        if name.startswith("ddpkit.lint")
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert len(edges) >= 10
    assert [m for m in edges if m in reach(m)] == []


def codes(source: str) -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in lint_source(textwrap.dedent(source), "train.py")]


SESSION = """
    import torch, torch.nn.functional as F
    import ddpkit

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        opt = torch.optim.AdamW(model.parameters())
        for x, y in s.loader(data, batch_size=64):
            logits = model(x)
            LINE
            s.step(opt)
"""


def test_the_recommended_token_weighted_line_is_not_a_summed_loss() -> None:
    """The README's own line (issue 28: it was reported as DDP003): s.backward rescales the summed
    gradients to the global token mean. The same sum without `tokens=` is still the trap."""
    line = 's.backward(F.cross_entropy(logits, y, reduction="sum"), tokens=(y != -100).sum())'
    assert codes(SESSION.replace("LINE", line)) == []
    assert codes(SESSION.replace("LINE", line.replace(", tokens=(y != -100).sum()", ""))) == [("DDP003", 10)]


TORCH = """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = DEVICE
    model = DDP(Net().to(device))
"""


def test_the_recommended_device_is_not_a_hard_coded_gpu() -> None:
    """docs/lint.md's own fix for DDP009 was reported as DDP009 (found by tests/test_lint_docs.py)."""
    assert codes(TORCH.replace("DEVICE", 'torch.device("cuda", local_rank)')) == []
    assert codes(TORCH.replace("DEVICE", "torch.device('cuda', index=local_rank)")) == []
    assert codes(TORCH.replace("DEVICE", 'torch.device("cuda")')) == [("DDP009", 6)]


# -- DDP013: an IterableDataset every rank reads whole ---------------------------------------------------

STREAM = """
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Stream(IterableDataset):
        def __init__(self, path):
            self.path = path

        def __iter__(self):
            BODY

    dist.init_process_group("gloo")
    model = DDP(Net())
    for x in DataLoader(Stream("tokens.bin"), batch_size=8, num_workers=4):
        model(x).sum().backward()
"""
PLAIN = "yield from read_tokens(self.path)"


def test_iterable_dataset_read_whole_by_every_rank() -> None:
    assert codes(STREAM.replace("BODY", PLAIN)) == [("DDP013", 10)]
    subclass = STREAM.replace(
        "class Stream(IterableDataset):",
        "class Base(IterableDataset):\n        pass\n\n    class Stream(Base):",
    )
    assert codes(subclass.replace("BODY", PLAIN)) == [("DDP013", 13)]
    one_process = STREAM.replace(
        '    dist.init_process_group("gloo")\n    model = DDP(Net())\n', "    model = Net()\n"
    ).replace("    from torch.nn.parallel import DistributedDataParallel as DDP\n", "")
    assert codes(one_process.replace("BODY", PLAIN)) == []


def test_iterable_dataset_that_splits_itself_or_is_split_before() -> None:
    split_here = [
        "info = get_worker_info()\n            yield from read_tokens(self.path)[info.id :: info.num_workers]",
        "yield from read_tokens(self.path)[dist.get_rank() :: dist.get_world_size()]",
        "yield from self.mine()\n\n        def mine(self):\n            return shard(self.path, dist.get_rank())",
        "yield from by_rank(self.path)\n\n    def by_rank(p):\n        return read(p)[int(os.environ['RANK'])::2]",
    ]
    for body in split_here:
        assert codes(STREAM.replace("BODY", body)) == [], body
    init = STREAM.replace("self.path = path", "self.path, self.rank = path, dist.get_rank()")
    assert codes(init.replace("BODY", PLAIN)) == []
    plain = STREAM.replace("BODY", PLAIN)
    split_before = [
        ('Stream("tokens.bin")', "Stream(files[rank::world_size])"),
        (
            'DataLoader(Stream("tokens.bin")',
            'DataLoader(split_dataset_by_node(Stream("tokens.bin"), rank=r, world_size=w)',
        ),
        (
            'DataLoader(Stream("tokens.bin")',
            'DataLoader(ShardedStream(Stream("tokens.bin"), dist.get_rank())',
        ),
    ]
    for old, new in split_before:
        assert codes(plain.replace(old, new)) == [], new


def test_iterable_dataset_given_to_ddpkits_loader_is_not_reported() -> None:
    """s.loader splits an iterable source over ranks and workers itself (issue 31)."""
    source = STREAM.replace("BODY", PLAIN).replace(
        '    dist.init_process_group("gloo")\n    model = DDP(Net())\n    for x in DataLoader(Stream("tokens.bin"), batch_size=8, num_workers=4):',
        '    import ddpkit\n    s = ddpkit.session()\n    model = s.model(Net())\n    for x in s.loader(Stream("tokens.bin"), batch_size=8):',
    )
    assert "s.loader(Stream" in source
    assert codes(source) == []
    assert codes(source.replace("s.loader(", "DataLoader(")) == [("DDP013", 10)]


class WholeStream(IterableDataset):
    def __iter__(self) -> Iterator[int]:  # ddpkit: noqa: DDP013 (the trap, run on purpose below)
        yield from range(8)


class SplitStream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # workers have no process group
        yield from range(rank * workers + worker, 8, world * workers)


def read_stream(split: bool) -> list[int]:
    """On a pool rank: the sample ids this rank's DataLoader (2 workers) yields, gathered over ranks."""
    stream = SplitStream() if split else WholeStream()
    loader = DataLoader(
        stream, batch_size=2, num_workers=2, multiprocessing_context="fork"
    )  # fork: no re-import
    seen = [int(v) for batch in loader for v in batch]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    return sorted(v for part in everyone for v in part)


def test_the_trap_is_real_on_gloo_ranks(pool2) -> None:
    """What DDP013 claims, on 2 real ranks x 2 DataLoader workers: every sample 4 times, once when split."""
    assert pool2.run(read_stream, False, timeout=120)[0] == sorted(list(range(8)) * 4)
    assert pool2.run(read_stream, True, timeout=120)[0] == list(range(8))


# -- DDP014: reentrant activation checkpointing under DDP -------------------------------------------------

CKPT = """
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.utils.checkpoint import checkpoint
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(4))

        def forward(self, x):
            for block in self.blocks:
                x = CALL
            return x

    dist.init_process_group("gloo")
    model = DDP(Net())
"""


def test_reentrant_checkpointing_under_ddp() -> None:
    for call in (
        "checkpoint(block, x)",
        "checkpoint(block, x, use_reentrant=True)",
        "torch.utils.checkpoint.checkpoint_sequential(block, 2, x)",
    ):
        assert codes(CKPT.replace("CALL", call)) == [("DDP014", 13)], call
    for call in ("checkpoint(block, x, use_reentrant=False)", "checkpoint(block, x, **options)", "block(x)"):
        assert codes(CKPT.replace("CALL", call)) == [], call
    plain = CKPT.replace("CALL", "checkpoint(block, x)")
    assert codes(plain.replace("DDP(Net())", "DDP(Net(), static_graph=True)")) == []  # DDP supports it then
    assert codes(plain.replace("model = DDP(Net())", "fully_shard(Net())")) == []  # not DDP's trap
    assert codes(plain.replace('    dist.init_process_group("gloo")\n    model = DDP(Net())\n', "")) == []
    session = plain.replace(
        'dist.init_process_group("gloo")\n    model = DDP(Net())',
        "import ddpkit\n    s = ddpkit.session()\n    model = s.model(Net())",
    )
    assert codes(session) == [("DDP014", 13)]
    assert codes(session.replace("s.model(Net())", 's.model(Net(), strategy="fsdp")')) == []
    assert codes(session.replace("ddpkit.session()", 'ddpkit.session(strategy="fsdp")')) == []


def test_reentrant_checkpoint_wrappers_and_hugging_face() -> None:
    wrapper = CKPT.replace("CALL", "block(x)") + (
        "    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, CheckpointImpl\n"
        "    wrapped = checkpoint_wrapper(Block(), checkpoint_impl=CheckpointImpl.REENTRANT)\n"
    )
    assert codes(wrapper) == [("DDP014", 19)]
    assert codes(wrapper.replace("CheckpointImpl.REENTRANT", "CheckpointImpl.NO_REENTRANT")) == []
    hf = CKPT.replace("CALL", "block(x)") + (
        '    model.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})\n'
    )
    assert codes(hf) == [("DDP014", 18)]
    assert codes(hf.replace("True})", "False})")) == []


def checkpointed_replicas(reentrant: bool) -> bool:
    """On a pool rank: a layer checkpointed twice under DDP, other data per rank, two SGD steps;
    do the replicas still hold the same weights?"""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = checkpoint(self.a, x, use_reentrant=reentrant)
            return self.head(checkpoint(self.a, h, use_reentrant=reentrant))

    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 8, generator=data, requires_grad=True)).sum().backward()
        opt.step()
        opt.zero_grad()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    both = [torch.zeros_like(weights) for _ in range(2)]
    dist.all_gather(both, weights)
    return bool(torch.equal(both[0], both[1]))


def test_the_checkpointing_trap_is_real_on_gloo_ranks(pool2) -> None:
    """What DDP014 claims: reentrant checkpointing of a layer used twice leaves the DDP replicas with
    other weights, silently; use_reentrant=False keeps them equal."""
    assert pool2.run(checkpointed_replicas, True, timeout=120) == [False, False]
    assert pool2.run(checkpointed_replicas, False, timeout=120) == [True, True]
