"""A sharded checkpoint's per-rank digests: kept at the save, checked at the load, shown by inspect.

Real gloo ranks save FSDP (2 ranks) and HSDP (2 replicas x 2 shards, 4 ranks) checkpoints; each rank's
shard file is hashed as it is written and its SHA-256 recorded in the manifest. Then one byte of one rank's
shard file is flipped on disk (a disk or copy fault): `ddpkit checkpoint inspect` lists every rank's file
with its digest and marks that one FAIL; a load of that checkpoint is refused on every rank with one
paragraph naming the rank, the file and the fix; a load of the folder resumes from the checkpoint before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint import cli, files
from ddpkit.checkpoint.files import CheckpointError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def _save(root: str, strategy: str) -> None:
    """Two checkpoints (steps 1 and 2) of a model and its AdamW state, sharded by `strategy`."""
    from ddpkit.strategy.hsdp_options import HSDPOptions

    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        chosen = HSDPOptions(replicate=2, shard=2) if strategy == "hsdp" else strategy
        model = s.model(_net(), strategy=chosen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in (1, 2):
            s.backward(model(torch.randn(4, 8)).square().mean())
            s.step(opt)
            s.save(root, model=model, optimizer=opt, step=step)


def _load(path: str, strategy: str) -> dict:
    """Load `path` (a checkpoint or a folder of them) on every rank: the step it resumed at, or the error."""
    from ddpkit.strategy.hsdp_options import HSDPOptions

    with ddpkit.session(seed=0, verbose=False, log_to=None) as s:
        chosen = HSDPOptions(replicate=2, shard=2) if strategy == "hsdp" else strategy
        model = s.model(_net(), strategy=chosen)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            return {"step": s.load(path, model=model, optimizer=opt, step=0)["step"], "error": ""}
        except ddpkit.DdpkitError as err:  # rank 0's CheckpointError; the others learn it from rank 0
            return {"step": None, "error": str(err)}


def _flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("strategy", "world"), [("fsdp", 2), ("hsdp", 4)])
def test_a_corrupted_shard_is_shown_refused_by_rank_and_the_load_falls_back(
    strategy: str, world: int, pool2, pool4, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = pool2 if world == 2 else pool4
    root = tmp_path / "ckpt"
    pool.run(_save, str(root), strategy, timeout=180)
    newest = files.candidates(root)[0]
    manifest = files.verify(newest).manifest
    shards = {files.shard_rank(n): e for n, e in manifest["files"].items() if files.shard_rank(n) is not None}
    assert sorted(shards) == list(range(world)) and all(len(e["sha256"]) == 64 for e in shards.values())
    assert cli.main(["inspect", str(root)]) == 0  # every rank's digest listed, all holding
    shown = capsys.readouterr().out
    assert "shards (each rank's file, SHA-256 at the save):" in shown
    for rank, entry in shards.items():
        assert f"rank {rank}  dcp/__{rank}_0.distcp" in shown and entry["sha256"][:16] in shown

    _flip_one_byte(newest / "dcp" / "__1_0.distcp")  # rank 1's shards
    assert cli.main(["inspect", str(newest)]) == 1
    shown = capsys.readouterr().out
    assert "rank 1  dcp/__1_0.distcp" in shown and shown.count("FAIL") == 2, shown  # its line, the summary
    with pytest.raises(CheckpointError, match=rf"rank 1 of {world} wrote at step 2") as refused:
        files.verify(newest)
    text = str(refused.value)
    assert (
        "__1_0.distcp does not match its SHA-256" in text and "restore ckpt-000002/dcp/__1_0.distcp" in text
    )
    assert "\n" not in text

    explicit = pool.run(_load, str(newest), strategy, timeout=180)
    assert all(r["step"] is None and f"rank 1 of {world} wrote" in r["error"] for r in explicit), explicit
    folder = pool.run(_load, str(root), strategy, timeout=180)
    assert [r["step"] for r in folder] == [1] * world, folder  # the checkpoint before it
