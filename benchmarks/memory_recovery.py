"""What a fault costs, from disk (today) and from memory snapshots; and what a snapshot costs a step.

    python benchmarks/memory_recovery.py recovery --nproc 2 --strategy ddp --reps 5
    python benchmarks/memory_recovery.py recovery --nproc 4 --strategy fsdp --reps 5
    python benchmarks/memory_recovery.py torchft --reps 5    # torchft's own recovery (a scratch install)
    ddpkit run --nproc 2 benchmarks/memory_recovery.py cost mlp 5 6     # WORKLOAD ROUNDS STEPS_PER_BLOCK

recovery: tests/memory_recovery_train.py (12 steps; weights, AdamW, LR schedule, loader position, RNG)
under `ddpkit run --max-restarts 1`, one rank SIGKILLed in a random step (the same step and rank for
every kind in a repetition; the kinds interleaved, the order rotated): "memory" restores the
newest snapshot every rank holds from a keeper (a snapshot after every step, taken by the script),
"s.load" is the product's way (`s.load(..., memory=1)`, the keeper `ddpkit run` starts, the ranks'
meeting in the store, the snapshot at the loader's next batch), "disk" is today's `s.load` with
`s.save(every=4)`. Per run: recovery = the kill to the next finished step (rank 0),
steps redone = the killed step - the step restored, and whether the final state (weights, optimizer,
RNG, LR, step) is bitwise the uninterrupted run's. Medians [min..max]; the load average is printed.
DDPKIT_WARM_START in the environment forks the ranks from a warm server (the restart then costs no
torch import): it says which. A run whose fault did not happen (the job failed first) is reported and
left out of the medians. Run it from a copy of a commit when others edit the tree (`git archive HEAD |
tar -x -C DIR`, then PYTHONPATH=DIR python DIR/benchmarks/memory_recovery.py ...): every restarted rank
imports ddpkit anew.

torchft: the side-by-side run of torchft's own recovery (its README's set-up: two replica groups,
kill -9 of one) from the prototype in TORCHFT_BENCH (default /tmp/mem-proto: ft_recovery.py, and
torchft installed into its ftlib/ with `pip install --target`; never into ddpkit's environment).

cost: on each rank, blocks of steps with and without a snapshot after the step, interleaved (the order
rotated every round, a warm-up round first that also faults in the slots' pages); the step time per
mode (median of rank 0's steps), the overhead per round (with / without - 1: median [min..max]) and
the copy time alone (measured around the snapshot), with the bytes a rank copies.
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
TRAIN = REPO / "tests" / "memory_recovery_train.py"
DISK_EVERY = 4


def _spread(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}..{max(values):.{digits}f}]"


def _launch(out: Path, nproc: int, strategy: str, *args: str) -> int:
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "ddpkit.cli", "run", "--nproc", str(nproc), "--max-restarts", "1"]
    cmd += [str(TRAIN), str(out), "--strategy", strategy, *args]
    with open(out / "log", "w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=600).returncode


def _final(out: Path, nproc: int) -> list[dict]:
    import torch

    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def _bitwise(a: list[dict], b: list[dict]) -> bool:
    sys.path.insert(0, str(REPO / "tests"))
    from resume_train import same

    return all(same(x, y) == [] for x, y in zip(a, b, strict=True))


def _one(kind: str, root: Path, nproc: int, strategy: str, kill_at: int, rank: int) -> dict:
    from ddpkit.cluster.keeper import Keeper

    out = root / f"{kind}-{kill_at}-{rank}-{time.monotonic_ns()}"
    fault = ["--kill-at", str(kill_at), "--kill-rank", str(rank)]
    keeper = Keeper.start() if kind == "memory" else None
    try:
        if keeper is not None:
            rc = _launch(out, nproc, strategy, *fault, "--keeper", keeper.name)
        elif kind == "s.load":
            rc = _launch(out, nproc, strategy, *fault, "--memory", "1")
        else:
            rc = _launch(
                out, nproc, strategy, *fault, "--ckpt", str(out / "ckpt"), "--disk-every", str(DISK_EVERY)
            )
    finally:
        if keeper is not None:
            keeper.stop()
    if not (out / "killed.txt").exists() or not (out / "resumed.txt").exists():
        return {"rc": rc, "failed": f"no fault or no restart (exit code {rc}): see {out / 'log'}", "out": out}
    killed = float((out / "killed.txt").read_text().split()[0])
    steps = [line.split() for line in (out / "steps.txt").read_text().splitlines()]
    back = min(float(t) for t, _, restart in steps if restart != "0")
    restored = int((out / "resumed.txt").read_text().split()[1])
    return {"rc": rc, "recover_s": back - killed, "redone": kill_at - restored, "out": out}


def recovery(nproc: int, strategy: str, reps: int, seed: int | None) -> None:
    seed = random.randrange(1 << 30) if seed is None else seed
    draw = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="ddpkit-memory-recovery-"))
    assert _launch(root / "reference", nproc, strategy) == 0, "the uninterrupted run failed"
    reference = _final(root / "reference", nproc)
    kinds = ("memory", "s.load", "disk")
    rows: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for i in range(reps):
        kill_at, rank = draw.randint(2, 12), draw.randrange(nproc)
        for kind in kinds[i % 3 :] + kinds[: i % 3]:
            row = _one(kind, root, nproc, strategy, kill_at, rank)
            if "failed" in row:
                print(f"  {kind:6s} kill -9 rank {rank} in step {kill_at}: {row['failed']}", flush=True)
                continue
            row["bitwise"] = row["rc"] == 0 and _bitwise(_final(row["out"], nproc), reference)
            rows[kind].append(row)
            print(
                f"  {kind:6s} kill -9 rank {rank} in step {kill_at}: recovered in {row['recover_s']:.2f} s, "
                f"{row['redone']} step(s) redone, bitwise {row['bitwise']}",
                flush=True,
            )
    warm = "warm start" if os.environ.get("DDPKIT_WARM_START") else "new interpreters"
    print(
        f"memory_recovery: {strategy} x {nproc} ranks, {reps} kills (seed {seed}), {warm}, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    for kind, done in rows.items():
        if not done:
            print(f"  {kind:6s}: every run failed")
            continue
        print(
            f"  {kind:6s}: recovery {_spread([r['recover_s'] for r in done])} s, steps redone "
            f"{_spread([r['redone'] for r in done], 0)}, "
            f"bitwise {sum(r['bitwise'] for r in done)}/{len(done)}"
        )


def torchft(reps: int) -> None:
    here = Path(os.environ.get("TORCHFT_BENCH", "/tmp/mem-proto"))
    if not (here / "ft_recovery.py").exists() or not (here / "ftlib" / "torchft").exists():
        print(
            f"memory_recovery torchft: no scratch install in {here} (ft_recovery.py, ftlib/torchft): skipped"
        )
        return
    env = {**os.environ, "PYTHONPATH": str(here / "ftlib"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(here / "ft_recovery.py"), str(reps)],
        env=env,
        cwd=here,
        timeout=3000,
        capture_output=True,
        text=True,
    )
    print(done.stdout[-6000:], done.stderr[-2000:] if done.returncode else "")
    print(f"memory_recovery torchft: {reps} kills, load {os.getloadavg()[0]:.1f}")


def cost(spec: str, rounds: int, per_block: int) -> None:
    """Run under `ddpkit run --nproc N`: see the module docstring."""
    import torch

    import ddpkit
    from ddpkit.checkpoint.memory import MemorySnapshots
    from ddpkit.tools import workloads

    torch.set_num_threads(1)
    wl = workloads.load(spec)
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        loader = s.loader(wl.dataset(batches=4), batch_size=wl.global_batch, shuffle=True)
        snaps = MemorySnapshots(None, f"w{s.world_size}/r{s.rank}")
        owner = s.checkpoints._ctx.strategy
        batches = iter(loader)
        times: dict[str, list[float]] = {"none": [], "memory": []}
        overhead, copies = [], []
        step = 0
        for r in range(-1, rounds):  # round -1: warm-up
            block: dict[str, float] = {}
            for mode in ("none", "memory") if r % 2 else ("memory", "none"):
                ts = []
                for _ in range(per_block):
                    s.barrier()
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        batches = iter(loader)
                        batch = next(batches)
                    s.backward(wl.step_loss(model, batch))
                    s.step(opt)
                    step += 1
                    if mode == "memory":
                        t1 = time.perf_counter()
                        snaps.save(
                            step, owner, {"model": model, "optimizer": opt, "loader": loader, "step": step}
                        )
                        copies.append(time.perf_counter() - t1)
                    ts.append(time.perf_counter() - t0)
                block[mode] = statistics.median(ts)
                if r >= 0:
                    times[mode] += ts
            if r >= 0:
                overhead.append(block["memory"] / block["none"] - 1)
        if s.rank == 0:
            none = statistics.median(times["none"])
            copy = statistics.median(copies[per_block:])
            with_snapshot = statistics.median(times["memory"])
            print(
                f"memory_recovery cost: {spec}, {s.world_size} ranks, {rounds} rounds x {per_block} steps, "
                f"load {os.getloadavg()[0]:.1f}\n  state per rank {snaps.last_bytes / 1e6:.1f} MB; "
                f"step without a snapshot {none:.3f} s, with {with_snapshot:.3f} s; "
                f"overhead per round {_spread([o * 100 for o in overhead], 1)} %; the copy alone "
                f"{copy:.3f} s = {copy / none * 100:.1f}% of a step "
                f"({snaps.last_bytes / copy / 1e9:.2f} GB/s)",
                flush=True,
            )
        snaps.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("recovery")
    r.add_argument("--nproc", type=int, default=2)
    r.add_argument("--strategy", default="ddp")
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--seed", type=int, default=None)
    t = sub.add_parser("torchft")
    t.add_argument("--reps", type=int, default=5)
    c = sub.add_parser("cost")
    c.add_argument("workload", nargs="?", default="mlp")
    c.add_argument("rounds", nargs="?", type=int, default=5)
    c.add_argument("steps", nargs="?", type=int, default=6)
    a = p.parse_args()
    if a.what == "recovery":
        recovery(a.nproc, a.strategy, a.reps, a.seed)
    elif a.what == "torchft":
        torchft(a.reps)
    else:
        cost(a.workload, a.rounds, a.steps)


if __name__ == "__main__":
    main()
