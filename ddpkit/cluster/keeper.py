"""The per-host snapshot keeper: a process beside the ranks that holds their memory snapshots.

    keeper = Keeper.start()                    # `ddpkit run` on each host, before the ranks start
    keeper.name                                # what every rank is told (`ddpkit.names.KEEPER_ENV`)
    client = KeeperClient.connect(name)        # a rank: hold / get / committed / drop its slots
    keeper.stop()                              # the launch's end (its death ends the keeper too)

    python keeper.py NAME [--tcp HOST:PORT] [--buddy HOST:PORT]    # the keeper itself (run by path)
    DDPKIT_KEEPER_TOKEN=...                                         # its job token (environment, not argv)

Why a process of its own: a rank's snapshot must outlive the rank (a kill -9, the OOM killer, a CUDA
error, the agent stopping the group to restart it), and nothing a rank starts does (torchrun's agent
stops each worker's whole process group). The ranks create memfd segments (two slots each,
`ddpkit.checkpoint.memory`), fill them, and hand their file descriptors here (SCM_RIGHTS); the kernel
keeps a memfd while any descriptor of it is open, so the keeper's keep the bytes through any death of a
rank, and the keeper's own end frees them: it dies with its parent (PR_SET_PDEATHSIG, and a poll of its
parent pid), so no exit path of the launcher leaves memory behind (nothing in /dev/shm, nothing to
sweep). It never maps a slot except to send or receive it, so its own memory stays small.

The lost host: with a buddy (`--buddy`, or the "buddy" request a rank sends once the hosts have met:
`ddpkit run` across hosts wires each host's keeper to the next host's, `ddpkit.checkpoint.memory`), each
slot a rank reports committed is pushed (on a thread of the keeper, never a rank's; superseded commits
dropped) to the buddy host's keeper over TCP, which writes it into slots of its own with the same
step-last protocol and acknowledges the step it now holds; a rank whose keeper lacks its key (a
replacement host) fetches its slots from there. A push whose slot was rewritten while it was sent (its
seq changed) is dropped by the receiver. The "committed" answer carries the newest step the buddy has
acknowledged for that key, so a rank can bound how far the copy falls behind (`memory.BUDDY_LAG`).

The job token: the TCP port is reachable from other hosts, so every connection's first line must carry
this keeper's token (`TOKEN_ENV`: `ddpkit run` makes one per launch, hands it to its keeper and ranks by
environment, and the ranks publish it with the keeper's address in the job's store for the other
hosts). It is compared with `hmac.compare_digest`; a wrong or missing one gets one line,
{"refused": "..."}, and the connection is closed: nothing is stored or served.

Unix socket "\\0NAME" (abstract: one per network namespace, i.e. per host; only this user's processes
are answered, SO_PEERCRED), requests as a 4-byte length + JSON, descriptors on the length bytes:
    {"op": "hold", "key": K} + fds     keep these slots for K (replacing what it held)
    {"op": "get", "key": K}            -> {"n": N} + the descriptors held for K
    {"op": "committed", "key": K, "slot": i}   slot i of K is complete: push it to the buddy
        -> {"ok": true, "buddy": B, "buddy_step": S}   (S: the newest step of K the buddy acknowledged)
    {"op": "acked", "key": K} -> {"buddy_step": S}
    {"op": "buddy", "address": "HOST:PORT", "token": T}   push to that keeper from now on
    {"op": "drop", "key": K}, {"op": "keys"}
TCP (`--tcp`; port 0: the OS picks, "listening PORT" says which): first {"token": T} -> {"ok": true}
(or {"refused": why}, then closed); then requests: a JSON line {"op": "push", "key": K, "n": N, "seq":
S}, N bytes, a JSON line {"ok": b} -> {"stored": step or -1}; or {"op": "fetch", "key": K} -> a JSON
line {"sizes": [...]} and the bytes of each complete slot.

Standard library only (it runs by path, like `ddpkit/checkpoint/writer_child.py`): starting it costs
no torch import.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import io
import json
import mmap
import os
import queue
import secrets
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ddpkit import names  # torch-free: the keeper, run by path, imports no torch

HEAD = struct.Struct("<8sqqqqq")  # a slot's header: magic, step (-1 while written), seq, tree off, len, crc
MAGIC = b"DDPKSNP1"
STEP_AT = 8  # the byte offset of the step in the header: the commit is one aligned 8-byte store there
_LENGTH = struct.Struct("<I")
_MAX_FDS = 16
TOKEN_ENV = names.KEEPER_TOKEN_ENV  # this host's keeper's job token (`ddpkit run`; never on a command line)
ADDRESS_ENV = names.KEEPER_ADDRESS_ENV  # HOST:PORT where the other hosts reach this host's keeper (TCP)


class KeeperRefused(PermissionError):
    """Another host's keeper refused this connection: the token is not its job's."""


# -- the client (a rank, or a test) --------------------------------------------------------------------
class KeeperClient:
    """One connection to this host's keeper; requests are answered in order."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = sock, name

    @classmethod
    def connect(cls, name: str) -> KeeperClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + name)
        return cls(sock, name)

    def ask(self, body: dict[str, Any], fds: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        """Send one request (with `fds`), return the answer and the descriptors that came with it."""
        data = json.dumps(body).encode()
        socket.send_fds(self.sock, [_LENGTH.pack(len(data))], list(fds or []))
        self.sock.sendall(data)
        head, got, _, _ = socket.recv_fds(self.sock, _LENGTH.size, _MAX_FDS)
        if not head:
            raise EOFError(f"the snapshot keeper {self.name} closed the connection")
        head += _recv_exact(self.sock, _LENGTH.size - len(head))
        (n,) = _LENGTH.unpack(head)
        return json.loads(_recv_exact(self.sock, n)), got

    def hold(self, key: str, fds: list[int]) -> None:
        self.ask({"op": "hold", "key": key}, fds)

    def get(self, key: str) -> list[int]:
        return self.ask({"op": "get", "key": key})[1]

    def committed(self, key: str, slot: int) -> dict[str, Any]:
        """Slot `slot` of `key` is complete; the answer says whether a buddy copies it and the newest
        step of `key` the buddy has acknowledged (-1: none yet)."""
        return self.ask({"op": "committed", "key": key, "slot": slot})[0]

    def acked(self, key: str) -> int:
        """The newest step of `key` the buddy has acknowledged holding (-1: none, or no buddy)."""
        return int(self.ask({"op": "acked", "key": key})[0]["buddy_step"])

    def buddy(self, address: str, token: str) -> None:
        """Push every committed slot to the keeper at `address` (TCP) from now on."""
        self.ask({"op": "buddy", "address": address, "token": token})

    def drop(self, key: str) -> None:
        self.ask({"op": "drop", "key": key})

    def keys(self) -> dict[str, Any]:
        return self.ask({"op": "keys"})[0]

    def close(self) -> None:
        self.sock.close()


def open_tcp(address: str, token: str, timeout: float = 30.0) -> tuple[socket.socket, BinaryIO]:
    """A connection to another host's keeper, its token accepted; `KeeperRefused` (its one line) if not."""
    host, _, port = address.rpartition(":")
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    f = conn.makefile("rb")
    try:
        conn.sendall(json.dumps({"token": token}).encode() + b"\n")
        answer = _line(f)
    except BaseException:
        f.close()
        conn.close()
        raise
    if "refused" in answer:
        f.close()
        conn.close()
        raise KeeperRefused(f"the snapshot keeper at {address} refused the connection: {answer['refused']}")
    return conn, f


def fetch(address: str, key: str, token: str, timeout: float = 30.0) -> list[bytes]:
    """The complete slots another host's keeper holds for `key` (newest first), over TCP; [] if none
    or if it cannot be reached; `KeeperRefused` when it refuses the token."""
    try:
        conn, f = open_tcp(address, token, timeout)
    except (OSError, EOFError) as err:
        if isinstance(err, KeeperRefused):
            raise
        return []
    with conn, f:
        conn.sendall(json.dumps({"op": "fetch", "key": key}).encode() + b"\n")
        sizes = _line(f)["sizes"]
        return [f.read(n) for n in sizes]


# -- the launcher's side --------------------------------------------------------------------------------
@dataclass
class Keeper:
    """A running keeper, started by `ddpkit run` on its host (one per launch)."""

    name: str
    process: subprocess.Popen[bytes]
    tcp: str | None = None  # HOST:PORT it listens on (the port the OS picked for port 0)
    token: str = ""  # its job token: every TCP connection must present it
    stopped: bool = field(default=False)

    @classmethod
    def start(cls, *, tcp: str | None = None, buddy: str | None = None, token: str | None = None) -> Keeper:
        """Start the keeper and wait until it listens. Call it from the main thread: PR_SET_PDEATHSIG
        fires when the thread that started the child ends. `token`: its job token (a new random one
        when None), passed by environment; the buddy (`buddy`, given here) is taken to share it."""
        name = f"ddpkit-keeper-{uuid.uuid4().hex[:16]}"
        token = token if token is not None else secrets.token_hex(16)
        extra = [*(["--tcp", tcp] if tcp else []), *(["--buddy", buddy] if buddy else [])]
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), name, *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env={**os.environ, TOKEN_ENV: token},
        )
        assert process.stdout is not None
        said = process.stdout.readline().split()  # "listening [PORT]": the sockets exist from here on
        if not said:
            process.wait()
            raise RuntimeError(f"the snapshot keeper did not start (exit code {process.returncode})")
        process.stdout.close()
        if tcp and len(said) > 1:
            tcp = f"{tcp.rpartition(':')[0]}:{int(said[1])}"
        return cls(name, process, tcp, token)

    def stop(self) -> None:
        """End the keeper: the memory of every snapshot it held is freed."""
        if not self.stopped:
            self.stopped = True
            self.process.kill()
            self.process.wait()


# -- the keeper process ------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(buf)


def _line(f: BinaryIO) -> dict[str, Any]:
    raw = f.readline()
    if not raw:
        raise EOFError
    return json.loads(raw)


def header(m: mmap.mmap) -> tuple[int, int, int]:
    """(step, seq, bytes used) of a slot: step -1 when it holds no complete snapshot."""
    magic, step, seq, off, n, _ = HEAD.unpack_from(m, 0)
    return (step, seq, off + n) if magic == MAGIC else (-1, 0, 0)


class Held:
    """The slots this keeper holds, by key, and the pushes waiting for the buddy."""

    def __init__(self) -> None:
        self.fds: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.pushes: queue.Queue[tuple[str, int]] = queue.Queue()
        self.stats = {"pushed": 0, "dropped": 0, "received": 0, "refused": 0}
        self.buddy: tuple[str, str] | None = None  # (HOST:PORT, token) of the keeper copies go to
        self.acked: dict[str, int] = {}  # key -> the newest step the buddy acknowledged holding
        self.sending = threading.Event()  # set once a sender thread runs
        self.token = ""  # every TCP connection must present it

    def replace(self, key: str, fds: list[int]) -> None:
        with self.lock:
            for fd in self.fds.pop(key, []):
                os.close(fd)
            if fds:
                self.fds[key] = fds

    def maps(self, key: str) -> list[mmap.mmap]:
        with self.lock:
            return [mmap.mmap(fd, 0) for fd in self.fds.get(key, [])]

    def slots_for(self, key: str, size: int) -> list[mmap.mmap]:
        """Two slots of at least `size` bytes for a copy received from another host."""
        with self.lock:
            fds = self.fds.get(key, [])
            if len(fds) != 2 or any(os.fstat(fd).st_size < size for fd in fds):
                new = []
                for i in range(2):
                    fd = os.memfd_create(f"ddpkit-snapshot-{key}-{i}", os.MFD_CLOEXEC)
                    os.ftruncate(fd, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
                    new.append(fd)
                for fd in fds:
                    os.close(fd)
                self.fds[key] = fds = new
            return [mmap.mmap(fd, 0) for fd in fds]


def receive(held: Held, key: str, n: int, f: io.BufferedReader) -> int:
    """One push's `n` bytes read from `f` straight into the slot not holding the newest step (no copy in
    between: its step -1 first, the bytes, then the step, last), and the sender's {"ok": b} line after
    them; the step now held, or -1 when the push was torn or not ok (the slot written stays incomplete:
    it held the older step, the other one stays whole)."""
    slots = held.slots_for(key, n)
    steps = [header(m)[0] for m in slots]
    target = slots[1 - steps.index(max(steps))] if max(steps) >= 0 else slots[0]
    view = memoryview(target)
    body = view[STEP_AT + 8 : max(n, STEP_AT + 8)]
    try:
        struct.pack_into("<q", target, STEP_AT, -1)
        head = f.read(STEP_AT + 8)
        got = f.readinto(body)
        if not (_line(f).get("ok") and len(head) == STEP_AT + 8 and got == n - STEP_AT - 8):
            return -1
        target[0:STEP_AT] = head[:STEP_AT]
        target[STEP_AT : STEP_AT + 8] = head[STEP_AT:]  # the step, last
        held.stats["received"] += 1
        return int(struct.unpack_from("<q", head, STEP_AT)[0])
    finally:
        body.release()
        view.release()
        for m in slots:
            m.close()


def push(held: Held, conn: socket.socket, f: BinaryIO, key: str, slot: int) -> None:
    """Send one committed slot to the buddy; marked not ok when it was rewritten during the send. The
    buddy's answer is the step it holds now (recorded in `held.acked`)."""
    maps = held.maps(key)
    if slot >= len(maps):
        return
    m = maps[slot]
    step, seq, n = header(m)
    if step >= 0:
        conn.sendall(json.dumps({"op": "push", "key": key, "n": n, "seq": seq}).encode() + b"\n")
        conn.sendall(memoryview(m)[:n])
        ok = header(m)[:2] == (step, seq)
        conn.sendall(json.dumps({"ok": ok}).encode() + b"\n")
        held.stats["pushed" if ok else "dropped"] += 1
        stored = int(_line(f).get("stored", -1))
        with held.lock:
            held.acked[key] = max(held.acked.get(key, -1), stored)
    for each in maps:
        each.close()


def sender(held: Held) -> None:
    """The buddy's copies, one push at a time, behind training (a thread of the keeper)."""
    conn: tuple[socket.socket, BinaryIO] | None = None
    target: tuple[str, str] | None = None
    while True:
        latest = dict([held.pushes.get()])
        while not held.pushes.empty():  # newer commits of a key supersede older ones
            key, slot = held.pushes.get()
            latest[key] = slot
        for key, slot in latest.items():
            try:
                if conn is not None and target != held.buddy:  # rewired: the hosts met again
                    conn[0].close()
                    conn = None
                if conn is None and held.buddy is not None:
                    target = held.buddy
                    conn = open_tcp(*target)
                if conn is not None:
                    push(held, *conn, key, slot)
            except KeeperRefused:
                held.stats["refused"] += 1
                conn = None
            except (OSError, EOFError, ValueError):
                conn = None  # the buddy is gone or restarting: the next commit tries again


def _admitted(held: Held, conn: socket.socket, f: BinaryIO) -> bool:
    """The connection's first line carries this keeper's token; else one line says why, and no more."""
    try:
        given = str(_line(f).get("token", ""))
    except (EOFError, ValueError, AttributeError):
        given = ""
    if held.token and hmac.compare_digest(given.encode(), held.token.encode()):
        conn.sendall(b'{"ok": true}\n')
        return True
    held.stats["refused"] += 1
    why = "wrong or missing job token: this keeper holds the snapshots of another job"
    conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
    return False


def serve_tcp(held: Held, conn: socket.socket) -> None:
    with contextlib.suppress(EOFError, OSError, ValueError), conn, conn.makefile("rb") as f:
        if not _admitted(held, conn, f):
            return
        while True:
            req = _line(f)
            if req["op"] == "push":
                stored = receive(held, req["key"], int(req["n"]), f)
                conn.sendall(json.dumps({"stored": stored}).encode() + b"\n")
            elif req["op"] == "fetch":
                maps = held.maps(req["key"])
                complete = sorted((m for m in maps if header(m)[0] >= 0), key=lambda m: -header(m)[0])
                sizes = [header(m)[2] for m in complete]
                conn.sendall(json.dumps({"sizes": sizes}).encode() + b"\n")
                for m, n in zip(complete, sizes, strict=True):
                    conn.sendall(memoryview(m)[:n])
                for m in maps:
                    m.close()


def tcp_server(held: Held, srv: socket.socket) -> None:
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=serve_tcp, args=(held, conn), daemon=True).start()


def _same_user(conn: socket.socket) -> bool:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return uid == os.getuid()


def answer(held: Held, req: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
    """One request of a rank on the Unix socket."""
    op, key = req.get("op"), str(req.get("key"))
    if op == "hold":
        held.replace(key, fds)
    elif op == "get":
        with held.lock:
            out = list(held.fds.get(key, []))
        return {"n": len(out)}, out
    elif op == "committed":
        if held.buddy is not None:
            held.pushes.put((key, int(req["slot"])))
        with held.lock:
            return {"ok": True, "buddy": held.buddy is not None, "buddy_step": held.acked.get(key, -1)}, []
    elif op == "acked":
        with held.lock:
            return {"buddy_step": held.acked.get(key, -1)}, []
    elif op == "buddy":
        wired = (str(req["address"]), str(req["token"]))
        if held.buddy != wired:
            with held.lock:
                held.acked.clear()  # another keeper: what the last one acknowledged is not held there
            held.buddy = wired
        if not held.sending.is_set():
            held.sending.set()
            threading.Thread(target=sender, args=(held,), daemon=True).start()
    elif op == "drop":
        held.replace(key, [])
    elif op == "keys":
        with held.lock:
            return {"keys": {k: len(v) for k, v in held.fds.items()}, **held.stats}, []
    return {"ok": True}, []


def _request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, _MAX_FDS)
    if not head:
        raise EOFError
    head += _recv_exact(conn, _LENGTH.size - len(head))
    (n,) = _LENGTH.unpack(head)
    return json.loads(_recv_exact(conn, n)), fds


def end_with_parent() -> None:
    """This process ends when its parent does, however it ends: PR_SET_PDEATHSIG, and a poll of the
    parent's pid (the signal is lost if the parent died before the prctl)."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str]) -> None:
    name, opts = argv[0], dict(zip(argv[1::2], argv[2::2], strict=False))
    end_with_parent()
    held = Held()
    held.token = os.environ.get(TOKEN_ENV, "")
    said = "listening"
    if "--tcp" in opts:
        if not held.token:
            sys.exit(f"the snapshot keeper's TCP port needs a job token ({TOKEN_ENV}): none given")
        host, _, port = opts["--tcp"].rpartition(":")
        srv = socket.create_server((host, int(port)))
        said += f" {srv.getsockname()[1]}"
        threading.Thread(target=tcp_server, args=(held, srv), daemon=True).start()
    if "--buddy" in opts:  # the same job's keeper: its token is this one's
        answer(held, {"op": "buddy", "address": opts["--buddy"], "token": held.token}, [])
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind("\0" + name)
    server.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    print(said, flush=True)
    while True:
        for k, _ in sel.select():
            if k.fileobj is server:
                conn, _ = server.accept()
                if _same_user(conn):
                    sel.register(conn, selectors.EVENT_READ)
                else:
                    conn.close()
                continue
            conn = k.fileobj  # type: ignore[assignment]
            try:
                req, fds = _request(conn)
                body, out = answer(held, req, fds)
                data = json.dumps(body).encode()
                socket.send_fds(conn, [_LENGTH.pack(len(data))], out)
                conn.sendall(data)
            except (EOFError, OSError, ValueError):
                sel.unregister(conn)
                conn.close()


if __name__ == "__main__":
    main(sys.argv[1:])
