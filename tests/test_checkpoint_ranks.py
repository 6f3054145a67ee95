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
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s, pytest.raises(CheckpointError, match="is a file"):
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
