"""The test helper itself: a rank pool never hands a test the result of an earlier request."""

from __future__ import annotations

import time

import pytest
from rankpool import RankFailure, RankPool


def answer(value: int) -> int:
    return value


def slow_answer(value: int, seconds: float) -> int:
    time.sleep(seconds)
    return value


def test_a_late_result_of_an_earlier_request_is_dropped() -> None:
    pool = RankPool(2)
    try:
        assert pool.run(answer, 1, timeout=60) == [1, 1]
        # rank 0 answers the old request at once, rank 1 after the pool gave up on it: both late
        # answers are put in the queue before the next request's (the worker is busy until then).
        pool.request_id += 1  # what a timed-out `run` leaves behind: an id no one waits for any more
        stale = pool.request_id
        for inbox in pool._inboxes:
            inbox.put((stale, slow_answer, (2, 0.5)))
        assert pool.run(answer, 3, timeout=60) == [3, 3]
        assert pool.dropped == 2
    finally:
        pool.close()


def test_after_a_timeout_the_next_request_gets_its_own_answer() -> None:
    pool = RankPool(2)
    try:
        with pytest.raises(RankFailure, match="timed out after 1"):
            pool.run(slow_answer, 5, 3.0, timeout=1)
        assert pool.run(answer, 6, timeout=60) == [6, 6]
    finally:
        pool.close()
