"""The profiler switch: torch.profiler on chosen ranks and steps, one trace file per rank.

    profiler = StepProfiler.build(ProfileOptions(ranks=(0, 1), wait=1, warmup=1, active=3), rank=r)
    for step in ...:
        train_step()
        profiler.step()          # the schedule: wait, warmup, active (traced), then (repeat) again
    profiler.stop()

Every active window writes `<directory>/rank<r>-step<n>.trace.json`, a Chrome trace (`traceEvents`)
that Perfetto (ui.perfetto.dev) and chrome://tracing open. `stacks=True` records the Python stack of
every op (`with_stack`), `memory=True` what each op allocated and frees (`profile_memory`) and, beside
the trace, `rank<r>-step<n>.memory.txt`, the profiler's memory view: the ops ordered by the memory
they allocated (on CPU the only memory view there is).

On CUDA `oom_snapshot=True` (the default) also records the caching allocator's history and, when an
allocation fails, dumps `<directory>/rank<r>-oom.pickle`, a memory snapshot that
pytorch.org/memory_viz opens. On CPU there is no caching allocator and so nothing to snapshot: the
observer is not installed and `describe()` says so.

Off costs nothing: with `profile=None` there is no profiler object, and a rank that is not chosen gets
`NullProfiler`, whose `step()` returns at once (benchmarks/profiler_cost.py measures both).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ddpkit.errors import problem


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    """What to profile: which ranks ("all" or a tuple), the schedule, what to record, where to write."""

    ranks: tuple[int, ...] | str = (0,)
    wait: int = 1  # steps skipped before each window
    warmup: int = 1  # steps profiled but thrown away (the profiler's own start-up)
    active: int = 3  # steps traced
    repeat: int = 1  # windows (0: until the run ends)
    stacks: bool = False
    memory: bool = False
    shapes: bool = False
    directory: str = "profiles"
    oom_snapshot: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.ranks, list):
            object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.ranks != "all" and not (
            isinstance(self.ranks, tuple) and all(isinstance(r, int) and r >= 0 for r in self.ranks)
        ):
            raise problem(
                f"profile ranks={self.ranks!r} is neither 'all' nor a tuple of ranks",
                "Pass ranks='all' or ranks=(0, 1)",
            )
        if self.wait < 0 or self.warmup < 0 or self.active < 1 or self.repeat < 0:
            raise problem(
                f"profile schedule wait={self.wait}, warmup={self.warmup}, active={self.active}, "
                f"repeat={self.repeat} is out of range",
                "Use wait >= 0, warmup >= 0, active >= 1 and repeat >= 0 (0: every window until the end)",
            )

    @classmethod
    def of(cls, value: ProfileOptions | Mapping[str, Any] | bool | None) -> ProfileOptions | None:
        """What `session(profile=...)` takes: None/False (off), True (the defaults), a dict, or options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise problem(
                    f"profile= has unknown key(s) {unknown}", f"Use some of {', '.join(sorted(known))}"
                )
            return cls(**value)
        raise problem(
            f"profile={value!r} is not a ProfileOptions, a dict or True",
            "Pass profile=True, profile={'ranks': (0,), 'active': 3} or ProfileOptions(...)",
        )

    def chosen(self, rank: int) -> bool:
        return self.ranks == "all" or rank in self.ranks


class NullProfiler:
    """A rank that is not profiled: every call returns at once."""

    traces: list[Path] = []  # noqa: RUF012 (never written)

    def step(self) -> None:
        return None

    def stop(self) -> None:
        return None

    def describe(self) -> str:
        return "not profiled on this rank"


class StepProfiler:
    """torch.profiler driven by the training steps; writes one trace per rank and active window."""

    def __init__(self, options: ProfileOptions, rank: int, device: torch.device) -> None:
        self.options, self.rank, self.device = options, rank, device
        self.directory = Path(options.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.traces: list[Path] = []
        self.memory_views: list[Path] = []
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(
            activities=activities,
            schedule=schedule(
                wait=options.wait, warmup=options.warmup, active=options.active, repeat=options.repeat
            ),
            on_trace_ready=self._written,
            record_shapes=options.shapes or options.memory,
            profile_memory=options.memory,
            with_stack=options.stacks,
        )
        self.oom = OomSnapshot(self.directory, rank, device) if options.oom_snapshot else None
        self._profile.start()
        self._running = True

    @classmethod
    def build(
        cls,
        value: ProfileOptions | Mapping[str, Any] | bool | None,
        rank: int,
        device: torch.device | str = "cpu",
    ) -> StepProfiler | NullProfiler | None:
        """The session's profiler: None when off, `NullProfiler` on a rank not chosen."""
        options = ProfileOptions.of(value)
        if options is None:
            return None
        if not options.chosen(rank):
            return NullProfiler()
        return cls(options, rank, torch.device(device))

    def _written(self, prof: profile) -> None:
        stem = self.directory / f"rank{self.rank}-step{prof.step_num}"
        trace = stem.with_suffix(".trace.json")
        prof.export_chrome_trace(str(trace))
        self.traces.append(trace)
        if self.options.memory:
            key = "self_cuda_memory_usage" if self.device.type == "cuda" else "self_cpu_memory_usage"
            view = stem.with_suffix(".memory.txt")
            view.write_text(prof.key_averages().table(sort_by=key, row_limit=40))
            self.memory_views.append(view)

    def step(self) -> None:
        """One training step ended (the stepper calls it after the optimizer step)."""
        if self._running:
            self._profile.step()

    def stop(self) -> None:
        """End profiling; an active window cut short by the run's end is written as it is."""
        if self._running:
            self._running = False
            self._profile.stop()
        if self.oom is not None:
            self.oom.remove()

    def describe(self) -> str:
        o = self.options
        what = ", ".join(
            n for n, on in (("stacks", o.stacks), ("memory", o.memory), ("shapes", o.shapes)) if on
        )
        oom = self.oom.describe() if self.oom is not None else "no OOM snapshot"
        return (
            f"profiling rank {self.rank}: wait {o.wait}, warmup {o.warmup}, active {o.active} steps, "
            f"repeat {o.repeat}{', with ' + what if what else ''}; traces in {self.directory}; {oom}"
        )


class OomSnapshot:
    """On CUDA: record the allocator's history; when an allocation fails, dump a memory snapshot."""

    def __init__(self, directory: Path, rank: int, device: torch.device, max_entries: int = 100_000) -> None:
        self.path = directory / f"rank{rank}-oom.pickle"
        self.installed = device.type == "cuda" and torch.cuda.is_available()
        self.dumped = False
        if self.installed:
            torch.cuda.memory._record_memory_history(max_entries=max_entries)
            torch._C._cuda_attach_out_of_memory_observer(self.observer())  # type: ignore[attr-defined]

    def observer(self) -> Callable[[int, int, int, int], None]:
        def dump(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
            with open(self.path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)
            self.dumped = True

        return dump

    def remove(self) -> None:
        if self.installed:
            torch.cuda.memory._record_memory_history(enabled=None)

    def describe(self) -> str:
        if self.installed:
            return f"an out-of-memory error dumps {self.path} (open it in pytorch.org/memory_viz)"
        return (
            "no OOM snapshot on CPU (no caching allocator to snapshot; memory=True gives the profiler's "
            "memory view instead)"
        )
