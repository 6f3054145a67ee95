"""ddpkit.cpu_allocator: a session on the CPU keeps big blocks for reuse instead of faulting them in again.

Each check runs in a fresh interpreter: the settings are process-wide and cannot be undone.
"""

import os
import subprocess
import sys

import pytest

from ddpkit import cpu_allocator

pytestmark = pytest.mark.skipif(not cpu_allocator.enabled({}), reason="Linux with glibc only")

# Page faults over 20 "steps" that each allocate, fill and free two 64 MB tensors (as every training step
# does with its gradients and temporaries), after 3 such steps of warm-up, inside a CPU session.
# Measured: glibc ~655,000 (4 KB pages, every step), huge pages alone 21,760, ddpkit 544-3,264 (the heap
# grows now and then, 2 MB-aligned blocks do not always fit the freed ones).
PROBE = """
import resource, torch, ddpkit
with ddpkit.session(verbose=False, env={}):
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for step in range(23):
        if step == 3:
            before = faults()
        x = torch.ones(16 << 20); y = torch.ones(16 << 20); del x, y
    print(faults() - before)
"""


def _faults(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "THP_", "DDPKIT_"))}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_session_reuses_big_blocks_instead_of_faulting_them_in():
    assert _faults() < 8000  # mostly the same memory again (huge pages alone would fault 21,760)


def test_opt_out_keeps_glibc_behaviour():
    assert _faults(DDPKIT_CPU_ALLOCATOR="default") > 200_000


def test_rank_env_leaves_the_users_own_values_alone():
    env = cpu_allocator.rank_env({"MALLOC_MMAP_MAX_": "65536"})
    assert "MALLOC_MMAP_MAX_" not in env
    assert env["THP_MEM_ALLOC_ENABLE"] == "1" and env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30)
    assert cpu_allocator.rank_env({"DDPKIT_CPU_ALLOCATOR": "default"}) == {}
