"""Checkpoints in any fsspec storage: `s.save("s3://bucket/run", ...)`, `s.load("s3://bucket/run", ...)`.

    remote = Remote.parse("s3://bucket/run")     # None for a local path (file:// is a local path)
    remote.local                                 # the local folder the save is written in first
    remote.upload(final)                         # after the local commit: every file, the manifest last
    remote.pull()                                # before a load: the newest complete one, downloaded

The same directory layout as a local root (`ddpkit.checkpoint.files`), one prefix per checkpoint:
`s3://bucket/run/ckpt-000004/model.safetensors`, ... Object stores have no atomic rename of a folder,
so the commit is the manifest: it is uploaded last, only after every file it lists is in the store, and
a checkpoint without one is not a checkpoint (a save killed mid-upload leaves files that no load
reads, removed by the next save). Every file is checked against the manifest's SHA-256 after download.

A save is written and committed locally first (the usual atomic rename, in a cache folder: fast, and
the writer thread or process does it behind training), then rank 0 uploads it; retention deletes the
remote checkpoints beyond `keep` (never the one just uploaded). Every rank must see the local folder
(one node, or a shared file system), as for a local root. fsspec and the store's driver (s3fs, gcsfs,
adlfs) are optional dependencies (`pip install "ddpkit[remote]"`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit.checkpoint import files
from ddpkit.checkpoint.retention import Retention
from ddpkit.errors import problem
from ddpkit.names import CHECKPOINT_CACHE_ENV

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_NAME = re.compile(r"^ckpt-(\d{6,})$")


def _filesystem(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        raise problem(
            f"{url} is a remote URL, and saving to one needs fsspec (and the store's driver)",
            'pip install "ddpkit[remote]" (fsspec and s3fs), or gcsfs / adlfs for Google or Azure storage',
        ) from None
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        raise problem(
            f"no fsspec file system for {url}: {err}",
            "Install the store's fsspec driver (s3:// needs s3fs, gs:// gcsfs, az:// adlfs)",
        ) from None
    return fs, path.rstrip("/")


@dataclass
class Remote:
    """A checkpoint root in an fsspec store, and the local folder its saves are written in first."""

    url: str
    fs: Any
    path: str  # the root within the store (no protocol)
    local: Path

    @classmethod
    def parse(cls, root: str | Path) -> Remote | None:
        text = str(root)
        if not _URL.match(text) or text.startswith("file://"):
            return None
        fs, path = _filesystem(text)
        digest = hashlib.sha256(text.rstrip("/").encode()).hexdigest()[:16]
        default = Path(tempfile.gettempdir()) / f"ddpkit-checkpoints-{os.getuid()}"
        base = Path(os.environ.get(CHECKPOINT_CACHE_ENV) or default)
        return cls(text.rstrip("/"), fs, path, base / digest)

    def _names(self) -> list[tuple[int, str]]:
        """Checkpoint prefixes in the store, newest first (with or without a manifest)."""
        self.fs.invalidate_cache()  # another job (or this one, a moment ago) changed the store
        try:
            entries = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        found = [(int(m.group(1)), m.group(0)) for n in names if (m := _NAME.match(n))]
        return sorted(found, reverse=True)

    def complete(self) -> list[str]:
        """The names of the checkpoints whose manifest is in the store, newest first."""
        return [n for _, n in self._names() if self.fs.exists(f"{self.path}/{n}/{files.MANIFEST}")]

    def next_seq(self) -> int:
        return max((s for s, _ in self._names()), default=0) + 1

    def upload(self, final: Path) -> str:
        """Upload a committed local checkpoint: every file, then (the commit) its manifest."""
        target = f"{self.path}/{final.name}"
        manifest = json.loads((final / files.MANIFEST).read_text())  # written and committed by this rank
        for name in sorted(manifest["files"], key=lambda n: (final / n).stat().st_size):
            self.fs.put_file(str(final / name), f"{target}/{name}")
        self.fs.put_file(str(final / files.MANIFEST), f"{target}/{files.MANIFEST}")
        return f"{self.url}/{final.name}"

    def prune(self, retention: Retention, current: str) -> list[str]:
        """Delete complete checkpoints `retention` does not keep, and uploads that never got their manifest
        (older than `current`, the one just uploaded, which is never deleted)."""
        complete = self.complete()
        manifests = [(n, json.loads(self.fs.cat_file(f"{self.path}/{n}/{files.MANIFEST}"))) for n in complete]
        kept = retention.kept(manifests)
        doomed = [n for n in complete if n not in kept and n != current]
        seq = int(current.rsplit("-", 1)[-1])
        doomed += [n for s, n in self._names() if n not in complete and s < seq]
        for name in doomed:
            self.fs.rm(f"{self.path}/{name}", recursive=True)
        return doomed

    def pull(self, say: Any) -> None:
        """Download the newest remote checkpoint that verifies into the local folder (if not there yet)."""
        self.local.mkdir(parents=True, exist_ok=True)
        for name in self.complete():
            here = self.local / name
            if files.is_checkpoint(here):
                try:
                    files.verify(here)
                    return
                except files.CheckpointError:
                    pass
            partial = self.local / f".pull-{name}"
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            manifest = json.loads(self.fs.cat_file(f"{self.path}/{name}/{files.MANIFEST}"))
            for entry in [*manifest.get("files", {}), files.MANIFEST]:  # names checked by verify below
                (partial / entry).parent.mkdir(parents=True, exist_ok=True)
                try:
                    self.fs.get_file(f"{self.path}/{name}/{entry}", str(partial / entry))
                except FileNotFoundError:
                    break  # verify names the missing file
            try:
                files.verify(partial)
            except files.CheckpointError as err:
                say(f"ddpkit: skipped a damaged checkpoint in {self.url}: {err}")
                shutil.rmtree(partial, ignore_errors=True)
                continue
            shutil.rmtree(here, ignore_errors=True)
            os.replace(partial, here)
            say(f"ddpkit: downloaded {self.url}/{name} to {here}")
            return


def export_target(path: str | Path) -> tuple[Path, Any]:
    """Where `s.export` writes: the path itself, or for a URL a local file or folder (a Hugging Face or
    adapter directory) and the upload that follows (rank 0, after it is whole; a failed upload is an
    error naming the local copy)."""
    text = str(path).rstrip("/")
    if not _URL.match(text) or text.startswith("file://"):
        return Path(text.removeprefix("file://")), None
    fs, remote_path = _filesystem(text)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    default = Path(tempfile.gettempdir()) / f"ddpkit-checkpoints-{os.getuid()}"
    cache = Path(os.environ.get(CHECKPOINT_CACHE_ENV) or default)
    local = cache / "exports" / digest / text.rsplit("/", 1)[-1]

    def upload(say: Any) -> None:
        try:
            if local.is_dir():
                put_folder(fs, local, remote_path)
            else:
                fs.put_file(str(local), remote_path)
        except Exception as err:
            raise files.CheckpointError(
                f"the export is written to {local}, but its upload to {text} failed ({type(err).__name__}: "
                f"{err}). Check the store's address and credentials, then upload that copy"
            ) from err
        say(f"ddpkit: uploaded the export to {text}")

    return local, upload


def export_via(
    path: str | Path,
    write: Callable[[Path], Any],
    *,
    is_main: bool,
    barrier: Callable[[], None],
    say: Callable[[str], None],
) -> Any:
    """`write(local)` on every rank (an export, a file or a folder such as a Hugging Face or adapter
    directory); for an fsspec URL `local` is in this machine's cache, and rank 0 uploads what was written
    (`put_folder`: a folder's JSON files last). What `write` returns."""
    target, upload = export_target(path)
    if upload is None:
        return write(target)
    if is_main and target.is_dir():  # an earlier export of this URL: not uploaded again
        shutil.rmtree(target)
    elif is_main and target.exists():
        target.unlink()
    barrier()
    written = write(target)
    barrier()
    if is_main:
        upload(say)
    return written


def put_folder(fs: Any, local: Path, remote_path: str) -> None:
    """A folder to the store: the weights first, the JSON files (`config.json`, `adapter_config.json`,
    which `from_pretrained` reads first) last, so a folder cut off mid-upload has no config and no
    loader takes it for whole; then files an earlier export left there and this one lacks are removed."""
    names = sorted(
        (p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()),
        key=lambda n: (n.endswith(".json"), n),
    )
    for name in names:
        fs.put_file(str(local / name), f"{remote_path}/{name}")
    fs.invalidate_cache()
    try:
        there = fs.find(remote_path)
    except FileNotFoundError:
        return
    stale = [p for p in there if p.removeprefix(remote_path).lstrip("/") not in names]
    for old in stale:
        fs.rm(old)
