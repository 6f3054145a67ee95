"""`ddpkit checkpoint inspect` and `convert`: offline, from checkpoints DDP, FSDP and one process wrote.

The ranks train and save with real gloo groups (the shared pools); inspect and convert then run in this
process or a fresh interpreter, with no process group. The converted weights are the trained ones (the
full parameters the ranks gathered), so the forward of a model loaded from the converted file equals the
forward of a model holding the trained weights, computed here on the same kernels: equal by construction.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, run_marked
from fsdp_train import Block, data, full_params, net
from safetensors import safe_open
from safetensors.torch import load_file

import ddpkit
from ddpkit.checkpoint import convert
from ddpkit.checkpoint.files import CheckpointError
from ddpkit.strategy import FSDPOptions

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)
X = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))


# -- rank functions (run in the pools) ------------------------------------------------------------
def train_and_save(strategy: str, root: str, steps: int = 3) -> dict[str, torch.Tensor]:
    """A few AdamW steps under `strategy`, then s.save; the trained full weights (every rank)."""
    with ddpkit.session(seed=0, verbose=False, strategy=strategy) as s:
        options = FSDPOptions(blocks=(Block,)) if strategy == "fsdp" else None
        model = s.model(net(), strategy=options) if options else s.model(net())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = s.loader(data(), batch_size=12, shuffle=True)
        it = iter(loader)
        for _ in range(steps):
            x, y = next(it)
            s.backward(F.cross_entropy(model(x), y))
            s.step(opt)
        s.save(root, model=model, optimizer=opt, loader=loader, step=steps)
        return full_params(model)


def save_large(root: str, tensors: int, width: int) -> int:
    """An FSDP checkpoint of `tensors` square weights (no training): the bytes of the model."""
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width, bias=False) for _ in range(tensors)]
        model = s.model(torch.nn.Sequential(*layers), strategy=FSDPOptions(blocks=(torch.nn.Linear,)))
        s.save(root, model=model, step=0)
    return tensors * width * width * 4


def _forward(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    model = net()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(X)


def _converted_forward_equals_trained(
    ckpt: Path, trained: dict[str, torch.Tensor], tmp: Path, command: bool = True
) -> None:
    """`ddpkit checkpoint convert` (`command`: the command line, else its function in this process) and
    `convert.to_torch` give the trained weights."""
    out = tmp / "model.safetensors"
    if command:
        done = run_cli("checkpoint", "convert", str(ckpt), str(out), timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"wrote {len(trained)} tensors to {out}" in done.stdout
    else:
        assert convert.to_safetensors(ckpt, out) == (out, len(trained))
    converted = load_file(str(out))
    assert sorted(converted) == sorted(trained)
    assert all(torch.equal(converted[k], trained[k]) for k in trained)
    assert torch.equal(_forward(converted), _forward(trained))
    as_torch, _ = convert.to_torch(ckpt, tmp / "model.pt")
    assert torch.equal(_forward(torch.load(as_torch, weights_only=True)), _forward(trained))


@pytest.mark.timeout(180)
def test_ddp_two_ranks_converts_to_the_trained_weights(pool2, tmp_path: Path) -> None:
    trained = pool2.run(train_and_save, "ddp", str(tmp_path / "ckpt"))[0]
    _converted_forward_equals_trained(tmp_path / "ckpt", trained, tmp_path)


@pytest.mark.timeout(180)
def test_fsdp_two_ranks_converts_from_its_shards_with_no_process_group(pool2, tmp_path: Path) -> None:
    trained = pool2.run(train_and_save, "fsdp", str(tmp_path / "ckpt"))[0]
    _converted_forward_equals_trained(tmp_path / "ckpt", trained, tmp_path)
    # inspect and convert leave torch.distributed untouched (a laptop with no process group): in a process
    # of its own, forked from the suite's warm start (torch imported, no group ever made there)
    script = tmp_path / "offline.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "from ddpkit.checkpoint import convert, inspect\n"
        f"text, ok = inspect.report({str(tmp_path / 'ckpt')!r})\n"
        f"convert.to_safetensors({str(tmp_path / 'ckpt')!r}, {str(tmp_path / 'again.safetensors')!r})\n"
        "print(ok, dist.is_initialized())\n"
        "print(text)\n"
    )
    done = run_marked([sys.executable, str(script)], timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    ok_line, text = out.split("\n", 1)
    assert ok_line == "True False", out
    assert "step 3, written by fsdp at world size 2" in text
    assert "model (sharded: dcp/): 10 tensors, 1,028 numbers" in text, text
    assert re.search(r"\n    0\.weight +\[16, 8\] +float32\n", text), text
    assert "optimizer (sharded optimizer: dcp/): 30 tensors (exp_avg, exp_avg_sq, step)" in text, text
    assert re.search(
        r"loader \(per rank\): rank 0: epoch 0, sample \d+; rank 1: epoch 0, sample \d+", text
    ), text
    assert "checksums: all 9 files hold" in text, text


@pytest.mark.timeout(240)
def test_fsdp_four_ranks_and_one_process_convert_alike(pool4, tmp_path: Path) -> None:
    # the conversions in this process (the command line's is the two-rank tests'): one launch fewer each
    trained = pool4.run(train_and_save, "fsdp", str(tmp_path / "four"))[0]
    _converted_forward_equals_trained(tmp_path / "four", trained, tmp_path, command=False)
    one = train_and_save("single", str(tmp_path / "one"))  # this process: no group, the plain strategy
    _converted_forward_equals_trained(tmp_path / "one", one, tmp_path, command=False)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.timeout(180)
def test_a_checkpoint_whose_checksum_fails_is_reported_and_never_converted(pool2, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    pool2.run(train_and_save, "fsdp", str(root), 1)
    pool2.run(train_and_save, "fsdp", str(root), 2)
    newest = root / "ckpt-000002"
    shard = newest / "dcp" / "__1_0.distcp"
    _flip(shard, shard.stat().st_size // 2)
    done = run_cli("checkpoint", "convert", str(root), str(tmp_path / "out.safetensors"))
    assert done.returncode == 2 and not (tmp_path / "out.safetensors").exists()
    message = done.stderr.strip()
    assert f"refused {newest}" in message and "__1_0.distcp does not match its SHA-256" in message, message
    assert "ckpt-000001 verifies: pass it to use that one" in message and "\n" not in message, message
    looked = run_cli("checkpoint", "inspect", str(root))
    assert looked.returncode == 1 and "checksums: 1 of 9 files FAIL" in looked.stdout, looked.stdout
    with pytest.raises(CheckpointError, match="refused"):
        convert.to_hf(newest, tmp_path / "hf", config=tmp_path / "none.json")  # the checksums come first


@pytest.mark.timeout(240)
def test_hf_gpt2_to_a_folder_from_pretrained_loads_and_back_into_a_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from hf_ranks import config

    ids = torch.randint(3, 50, (2, 12), generator=torch.Generator().manual_seed(1))
    with ddpkit.session(env={}, hardware=HW, seed=0, verbose=False) as s:
        model = s.model(lambda: transformers.GPT2LMHeadModel(config("gpt2")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            s.backward(model(input_ids=ids, labels=ids).loss)
            s.step(opt)
        s.save(tmp_path / "ckpt", model=model, optimizer=opt, step=2)
        s.export(str(tmp_path / "export"), model)  # the folder whose config.json the conversion takes
        model.eval()
        with torch.no_grad():
            trained = model(input_ids=ids).logits
    done = run_cli(
        "checkpoint",
        "convert",
        str(tmp_path / "ckpt"),
        str(tmp_path / "hf"),
        "--config",
        str(tmp_path / "export"),
    )
    assert done.returncode == 0, done.stderr
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained)
    # back: the HF folder becomes a checkpoint that s.load resumes
    done = run_cli("checkpoint", "convert", str(tmp_path / "hf"), str(tmp_path / "back"), "--step", "2")
    assert done.returncode == 0 and "s.load(" in done.stdout, done.stderr
    with ddpkit.session(env={}, hardware=HW, seed=1, verbose=False) as s:
        fresh = s.model(lambda: transformers.GPT2LMHeadModel(config("gpt2")))
        assert s.load(tmp_path / "back", model=fresh, step=0) == {"step": 2}
        fresh.eval()
        with torch.no_grad():
            assert torch.equal(fresh(input_ids=ids).logits, trained)


def test_back_from_a_safetensors_file_resumes_under_fsdp_too(pool2, tmp_path: Path) -> None:
    weights = {k: torch.randn_like(v) for k, v in net().state_dict().items()}
    from safetensors.torch import save_file

    save_file(weights, str(tmp_path / "w.safetensors"))
    convert.from_weights(tmp_path / "w.safetensors", tmp_path / "ckpt", step=7)
    got = pool2.run(_load_fsdp, str(tmp_path / "ckpt"))
    for step, params in got:
        assert step == 7 and all(torch.equal(params[k], weights[k]) for k in weights)


def _load_fsdp(root: str) -> tuple[int, dict[str, torch.Tensor]]:
    with ddpkit.session(seed=0, verbose=False, strategy="fsdp") as s:
        model = s.model(net(), strategy=FSDPOptions(blocks=(Block,)))
        step = s.load(root, model=model, step=0)["step"]
        return step, full_params(model)


PEAK = """
import resource, sys
from ddpkit.checkpoint import convert
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert.to_safetensors(sys.argv[1], sys.argv[2])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
"""


@pytest.mark.timeout(240)
def test_convert_holds_one_tensor_at_a_time_not_the_model(pool2, tmp_path: Path) -> None:
    """A 128 MiB FSDP checkpoint of 16 tensors of 8 MiB: the conversion's peak memory grows by a few
    tensors (the one read, DCP's read buffer, what the first read imports; 34-45 MiB measured), never by
    the model (docs/fault-tolerance.md quotes this test's print)."""
    size = pool2.run(save_large, str(tmp_path / "big"), 16, 1448)[0]
    tensor = size // 16
    code = "import ddpkit.checkpoint.convert, torch.distributed.checkpoint\n" + PEAK
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "big"), str(tmp_path / "big.safetensors")],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr
    grew = int(done.stdout.split()[-1])
    print(
        f"peak RSS growth {grew / 2**20:.1f} MiB converting {size / 2**20:.0f} MiB ({tensor / 2**20:.1f} MiB a tensor)"
    )
    assert (tmp_path / "big.safetensors").stat().st_size > size
    assert grew < size / 2, f"grew {grew / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB model"
    with safe_open(str(tmp_path / "big.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and len(f.keys()) == 16


def test_a_swapped_export_call_is_refused_with_the_order_named(tmp_path: Path) -> None:
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(torch.nn.Linear(3, 2))
        with pytest.raises(
            ddpkit.DdpkitError, match=r"path first, then the model.*s\.export\('runs/final', model\)"
        ):
            s.export(model, str(tmp_path / "w.safetensors"))  # type: ignore[arg-type]
        s.export(str(tmp_path / "w.safetensors"), model)
    assert set(load_file(tmp_path / "w.safetensors")) == {"weight", "bias"}
