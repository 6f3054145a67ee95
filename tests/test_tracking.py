"""`s.log` and `session(log_to=...)` against the real trackers, offline: TensorBoard's event files read
back with its own EventAccumulator, MLflow's file store with MlflowClient, W&B's offline run files
(WANDB_MODE=offline; nothing leaves the machine). A resumed run continues the same tracker run and
step axis, also after a 2-rank job's writer was SIGKILLed and torchrun restarted it.
"""

from __future__ import annotations

import glob
import json
import struct
import subprocess
from pathlib import Path

import pytest
from conftest import REPO, python, run_cli

import ddpkit

pytest.importorskip("tensorboard")
OFFLINE = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "MLFLOW_TRACKING_URI": "",
    "MLFLOW_ALLOW_FILE_STORE": "true",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def _log(log_dir: Path, log_to, steps, scale: float = 1.0) -> list[str]:
    with ddpkit.session(log_to=log_to, log_dir=str(log_dir), verbose=False) as s:
        for step in steps:
            s.log({"loss": scale / step, "lr": 0.1}, step=step)
        return s.tracking.trackers


def tensorboard_scalars(log_dir: Path, tag: str = "loss") -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def mlflow_history(log_dir: Path, key: str = "loss") -> tuple[list[str], list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="file:" + str(log_dir / "mlruns"))
    experiment = client.get_experiment_by_name("ddpkit")
    runs = client.search_runs([experiment.experiment_id])
    points = client.get_metric_history(runs[0].info.run_id, key)
    return [r.info.run_id for r in runs], sorted((m.step, m.value) for m in points)


def wandb_records(path: str) -> list:
    """The records of an offline W&B run file: a LevelDB-style log of 32 KiB blocks, 7-byte headers."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert struct.unpack("<4sHB", data[:7])[0] == b":W&B"
    pos, chunks, records, block = 7, b"", [], 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def wandb_history(
    log_dir: Path, key: str = "loss", segment: str = "offline-run-*"
) -> tuple[set[str], list[tuple[int, float]]]:
    """Run ids and (step, value) points over the offline segments of the run, in file order."""
    ids, points = set(), []
    for path in sorted(glob.glob(str(log_dir / "wandb" / segment / "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                if key in items:
                    points.append((record.history.step.num, float(json.loads(items[key]))))
    return ids, points


def test_tensorboard_events_read_back_and_a_resumed_session_replaces_the_points_after_its_start(
    tmp_path: Path,
) -> None:
    assert _log(tmp_path, "tensorboard", range(1, 11)) == ["tensorboard"]
    assert tensorboard_scalars(tmp_path) == [(s, pytest.approx(1 / s)) for s in range(1, 11)]
    _log(tmp_path, "tensorboard", range(6, 13), scale=2.0)  # resumed from a checkpoint at step 5
    points = tensorboard_scalars(tmp_path)
    assert [step for step, _ in points] == list(range(1, 13)), "no repeated or missing step"
    assert [v for _, v in points] == [pytest.approx(1 / s) for s in range(1, 6)] + [
        pytest.approx(2 / s) for s in range(6, 13)
    ], "steps 6..10 are the resumed session's"


def test_by_default_a_session_logs_to_tensorboard_when_it_is_installed(tmp_path: Path) -> None:
    with ddpkit.session(log_dir=str(tmp_path), verbose=False) as s:  # log_to left at its default, "auto"
        for step in range(1, 4):
            s.log({"loss": 1 / step}, step=step)
    assert tensorboard_scalars(tmp_path) == [(s, pytest.approx(1 / s)) for s in range(1, 4)]


def test_mlflow_file_store_keeps_one_run_and_one_point_per_step_across_a_resume(tmp_path: Path) -> None:
    _log(tmp_path, "mlflow", range(1, 11))
    ids, points = mlflow_history(tmp_path)
    assert points == [(s, pytest.approx(1 / s)) for s in range(1, 11)]
    state = json.loads((tmp_path / "ddpkit-tracking.json").read_text())
    assert ids == [state["mlflow"]["run_id"]]
    _log(tmp_path, "mlflow", range(6, 13))
    ids_after, points = mlflow_history(tmp_path)
    assert ids_after == ids, "the resumed session continues the same MLflow run"
    assert [step for step, _ in points] == list(range(1, 13)), "no repeated or missing step"


def test_wandb_offline_run_files_hold_one_run_id_and_one_point_per_step_across_a_resume(
    tmp_path: Path,
) -> None:
    pytest.importorskip("wandb")
    _log(tmp_path, "wandb", range(1, 11))
    _log(tmp_path, "wandb", range(6, 13))
    ids, points = wandb_history(tmp_path)
    state = json.loads((tmp_path / "ddpkit-tracking.json").read_text())
    assert ids == {state["wandb"]["run_id"]}, "both segments are the same W&B run (id + resume='allow')"
    assert sorted(step for step, _ in points) == list(range(1, 13)), "no repeated or missing step"


def test_a_2_rank_run_whose_writer_is_killed_and_restarted_logs_every_step_once(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    out = tmp_path / "out"
    done = run_cli(
        "run",
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        str(REPO / "tests" / "tracking_train.py"),
        str(out),
        "--kill-at",
        "8",
        "--steps",
        "12",
        timeout=110,
        env=OFFLINE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "killed.txt").read_text() == "8", "global rank 0, the writer, was killed at step 8"
    assert (out / "rank0-trackers.txt").read_text() == "tensorboard,mlflow,wandb"
    assert (out / "rank1-trackers.txt").read_text() == "", "rank 1 wrote to no tracker"
    run = out / "run"
    tb = tensorboard_scalars(run)
    assert [s for s, _ in tb] == list(range(1, 13)), f"TensorBoard steps {[s for s, _ in tb]}"
    ml_ids, ml = mlflow_history(run)
    assert len(ml_ids) == 1 and [s for s, _ in ml] == list(range(1, 13)), f"MLflow steps {ml}"
    # W&B's service buffers its writes until finish (offline: its .wandb file every 15 s), so the killed
    # segment may hold nothing; the resumed segment logs every step from the checkpoint on, once.
    wb_ids, wb = wandb_history(run)
    segments = sorted(glob.glob(str(run / "wandb" / "offline-run-*")))
    assert len(wb_ids) == 1 and len(segments) == 2, "the restart resumed the W&B run by id"
    resumed = [step for step, _ in wandb_history(run, segment=segments[-1])[1]]
    assert resumed == list(range(7, 13)), f"W&B steps {wb}"
    replaced = {7, 8}  # logged by the killed segment; TensorBoard keeps the resumed values, MLflow the first
    assert [v for s, v in tb if s not in replaced] == pytest.approx([v for s, v in ml if s not in replaced])


def test_fit_logs_loss_lr_throughput_step_time_and_the_clipped_norm_by_itself(tmp_path: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    with ddpkit.session(seed=0, log_to="tensorboard", log_dir=str(tmp_path), verbose=False) as s:
        model = s.model(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ddpkit.fit(
            s,
            model,
            opt,
            s.loader(data, batch_size=16, shuffle=True),
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
            epochs=2,
            max_norm=1.0,
            track_every=1,
            progress=False,
        )
    for tag in ("loss", "lr", "throughput", "step_time", "grad_norm"):
        assert [step for step, _ in tensorboard_scalars(tmp_path, tag)] == list(range(1, 9)), tag
    assert all(v > 0 for _, v in tensorboard_scalars(tmp_path, "throughput"))
    with ddpkit.session(seed=0, log_to="tensorboard", log_dir=str(tmp_path / "every4"), verbose=False) as s:
        model = s.model(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ddpkit.fit(
            s,
            model,
            opt,
            s.loader(data, batch_size=16, shuffle=True),
            lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]),
            epochs=2,
            track_every=4,
            progress=False,
        )
    assert [step for step, _ in tensorboard_scalars(tmp_path / "every4", "step_time")] == [4, 8]


def test_the_trackers_are_not_imported_unless_something_is_logged(tmp_path: Path) -> None:
    # A process of its own, forked by the suite's warm start (tests/conftest.py; torch and ddpkit imported
    # there, never a tracker), else a new interpreter: no earlier test's imports.
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, ddpkit\n"
        "with ddpkit.session(verbose=False) as s: pass\n"
        "print(sorted(m for m in ('tensorboard', 'mlflow', 'wandb', 'torch.utils.tensorboard') if m in sys.modules))"
    )
    done = subprocess.run([python(), str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_an_unknown_tracker_is_an_error_naming_the_choices() -> None:
    with (
        pytest.raises(
            ddpkit.DdpkitError, match=r"log_to='tensorbord' names unknown tracker\(s\) \['tensorbord'\]"
        ),
        ddpkit.session(log_to="tensorbord", verbose=False),
    ):
        pass
