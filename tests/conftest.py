"""Shared fixtures: long-lived rank pools, environment hygiene, helpers to run the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpkit.cluster.warmstart import client as warm_client
from ddpkit.names import WARM_START_ENV

sys.path.insert(0, str(Path(__file__).parent))
from rankpool import RankPool

# The suite, and every process it starts, writes the bytecode of what it imports, as Python does by default,
# also where the machine sets PYTHONDONTWRITEBYTECODE (this project's CI machines): scripts/setup.sh compiles
# only what a ddpkit run imports, and the extras' packages (transformers, moto, the trackers) are compiled
# once, at their first import here, instead of in every process that imports them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

REPO = Path(__file__).resolve().parent.parent

_pools: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _pools:
        _pools[world] = RankPool(world)
    return _pools[world]


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    """Two gloo ranks shared by every test that asks (one process group for the whole run)."""
    return _pool(2)


@pytest.fixture(scope="session")
def pool3() -> RankPool:
    return _pool(3)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    """Four gloo ranks (oversubscribed on 2 cores): world sizes 1, 2 and 4 through subgroups."""
    return _pool(4)


@pytest.fixture
def pool_runner(pool2, pool4):
    """A `runner(fn, world, args)` for the checks that spawn fresh ranks by default (`ddpkit.verify.resume`,
    `ddpkit.verify.bitwise`): 2 or 4 ranks from the pools, 1 rank in this process with one thread (as
    `ddpkit.spawn(threads=1)` would give it). Every run builds its session and state anew either way."""

    def run(fn: Callable[..., Any], world: int, args: tuple) -> list[Any]:
        if world in (2, 4):
            return (pool2 if world == 2 else pool4).run(fn, *args, timeout=120)
        assert world == 1, f"no pool of {world} ranks"
        import torch

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return [fn(*args)]
        finally:
            torch.set_num_threads(threads)

    return run


# The warm start (ddpkit.cluster.warmstart): every launch of a test (the `ddpkit` command started by
# `popen_marked`, and the ranks of any `ddpkit run`, which read DDPKIT_WARM_START) is forked from one
# server that imported torch and ddpkit once for the session, instead of paying ~5 s of CPU for imports
# per process (~400 such processes in the suite). What a forked process shares with the server is checked
# per request (a differing load-time variable starts a new interpreter). DDPKIT_TEST_WARM=0 turns it off:
# every launch then starts new interpreters, as a user's `ddpkit run` does.
_warm: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("DDPKIT_TEST_WARM", "1") == "0" or not hasattr(socket, "send_fds"):
        return
    _warm["dir"] = Path(tempfile.mkdtemp(prefix="ddpkit-warm-"))
    os.environ[WARM_START_ENV] = str(_warm["dir"])  # started at the first launch (`python`)


WORKERS_ENV = "DDPKIT_TEST_WORKERS"  # how many pytest workers `-n auto` starts; 0: one process


def auto_workers(args: list[str], cwd: Path, cores: int, env: dict[str, str], marks: str = "") -> int:
    """pytest-xdist's worker count for `-n auto` (pyproject's addopts), each worker with its own rank pools
    and warm-start server.

    The whole suite (no arguments, or folders): one worker per core, at most 4. Measured on the 2-core VM
    (docs/testing.md, "CI's time"): run in one process the suite keeps the cores ~64 % busy (its ranks wait
    on sockets, signals, rendezvous and timeouts), with two workers ~97 %, and it ends ~24 % sooner. Named
    files or tests run in one process, as a developer expects of a short run (`-s`, `--pdb`, no worker
    start-up); so do the mutation check's runs, which name their tests, and the inner loop (`-m quick`: its
    46 short tests took 50 s on two workers against 35 s in one process, both workers paying the start-up).
    """
    if env.get(WORKERS_ENV):
        return int(env[WORKERS_ENV])
    if any(not (cwd / arg.split("::")[0]).is_dir() for arg in args) or marks.strip() == "quick":
        return 0
    return min(4, cores) if cores > 1 else 0


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return auto_workers(
        list(config.args), config.invocation_params.dir, cores, dict(os.environ), config.option.markexpr
    )


MODULE_SECONDS = REPO / "tests" / "module_seconds.json"


def longest_first(seconds: dict[str, float], pending: list[str]) -> str:
    """The pending module (`tests/test_x.py`) to hand out next: the longest by the table, one not in it
    taken at the median. Ties keep xdist's own order."""
    default = statistics.median(seconds.values()) if seconds else 0.0
    return max(pending, key=lambda scope: seconds.get(Path(scope.split("::")[0]).name, default))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` handing out modules longest first (scripts/module_seconds.py says why)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node: Any) -> None:
            self.workqueue.move_to_end(longest_first(seconds, list(self.workqueue)), last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log)


def python() -> str:
    """The interpreter a test's launch runs: the warm server's client (the server is started by the
    first launch of the session: a run of tests that launch nothing never pays for it), else this one."""
    directory = _warm.get("dir")
    if directory is None:
        return sys.executable
    if "server" not in _warm:
        log = (directory / "server.log").open("w")
        _warm["server"] = subprocess.Popen(
            [sys.executable, "-m", "ddpkit.cluster.warmstart", str(directory)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10  # it listens before it imports: clients queue meanwhile
        while warm_client(directory) is None and time.monotonic() < deadline:
            time.sleep(0.01)
    client = warm_client(directory)
    return str(client) if client else sys.executable


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for pool in _pools.values():
        pool.close()
    server = _warm.pop("server", None)
    if server is not None:
        server.terminate()  # it kills what it forked and is still running
        server.wait(10)
    shutil.rmtree(_warm.pop("dir", ""), ignore_errors=True)


REQUIRED = "DDPKIT_CI_REQUIRE"  # e.g. "elastic,cgroup": tests marked must_run(name) may not skip


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A skip of a test that the environment declares required is a failure, with the skip's reason.

    Some proofs need what only some machines have (root, network namespaces, a memory cgroup); they skip
    elsewhere. CI names the ones its machine must run, so losing one fails CI instead of passing quietly.
    """
    outcome = yield
    report = outcome.get_result()
    required = {name.strip() for name in os.environ.get(REQUIRED, "").split(",") if name.strip()}
    marks = {arg for mark in item.iter_markers("must_run") for arg in mark.args}
    if report.skipped and marks & required:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} skipped, but {REQUIRED}={os.environ[REQUIRED]} requires it "
            f"({', '.join(sorted(marks & required))}): {reason}"
        )


@pytest.fixture(autouse=True)
def _restore_environ():
    """Tests may set launcher variables; none may leak into the next test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


LAUNCH_MARK = "DDPKIT_TEST_LAUNCH"  # inherited by the launcher's workers: finds them in any session


def marked(mark: str, var: str = LAUNCH_MARK) -> list[int]:
    """Pids of the live processes whose environment holds `var=mark` (they inherited it from a launch)."""
    pids, needle = [], f"{var}={mark}".encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (
                needle in (proc / "environ").read_bytes().split(b"\0")
                and (proc / "stat").read_text().split(") ", 1)[1][0] != "Z"
            ):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours
            continue
    return pids


def end_launch(proc: subprocess.Popen, mark: str) -> None:
    """SIGKILL the launcher's process group and every process that inherited its mark: torchrun starts
    each worker in a session of its own, so killing the launcher's group alone leaves them running."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(50):  # a worker may be forking a child of its own while we kill
        pids = marked(mark)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def popen_marked(
    cmd: list[str], *, cwd: Path | None = None, env: dict | None = None, **kwargs
) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a launcher: ddpkit run, torchrun) in a session of its own, its environment marked
    so that `end_launch` finds its workers; stdout and stderr piped unless given."""
    mark = uuid.uuid4().hex
    if cmd and cmd[0] == sys.executable:
        cmd = [python(), *cmd[1:]]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {}), LAUNCH_MARK: mark}
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    proc = subprocess.Popen(cmd, text=True, cwd=cwd, env=full_env, start_new_session=True, **kwargs)
    return proc, mark


def popen_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, **kwargs
) -> tuple[subprocess.Popen, str]:
    """`ddpkit ...` started by `popen_marked`."""
    return popen_marked([sys.executable, "-m", "ddpkit.cli", *args], cwd=cwd, env=env, **kwargs)


def communicate(proc: subprocess.Popen, mark: str, timeout: float) -> subprocess.CompletedProcess:
    """Wait for a `popen_cli` launch; on a timeout end it and its workers, then raise TimeoutExpired.
    Workers left behind by a launcher that exited (killed, or crashed) are ended too."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_launch(proc, mark)
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that escaped still holds the pipes open
            stdout = stderr = None
        raise subprocess.TimeoutExpired(proc.args, timeout, stdout, stderr) from None
    if marked(mark):
        end_launch(proc, mark)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_marked(cmd: list[str], *, timeout: float, cwd: Path | None = None, env: dict | None = None):
    """subprocess.run for a launcher: on a timeout it and all its workers are killed before
    subprocess.TimeoutExpired is raised (subprocess.run would kill only the launcher)."""
    proc, mark = popen_marked(cmd, cwd=cwd, env=env)
    return communicate(proc, mark, timeout)


def run_cli(*args: str, timeout: float = 120, cwd: Path | None = None, env: dict | None = None):
    """Run `ddpkit ...` as a user would, in a subprocess; return the CompletedProcess. On a timeout the
    launcher and all its workers are killed before subprocess.TimeoutExpired is raised."""
    return run_marked([sys.executable, "-m", "ddpkit.cli", *args], timeout=timeout, cwd=cwd, env=env)


def fresh_python(code: str, timeout: float = 60) -> str:
    """Run `code` in a new interpreter (nothing imported yet, ddpkit from this checkout); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


# The inner loop (`pytest -m quick`, docs/testing.md): a few fast tests per wing of ddpkit/, real ranks
# included (the shared pools, one real `ddpkit run` launch), for use between commits; about a minute on
# 2 cores. Listed here rather than marked in each file so that the whole selection reads in one place;
# tests/test_ci_selection.py checks that every wing has an entry and every entry names collected tests.
# An entry is a test's node id, or its id without the parameters (then every parametrisation).
QUICK: dict[str, tuple[str, ...]] = {
    "bench": ("test_bench.py::test_floor_is_the_least_exchange_at_copy_bandwidth",),
    "checkpoint": (
        "test_checkpoint.py::test_round_trip_restores_objects_values_and_rng",
        "test_checkpoint.py::test_rng_streams_continue_where_they_were_saved",
        "test_background_save.py::test_a_background_save_holds_the_state_of_the_call_not_of_later_steps",
    ),
    "cluster": (
        "test_routes.py::test_a_clean_preemption_is_not_recorded_as_a_failure",
        "test_routes.py::test_one_rule_for_a_signal_name_in_the_launcher_and_the_ranks",
        "test_launch.py::test_module_target_and_exit_code_come_back",  # a real `ddpkit run --nproc 2`
        "test_launch.py::test_spawn_returns_results_in_rank_order",
    ),
    "data": (
        "test_ddp_core.py::test_each_rank_sees_a_disjoint_shard_and_the_order_changes",
        "test_data_samplers.py::test_each_rank_takes_its_share_of_the_global_order",
        "test_data_streams.py::test_a_one_pass_iterator_is_refused_with_a_paragraph",
    ),
    "lint": (
        "test_lint_new_rules.py::test_iterable_dataset_read_whole_by_every_rank",
        "test_lint_docs.py::test_no_finding_on_what_the_docs_recommend[README.md]",
    ),
    "observe": (
        "test_tracking.py::test_tensorboard_events_read_back_and_a_resumed_session_replaces_the_points_after_its_start",
        "test_anatomy.py::test_anatomy_marks_split_backward_at_the_last_gradient",
    ),
    "plan": ("test_plan.py::test_ring_tree_and_allgather_costs_follow_the_textbook_formulas",),
    "parallel": (
        "test_shm_allreduce.py::test_bitwise_equal_to_gloo_and_across_ranks",
        "test_syncbn.py::test_sync_batchnorm_equals_batchnorm_on_the_concatenated_batch",
        "test_fsdp_shm.py::test_shm_reduce_scatter_and_all_gather_are_exact",
        "test_plugins.py::test_the_shape_carries_nodes_and_a_mesh_that_must_cover_the_ranks",
    ),
    "step": (
        "test_accumulate.py::test_one_all_reduce_per_bucket_per_optimizer_step",
        "test_shard_exchange.py::test_reduce_scatter_step_gives_the_all_reduce_weights_bitwise",
    ),
    "strategy": (
        "test_fsdp_init.py::test_factory_built_shards_are_one_process_initial_weights",
        "test_plugins.py::test_a_strategy_registered_from_outside_trains_with_its_shape",
        "test_memory_limit.py::test_ddp_refusal_names_fsdp_and_the_numbers",
    ),
    "tools": (
        "test_public_api.py::test_tools_receive_their_own_options",
        "test_gpucheck.py::test_rehearsal_on_cpu_one_line_per_check_and_summary",
    ),
    "training": (
        "test_fit.py::test_a_stop_request_on_one_rank_stops_all_ranks_together",
        "test_metrics.py::test_evaluation_equals_one_process",
    ),
    "verify": (
        "test_verify.py::test_sgd_stays_within_1e_6_relative_norm_and_replicas_are_bitwise_identical",
        "test_verify_diagnose.py::test_a_correct_setup_passes_with_no_diagnosis",
    ),
    "": (  # the package's top level and its layout
        "test_public_api.py::test_public_names",
        "test_architecture.py::test_every_module_is_in_a_layer",
        "test_architecture.py::test_import_contracts_hold",
    ),
}


_REFUSAL = "a refusal or an error message"
_SAME_BY_CONSTRUCTION = "a resumed run repeats the uninterrupted run's own operations: equal on any kernel"
# Tests (file, or file::test) whose results cannot depend on the kernel path, and why: .ci/run's
# default-kernel leg (`-m "numerics and not kernel_independent"`) leaves them out, also where their module
# is marked `numerics` as a whole. tests/test_ci_selection.py checks that every other test showing a float
# comparison is marked `numerics`, and that every entry names a test.
NOT_KERNEL_DEPENDENT = {
    "test_memory_recovery.py": "a snapshot's round trip: the restored tensors are the bytes the slot holds",
    "test_memory_recovery_faults.py": _SAME_BY_CONSTRUCTION,
    "test_memory_recovery_hosts.py": _SAME_BY_CONSTRUCTION,
    "test_memory_recovery_keepers.py": _SAME_BY_CONSTRUCTION,
    "test_memory_recovery_plan.py": "the fault plan's arithmetic on given rates and times",
    "test_verify_script_resume.py": _SAME_BY_CONSTRUCTION,
    "test_drift_rollback.py": _SAME_BY_CONSTRUCTION,
    "test_shard_checksum.py": "a checkpoint's file digests and a refusal: the bytes on disk, not a float result",
    "test_idioms_reading.py": "an offline read returns the saved bytes",
    "test_tp_options.py": (
        "TPOptions' mesh, units, reshard and notes; the initial weights are one process's draws, cut"
    ),
    "test_tp_verify.py::test_the_tensor_flags_set_the_shapes_verify_and_plan_run": (
        "the flags' effect on the spec verify runs (the comparison is not run)"
    ),
    "test_options_cli.py::test_checkpoint_convert_to_model_and_back_with_name_and_step": (
        "a conversion round trip: the converted tensors are the saved bytes"
    ),
    "test_options_cli_plan.py": "the planner's arithmetic on a given profile and on parameter counts",
    "test_options_cli_verify.py": "the flags' effect on the spec verify runs (the comparison is not run)",
    "test_shapes_hsdp.py::test_real_ranks_as_one_shard_group_and_as_four_replicas": (
        "replicas of one step hold the same bits by construction (one all-reduce's result on every rank)"
    ),
    "test_shapes_plan.py": "the memory plan's and the step plan's byte arithmetic",
    "test_anatomy.py": "timings and their arithmetic; no trained values compared",
    "test_bench.py": "benchmark arithmetic (floors, spreads) on measured or given numbers",
    "test_checkpoint.py": "save/load round trips: the same bytes come back",
    "test_background_fsdp.py::test_a_process_save_under_fsdp_is_written_by_the_writer_process_and_resumes_bitwise": (
        "a save/load round trip: the loaded shards are the saved bytes (joined by torch.cat, no arithmetic)"
    ),
    "test_checkpoint_tools.py": "conversions return the saved bytes; forwards compared in one process on the same weights",
    "test_checkpoint_portable.py": "a load copies the saved values: the loaded state equals the saved bytes",
    "test_checkpoint_remote.py": "downloaded checkpoints equal the uploaded bytes; the preempted run: "
    + _SAME_BY_CONSTRUCTION,
    "test_ci_selection.py": "this check's own sample of a float comparison",
    "test_data_hf.py": _SAME_BY_CONSTRUCTION,
    "test_fit.py": "logged values read back as written",
    "test_gpucheck.py": "names of checks; nothing computed",
    "test_hf_weights.py": "weights loaded from a checkpoint equal its bytes",
    "test_fixes_weights.py": "weights loaded from a transformers checkpoint equal its bytes",
    "test_plan.py": "the planner's cost model in Python floats; no torch kernel",
    "test_plugins.py::test_a_strategy_registered_from_outside_trains_with_its_shape": "replicas compared with each other: every rank applies the same all-reduced gradient",
    "test_architecture.py::test_every_wing_index_lists_all_its_modules": "module names in docstrings; nothing computed",
    "test_plan_noise.py": "the planner's noise bands in Python floats; no torch kernel",
    "test_plan_memory.py": "bytes of fake tensors (shapes and dtypes): no kernel computes a value",
    "test_plan_memory_ranks.py": "a peak in bytes measured by the kernel against the estimate; no trained value compared",
    "test_plan_tp_shapes.py": "bytes of fake tensors split by a tensor-parallel plan: no kernel computes a value",
    "test_plan_tp_ranks.py": "bytes real TP ranks hold against the estimate; no trained value compared",
    "test_plan_tp_time.py": "the planner's cost model in Python floats and fake-tensor sizes; no torch kernel",
    "test_plan_tp_gpucheck.py": "the GPU acceptance script's CPU path: which checks skip and why",
    "test_preemption.py": _SAME_BY_CONSTRUCTION,
    "test_public_api.py": "command-line options only",
    "test_run_reports.py": "launch reports; no values compared",
    "test_strategy_choice.py": "byte counts of optimizer state",
    "test_tracking.py": "logged values read back as written",
    "test_activation_checkpointing.py::test_a_block_fed_the_raw_batch_still_trains": "weights changed at all",
    "test_activation_checkpointing.py::test_auto_finds_an_hf_models_blocks_and_loads_weights_through_the_wrappers": (
        "loaded weights equal the saved bytes"
    ),
    "test_data_streams.py::test_stopped_mid_epoch_and_resumed_ends_bitwise_like_uninterrupted": _SAME_BY_CONSTRUCTION,
    "test_data_streams.py::test_killed_mid_epoch_and_restarted_ends_bitwise_like_uninterrupted": _SAME_BY_CONSTRUCTION,
    "test_lint_new_rules.py::test_the_checkpointing_trap_is_real_on_gloo_ranks": (
        "shows a hang/refusal of the trap, not two computations' values"
    ),
    "test_tokens.py::test_a_step_without_any_valid_token_is_skipped_on_every_rank": "weights left unchanged",
    "test_verify_resume.py::test_a_checkpoint_of_everything_resumes_bitwise": _SAME_BY_CONSTRUCTION,
    "test_verify_resume.py::test_the_command_line": "the same world size: " + _SAME_BY_CONSTRUCTION,
    "test_adapters.py::test_checkpoint_holds_adapters_only_and_resumes_bitwise": (
        "which tensors a checkpoint holds; the resume: " + _SAME_BY_CONSTRUCTION
    ),
    # In modules marked `numerics` as a whole: what these check is not a float result of two computations
    "test_elastic.py": (
        "membership, restarts and the global batch; its float claims are test_invariant's (bitwise at any "
        "world size, in the leg) and a 1e-5 bound 50x above the measured 2e-7"
    ),
    "test_hsdp_elastic.py": (
        "a lost host under HSDP: membership, restart and resume (test_elastic's claims); resuming an HSDP "
        "checkpoint under other shapes is test_hsdp's, in the leg; its 1e-5 bound is test_elastic's"
    ),
    "test_accumulate.py::test_one_all_reduce_per_bucket_per_optimizer_step": "counts all-reduces",
    "test_adapters.py::test_an_optimizer_over_the_frozen_base_only_stops_the_first_step": (
        _REFUSAL + "; then that the adapters changed at all (not equal to their start)"
    ),
    "test_accumulate.py::test_accumulate_refuses_the_unwrapped_module": _REFUSAL,
    "test_accumulate.py::test_misuse_is_refused_with_the_fix": _REFUSAL,
    "test_comm_hooks.py::test_hooks_are_imported_only_when_asked_for": "imports",
    "test_comm_hooks.py::test_one_process_ignores_the_hook_and_says_so": _REFUSAL,
    "test_comm_hooks.py::test_options_a_hook_does_not_take_are_refused": _REFUSAL,
    "test_comm_hooks.py::test_unknown_hook_names_the_known_ones": _REFUSAL,
    "test_compile.py::test_a_cache_directory_set_before_start_is_kept_and_called_the_users": "cache directories",
    "test_compile.py::test_a_fresh_process_compiles_into_ddpkits_cache_directory": "cache directories",
    "test_compile.py::test_bench_tune_offers_compile": "the tuner's options",
    "test_compile.py::test_compile_options_are_checked_and_the_cache_directory_is_chosen": _REFUSAL,
    "test_compile.py::test_unwrap_returns_the_module_through_nested_compile_wrappers": "module identity",
    "test_compile.py::test_verify_compile_fails_when_nothing_was_compiled": "verify notices that nothing compiled",
    "test_fsdp_compile.py::test_verify_strategy_fsdp_compile_on_the_command_line": (
        "the command line's plumbing of verify under FSDP and compile, whose floor the leg checks in "
        "test_hsdp's compiled verify and test_fsdp_compile_trains_like_eager_fsdp_and_one_process_with_the_same_names"
    ),
    "test_hsdp.py::test_hsdp_resume_at_the_same_shape_is_bitwise": "the same shape: " + _SAME_BY_CONSTRUCTION,
    "test_hsdp.py::test_hsdp_checkpoint_resumes_under_another_shape_exactly": (
        "DCP reshards by copying: the loaded weights and moments equal the saved bytes (nothing trained after)"
    ),
    "test_hsdp.py::test_an_fsdp_checkpoint_resumes_under_hsdp_exactly": (
        "DCP reshards by copying: the loaded weights and moments equal the saved bytes"
    ),
    "test_hsdp.py::test_an_hsdp_background_save_holds_the_state_of_the_call": (
        "a save/load round trip: the loaded state equals the state at the call"
    ),
    "test_hsdp.py::test_an_hsdp_checkpoint_converts_to_whole_weights_for_ddp_and_one_process": (
        "conversions return the saved bytes"
    ),
    "test_hsdp.py::test_pretrained_weights_into_hsdp_shards_equal_the_file": "weights loaded from a file equal its bytes",
    "test_hsdp.py::test_verify_strategy_hsdp_on_the_command_line": (
        "the command line's plumbing of test_verify_strategy_hsdp_2x2_trains_the_weights_of_one_process (in the leg)"
    ),
    "test_compile.py::test_verify_compile_flag_on_the_command_line": (
        "the command line's plumbing of test_verify_compile_matches_one_eager_process (in the leg)"
    ),
    "test_ddp_core.py::test_batch_arithmetic_errors": _REFUSAL,
    "test_ddp_core.py::test_batch_arithmetic_is_stated": "integer batch arithmetic",
    "test_ddp_core.py::test_data_set_smaller_than_world_is_a_clear_error": _REFUSAL,
    "test_ddp_core.py::test_each_rank_sees_a_disjoint_shard_and_the_order_changes": "sample indices",
    "test_ddp_core.py::test_evaluation_shards_count_every_sample_once": "sample counts",
    "test_ddp_core.py::test_only_global_rank_zero_prints_and_collectives_agree": "printing and agreement",
    "test_ddp_core.py::test_single_process_needs_no_group_and_explains_ddp_options": _REFUSAL,
    "test_ddp_core.py::test_uneven_training_data_is_padded_like_distributed_sampler": "sample indices",
    "test_examples.py::test_sampler_and_set_epoch_duplicate_work_repeated_order_and_the_fix": "sample indices",
    "test_fsdp.py::test_dcp_metadata_reader_refuses_anything_but_dcp_classes": _REFUSAL,
    "test_fsdp.py::test_ddp_optimizer_state_loads_into_fsdp": "whether a DDP checkpoint loads, not its values",
    "test_fsdp.py::test_different_initial_weights_are_a_clear_error": _REFUSAL,
    "test_fsdp.py::test_each_model_keeps_its_own_fsdp_options": "options",
    "test_fsdp_compile.py::test_fsdp_compile_refuses_a_module_compiled_already": _REFUSAL,
    "test_fsdp_shm.py::test_fsdp_shm_off_keeps_gloo": "which collectives are used",
    "test_hf_models.py::test_a_parameter_hf_init_never_writes_is_refused_not_zeroed": _REFUSAL,
    "test_hf_models.py::test_size_rule_keeps_a_tied_embedding_with_its_head": "unit layout",
    "test_hf_models.py::test_tied_modules_split_over_two_units_is_a_clear_error": _REFUSAL,
    "test_hsdp.py::test_hsdp_options_name_the_hsdp_strategy": "options",
    "test_hsdp.py::test_impossible_degrees_are_refused_with_the_fix": _REFUSAL,
    "test_hsdp.py::test_shard_group_across_nodes_is_refused_unless_asked": _REFUSAL,
    "test_metrics.py::test_empty_metrics_and_bad_shapes": _REFUSAL,
    "test_metrics.py::test_ranks_with_different_metric_names_all_refuse": _REFUSAL,
    "test_precision.py::test_fp16_on_cpu_says_what_it_falls_back_to": _REFUSAL,
    "test_precision.py::test_precision_decision_table": "the decision table",
    "test_precision.py::test_the_loss_scale_survives_a_checkpoint_round_trip": "a round trip: the same bytes",
    "test_precision.py::test_unknown_precision_names_the_choices": _REFUSAL,
    "test_resume.py::test_negative_control_without_the_data_position_the_weights_differ": "weights differ at all",
    "test_resume.py::test_saved_weights_load_into_a_plain_model_without_ddpkit": "a round trip: the same bytes",
    "test_sharding.py::test_auto_leaves_a_small_model_whole_and_says_nothing": "the sharding decision",
    "test_sharding.py::test_auto_shards_a_model_past_the_break_even": "the sharding decision",
    "test_sharding.py::test_bad_shard_option_is_a_clear_error": _REFUSAL,
    "test_sharding.py::test_join_after_sharded_steps_is_a_clear_error": _REFUSAL,
    "test_sharding.py::test_parameters_added_after_sharded_steps_is_a_clear_error": _REFUSAL,
    "test_sharding.py::test_partition_balances_and_is_deterministic": "the partition of parameters",
    "test_sharding.py::test_rank_0_says_once_that_the_step_is_sharded": "printing",
    "test_shm_allreduce.py::test_fallback_says_why": _REFUSAL,
    "test_shm_allreduce.py::test_kill_9_of_a_peer_leaves_no_segment_and_no_hang": "clean-up after a killed peer",
    "test_shm_allreduce.py::test_stale_segments_of_dead_creators_are_removed": "clean-up of segments",
    "test_syncbn.py::test_torch_syncbatchnorm_on_cuda_ddpkit_s_elsewhere": "which module is chosen",
    "test_verify.py::test_cli_usage_error_exits_2_without_starting_ranks": _REFUSAL,
    "test_verify.py::test_ddpkit_verify_failure_explains_and_exits_1": (
        "a planted fault moves the weights orders of magnitude past the floor"
    ),
    "test_verify.py::test_spec_errors": _REFUSAL,
}


def kernel_independent(nodeid: str) -> bool:
    """Whether NOT_KERNEL_DEPENDENT lists this node id (`tests/` stripped; the file, or the test)."""
    name = nodeid.split("tests/", 1)[-1].split("[", 1)[0]
    return name in NOT_KERNEL_DEPENDENT or name.split("::")[0] in NOT_KERNEL_DEPENDENT


def quick_entry(nodeid: str) -> str | None:
    """The QUICK entry that selects this node id (`tests/` stripped), or None."""
    name = nodeid.split("tests/", 1)[-1]
    entries = {entry for wing in QUICK.values() for entry in wing}
    if name in entries:
        return name
    base = name.split("[", 1)[0]
    return base if base in entries else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if quick_entry(item.nodeid):
            item.add_marker(pytest.mark.quick)
        if kernel_independent(item.nodeid):
            item.add_marker(pytest.mark.kernel_independent)
