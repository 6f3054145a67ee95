"""A node lost under HSDP (`ddpkit run --nnodes 1:2`, two hosts in network namespaces, as
tests/test_elastic.py): each host is one replica (HSDP's default degrees: shard = the ranks of a node,
replicate = the nodes); one host is SIGKILLed mid-run and the other resumes from the last HSDP
checkpoint at the smaller shape (here one process: the DCP shards read whole, the optimizer's momentum
included), the global batch kept, and ends within 1e-5 of an uninterrupted run (tests/elastic_reference.py). And two hosts of
2 ranks each: HSDP's default degrees make it HSDP(2x2), each host's ranks one shard group (their
all-gathers and reduce-scatters inside the namespace), the all-reduce of the shards across the link.
Needs root and iproute2 (skipped otherwise, with the reason).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_elastic import (  # noqa: F401
    _at,
    _check_finished,
    _lose_host_1,
    _prepare,
    _steps,
    _wait_for,
    hosts,
    namespaces,
    references,
)

REFERENCE_LOOPS = ("step",)  # the uninterrupted run both tests compare with (the references fixture)

pytestmark = [
    pytest.mark.numerics,
    pytest.mark.must_run("elastic"),
    *[m for m in __import__("test_elastic").pytestmark if m.name == "skipif"],
]


@pytest.mark.timeout(280)  # the inner limits, as test_elastic's lost host: 45 + 100 + 45 + 40 s
def test_an_hsdp_job_that_loses_a_host_resumes_on_the_other(hosts, references, tmp_path: Path) -> None:  # noqa: F811
    # both hosts hold after step 8 (tests/elastic_train.py) until host 1 is lost: mid-run whatever the load,
    # and between saves (test_elastic's _lose_host_1)
    args = ("--loop", "step", "--strategy", "hsdp", "--save-every", "3", "--hold", "2:8", "--sleep", "0")
    out, ckpt = _prepare(tmp_path)
    a, b = hosts(0, ckpt, out, args=args), hosts(1, ckpt, out, args=args)
    _wait_for(lambda: _at(2, 8)(out), 45, [a, b], out)
    references.start()  # uninterrupted, one process
    _lose_host_1(hosts, a, out)
    assert a.wait(timeout=45) == 0, (out / "host0.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights("step"))
    worlds = [w for w, *_ in steps]
    assert worlds[0] == 2 and worlds[-1] == 1, steps
    log = (out / "host0.log").read_text()
    assert "HSDP: 2 replica(s) x 1 shard(s)" in log, log[-3000:]  # the 2-host run was HSDP, one replica each
    resumed = [int(n) for n in re.findall(r"resumed from \S+ \(step (\d+)\)", log)]
    assert resumed and all(n % 3 == 0 for n in resumed), resumed  # from the HSDP checkpoints


@pytest.mark.timeout(200)  # the inner limits: meeting 60 + the end 60 + reference 40 s
def test_two_hosts_of_two_ranks_train_hsdp_2x2_to_the_reference_weights(
    hosts,  # noqa: F811
    references,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`ddpkit run --nnodes 2 --nproc 2` on each host, strategy="hsdp" with no degrees: replicate 2 (the
    hosts) x shard 2 (a host's ranks), the mesh named in the start-up line; all 24 steps at world size
    4 (per-rank batch 2, the global batch 8) and the final weights within 1e-5 of the uninterrupted run."""
    args = ("--loop", "step", "--strategy", "hsdp", "--sleep", "0", "--save-every", "12")
    shape = ("--nnodes", "2", "--nproc", "2")  # after the fixture's --nnodes 1:2 --nproc 1: these win
    out, ckpt = _prepare(tmp_path)
    a, b = hosts(0, ckpt, out, run_args=shape, args=args), hosts(1, ckpt, out, run_args=shape, args=args)
    _wait_for(lambda: bool(_steps(out)), 60, [a, b], out)
    references.start()  # only now, as above: the hosts have met
    for i, host in enumerate((a, b)):
        assert host.wait(timeout=60) == 0, (out / f"host{i}.log").read_text()[-3000:]
    steps = _check_finished(out, references.weights("step"))
    assert {w for w, *_ in steps} == {4}, steps
    log = (out / "host0.log").read_text() + (out / "host1.log").read_text()  # global rank 0 on either host
    assert "strategy hsdp over 2 node(s) x 2 rank(s), mesh replicate 2 x shard 2" in log, log[-3000:]
    assert "HSDP: 2 replica(s) x 2 shard(s)" in log, log[-3000:]
