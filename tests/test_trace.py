"""`ddpkit trace`: a Chrome trace with every phase and bucket on every rank, a PNG, the overlap arithmetic."""

from __future__ import annotations

import json

from ddpkit.tools import trace


def test_trace_writes_chrome_trace_png_and_explains_buckets(tmp_path, capsys) -> None:
    code = trace.main(
        [
            "--workload",
            "cnn",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--bucket-cap-mb",
            "0.1",
            "--explain",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    done = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        names = {e["name"] for e in done if e["pid"] == rank}
        assert {"forward", "backward", "optimizer step"} <= names
        assert any(n.startswith("all-reduce bucket") for n in names)
    assert all(e["dur"] >= 0 for e in done)
    assert (tmp_path / "trace.png").stat().st_size > 1000
    text = capsys.readouterr().out
    assert "hidden behind backward" in text
    assert "bucket(s); firing order in a step" in text and "fc3.weight" in text


def _ev(name: str, track: str, start: float, end: float, step: int = 0) -> dict:
    return {"name": name, "track": track, "start": start, "end": end, "step": step}


def test_overlap_counts_comm_before_the_last_launch_as_hidden() -> None:
    events = [
        _ev("backward", "compute", 0.0, 10.0),
        _ev(
            "all-reduce bucket 0", "bucket 0", 2.0, 6.0
        ),  # fully before the last launch at 5: hidden 3, exposed 1
        _ev("all-reduce bucket 1", "bucket 1", 5.0, 9.0),  # after the last launch: exposed 4
    ]
    ov = trace.overlap(events)
    assert ov["hidden_s"] == 3.0 and ov["exposed_s"] == 4.0
    assert abs(ov["hidden_share"] - 3 / 7) < 1e-12


def test_chrome_trace_is_microseconds_from_the_first_event() -> None:
    ranks = [
        {"rank": 0, "events": [_ev("forward", "compute", 1.0, 1.5)]},
        {"rank": 1, "events": [_ev("forward", "compute", 1.25, 2.0)]},
    ]
    xs = [e for e in trace.chrome_trace(ranks)["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["ts"], e["dur"]) for e in xs] == [(0, 0.0, 5e5), (1, 2.5e5, 7.5e5)]


def test_trace_under_fsdp_shows_each_blocks_all_gather_and_reduce_scatter(tmp_path) -> None:
    code = trace.main(
        ["--workload", "cnn", "--strategy", "fsdp", "--warmup", "1", "--steps", "1", "--out", str(tmp_path)]
    )
    assert code == 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == 1}
    assert any(n.startswith("all-gather") for n in names)
    assert any(n.startswith("reduce-scatter") for n in names)
