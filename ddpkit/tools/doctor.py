"""`ddpkit doctor`: what this machine and environment give, then a real 2-process all-reduce.

    ddpkit doctor            # the report; exit code 0 only when healthy
    ddpkit doctor --json     # the same facts as JSON, to paste into a bug report
    ddpkit doctor --script train.py   # also `ddpkit lint train.py`: its findings count as FAIL lines

Readable in ten seconds: one line per fact, `ok` / `FAIL` / `note` in front. Healthy means: a process
group backend is available, `auto` resolves to a plan without error, a free port can be bound, and two
local processes (ddpkit.spawn, gloo on the CPU; NCCL too when there are two GPUs, or two ranks
sharing the GPU over gloo when there is one) agree on an all-reduce within the timeout. The launcher
line says which launcher `ddpkit.cluster.environments` detected, and why a plan was chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from ddpkit.cluster import environments
from ddpkit.names import DEVICE_ENV

COMM_PREFIXES = ("NCCL_", "GLOO_", "DDPKIT_")  # communication and ddpkit's own, beside the launchers'
COMM_VARS = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_DISTRIBUTED_DEBUG", "KUBERNETES_SERVICE_HOST")


def launcher_env(env: dict[str, str]) -> dict[str, str]:
    """The variables that steer launching (`cluster.environments` owns that list) and communication."""
    comm = {k: v for k, v in env.items() if k in COMM_VARS or k.startswith(COMM_PREFIXES)}
    return dict(sorted({**environments.launcher_vars(env), **comm}.items()))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _smoke(device: str, share_gpu: bool = False) -> dict[str, Any]:
    """Rank body: all-reduce rank + 1 over the group; every rank must see 1 + 2 + ... + n."""
    import torch
    import torch.distributed as dist

    import ddpkit

    with ddpkit.session(device=device, verbose=False, share_gpu=share_gpu) as s:
        value = torch.tensor([float(s.rank + 1)], device=s.device)
        start = time.perf_counter()
        dist.all_reduce(value)
        seconds = time.perf_counter() - start
        return {"value": value.item(), "backend": s.plan.backend, "world": s.world_size, "seconds": seconds}


def smoke_test(
    device: str, nproc: int = 2, timeout: float = 60.0, share_gpu: bool = False
) -> tuple[bool, str]:
    import ddpkit

    start = time.perf_counter()
    try:
        out = ddpkit.spawn(_smoke, nproc=nproc, args=(device, share_gpu), timeout=timeout, threads=1)
    except Exception as err:  # the report names the failure; the exit code says unhealthy
        first = str(err).strip().splitlines()
        return False, f"{type(err).__name__}: {first[0] if first else ''}"
    want = nproc * (nproc + 1) / 2
    ok = all(r["value"] == want and r["world"] == nproc for r in out)
    detail = (
        f"{nproc} ranks, backend {out[0]['backend']}, all_reduce = {out[0]['value']:g} "
        f"(want {want:g}) in {out[0]['seconds'] * 1e3:.1f} ms; {time.perf_counter() - start:.1f} s "
        "with process start"
    )
    return ok, detail


def facts(env: dict[str, str]) -> dict[str, Any]:
    """Everything except the smoke test: cheap, no process started."""
    import torch
    import torch.distributed as dist

    from ddpkit import __version__
    from ddpkit.cluster import environments, topology
    from ddpkit.cluster.launch import resolve_nproc
    from ddpkit.errors import DdpkitError

    hw = topology.Hardware.detect()
    gpus = [torch.cuda.get_device_name(i) for i in range(hw.gpus)]
    nccl_version = None
    if dist.is_nccl_available() and torch.cuda.is_available():
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL present in the build but not loadable: reported as unavailable
            nccl_version = None
    try:
        plan = topology.resolve(env, hw)
        plan_text, plan_error, notes = plan.describe(), None, list(plan.notes)
    except DdpkitError as err:
        plan_text, plan_error, notes = None, str(err), []
    try:
        launcher = environments.describe(environments.detect(env))
    except DdpkitError as err:
        launcher = f"unreadable launcher variables ({str(err).splitlines()[0]})"
    nproc = resolve_nproc("auto", hw)
    return {
        "ddpkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpus": gpus,
        "cpu_cores": hw.cpu_cores,
        "torch_threads": torch.get_num_threads(),
        "backends": {
            "gloo": dist.is_gloo_available(),
            "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available(),
        },
        "nccl_version": nccl_version,
        "plan": plan_text,
        "plan_error": plan_error,
        "plan_notes": notes,
        "launcher": launcher,
        "why": _why(hw, env, launcher),
        "run_auto": f"`ddpkit run train.py` starts {nproc} process(es) x "
        f"{topology.threads_per_process(hw.cpu_cores, nproc)} CPU thread(s)"
        + (f"; `--nproc 2` gives 2 x {topology.threads_per_process(hw.cpu_cores, 2)}" if not hw.gpus else ""),
        "shm": _shm(),
        "env": launcher_env(env),
    }


def _why(hw: Any, env: dict[str, str], launcher: str) -> str:
    """Why auto chose the plan: the launcher (`ddpkit.cluster.environments`) and the device."""
    if env.get(DEVICE_ENV):
        device = f"{DEVICE_ENV}={env[DEVICE_ENV]}"
    elif hw.gpus:
        device = f"{hw.gpus} visible GPU(s): CUDA, NCCL between processes"
    else:
        device = "no visible GPU: CPU, gloo between processes"
    return f"{launcher}; {device}"


def _shm() -> str:
    """Whether ranks on this machine can share memory (the "shm" communication hook)."""
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm: the shm hook falls back to the process group"
    st = os.statvfs("/dev/shm")
    return f"/dev/shm has {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free"


def report(f: dict[str, Any], smoke: list[tuple[str, bool, str]], port: int | None) -> tuple[list[str], bool]:
    lines = []
    healthy = True

    def say(status: str, text: str) -> None:
        lines.append(f"{status:4s}  {text}")

    say("ok", f"ddpkit {f['ddpkit']}, torch {f['torch']}, Python {f['python']}, {f['platform']}")
    cuda = f"CUDA build {f['cuda_build']}" if f["cuda_build"] else "CPU-only torch build"
    gpu_text = ", ".join(f"cuda:{i} {n}" for i, n in enumerate(f["gpus"])) or "no GPU visible"
    say("ok" if f["gpus"] or not f["cuda_build"] else "note", f"{cuda}; {gpu_text}")
    say("ok", f"{f['cpu_cores']} CPU core(s) usable; torch uses {f['torch_threads']} thread(s) here")
    b = f["backends"]
    nccl = f"nccl {f['nccl_version']}" if f["nccl_version"] else f"nccl {'built in' if b['nccl'] else 'no'}"
    gloo, mpi = ("yes" if b["gloo"] else "NO"), ("yes" if b["mpi"] else "no")
    say("ok" if b["gloo"] or b["nccl"] else "FAIL", f"process group backends: gloo {gloo}, {nccl}, mpi {mpi}")
    healthy &= b["gloo"] or b["nccl"]
    if f["plan_error"]:
        say("FAIL", f"mode auto: {f['plan_error']}")
        healthy = False
    else:
        say("ok", f"mode auto: {f['plan']} ({f['why']})")
    for note in f["plan_notes"]:
        say("note", note)
    say("ok", f["run_auto"])
    say("ok" if "GiB free" in f["shm"] else "note", f"shared memory: {f['shm']}")
    env = ", ".join(f"{k}={v}" for k, v in f["env"].items()) or "none set"
    say("ok", f"launcher environment: {env}")
    say("ok" if port else "FAIL", f"free TCP port on 127.0.0.1: {port}" if port else "cannot bind a TCP port")
    healthy &= bool(port)
    for name, ok, detail in smoke:
        say("ok" if ok else "FAIL", f"smoke test ({name}): {detail}")
        healthy &= ok
    lines.append("healthy" if healthy else "NOT healthy: see the FAIL lines above")
    return lines, healthy


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddpkit doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for the smoke test")
    p.add_argument("--no-smoke", action="store_true", help="skip the 2-process all-reduce")
    p.add_argument("--script", nargs="+", default=[], help="also check training scripts (ddpkit lint)")
    ns = p.parse_args(argv)
    f = facts(dict(os.environ))
    try:
        port: int | None = free_port()
    except OSError:
        port = None
    smoke: list[tuple[str, bool, str]] = []
    if not ns.no_smoke:
        smoke.append(("gloo, CPU", *smoke_test("cpu", 2, ns.timeout)))
        if len(f["gpus"]) >= 2 and f["backends"]["nccl"]:
            smoke.append(("NCCL, 2 GPUs", *smoke_test("cuda", 2, ns.timeout)))
        elif len(f["gpus"]) == 1:  # NCCL needs 2 GPUs; CUDA tensors over gloo, 2 ranks on cuda:0
            smoke.append(("gloo, 2 ranks sharing cuda:0", *smoke_test("cuda", 2, ns.timeout, share_gpu=True)))
    lines, healthy = report(f, smoke, port)
    if ns.script:  # static checks of the user's scripts, `ddpkit lint`: findings are FAIL lines
        from ddpkit.lint import lint_paths

        f["lint"] = [x.render() for group in lint_paths(ns.script) for x in group]
        lines[-1:-1] = [f"FAIL  {x}" for x in f["lint"]] or [
            f"ok    lint: no finding in {' '.join(ns.script)}"
        ]
        healthy &= not f["lint"]
        lines[-1] = "healthy" if healthy else "NOT healthy: see the FAIL lines above"
    if ns.json:
        f.update(free_port=port, healthy=healthy)
        f["smoke"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in smoke]
        print(json.dumps(f, indent=1))
    else:
        print("\n".join(lines))
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
