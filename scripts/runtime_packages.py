"""Print the site-packages paths (package folders and single modules) of what a ddpkit run can import:
ddpkit's own requirements and theirs, recursively, without any extra (torch, numpy, sympy, tqdm, ...).

scripts/setup.sh byte-compiles these where Python writes no bytecode (PYTHONDONTWRITEBYTECODE set, as on
this project's CI machines): every rank would otherwise compile torch's modules from source at each start.
The optional extras' packages (transformers, moto, the trackers: most of the venv's bytes) are left to the
test suite, which writes bytecode at their first import (tests/conftest.py).
"""

from __future__ import annotations

import re
from importlib import metadata


def closure(name: str, seen: dict[str, metadata.Distribution]) -> None:
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in seen:
        return
    try:
        seen[key] = dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:  # a requirement for another platform or Python
        return
    for requirement in dist.requires or []:
        if "extra ==" not in requirement:
            match = re.match(r"[A-Za-z0-9_.-]+", requirement)
            if match:
                closure(match.group(0), seen)


def main() -> None:
    seen: dict[str, metadata.Distribution] = {}
    closure("ddpkit", seen)
    tops = {
        str(dist.locate_file(file.parts[0]))
        for dist in seen.values()
        for file in dist.files or []
        if file.suffix == ".py" and file.parts[0] != ".."  # not the scripts pip puts in bin/
    }
    print("\n".join(sorted(tops)))


if __name__ == "__main__":
    main()
