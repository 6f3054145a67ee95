"""The checkpoint writer process's own code: standard library only, run by path (not imported).

    python ddpkit/checkpoint/writer_child.py FD NICE     # started by `ddpkit.checkpoint.writer_process`

Why a separate, torch-free program: it starts in tens of milliseconds, imports nothing of the user's
(multiprocessing's spawn would re-import the training script), and its CPU time (writing and hashing
hundreds of MiB) runs in its own interpreter at the lowest priority, never holding training's GIL.

It serves requests on the Unix socket FD, one at a time, each a 4-byte length and a JSON body (file
descriptors of new shared-memory segments ride on the length bytes, SCM_RIGHTS):

    {"segments": [id, ...], "path": ".../model.safetensors", "head": "<base64>",
     "pieces": [[id, offset, n], ...]}

and writes the file: the safetensors header, then each piece's bytes straight from the mapped memory,
hashing them on the way; fsync; then, and only then, it answers {"bytes": N, "sha256": "..."} (or
{"error": "..."}). The parent's manifest and atomic rename come after that answer. End of input (the
training process ended or died) ends it.

Under FSDP and HSDP the request is one rank's file of DCP's shards (`dcp/__R_0.distcp`):

    {"segments": [...], "path": ".../dcp/__0_0.distcp",
     "items": [{"data": "<base64>"}, {"at": [id, offset, n], "dtype": "float32", "shape": [4, 8]}, ...]}

and each item is written in DCP's own format: small objects as the bytes the parent's DCP planner
serialised, each tensor as `torch.save` of it (what DCP's `FileSystemWriter` writes, so DCP's reader,
resharding and `ddpkit checkpoint inspect/convert` read it unchanged); the answer adds each item's
[offset, length] in the file, which the parent hands back to DCP for its metadata. Only this request
imports torch (once, on the first; a few seconds at idle priority): a DDP job's writer stays
torch-free.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import mmap
import os
import socket
import struct
import sys
from collections.abc import Iterable, Iterator
from typing import Any

# Each piece is hashed, then written while it is still in the core's cache: measured on 448 MiB from a
# memfd (hash + write + fsync), 0.71 s of CPU with 1 MiB pieces against 1.59 s with 8 MiB ones (which
# the write read again from memory), 0.75 s with 256 KiB (more calls).
CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise EOFError
        data += part
    return data


def receive(sock: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, 4, 64)
    if not head:
        raise EOFError
    head += _recv_exact(sock, 4 - len(head))
    (length,) = struct.unpack("<I", head)
    return json.loads(_recv_exact(sock, length)), fds


def send(sock: socket.socket, body: dict) -> None:
    data = json.dumps(body).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


class _Hashed:
    """A write-only file that hashes and counts what goes through it, in CHUNK pieces (each hashed, then
    written while still in the core's cache); both kinds of request write through it, torch.save too."""

    def __init__(self, f: object, digest: object) -> None:
        self.f, self.digest, self.n = f, digest, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = view[start : start + CHUNK]
            self.digest.update(piece)  # type: ignore[attr-defined]
            while piece:
                piece = piece[self.f.write(piece) :]  # type: ignore[attr-defined]
        self.n += len(view)
        return len(view)

    def flush(self) -> None:
        pass


def write_file(request: dict, maps: dict[int, mmap.mmap]) -> dict:
    digest = hashlib.sha256()
    with open(request["path"], "wb", buffering=0) as f:
        out = _Hashed(f, digest)
        out.write(base64.b64decode(request["head"]))
        for segment, offset, n in request["pieces"]:
            view = memoryview(maps[segment])[offset : offset + n]
            out.write(view)
            view.release()
        os.fsync(f.fileno())  # durable before the answer: the parent commits on it
    return {"bytes": os.stat(request["path"]).st_size, "sha256": digest.hexdigest()}


def write_shards(request: dict, maps: dict[int, mmap.mmap]) -> dict:
    """One rank's DCP file: each item as DCP's `FileSystemWriter` writes it (module docstring)."""
    import warnings

    import torch  # here only: a DDP job's writer never imports it

    torch.set_num_threads(1)

    def items() -> Iterator[Any]:
        for item in request["items"]:
            if "data" in item:
                yield base64.b64decode(item["data"])
                continue
            dtype, shape = getattr(torch, item["dtype"]), item["shape"]
            if item["at"] is None:  # no elements: nothing in shared memory
                yield torch.empty(shape, dtype=dtype)
                continue
            segment, offset, n = item["at"]
            with warnings.catch_warnings():  # a read-only mapping: torch only reads it
                warnings.simplefilter("ignore")
                count = n // torch.empty((), dtype=dtype).element_size()
                tensor = torch.frombuffer(maps[segment], dtype=dtype, count=count, offset=offset)
            yield tensor.view(shape)  # no view is kept after the write: the mapping can be closed later

    return write_items(request["path"], items())


def write_items(path: str, items: Iterable[Any]) -> dict:
    """A DCP file (`__R_0.distcp`) of `items`: bytes as they are (DCP's serialised small objects), each
    tensor as `torch.save` of it (what DCP's `FileSystemWriter` writes), hashed on the way (nothing is
    read back) and fsynced. Its size, SHA-256, and each item's [offset, length] (for DCP's metadata).
    The writer process runs it on the tensors it maps; a thread writer (`ddpkit.checkpoint.dcp`) on the
    tensors of its copy, which must own exactly their bytes (`torch.save` writes a tensor's storage)."""
    import torch

    digest = hashlib.sha256()
    spans = []
    with open(path, "wb", buffering=0) as f:
        out = _Hashed(f, digest)
        for item in items:
            start = out.n
            if isinstance(item, (bytes, bytearray, memoryview)):
                out.write(item)
            else:
                torch.save(item, out)  # type: ignore[arg-type]
            spans.append([start, out.n - start])
        os.fsync(f.fileno())  # durable before the answer: the parent commits on it
    return {"bytes": os.stat(path).st_size, "sha256": digest.hexdigest(), "spans": spans}


def lowest_priority(nice: int) -> None:
    """SCHED_IDLE and `nice` for this whole process: it runs on CPU time training leaves idle."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def main(fd: int, nice: int | None) -> None:
    if nice is not None:
        lowest_priority(nice)
    sock = socket.socket(fileno=fd)
    maps: dict[int, mmap.mmap] = {}
    while True:
        try:
            request, fds = receive(sock)
        except (EOFError, ConnectionError):
            return
        for segment, new_fd in zip(request.get("segments", []), fds, strict=True):
            maps[segment] = mmap.mmap(new_fd, 0, prot=mmap.PROT_READ)
            os.close(new_fd)
        for segment in request.get("drop", []):
            if segment in maps:
                maps.pop(segment).close()
        if "path" not in request:
            send(sock, {"ok": True})
            continue
        try:
            answer = write_shards(request, maps) if "items" in request else write_file(request, maps)
        except Exception as err:  # reported to the parent, which fails the save with it
            answer = {"error": f"{type(err).__name__}: {err}"}
        try:
            send(sock, answer)
        except (BrokenPipeError, ConnectionError):
            return


if __name__ == "__main__":
    # Run by path, Python puts this file's folder first on sys.path, where ddpkit's own `inspect.py` would
    # shadow the standard library's (which torch imports): the folder goes.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    main(int(sys.argv[1]), None if sys.argv[2] == "none" else int(sys.argv[2]))
