"""Switch each key feature off in turn and show that a test notices: the suite's tests can fail.

    .venv/bin/python scripts/mutation_check.py              # every mutant, a baseline run first
    .venv/bin/python scripts/mutation_check.py shm no_sync  # only these mutants
    .venv/bin/python scripts/mutation_check.py --list       # the mutants and the tests that must catch them
    .venv/bin/python scripts/mutation_check.py --record     # every mutant; record the caught ones at HEAD
    .venv/bin/python scripts/mutation_check.py --due --budget 420 --seed 7   # what CI runs

The whole check takes ~20 minutes on 2 cores, most of it a few mutants whose tests launch real jobs, so
CI runs it incrementally, as mutation tools do (Stryker's incremental mode, PIT's history): `--record`
writes, for each mutant caught on a clean checkout, the commit and a digest of the mutant to
`.ci/mutants-verified.json`. `--due` runs every mutant that is *due* (new or edited since its record, or
one of its files changed since its commit: its ddpkit file, its test files and their helpers, the changes
that can let a mutant through), then fills `--budget` seconds with the others in an order `--seed`
shuffles, so successive CI runs cover all of them. Every mutant's target text is checked on every run,
due or not.

Each mutant is one hand-written text replacement in one ddpkit file ("call torch.compile" becomes "do
not"), applied to a temporary copy of the repository (never the working tree), followed by a run of
only the tests named for it. A mutant is *caught* when at least one of them fails. Every replacement
asserts that its target text occurs exactly once, so the script stops loudly when the code moves and
the list needs updating, rather than reporting a mutant that changed nothing as caught or missed.

Each run is pytest forked from this process after it imported torch (most of a short run's cost), in a
copy whose ddpkit/ the run imports afresh; `-j N` runs N mutants at once, each in its own copy.

The baseline (the same tests on the unmodified copy) runs first: a test that fails without any
mutation would make every mutant look caught. Exit code 0 when the baseline passes and every mutant
is caught, 1 otherwise. docs/testing.md holds the latest table.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import hashlib
import importlib
import json
import os
import py_compile
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent
# Mutants at once. One: on 2 cores two runs at once each took about twice as long (docs/testing.md), and
# extra load can fail a timing-sensitive test for another reason than its mutant (a false "caught").
JOBS = 1


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository root
    old: str  # must occur exactly once
    new: str
    tests: tuple[str, ...]  # pytest node ids; at least one must fail
    what: str


MUTANTS_DIR = REPO / "scripts" / "mutants"


def load_mutants(folder: Path = MUTANTS_DIR) -> list[Mutant]:
    """The mutants, as data: one TOML file a wing (`[[mutant]]` tables: name, file, what, old, new, tests),
    read in file-name order. A name given twice is an error, so two files cannot shadow each other."""
    found: list[Mutant] = []
    for path in sorted(folder.glob("*.toml")):
        for entry in tomllib.loads(path.read_text())["mutant"]:
            fields = {**entry, "tests": tuple(entry["tests"])}
            found.append(Mutant(**fields))
    names = [m.name for m in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SystemExit(f"mutants named twice in {folder}: {twice}")
    return found


MUTANTS = load_mutants()


def copy_repo(dest: Path) -> None:
    """The files git knows (tracked and untracked-not-ignored), as they are in the working tree, with
    ddpkit/ byte-compiled into hash-checked .pyc files: a rank or a run imports them without compiling,
    and a mutated file's .pyc no longer matches its source's hash, so it is compiled afresh (never stale,
    whatever the file's size and time stamp)."""
    names = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, names):
        src = REPO / name
        if src.is_file() and not src.is_symlink():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    compileall.compile_dir(
        dest / "ddpkit", quiet=1, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
    )


PYTEST_ARGS = ("-q", "-x", "-p", "no:randomly", "-p", "no:cacheprovider")
# Imported once by this process before it forks a pytest run per mutant: torch's import is most of a short
# run's cost. ddpkit is never among them: each run imports it from its own (mutated) copy.
PRELOAD = ("torch", "torch.nn", "torch.distributed", "torch.multiprocessing", "numpy", "pytest")


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    assert not any(m == "ddpkit" or m.startswith("ddpkit.") for m in sys.modules), "ddpkit imported early"


def _child(copy: Path, tests: tuple[str, ...], log: Path) -> None:
    """In the forked process: pytest on `tests` in `copy`, output to `log`; never returns."""
    code = 3
    try:
        os.setsid()  # its own group: a timeout kills it and what it started
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(copy)
        os.environ.update(PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        sys.dont_write_bytecode = True
        sys.path.insert(0, str(copy))
        import pytest

        code = int(pytest.main([*PYTEST_ARGS, *tests]))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@dataclass
class Run:
    """One pytest run: a forked child, its slot (copy of the repository), its deadline."""

    key: object
    slot: int
    pid: int
    log: Path
    start: float
    deadline: float
    restore: Callable[[], None]


def run_all(
    jobs: list[tuple[object, tuple[str, ...], Callable[[Path], Callable[[], None]]]],
    copies: list[Path],
    timeout: float,
    done: Callable[[object, int, str, float], None],
) -> None:
    """Run each job `(key, tests, prepare)` in a free copy, len(copies) at a time. `prepare(copy)`
    mutates that copy and returns what undoes it; `done(key, exit code, failures, seconds)` is called
    as each run ends (124: timed out). Single-threaded: fork, then poll with waitpid."""
    pending, free, running = list(jobs), list(range(len(copies))), {}
    logs = Path(tempfile.mkdtemp(prefix="ddpkit-mutant-logs-"))
    try:
        while pending or running:
            while pending and free:
                key, tests, prepare = pending.pop(0)
                slot = free.pop(0)
                restore = prepare(copies[slot])
                log = logs / f"{slot}.log"
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(copies[slot], tests, log)
                now = time.monotonic()
                running[pid] = Run(key, slot, pid, log, now, now + timeout, restore)
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                for run in running.values():
                    if time.monotonic() > run.deadline:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(run.pid, signal.SIGKILL)
                        run.deadline = float("inf")
                        run.restore = _timed_out(run.restore)
                time.sleep(0.05)
                continue
            run = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            timed_out = getattr(run.restore, "timed_out", False)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # anything it left in its group
            run.restore()
            free.append(run.slot)
            out = run.log.read_text(errors="replace")
            lines = [ln for ln in out.splitlines() if ln.startswith(("FAILED", "ERROR"))]
            if timed_out:
                code, lines = 124, ["timed out"]
            elif code not in (0, 1) and not lines:
                lines = out.splitlines()[-5:]
            done(run.key, code, "; ".join(lines)[:300], time.monotonic() - run.start)
    finally:
        for run in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)
        shutil.rmtree(logs, ignore_errors=True)


def _timed_out(restore: Callable[[], None]) -> Callable[[], None]:
    def again() -> None:
        restore()

    again.timed_out = True  # type: ignore[attr-defined]
    return again


def apply(copy: Path, m: Mutant) -> str:
    path = copy / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(
            f"mutant {m.name!r}: its target text occurs {count} times in {m.file} (want exactly 1); the "
            f"code moved. Update MUTANTS in scripts/mutation_check.py. Target:\n{m.old}"
        )
    path.write_text(text.replace(m.old, m.new))
    return text


def mutate(m: Mutant) -> Callable[[Path], Callable[[], None]]:
    def prepare(copy: Path) -> Callable[[], None]:
        original = apply(copy, m)
        return lambda: (copy / m.file).write_text(original)

    return prepare


RECORD = REPO / ".ci" / "mutants-verified.json"


def _where() -> str:
    return os.path.relpath(RECORD, REPO)


def digest(m: Mutant) -> str:
    """What a mutant is: a new or edited mutant is never covered by an older record."""
    return hashlib.sha256(repr((m.file, m.old, m.new, m.tests)).encode()).hexdigest()[:16]


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def changed_since(commit: str) -> set[str] | None:
    """Files changed between `commit` and the working tree (committed or not); None when git does not
    know the commit (a shallow clone, a rewritten history): then every mutant is due."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    names = set(_git("diff", "--name-only", commit).stdout.split())
    names |= set(_git("ls-files", "--others", "--exclude-standard").stdout.split())
    return names


# Shared by nearly every test: a change to them would make every mutant due. What they do is covered by the
# suite passing and by the budget's rotation through all mutants, not by the due set.
SHARED_HELPERS = {"tests/conftest.py", "tests/rankpool.py"}


def _helpers(test_file: str) -> set[str]:
    """The modules of tests/ a test file imports (rank scripts, its own helpers), less the shared ones."""
    path = REPO / test_file
    if not path.is_file():
        return set()
    found = re.findall(r"^\s*(?:from|import)\s+(\w+)", path.read_text(), re.MULTILINE)
    named = {f"tests/{name}.py" for name in found if (REPO / "tests" / f"{name}.py").is_file()}
    return named - SHARED_HELPERS


def files_of(m: Mutant) -> set[str]:
    """The files whose change can let this mutant through: its target, its tests and their helpers."""
    tests = {t.split("::")[0] for t in m.tests}
    return {m.file} | tests | {h for t in tests for h in _helpers(t)}


def due(chosen: list[Mutant]) -> tuple[list[Mutant], str]:
    """The mutants the record does not cover, and a line saying why. A mutant is covered when the record
    holds its digest and a commit at which it was caught, and none of its files changed since."""
    verified = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    changes: dict[str, set[str] | None] = {}
    picked, unknown = [], set()
    for m in chosen:
        entry = verified.get(m.name)
        if entry is None or entry["digest"] != digest(m):
            picked.append(m)
            continue
        if entry["commit"] not in changes:
            changes[entry["commit"]] = changed_since(entry["commit"])
        changed = changes[entry["commit"]]
        if changed is None:
            unknown.add(entry["commit"][:10])
        if changed is None or files_of(m) & changed:
            picked.append(m)
    missing = f"; commits not in this clone (all their mutants due): {sorted(unknown)}" if unknown else ""
    return picked, (
        f"{len(picked)} of {len(chosen)} mutants due (new, edited, or a file of theirs changed since the "
        f"commit at which {_where()} says they were caught){missing}"
    )


def write_record(caught: list[Mutant]) -> str:
    """Record each caught mutant at HEAD; only on a checkout with no uncommitted change to tracked files."""
    if _git("status", "--porcelain", "--untracked-files=no").stdout.strip():
        return "not recorded: uncommitted changes (a record names a commit; commit first)"
    commit = _git("rev-parse", "HEAD").stdout.strip()
    verified = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    for m in caught:
        verified[m.name] = {"digest": digest(m), "commit": commit, "date": time.strftime("%Y-%m-%d")}
    known = {m.name for m in MUTANTS}
    verified = {name: entry for name, entry in verified.items() if name in known}
    RECORD.write_text(json.dumps(verified, indent=1, sort_keys=True) + "\n")
    return f"recorded {len(caught)} caught mutants at {commit[:10]} in {_where()} (commit it)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on unmodified code")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per pytest run (300)")
    parser.add_argument(
        "-j", "--jobs", type=int, default=JOBS, help=f"mutants run at once, each in its own copy ({JOBS})"
    )
    parser.add_argument(
        "--due",
        action="store_true",
        help="only the mutants the record does not cover, then others within --budget",
    )
    parser.add_argument("--budget", type=float, default=0, help="with --due: seconds to fill with others")
    parser.add_argument(
        "--due-budget",
        type=float,
        default=0,
        help="with --due: at most these seconds for the due mutants, in --seed's order (0: all of them)",
    )
    parser.add_argument("--seed", type=int, default=0, help="with --due: the order of the others")
    parser.add_argument("--record", action="store_true", help="record the caught mutants at HEAD")
    ns = parser.parse_args(argv)
    unknown = sorted(set(ns.names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {[m.name for m in MUTANTS]}")
    chosen = [m for m in MUTANTS if not ns.names or m.name in ns.names]
    others: list[Mutant] = []
    if ns.due:
        picked, why = due(chosen)
        others = [m for m in chosen if m not in picked]
        random.Random(ns.seed).shuffle(others)
        chosen = picked
        if ns.due_budget:  # more due than CI's time holds: a seeded share each run, the rest said
            random.Random(ns.seed).shuffle(chosen)
        print(f"{why}; then others for up to {ns.budget:.0f} s (order: --seed {ns.seed})", flush=True)
    if ns.list:
        for m in chosen:
            print(f"{m.name:18} {m.file:24} {m.what}\n{'':18} tests: {' '.join(m.tests)}")
        return 0
    began = time.monotonic()
    # A TERM (CI's or `timeout`'s) unwinds through run_all's `finally`, which kills the runs in flight: they
    # are in sessions of their own and would otherwise live on in a deleted copy.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    preload()
    results: dict[str, tuple[int, str, float]] = {}
    ok = True
    with tempfile.TemporaryDirectory(prefix="ddpkit-mutants-") as tmp:
        copies = [Path(tmp) / f"copy{i}" for i in range(max(1, min(ns.jobs, len(chosen))))]
        for copy in copies:
            copy.mkdir()
            copy_repo(copy)
        for m in chosen + others:  # every target must exist before anything runs, due or not
            apply(copies[0], m)
            (copies[0] / m.file).write_text((REPO / m.file).read_text())
        if not ns.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))

            def baseline(key: object, rc: int, failed: str, secs: float) -> None:
                nonlocal ok
                ok = rc == 0
                verdict = "pass" if ok else f"FAIL {failed}"
                print(f"baseline (no mutant), {len(tests)} tests: {verdict} ({secs:.0f} s)", flush=True)

            run_all([("baseline", tests, lambda copy: lambda: None)], copies[:1], ns.timeout * 2, baseline)

        def record(key: object, rc: int, failed: str, secs: float) -> None:
            verdict = "caught" if rc == 1 else "MISSED" if rc == 0 else f"ERROR (pytest exit {rc})"
            results[str(key)] = (rc, verdict + (f": {failed}" if rc else ""), secs)
            print(f"{key}: {verdict} ({secs:.0f} s)", flush=True)

        if ns.due and ns.due_budget:
            due_ends, ran = time.monotonic() + ns.due_budget, []
            for m in chosen:
                if time.monotonic() >= due_ends:
                    break
                run_all([(m.name, m.tests, mutate(m))], copies[:1], ns.timeout, record)
                ran.append(m)
            if len(ran) < len(chosen):
                print(
                    f"{len(chosen) - len(ran)} due mutants not run within --due-budget {ns.due_budget:.0f} s "
                    "(a later seed runs them; `--record` on a quiet machine covers all)",
                    flush=True,
                )
            chosen = ran
        else:
            run_all([(m.name, m.tests, mutate(m)) for m in chosen], copies, ns.timeout, record)
        ends = time.monotonic() + ns.budget
        for m in others:  # one at a time, each started only while the budget lasts
            if time.monotonic() >= ends:
                break
            run_all([(m.name, m.tests, mutate(m))], copies[:1], ns.timeout, record)
            chosen.append(m)
    print("\n| mutant | switched off | tests that fail | s |\n|---|---|---|---|")
    for m in chosen:
        rc, verdict, secs = results[m.name]
        ok = ok and rc == 1
        print(f"| {m.name} | {m.file}: {m.what} | {verdict} | {secs:.0f} |")
    caught = sum(results[m.name][0] == 1 for m in chosen)
    print(
        f"\n{caught} of {len(chosen)} mutants caught, {ns.jobs} at a time, "
        f"in {time.monotonic() - began:.0f} s"
    )
    if ns.due:
        print(
            f"{len(MUTANTS) - len(chosen)} of {len(MUTANTS)} mutants not run "
            "(the record covers them, or the due budget left them)"
        )
    if ns.record:
        print(write_record([m for m in chosen if results[m.name][0] == 1]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
