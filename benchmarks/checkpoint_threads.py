"""Where a save's CPU time goes, per thread and priority: what of it can take time from training.

    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_threads.py          # 5 rounds, 6 steps
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_threads.py 6 3      # width, rounds
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_threads.py 6 3 fsdp # under FSDP
    OMP_NUM_THREADS=1 ddpkit run --nproc 2 benchmarks/checkpoint_threads.py parts    # FSDP's pieces

The workload of `benchmarks/checkpoint_stall.py` (the 37.8M-parameter MLP with AdamW under DDP, or
FSDP: each rank's shards through DCP, whose planning and metadata run on the writer thread). Each
round runs a window of W steps per kind (none, sync, thread, process), the save at the first step, then
waits for the write; around each window every rank reads the CPU time (user + system, from /proc) of
each of its threads, of its writer process, and of the kernel's threads (children of kthreadd: the
page cache's writeback, softirqs), and the machine's total. Printed per kind, the median over rounds
of the CPU seconds beyond the window without a save, split by who spent them:

    train     training's own thread (the call, the GIL waits do not count: waiting is not CPU)
    normal    other threads of the rank at normal priority (gloo's workers and transport threads)
    idle      threads at SCHED_IDLE or niced (the writer's process group's gloo threads)
    ended     threads that ended meanwhile (the writer thread: started per save, at SCHED_IDLE)
    child     the writer process (SCHED_IDLE)
    kernel    kernel threads (writeback, softirq), machine-wide
    other     the machine's busy time no process above accounts for (other jobs, interrupts)

CPU that is not idle-priority (train, normal, kernel) takes time from the ranks whatever the writer's
priority; idle-priority CPU only uses what the ranks leave.

`parts` times the pieces of an FSDP save on their own (CPU seconds of the calling thread, median of
6): the state dicts (`strategy.sharded_state`), the copy of the shards into fresh memory (a clone)
and into memory reused from the save before (`staging.Arena`), DCP's save planning with and without
its plan cache (`DefaultSavePlanner(enable_plan_caching=True)`; local planning, the rank's own plan
as the global one), and on rank 0 how long a busy Python loop on the main thread is kept from the
interpreter lock while a thread writes the rank's shards (`writer_child.write_items`: the sum of its
gaps over 4 ms, and the longest).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
from checkpoint_stall import workload  # this folder is on sys.path when run as a script

import ddpkit

ROOT = Path(tempfile.gettempdir()) / f"ddpkit-checkpoint-threads-{os.getuid()}"
KINDS = {"none": None, "sync": False, "thread": "thread", "process": "process"}
TICK = os.sysconf("SC_CLK_TCK")
IDLE_POLICY = 5  # SCHED_IDLE


def _stat(path: str) -> list[str] | None:
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # the fields after the name: [0] is field 3 (state)


def _cpu(rest: list[str]) -> float:
    return (int(rest[11]) + int(rest[12])) / TICK  # utime + stime


def sample(child: int | None) -> dict[str, float]:
    """CPU seconds so far: this process's threads by class, the writer process, the kernel's threads,
    and the machine's busy total."""
    out = dict.fromkeys(("train", "normal", "idle", "ended", "child", "kernel", "busy"), 0.0)
    me = os.getpid()
    whole = _stat(f"/proc/{me}/stat")
    assert whole is not None
    out["ended"] = _cpu(whole)  # the process's total, threads that ended included: live ones taken off below
    for tid in os.listdir(f"/proc/{me}/task"):
        rest = _stat(f"/proc/{me}/task/{tid}/stat")
        if rest is None:
            continue
        if int(tid) == me:
            out["train"] += _cpu(rest)
        elif int(rest[38]) == IDLE_POLICY or int(rest[16]) > 0:
            out["idle"] += _cpu(rest)
        else:
            out["normal"] += _cpu(rest)
    out["ended"] -= out["train"] + out["normal"] + out["idle"]
    if child is not None:
        rest = _stat(f"/proc/{child}/stat")
        out["child"] = _cpu(rest) if rest else 0.0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            rest = _stat(f"/proc/{pid}/stat")
            if rest is not None and rest[1] == "2":  # ppid 2: a kernel thread
                out["kernel"] += _cpu(rest)
    with open("/proc/stat") as f:
        cpu = [int(v) for v in f.readline().split()[1:]]
    out["busy"] = (sum(cpu[:8]) - cpu[3] - cpu[4]) / TICK  # all but idle and iowait
    return out


def main(s, width: int, rounds: int, strategy: str = "ddp") -> None:
    model, opt, step = workload(s, strategy)  # the stall benchmark's, so the two measure the same save

    if s.is_main:
        shutil.rmtree(ROOT, ignore_errors=True)
    s.barrier()
    for kind, mode in KINDS.items():  # warm-up: the writer group, the writer process, the arena
        step()
        if mode is not None:
            s.save(ROOT / kind, model=model, optimizer=opt, step=0, keep=1, background=mode)
            s.checkpoints.wait()
    load = os.getloadavg()[0]
    spent: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    for r in range(rounds):
        for kind in list(KINDS) if r % 2 == 0 else list(reversed(KINDS)):
            mode = KINDS[kind]
            process = s.checkpoints._process  # the benchmark reads the writer's pid; not an API
            child = process.process.pid if process is not None else None
            s.barrier()
            before, t0 = sample(child), time.perf_counter()
            for i in range(width):
                step()
                if i == 0 and mode is not None:
                    s.save(ROOT / kind, model=model, optimizer=opt, step=r + 1, keep=1, background=mode)
            s.checkpoints.wait()
            s.barrier()
            after = sample(child)
            delta = {k: after[k] - before[k] for k in after}
            delta["wall"] = time.perf_counter() - t0
            spent[kind].append(delta)
    mine = {k: {c: statistics.median(d[c] for d in v) for c in v[0]} for k, v in spent.items()}
    everyone: list[dict | None] = [None] * s.world_size
    dist.all_gather_object(everyone, mine)
    if not s.is_main:
        return
    classes = ("train", "normal", "idle", "ended", "child", "kernel")
    print(
        f"checkpoint_threads: {strategy}, {s.world_size} rank(s), windows of {width} steps (the write "
        f"waited for inside), {rounds} rounds; load {load:.1f} -> {os.getloadavg()[0]:.1f}; CPU seconds "
        "beyond the window without a save, median over rounds; other: the machine's busy time beyond "
        "the ranks' and the kernel's"
    )
    print(f"  {'kind':8s} {'rank':>4s} {'wall':>6s} " + " ".join(f"{c:>6s}" for c in classes) + "  other")
    for kind in ("sync", "thread", "process"):
        ranks = [e for e in everyone if e is not None]
        ours = sum(e[kind][c] - e["none"][c] for e in ranks for c in classes[:5])
        kernel = ranks[0][kind]["kernel"] - ranks[0]["none"]["kernel"]
        other = ranks[0][kind]["busy"] - ranks[0]["none"]["busy"] - ours - kernel
        for rank, e in enumerate(ranks):
            d, b = e[kind], e["none"]
            cols = [d["wall"] - b["wall"], *(d[c] - b[c] for c in classes)]
            print(
                f"  {kind:8s} {rank:4d} "
                + " ".join(f"{v:6.2f}" for v in cols)
                + (f" {other:6.2f}" if rank == 0 else "")
            )


def parts(s) -> None:
    import threading

    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ddpkit.checkpoint import dcp
    from ddpkit.checkpoint.staging import Arena
    from ddpkit.checkpoint.writer_child import write_items

    model, opt, step = workload(s, "fsdp")
    step()
    say = print if s.is_main else (lambda *a: None)

    def cpu(fn, n: int = 6) -> str:
        times = []
        for _ in range(n):
            t = time.thread_time()
            fn()
            times.append(time.thread_time() - t)
        return f"{statistics.median(times) * 1e3:.1f} ms [{min(times) * 1e3:.1f}..{max(times) * 1e3:.1f}]"

    state = s.strategy.sharded_state(model, {"optimizer": opt})
    arena = Arena()
    arena.reset()
    dcp.stage(state, arena.stage)

    def reused() -> None:
        arena.reset()
        dcp.stage(state, arena.stage)

    def plan(cache: bool) -> None:
        planner = DefaultSavePlanner(enable_plan_caching=cache)
        planner.set_up_planner(state, None, True)
        writer = FileSystemWriter(ROOT / "plan", single_file_per_rank=True)
        writer.set_up_storage_writer(True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        plans, _ = planner.create_global_plan([local])
        planner.finish_plan(writer.prepare_global_plan(plans)[0])

    say(
        f"checkpoint_threads parts: fsdp, {s.world_size} rank(s); load {os.getloadavg()[0]:.1f}; CPU of the "
        "calling thread per save, median [min..max] of 6"
    )
    say(f"  state dicts (sharded_state) {cpu(lambda: s.strategy.sharded_state(model, {'optimizer': opt}))}")
    say(f"  copy into fresh memory (clone) {cpu(lambda: dcp.stage(state))}")
    say(f"  copy into reused memory (arena) {cpu(reused)}")
    say(f"  DCP planning without its cache {cpu(lambda: plan(False))}; with it {cpu(lambda: plan(True))}")
    s.barrier()
    if s.is_main:  # the other rank waits in the barrier below
        staged = dcp.stage(state)
        tensors = [dcp.exact(t.to_local() if hasattr(t, "to_local") else t) for t in _tensors(staged)]
        ROOT.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            thread = threading.Thread(target=write_items, args=(str(ROOT / "gil.distcp"), tensors))
            gaps, last = [], time.perf_counter()
            thread.start()
            while thread.is_alive():
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            thread.join()
            held = sum(g for g in gaps if g > 0.004)
            say(
                f"  a thread writing the rank's {sum(t.nbytes for t in tensors) / 2**20:.0f} MiB of shards: "
                f"the main thread's gaps over 4 ms add to {held * 1e3:.0f} ms, the longest "
                f"{max(gaps) * 1e3:.0f} ms"
            )
    s.barrier()


def _tensors(tree):
    if hasattr(tree, "shape"):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


if __name__ == "__main__":
    if sys.argv[1:2] == ["parts"]:
        with ddpkit.session(seed=0, verbose=False) as session:
            parts(session)
        sys.exit(0)
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    strategy = sys.argv[3] if len(sys.argv) > 3 else "ddp"
    with ddpkit.session(seed=0, verbose=False) as session:
        main(session, width, rounds, strategy)
