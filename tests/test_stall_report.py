"""The stall report's headline: the rank(s) outside a collective while others wait in one, named first.

The classification runs on stacks whose frames point at torch's real files (DDP's collectives are
issued from its Python methods straight into C++, so no torch.distributed function is on the stack);
the launcher's choice runs on torchrun's own `ProcessFailure`, reading error files that
`ddpkit.cluster.failures.record_failure` wrote. Real 2-rank runs are in test_faults.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from traceback import FrameSummary

import pytest
import torch.autograd
import torch.distributed.distributed_c10d as c10d
import torch.distributed.utils
import torch.nn.parallel.distributed as ddp_module
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ddpkit.cluster import failures
from ddpkit.cluster.watchdog import describe, format_report
from ddpkit.errors import DdpkitError

DDP = ddp_module.__file__
USER = "/home/me/train.py"


def _stack(*inner: tuple[str, str, str]) -> list[FrameSummary]:
    frames = [FrameSummary(USER, 11, "<module>", line="loss = model(x).sum()")]
    return frames + [FrameSummary(path, 100, name, line=line) for path, name, line in inner]


FORWARD = (DDP, "forward", "inputs, kwargs = self._pre_forward(*inputs, **kwargs)")


@pytest.mark.parametrize(
    ("stack", "state"),
    [
        (
            _stack(
                FORWARD,
                (DDP, "_pre_forward", "if torch.is_grad_enabled() and self.reducer._rebuild_buckets():"),
            ),
            "in DDP's forward: its bucket rebuild",
        ),
        (
            _stack(
                FORWARD,
                (DDP, "_pre_forward", "self._sync_buffers()"),
                (DDP, "_sync_buffers", "..."),
                (DDP, "_distributed_broadcast_coalesced", "dist._broadcast_coalesced("),
            ),
            "in DDP's forward: its buffer broadcast",
        ),
        (
            _stack(
                (DDP, "__init__", "_sync_module_states("),
                (torch.distributed.utils.__file__, "_sync_params_and_buffers", "dist._broadcast_coalesced("),
            ),
            "in DDP's construction: its shape check and weight broadcast",
        ),
        (_stack((c10d.__file__, "all_reduce", "work.wait()")), "in all_reduce"),
        (
            _stack((torch.autograd.__file__, "backward", "_engine_run_backward(")),
            "in backward: DDP's gradient all-reduce",
        ),
        (
            _stack(FORWARD, (DDP, "_pre_forward", "self.reducer.prepare_for_forward()")),
            "running (not in a collective)",
        ),
        (_stack(), "running (not in a collective)"),
    ],
    ids=[
        "bucket-rebuild",
        "buffer-broadcast",
        "construction",
        "all_reduce",
        "backward",
        "ddp-not-waiting",
        "user",
    ],
)
def test_ddps_own_collectives_count_as_collectives(stack: list[FrameSummary], state: str) -> None:
    position = describe(stack)
    assert position["state"] == state
    assert position["collective"] is state.startswith("in ")
    assert (
        position["where"] == f"{USER}:11 in <module>: loss = model(x).sum()"
        and position["at"] == "train.py:11"
    )


def _at(state: str, line: int, code: str, collective: bool = True) -> dict:
    return {
        "state": state,
        "collective": collective,
        "where": f"{USER}:{line} in <module>: {code}",
        "at": f"train.py:{line}",
    }


SLEEPING = _at("running (not in a collective)", 9, "time.sleep(60)", collective=False)
REBUILD = _at("in DDP's forward: its bucket rebuild", 11, "loss = model(x).sum()")


def test_the_headline_names_the_ranks_that_never_came_and_where_they_are() -> None:
    report = format_report({0: REBUILD, 1: SLEEPING, 2: REBUILD}, world_size=4)
    assert report.headline == (
        "ranks 1, 3 did not reach the collective that ranks 0, 2 wait in (DDP's forward: its bucket rebuild, "
        f"at train.py:11): rank 1 is at {USER}:9 in <module>: time.sleep(60); rank 3 did not answer (blocked "
        "in native code holding the GIL, or gone)"
    )
    assert report.text.splitlines()[0] == report.headline
    assert report.ranks.splitlines()[0] == "Where every rank stands:"
    assert len(report.ranks.splitlines()) == 5


def test_no_culprit_when_every_rank_waits_in_the_same_collective_and_a_mismatch_is_said() -> None:
    assert format_report({0: REBUILD, 1: REBUILD}, world_size=2).headline is None
    other = _at("in all_reduce", 14, "s.all_reduce(loss)")
    headline = format_report({0: REBUILD, 1: other}, world_size=2).headline
    assert headline is not None and headline.startswith(
        "every rank waits in a collective, but not in the same"
    )
    assert "rank 1 in all_reduce at train.py:14" in headline


def _failure(
    tmp_path: Path,
    rank: int,
    exc: BaseException | None,
    *,
    when: float,
    stalled: str | None = None,
    exitcode: int = 1,
) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    if exc is not None:
        failures.write_error_file(str(path), exc, rank, when, stalled=stalled)
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_launcher_leads_with_the_stalled_rank_unless_a_rank_raised_first(tmp_path: Path) -> None:
    now = time.time()
    headline = "rank 1 did not reach the collective that rank 0 waits in (all_reduce, at train.py:7): ..."
    timeout = _failure(tmp_path, 0, DdpkitError("timed out"), when=now, stalled=headline)
    stopped = _failure(tmp_path, 1, None, when=now, exitcode=-15)  # the agent's SIGTERM, no file
    assert failures.stall_report({0: timeout, 1: stopped}) == (0, timeout, headline)
    # A rank that raised before the timeout is the cause: no stall headline, it is named as failing first.
    crashed = _failure(tmp_path, 1, ValueError("bad batch"), when=now - 1)
    assert failures.stall_report({0: timeout, 1: crashed}) is None
    plain = _failure(tmp_path, 0, RuntimeError("Connection closed by peer"), when=now + 1)
    assert failures.stall_report({0: plain, 1: crashed}) is None


def test_a_wait_through_the_store_gives_up_on_a_rank_that_stopped_beating() -> None:
    """A save's wait names a rank whose watchdog stopped (process or node gone) instead of waiting for
    the save limit; a rank that keeps beating is waited for. A real TCPStore, real threads."""
    import socket
    import threading
    import time as clock
    from datetime import timedelta

    import pytest
    import torch.distributed as dist

    from ddpkit.cluster.lifecycle import wait_for_keys
    from ddpkit.errors import DdpkitError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    store.set("alive/1", "7")  # one beat, then silence
    start = clock.monotonic()
    with pytest.raises(
        DdpkitError, match=r"rank 1 stopped answering while this rank waited for rank 1's part"
    ):
        wait_for_keys(store, ["part/1"], 60, "rank 1's part", heartbeats={1: "alive/1"}, silent_after=1)
    assert clock.monotonic() - start < 5  # not the 60 s limit (~2 s: the beats are read once a second)

    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(0.2):
            n += 1
            store.set("alive/2", str(n))

    threading.Thread(target=beat, daemon=True).start()
    threading.Timer(2.5, lambda: store.set("part/2", "done")).start()
    try:  # 2.5 s > silent_after (past two reads of the beats), but the rank beats: it is waited for
        assert wait_for_keys(
            store, ["part/2"], 60, "rank 2's part", heartbeats={2: "alive/2"}, silent_after=1
        )
    finally:
        stop.set()
