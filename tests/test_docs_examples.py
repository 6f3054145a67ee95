"""Every Python block of README.md, docs/index.md, docs/quickstart.md and docs/guides/ runs, as written.

The blocks and their markers come from `scripts/docs_examples.py` (its docstring: `nproc=2`, `skip: REASON`,
`raises=Error`). A one-process block runs here, in a fresh directory; a two-rank block runs on the shared
pool of two gloo ranks (`pool2`, as `ddpkit run --nproc 2` would run it: the session finds the group and
uses it), both ranks in one fresh directory, as ranks of one machine share a file system. A documented
line that breaks fails here with the page and line of its block.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import docs_examples

BLOCKS = docs_examples.blocks()
ONE = [b for b in BLOCKS if b.nproc == 1 and not b.skip]
TWO = [b for b in BLOCKS if b.nproc == 2 and not b.skip]


@contextlib.contextmanager
def _inside(folder: str):
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def _run_on_rank(block: docs_examples.Block, folder: str) -> str:
    """One rank's run of a block (in the pool's worker)."""
    with _inside(folder):
        docs_examples.run(block)
    return "ok"


def _refused(block: docs_examples.Block) -> str:
    """Run a block that shows a refusal; the name of what it raised (or "nothing")."""
    try:
        docs_examples.run(block)
    except Exception as err:
        return type(err).__name__
    return "nothing"


def test_the_pages_have_blocks_and_every_skip_says_why() -> None:
    pages = {b.where.split(":")[0] for b in BLOCKS}
    assert {"README.md", "docs/quickstart.md", "docs/guides/start-here.md"} <= pages, pages
    assert all(len(b.skip) > 10 for b in BLOCKS if b.skip), [b.where for b in BLOCKS if b.skip]
    assert all(b.nproc in (1, 2) for b in BLOCKS), "only one process or the two-rank pool"


@pytest.mark.parametrize("block", ONE, ids=[b.where for b in ONE])
def test_a_one_process_block_runs(block: docs_examples.Block, tmp_path: Path) -> None:
    with _inside(str(tmp_path)):
        if block.raises:
            assert _refused(block) == block.raises, f"{block.where} should be refused with {block.raises}"
        else:
            docs_examples.run(block)


@pytest.mark.parametrize("block", TWO, ids=[b.where for b in TWO])
def test_a_two_rank_block_runs(block: docs_examples.Block, tmp_path: Path, pool2) -> None:
    assert pool2.run(_run_on_rank, block, str(tmp_path), timeout=180) == ["ok", "ok"]


def test_a_broken_block_fails_with_its_page_and_line(tmp_path: Path) -> None:
    """The runner does not swallow an error: the traceback names the page and the block's line."""
    block = docs_examples.parse("x\n```python\nmodel = s.model(Net())\n```\n", "PAGE.md")[0]
    with _inside(str(tmp_path)), pytest.raises(NameError) as caught:
        docs_examples.run(block)
    assert any(str(e.path) == "PAGE.md" and e.lineno + 1 == 3 for e in caught.traceback), caught.traceback
