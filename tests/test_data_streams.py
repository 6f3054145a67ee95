"""Iterable sources through `s.loader` on real gloo ranks x DataLoader workers: every sample id counted.

The source yields sample ids 0..n-1 (a torch IterableDataset, no __len__). What a user checks: over all
ranks each id is trained on once per epoch (the tail: at most W - 1 ids twice, or with drop_last the
last incomplete global micro-batch unseen), every rank has as many batches, the order changes with the
epoch, and the batches do not depend on the number of DataLoader workers.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections import Counter
from pathlib import Path

import pytest
import stream_train
import torch
from conftest import REPO, run_cli
from stream_train import Numbers
from torch import nn
from torch.utils.data import IterableDataset

import ddpkit
from ddpkit.verify import VerifySpec, verify

N, PER_RANK = 61, 4  # 61: prime, so the tail is uneven at every world size


def _fork(workers: int) -> dict:
    # the pool's ranks are spawned; fork keeps worker start-up short
    return {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}


def stream_ids(n: int, epochs: int, drop_last: bool) -> dict:
    """Per DataLoader worker count (0, 1, 2): this rank's batches of ids, per epoch."""
    with ddpkit.session(seed=3, verbose=False) as s:
        out = {}
        for workers in (0, 1, 2):
            loader = s.loader(
                Numbers(n),
                per_rank_batch_size=PER_RANK,
                shuffle=True,
                drop_last=drop_last,
                shuffle_buffer=16,
                **_fork(workers),
            )
            out[workers] = [[ids.tolist() for _, ids in loader] for _ in range(epochs)]
        return out


def _check_epoch(per_rank: list[list[list[int]]], world: int, drop_last: bool) -> None:
    counts = {len(batches) for batches in per_rank}
    assert len(counts) == 1, f"ranks have different numbers of batches: {counts}"
    seen = Counter(i for batches in per_rank for batch in batches for i in batch)
    rest = N % (world * PER_RANK)
    if drop_last:
        assert max(seen.values()) == 1 and len(seen) == N - rest
    else:
        twice = math.ceil(rest / world) * world - rest
        assert set(seen) == set(range(N)), f"missing: {set(range(N)) - set(seen)}"
        assert sum(seen.values()) == N + twice and twice <= world - 1


@pytest.mark.parametrize("world", [2, 3])
def test_every_id_once_per_epoch_equal_batches_any_worker_count(world: int, pool2, pool3) -> None:
    results = (pool2 if world == 2 else pool3).run(stream_ids, N, 2, False, timeout=90)
    for workers in (0, 1, 2):
        for epoch in range(2):
            _check_epoch([r[workers][epoch] for r in results], world, drop_last=False)
        assert [r[workers] for r in results] == [r[0] for r in results], "workers changed the batches"
    assert [r[0][0] for r in results] != [r[0][1] for r in results], "same order every epoch"


def test_drop_last_drops_only_the_incomplete_global_batch(pool3) -> None:
    results = pool3.run(stream_ids, N, 1, True, timeout=90)
    for workers in (0, 2):
        _check_epoch([r[workers][0] for r in results], 3, drop_last=True)


def eval_ids(n: int) -> list[list[int]]:
    with ddpkit.session(seed=3, verbose=False) as s:
        loader = s.loader(Numbers(n), per_rank_batch_size=PER_RANK, evaluation=True, **_fork(2))
        return [ids.tolist() for _, ids in loader]


def test_evaluation_reads_every_id_exactly_once(pool3) -> None:
    results = pool3.run(eval_ids, N, timeout=90)
    assert sorted(i for r in results for b in r for i in b) == list(range(N)), "padded or lost"


class Part(IterableDataset):
    """This rank's own ids (r, r+W, ...): a pre-split stream, split over DataLoader workers by itself."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        mine = range(self.rank, N, self.world)
        return iter([(torch.zeros(3), i) for k, i in enumerate(mine) if k % workers == worker])


def presplit_ids(workers: int) -> list[list[list[int]]]:
    with ddpkit.session(seed=3, verbose=False) as s:
        loader = s.loader(
            Part(s.rank, s.world_size),
            per_rank_batch_size=PER_RANK,
            presplit=True,
            shuffle=True,
            shuffle_buffer=8,
            **_fork(workers),
        )
        return [[ids.tolist() for _, ids in loader] for _ in range(2)]


def test_a_presplit_stream_is_shuffled_per_epoch_and_ends_together(pool2) -> None:
    """31 and 30 ids: the ranks end together at 8 batches; shuffle=True reorders every epoch."""
    for workers in (0, 2):
        results = pool2.run(presplit_ids, workers, timeout=90)
        for epoch in range(2):
            assert len({len(r[epoch]) for r in results}) == 1, "ranks have different numbers of batches"
            seen = [i for r in results for b in r[epoch] for i in b]
            assert len(seen) == len(set(seen)) == N, "an id twice or missing"
        assert results[0][0] != results[0][1], "the same order every epoch"


def train_stream(ckpt: str | None, stop_after: int | None, workers: int, batch: int = 12) -> dict:
    """Two epochs of a small model on the stream, global batch `batch`; the ids of every step.

    With `stop_after`, save after that many steps and return; with `ckpt` alone, resume from it first.
    """
    torch.set_num_threads(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), ddpkit.session(seed=0) as s:
        model = s.model(nn.Linear(3, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = s.loader(Numbers(N), batch_size=batch, shuffle=True, shuffle_buffer=16, **_fork(workers))
        step = (
            s.load(ckpt, model=model, optimizer=opt, loader=loader, step=0)["step"]
            if ckpt and stop_after is None
            else 0
        )
        seen = []
        for _ in range(2 - loader.epoch):
            for x, ids in loader:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                s.backward(loss)
                opt.step()
                step += 1
                seen.append(ids.tolist())
                if step == stop_after:
                    s.save(ckpt, model=model, optimizer=opt, loader=loader, step=step)
                    return {"seen": seen}
        params = [p.detach().clone() for p in ddpkit.unwrap(model).parameters()]
        return {"params": params, "seen": seen, "step": step, "out": out.getvalue()}


@pytest.mark.parametrize("workers", [0, 2])
def test_stopped_mid_epoch_and_resumed_ends_bitwise_like_uninterrupted(
    pool2, tmp_path: Path, workers: int
) -> None:
    whole = pool2.run(train_stream, None, None, workers, timeout=90)
    ckpt = str(tmp_path / "ckpt")
    pool2.run(train_stream, ckpt, 7, workers, timeout=90)  # 6 steps per epoch: mid epoch 1
    resumed = pool2.run(train_stream, ckpt, None, workers, timeout=90)
    for got, want in zip(resumed, whole, strict=True):
        assert got["step"] == want["step"] == 12
        assert got["seen"] == want["seen"][7:], "the resumed run read other batches"
        assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"], strict=True))


def test_resumed_at_another_world_size_the_stream_is_re_split_from_the_global_position(
    pool2, tmp_path: Path
) -> None:
    whole = pool2.run(train_stream, None, None, 0, timeout=90)
    ckpt = str(tmp_path / "ckpt")
    pool2.run(train_stream, ckpt, 3, 0, timeout=90)
    alone = train_stream(ckpt, None, 0)  # in this process: world size 1, global batch 12 kept
    assert "stream re-split from global sample 36 over 1 rank(s)" in alone["out"], alone["out"]
    steps = [sorted(a + b) for a, b in zip(whole[0]["seen"], whole[1]["seen"], strict=True)]
    full = [sorted(ids) for ids in alone["seen"] if len(ids) == 12]  # the tails differ: 1 rank pads none
    assert full == [ids for ids in steps[3:] if len(ids) == 12], "the rest of the stream was cut otherwise"


class Once:
    def __iter__(self):
        return self

    def __next__(self):
        raise StopIteration


def test_a_one_pass_iterator_is_refused_with_a_paragraph() -> None:
    with (
        ddpkit.session(env={}, verbose=False) as s,
        pytest.raises(ddpkit.DdpkitError, match="can be read once"),
    ):
        s.loader((i for i in range(4)), batch_size=2)
    with (
        ddpkit.session(env={}, verbose=False) as s,
        pytest.raises(ddpkit.DdpkitError, match="persistent_workers"),
    ):
        s.loader(Numbers(4), batch_size=2, num_workers=1, persistent_workers=True)
    with (
        ddpkit.session(env={}, verbose=False) as s,
        pytest.raises(ddpkit.DdpkitError, match="an iterable has no indices"),
    ):
        s.loader(Numbers(4), batch_size=2, sampler=range(4))


def test_a_position_saved_from_another_kind_of_source_is_refused(tmp_path: Path) -> None:
    with ddpkit.session(env={}, verbose=False) as s:
        s.save(str(tmp_path), loader=s.loader(Numbers(8), batch_size=2))
        mapped = s.loader(list(range(8)), batch_size=2)
        with pytest.raises(ddpkit.DdpkitError, match="of a stream source, this loader reads a map source"):
            s.load(str(tmp_path), loader=mapped)


@pytest.mark.timeout(170)  # above ddpkit run's 150 s below
def test_killed_mid_epoch_and_restarted_ends_bitwise_like_uninterrupted(pool2, tmp_path: Path) -> None:
    """kill -9 of rank 1 at step 8 (epoch 1, 2 DataLoader workers); ddpkit run restarts both ranks,
    which resume from the step-6 checkpoint: the same batches and weights as the uninterrupted run."""
    out = tmp_path / "out"
    out.mkdir()
    done = run_cli(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        str(REPO / "tests" / "stream_train.py"),
        str(tmp_path / "ck"),
        str(out),
        "--every",
        "3",
        "--kill-at",
        "8",
        timeout=150,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "killed.txt").exists() and "resumed from" in done.stdout, done.stdout[-2000:]
    whole = pool2.run(stream_train.train, None, timeout=90)
    for rank, want in enumerate(whole):
        got = torch.load(out / f"rank{rank}.pt", weights_only=True)
        assert got["step"] == want["step"] == 12
        assert got["seen"] == want["seen"][6:], f"rank {rank} read other batches after the restart"
        assert all(torch.equal(got["params"][k], v) for k, v in want["params"].items()), (
            f"rank {rank} weights differ"
        )


class Rows(IterableDataset):
    """A stream of (x, y) rows for `ddpkit verify --data`: 8 features, 3 classes, seeded."""

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for _ in range(96):
            yield torch.randn(8, generator=g), int(torch.randint(0, 3, (1,), generator=g))


def verify_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


@pytest.mark.numerics
def test_verify_reads_an_iterable_data_source(pool2) -> None:
    """verify's single process computes each rank's shard of the global batch: for a stream, the
    contiguous slices ddpkit's loader gives the ranks (a wrong split is reported as data_mismatch)."""
    spec = VerifySpec(model=verify_mlp, data=Rows, optimizer="sgd", steps=6, batch_size=12)
    report = verify(spec, runner=pool2.run)
    assert report.passed and report.replicas_identical, report.render()
    assert "data_mismatch" not in report.render()
