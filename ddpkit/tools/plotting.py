"""matplotlib for the commands that draw (trace, bench, plan), on a backend that needs no display.

    plt = pyplot()          # matplotlib.pyplot, imported on first use with the "Agg" backend

Its own module so that the tools and the bench draw with one helper without importing each other.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive backend (benchmarks run on headless machines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
