"""FSDP2 behind the same session: the README loop, identical norms, sharded state, checkpoints that reshard.

Each test runs real gloo ranks (the shared pools); rank functions live in tests/fsdp_train.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fsdp_train import (
    ddp_checkpoint_into_fsdp,
    different_init,
    evaluate_in_one_process,
    fit_and_evaluate,
    net,
    resumable,
    train,
    units_per_model,
)
from safetensors.torch import load_file

pytestmark = pytest.mark.numerics  # .ci/run runs these again under ATEN_CPU_CAPABILITY=default


def _close(a: dict, b: dict, tol: float = 1e-5) -> list[str]:
    return [k for k in a if not torch.allclose(a[k], b[k], rtol=tol, atol=tol)]


def test_readme_loop_under_fsdp_matches_ddp_within_tolerance(pool2) -> None:
    fsdp = pool2.run(train, "fsdp")
    ddp = pool2.run(train, "ddp")
    assert [r["strategy"] for r in fsdp] == ["fsdp", "fsdp"]
    assert fsdp[0]["norms"] == fsdp[1]["norms"], "the clipped norm differs between ranks"
    assert len(fsdp[0]["norms"]) == 6
    # reduce-scatter vs all-reduce: a different summation order, so a tolerance, not bitwise
    assert torch.allclose(torch.tensor(fsdp[0]["norms"]), torch.tensor(ddp[0]["norms"]), rtol=1e-4)
    assert _close(fsdp[0]["params"], ddp[0]["params"]) == []
    total = sum(p.numel() for p in net().parameters())
    assert all(r["local"] <= total // 2 + 64 for r in fsdp), "a rank holds more than its half"


def test_different_initial_weights_are_a_clear_error(pool2) -> None:
    messages = pool2.run(different_init)
    for message in messages:
        assert "different initial weights" in message and "seed" in message


def test_each_model_keeps_its_own_fsdp_options(pool2) -> None:
    fine, session_default, by_class = pool2.run(units_per_model)[0]
    assert "1.lin" in fine and "0" in fine  # min_block_params=1: the Linears are units of their own
    assert (
        session_default == []
    )  # the session's min_block_params=1e9: only the root, not the previous model's
    assert by_class == ["1", "2", "3"]  # blocks=(Block,)


def test_fit_and_evaluate_with_unequal_eval_shards(pool2) -> None:
    results = pool2.run(fit_and_evaluate)
    assert results[0]["metrics"] == results[1]["metrics"]
    # each of the 37 samples counted exactly once: the same numbers as one process over the whole set
    want = evaluate_in_one_process(results[0]["params"])
    got = results[0]["metrics"]
    assert got["accuracy"] * 37 == pytest.approx(want["accuracy"] * 37, abs=1e-6), (got, want)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), (got, want)


def test_resume_at_the_same_world_size_is_bitwise(pool2, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    straight = pool2.run(resumable, str(tmp_path / "unused"), None, False)
    pool2.run(resumable, root, 3, False)
    resumed = pool2.run(resumable, root, None, True)
    for rank in (0, 1):
        for name, value in straight[rank]["params"].items():
            assert torch.equal(value, resumed[rank]["params"][name]), f"rank {rank}: {name} differs"
        for (k, a), (_, b) in zip(straight[rank]["moments"], resumed[rank]["moments"], strict=True):
            assert torch.equal(a, b), f"rank {rank}: AdamW moment of {k} differs"
    manifest = (next(Path(root).glob("ckpt-*")) / "manifest.json").read_text()
    assert "dcp/__1_0.distcp" in manifest and "dcp/.metadata" in manifest


def test_export_is_the_full_model(pool2, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = pool2.run(resumable, root, 2, False)
    exported = load_file(f"{root}/export/model.safetensors")
    plain = net()
    plain.load_state_dict(exported)  # a plain module reads it, keys without any prefix
    assert _close(exported, saved[0]["params"], tol=0) == []


def test_ddp_optimizer_state_loads_into_fsdp(pool2, tmp_path: Path) -> None:
    """A DDP checkpoint with its optimizer resumes under FSDP (the optimizer state cut into each rank's
    shards); tests/test_checkpoint_portable.py compares the values."""
    assert pool2.run(ddp_checkpoint_into_fsdp, str(tmp_path / "ckpt")) == ["loaded", "loaded"]


def test_resume_from_two_ranks_on_three(pool2, pool3, tmp_path: Path) -> None:
    root = str(tmp_path / "ckpt")
    saved = pool2.run(resumable, root, 2, False)
    resumed = pool3.run(resumable, root, 2, True)  # nothing left to train: the loaded state itself
    for rank in range(3):
        assert _close(resumed[rank]["params"], saved[0]["params"], tol=0) == [], (
            "weights changed in resharding"
        )


@pytest.mark.parametrize("world", [2, 3])
def test_verify_fsdp_against_one_process(pool2, pool3, world: int) -> None:
    from fsdp_train import data

    from ddpkit.verify import VerifySpec, verify

    spec = VerifySpec(
        model=net, data=data, optimizer="adamw", steps=6, batch_size=12, nproc=world, strategy="fsdp"
    )
    report = verify(spec, runner=(pool2 if world == 2 else pool3).run)
    text = report.render()
    assert report.passed and report.replicas_identical, text
    # the report names what ran on the ranks: FSDP, not DDP
    assert text.startswith(f"ddpkit verify: FSDP on {world} ranks vs 1 process"), text.splitlines()[0]
    assert "verdict: PASS, FSDP trains the same weights as one process" in text, text.splitlines()[-1]


class _Planted:
    def __reduce__(self):
        import os

        return (os.system, ("echo planted > /dev/null",))


def test_dcp_metadata_reader_refuses_anything_but_dcp_classes(tmp_path: Path) -> None:
    import io
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from ddpkit.checkpoint.dcp import MetadataUnpickler
    from ddpkit.checkpoint.files import CheckpointError

    good = MetadataUnpickler(io.BytesIO(pickle.dumps(Metadata(state_dict_metadata={})))).load()
    assert isinstance(good, Metadata)
    with pytest.raises(CheckpointError, match="refused unread"):
        MetadataUnpickler(io.BytesIO(pickle.dumps(_Planted()))).load()
