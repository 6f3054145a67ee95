"""A checkpoint's values and weights read offline (`ddpkit.checkpoint.reading.read`), `checkpoint inspect
--values` showing values whole, and `Session.is_main` no longer offered as the guard of a save."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import run_cli
from torch import nn

import ddpkit
from ddpkit.checkpoint import reading

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)
ARGS = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "bias": False, "vocab_size": 50304}


def _save(root: Path) -> nn.Module:
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        model = s.model(nn.Linear(3, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        s.save(root, model=model, optimizer=opt, model_args=ARGS, best=1.25, step=7)
        return model


def test_read_gives_the_values_whole_and_the_weights_without_a_session(tmp_path: Path) -> None:
    model = _save(tmp_path / "ck")
    ckpt = reading.read(tmp_path / "ck")
    assert ckpt.values == {"model_args": ARGS, "best": 1.25, "step": 7}
    assert ckpt.world_size == 1 and ckpt.path.name.startswith("ckpt-")
    assert set(ckpt.weights["model"]) == {"weight", "bias"}
    for key, value in model.state_dict().items():
        assert torch.equal(ckpt.weights["model"][key], value), key  # the same bytes, read back
    assert ckpt.objects["optimizer"]["state"][0]["exp_avg"].shape == (2, 3)
    assert "rng" in ckpt.ranks[0]


def test_inspect_values_shows_each_value_whole(tmp_path: Path) -> None:
    _save(tmp_path / "ck")
    cut = run_cli("checkpoint", "inspect", str(tmp_path / "ck"), timeout=60)
    whole = run_cli("checkpoint", "inspect", "--values", str(tmp_path / "ck"), timeout=60)
    assert cut.returncode == whole.returncode == 0, cut.stderr + whole.stderr
    line = '    model_args = {"bias": false, "block_size": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, '
    assert line + '"vocab_size": 50304}' in whole.stdout, whole.stdout
    assert '"vocab_size": 50304' not in cut.stdout, cut.stdout  # cut to one line without --values


def test_is_main_is_not_offered_as_the_guard_of_a_save() -> None:
    text = ddpkit.Session.is_main.__doc__ or ""
    assert "prints and saves" not in text and "every rank calls those" in text, text
