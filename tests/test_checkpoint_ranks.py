"""What a checkpoint root may hold, and per-rank state in shared objects: real files, real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.checkpoint.files import CheckpointError

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


# -- a checkpoint root that holds something else ------------------------------------------------------
def _resume(root: Path) -> dict:
    model = nn.Linear(3, 2)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        return s.load(root, model=model, step=0)


def test_a_file_another_tool_wrote_is_refused_at_load_not_taken_for_a_fresh_start(tmp_path: Path) -> None:
    snapshot = tmp_path / "gpt_snapshot.pt"  # minGPT's snapshot_path, written by the original script
    torch.save({"MODEL_STATE": nn.Linear(3, 2).state_dict(), "EPOCHS_RUN": 4}, snapshot)
    with pytest.raises(CheckpointError) as err:
        _resume(snapshot)
    text = str(err.value)
    assert "gpt_snapshot.pt is a file" in text and "torch.save" in text, text
    assert "Pass a new or empty folder" in text and "weights=" in text, text
    assert "\n" not in text  # one paragraph
    with (
        ddpkit.session(env={}, hardware=HW, verbose=False) as s,
        pytest.raises(CheckpointError, match="is a file"),
    ):
        s.save(snapshot, model=nn.Linear(3, 2), step=1)  # and a save says the same, not "[Errno 17]"


def test_a_folder_of_unrelated_files_is_refused_and_an_empty_or_new_one_starts_fresh(tmp_path: Path) -> None:
    other = tmp_path / "outputs"
    (other / "logs").mkdir(parents=True)
    (other / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"outputs is a folder of 2 other entries \(logs/, notes.txt\)"):
        _resume(other)
    (tmp_path / "empty").mkdir()
    assert _resume(tmp_path / "empty") == {"step": 0}
    assert _resume(tmp_path / "new") == {"step": 0}
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.save(tmp_path / "new", model=nn.Linear(3, 2), step=5)
    (tmp_path / "new" / "export").mkdir()  # other things beside the checkpoints are fine
    assert _resume(tmp_path / "new") == {"step": 5}


# -- per-rank state in an object of the user's own ------------------------------------------------------
class Stream:
    """A per-rank stream position of the user's own (not a DataLoader): state_dict/load_state_dict."""

    def __init__(self, position: int) -> None:
        self.position = position

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


class SharedStream(Stream):
    ddpkit_per_rank = False  # explicit: one copy (rank 0's), no check


def save_and_resume(root: str, kind: str) -> tuple[int, str]:
    """Rank r saves position 100 + 10 r (twice), then loads into a fresh object: (loaded, printed)."""
    import contextlib
    import io

    import torch.distributed as dist

    cls = SharedStream if kind == "marked shared" else Stream
    start = 100 + (10 * dist.get_rank() if kind != "same" else 0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), ddpkit.session(seed=0, verbose=True) as s:
        stream = cls(start)
        s.save(root, stream=stream, step=1)
        s.save(root, stream=stream, step=2)
        fresh = cls(0)
        assert s.load(root, stream=fresh, step=0) == {"step": 2}
    return fresh.position, printed.getvalue()


@pytest.mark.timeout(120)
def test_an_object_whose_state_differs_between_ranks_comes_back_per_rank(pool2, tmp_path: Path) -> None:
    (p0, out), (p1, _) = pool2.run(save_and_resume, str(tmp_path / "ckpt"), "differs")
    assert (p0, p1) == (100, 110)  # rank 1 saved 110 and loads 110, not rank 0's 100
    said = [line for line in out.splitlines() if "is saved per rank" in line]
    assert len(said) == 1, out  # one line, once a session
    assert "stream= (Stream) is saved per rank: its state differs between the ranks" in said[0]
    assert "ddpkit_per_rank = True" in said[0]
    import json

    manifest = json.loads((tmp_path / "ckpt" / "ckpt-000002" / "manifest.json").read_text())
    assert manifest["objects"]["per_rank"] == ["stream"] and manifest["objects"]["shared"] == []
    # at another world size it is refused, as a stateful loader is
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s, pytest.raises(ddpkit.DdpkitError) as err:
        s.load(tmp_path / "ckpt", stream=Stream(0))
    text = str(err.value)
    assert "stream= (Stream) was saved per rank at world size 2" in text and "Resume at world size 2" in text


@pytest.mark.timeout(120)
def test_the_same_state_stays_one_copy_and_a_mark_says_which(pool2, tmp_path: Path) -> None:
    (p0, out), (p1, _) = pool2.run(save_and_resume, str(tmp_path / "same"), "same")
    assert (p0, p1) == (100, 100) and "is saved per rank" not in out, out
    (p0, out), (p1, _) = pool2.run(save_and_resume, str(tmp_path / "marked"), "marked shared")
    assert (p0, p1) == (100, 100) and "is saved per rank" not in out, out  # ddpkit_per_rank = False: rank 0's
