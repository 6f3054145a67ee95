"""The Python blocks of the README and the guides, as tests run them (tests/test_docs_examples.py).

A block is a ```python fence. The line right before it may be an HTML comment, invisible on the page, that
says how it runs:

    <!-- docs-test: nproc=2 -->               on two gloo ranks (as `ddpkit run --nproc 2` would run it)
    <!-- docs-test: skip: REASON -->          not run here, and why (a GPU, a pretrained checkpoint, ...)
    <!-- docs-test: raises=DdpkitError -->    shows a refusal: running it must raise that error

Without a comment a block runs on one process. Every block runs after `PRELUDE`, which defines the two
names a reader brings to a page (`Net`, `train_set`) and the imports every page assumes, so a block shows
only the lines that matter. `python scripts/docs_examples.py FILE` prints FILE's first two-rank block as a
script (CI's install leg runs the quickstart's that way, from the built wheel).
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/index.md", "docs/quickstart.md", "docs/guides/*.md")

PRELUDE = """\
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


_g = torch.Generator().manual_seed(0)
train_set = TensorDataset(torch.randn(256, 8, generator=_g), torch.randint(0, 4, (256,), generator=_g))
"""

_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_MARK = re.compile(r"<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    where: str  # path:line of the fence, for the test's id and its failure
    code: str
    nproc: int = 1
    skip: str | None = None  # the reason it cannot run here
    raises: str | None = None  # the error class name it must raise


def _mark(text: str, fence_start: int) -> str | None:
    """The docs-test comment on the line before the fence, if any."""
    before = text[:fence_start].rstrip("\n").rsplit("\n", 1)[-1]
    m = _MARK.search(before)
    return m.group("what") if m else None


def parse(text: str, rel: str) -> list[Block]:
    """Every ```python block of a page, with how it runs; an unknown marker is an error, not a silent skip."""
    out = []
    for m in _FENCE.finditer(text):
        where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}"
        what = _mark(text, m.start())
        kw: dict = {}
        if what is None:
            pass
        elif what.startswith("skip:") and what[5:].strip():
            kw["skip"] = what[5:].strip()
        elif re.fullmatch(r"nproc=\d+", what):
            kw["nproc"] = int(what.split("=")[1])
        elif re.fullmatch(r"raises=\w+", what):
            kw["raises"] = what.split("=")[1]
        else:
            raise ValueError(
                f"{where}: unknown docs-test marker {what!r} (nproc=N, skip: REASON, raises=Error)"
            )
        out.append(Block(where, m.group(1), **kw))
    return out


def pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def blocks(root: Path = ROOT) -> list[Block]:
    return [b for p in pages(root) for b in parse(p.read_text(encoding="utf-8"), str(p.relative_to(root)))]


def run(block: Block) -> None:
    """Run one block after the prelude, in this process and its current directory; a traceback names the
    page and the page's own line numbers."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(PRELUDE, "<docs prelude>", "exec"), namespace)
    page, _, line = block.where.rpartition(":")
    tree = ast.parse(block.code, page)
    ast.increment_lineno(tree, int(line))  # the fence's line: the code starts on the next one
    exec(compile(tree, page, "exec"), namespace)


if __name__ == "__main__":
    page = Path(sys.argv[1])
    found = [b for b in parse(page.read_text(encoding="utf-8"), str(page)) if b.nproc > 1 and not b.skip]
    if not found:
        sys.exit(f"{page}: no two-rank block")
    print(found[0].code, end="")
