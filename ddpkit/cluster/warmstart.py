"""A warm start: one server imports torch, torch._dynamo and ddpkit once, then forks every process it is
asked for (a rank of `ddpkit run`, a `ddpkit` command), which then starts in ~0.1 s instead of paying
~5 s of CPU for imports (2-core VM: `import torch` 2.5 s; torch._dynamo 2.0 s more, which torch's own
optimizers import at their first `add_param_group`).

    python -m ddpkit.cluster.warmstart DIR &                 # serves on DIR/socket, writes DIR/python
    DDPKIT_WARM_START=DIR ddpkit run --nproc 2 train.py      # the ranks are forked from it
    DIR/python -m ddpkit.cli verify model.py:build ...       # any `python [-u] SCRIPT|-m MODULE` line

For a developer's loop and the test suite (tests/conftest.py starts one per session), where the same
imports would otherwise be paid by every rank of hundreds of short runs; a long training run gains
nothing from it and `ddpkit run` without DDPKIT_WARM_START starts new interpreters as torchrun does.

What a forked process gets: its client's arguments, environment, working directory and stdio; a session
and process group of its own (torchrun's agent signals its workers' groups: the client passes each
signal on, `ddpkit.cluster.warm_client`); numpy's global generator reseeded (Python's `random` reseeds
itself at a fork); torch's CPU threads from its OMP_NUM_THREADS; its client's umask and CPU affinity.
What it shares with the server: what torch, OpenMP, glibc's allocator and the interpreter read once
as they load (`LOAD_TIME`), and what a fork cannot change: namespaces (a launcher inside a network
namespace or a container), control group (a job's memory limit), resource limits and user
(`warm_client.place`). A request whose values of those differ from the server's is answered "fresh"
and its client starts a new interpreter instead, so a warm start changes how fast a process starts,
never what it runs. Python's hash seed is the server's (string-set iteration orders agree across the
ranks).

Why forking it is safe: the server only imports. It never runs a tensor operation (no OpenMP pool,
whose threads a forked child would lack) and never touches CUDA (which a forked child could not use),
as PyTorch's DataLoader forks its workers from a process with torch loaded. The server ends with the
process that started it (Linux's parent-death signal), and a forked process ends when its client does.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import gc
import importlib
import json
import os
import runpy
import selectors
import shlex
import signal
import socket
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.cluster import rank_output
from ddpkit.cluster.warm_client import place

# Read once, as torch, the C libraries or the interpreter load (or at the first tensor): a forked
# process keeps the server's values, so a request with other values starts fresh.
LOAD_TIME = (
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "TORCH_LOGS",
    "TORCH_COMPILE",
    "PYTORCH_",
    "ATEN_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "MALLOC_",
    "GLIBC_TUNABLES",
    "THP_",
    "LD_",
    "CUDA_",
    "PYTHON",
)
# ...except these, read when used (Inductor's cache), or applied to the forked process here.
APPLIED = frozenset({"TORCHINDUCTOR_CACHE_DIR", "PYTHONUNBUFFERED", "OMP_NUM_THREADS", "PYTHON_EXEC"})
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch._dynamo", "ddpkit.training.fit")
SOCKET = "socket"
CLIENT = "python"  # the executable a caller runs instead of `python` (PYTHON_EXEC for torchrun)


def load_time_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of `env` that a process reads once as it loads (`LOAD_TIME`, less `APPLIED`)."""
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME) and k not in APPLIED}


def client(directory: str | os.PathLike[str]) -> Path | None:
    """The executable that runs a `python` command line through the server in `directory`, if it serves."""
    path = Path(directory) / CLIENT
    return path if path.exists() and (Path(directory) / SOCKET).exists() else None


def _write_client(directory: Path) -> None:
    script = Path(__file__).with_name("warm_client.py")
    line = " ".join(shlex.quote(str(p)) for p in (sys.executable, "-I", "-S", script, directory / SOCKET))
    path = directory / CLIENT
    # whole and executable the moment it exists: a client that finds it (and the socket) runs it at once
    staged = path.with_name(f".{CLIENT}.{os.getpid()}")
    staged.write_text(f'#!/bin/sh\nexec {line} "$@"\n')
    staged.chmod(0o755)
    os.replace(staged, path)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # not yet its own group leader
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


class _Server:
    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / SOCKET).unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(directory / SOCKET))
        self.listener.listen(256)  # clients queue here while the imports below run
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        self.selector = selectors.DefaultSelector()
        self.conns: dict[int, socket.socket] = {}  # forked pid -> its client's connection
        self.env = load_time_env(os.environ)
        self.threads = os.environ.get("OMP_NUM_THREADS")
        self.client = directory / CLIENT
        self.place = json.loads(json.dumps(place()))  # as a request carries it (lists for tuples)
        _write_client(directory)

    def stop(self, signum: int = 0, frame: object = None) -> None:
        for pid in self.conns:
            _kill(pid)
        os._exit(0)

    def serve(self) -> tuple[dict[str, Any], list[int]]:
        """Answer requests; returns only in a forked process: its request and stdio descriptors."""
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w)
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    forked = self._accept()
                    if forked is not None:
                        return forked
                elif key.data == "wake":
                    os.read(self.wake_r, 4096)
                    self._reap()
                else:
                    self._client_readable(key.data, key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> tuple[dict[str, Any], list[int]] | None:
        conn, _ = self.listener.accept()
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
        except (OSError, ValueError):
            conn.close()
            return None
        if len(fds) != 3 or not self._warm(request["env"]) or request.get("place") != self.place:
            with contextlib.suppress(OSError):
                conn.send(b"fresh")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            conn.close()
            self._leave()
            return request, fds
        for fd in fds:
            os.close(fd)
        try:
            conn.send(f"pid {pid}".encode())
        except OSError:  # the client is gone already
            _kill(pid)
        self.conns[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def _warm(self, env: Mapping[str, str]) -> bool:
        threads = env.get("OMP_NUM_THREADS")
        threads_ok = threads == self.threads or (
            threads is not None and threads.isdigit() and int(threads) > 0
        )
        return threads_ok and load_time_env(env) == self.env

    def _client_readable(self, pid: int, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if conn.recv(64):
                return
        _kill(pid)  # the client ended (killed): its process goes with it
        self.selector.unregister(conn)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.conns.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.send((f"signal {-code}" if code < 0 else f"exit {code}").encode())
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()

    def _leave(self) -> None:
        """In the forked process: drop the server's descriptors and signal handlers."""
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def _become(request: dict[str, Any], fds: list[int], server: _Server) -> bool:
    """Turn the forked process into the one its client describes; True when it asked for `-u`."""
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    with contextlib.suppress(OSError):  # taskset, numactl, a scheduler's binding of the launcher
        os.sched_setaffinity(0, request["affinity"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHON_EXEC") == str(server.client):
        del os.environ["PYTHON_EXEC"]  # how `ddpkit run` sent its ranks here, not the user's setting
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads != server.threads and threads:
        import torch

        torch.set_num_threads(int(threads))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh interpreter's numpy seeds from the OS
    args = request["args"]
    unbuffered = args[:1] == ["-u"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    if unbuffered:  # torchrun's workers: line-buffered, not written through (rank_output says why)
        rank_output.line_buffered()
    return unbuffered


def _run(args: list[str]) -> None:
    rest = args[1:] if args[:1] == ["-u"] else args
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        return
    script = rest[0]
    sys.argv = list(rest)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=os.path.abspath(script), __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    code = compile(Path(script).read_bytes(), script, "exec")
    exec(code, main.__dict__)


def _own_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the user's first frame: this module's and runpy's frames are not theirs."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def main(directory: str) -> None:
    _die_with_parent()
    server = _Server(Path(directory))
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # the forked processes do not copy the server's objects by touching their counts
    request, fds = server.serve()
    _become(request, fds, server)
    try:
        _run(request["args"])
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        kind, value, tb = sys.exc_info()
        assert kind is not None and value is not None
        tb = _own_frames(tb)
        sys.excepthook(kind, value.with_traceback(tb), tb)  # as the interpreter does for an uncaught error
        raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1])
