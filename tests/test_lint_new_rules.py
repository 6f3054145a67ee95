"""`ddpkit lint`, this round: the rules for iterable datasets (DDP013) and reentrant activation
checkpointing (DDP014), the lines ddpkit recommends that were reported (DDP003, DDP009), and the
package's own imports (no cycle inside ddpkit/lint/). Static: nothing is imported from the scripts.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from ddpkit.lint import lint_source

ROOT = Path(__file__).resolve().parents[1]


def test_the_lint_package_imports_one_way() -> None:
    """The registry imports the rule modules and the rule modules import `Rule` from `rule.py`: no
    module of ddpkit/lint/ reaches itself through its imports (it did through rules.py before)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import import_graph
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    mods = import_graph.modules(ROOT / "ddpkit")
    edges = {
        name: import_graph.imports_of(name, path) & mods.keys()
        for name, path in mods.items()
        if name.startswith("ddpkit.lint")
    }

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert len(edges) >= 10
    assert [m for m in edges if m in reach(m)] == []


def codes(source: str) -> list[tuple[str, int]]:
    return [(f.code, f.line) for f in lint_source(textwrap.dedent(source), "train.py")]


SESSION = """
    import torch, torch.nn.functional as F
    import ddpkit

    with ddpkit.session(seed=0) as s:
        model = s.model(Net())
        opt = torch.optim.AdamW(model.parameters())
        for x, y in s.loader(data, batch_size=64):
            logits = model(x)
            LINE
            s.step(opt)
"""


def test_the_recommended_token_weighted_line_is_not_a_summed_loss() -> None:
    """The README's own line (issue 28: it was reported as DDP003): s.backward rescales the summed
    gradients to the global token mean. The same sum without `tokens=` is still the trap."""
    line = 's.backward(F.cross_entropy(logits, y, reduction="sum"), tokens=(y != -100).sum())'
    assert codes(SESSION.replace("LINE", line)) == []
    assert codes(SESSION.replace("LINE", line.replace(", tokens=(y != -100).sum()", ""))) == [("DDP003", 10)]


TORCH = """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = DEVICE
    model = DDP(Net().to(device))
"""


def test_the_recommended_device_is_not_a_hard_coded_gpu() -> None:
    """docs/lint.md's own fix for DDP009 was reported as DDP009 (found by tests/test_lint_docs.py)."""
    assert codes(TORCH.replace("DEVICE", 'torch.device("cuda", local_rank)')) == []
    assert codes(TORCH.replace("DEVICE", "torch.device('cuda', index=local_rank)")) == []
    assert codes(TORCH.replace("DEVICE", 'torch.device("cuda")')) == [("DDP009", 6)]
