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

cost: on each rank, blocks of steps in four modes, interleaved (the order rotated every round, a
warm-up round first that also faults in the slots' pages): "none" (no snapshot), "memory" (a snapshot
after each step, no buddy), "behind" and "before-next-step" (the snapshot, and its copy to a buddy
keeper in that `s.load(..., buddy=)` mode: each rank's own home keeper and buddy keeper on this host,
over loopback TCP, not a link between hosts). Per mode: the step time (median of rank 0's steps), the
overhead per round (mode / none - 1: median [min..max]), the training thread's wait for the buddy per
step (median [min..max]) and the bytes sent per step; and the copy time alone, with the bytes a rank
copies.
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


COST_MODES = ("none", "memory", "behind", "before-next-step")


def cost(spec: str, rounds: int, per_block: int) -> None:
    """Run under `ddpkit run --nproc N`: see the module docstring."""
    import torch

    import ddpkit
    from ddpkit.checkpoint.memory import MemorySnapshots
    from ddpkit.cluster.keeper import Keeper
    from ddpkit.tools import workloads

    torch.set_num_threads(1)
    wl = workloads.load(spec)
    keepers = [Keeper.start() for _ in range(2)] + [Keeper.start(tcp="127.0.0.1:0") for _ in range(2)]
    with ddpkit.session(seed=0, verbose=False) as s:
        model = s.model(wl.build())
        opt = wl.optimizer(model.parameters())
        loader = s.loader(wl.dataset(batches=4), batch_size=wl.global_batch, shuffle=True)
        key = f"w{s.world_size}/r{s.rank}"
        snaps = {"memory": MemorySnapshots(None, key)}
        for i, mode in enumerate(("behind", "before-next-step")):  # each its home keeper and its buddy
            snaps[mode] = MemorySnapshots.attach(keepers[i].name, s.rank, s.world_size)
            snaps[mode].strict = mode == "before-next-step"
            snaps[mode].wire(str(keepers[2 + i].tcp), keepers[2 + i].token)
        owner = s.checkpoints._ctx.strategy
        batches = iter(loader)
        times: dict[str, list[float]] = {m: [] for m in COST_MODES}
        waits: dict[str, list[float]] = {m: [] for m in COST_MODES}
        overhead: dict[str, list[float]] = {m: [] for m in COST_MODES[1:]}
        copies: list[float] = []
        step = 0
        for r in range(-1, rounds):  # round -1: warm-up
            block: dict[str, float] = {}
            order = COST_MODES[r % 4 :] + COST_MODES[: r % 4]  # rotated every round
            for mode in order:
                ts = []
                for _ in range(per_block):
                    s.barrier()
                    t0 = time.perf_counter()
                    batch = next(batches, None)
                    if batch is None:
                        batches = iter(loader)
                        batch = next(batches)
                    waited = sum(x.waited_s for x in snaps.values())
                    if mode != "none":
                        snaps[mode].settle()  # what the product's forward pre-hook does (strict mode)
                    s.backward(wl.step_loss(model, batch))
                    s.step(opt)
                    step += 1
                    if mode != "none":
                        t1 = time.perf_counter()
                        state = {"model": model, "optimizer": opt, "loader": loader, "step": step}
                        snaps[mode].save(step, owner, state)
                        if mode == "memory":
                            copies.append(time.perf_counter() - t1)
                        if len(ts) == per_block - 1:
                            snaps[mode].settle()  # the block's last copy, charged to its last step
                    ts.append(time.perf_counter() - t0)
                    if r >= 0:
                        waits[mode].append(sum(x.waited_s for x in snaps.values()) - waited)
                block[mode] = statistics.median(ts)
                if r >= 0:
                    times[mode] += ts
            if r >= 0:
                for mode in COST_MODES[1:]:
                    overhead[mode].append(block[mode] / block["none"] - 1)
        if s.rank == 0:
            none = statistics.median(times["none"])
            copy = statistics.median(copies[per_block:])
            nbytes = snaps["memory"].last_bytes
            print(
                f"memory_recovery cost: {spec}, {s.world_size} ranks, {rounds} rounds x {per_block} steps "
                f"per mode, load {os.getloadavg()[0]:.1f}\n  state per rank {nbytes / 1e6:.2f} MB; step "
                f"without a snapshot {none:.4f} s; the copy alone {copy:.4f} s = {copy / none * 100:.1f}% "
                f"of a step ({nbytes / copy / 1e9:.2f} GB/s)",
                flush=True,
            )
            for mode in COST_MODES[1:]:
                sent = snaps[mode].sent_bytes / max(1, snaps[mode].copies)
                print(
                    f"  {mode:16s} step {statistics.median(times[mode]):.4f} s, overhead per round "
                    f"{_spread([o * 100 for o in overhead[mode]], 1)} %; the training thread's wait for the "
                    f"buddy per step {_spread([w * 1e3 for w in waits[mode]], 2)} ms; "
                    f"{sent / 1e6:.2f} MB sent per step",
                    flush=True,
                )
        for each in snaps.values():
            each.drop()
            each.close()
    for keeper in keepers:
        keeper.stop()


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
