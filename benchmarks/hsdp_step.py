"""HSDP's step on two "hosts" across a slow link: measured against what `ddpkit plan` predicts.

    sudo .venv/bin/python benchmarks/hsdp_step.py --rate 200mbit --rounds 3 --json runs/hsdp_step.json
    sudo .venv/bin/python benchmarks/hsdp_step.py --continue --rounds 1 --json runs/hsdp_step.json  # more
    .venv/bin/python benchmarks/hsdp_step.py --predict-from runs/hsdp_step.json   # the table again

A round takes about 4 minutes on 2 shared cores (4 launches of 4 ranks); no run starts after
`--budget-s` (540 s: each command stays under 10 minutes), the JSON is rewritten after every run.
Measured here (docs/planning.md, "HSDP across two hosts"): HSDP 2x2 3897 ms, predicted -13%; FSDP 4
5373 ms, -4%; DDP 4 2877 ms, +23%; the bytes each host sends per step as the model says.

Two network namespaces (the hosts, 10.78.0.1 and .2, each with its own hostname so that ddpkit sees two
machines and its shared-memory paths stay inside a host), joined by a veth whose two ends are limited
with `tc tbf` to `--rate` (optionally `--delay-ms` of netem latency): the inter-node link. Each host
runs `ddpkit run --nnodes 2 --nproc 2` (4 CPU ranks, 1 thread each, all on this machine's cores).

1. Links, as the planner defines them: gloo all-reduce (and all-gather, reduce-scatter) times inside a
   host (2 ranks) and between the hosts (one rank per host), `benchmarks/hsdp_step_worker.py links`;
   fitted with `ddpkit.plan.links` into a two-level `Link` (`links.two_level`).
2. Compute, as `ddpkit plan --contention measured` profiles it: 4 ranks computing side by side, no
   communication (`ddpkit.plan.profile.measure(ranks=4)`), once per round in the rotation below (the
   machine's load moves the compute by 2x between minutes here), the median profile used, as
   `ddpkit plan --repeats` does.
3. The prediction: `Planner.predict(4, Options(strategy=...))` on 2 nodes x 2 ranks for HSDP 2x2,
   FSDP over 4 and DDP over 4.
4. The measurement: each strategy's step (`s.backward; s.step`, median of rank 0's timed steps) in
   `--rounds` rounds, the strategies' order rotating every round; median over rounds, spread = (max -
   min) / median of the rounds' medians. Load average noted before and after.

Needs root, iproute2 and tc (sch_tbf). The hosts share this machine's cores: this checks the model's
communication terms and its shapes' ranking on a slow link, not a real cluster's compute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
WORKER = str(HERE / "hsdp_step_worker.py")
PORT = 29400  # inside fresh namespaces: nothing else listens there


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


class Hosts:
    """Two namespaces joined by a veth pair, each end shaped to `rate` (tbf) and `delay_ms` (netem)."""

    def __init__(self, rate: str, delay_ms: float) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names, self.links = [f"hsdp{tag}a", f"hsdp{tag}b"], [f"ha{tag}", f"hb{tag}"]
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for i, (ns, link) in enumerate(zip(self.names, self.links, strict=True)):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"10.78.0.{i + 1}/24", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            shape = ["tc", "-n", ns, "qdisc", "add", "dev", link, "root"]
            if delay_ms:
                subprocess.run(
                    [*shape, "handle", "1:", "netem", "delay", f"{delay_ms}ms"], check=True, timeout=20
                )
                shape = ["tc", "-n", ns, "qdisc", "add", "dev", link, "parent", "1:", "handle", "10:"]
            subprocess.run(
                [*shape, "tbf", "rate", rate, "burst", "256kb", "latency", "200ms"], check=True, timeout=20
            )

    def run(self, args: list[str], logs: Path, label: str, timeout: float) -> None:
        """`ddpkit run --nnodes 2 --nproc 2 WORKER args` on both hosts; raise with the logs if one fails."""
        procs = []
        for i, ns in enumerate(self.names):
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname hsdp-host{i} && exec "$@"',
                "--",
                sys.executable,
                "-m",
                "ddpkit.cli",
                "run",
                "--nnodes",
                "2",
                "--nproc",
                "2",
                "--rdzv-endpoint",
                f"10.78.0.1:{PORT}",
                "--local-addr",
                f"10.78.0.{i + 1}",
                WORKER,
                *args,
            ]
            env = {**os.environ, "GLOO_SOCKET_IFNAME": self.links[i], "OMP_NUM_THREADS": "1"}
            log = open(logs / f"{label}.host{i}.log", "w")  # noqa: SIM115 (closed with the process)
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            )
        try:
            for i, p in enumerate(procs):
                if p.wait(timeout=timeout) != 0:
                    raise RuntimeError(
                        f"{label}: host {i} failed:\n" + (logs / f"{label}.host{i}.log").read_text()[-3000:]
                    )
        finally:
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=20)

    def close(self) -> None:
        for ns in self.names:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def load() -> float:
    return os.getloadavg()[0]


def profile_beside(spec: str, global_batch: int, steps: int) -> dict[str, Any]:
    """`ddpkit plan --contention measured`'s profile at 4 ranks: 4 ranks computing side by side."""
    from ddpkit.plan import profile

    per_rank = global_batch // 4
    return profile.measure(spec, [per_rank], ranks=4, threads=1, steps=steps)[per_rank].as_dict()


def predict(
    link_rows: list[dict[str, Any]], profiles: list[dict[str, Any]], strategies: list[str], cores: int
) -> dict[str, Any]:
    """What `ddpkit plan` predicts for 2 nodes x 2 ranks from the measured links and profile."""
    from ddpkit.plan import links, profile
    from ddpkit.plan.planner import Planner
    from ddpkit.plan.simulate import Options

    link = links.two_level(link_rows, cores=cores)
    beside = profile.median_of([profile.Profile.from_dict(d) for d in profiles])  # as --repeats does
    per_rank = beside.batch
    pl = Planner(
        profiles={per_rank: beside}, link=link, per_node=2, beside={4: beside}, batches={4: per_rank}
    )
    out: dict[str, Any] = {
        "link": link.describe(),
        "profile": {
            "forward_ms": beside.forward_s * 1e3,
            "backward_ms": beside.backward_s * 1e3,
            "optimizer_ms": beside.optimizer_s * 1e3,
            "straggler_ms": beside.straggler_s * 1e3,
            "param_bytes": beside.param_bytes,
        },
    }
    for name in strategies:
        q = pl.predict(4, Options(strategy=name))  # across machines: no shared-memory sharded step
        out[name] = {
            "step_ms": q.step_s * 1e3,
            "comm_ms": q.comm_s * 1e3,
            "exposed_ms": q.exposed_s * 1e3,
            "slow_link_mb": q.slow_link_bytes / 1e6,
        }
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        *result["predicted"]["link"],
        f"compute (4 ranks side by side): {result['predicted']['profile']}",
        "| strategy | measured ms (spread) | predicted ms (error) | link MB per node: measured, predicted |",
        "|---|---|---|---|",
    ]
    for name in result["strategies"]:
        m, p = result["measured"][name], result["predicted"][name]
        label = {"hsdp": "HSDP 2x2", "fsdp": "FSDP 4", "ddp": "DDP 4"}.get(name, name)
        lines.append(
            f"| {label} | {m['step_ms']:.0f} (±{m['spread'] / 2:.0%}) | {p['step_ms']:.0f} "
            f"({p['step_ms'] / m['step_ms'] - 1:+.0%}) | "
            f"{m['link_mb_per_step']:.1f}, {p['slow_link_mb']:.1f} |"
        )
    loads = result.get("loads") or [result["load_start"]]
    lines.append(
        f"load average {result['load_start']:.2f} at start, {min(loads):.2f}-{max(loads):.2f} after runs "
        f"({result.get('rounds_done', 0)} round(s))"
    )
    return "\n".join(lines)


def summarise(result: dict[str, Any]) -> None:
    """Medians over rounds, spreads, link bytes; the prediction from the saved links and profile."""
    result["measured"] = {
        name: {
            "step_ms": statistics.median(v) * 1e3,
            "spread": (max(v) - min(v)) / statistics.median(v),
            "rounds_ms": [x * 1e3 for x in v],
            "link_mb_per_step": statistics.median(result["sent"][name]) / 1e6,
        }
        for name, v in result["runs"].items()
        if v
    }
    result["predicted"] = predict(result["links"], result["profiles"], result["strategies"], result["cpus"])


def save(result: dict[str, Any], path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="200mbit", help="tc rate of the inter-host link, each direction")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="netem delay on each end of the link")
    ap.add_argument("--workload", default="gpt")
    ap.add_argument("--global-batch", type=int, default=24)
    ap.add_argument("--strategies", default="hsdp,fsdp,ddp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-mb", type=float, default=8.0, help="largest message of the link measurement")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds")
    ap.add_argument("--json", default=None, help="results, rewritten after every run")
    ap.add_argument(
        "--continue",
        dest="more",
        action="store_true",
        help="add --rounds rounds to --json's (its links and profile kept; same link settings)",
    )
    ap.add_argument(
        "--predict-from",
        default=None,
        metavar="JSON",
        help="no measurement: predict again from an earlier run's links and profile",
    )
    ns = ap.parse_args()
    if ns.predict_from:
        with open(ns.predict_from) as f:
            result = json.load(f)
        summarise(result)
        print(table(result))
        return 0
    if os.geteuid() != 0:
        print("needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout`: still tear the hosts down
    start = time.monotonic()
    if ns.more:
        with open(ns.json) as f:
            result = json.load(f)
        result["load_continued"] = load()
    else:
        strategies = [s for s in ns.strategies.split(",") if s]
        result = {
            "rate": ns.rate,
            "delay_ms": ns.delay_ms,
            "workload": ns.workload,
            "steps": ns.steps,
            "global_batch": ns.global_batch,
            "load_start": load(),
            "cpus": os.cpu_count(),
            "strategies": strategies,
            "rounds_done": 0,
            "runs": {s: [] for s in strategies},
            "sent": {s: [] for s in strategies},
            "loads": [],
            "profiles": [],
        }
    strategies = result["strategies"]
    hosts = Hosts(result["rate"], result["delay_ms"])
    with tempfile.TemporaryDirectory(prefix="hsdp-step-") as tmp:
        logs = Path(tmp)
        try:
            if "links" not in result:
                hosts.run(["links", str(logs / "links.json"), "--max-mb", str(ns.max_mb)], logs, "links", 300)
                result["links"] = json.loads((logs / "links.json").read_text())["rows"]
                result["load_after_links"] = load()
                save(result, ns.json)
            for _ in range(ns.rounds):
                r = result["rounds_done"]
                items = ["profile", *strategies]  # the compute profile rotates with the runs: the same load
                order = items[r % len(items) :] + items[: r % len(items)]
                for name in order:
                    if time.monotonic() - start > ns.budget_s:
                        raise TimeoutError(
                            f"--budget-s {ns.budget_s:g} spent: stopping before {name}, round {r}"
                        )
                    if name == "profile":
                        result["profiles"].append(
                            profile_beside(result["workload"], result["global_batch"], result["steps"])
                        )
                        p = result["profiles"][-1]
                        ms = (p["forward_s"] + p["backward_s"] + p["optimizer_s"]) * 1e3
                        print(f"round {r} profile: compute {ms:.0f} ms (load {load():.2f})", flush=True)
                        save(result, ns.json)
                        continue
                    out = logs / f"train-{name}-{r}.json"
                    args = [
                        "train",
                        str(out),
                        "--strategy",
                        name,
                        "--workload",
                        result["workload"],
                        "--global-batch",
                        str(result["global_batch"]),
                        "--steps",
                        str(result["steps"]),
                    ]
                    hosts.run(args, logs, f"train-{name}-{r}", 300)
                    got = json.loads(out.read_text())
                    result["runs"][name].append(statistics.median(got["steps_s"]))
                    result["sent"][name].append(got["link_bytes_per_step"])
                    result["loads"].append(load())
                    if name not in result.setdefault("startup_lines", {}):
                        text = "".join((logs / f"train-{name}-{r}.host{i}.log").read_text() for i in (0, 1))
                        keys = ("strategy", "shared memory", "HSDP", "FSDP")
                        result["startup_lines"][name] = [
                            ln for ln in text.splitlines() if any(k in ln for k in keys)
                        ]
                    print(
                        f"round {r} {name}: {result['runs'][name][-1] * 1e3:.0f} ms (load {load():.2f})",
                        flush=True,
                    )
                    save(result, ns.json)
                result["rounds_done"] = r + 1
                save(result, ns.json)
        except TimeoutError as err:
            print(err, flush=True)
        finally:
            hosts.close()
    result["load_end"] = load()
    summarise(result)
    save(result, ns.json)
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
