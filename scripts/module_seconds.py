"""Write tests/module_seconds.json, each test module's seconds in a run of the whole suite, from that run's
JUnit XML: `python -m pytest --junitxml=run.xml && python scripts/module_seconds.py run.xml`.

The suite's two pytest-xdist workers take whole modules (`--dist loadfile`), and tests/conftest.py hands
them out longest first from this table. Left to xdist's own order (the modules with the most tests first),
the few-test modules that take longest (a 4-rank memory-cap proof, the elastic hosts) came last, and one
worker ran them alone at the end while the other core idled. The figures need not be exact, only in about
the right order: refresh them when a module's cost changes by much. A module not in the table is taken to
cost the median.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def module_seconds(junit: Path) -> dict[str, float]:
    """{"test_x.py": seconds} summed over the module's test cases (set-up, call and tear-down)."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit).iter("testcase"):
        parts = case.get("classname", "").split(".")  # "tests.test_x", or "tests.test_x.Class" for a method
        module = next((part for part in parts if part.startswith("test_")), parts[-1])
        seconds[f"{module}.py"] += float(case.get("time", 0))
    return {name: round(s, 1) for name, s in seconds.most_common()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/module_seconds.py RUN.xml  (a JUnit XML of the whole suite)")
    OUT.write_text(json.dumps(module_seconds(Path(sys.argv[1])), indent=0) + "\n")
    print(f"wrote {OUT}")
