"""The client side of a warm start (`ddpkit.cluster.warmstart`): behaves as `python [-u] SCRIPT|-m MODULE
ARGS...` would, but the interpreter that runs the script is forked from the warm server.

Run as a file by the wrapper the server writes (`<dir>/python`), with `python -I -S`: standard library
only, never the ddpkit package (that would import torch, the cost this avoids). It sends the server its
arguments, environment, working directory and its stdin/stdout/stderr (SCM_RIGHTS); passes on every
signal it receives to the forked process's group (torchrun's agent signals its workers' groups); and ends
as that process ended: the same exit code, or killed by the same signal. If this process is killed
(SIGKILL), the server sees the connection close and kills the forked process. Anything the server cannot
run warm (other interpreter options, a changed load-time variable, no server) is run by a new interpreter
instead (`exec`), so a warm start never changes what runs, only how fast it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import sys

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCONT")


def _fresh(args: list[str], path: str) -> None:
    """The same command line in a new interpreter; without the PYTHON_EXEC that `ddpkit run` set to reach
    this client (as a forked process is given it)."""
    if os.environ.get("PYTHON_EXEC") == os.path.join(os.path.dirname(path), "python"):  # warmstart.CLIENT
        del os.environ["PYTHON_EXEC"]
    os.execv(sys.executable, [sys.executable, *args])


def place() -> dict[str, object]:
    """Where a process lives that a fork cannot change: its namespaces (a launcher in a network namespace,
    a container), its control group (a job's memory limit), its resource limits and its user."""
    namespaces = {}
    for name in ("net", "mnt", "pid", "uts", "ipc", "user", "cgroup"):
        with contextlib.suppress(OSError):
            namespaces[name] = os.stat(f"/proc/self/ns/{name}").st_ino
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = f.read()
    except OSError:
        cgroup = ""
    limits = {n: resource.getrlimit(getattr(resource, n)) for n in dir(resource) if n.startswith("RLIMIT_")}
    return {"ns": namespaces, "cgroup": cgroup, "rlimits": limits, "ids": [os.getuid(), os.getgid()]}


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


def _warm_form(args: list[str]) -> bool:
    """Only `[-u] SCRIPT ...` and `[-u] -m MODULE ...` are run warm; any other option starts fresh."""
    rest = args[1:] if args[:1] == ["-u"] else args
    if rest[:1] == ["-m"]:
        return len(rest) > 1
    return bool(rest) and not rest[0].startswith("-")


def main(path: str, args: list[str]) -> None:
    if not _warm_form(args):
        _fresh(args, path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        request = {
            "args": args,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "place": place(),
            "umask": _umask(),
            "affinity": sorted(os.sched_getaffinity(0)),
        }
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        first = sock.recv(64).decode()
    except OSError:  # no server (it ended, or never started): the same command, unwarmed
        first = "fresh"
    if not first.startswith("pid "):
        sock.close()
        _fresh(args, path)
    pid = int(first.split()[1])

    def forward(signum: int, frame: object) -> None:
        try:
            os.killpg(pid, signum)
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    end = sock.recv(64).decode()  # PEP 475: a signal runs `forward`, then the wait goes on
    if end.startswith("signal "):  # die of the same signal, as torchrun's agent expects of a worker
        signum = int(end.split()[1])
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        sys.exit(128 + signum)  # a signal whose default is to be ignored
    sys.exit(int(end.split()[1]) if end.startswith("exit ") else 1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
