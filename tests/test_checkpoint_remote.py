"""Checkpoints in an fsspec store: an S3-compatible server (moto's, started here on a free port, offline)
and a file:// URL. What a user checks: a save to s3://... resumes on another machine (an empty local
folder) bitwise; retention keeps the newest K in the store; a save killed in the middle of its upload
leaves the store's checkpoint whole or absent, and the relaunch resumes from the one before it."""

from __future__ import annotations

import os
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import python
from torch import nn

import ddpkit

pytest.importorskip("s3fs", reason='pip install "ddpkit[remote-test]"')
pytest.importorskip("moto.server", reason='pip install "ddpkit[remote-test]"')

HW = ddpkit.Hardware(gpus=0, cpu_cores=2)


class Gate:
    """In front of the S3 server: from `hold(prefix)` on, the first object PUT under that prefix after one
    is stored there is held (its client waits on the upload, as on a stalled link) until `let_go()`, then
    refused. The test's hand on the network, so that a kill lands in the middle of an upload whatever the
    machine's speed (a PUT the server failed, and its client's retry, do not count as stored)."""

    def __init__(self, app: Callable) -> None:
        self.app, self.prefix, self.stored = app, "", 0
        self.holding, self.released = threading.Event(), threading.Event()

    def hold(self, prefix: str) -> None:
        self.prefix, self.stored = prefix, 0
        self.holding.clear()
        self.released.clear()

    def let_go(self) -> None:
        self.prefix = ""
        self.released.set()

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        put = environ["REQUEST_METHOD"] == "PUT"
        if not (put and self.prefix and environ["PATH_INFO"].startswith(self.prefix)):
            return self.app(environ, start_response)
        if self.stored:  # s3fs uploads one file after another: the one before is in, this one stalls
            self.holding.set()
            self.released.wait(120)  # the test kills the client meanwhile; bounded all the same
            start_response("503 Service Unavailable", [("Content-Length", "0")])
            return [b""]
        status: list[str] = []

        def record(code: str, headers: list, *exc: object) -> Callable:
            status.append(code)
            return start_response(code, headers, *exc)

        body = list(self.app(environ, record))  # moto answers whole, not streamed
        if status and status[0].startswith("200"):
            self.stored += 1
        return body


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Gate]]:
    """moto's S3 server (as moto's ThreadedMotoServer runs it) behind a Gate, on a port the OS picks."""
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import make_server

    gate = Gate(DomainDispatcherApplication(create_backend_app))
    srv = make_server("127.0.0.1", 0, gate, threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}", gate
    gate.let_go()
    srv.shutdown()
    thread.join(10)


@pytest.fixture
def store(server: tuple[str, Gate], tmp_path: Path, request: pytest.FixtureRequest):
    """A fresh bucket, credentials for the local server, this machine's cache folder; the fs."""
    import fsspec

    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=server[0],
        DDPKIT_CHECKPOINT_CACHE=str(tmp_path / "cache"),
    )
    bucket = f"b{abs(hash(request.node.name)) % 10**8}-{time.time_ns() % 10**6}"
    fs, _ = fsspec.core.url_to_fs(f"s3://{bucket}")
    fs.mkdir(bucket)
    return fs, bucket


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def _names(fs, prefix: str) -> list[str]:
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix, detail=False))


def test_a_save_to_s3_resumes_on_another_machine_and_keeps_the_newest(store, tmp_path: Path) -> None:
    fs, bucket = store
    url = f"s3://{bucket}/run"
    model, opt = _model()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        for step in (1, 2):
            s.save(url, model=model, optimizer=opt, step=step, keep=2, keep_best="loss", loss=1.0 / step)
        s.save(
            url, model=model, optimizer=opt, step=3, keep=1, keep_best="loss", loss=0.9, background="process"
        )  # (uploaded behind training)
        s.checkpoints.wait()
    assert _names(fs, f"{bucket}/run") == ["ckpt-000002", "ckpt-000003"]  # the newest, and the best (0.5)
    assert "manifest.json" in _names(fs, f"{bucket}/run/ckpt-000003")
    os.environ["DDPKIT_CHECKPOINT_CACHE"] = str(tmp_path / "other-machine")  # nothing local
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        assert s.load(url, model=fresh, optimizer=fresh_opt, step=0)["step"] == 3
    for key, value in model.state_dict().items():
        assert fresh.state_dict()[key].equal(value), key
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert fresh_opt.state_dict()["state"][0]["exp_avg"].equal(saved)


def test_an_empty_store_is_a_fresh_start_and_a_file_url_is_a_local_folder(store, tmp_path: Path) -> None:
    _, bucket = store
    model, _ = _model()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        assert s.load(f"s3://{bucket}/nothing", model=model, step=7)["step"] == 7
        s.save(f"file://{tmp_path}/local", model=model, step=1)
        assert (tmp_path / "local" / "ckpt-000001" / "manifest.json").is_file()
        assert s.load(f"file://{tmp_path}/local", model=model, step=0)["step"] == 1


def test_an_export_to_s3_is_the_models_weights(store, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    fs, bucket = store
    model, _ = _model()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.export(f"s3://{bucket}/out/model.safetensors", model)
    fs.get_file(f"{bucket}/out/model.safetensors", str(tmp_path / "m.safetensors"))
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back.keys() == model.state_dict().keys()
    assert all(back[k].equal(v) for k, v in model.state_dict().items())


def test_a_store_without_its_driver_is_refused_with_the_package_to_install() -> None:
    from ddpkit.checkpoint.remote import Remote

    with pytest.raises(ddpkit.DdpkitError, match=r"no fsspec file system for nope://b/run.*driver"):
        Remote.parse("nope://b/run")


JOB = """
import sys, torch, ddpkit
from torch import nn
url = sys.argv[1]
with ddpkit.session(seed=0, verbose=True) as s:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))  # the architecture of _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    values = s.load(url, model=model, optimizer=opt, step=0)
    print(f"RESUMED {values['step']}", flush=True)
    s.backward(model(torch.randn(2, 64)).sum()); s.step(opt)
    s.save(url, model=model, optimizer=opt, step=values["step"] + 1)
    print(f"SAVED {values['step'] + 1}", flush=True)
"""


def test_a_kill_during_the_upload_leaves_the_stores_checkpoint_whole_or_absent(
    server, store, tmp_path: Path
) -> None:
    """A job resumes from ckpt-000001 and saves ckpt-000002; the store stalls its upload after the first
    object (the Gate), and the job is killed there (SIGKILL: no handler runs). The store must hold no
    manifest for ckpt-000002, and a relaunch on another machine (an empty local folder; here, in this
    process) resumes from ckpt-000001, saves ckpt-000003 and removes the unfinished upload."""
    _, gate = server
    fs, bucket = store
    url = f"s3://{bucket}/run"
    model, opt = _model()
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:  # the first run's checkpoint
        s.save(url, model=model, optimizer=opt, step=1)
    assert _names(fs, f"{bucket}/run") == ["ckpt-000001"]
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    env = {**os.environ, "DDPKIT_CHECKPOINT_CACHE": str(tmp_path / "a"), "OMP_NUM_THREADS": "1"}
    gate.hold(f"/{bucket}/run/ckpt-000002/")
    # The job is the suite's warm client (tests/conftest.py, `python()`): killing it kills the job it runs,
    # forked from the warm server (SIGKILL too), before its stdout and stderr close
    job = subprocess.Popen(
        [python(), str(script), url], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        if not gate.holding.wait(90):  # an event, not a poll: the upload's second object is on the wire
            job.kill()
            out, err = job.communicate(timeout=30)
            pytest.fail(f"the job's upload never reached its second object:\n{out[-2000:]}\n{err[-2000:]}")
        there = {p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/run/ckpt-000002")}
        job.kill()  # SIGKILL in the middle of its upload
        out, err = job.communicate(timeout=30)
    finally:
        gate.let_go()
        if job.poll() is None:
            job.kill()
            job.wait()
    assert "RESUMED 1" in out and "SAVED" not in out, f"{out[-2000:]}\n{err[-2000:]}"
    assert there and "manifest.json" not in there, f"committed before its parts were in: {sorted(there)}"
    os.environ["DDPKIT_CHECKPOINT_CACHE"] = str(tmp_path / "b")  # another machine: nothing local
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        assert s.load(url, model=fresh, optimizer=fresh_opt, step=0)["step"] == 1
        s.backward(fresh(torch.randn(2, 64)).sum())
        s.step(fresh_opt)
        s.save(url, model=fresh, optimizer=fresh_opt, step=2)
    assert _names(fs, f"{bucket}/run") == ["ckpt-000001", "ckpt-000003"]  # the unfinished upload removed


def test_a_preempted_run_saves_to_the_store_and_a_relaunch_on_another_machine_resumes(
    store, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """`ddpkit run --nproc 2 preempt_train.py s3://...`: SIGTERM at step 3 (no periodic save in the
    run); the preemption save reaches the store before exit 75, and a relaunch with an empty local
    folder resumes from it and ends bitwise like an uninterrupted run (tests/test_preemption.py's job,
    whose uninterrupted run, with a local root, is launched once for the session)."""
    from test_preemption import NO_PAUSE, SLOW, STEPS, launch, uninterrupted_weights

    fs, bucket = store
    url = f"s3://{bucket}/run"
    want = uninterrupted_weights(tmp_path_factory)
    idiom = ("--idiom", "if", "--save-every", "100")
    first = launch(
        url,
        tmp_path / "out",
        "--signal-at",
        "forward:3:0",
        *idiom,
        *SLOW,  # type: ignore[arg-type]
        env={"DDPKIT_CHECKPOINT_CACHE": str(tmp_path / "machine-a")},
    )
    assert first.returncode == 75, f"{first.stdout[-2000:]}\n{first.stderr[-3000:]}"
    assert f"uploaded ckpt-000001 to {url}/ckpt-000001" in first.stdout, first.stdout[-2000:]
    assert "manifest.json" in _names(fs, f"{bucket}/run/ckpt-000001")
    second = launch(
        url,
        tmp_path / "out",
        *idiom,
        *NO_PAUSE,  # type: ignore[arg-type]
        env={"DDPKIT_CHECKPOINT_CACHE": str(tmp_path / "machine-b")},
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "downloaded" in second.stdout and "resumed from" in second.stdout, second.stdout[-2000:]
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "final.safetensors"))
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert (tmp_path / "out" / "log.txt").read_text().split()[-1] == str(STEPS)


def test_a_hugging_face_export_to_s3_is_a_folder_from_pretrained_loads(store, tmp_path: Path) -> None:
    """`s.export("s3://.../hf", model)` of a transformers model: the store holds the directory
    `from_pretrained` reads (weights and config), the same forward; a second export replaces it."""
    tf = pytest.importorskip("transformers")
    fs, bucket = store
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=32))
    with ddpkit.session(env={}, hardware=HW, verbose=False) as s:
        s.export(f"s3://{bucket}/out/hf/", model)
        fs.pipe(f"{bucket}/out/hf/stale.bin", b"an earlier export's file")
        s.export(f"s3://{bucket}/out/hf", model)  # again: what is there is replaced
    assert _names(fs, f"{bucket}/out/hf") == ["config.json", "generation_config.json", "model.safetensors"]
    (tmp_path / "hf").mkdir()
    for name in _names(fs, f"{bucket}/out/hf"):
        fs.get_file(f"{bucket}/out/hf/{name}", str(tmp_path / "hf" / name))
    back = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")  # in eval mode, as from_pretrained leaves it
    ids = torch.arange(8)[None]
    assert torch.equal(back(ids).logits, model.eval()(ids).logits)  # dropout off on both sides


def test_a_folder_is_uploaded_with_its_json_files_last(tmp_path: Path) -> None:
    """An upload cut off part-way leaves no config.json: no `from_pretrained` takes the folder for whole."""
    from ddpkit.checkpoint.remote import put_folder

    for name in ("config.json", "model-00001.safetensors", "sub/adapter_config.json", "tokenizer.model"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)

    class Store:  # records the order; the upload's other calls on an empty store
        def __init__(self) -> None:
            self.put: list[str] = []

        def put_file(self, local: str, remote: str) -> None:
            self.put.append(remote)

        def invalidate_cache(self) -> None: ...

        def find(self, path: str) -> list[str]:
            raise FileNotFoundError(path)

    store = Store()
    put_folder(store, tmp_path, "b/hf")
    assert store.put == [
        "b/hf/model-00001.safetensors",
        "b/hf/tokenizer.model",
        "b/hf/config.json",
        "b/hf/sub/adapter_config.json",
    ]
