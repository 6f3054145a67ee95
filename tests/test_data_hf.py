"""Hugging Face `datasets` and torchdata through ddpkit on real gloo ranks (the real packages, data the
test writes; nothing from the hub). Every sample id is counted over the ranks, per epoch.

- map-style `Dataset` (dict rows, with_format("torch"), a collator): every id once per epoch; one cut
  by `split_dataset_by_node` and declared `presplit=True` is never split again.
- streaming (`to_iterable_dataset`, `load_dataset("json", ..., streaming=True)` on local files): split
  by HF's own `split_dataset_by_node` (by shard file when they divide over the ranks, else by example),
  every rank's epoch ended at the shortest rank's last batch; resumed mid-epoch, the same batches.
- stateful loaders (torchdata `StatefulDataLoader`, an HF `IterableDataset`): each rank saves and loads
  its own position; at another world size they are refused.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import Dataset, load_dataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

import ddpkit

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchdata's set_vital deprecation

N = 48


def rows(n: int = N) -> Dataset:
    return Dataset.from_dict({"id": list(range(n)), "x": [[i / n] * 3 for i in range(n)]})


def collate(batch: list[dict]) -> dict:
    """A collator as users write them: dict rows to a dict of stacked tensors."""
    return {"id": torch.stack([r["id"] for r in batch]), "x": torch.stack([r["x"] for r in batch])}


def _fork(workers: int) -> dict:
    return {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}


def map_ids(presplit: bool) -> list[list[list[int]]]:
    with ddpkit.session(seed=2, verbose=False) as s:
        ds = rows().with_format("torch")
        if presplit:
            ds = split_dataset_by_node(ds, rank=s.rank, world_size=s.world_size)
        loader = s.loader(ds, per_rank_batch_size=4, shuffle=True, collate_fn=collate, presplit=presplit)
        return [[b["id"].tolist() for b in loader] for _ in range(2)]


@pytest.mark.parametrize("presplit", [False, True])
def test_map_style_every_id_once_per_epoch(pool2, presplit: bool) -> None:
    results = pool2.run(map_ids, presplit)
    for epoch in range(2):
        assert len({len(r[epoch]) for r in results}) == 1
        ids = sorted(i for r in results for b in r[epoch] for i in b)
        assert ids == list(range(N)), "an id twice or missing: split twice?" if presplit else ""
    assert results[0][0] != results[0][1], "the same order every epoch"


def write_shards(folder: str, sizes: list[int]) -> list[str]:
    """JSON-lines files of consecutive ids, one per size (the stream's shard files)."""
    paths, start = [], 0
    for k, size in enumerate(sizes):
        path = Path(folder) / f"part-{k}.jsonl"
        path.write_text(
            "".join(json.dumps({"id": i, "x": [i / N] * 3}) + "\n" for i in range(start, start + size))
        )
        paths.append(str(path))
        start += size
    return paths


def hf_stream(source: str, files: list[str], rank: int = 0, world: int = 1):
    if source == "files":
        return load_dataset("json", data_files=files, split="train", streaming=True).with_format("torch")
    stream = rows().to_iterable_dataset(num_shards=4).with_format("torch")
    if source == "split":  # cut by the user: detected, never split again
        return split_dataset_by_node(stream.shuffle(seed=2, buffer_size=8), rank=rank, world_size=world)
    return stream


def stream_ids(source: str, files: list[str], workers: int, shuffle: bool = True) -> list[list[list[int]]]:
    with ddpkit.session(seed=2, verbose=False) as s:
        loader = s.loader(
            hf_stream(source, files, s.rank, s.world_size),
            per_rank_batch_size=4,
            shuffle=shuffle and source != "split",
            shuffle_buffer=8,
            **_fork(workers),
        )
        return [[b["id"].tolist() for b in loader] for _ in range(2)]


@pytest.mark.parametrize(
    ("source", "world", "workers"), [("memory", 2, 2), ("files", 2, 0), ("memory", 3, 1), ("split", 2, 0)]
)
def test_streaming_every_id_once_per_epoch(
    pool2, pool3, tmp_path: Path, source: str, world: int, workers: int
) -> None:
    files = write_shards(str(tmp_path), [12, 12, 12, 12])
    results = (pool2 if world == 2 else pool3).run(stream_ids, source, files, workers, timeout=90)
    for epoch in range(2):
        assert len({len(r[epoch]) for r in results}) == 1, "ranks have different numbers of batches"
        assert sorted(i for r in results for b in r[epoch] for i in b) == list(range(N))
    assert results[0][0] != results[0][1], "the same order every epoch"


def test_uneven_shards_end_every_rank_at_the_shortest_ranks_last_batch(pool2, tmp_path: Path) -> None:
    files = write_shards(str(tmp_path), [18, 14, 10, 6])
    held = [
        sum(1 for _ in split_dataset_by_node(hf_stream("files", files), rank=r, world_size=2)) for r in (0, 1)
    ]
    assert held[0] != held[1], f"both ranks hold {held}: the test would not exercise the tail rule"
    results = pool2.run(stream_ids, "files", files, 0, False, timeout=90)  # unshuffled: the parts are `held`
    per_rank = [sum(len(b) for b in r[0]) for r in results]
    assert len({len(r[0]) for r in results}) == 1, "ranks have different numbers of batches"
    seen = Counter(i for r in results for b in r[0] for i in b)
    assert max(seen.values()) == 1, "an id twice"
    shortest = min(-(-h // 4) for h in held)  # batches of 4 in the shortest rank's part
    assert len(seen) == sum(per_rank) == sum(min(h, 4 * shortest) for h in held), (held, per_rank)


def train_stream(
    source: str, files: list[str], ckpt: str | None, stop_after: int | None, verbose: bool = False
) -> dict:
    torch.set_num_threads(1)
    with ddpkit.session(seed=0, verbose=verbose) as s:
        model = s.model(torch.nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = s.loader(hf_stream(source, files), batch_size=8, shuffle=True, shuffle_buffer=8)
        step = (
            s.load(ckpt, model=model, optimizer=opt, loader=loader, step=0)["step"]
            if ckpt and stop_after is None
            else 0
        )
        seen = []
        for _ in range(2 - loader.epoch):
            for b in loader:
                opt.zero_grad()
                s.backward(model(b["x"].float()).pow(2).mean())
                opt.step()
                step, _ = step + 1, seen.append(b["id"].tolist())
                if step == stop_after:
                    s.save(ckpt, model=model, optimizer=opt, loader=loader, step=step)
                    return {}
        return {"seen": seen, "params": [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]}


def test_streaming_resumed_mid_epoch_ends_bitwise_like_uninterrupted(pool2, tmp_path: Path, capsys) -> None:
    files = write_shards(str(tmp_path), [12, 12, 12, 12])
    whole = pool2.run(train_stream, "files", files, None, None, timeout=90)
    ckpt = str(tmp_path / "ckpt")
    pool2.run(train_stream, "files", files, ckpt, 8, timeout=90)  # 6 steps per epoch: mid epoch 1
    resumed = pool2.run(train_stream, "files", files, ckpt, None, timeout=90)
    for got, want in zip(resumed, whole, strict=True):
        assert got["seen"] == want["seen"][8:]
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"], strict=True))
    alone = train_stream("files", files, ckpt, None, True)  # in this process: world size 1
    out = capsys.readouterr().out
    assert (
        "pre-split source: world size 2 -> 1: each rank's position belonged to its old part, so epoch 1 restarts"
        in out
    ), out
    assert sorted(i for b in alone["seen"] for i in b) == list(range(N)), "epoch 1 was not read whole"


def stateful(ckpt: str, stop_after: tuple[int, ...] | None, workers: int) -> dict:
    """The user's own StatefulDataLoader over this rank's part of an HF stream, saved with s.save after
    `stop_after[rank]` batches (each rank at its own position; None: loaded and read to the end)."""
    with ddpkit.session(seed=0, verbose=False) as s:
        part = split_dataset_by_node(hf_stream("memory", []), rank=s.rank, world_size=s.world_size)
        loader = StatefulDataLoader(part, batch_size=3, **_fork(workers))
        if stop_after is None:
            s.load(ckpt, loader=loader)
        seen = []
        for b in loader:
            seen.append(b["id"].tolist())
            if stop_after is not None and len(seen) == stop_after[s.rank]:
                s.save(ckpt, loader=loader)
                break
        return {"seen": seen}


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumes_at_each_ranks_own_position(
    pool2, tmp_path: Path, workers: int
) -> None:
    ckpt = str(tmp_path / "ckpt")
    # The ranks save at positions of their own (2 and 4 batches of 3 into their 24 ids): a rank handed
    # another rank's position (rank 0's, say) would repeat or skip ids of its own part.
    first = pool2.run(stateful, ckpt, (2, 4), workers, timeout=90)
    rest = pool2.run(stateful, ckpt, None, workers, timeout=90)
    assert first[0]["seen"] != first[1]["seen"], "the ranks read the same part"
    assert [len(r["seen"]) for r in first] == [2, 4]
    for a, b in zip(first, rest, strict=True):
        ids = [i for batch in a["seen"] + b["seen"] for i in batch]
        assert sorted(ids) == sorted(set(ids)) and len(ids) == N // 2, "a rank resumed at another's position"
    assert [len(r["seen"]) for r in rest] == [6, 4]
    with pytest.raises(ddpkit.DdpkitError, match="holds a position in each rank's own stream"):
        stateful(ckpt, None, 0)  # in this process: world size 1
