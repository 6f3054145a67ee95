"""matplotlib for the commands that draw (trace, bench, plan), on a backend that needs no display.

    plt = pyplot()          # matplotlib.pyplot, imported on first use with the "Agg" backend

Its own module so that the tools and the bench draw with one helper without importing each other.
"""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the non-interactive backend (benchmarks run on headless machines).

    matplotlib is no dependency of training, so the core install leaves it to the `plots` extra; a command
    asked to draw without it stops with one paragraph that names the install instead of an ImportError."""
    try:
        import matplotlib
    except ImportError as err:
        from ddpkit.errors import problem

        raise problem(
            "drawing a figure needs matplotlib, which is not installed: ddpkit's training needs no plotting "
            "library, so a plain `pip install ddpkit` leaves it out",
            'Install it with `pip install "ddpkit[plots]"` (or leave out the option that asks for a picture, '
            "such as --plot)",
        ) from err

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
