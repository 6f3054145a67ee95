"""What `ddpkit run` tells a user when a job ends badly: one paragraph for a mistake the user can fix,
and the rank that died first named at every restart. Real torchrun agents, real gloo ranks, real files.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
from conftest import run_cli

from ddpkit import checkpoint_files as files

HERE = Path(__file__).parent
SCRIPT = str(HERE / "refusal_train.py")


class _Planted:
    """A pickle that would create a file if anything unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(checkpoint: Path, marker: Path) -> None:
    """Replace the DCP metadata by a pickle, and forge the manifest's checksums to match it."""
    (checkpoint / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        p = checkpoint / name
        manifest["files"][name] = {"bytes": p.stat().st_size, "sha256": files.sha256_of(p)}
    files.write_manifest(
        checkpoint, {k: v for k, v in manifest.items() if k not in ("format", "self_sha256")}
    )
    files.verify(checkpoint)  # forged well: the manifest alone cannot tell


@pytest.mark.timeout(150)
def test_a_planted_sharded_checkpoint_ends_the_job_with_one_paragraph(tmp_path: Path) -> None:
    ckpt, marker = tmp_path / "ck", tmp_path / "pwned"
    saved = run_cli("run", "--nproc", "2", SCRIPT, str(ckpt), timeout=60)
    assert saved.returncode == 0, saved.stderr
    _plant(ckpt / "ckpt-000002", marker)
    done = run_cli("run", "--nproc", "2", SCRIPT, str(ckpt), timeout=60)
    assert done.returncode == 1, done.stderr
    assert not marker.exists(), "the planted pickle ran"
    out = done.stdout + done.stderr
    assert out.count("refused to load") == 1, out  # once for the job, not once per rank
    assert f"refused to load {ckpt}/ckpt-000002" in done.stderr and "names posix.system" in done.stderr
    assert "Move ckpt-000002 out of" in done.stderr and "raised by 2 ranks alike" in done.stderr
    assert "Traceback" not in out, out
