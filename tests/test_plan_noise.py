"""The planner's own noise (issue 20): repeated profiles, predictions from the median, a band on step
time and efficiency, and no efficiency above 1 shown without saying that it is noise.

Synthetic profiles only: no process is started and nothing is timed.
"""

from dataclasses import replace

import pytest

from ddpkit.plan import links
from ddpkit.plan.planner import Planner
from ddpkit.plan.profile import Param, Profile, median_of
from ddpkit.plan.report import curve_table, efficiency_cell
from ddpkit.plan.simulate import Options

MB = 1 << 20


def _profile(compute_scale: float = 1.0, band: tuple[float, float] = (1.0, 1.0)) -> Profile:
    params = tuple(Param(name=f"p{i}", shape=(MB,), bytes=4 * MB, ready_s=0.002 * (i + 1)) for i in range(4))
    p = Profile(
        workload="synthetic",
        device="cpu",
        threads=1,
        batch=8,
        forward_s=0.010,
        backward_s=0.020,
        optimizer_s=0.005,
        copy_s=0.001,
        params=params,
        state_bytes=0,
        band=band,
    )
    return p.scaled(compute_scale)


def _planner(one: Profile, two: Profile) -> Planner:
    link = links.Link(name="test", intra=links.Level(name="t", alpha_s=10e-6, beta_Bps=10e9, source="test"))
    return Planner(profiles={8: one}, link=link, per_node=2, batches={1: 8, 2: 8}, beside={2: two})


def test_the_median_repeat_is_kept_and_the_others_become_its_band() -> None:
    runs = [_profile(1.18), _profile(1.0), _profile(0.85)]  # e.g. 822, 697, 592 ms for one device
    p = median_of(runs)
    assert p.compute_s == pytest.approx(runs[1].compute_s)
    assert p.band == pytest.approx((0.85, 1.18))
    assert median_of([_profile()]).band == (1.0, 1.0)  # one repeat: no band
    assert Profile.from_dict(p.as_dict()).band == pytest.approx(p.band)  # kept in the plan's JSON


def test_the_band_brackets_the_prediction_from_the_median() -> None:
    pl = _planner(_profile(band=(0.85, 1.18)), _profile(band=(0.9, 1.1)))
    opts = Options(bucket_cap_mb=25.0)
    curve = pl.curve([1, 2], opts)
    for q, w in zip(curve, pl.band([1, 2], opts), strict=True):
        lo, hi = w["step_s"]
        assert lo < q.step_s < hi
        assert w["efficiency"][0] <= q.efficiency <= w["efficiency"][1]
    assert pl.band([2], opts)[0]["efficiency"][1] > 1.0  # a slow one-device run can read super-linear


def test_without_repeats_the_band_is_a_point() -> None:
    pl = _planner(_profile(), _profile())
    w = pl.band([2], Options())[0]
    assert w["step_s"][0] == pytest.approx(w["step_s"][1])


def test_efficiency_above_one_is_always_called_noise() -> None:
    assert "within noise" in efficiency_cell(1.18, (0.95, 1.25))
    assert "noise" in efficiency_cell(1.18)  # no band known: still not shown bare
    assert "noise" in efficiency_cell(1.05, (1.02, 1.08))
    assert efficiency_cell(0.93, (0.85, 1.02)) == "0.930 [0.85, 1.02]"
    assert efficiency_cell(1.0) == "1.000"


def test_the_curve_table_shows_the_bands() -> None:
    pl = _planner(_profile(band=(0.85, 1.18)), replace(_profile(0.8), band=(0.9, 1.1)))
    opts = Options()
    rows = [
        {**q.as_dict(), "nodes": 1, "step_band_s": w["step_s"], "efficiency_band": w["efficiency"]}
        for q, w in zip(pl.curve([1, 2], opts), pl.band([1, 2], opts), strict=True)
    ]
    assert rows[1]["efficiency"] > 1.0  # the n-rank profile ran faster than the one-device one
    text = curve_table(rows)
    assert "within noise" in text and "[" in text
