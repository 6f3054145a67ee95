"""Putting a preempted job back in its scheduler's queue, behind the launcher's environment.

    requeue.of(env).requeue(mode, say)   # after the preemption checkpoint is committed, on global rank 0

`of(env)` picks the way this environment's scheduler requeues: Slurm's `scontrol requeue` when the job
has a `SLURM_JOB_ID`, else nothing (`NoRequeue`). Another scheduler is one more class with the
`Requeue` protocol and one more line in `of`. `mode` is `ddpkit run --requeue` ("auto": only a job
submitted requeueable; True; False).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Mapping
from typing import Protocol


class Requeue(Protocol):
    """One scheduler's way to requeue the job this process belongs to; True when it was requeued."""

    def requeue(self, mode: bool | str, say: Callable[[str], None]) -> bool: ...


class NoRequeue:
    """No scheduler that ddpkit can ask: the launcher restarts the job (or a person does)."""

    def requeue(self, mode: bool | str, say: Callable[[str], None]) -> bool:
        return False


class Slurm:
    """Slurm: `scontrol requeue $SLURM_JOB_ID` (with "auto", only when the job was submitted --requeue)."""

    def __init__(self, job: str, path: str | None) -> None:
        self.job, self.path = job, path

    def requeue(self, mode: bool | str, say: Callable[[str], None]) -> bool:
        job = self.job
        if mode is False:
            return False
        scontrol = shutil.which("scontrol", path=self.path)
        if scontrol is None:
            say(
                f"ddpkit: cannot requeue Slurm job {job}: `scontrol` is not on PATH in this environment (a "
                "container without Slurm's client tools?). The checkpoint is saved; requeue from outside "
                f"(`scontrol requeue {job}`), mount Slurm's binaries into the container, or pass "
                "--requeue 0 to skip this"
            )
            return False
        if mode == "auto" and not _requeueable(scontrol, job):
            say(
                f"ddpkit: Slurm job {job} was not submitted with --requeue: not requeued (sbatch --requeue, "
                "or ddpkit run --requeue 1, to have it requeued)"
            )
            return False
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            say(f"ddpkit: `scontrol requeue {job}` failed ({done.returncode}): {done.stderr.strip()}")
            return False
        say(f"ddpkit: requeued Slurm job {job}")
        return True


def of(env: Mapping[str, str]) -> Requeue:
    """The requeue of the scheduler this environment belongs to."""
    job = env.get("SLURM_JOB_ID")
    if job:
        return Slurm(job, env.get("PATH"))
    return NoRequeue()


def _requeueable(scontrol: str, job: str) -> bool:
    try:
        command = [scontrol, "show", "job", "-o", job]
        shown = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return "Requeue=1" in shown.stdout
