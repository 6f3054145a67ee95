"""A node lost under HSDP (`ddpkit run --nnodes 1:2`, two hosts in network namespaces, as
tests/test_elastic.py): each host is one replica (HSDP's default degrees: shard = the ranks of a node,
replicate = the nodes); one host is SIGKILLed mid-run and the other resumes from the last HSDP
checkpoint at the smaller shape (here one process: the DCP shards read whole, the optimizer's momentum
included), the global batch kept, and ends within 1e-5 of an uninterrupted 2-rank run.
Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_elastic import _check_finished, _prepare, _steps, _wait_for, hosts, references  # noqa: F401

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.must_run("elastic"),
    *[m for m in __import__("test_elastic").pytestmark if m.name == "skipif"],
]


@pytest.mark.timeout(280)  # the inner limits, as test_elastic's lost host: 45 + 100 + 45 + 40 s
def test_an_hsdp_job_that_loses_a_host_resumes_on_the_other(hosts, references, tmp_path: Path) -> None:  # noqa: F811
    args = ("--loop", "step", "--strategy", "hsdp", "--save-every", "3", "--sleep-at-world", "2")
    out, ckpt = _prepare(tmp_path)
    a, b = hosts(0, ckpt, out, args=args), hosts(1, ckpt, out, args=args)
    _wait_for(lambda: sum(s[0] == 2 for s in _steps(out)) >= 4, 45, [a, b], out)
    references.start(("--loop", "step"))  # DDP over 2 ranks, uninterrupted
    hosts.lose(1)
    _wait_for(lambda: any(s[0] == 1 for s in _steps(out)), 100, [a], out)
    assert a.wait(timeout=45) == 0, (out / "host0.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights(("--loop", "step")))
    worlds = [w for w, *_ in steps]
    assert worlds[0] == 2 and worlds[-1] == 1, steps
    log = (out / "host0.log").read_text()
    assert "HSDP: 2 replica(s) x 1 shard(s)" in log, log[-3000:]  # the 2-host run was HSDP, one replica each
    resumed = [int(n) for n in re.findall(r"resumed from \S+ \(step (\d+)\)", log)]
    assert resumed and all(n % 3 == 0 for n in resumed), resumed  # from the HSDP checkpoints
