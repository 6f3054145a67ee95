"""Notice when the public surface changes: the exported names and the CLI's options."""

from __future__ import annotations

import ddpkit
from ddpkit.cli import build_parser


def test_public_names() -> None:
    assert sorted(ddpkit.__all__) == sorted(
        [
            "Accuracy",
            "Callback",
            "CheckpointError",
            "DDPOptions",
            "DdpkitError",
            "FSDPOptions",
            "FitResult",
            "FitState",
            "Global",
            "HSDPOptions",
            "Hardware",
            "Mean",
            "MetricSet",
            "Placement",
            "Session",
            "ShmAllReduce",
            "SpawnError",
            "SpikeGuard",
            "StepInfo",
            "StepMonitor",
            "Sum",
            "TPOptions",
            "__version__",
            "evaluate",
            "fit",
            "seed_everything",
            "session",
            "spawn",
            "to_device",
            "unwrap",
        ]
    )


def _options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {opt for action in sub.choices[command]._actions for opt in action.option_strings}


def test_run_options_are_torchrun_compatible() -> None:
    assert _options("run") == {
        "-h",
        "--help",
        "--nproc",
        "--nnodes",
        "--node-rank",
        "--rdzv-endpoint",
        "--port",
        "--max-restarts",
        "--device",
        "--share-gpu",
        "-m",
        "--preemption-signal",
        "--requeue",
        "--grace",
        "--rdzv-conf",
        "--local-addr",  # torchrun's own names
        "--elastic-batch",  # ddpkit's: which batch an elastic job keeps at fewer nodes
    }


def test_tools_receive_their_own_options(capsys) -> None:
    import pytest

    from ddpkit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--help"])
    assert exit_info.value.code == 0 and "--model" in capsys.readouterr().out


def test_every_lazy_public_name_resolves_where_it_lives_now() -> None:
    """`ddpkit.X` imports X's module on first use: a module that moved must not leave a name behind
    (`ddpkit.ShmAllReduce` pointed at a moved module and failed only when a tool first used it)."""
    import importlib

    for name, home in ddpkit._HOME.items():
        assert getattr(importlib.import_module(f"ddpkit.{home}"), name) is getattr(ddpkit, name), name
