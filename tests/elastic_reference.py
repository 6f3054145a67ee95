"""The uninterrupted reference runs of tests/test_elastic.py and tests/test_hsdp_elastic.py, in one process.

    python tests/elastic_reference.py ROOT LOOP [LOOP ...]    # writes ROOT/LOOP/final.safetensors

Each loop of tests/elastic_train.py in turn, unlaunched: world size 1, the global batch 8 in one batch
of 8, the same samples in the same order at every step as at any world size (the sampler's order does
not depend on it), so the weights differ from a 2-rank run's only in the order of the sums (the tests'
1e-5 bound), and not at all for "invariant" (reproducible="any-world": bitwise at any world size, which is
what that test checks). One interpreter and one torch import for all the loops a module needs, instead of
a `ddpkit run --nproc 2` (three interpreters) per loop. List "invariant" first: its bits are compared, and
it then runs as it does in a fresh worker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import elastic_train


def main() -> None:
    root = Path(sys.argv[1])
    for loop in sys.argv[2:]:
        out = root / loop
        out.mkdir(parents=True)
        # no checkpoint is due (1000 > 24 steps): the reference needs none
        elastic_train.main(
            [str(out / "ckpt"), str(out), "--sleep", "0", "--loop", loop, "--save-every", "1000"]
        )


if __name__ == "__main__":
    main()
