"""`ddpkit lint`: no false finding on real DDP scripts, exactly the seeded finding on broken variants.

The real scripts are third-party files kept verbatim in tests/lint_corpus (see its NOTICE.md); each
seeded variant is derived from one of them at test time by a textual edit that plants one trap. The
small scripts below pin what ddpkit's own API handles (no finding) and the edge cases of each rule.
Everything here is static: nothing is imported from the scripts, no process starts.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddpkit.cli import main as ddpkit_main
from ddpkit.lint import all_rules, lint_source

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "lint_corpus"
PX = "pytorch_examples/distributed"

# Every real script and what it must give. The three findings are true: imagenet/main.py's
# non-distributed multi-GPU branch uses torch.nn.DataParallel (lines 191, 194), so does timm's
# validate.py with --num-gpu > 1 (line 269).
REAL = {
    f"{PX}/ddp/example.py": [],
    f"{PX}/ddp-tutorial-series/multigpu.py": [],
    f"{PX}/ddp-tutorial-series/multigpu_torchrun.py": [],
    f"{PX}/ddp-tutorial-series/multinode.py": [],
    f"{PX}/minGPT-ddp/mingpt/main.py": [],
    f"{PX}/minGPT-ddp/mingpt/trainer.py": [],
    f"{PX}/rpc/ddp_rpc/main.py": [],
    f"{PX}/rpc/batch/parameter_server.py": [],
    f"{PX}/FSDP2/example.py": [],
    f"{PX}/FSDP/T5_training.py": [],
    "pytorch_examples/imagenet/main.py": [("DDP011", 191), ("DDP011", 194)],
    "nanogpt/train.py": [],
    "dino/main_dino.py": [],
    "dino/eval_linear.py": [],
    "dino/eval_knn.py": [],
    "timm/train.py": [],
    "timm/validate.py": [("DDP011", 269)],
}


def found(source: str, path: str = "train.py") -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in lint_source(source, path)]


def codes(source: str) -> list[str]:
    return [code for code, _ in found(textwrap.dedent(source))]


@pytest.mark.parametrize("rel", sorted(REAL))
def test_real_scripts_give_no_false_finding(rel: str) -> None:
    assert found((CORPUS / rel).read_text(), rel) == REAL[rel]


@dataclass(frozen=True)
class Seed:
    """One trap planted in a real script: replace `old` (which must occur once) by `new`."""

    code: str
    file: str
    edits: tuple[tuple[str, str], ...]
    at: str  # text on the line the finding must point at

    def source(self) -> str:
        text = (CORPUS / self.file).read_text()
        for old, new in self.edits:
            assert text.count(old) == 1, f"{self.file}: {old!r} occurs {text.count(old)} times"
            text = text.replace(old, new)
        return text


_TORCHRUN = f"{PX}/ddp-tutorial-series/multigpu_torchrun.py"
_MULTIGPU = f"{PX}/ddp-tutorial-series/multigpu.py"
_DDP = f"{PX}/ddp/example.py"
SEEDS = [
    Seed(
        "DDP001",
        f"{PX}/FSDP2/example.py",
        (
            ("    optim = torch.optim.Adam(model.parameters(), lr=1e-2)\n", ""),
            (
                "    fsdp_kwargs = {}\n",
                "    optim = torch.optim.Adam(model.parameters(), lr=1e-2)\n    fsdp_kwargs = {}\n",
            ),
        ),
        "optim = torch.optim.Adam",
    ),
    Seed("DDP002", _DDP, (("self.relu = nn.ReLU()", "self.relu = nn.BatchNorm1d(10)"),), "DDP(model"),
    Seed(
        "DDP003",
        _TORCHRUN,
        (("F.cross_entropy(output, targets)", 'F.cross_entropy(output, targets, reduction="sum")'),),
        "reduction=",
    ),
    Seed(
        "DDP004",
        _MULTIGPU,
        (
            (
                "        self.model = DDP(model, device_ids=[gpu_id])\n",
                "        self.model = DDP(model, device_ids=[gpu_id])\n        self.model.module.requires_grad_(False)\n",
            ),
        ),
        "requires_grad_(False)",
    ),
    Seed(
        "DDP004",
        _DDP,
        (
            (
                "    ddp_model = DDP(model, device_ids=[rank])\n",
                "    ddp_model = DDP(model, device_ids=[rank])\n    model.net2 = nn.Linear(10, 5).to(rank)\n",
            ),
        ),
        "model.net2 = ",
    ),
    Seed(
        "DDP005",
        _MULTIGPU,
        (("        self.train_data.sampler.set_epoch(epoch)\n", ""),),
        "sampler=DistributedSampler",
    ),
    Seed(
        "DDP006",
        _MULTIGPU,
        (("if self.gpu_id == 0 and epoch % self.save_every == 0:", "if epoch % self.save_every == 0:"),),
        "torch.save",
    ),
    Seed(
        "DDP007",
        _TORCHRUN,
        (
            (
                "        loss.backward()\n        self.optimizer.step()\n",
                '        loss.backward()\n        self.optimizer.step()\n        print(f"loss {loss.item():.4f}")\n',
            ),
        ),
        'print(f"loss',
    ),
    Seed(
        "DDP008",
        f"{PX}/FSDP2/example.py",
        (("torch.manual_seed(0)", "torch.manual_seed(rank)"),),
        "manual_seed(rank)",
    ),
    Seed(
        "DDP008",
        f"{PX}/FSDP/T5_training.py",
        (
            (
                "    torch.manual_seed(args.seed)\n",
                "    if int(os.environ['RANK']) == 0:\n        torch.manual_seed(args.seed)\n",
            ),
        ),
        "manual_seed(args.seed)",
    ),
    Seed("DDP009", _DDP, (("model = ToyModel().to(rank)", 'model = ToyModel().to("cuda:0")'),), "cuda:0"),
    Seed(
        "DDP009",
        _TORCHRUN,
        (("DDP(self.model, device_ids=[self.gpu_id])", "DDP(self.model, device_ids=[0])"),),
        "device_ids=[0]",
    ),
    Seed(
        "DDP010",
        _DDP,
        (("model = ToyModel().to(rank)", "model = ToyModel().to(rank).to(torch.bfloat16)"),),
        "torch.bfloat16",
    ),
    Seed(
        "DDP011",
        _MULTIGPU,
        (("self.model = DDP(model, device_ids=[gpu_id])", "self.model = torch.nn.DataParallel(model)"),),
        "DataParallel",
    ),
    Seed(
        "DDP007",
        "nanogpt/train.py",
        (("if iter_num % log_interval == 0 and master_process:", "if iter_num % log_interval == 0:"),),
        'print(f"iter',
    ),
    Seed(
        "DDP009",
        "nanogpt/train.py",
        (("DDP(model, device_ids=[ddp_local_rank])", "DDP(model, device_ids=[0])"),),
        "device_ids=[0]",
    ),
    Seed(
        "DDP012",
        _DDP,
        (("DDP(model, device_ids=[rank])", "DDP(model, device_ids=[rank], find_unused_parameters=True)"),),
        "find_unused",
    ),
    Seed(
        "DDP013",
        _MULTIGPU,
        (
            (
                "from datautils import MyTrainDataset\n",
                "from torch.utils.data import IterableDataset\n\nclass MyTrainDataset(IterableDataset):\n"
                "    def __init__(self, size):\n        self.size = size\n\n    def __iter__(self):\n"
                "        for _ in range(self.size):\n            yield torch.rand(20), torch.rand(1)\n",
            ),
            (
                "        shuffle=False,\n        sampler=DistributedSampler(dataset)\n",
                "        shuffle=False,\n",
            ),
        ),
        "def __iter__",
    ),
    Seed(
        "DDP014",
        _DDP,
        (
            (
                "return self.net2(self.relu(self.net1(x)))",
                "return self.net2(torch.utils.checkpoint.checkpoint(lambda t: self.relu(self.net1(t)), x))",
            ),
        ),
        "checkpoint",
    ),
]


@pytest.mark.parametrize(
    "seed", SEEDS, ids=[f"{s.code}-{Path(s.file).stem}-{i}" for i, s in enumerate(SEEDS)]
)
def test_seeded_variant_gives_exactly_its_finding(seed: Seed) -> None:
    source = seed.source()
    got = found(source, seed.file)
    assert [code for code, _ in got] == [seed.code], got
    assert seed.at in source.splitlines()[got[0][1] - 1]


def test_every_rule_has_a_seeded_variant() -> None:
    from test_lint_idioms import PLANTS  # DDP015, DDP016: planted in a ddpkit port of a GPT loop

    assert {r.code for r in all_rules()} == {s.code for s in SEEDS} | {p.code for p in PLANTS}


# -- ddpkit's own scripts and API ---------------------------------------------------------------------


# README.md, docs/*.md and examples/ are linted snippet by snippet in tests/test_lint_docs.py.


GOOD_DDPKIT = """
    import torch, torch.nn as nn, ddpkit
    import torch.nn.functional as F

    with ddpkit.session(seed=0) as s:
        model = s.model(Net(), sync_batchnorm=True)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        train = s.loader(train_set, batch_size=256, shuffle=True)
        for epoch in range(10):
            for x, y in train:
                loss = F.cross_entropy(model(x), y)
                s.backward(loss)
                s.step(opt)
            s.print(f"epoch {epoch}: loss {loss.item():.3f}")
            s.save("runs/ckpt", model=model, optimizer=opt, loader=train)
"""


def test_what_ddpkit_handles_is_not_reported() -> None:
    assert codes(GOOD_DDPKIT) == []


@pytest.mark.parametrize(
    "old, new, code",
    [
        (
            "    model = s.model(Net(), sync_batchnorm=True)\n    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)",
            "    model = Net()\n    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)\n    model = s.model(model)",
            "DDP001",
        ),
        (
            "s.model(Net(), sync_batchnorm=True)",
            "s.model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))",
            "DDP002",
        ),
        ("F.cross_entropy(model(x), y)", "F.cross_entropy(model(x), y, reduction='sum')", "DDP003"),
        ("s.print(", "print(", "DDP007"),
        ("ddpkit.session(seed=0)", "ddpkit.session(seed=int(os.environ['RANK']))", "DDP008"),
        (
            's.save("runs/ckpt", model=model, optimizer=opt, loader=train)',
            "torch.save(model.state_dict(), 'm.pt')",
            "DDP006",
        ),
        (
            "model = s.model(Net(), sync_batchnorm=True)",
            "model = s.model(Net().cuda(), sync_batchnorm=True)",
            "DDP009",
        ),
        (
            "s.model(Net(), sync_batchnorm=True)",
            "s.model(nn.Linear(4, 4), find_unused_parameters=True)",
            "DDP012",
        ),
    ],
)
def test_ddpkit_script_with_one_trap(old: str, new: str, code: str) -> None:
    source = textwrap.dedent(GOOD_DDPKIT)
    assert source.count(old) == 1
    assert codes(source.replace(old, new)) == [code]


# -- edge cases, plain torch.distributed ---------------------------------------------------------------

HEAD = """
    import os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
"""


def test_optimizer_before_ddp_or_to_is_not_reported() -> None:
    """DDP(...) and .to() keep the Parameter objects, so an optimizer built before them still trains
    the model (the pytorch/examples tutorial relies on it); only sharding replaces them."""
    net = torch.nn.Linear(3, 3)
    before = list(net.parameters())
    net.to(torch.float64)
    assert all(a is b for a, b in zip(before, net.parameters(), strict=True))
    assert (
        codes(
            HEAD
            + "    m = Net()\n    opt = torch.optim.SGD(m.parameters(), lr=0.1)\n    m = DDP(m.to('cpu'))\n"
        )
        == []
    )


def test_summed_loss_only_when_it_is_backpropagated() -> None:
    evaluation = (
        HEAD
        + """
    model = DDP(Net())
    def evaluate(loader):
        total = 0.0
        for x, y in loader:
            total += F.nll_loss(model(x), y, reduction="sum").item()
        return total
    def train(x, y, mask):
        loss = (F.cross_entropy(model(x), y, reduction="none") * mask).sum() / mask.sum()
        loss.backward()
        penalty = model(x).sum()
        penalty.backward()
    """
    )
    assert codes(evaluation) == []
    criterion = (
        HEAD
        + """
    model = DDP(Net())
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss = criterion(model(x), y)
    loss.backward()
    """
    )
    assert codes(criterion) == ["DDP003"]
    assert codes(criterion.replace("    loss.backward()", "    loss /= len(y)\n    loss.backward()")) == []


@pytest.mark.parametrize(
    "body, expected",
    [
        ("torch.save(model.state_dict(), 'm.pt')", ["DDP006"]),
        ("if rank == 0:\n        torch.save(model.state_dict(), 'm.pt')", []),
        ("if dist.get_rank() != 0:\n        return\n    torch.save(model.state_dict(), 'm.pt')", []),
        ("print(f'loss {loss.item()}')", ["DDP007"]),
        ("print(f'rank {rank}: loss {loss.item()}')", []),
        ("print('epoch done')", []),
    ],
)
def test_who_saves_and_prints(body: str, expected: list[str]) -> None:
    source = (
        HEAD
        + "    model = DDP(Net())\n    def end_of_epoch(loss):\n        "
        + body.replace("\n", "\n    ")
        + "\n"
    )
    source += "    for epoch in range(3):\n        end_of_epoch(train())\n"
    assert codes(source) == expected


def test_save_in_a_function_called_on_rank_zero_only() -> None:
    source = (
        HEAD
        + """
    model = DDP(Net())
    def checkpoint():
        torch.save(model.state_dict(), "m.pt")
    if rank == 0:
        checkpoint()
    """
    )
    assert codes(source) == []
    assert codes(source.replace("    if rank == 0:\n        checkpoint()", "    checkpoint()")) == ["DDP006"]


def test_seeds() -> None:
    assert codes(HEAD + "    torch.manual_seed(rank)\n    model = DDP(Net())\n") == []  # DDP broadcasts
    assert codes(HEAD + "    model = DDP(Net())\n    torch.manual_seed(1000 + rank)\n") == []
    assert codes(HEAD + "    torch.manual_seed(rank)\n    fully_shard(Net())\n") == ["DDP008"]
    assert codes(HEAD + "    if rank == 0:\n        torch.manual_seed(0)\n    model = DDP(Net())\n") == [
        "DDP008"
    ]


def test_devices() -> None:
    load = (
        HEAD
        + "    model = DDP(Net())\n    sd = torch.load('m.pt', map_location={'cuda:0': f'cuda:{rank}'})\n"
    )
    assert codes(load) == []
    picked = HEAD + "    torch.cuda.set_device(rank)\n    model = DDP(Net().cuda())\n"
    assert codes(picked) == []
    assert codes(picked.replace("    torch.cuda.set_device(rank)\n", "")) == ["DDP009"]
    assert codes(HEAD + "    device = 'cuda:0'\n") == ["DDP009"]


def test_cast_for_export_after_training_is_not_reported() -> None:
    source = (
        HEAD
        + """
    model = DDP(Net())
    opt = torch.optim.AdamW(model.parameters())
    for x, y in data:
        F.mse_loss(model(x), y).backward()
        opt.step()
    model.half()
    """
    )
    assert codes(source) == []


def test_find_unused_parameters_needed_by_a_branch() -> None:
    model = """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
        def forward(self, x):
            return self.b(self.a(x))
    """
    wrap = "    model = DDP(Net(), find_unused_parameters=True)\n"
    assert codes(HEAD + model + wrap) == ["DDP012"]
    branchy = model.replace("return self.b(self.a(x))", "return self.b(x) if x.sum() > 0 else self.a(x)")
    assert codes(HEAD + branchy + wrap) == []
    assert codes(HEAD + model.replace("self.b(self.a(x))", "self.a(x)") + wrap) == []  # self.b unused


def test_exclusive_branches_are_not_ordered() -> None:
    source = (
        HEAD
        + """
    if world > 1:
        model = DDP(model)
    else:
        model.head = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    """
    )
    assert codes(source) == []
    assert codes(source.replace("    else:\n", "")) == ["DDP004"]


def test_frozen_after_wrap_only_for_a_trained_model() -> None:
    """DINO wraps its EMA teacher in DDP for SyncBatchNorm, then freezes it: it never back-propagates."""
    teacher = (
        HEAD
        + "    teacher = DDP(Net())\n    for p in teacher.parameters():\n        p.requires_grad = False\n"
    )
    assert codes(teacher) == []
    assert codes(teacher + "    opt = torch.optim.SGD(teacher.parameters(), lr=0.1)\n") == ["DDP004"]


def test_print_made_rank_zero_only_elsewhere() -> None:
    """Scripts that set up the group in a helper module (where DeiT/DINO make print rank-0-only) are
    not judged on their prints."""
    body = "    model = DDP(Net())\n    print(f'loss {loss.item()}')\n"
    assert codes(HEAD + body) == ["DDP007"]
    assert (
        codes(HEAD.replace('dist.init_process_group("gloo")', "utils.init_distributed_mode(args)") + body)
        == []
    )


# -- silencing, selection, the command ---------------------------------------------------------------

SAVE = HEAD + "    model = DDP(Net())\n    torch.save(model.state_dict(), 'm.pt'){comment}\n"


@pytest.mark.parametrize(
    "comment, silenced",
    [
        ("  # ddpkit: noqa", True),
        ("  # noqa: DDP006", True),
        ("  # noqa: E501, DDP006", True),
        ("  # ddpkit: noqa: DDP006", True),
        ("  # noqa: DDP007", False),
        ("  # noqa", False),
        ("", False),
    ],
)
def test_noqa(comment: str, silenced: bool) -> None:
    assert codes(SAVE.format(comment=comment)) == ([] if silenced else ["DDP006"])


def test_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "train.py"
    bad.write_text(textwrap.dedent(SAVE.format(comment="")))
    assert ddpkit_main(["lint", str(bad)]) == 1
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"{re.escape(str(bad))}:\d+:\d+: DDP006 .+ \(fix: .+\)", out), out
    assert ddpkit_main(["lint", "--ignore", "DDP006", str(bad)]) == 0
    assert ddpkit_main(["lint", "--select", "DDP00", str(tmp_path)]) == 1
    (tmp_path / "broken.py").write_text("def f(:\n")
    assert ddpkit_main(["lint", str(tmp_path / "broken.py")]) == 2
    assert ddpkit_main(["lint", str(tmp_path / "missing.py")]) == 2
    capsys.readouterr()
    assert ddpkit_main(["lint", "--list-rules"]) == 0
    listing = capsys.readouterr().out
    assert all(r.code in listing for r in all_rules())
    with pytest.raises(SystemExit):
        ddpkit_main(["lint", "--select", "XYZ9", str(bad)])


def test_doctor_runs_lint_on_a_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from ddpkit.tools import doctor

    bad = tmp_path / "train.py"
    bad.write_text(textwrap.dedent(SAVE.format(comment="")))
    assert doctor.main(["--no-smoke", "--script", str(bad)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAIL  .*train\.py:\d+:\d+: DDP006 ", out, flags=re.M) and "NOT healthy" in out
    doctor.main(["--no-smoke", "--json", "--script", str(bad)])
    assert [line.split(": ")[1].split()[0] for line in json.loads(capsys.readouterr().out)["lint"]] == [
        "DDP006"
    ]


def test_a_file_per_rank_a_gpu_only_function_and_a_single_pass_are_not_traps() -> None:
    """Found by running the linter over ddpkit's own tests and tools."""
    per_rank = HEAD + "    model = DDP(Net())\n    torch.save(model.state_dict(), f'out/rank{rank}.pt')\n"
    assert codes(per_rank) == []
    gpu_only = (
        HEAD
        + "    torch.cuda.set_device(rank)\n    def check():\n        cuda_only()\n        return DDP(Net().cuda())\n"
    )
    assert codes(gpu_only.replace("    torch.cuda.set_device(rank)\n", "")) == []
    assert codes(
        gpu_only.replace("    torch.cuda.set_device(rank)\n", "").replace("        cuda_only()\n", "")
    ) == ["DDP009"]
    sampler = (
        HEAD
        + """
    model = DDP(Net())
    sampler = DistributedSampler(data, shuffle=True)
    for x, y in DataLoader(data, sampler=sampler):
        F.mse_loss(model(x), y).backward()
    """
    )
    assert codes(sampler) == []
    assert codes(
        sampler.replace("    for x, y", "    for epoch in range(3):\n      for x, y").replace(
            "        F.", "          F."
        )
    ) == ["DDP005"]
