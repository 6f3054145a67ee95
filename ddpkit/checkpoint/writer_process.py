"""`background="process"`: the files of a background save written and hashed by a separate process.

    writer = WriterProcess(nice=19)          # started at the first such save, kept for the session
    staged = writer.arena.stage(tensor)      # `capture` copies into shared memory (ddpkit.checkpoint.staging)
    entry = writer.write_file(path, tensors) # the writer thread asks; the process writes, hashes, fsyncs

Why a process: the writer thread shares training's interpreter, and its Python work (and any C code
that keeps the GIL) stalls training's thread; the bytes of the big files (the model's weights, the
optimizer state; under FSDP and HSDP each rank's file of DCP's shards) are written and hashed by
`ddpkit/checkpoint/writer_child.py`, a program in its own interpreter at the lowest CPU priority (torch-free
unless it writes DCP's shards), which reads them from the shared memory the save's copy went to (no second
copy, no pickling). The writer thread still coordinates (the optimizer shares gathered over the writer's
gloo group, DCP's planning and metadata, the per-rank files, the manifest and the rename), mostly
waiting. The rename happens only after the process has answered for every file, and it answers after
fsync: a killed writer process fails that save with a clear error and leaves the previous checkpoint
the newest valid one; the next save starts a new process.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint import files
from ddpkit.checkpoint.files import CheckpointError
from ddpkit.checkpoint.staging import Arena
from ddpkit.errors import problem

CHILD = Path(__file__).with_name("writer_child.py")


class WriterProcess:
    """The writer process and the arena it reads from; one request at a time."""

    def __init__(self, *, nice: int | None) -> None:
        self.arena = Arena()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = parent
        self.process = subprocess.Popen(
            [sys.executable, str(CHILD), str(child.fileno()), "none" if nice is None else str(nice)],
            pass_fds=[child.fileno()],
            stdin=subprocess.DEVNULL,
        )
        child.close()

    @staticmethod
    def available() -> bool:
        return Arena.available() and hasattr(socket, "send_fds")

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def write_file(self, path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Write `tensors` as one safetensors file through the process; its manifest entry (size, SHA-256),
        returned only once the file is written and fsynced. Tensors outside the arena are staged first."""
        if any(t.dtype not in files.SAFETENSORS_DTYPES for t in tensors.values()):
            return files.write_tensors(path, tensors)  # a dtype the streamed header does not know
        pieces, laid_out = [], {}
        for key, t in tensors.items():
            t, where = self._in_arena(t)  # e.g. the optimizer state gathered on the writer thread: staged
            laid_out[key] = t
            if where is not None:
                pieces.append(where)
        head = files.safetensors_header(laid_out.items(), {"format": files.FORMAT})
        return self._write(path, {"head": base64.b64encode(head).decode(), "pieces": pieces})

    def write_shards(self, path: Path, items: list[torch.Tensor | io.BytesIO]) -> dict[str, Any]:
        """One rank's file of DCP's shards, written by the process in DCP's format (`writer_child.py`):
        each tensor read from the arena (staged there first if it is not), each small object as the bytes
        DCP serialised it to. Answers once the file is fsynced: its size, SHA-256, and each item's
        [offset, length] in it (for DCP's metadata)."""
        listed: list[dict[str, Any]] = []
        for item in items:
            if isinstance(item, io.BytesIO):
                listed.append({"data": base64.b64encode(item.getbuffer()).decode()})
                continue
            t, where = self._in_arena(item.detach())  # not staged by `capture` (or not contiguous): now
            listed.append({"at": where, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)})
        return self._write(path, {"items": listed})

    def _in_arena(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """`t` in the arena (staged there if it is not yet) and where it lies; None for an empty tensor."""
        if not t.numel():
            return t, None
        where = self.arena.locate(t)
        if where is None:
            t = self.arena.stage(t)
            where = self.arena.locate(t)
        return t, where

    def _write(self, path: Path, request: dict[str, Any]) -> dict[str, Any]:
        """Send one file's request with the arena segments the process has not seen yet; its answer."""
        new = [s for s in self.arena.segments if not s.sent]
        answer = self._ask(
            {"segments": [s.id for s in new], "path": str(path), **request}, [s.fd for s in new]
        )
        for segment in new:
            segment.sent = True
        if "error" in answer:
            raise CheckpointError(f"the checkpoint writer process could not write {path}: {answer['error']}")
        return answer

    def _ask(self, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        data = json.dumps(request).encode()
        try:
            socket.send_fds(self._sock, [struct.pack("<I", len(data))], fds)
            self._sock.sendall(data)
            head = self._recv(4)
            (length,) = struct.unpack("<I", head)
            return dict(json.loads(self._recv(length)))
        except (EOFError, OSError) as err:
            code = self.process.wait()
            how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
            raise CheckpointError(
                f"the checkpoint writer process (pid {self.process.pid}) ended ({how}) while writing "
                f"{request.get('path')}: this save is not committed, and the previous checkpoint is "
                "untouched and still the newest valid one. The next save starts a new writer; if it keeps "
                'dying, look for an out-of-memory kill (dmesg) or save with background="thread"'
            ) from err

    def _recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self._sock.recv(n - len(data))
            if not part:
                raise EOFError
            data += part
        return data

    def close(self) -> None:
        """End the process (end of input) and release the arena."""
        self._sock.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.arena.close()


def writer_mode(background: bool | str) -> str | None:
    """None (synchronous), "thread" or "process", from `save`'s `background=`."""
    if background is False:
        return None
    if background is True or background == "thread":
        return "thread"
    if background == "process":
        return "process"
    raise problem(
        f"background={background!r} is not a way to save",
        'Pass background=False (wait for the write), True or "thread" (a writer thread), or "process" '
        "(a writer process: out of training's interpreter)",
    )
