"""The job's stop policy, parsed once: which signal asks for a save-and-stop, and whether to requeue.

    options = PreemptionOptions.from_env(os.environ)    # in a rank: what `ddpkit run` passed down
    PreemptionOptions(signal="USR2", requeue="1")        # in `ddpkit run`: --preemption-signal, --requeue

One owner for each fact (torch-free, so the launcher's parser imports it without torch): a signal is
named ("USR1", "SIGUSR1", "TERM"), never numbered ("10" is SIGUSR1 on x86 Linux and SIGBUS on others,
so it is refused here, for the launcher and the ranks alike); `requeue` is parsed from its text
("auto", "1", "0") once, here; the variables' names and the exit code live in `ddpkit.names`.
`ddpkit.cluster.preemption` acts on the policy; the checkpoint wing never sees it.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from signal import Signals  # the field `signal` shadows the module in the class body's annotations

from ddpkit.errors import problem
from ddpkit.names import DEFAULT_PREEMPTION_SIGNAL, PREEMPTION_SIGNAL_ENV, REQUEUE_CHOICES, REQUEUE_ENV


def signal_of(name: str) -> Signals:
    """SIGUSR1 from "USR1" or "SIGUSR1" (any case); a clear error for anything else, numbers included."""
    text = str(name).strip().upper()
    found = getattr(signal.Signals, f"SIG{text.removeprefix('SIG')}", None) if text.isalnum() else None
    if not isinstance(found, signal.Signals):
        raise problem(
            f"{name!r} is not a signal name (numbers differ between platforms: pass the name)",
            "Pass a name such as USR1 (Slurm's --signal=USR1@120), USR2 (submitit) or TERM",
        )
    return found


def requeue_of(text: str | bool) -> bool | str:
    """ "auto" (requeue if the Slurm job was submitted with --requeue), True ("1") or False ("0")."""
    if isinstance(text, bool) or text == "auto":
        return text
    if text not in REQUEUE_CHOICES:
        raise problem(
            f"requeue {text!r} is not one of {', '.join(REQUEUE_CHOICES)}", "Pass --requeue auto, 1 or 0"
        )
    return text == "1"


@dataclass(frozen=True, kw_only=True)
class PreemptionOptions:
    """Which signal asks for a stop (besides SIGTERM), and whether to requeue a Slurm job after it."""

    signal: str = DEFAULT_PREEMPTION_SIGNAL
    requeue: bool | str = "auto"

    def __post_init__(self) -> None:  # both kept parsed: "sigusr2" is "USR2", "1" is True
        object.__setattr__(self, "signal", signal_of(self.signal).name.removeprefix("SIG"))
        object.__setattr__(self, "requeue", requeue_of(self.requeue))

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> PreemptionOptions:
        return cls(
            signal=env.get(PREEMPTION_SIGNAL_ENV, DEFAULT_PREEMPTION_SIGNAL),
            requeue=env.get(REQUEUE_ENV, "auto"),
        )

    def env(self) -> dict[str, str]:
        """What `ddpkit run` passes down to every rank (read back by `from_env`)."""
        requeue = "auto" if self.requeue == "auto" else "1" if self.requeue else "0"
        return {PREEMPTION_SIGNAL_ENV: self.signal, REQUEUE_ENV: requeue}

    @property
    def signals(self) -> tuple[Signals, ...]:
        """The signals that ask for a save-and-stop: SIGTERM and the policy's own."""
        return tuple(dict.fromkeys((signal.SIGTERM, signal_of(self.signal))))
