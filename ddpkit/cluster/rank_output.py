"""Every rank's stdout and stderr line-buffered, so that lines of ranks sharing one stream never tear.

    site = rank_output.write_site(run_dir)        # `ddpkit run`: PYTHONPATH=site for fresh interpreters
    rank_output.line_buffered()                   # a forked rank (warm start, ddpkit.spawn): itself

Why: the ranks share their launcher's stdout, and torchrun's agent starts each with `python -u`, whose
text streams write through: a plain `print(a, b)` writes `a`, the separator, `b` and the newline apart,
and another rank's writes land between them (measured: 4 ranks of `ddpkit run` printing 2,000 lines
each, 1,446 of the 8,000 lines torn). PYTHONUNBUFFERED is the same thing, and the default without either
(a block buffer, flushed every 8 KiB) cuts lines wherever the buffer fills. Line-buffered, each line goes
out in one write(), which a pipe keeps whole up to PIPE_BUF (4 KiB) and a file appends whole.

How it reaches each rank: no interpreter option or variable asks for line buffering, so a new
interpreter (torchrun's worker) gets it from a `sitecustomize` module that `ddpkit run` puts first on
PYTHONPATH (it then imports the environment's own sitecustomize, if there is one, and leaves sys.path
as it was). A process forked from the warm-start server or by `ddpkit.spawn` read its environment long
before, when the server or the parent started, so nothing in the environment could reach it: it calls
`line_buffered()` itself, as it becomes the rank. Standard library only (the site module runs it in
every interpreter the job starts).
"""

from __future__ import annotations

import sys
from pathlib import Path

SITE = '''"""Written by `ddpkit run` (ddpkit.cluster.rank_output): this process's stdout and stderr
line-buffered, then the environment's own sitecustomize, if any."""
import importlib
import os
import sys

for _stream in (sys.stdout, sys.stderr):
    if hasattr(_stream, "reconfigure"):
        _stream.reconfigure(line_buffering=True, write_through=False)
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_self = sys.modules.pop("sitecustomize")
try:
    importlib.import_module("sitecustomize")
except ModuleNotFoundError as _err:
    sys.modules["sitecustomize"] = _self  # none other: this one stays the imported sitecustomize
    if _err.name != "sitecustomize":
        raise
'''


def line_buffered() -> None:
    """This process's stdout and stderr flushed at every line, in one write (not through: `-u`)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)  # a notebook's stream has none
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)


def write_site(parent: Path) -> Path:
    """A folder holding only the `sitecustomize` above, for PYTHONPATH; under `parent`."""
    site = parent / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITE)
    return site
