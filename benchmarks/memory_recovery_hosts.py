"""What losing a host costs, from disk (today) and from the buddy host's memory: two hosts, one lost whole.

    sudo .venv/bin/python benchmarks/memory_recovery_hosts.py --reps 5     # root: network namespaces
    sudo .venv/bin/python benchmarks/memory_recovery_hosts.py --reps 5 --kinds behind,before-next-step,disk

Two network namespaces (tests/test_elastic.py's `_Hosts`: 10.77.0.1 and 10.77.0.2, a veth pair), one
FSDP rank each, `ddpkit run --nnodes 2 --max-restarts 3` on each, tests/memory_recovery_train.py (12
steps, 0.3 s added to each so the loss lands mid-run). Host 1 is SIGKILLed whole (its agent, its rank,
its keeper) after a random step from 3 to 9 (the same step for both kinds in a repetition, the kinds
interleaved, the order alternating); a replacement host 1 starts 0.5 s later with an empty keeper.
"behind" (also "memory") and "before-next-step": `s.load(..., memory=1, buddy=KIND)`: each host's keeper
copies its rank's snapshots to the other's (wired through the job's store); the replacement's rank
fetches its own from host 0's keeper. "disk": today's `s.load` with `s.save(every=4)`. Per run:
recovery = the loss to the first step finished after the restore (rank 0's log), steps redone = the
step in flight - the step restored, the step in flight being the newest whose forward rank 0 had run
at the loss (under FSDP its all-gather means every rank had begun it; the loss between a step's end and
its snapshot, or with its copy in flight, costs that step too), and whether every
rank's final state (weights, optimizer, RNG, LR, step) is bitwise the uninterrupted 2-rank run's.
Medians [min..max]; the load average is printed. The time is mostly the agents' rendezvous (a lost
agent is dropped after 5 missed 1 s heartbeats) and new interpreters; what memory saves is the steps
redone, each a step's time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
TRAIN = REPO / "tests" / "memory_recovery_train.py"
DISK_EVERY = 4


def _steps(out: Path) -> list[tuple[float, int, str]]:
    """Rank 0's log: (when, step, the agent's restart count) per finished step."""
    path = out / "steps.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(float(t), int(step), restart) for t, step, restart in (line.split() for line in lines)]


def _host(net, port: int, out: Path, i: int, log: str, kind: str) -> subprocess.Popen:
    run = ["run", "--nnodes", "2", "--nproc", "1", "--max-restarts", "3"]
    run += ["--rdzv-endpoint", f"10.77.0.1:{port}", "--local-addr", f"10.77.0.{i + 1}"]
    run += ["--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=5"]
    how = (
        ["--ckpt", str(out / "ckpt"), "--disk-every", str(DISK_EVERY)]
        if kind == "disk"
        else ["--memory", "1", "--buddy", "behind" if kind == "memory" else kind]
    )
    script = [str(TRAIN), str(out), "--strategy", "fsdp", "--step-sleep", "0.3", *how]
    cmd = [*net.enter(i), sys.executable, "-m", "ddpkit.cli", *run, *script]
    with open(out / log, "w") as file:
        return subprocess.Popen(
            cmd, env=net.env(i), stdout=file, stderr=subprocess.STDOUT, start_new_session=True
        )


def _one(net, root: Path, kind: str, lose_after: int, reference: list[dict]) -> dict:
    from memory_recovery import _bitwise, _final

    out = root / f"{kind}-{lose_after}-{time.monotonic_ns()}"
    out.mkdir()
    port = next(net.ports)
    procs = [_host(net, port, out, 0, "host0.log", kind), _host(net, port, out, 1, "host1.log", kind)]
    try:
        deadline = time.monotonic() + 120
        while not any(step >= lose_after for _, step, _ in _steps(out)):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                return {"failed": f"no progress: see {out}"}
            time.sleep(0.02)
        lost = time.time()
        forward = out / "forward.txt"  # rank 0: each step whose forward ran
        in_flight = max(int(line.split()[1]) for line in forward.read_text().splitlines())
        net.lose(1)
        time.sleep(0.5)
        procs.append(_host(net, port, out, 1, "host1-replacement.log", kind))
        rc = procs[0].wait(timeout=300), procs[-1].wait(timeout=60)
    finally:
        net.lose(0)
        net.lose(1)
        for proc in procs:
            proc.kill()
            proc.wait(timeout=20)
    if rc != (0, 0) or not (out / "resumed.txt").exists():
        return {"failed": f"exit codes {rc}: see {out}"}
    resumed_at, restored = (out / "resumed.txt").read_text().split()  # rank 0, after the restore
    after = [t for t, _, _ in _steps(out) if t > float(resumed_at)]  # the restart count may stay 0
    if not after:
        return {"failed": f"no step after the restore: see {out}"}
    back, restored = min(after), int(restored)
    bitwise = _bitwise(_final(out, 2), reference)
    return {"recover_s": back - lost, "redone": in_flight - restored, "bitwise": bitwise}


def _spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--kinds", default="memory,disk", help="of behind (memory), before-next-step, disk")
    a = p.parse_args()
    kinds = a.kinds.split(",")
    from memory_recovery import _final, _launch
    from test_elastic import _Hosts

    seed = random.randrange(1 << 30) if a.seed is None else a.seed
    draw = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="ddpkit-memory-hosts-"))
    assert _launch(root / "reference", 2, "fsdp") == 0, "the uninterrupted run failed"
    reference = _final(root / "reference", 2)
    net = _Hosts(root)
    rows: dict[str, list[dict]] = {kind: [] for kind in kinds}
    try:
        for i in range(a.reps):
            lose_after = draw.randint(3, 9)
            for kind in kinds[i % len(kinds) :] + kinds[: i % len(kinds)]:  # interleaved, rotated
                row = _one(net, root, kind, lose_after, reference)
                if "failed" in row:
                    print(f"  {kind:16s} host 1 lost after step {lose_after}: {row['failed']}", flush=True)
                    continue
                rows[kind].append(row)
                print(
                    f"  {kind:16s} host 1 lost after step {lose_after}: recovered in "
                    f"{row['recover_s']:.2f} s, {row['redone']} step(s) redone, bitwise {row['bitwise']}",
                    flush=True,
                )
    finally:
        net.close()
    print(
        f"memory_recovery_hosts: fsdp x 2 hosts x 1 rank, {a.reps} host losses (seed {seed}), "
        f"load {os.getloadavg()[0]:.1f}"
    )
    for kind, done in rows.items():
        if not done:
            print(f"  {kind:16s}: every run failed")
            continue
        print(
            f"  {kind:16s}: recovery {_spread([r['recover_s'] for r in done])} s, steps redone "
            f"{_spread([r['redone'] for r in done], 0)}, "
            f"bitwise {sum(r['bitwise'] for r in done)}/{len(done)}"
        )


if __name__ == "__main__":
    main()
