"""`ddpkit lint` on what a working DDP script brings when it is ported to ddpkit: a collective under a
rank test (DDP015) and a loss divided by the accumulation count before `s.backward` (DDP016).

The planted script is a nanoGPT-style loop as a first port writes it from the README: DDP under
torchrun, accumulation over micro-steps, a prefetched next batch, evaluation and a checkpoint every N
iterations. Ported correctly it gives no finding; each variant plants one idiom of the original script
and must give exactly its finding, on the planted line. Also: no finding on the real-script corpus, the
held-back corpus, and every line the README, docs and examples show. Static: nothing is run.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_lint_docs import SOURCES, check, snippets_of

from ddpkit.lint import all_rules, lint_source
from ddpkit.lint.rules_idioms import COLLECTIVES
from ddpkit.training.session import Session

ROOT = Path(__file__).resolve().parents[1]
IDIOMS = ("DDP015", "DDP016")

PORTED = '''
"""A GPT trained with ddpkit: torchrun --nproc-per-node 2 train.py, or ddpkit run --nproc 2 train.py."""
import os

import numpy as np
import torch
import torch.distributed as dist

import ddpkit

batch_size, block_size = 12, 64
eval_interval, eval_iters, max_iters = 20, 10, 100
gradient_accumulation_steps = 8
gradient_accumulation_steps //= int(os.environ.get("WORLD_SIZE", 1))
data = np.memmap("train.bin", dtype=np.uint16, mode="r")


def get_batch(s):
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix])
    return x.to(s.device), y.to(s.device)


@torch.no_grad()
def estimate_loss(s, model):
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        X, Y = get_batch(s)
        _, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return s.all_reduce(losses.mean(), op="mean").item()


with ddpkit.session(seed=1337, accumulation=gradient_accumulation_steps) as s:
    model = s.model(GPT(GPTConfig(block_size=block_size)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4)
    state = dict(model=model, optimizer=optimizer)
    iter_num = s.load("out", **state, iter_num=0)["iter_num"]
    X, Y = get_batch(s)  # the first batch, prefetched
    while iter_num < max_iters:
        if iter_num % eval_interval == 0:
            val = estimate_loss(s, model)
            s.print(f"step {iter_num}: val loss {val:.4f}")
            if iter_num > 0:
                s.save("out", **state, iter_num=iter_num)
        for micro_step in range(gradient_accumulation_steps):
            with s.accumulate(model):
                logits, loss = model(X, Y)
                X, Y = get_batch(s)  # the next batch, while the backward runs
                s.backward(loss)
            s.step(optimizer, max_norm=1.0)
        if iter_num % 10 == 0:
            s.print(f"iter {iter_num}: loss {loss.item():.4f}")
        iter_num += 1
'''


@dataclass(frozen=True)
class Plant:
    """One idiom planted in the port: replace `old` (which occurs once) by `new`."""

    name: str
    code: str
    old: str
    new: str
    at: str  # text on the line the finding must point at
    also: tuple[tuple[str, str], ...] = ()  # more edits of the same kind

    def source(self) -> str:
        text = PORTED
        for old, new in ((self.old, self.new), *self.also):
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        return text


_SAVE = "            if iter_num > 0:\n                s.save("
PLANTS = [
    Plant(
        "save-is-main",
        "DDP015",
        _SAVE,
        "            if iter_num > 0 and s.is_main:\n                s.save(",
        "s.save(",
    ),
    Plant("save-rank", "DDP015", _SAVE, "            if s.rank == 0:\n                s.save(", "s.save("),
    Plant(
        "save-get-rank",
        "DDP015",
        _SAVE,
        "            if dist.get_rank() == 0:\n                s.save(",
        "s.save(",
    ),
    Plant(
        "save-environ",
        "DDP015",
        _SAVE,
        '            if int(os.environ["RANK"]) == 0:\n                s.save(',
        "s.save(",
    ),
    Plant(  # the rank test in a helper: `if not s.is_main: return` before the save
        "save-after-return",
        "DDP015",
        '                s.save("out", **state, iter_num=iter_num)\n',
        "                save_checkpoint(s, state, iter_num)\n",
        "s.save(",
        (
            (
                "with ddpkit.session(",
                "def save_checkpoint(s, state, iter_num):\n    if not s.is_main:\n        return\n"
                '    s.save("out", **state, iter_num=iter_num)\n\n\nwith ddpkit.session(',
            ),
        ),
    ),
    Plant(  # the original's `if iter_num % eval_interval == 0 and master_process:` kept: the
        # evaluation's all_reduce is reached through estimate_loss() on rank 0 only, as is s.save
        "eval-master",
        "DDP015",
        "        if iter_num % eval_interval == 0:\n",
        "        master_process = s.rank == 0\n        if iter_num % eval_interval == 0 and master_process:\n",
        "s.all_reduce(",
    ),
    Plant(
        "export",
        "DDP015",
        "        iter_num += 1\n",
        '        iter_num += 1\n    if s.is_main:\n        s.export("out/model.safetensors", model)\n',
        "s.export(",
    ),
    Plant(
        "barrier",
        "DDP015",
        "        iter_num += 1\n",
        "        iter_num += 1\n        s.barrier() if s.is_main else None\n",
        "s.barrier(",
    ),
    Plant(
        "divided",
        "DDP016",
        "                logits, loss = model(X, Y)\n",
        "                logits, loss = model(X, Y)\n                loss = loss / gradient_accumulation_steps\n",
        "loss = loss / gradient_accumulation_steps",
    ),
    Plant(
        "divided-inline",
        "DDP016",
        "s.backward(loss)",
        "s.backward(loss / s.accumulation)",
        "s.backward(loss / s.accumulation)",
    ),
    Plant(
        "divided-in-place",
        "DDP016",
        "                logits, loss = model(X, Y)\n",
        "                logits, loss = model(X, Y)\n                loss /= gradient_accumulation_steps\n",
        "loss /= gradient_accumulation_steps",
    ),
]


def findings(source: str) -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in lint_source(source, "train.py")]


def test_the_port_gives_no_finding() -> None:
    assert findings(PORTED) == []


@pytest.mark.parametrize("plant", PLANTS, ids=[p.name for p in PLANTS])
def test_each_planted_idiom_is_found_at_its_line(plant: Plant) -> None:
    source = plant.source()
    got = findings(source)
    if plant.name == "eval-master":  # the evaluation's all_reduce and the save: one cause, two calls
        assert [c for c, _ in got] == ["DDP015", "DDP015"], got
        assert "s.save(" in source.splitlines()[got[1][1] - 1]
    else:
        assert [c for c, _ in got] == [plant.code], got
    assert plant.at in source.splitlines()[got[0][1] - 1]


def test_the_messages_name_the_call_the_test_and_the_fix() -> None:
    (guarded,) = lint_source(PLANTS[0].source(), "train.py")
    assert "`s.save(...)` runs only under `iter_num > 0 and s.is_main`" in guarded.message
    assert "call it on every rank" in guarded.fix
    master = lint_source(next(p for p in PLANTS if p.name == "eval-master").source(), "train.py")
    assert (
        "in estimate_loss(), which is called only under `iter_num % eval_interval == 0" in master[0].message
    )
    (divided,) = lint_source(next(p for p in PLANTS if p.name == "divided").source(), "train.py")
    assert "divides by accumulation=gradient_accumulation_steps again" in divided.message
    assert "s.backward(loss) divides by accumulation" in divided.fix


def test_what_every_rank_reaches_is_not_reported() -> None:
    both = PORTED.replace(
        _SAVE,
        "            if s.is_main:\n                s.save('out', **state, iter_num=iter_num, best=val)\n"
        "            else:\n                s.save(",
    )
    assert findings(both) == []  # every rank calls s.save, in one branch or the other
    single = PORTED.replace(
        "        if iter_num % eval_interval == 0:\n",
        "        if args.local_rank == -1 or iter_num % eval_interval == 0:\n",
    )
    assert findings(single) == []  # "distributed or not": the same on every rank
    printing = PORTED.replace(
        '            s.print(f"step {iter_num}: val loss {val:.4f}")\n',
        '            if s.is_main:\n                print(f"step {iter_num}: val loss {val:.4f}")\n',
    )
    assert printing != PORTED and findings(printing) == []  # only printing under the rank test
    raising = PORTED.replace(
        "    while iter_num < max_iters:\n",
        "    if s.rank == 1:\n        raise KeyError('x')\n    while iter_num < max_iters:\n",
    )
    assert findings(raising) == []  # a rank that raises fails the job: no guard
    own_count = PORTED.replace(
        "            if iter_num > 0:\n", "            if iter_num == stop_after[s.rank]:\n"
    )
    assert findings(own_count) == []  # each rank its own threshold, every rank saves once
    flag = PORTED.replace("            if iter_num > 0:\n", "            if args.rank_file:\n")
    assert findings(flag) == []  # a name with "rank" in it is no rank


def test_a_division_that_is_not_the_accumulation_is_not_reported() -> None:
    no_accumulation = PORTED.replace("seed=1337, accumulation=gradient_accumulation_steps", "seed=1337")
    plain = no_accumulation.replace(
        "                logits, loss = model(X, Y)\n",
        "                logits, loss = model(X, Y)\n                loss = loss / gradient_accumulation_steps\n",
    )
    assert findings(plain) == []  # accumulation 1: s.backward divides by nothing
    tokens = PORTED.replace("s.backward(loss)", "s.backward(loss_sum / n_tokens)")
    assert findings(tokens) == []  # a token mean
    counted = PORTED.replace(
        "s.backward(loss)", "s.backward(loss_sum, tokens=n / gradient_accumulation_steps)"
    )
    assert findings(counted) == []


def test_the_collectives_are_the_sessions_own() -> None:
    """Every name DDP015 knows is a public method of the session; each public method is either one of
    them or known to run on one rank alone (a new method must be sorted into one or the other)."""
    public = {n for n, _ in inspect.getmembers(Session) if not n.startswith("_")}
    one_rank = {"print", "print_all", "log", "autocast", "loader", "start", "close"}
    properties = {n for n in public if isinstance(inspect.getattr_static(Session, n), property)}
    assert set(COLLECTIVES) <= public
    assert public - properties - one_rank == set(COLLECTIVES)


@pytest.mark.parametrize(
    "rel", sorted(str(p.relative_to(ROOT)) for p in [*(ROOT / "tests" / "lint_corpus").rglob("*.py")])
)
def test_no_finding_on_the_real_scripts(rel: str) -> None:
    found = lint_source((ROOT / rel).read_text(), rel)
    assert [f for f in found if f.code in IDIOMS] == []


def test_no_finding_on_the_held_back_scripts() -> None:
    found = [
        f
        for p in sorted((ROOT / "tests" / "lint_heldout").glob("*.py"))
        for f in lint_source(p.read_text(), str(p))
    ]
    assert [f for f in found if f.code in IDIOMS] == []


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(ROOT)) for p in SOURCES])
def test_no_finding_on_what_the_docs_show(path: Path) -> None:
    """The README's loops, docs/*.md and examples/ (tests/test_lint_docs.py's reading of them)."""
    problems = [p for s in snippets_of(path) for p in check(s) if any(c in p for c in IDIOMS)]
    assert problems == []


def test_every_idiom_rule_is_registered_and_planted() -> None:
    assert {r.code for r in all_rules()} >= set(IDIOMS)
    assert {p.code for p in PLANTS} == set(IDIOMS)


def test_ddp006s_fix_is_not_a_rank_0_save() -> None:
    (ddp006,) = [r for r in all_rules() if r.code == "DDP006"]
    assert "s.save" in ddp006.fix and "every rank" in ddp006.fix
    assert textwrap.dedent(ddp006.fix).count("rank 0") == 1  # torch.save only: s.save is called by all
