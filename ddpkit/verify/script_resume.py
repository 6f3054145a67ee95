"""`ddpkit verify --resume-script train.py -- ARGS`: does the user's own script resume exactly?

    report = check_script(ScriptRun("train.py", ["--out", "ckpt"], nproc=2, stop_at=5))
    print(report.render()); assert report.passed

The script runs three times under `ddpkit run`, each in a folder of its own (relative paths in ARGS land
there; `{run}` in ARGS is replaced by that folder): once uninterrupted, and once stopped at its
`stop_at`-th optimizer step (`how="kill"`: as kill -9, it resumes from the script's own newest checkpoint;
`how="signal"`: as a scheduler's preemption signal, ddpkit saves at the next step boundary and exits 75)
then run again, resuming. Every rank records, through its session's checkpoints, what each save wrote
(digests of the weights, the shared objects such as the optimizer, each value, each rank's own part and
its generators), which checkpoint a load took, and per optimizer step the generators at the step's first
boundary and the weights after it (the checkpoint wing's recorder, switched on by this tool only).

The verdict: the script's last save, weights, optimizer state, values and every rank's part compared
bitwise between the two (same world size, same machine). On a difference, the steps after the
checkpoint resumed from are walked in both records to the first one that differs, and named:
- the generators differ at the step's start although s.load restored them: something draws from them
  after the save point in one run only (an evaluation at the resumed step, a batch drawn again);
- the generators agree but the weights after the step differ: the step's inputs were not what the
  uninterrupted run had (a batch drawn before the save point and not saved: a prefetched batch);
- and each saved value or object that differs at the first save both runs made after the resume.
A run after the stop that loaded no checkpoint did not resume (no s.load, or a root s.save does not write):
refused as such, even when its last checkpoint agrees (a deterministic run that starts over). Under
`how="signal"` a state without `step=` is named: the preemption advances only `step=`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit import names
from ddpkit.errors import problem

RECORD_ENV = names.VERIFY_RECORD_ENV  # as ddpkit.checkpoint.checkpoints reads them in the ranks
STOP_ENV = names.VERIFY_STOP_ENV


@dataclass(frozen=True, kw_only=True)
class ScriptRun:
    """The script, its arguments, the world size, the step to stop at, and how to stop."""

    script: str
    args: list[str] = field(default_factory=list)
    nproc: int = 2
    stop_at: int = 2
    how: str = "kill"
    timeout: float = 600.0
    workdir: str | None = None
    env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.how not in ("kill", "signal"):
            raise problem(f"how={self.how!r} is not 'kill' or 'signal'", "Pass --stop kill or --stop signal")
        if self.stop_at < 1:
            raise problem(
                f"stop_at={self.stop_at} is below 1", "Pass the optimizer step to stop at (1 or more)"
            )


@dataclass
class ScriptReport:
    passed: bool
    lines: list[str]

    def render(self) -> str:
        return "\n".join(self.lines)


def check_script(run: ScriptRun) -> ScriptReport:
    """Run the script uninterrupted and stopped-and-resumed; compare and explain (module docstring)."""
    base = Path(run.workdir or tempfile.mkdtemp(prefix="ddpkit-verify-script-"))
    full = _launch(run, base / "full", stop=None)
    first = _launch(run, base / "resumed", stop=f"{run.how}:{run.stop_at}", stopped=True)
    second = _launch(run, base / "resumed", stop=None, record="record-2")
    return compare(full, first, second, run)


def _launch(
    run: ScriptRun, folder: Path, *, stop: str | None, stopped: bool = False, record: str = "record"
) -> list[list[dict[str, Any]]]:
    folder.mkdir(parents=True, exist_ok=True)
    records = folder / record
    env = {**os.environ, **(run.env or {}), RECORD_ENV: str(records)}
    env.pop(STOP_ENV, None)
    if stop is not None:
        env[STOP_ENV] = stop
    args = [a.replace("{run}", str(folder)) for a in run.args]
    command = [sys.executable, "-m", "ddpkit.cli", "run", "--nproc", str(run.nproc)]
    done = subprocess.run(
        [*command, str(Path(run.script).resolve()), *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=run.timeout,
    )
    if (done.returncode != 0) != stopped or (stopped and run.how == "signal" and done.returncode != 75):
        if stopped and done.returncode == 0:
            steps = sum(e["event"] == "step" for e in _read(records / "rank-0.jsonl"))  # never saved: said
            if not steps:
                raise problem(
                    f"the script was not stopped at its optimizer step {run.stop_at}: it took no optimizer "
                    "step through s.step (the steps counted; a loop of loss.backward() and opt.step() is "
                    "never stopped)",
                    "Step with s.backward(loss) and s.step(opt) (README, Accumulation), or check the "
                    "training with ddpkit verify --resume --setup module:setup",
                )
            raise problem(
                f"the script was not stopped at its optimizer step {run.stop_at}: it ended after {steps} "
                "optimizer step(s)",
                f"Pass --save-at {max(1, steps - 1)} or less (an optimizer step the script reaches, before "
                "its last save), or arguments that make it train longer",
            )
        raise problem(
            f"the script ended with exit code {done.returncode} "
            f"({'stopped at step ' + str(run.stop_at) if stopped else 'uninterrupted'}): "
            + (done.stderr.strip().splitlines() or ["no output"])[-1],
            "Run it once by hand with ddpkit run, with the same arguments, and fix what it says",
        )
    return [_read(records / f"rank-{r}.jsonl") for r in range(run.nproc)]


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise problem(
            f"the script never saved or loaded through its session ({path.name} is missing)",
            "Resume with s.load(root, ...) at the start and save with s.save(root, ...): only then can "
            "ddpkit check the resume",
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def compare(
    full: list[list[dict[str, Any]]],
    first: list[list[dict[str, Any]]],
    second: list[list[dict[str, Any]]],
    run: ScriptRun,
) -> ScriptReport:
    """The verdict from the three runs' records (one list of events per rank)."""
    name = Path(run.script).name
    head = f"verify --resume-script {name}: {run.nproc} rank(s), stopped ({run.how}) at step {run.stop_at}"
    last_full = [_saves(r)[-1] if _saves(r) else None for r in full]
    last_resumed = [_saves(r)[-1] if _saves(r) else None for r in second]
    if any(s is None for s in last_resumed):
        return ScriptReport(False, [head, "  the resumed run saved nothing: nothing to compare"])
    if not _saves(first[0]):
        return ScriptReport(
            False,
            [
                f"{head}: nothing to resume from: the run stopped at step {run.stop_at} had written no "
                "checkpoint yet. Pass a later --save-at (after the script's first s.save that writes)"
            ],
        )
    if not any(e["event"] == "load" and e.get("checkpoint") for e in second[0]):
        return ScriptReport(False, [f"{head}: FAILED, it did not resume: {_started_over(second[0])}"])
    differ = [
        f"rank {r}: {part}"
        for r, (a, b) in enumerate(zip(last_full, last_resumed, strict=True))
        for part in _differences(a["digests"] if a else {}, b["digests"] if b else {})
    ]
    if not differ:
        return ScriptReport(True, [f"{head}: PASSED, the last checkpoint is bitwise the uninterrupted run's"])
    lines = [
        f"{head}: FAILED, the last checkpoint differs from the uninterrupted run's: " + "; ".join(differ)
    ]
    lines += _explain(full, first, second)
    if run.how == "signal":
        lines += _preempted(first[0])
    return ScriptReport(False, lines)


def _started_over(events: list[dict[str, Any]]) -> str:
    """Why the run after the stop trained from the start: no s.load, or one that found nothing."""
    if not any(e["event"] == "load" for e in events):
        return (
            "the script never calls s.load, so after the stop it trains again from the start (its last "
            "checkpoint agrees only because the run is deterministic, and the work is done twice). Call "
            '`step = s.load(root, model=model, optimizer=opt, step=0)["step"]` before the loop, with the '
            "root s.save writes"
        )
    return (
        "s.load found no checkpoint in its root, so after the stop it trains again from the start. Load "
        "from the root s.save writes (a relative root is relative to the folder the script runs in)"
    )


def _preempted(events: list[dict[str, Any]]) -> list[str]:
    """On a failure under --stop signal: the preemption saves the state given to the script's last s.save
    (or s.load) as it stands, with only `step=` advanced by the optimizer steps since; without `step=`, the
    script's own counter is saved as it was then (`events`: the stopped run's record)."""
    saves = _saves(events)
    if not saves or saves[-1].get("step") is not None:
        return []
    return [
        "  the checkpoint resumed from was written by the preemption, and the state given to s.save has no "
        "step=: ddpkit advances only step= by the optimizer steps since that call, so a counter under "
        "another name (it=, iter_num=) was saved as it was then and the resumed run repeats those steps. "
        "Pass the optimizer step count as step="
    ]


def _saves(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "save"]


WHAT = {"weights": "the weights of", "objects": "the state of", "values": "the value"}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    out = []
    for kind in ("weights", "objects", "values"):
        for name in sorted(set(a.get(kind, {})) | set(b.get(kind, {}))):
            if a.get(kind, {}).get(name) != b.get(kind, {}).get(name):
                out.append(f"{WHAT[kind]} {name}")
    if not out and a.get("rank") != b.get("rank"):
        out.append("its own part (its generators, loader position or per-rank objects)")
    return out


def _explain(
    full: list[list[dict[str, Any]]], first: list[list[dict[str, Any]]], second: list[list[dict[str, Any]]]
) -> list[str]:
    """The first optimizer step after the resume at which a rank's record differs, and why."""
    lines = []
    for r, (a, b) in enumerate(zip(full, second, strict=True)):
        loads = [e for e in b if e["event"] == "load" and e.get("checkpoint")]
        if not loads:
            lines.append(f"  rank {r}: the resumed run loaded no checkpoint: it started over")
            continue
        taken = int(loads[0]["checkpoint"].rsplit("-", 1)[-1])
        before = _steps_until_save(first[r], taken)  # the stopped run wrote the checkpoint resumed from
        ahead = [e for e in a if e["event"] == "step"][before:]
        after = [e for e in b if e["event"] == "step"]
        for i, (x, y) in enumerate(zip(ahead, after, strict=False)):
            step, nth = before + i + 1, _nth(i + 1)
            if x["rng"] != y["rng"]:
                lines.append(
                    f"  rank {r}: step {step} (the {nth} after the checkpoint resumed from) starts with "
                    "other generator states although s.load restored them: something draws from them between "
                    "the save point and the step in one run only (an evaluation at the resumed step, a batch "
                    "drawn again). Draw nothing between s.load and the loop that the uninterrupted run does "
                    "not draw there too, or run it after the step"
                )
                break
            if x["weights"] != y["weights"]:
                lines.append(
                    f"  rank {r}: step {step} (the {nth} after the checkpoint resumed from) starts with the "
                    "same generators as the uninterrupted run's but ends with other weights: its inputs "
                    "differ, a batch drawn before the save point (a prefetched batch) that the checkpoint "
                    "does not hold. Save it (s.save(..., X=X, Y=Y): kept per rank) or draw it after s.load"
                )
                break
        else:
            lines.append(f"  rank {r}: every step after the resume agrees; what differs is only in the saves")
    return lines


def _steps_until_save(events: list[dict[str, Any]], seq: int) -> int:
    """How many optimizer steps the uninterrupted run took before its save number `seq`."""
    steps = saves = 0
    for e in events:
        if e["event"] == "step":
            steps += 1
        elif e["event"] == "save":
            saves += 1
            if saves == seq:
                return steps
    return steps


def _nth(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")
