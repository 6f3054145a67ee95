"""A tracker of one's own for tests: the two methods of `ddpkit.observe.tracking.Logger`, keeping what
`s.log` sends (tests/test_plugins.py, test_oom.py, test_spikes.py)."""

from __future__ import annotations

from collections.abc import Mapping


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.seen.append((step, dict(values)))

    def close(self) -> None:
        self.closed = True
