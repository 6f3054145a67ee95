"""Every flag of `ddpkit plan` and `ddpkit plan --memory` changes the plan (tests/options/cli.toml).

`ddpkit plan` is run in this process on a saved profile (`--profile`: no measurement), so that each flag
costs a few milliseconds; the flags that steer the measurement itself (--steps, --repeats, --threads,
--device) run one real profile of a tiny workload that counts the processes it was built in. The memory
plan runs on fake tensors in this process (`ddpkit.plan.memory`), on models small enough to take well
under a second each.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_options_cli_tools import COUNT_DIR_ENV, built_in
from test_plan import MB, _collectives_json, _profile
from torch import nn

from ddpkit.plan import cli

BATCHES = (8, 16, 32, 64)  # cnn's global batch is 64: the weak-scaling default


def _profiles(path: Path, *, beside: bool = False) -> Path:
    """An earlier plan's JSON: synthetic profiles at each batch (and, `beside`, two ranks computing at
    once, 1.5x slower)."""
    made = {
        str(b): _profile(
            [0.004 * b / 8, 0.006 * b / 8], [4 * MB, 4 * MB], batch=b, forward=0.001 * b
        ).as_dict()
        for b in BATCHES
    }
    data: dict[str, Any] = {"profiles": made}
    if beside:
        slow = _profile([0.05, 0.08], [4 * MB, 4 * MB], batch=64, forward=0.1, backward=0.2, optimizer=0.01)
        data["beside"] = {"2": slow.as_dict()}
    path.write_text(json.dumps(data))
    return path


def _plan(tmp_path: Path, capsys, *args: str, beside: bool = False) -> dict[str, Any]:
    """`ddpkit plan --workload cnn ARGS --json -` on the saved profiles; the plan."""
    profile = _profiles(tmp_path / "earlier.json", beside=beside)
    code = cli.main(["--workload", "cnn", "--profile", str(profile), *args, "--json", "-"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_plan_workload_and_its_alias_model_name_what_is_planned(tmp_path: Path, capsys) -> None:
    assert _plan(tmp_path, capsys)["workload"] == "cnn"
    assert _plan(tmp_path, capsys, "--workload", "mlp")["workload"] == "mlp"
    assert _plan(tmp_path, capsys, "--model", "mlp")["workload"] == "mlp"


def test_plan_profile_is_the_saved_one_not_a_new_measurement(tmp_path: Path, capsys) -> None:
    plan = _plan(tmp_path, capsys)
    saved = json.loads((tmp_path / "earlier.json").read_text())["profiles"]
    assert plan["profiles"] == saved and plan["profiles"]["64"]["workload"] == "synthetic"


def test_plan_counts_max_gpus_and_gpus_per_node_shape_the_curve(tmp_path: Path, capsys) -> None:
    assert _plan(tmp_path, capsys)["counts"] == [1, 2, 4, 8]
    assert _plan(tmp_path, capsys, "--max-gpus", "4")["counts"] == [1, 2, 4]
    assert _plan(tmp_path, capsys, "--counts", "1,3")["counts"] == [1, 3]
    nodes = [r["nodes"] for r in _plan(tmp_path, capsys, "--gpus-per-node", "2")["curve"]]
    assert nodes == [1, 1, 2, 4]


def test_plan_link_intra_and_nics_per_node_are_the_links_simulated(tmp_path: Path, capsys) -> None:
    base = _plan(tmp_path, capsys, "--gpus-per-node", "2")
    assert "InfiniBand NDR" in " ".join(base["link"])
    hdr = _plan(tmp_path, capsys, "--gpus-per-node", "2", "--link", "ib-hdr")
    assert "InfiniBand HDR" in " ".join(hdr["link"]) and hdr["link_name"] == "ib-hdr"
    intra = _plan(tmp_path, capsys, "--gpus-per-node", "2", "--intra", "pcie4")
    assert intra["link"][0].startswith("intra-node: PCIe 4.0"), intra["link"]
    one_nic = _plan(tmp_path, capsys, "--gpus-per-node", "2", "--nics-per-node", "1")
    assert "1 NIC(s) per node" in " ".join(one_nic["link"])
    assert one_nic["curve"][-1]["comm_s"] > base["curve"][-1]["comm_s"]  # 8 ranks on 4 nodes share 1 NIC


def test_plan_algorithm_is_the_one_simulated(tmp_path: Path, capsys) -> None:
    for algorithm in ("ring", "tree"):
        curve = _plan(tmp_path, capsys, "--gpus-per-node", "2", "--algorithm", algorithm)["curve"]
        assert {r["algorithm"] for r in curve if r["n"] > 1} == {algorithm}, curve


def test_plan_step_options_are_the_options_simulated(tmp_path: Path, capsys) -> None:
    base = _plan(tmp_path, capsys)
    assert base["options"] == {
        "bucket_cap_mb": 25.0,
        "hook": "none",
        "powersgd_rank": 1,
        "strategy": "ddp",
        "accumulation": 1,
        "sharded_step": False,
    }
    asked = _plan(
        tmp_path,
        capsys,
        "--bucket-cap-mb",
        "5",
        "--hook",
        "powersgd",
        "--powersgd-rank",
        "4",
        "--accumulation",
        "2",
        "--sharded-step",
        "on",
    )
    assert asked["options"] == {**base["options"], "bucket_cap_mb": 5.0, "hook": "powersgd"} | {
        "powersgd_rank": 4,
        "accumulation": 2,
        "sharded_step": True,
    }
    assert asked["curve"][-1]["step_s"] != base["curve"][-1]["step_s"]
    fsdp = _plan(tmp_path, capsys, "--strategy", "fsdp")
    assert fsdp["options"]["strategy"] == "fsdp" and fsdp["curve"][-1]["comm_s"] > base["curve"][-1]["comm_s"]


def test_plan_batch_size_and_global_batch_set_the_per_rank_batch(tmp_path: Path, capsys) -> None:
    per_rank = _plan(tmp_path, capsys, "--counts", "1,2,4", "--batch-size", "16")["curve"]
    assert [r["per_rank_batch"] for r in per_rank] == [16, 16, 16]
    split = _plan(tmp_path, capsys, "--counts", "1,2,4", "--global-batch", "32")["curve"]
    assert [r["per_rank_batch"] for r in split] == [32, 16, 8]


def test_plan_compute_scale_divides_the_profiled_compute(tmp_path: Path, capsys) -> None:
    base = _plan(tmp_path, capsys)
    fast = _plan(tmp_path, capsys, "--compute-scale", "4")
    assert "compute divided by 4 for the target device" in fast["profiled_on"]
    assert fast["curve"][0]["step_s"] == pytest.approx(base["curve"][0]["step_s"] / 4, rel=1e-6)


def test_plan_device_memory_decides_the_memory_advice(tmp_path: Path, capsys) -> None:
    roomy = " ".join(a["what"] for a in _plan(tmp_path, capsys)["advice"])
    assert "of 80 GB per device" in roomy and "DDP fits" in roomy
    tight = " ".join(a["what"] for a in _plan(tmp_path, capsys, "--device-memory", "0.01")["advice"])
    assert "does not fit 0.01 GB per device" in tight, tight


def test_plan_contention_measured_or_by_formula(tmp_path: Path, capsys) -> None:
    coll = tmp_path / "coll.json"
    _collectives_json(coll, n_list=(2,))
    args = ("--counts", "1,2", "--link", f"measured:{coll}")
    measured = _plan(tmp_path, capsys, *args, beside=True)
    assert "profiled with n ranks computing at once" in measured["assumptions"][0]
    formula = _plan(tmp_path, capsys, *args, "--contention", "formula", beside=True)
    assert "slows by max(1, ranks x threads / cores)" in formula["assumptions"][0]
    assert formula["curve"][1]["step_s"] < measured["curve"][1]["step_s"]  # the saved 2-rank profile is slow


def test_plan_list_links_prints_the_presets_and_plans_nothing(tmp_path: Path, capsys) -> None:
    assert cli.main(["--list-links", "--profile", str(tmp_path / "none.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nvlink4: ") and "ib-ndr: " in out and "measured[:collectives.json]" in out


def test_plan_measurement_steps_repeats_and_threads(tmp_path: Path, capsys, monkeypatch) -> None:
    """One real profile of a tiny workload: --repeats fresh processes built it, each timed --steps steps
    on --threads threads."""
    monkeypatch.setenv(COUNT_DIR_ENV, str(tmp_path / "counts"))
    code = cli.main(
        [
            "--workload",
            "test_options_cli_tools:counting",
            "--max-gpus",
            "2",
            "--link",
            "ib-hdr",
            "--steps",
            "2",
            "--repeats",
            "2",
            "--threads",
            "3",
            "--json",
            "-",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    plan = json.loads(out.out)
    (profile,) = plan["profiles"].values()
    assert len(profile["step_s"]) == 2 and profile["threads"] == 3 and profile["device"] == "cpu"
    assert plan["repeats"] == 2 and len(built_in(tmp_path / "counts", other_than_this_process=True)) == 2


def test_plan_device_is_the_device_profiled(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv(COUNT_DIR_ENV, str(tmp_path / "counts"))
    args = [
        "--workload",
        "test_options_cli_tools:counting",
        "--max-gpus",
        "1",
        "--steps",
        "1",
        "--repeats",
        "1",
    ]
    code = cli.main([*args, "--device", "cuda", "--json", "-"])
    out = capsys.readouterr()
    if torch.cuda.is_available():
        assert code == 0 and json.loads(out.out)["profiled_on"].startswith("cuda"), out.err
    else:  # no GPU here: asked for one, the plan says so instead of timing the CPU
        assert code == 2 and "--device cuda" in out.err and "no visible GPU" in out.err, out.err


# -- ddpkit plan --memory ---------------------------------------------------------------------------------
class Blocks(nn.Module):
    """Four equal blocks (what activation checkpointing's "auto" finds) over 64 features."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(4)
        )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def sample(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 64, generator=generator), torch.randint(0, 10, (n,), generator=generator)


MODEL = ("--model", "test_options_cli_plan:Blocks", "--sample", "test_options_cli_plan:sample")


def _memory(capsys, *args: str) -> dict[str, Any]:
    """`ddpkit plan --memory ARGS --json -`: the memory plan."""
    code = cli.main(["--memory", *args, "--json", "-"])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def test_memory_model_and_sample_are_the_model_estimated(capsys) -> None:
    plan = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8")
    assert plan["model"] == "test_options_cli_plan:Blocks"
    assert plan["parameters"] == sum(p.numel() for p in Blocks().parameters())
    assert cli.main(["--memory", "--model", "test_options_cli_plan:Blocks", "--world", "2"]) == 2
    assert "--sample" in capsys.readouterr().err  # a plain nn.Module needs its sample


def test_memory_world_global_and_micro_batch_make_the_step(capsys) -> None:
    plan = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8")
    assert (plan["global_batch"], plan["micro_batch"], plan["accumulation"]) == (8, 4, 1)
    micro = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8", "--micro-batch", "2")
    assert (micro["micro_batch"], micro["accumulation"]) == (2, 2)
    assert micro["breakdown"]["activations"] < plan["breakdown"]["activations"]
    four = _memory(capsys, *MODEL, "--world", "4", "--global-batch", "8", "--strategy", "fsdp")
    two = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8", "--strategy", "fsdp")
    assert four["breakdown"]["parameters"] < two["breakdown"]["parameters"]  # FSDP divides it by the world


def test_memory_strategy_and_shard_degree_divide_the_model_state(capsys) -> None:
    args = (*MODEL, "--world", "8", "--global-batch", "8")
    ddp = _memory(capsys, *args)["breakdown"]["parameters"]
    fsdp = _memory(capsys, *args, "--strategy", "fsdp")["breakdown"]["parameters"]
    hsdp2 = _memory(capsys, *args, "--strategy", "hsdp", "--shard-degree", "2")["breakdown"]["parameters"]
    hsdp4 = _memory(capsys, *args, "--strategy", "hsdp", "--shard-degree", "4")["breakdown"]["parameters"]
    assert fsdp < hsdp4 < hsdp2 < ddp
    assert hsdp2 == pytest.approx(2 * hsdp4, rel=0.05) and hsdp4 == pytest.approx(2 * fsdp, rel=0.05)


def test_memory_precision_optimizer_and_checkpointing_change_the_breakdown(capsys) -> None:
    args = (*MODEL, "--world", "2", "--global-batch", "1024")  # micro-batch 512: activations at the peak
    base = _memory(capsys, *args)["breakdown"]
    bf16 = _memory(capsys, *args, "--precision", "bf16")
    assert "bf16" in bf16["job"] and bf16["breakdown"]["activations"] < base["activations"]
    sgd = _memory(capsys, *args, "--optimizer", "sgd")["breakdown"]
    assert sgd["optimizer_state"] < base["optimizer_state"]  # AdamW keeps two moments
    recomputed = _memory(capsys, *args, "--activation-checkpointing", "auto")
    assert recomputed["breakdown"]["activations"] < base["activations"], recomputed["job"]


def test_memory_seq_len_sets_the_tokens_per_sample(capsys) -> None:
    model = ("--model", "hf:gpt2,n_layer=1,n_embd=32,n_head=2,vocab_size=128,n_positions=256")
    short = _memory(capsys, *model, "--world", "1", "--global-batch", "2", "--seq-len", "16")
    long = _memory(capsys, *model, "--world", "1", "--global-batch", "2", "--seq-len", "128")
    assert "sequence 16" in short["job"] and "sequence 128" in long["job"]
    assert long["breakdown"]["activations"] > 4 * short["breakdown"]["activations"]


def test_memory_device_and_device_memory_are_the_capacity(capsys) -> None:
    named = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8", "--device", "a100-40gb")
    assert named["device"]["name"].lower().startswith("a100"), named["device"]
    custom = _memory(capsys, *MODEL, "--world", "2", "--global-batch", "8", "--device-memory", "0.5")
    assert custom["device"]["memory"] == 500_000_000 and custom["device"]["source"] == "--device-memory"


def test_memory_json_to_a_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "memory.json"
    assert cli.main(["--memory", *MODEL, "--world", "2", "--global-batch", "8", "--json", str(path)]) == 0
    assert f"json: {path}" in capsys.readouterr().out and json.loads(path.read_text())["micro_batch"] == 4
