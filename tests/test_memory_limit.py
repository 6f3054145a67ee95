"""Issue 21, item 4: a model whose training state does not fit one rank's memory limit trains under
FSDP at 4 ranks, while DDP is refused with an error that names FSDP, and, with that check switched
off, is killed by the kernel. The limit is a real one: each rank runs in its own cgroup (v1 memory
controller) with `memory.limit_in_bytes` = 1.75 GiB, so going past it ends the process (SIGKILL).

The model (tests/memory_limit_rank.py): 222M parameters, 848 MiB of weights; DDP needs 2.1 GiB per
rank even with ddpkit's sharded optimizer step (parameters and gradients whole), FSDP about 0.85 GiB
of model state plus one 64 MiB block gathered at a time, plus torch itself (~270 MiB).

Needs root and a writable cgroup v1 memory hierarchy (these machines); elsewhere (CI runners without
root, cgroup v2 without delegation) the test skips and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_marked

from ddpkit.strategy import rank_memory

REPO = Path(__file__).resolve().parent.parent
LIMIT = 1792 * 2**20  # 1.75 GiB per rank
RANKS = 4
V1 = Path("/sys/fs/cgroup/memory")


def _own_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return V1 / path.lstrip("/")
    return None


@pytest.fixture
def limited() -> Iterator[Path]:
    """A cgroup per rank (rank0..rank3) under this process's memory cgroup, each limited to LIMIT."""
    own = _own_cgroup() if sys.platform == "linux" and V1.is_dir() else None
    if own is None or os.geteuid() != 0 or not os.access(own, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 memory controller to enforce a per-rank limit")
    base = own / f"ddpkit-limit-{os.getpid()}"
    base.mkdir()
    try:
        for r in range(RANKS):
            (base / f"rank{r}").mkdir()
            (base / f"rank{r}" / "memory.limit_in_bytes").write_text(str(LIMIT))
            swap = base / f"rank{r}" / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(LIMIT))  # no swapping around the limit either
        yield base
    finally:
        for r in range(RANKS):
            group = base / f"rank{r}"
            for _ in range(50):  # the killed ranks' processes leave their cgroup as they are reaped
                if not group.exists() or not (group / "cgroup.procs").read_text().strip():
                    break
                time.sleep(0.1)
            if group.exists():
                group.rmdir()
        base.rmdir()


def _launch(
    base: Path, strategy: str, out: Path, **env: str
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    for r in range(RANKS):
        (base / f"rank{r}" / "memory.max_usage_in_bytes").write_text("0")  # peaks of this run only
    out.mkdir()
    full_env = {**os.environ, "DDPKIT_TEST_CGROUP": str(base), "OMP_NUM_THREADS": "1", **env}
    run = run_marked(  # 3 launches x 190 s < the test's 600 s; workers ended on a timeout (conftest.py)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={RANKS}",
         str(REPO / "tests" / "memory_limit_rank.py"), strategy, str(out)],
        timeout=190, env=full_env, cwd=REPO,
    )  # fmt: skip
    groups = []
    for r in range(RANKS):
        group = base / f"rank{r}"
        oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
        groups.append({"max_usage": int((group / "memory.max_usage_in_bytes").read_text()),
                       "oom_kill": int(oom.get("oom_kill", 0))})  # fmt: skip
    return run, groups


@pytest.mark.timeout(600)
def test_fsdp_trains_where_ddp_cannot_start(limited: Path, tmp_path: Path) -> None:
    mib = 2**20
    fsdp, groups = _launch(limited, "fsdp", tmp_path / "fsdp")
    assert fsdp.returncode == 0, fsdp.stdout[-3000:] + fsdp.stderr[-3000:]
    ranks = [json.loads((tmp_path / "fsdp" / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert all(len(r["losses"]) == 2 for r in ranks) and ranks[0]["losses"] == ranks[3]["losses"]
    assert all(g["oom_kill"] == 0 and g["max_usage"] < LIMIT for g in groups)
    print(f"\nFSDP, {RANKS} ranks, limit {LIMIT / mib:.0f} MiB: cgroup peak per rank (page cache included) "
          f"{[round(g['max_usage'] / mib) for g in groups]} MiB, peak RSS "
          f"{[round(r['peak_rss'] / mib) for r in ranks]} MiB")  # fmt: skip

    ddp, _ = _launch(limited, "ddp", tmp_path / "ddp")
    assert ddp.returncode != 0
    said = ddp.stdout + ddp.stderr
    assert "exceeds this rank's memory limit of 1792 MiB" in said and "Pass strategy='fsdp'" in said, said[
        -3000:
    ]

    unchecked, groups = _launch(limited, "ddp", tmp_path / "unchecked", **{rank_memory.OPT_OUT: "off"})
    assert unchecked.returncode != 0, "DDP trained past the limit: the limit is not enforced"
    assert any(g["oom_kill"] > 0 for g in groups), unchecked.stderr[-3000:]
    assert "SIGKILL" in unchecked.stderr or "exitcode  : -9" in unchecked.stderr
    print(
        f"DDP without ddpkit's check: killed by the kernel (oom_kill per rank {[g['oom_kill'] for g in groups]})"
    )


def test_limit_is_read_from_cgroup_v1_and_v2_files(tmp_path: Path) -> None:
    v1 = tmp_path / "memory" / "job" / "step"
    v1.mkdir(parents=True)
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (tmp_path / "memory" / "job" / "memory.limit_in_bytes").write_text(str(3 << 30))
    (v1 / "memory.limit_in_bytes").write_text(str(5 << 30))
    proc = "4:memory:/job/step\n0::/\n"
    assert rank_memory.limit_bytes(proc, mount=tmp_path) == 3 << 30  # the smallest along the path
    v2 = tmp_path / "v2"
    (v2 / "pod" / "rank").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory\n")
    (v2 / "pod" / "memory.max").write_text("max\n")
    (v2 / "pod" / "rank" / "memory.max").write_text(str(1 << 30))
    assert rank_memory.limit_bytes("0::/pod/rank\n", mount=v2) == 1 << 30
    assert rank_memory.limit_bytes("0::/pod\n", mount=v2) is None


def test_ddp_refusal_names_fsdp_and_the_numbers() -> None:
    from torch import nn

    from ddpkit.errors import DdpkitError
    from ddpkit.strategy import DDP, FSDP
    from ddpkit.wrap import DDPOptions

    net = nn.Linear(1024, 1024)  # 4 MiB of weights: 8 MiB whole + 2 MiB sharded Adam at 4 ranks
    ddp = DDP(DDPOptions())
    with pytest.raises(DdpkitError, match=r"exceeds this rank's memory limit of 8 MiB.*strategy='fsdp'"):
        rank_memory.check_replicated(ddp, net, 4, sharded_step=True, env={}, limit=8 * 2**20)
    rank_memory.check_replicated(ddp, net, 4, sharded_step=True, env={}, limit=11 * 2**20)  # fits
    rank_memory.check_replicated(ddp, net, 4, sharded_step=True, env={"DDPKIT_MEMORY_CHECK": "off"}, limit=1)
    assert FSDP.shards_state  # FSDP is never refused here: its state is 1/N
