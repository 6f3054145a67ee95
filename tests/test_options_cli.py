"""Every flag of `ddpkit run`, `ddpkit demo`, `ddpkit lint`, `ddpkit doctor` and `ddpkit checkpoint` changes
what the command does (tests/options/cli.toml names, for each flag, the test that fails when it is ignored).

`ddpkit run` and `ddpkit demo` are checked at the launcher's boundary: the command line runs in this
process up to the point where torchrun's agent would start the ranks, and the test reads what the agent
was handed (its parsed configuration) and the environment every rank would start with. Real launches of
the same flags are tests/test_launch.py's, tests/test_preemption.py's and tests/test_demo.py's; they take
tens of seconds each, these take milliseconds.
"""

from __future__ import annotations

import json
import os
import socket
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_lint import SAVE
from torch import nn

import ddpkit
from ddpkit import cli as ddpkit_cli
from ddpkit.checkpoint import cli as checkpoint_cli
from ddpkit.names import DEVICE_ENV, PREEMPTION_SIGNAL_ENV, REQUEUE_ENV, SHARE_GPU_ENV
from ddpkit.tools import doctor

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


# -- ddpkit run / ddpkit demo: what torchrun's agent is handed -----------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launched(monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[dict[str, Any], dict[str, str]]:
    """`ddpkit ARGV` run in this process up to torchrun's agent: the agent's parsed configuration and the
    environment the ranks would inherit (the agent itself is not started)."""
    import torch.distributed.run as torchrun

    seen: dict[str, Any] = {}

    def agent(args: Any) -> None:
        seen["config"], seen["env"] = vars(args).copy(), dict(os.environ)

    monkeypatch.setattr(torchrun, "run", agent)
    assert ddpkit_cli.main(list(argv)) == 0
    return seen["config"], seen["env"]


def test_run_options_reach_torchrun_and_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    port = _free_port()
    config, env = _launched(
        monkeypatch,
        "run",
        "--nproc",
        "3",
        "--port",
        str(port),
        "--max-restarts",
        "2",
        "--device",
        "cpu",
        "--share-gpu",
        "--preemption-signal",
        "USR2",
        "--requeue",
        "0",
        "--grace",
        "7",
        str(script),
        "--lr",
        "0.1",
    )
    assert config["nproc_per_node"] == "3" and config["max_restarts"] == 2
    assert config["master_port"] == port and not config["standalone"]
    assert config["shutdown_timeout"] == 7 and "SIGUSR2" in config["signals_to_handle"].split(",")
    assert config["training_script"] == str(script) and config["training_script_args"] == ["--lr", "0.1"]
    assert not config["module"]
    assert env[DEVICE_ENV] == "cpu" and env[SHARE_GPU_ENV] == "1"
    assert env[PREEMPTION_SIGNAL_ENV] == "USR2" and env[REQUEUE_ENV] == "0"


def test_run_module_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = _launched(monkeypatch, "run", "--nproc", "1", "-m", "json.tool", "--sort-keys")
    assert config["module"] and config["training_script"] == "json.tool"
    assert config["training_script_args"] == ["--sort-keys"]


def test_run_node_options_reach_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    endpoint = f"10.0.0.1:{_free_port()}"
    config, _ = _launched(
        monkeypatch,
        "run",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-endpoint",
        endpoint,
        "--local-addr",
        "10.0.0.2",
        str(script),
    )
    assert config["nnodes"] == "2" and config["node_rank"] == 1 and config["rdzv_backend"] == "static"
    assert f"{config['master_addr']}:{config['master_port']}" == endpoint
    assert config["local_addr"] == "10.0.0.2"


def test_run_elastic_options_reach_torchrun_and_the_ranks(tmp_path: Path, monkeypatch) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config, env = _launched(
        monkeypatch,
        "run",
        "--nnodes",
        "1:3",
        "--max-restarts",
        "1",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--rdzv-conf",
        "join_timeout=31",
        "--elastic-batch",
        "accumulation",
        str(script),
    )
    assert config["nnodes"] == "1:3" and config["rdzv_backend"] == "c10d"
    assert config["rdzv_conf"].endswith(",join_timeout=31"), config["rdzv_conf"]  # the user's setting wins
    assert env["DDPKIT_ELASTIC_BATCH"] == "accumulation"


def test_demo_options_reach_torchrun_and_the_demo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    port = _free_port()
    out = str(tmp_path / "curves")
    config, env = _launched(
        monkeypatch,
        "demo",
        "--nproc",
        "3",
        "--epochs",
        "2",
        "--out",
        out,
        "--port",
        str(port),
        "--max-restarts",
        "2",
        "--device",
        "cpu",
        "--share-gpu",
    )
    assert config["nproc_per_node"] == "3" and config["max_restarts"] == 2 and config["master_port"] == port
    assert config["module"] and config["training_script"] == "ddpkit.tools.demo"
    assert config["training_script_args"] == ["--epochs", "2", "--out", out]
    assert env[DEVICE_ENV] == "cpu" and env[SHARE_GPU_ENV] == "1"


def test_demo_node_options_reach_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoint = f"10.0.0.1:{_free_port()}"
    config, _ = _launched(
        monkeypatch, "demo", "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint
    )
    assert config["nnodes"] == "2" and config["node_rank"] == 1
    assert f"{config['master_addr']}:{config['master_port']}" == endpoint


# -- ddpkit lint ------------------------------------------------------------------------------------------


def test_lint_select_keeps_only_the_codes_asked_for(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "train.py"
    bad.write_text(textwrap.dedent(SAVE.format(comment="")))  # DDP006 only
    assert ddpkit_cli.main(["lint", str(bad)]) == 1 and "DDP006" in capsys.readouterr().out
    assert ddpkit_cli.main(["lint", "--select", "DDP007", str(bad)]) == 0
    assert capsys.readouterr().out == ""
    assert ddpkit_cli.main(["lint", "--select", "DDP006", "--ignore", "DDP006", str(bad)]) == 0
    clean = tmp_path / "clean.py"
    clean.write_text("print('hello')\n")
    assert ddpkit_cli.main(["lint", str(clean)]) == 0  # the paths given, not some default


# -- ddpkit doctor ----------------------------------------------------------------------------------------
def test_doctor_no_smoke_starts_no_ranks_and_timeout_bounds_the_smoke_test(capsys) -> None:
    doctor.main(["--no-smoke"])
    assert "smoke test" not in capsys.readouterr().out
    assert doctor.main(["--timeout", "0.5"]) == 1  # 2 new interpreters cannot import torch that fast
    out = capsys.readouterr().out
    assert "FAIL  smoke test (gloo, CPU): SpawnError" in out and "did not finish within" in out, out


# -- ddpkit checkpoint ------------------------------------------------------------------------------------
def _deep() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)))  # 16 tensors: more than inspect lists


def _saved(root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint of two models (`model`, `head`); their weights."""
    with ddpkit.session(env={}, hardware=HW, seed=0, verbose=False, log_to=None) as s:
        model, head = s.model(_deep()), s.model(nn.Linear(4, 3))
        s.save(root, model=model, head=head, step=3)
        return (
            {k: v.clone() for k, v in model.state_dict().items()},
            {k: v.clone() for k, v in head.state_dict().items()},
        )


def test_checkpoint_inspect_all_lists_every_tensor(tmp_path: Path, capsys) -> None:
    _saved(tmp_path / "ckpt")
    assert checkpoint_cli.main(["inspect", str(tmp_path / "ckpt")]) == 0
    short = capsys.readouterr().out
    assert checkpoint_cli.main(["inspect", str(tmp_path / "ckpt"), "--all"]) == 0
    full = capsys.readouterr().out
    assert "7.weight" in full and "7.weight" not in short, short  # the 15th tensor of 16
    assert "step 3" in full


def test_checkpoint_convert_to_model_and_back_with_name_and_step(tmp_path: Path, capsys) -> None:
    model, head = _saved(tmp_path / "ckpt")
    out = tmp_path / "head.bin"  # a torch suffix; --to says safetensors
    to = ["convert", str(tmp_path / "ckpt"), str(out), "--model", "model", "--to", "safetensors"]
    assert checkpoint_cli.main(to) == 0
    assert sorted(load_file(str(out))) == sorted(model)
    assert checkpoint_cli.main(["convert", str(tmp_path / "ckpt"), str(out), "--model", "head"]) == 0
    weights = torch.load(out, weights_only=True)  # OUT's suffix: torch.save
    assert sorted(weights) == sorted(head) and all(torch.equal(weights[k], head[k]) for k in head)
    source = tmp_path / "w.safetensors"
    save_file({k: v + 1 for k, v in head.items()}, str(source))
    back = tmp_path / "back"
    assert checkpoint_cli.main(["convert", str(source), str(back), "--name", "net", "--step", "7"]) == 0
    assert "net=model" in capsys.readouterr().out
    with ddpkit.session(env={}, hardware=HW, seed=1, verbose=False, log_to=None) as s:
        fresh = s.model(nn.Linear(4, 3))
        assert s.load(back, net=fresh, step=0) == {"step": 7}
        assert all(torch.equal(fresh.state_dict()[k], head[k] + 1) for k in head)


def test_checkpoint_convert_to_hf_needs_and_takes_its_config(tmp_path: Path, capsys) -> None:
    _saved(tmp_path / "ckpt")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "custom", "hidden": 4}))
    hf = tmp_path / "hf"
    convert = ["convert", str(tmp_path / "ckpt"), str(hf), "--model", "model"]
    assert checkpoint_cli.main(convert) == 2
    assert "needs its config" in capsys.readouterr().err
    assert checkpoint_cli.main([*convert, "--config", str(config)]) == 0
    assert json.loads((hf / "config.json").read_text())["hidden"] == 4
    assert sorted(load_file(str(hf / "model.safetensors"))) == sorted(_deep().state_dict())
