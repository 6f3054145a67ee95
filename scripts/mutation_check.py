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


MUTANTS = [
    Mutant(
        "compile",
        "ddpkit/parallel/compiling.py",
        "compiled = torch.compile(module, **kwargs)",
        "compiled = module",
        (
            "tests/test_compile.py::test_compile_option_trains_like_eager_ddp_with_accumulation_clipping_and_hooks",
        ),
        "s.model(compile=True) returns eager DDP",
    ),
    Mutant(
        "compile-cache",
        "ddpkit/parallel/compiling.py",
        "if not value or os.path.abspath(value) == torch_default_cache_dir():",
        "if not value:",
        ("tests/test_compile.py::test_a_fresh_process_compiles_into_ddpkits_cache_directory",),
        "torch's own /tmp cache directory taken for the user's",
    ),
    Mutant(
        "fsdp-compile",
        "ddpkit/strategy/fsdp.py",
        "                compile_block(module.get_submodule(name))",
        "                pass  # mutant: blocks never compiled",
        (
            "tests/test_fsdp_compile.py::test_fsdp_compile_trains_like_eager_fsdp_and_one_process_with_the_same_names",
        ),
        "s.model(strategy='fsdp', compile=True): no block compiled before fully_shard",
    ),
    Mutant(
        "shm-hook",
        "ddpkit/parallel/comm_hooks.py",
        "    model.register_comm_hook(state, hook)",
        "    pass  # mutant: hook never registered",
        ("tests/test_shm_allreduce.py::test_ddp_with_shm_hook_trains_the_same_weights_as_gloo",),
        'comm_hook="shm" leaves gloo\'s all-reduce in place',
    ),
    Mutant(
        "sharded-step",
        "ddpkit/step/sharding.py",
        "aside = [(p, p.grad) for p in self.foreign if p.grad is not None]",
        "aside = []",
        ("tests/test_sharding.py::test_sharded_steps_give_the_unsharded_weights_bitwise",),
        "every rank steps every parameter (same weights, no sharding)",
    ),
    Mutant(
        "no_sync",
        "ddpkit/strategy/ddp.py",
        "return ddp.no_sync() if ddp is not None else contextlib.nullcontext()",
        "return contextlib.nullcontext()",
        ("tests/test_accumulate.py::test_one_all_reduce_per_bucket_per_optimizer_step",),
        "gradients all-reduced on every micro-batch",
    ),
    Mutant(
        "syncbn-allreduce",
        "ddpkit/parallel/syncbn.py",
        "        out = tensor.clone(memory_format=torch.contiguous_format)\n"
        "        dist.all_reduce(out, group=group)\n",
        "        out = tensor.clone(memory_format=torch.contiguous_format)\n",
        ("tests/test_syncbn.py::test_sync_batchnorm_equals_batchnorm_on_the_concatenated_batch",),
        "SyncBatchNorm's statistics stay per rank",
    ),
    Mutant(
        "set_epoch",
        "ddpkit/data/loader.py",
        "            self.sampler.set_epoch(epoch)",
        "            pass  # mutant: the same shuffle every epoch",
        ("tests/test_ddp_core.py::test_each_rank_sees_a_disjoint_shard_and_the_order_changes",),
        "the sampler's shuffle never changes between epochs",
    ),
    Mutant(
        "rng-restore",
        "ddpkit/checkpoint/state.py",
        '        set_rng_state(files.decode(tree["rng"], tensors))',
        "        pass  # mutant: RNG states not restored",
        ("tests/test_checkpoint.py::test_rng_streams_continue_where_they_were_saved",),
        "s.load leaves the RNG streams where they are",
    ),
    Mutant(
        "watchdog",
        "ddpkit/cluster/lifecycle.py",
        "        watchdog.start()\n",
        "        watchdog = None  # mutant: never started\n",
        ("tests/test_faults.py::test_a_stalled_rank_fails_the_job_within_the_timeout_and_is_named",),
        "no watchdog: a timed-out collective is not turned into a report",
    ),
    Mutant(
        "shm-mean",
        "ddpkit/parallel/shm_allreduce.py",
        "torch.div(part, self.world, out=slots[self.rank, :n])",
        "slots[self.rank, :n].copy_(part)",
        ("tests/test_shm_allreduce.py::test_ddp_with_shm_hook_trains_the_same_weights_as_gloo",),
        "the shm all-reduce sums instead of averaging",
    ),
    Mutant(
        "shm-reduce-scatter",
        "ddpkit/parallel/shm_allreduce.py",
        "                if owner == self.rank:\n",
        "                if owner == -1:  # mutant: no rank sums its share\n",
        ("tests/test_shard_exchange.py::test_reduce_scatter_is_the_all_reduce_on_owned_tensors",),
        "the shm reduce-scatter leaves each rank's share unreduced",
    ),
    Mutant(
        "bench-fsdp-floor",
        "ddpkit/bench/floor.py",
        "    return 2 * all_gather + reduce_scatter\n\n\ndef fsdp_ddpkit_traffic",
        "    return all_gather + reduce_scatter  # mutant: one all-gather\n\n\ndef fsdp_ddpkit_traffic",
        ("tests/test_bench.py::test_fsdp_floor_counts_fsdp2s_copies_and_the_least_exchange",),
        "FSDP's floor counts one all-gather a step, not forward's and backward's (reshard_after_forward)",
    ),
    Mutant(
        "bench-floor",
        "ddpkit/bench/floor.py",
        "return ideal_traffic(grad_bytes, world) / (2 * copy_bps) if world > 1 else 0.0",
        "return ideal_traffic(grad_bytes, world) / copy_bps if world > 1 else 0.0  # mutant: x2",
        ("tests/test_bench.py::test_floor_is_the_least_exchange_at_copy_bandwidth",),
        "the exchange's floor counts read + written bytes at the copy rate (twice too slow a floor)",
    ),
    Mutant(
        "shard-exchange",
        "ddpkit/step/shard_exchange.py",
        "            ddp.register_comm_hook(exchange.state, defer_hook)\n            return exchange\n",
        "            return None  # mutant: DDP keeps its all-reduce\n",
        ("tests/test_shard_exchange.py::test_reduce_scatter_step_gives_the_all_reduce_weights_bitwise",),
        "the sharded step never reduce-scatters: DDP's all-reduce stays (the exchange is not active)",
    ),
    Mutant(
        "shard-gradients-opt-in",
        "ddpkit/step/stepping.py",
        'elif self.shard == "gradients" and self.device.type == "cpu":',
        'elif self.shard is not False and self.device.type == "cpu":  # mutant: on by default',
        ("tests/test_shard_exchange.py::test_reduce_scatter_step_gives_the_all_reduce_weights_bitwise",),
        "the reduce-scatter runs without being asked for (.grad between backward and step is unreduced)",
    ),
    Mutant(
        "shard-clip",
        "ddpkit/step/shard_exchange.py",
        "        dist.all_reduce(norms, group=self.group)",
        "        pass  # mutant: each rank clips by its own share's norm",
        ("tests/test_shard_exchange.py::test_reduce_scatter_step_gives_the_all_reduce_weights_bitwise",),
        "clipping after the reduce-scatter uses each rank's share's norm, not the total",
    ),
    Mutant(
        "shard-found-inf",
        "ddpkit/step/shard_exchange.py",
        "            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)",
        "            pass  # mutant: each rank's own overflow flag",
        ("tests/test_shard_exchange.py::test_fp16_overflow_seen_by_one_rank_skips_the_step_everywhere",),
        "fp16 after the reduce-scatter: a rank whose share is finite steps while another skips",
    ),
    Mutant(
        "token-rescale",
        "ddpkit/step/tokens.py",
        "        factor = world * unit / total",
        "        factor = 1.0",
        ("tests/test_tokens.py::test_proof_token_weighted_matches_one_process_and_the_naive_mean_does_not",),
        "s.backward(loss_sum, tokens=n) leaves the summed gradients unscaled",
    ),
    Mutant(
        "resume-compare",
        "ddpkit/verify/resume_compare.py",
        "    count = 0\n    if len(resumed) != len(full):",
        "    return 0, None\n    if len(resumed) != len(full):",
        ("tests/test_verify_resume.py::test_a_forgotten_scheduler_is_named",),
        "verify --resume compares nothing",
    ),
    Mutant(
        "lint-iterable",
        "ddpkit/lint/rules_data.py",
        "        if not _split_outside(script, cls):",
        "        if False:  # mutant: DDP013 never reports",
        ("tests/test_lint_new_rules.py::test_iterable_dataset_read_whole_by_every_rank",),
        "ddpkit lint: an IterableDataset every rank reads whole is not reported (DDP013)",
    ),
    Mutant(
        "lint-reentrant",
        "ddpkit/lint/rules_model.py",
        "        how = _reentrant(script, call)",
        '        how = ""  # mutant: DDP014 never reports',
        ("tests/test_lint_new_rules.py::test_reentrant_checkpointing_under_ddp",),
        "ddpkit lint: reentrant activation checkpointing under DDP is not reported (DDP014)",
    ),
    Mutant(
        "lint-tokens",
        "ddpkit/lint/rules_loop.py",
        '        elif script.session_call(call, "backward") and kwarg(call, "tokens") is not None:',
        "        elif False:  # mutant: s.backward(loss_sum, tokens=n) read as a summed loss again",
        (
            "tests/test_lint_docs.py::test_no_finding_on_what_the_docs_recommend[README.md]",
            "tests/test_lint_new_rules.py::test_the_recommended_token_weighted_line_is_not_a_summed_loss",
        ),
        "ddpkit lint: the README's token-weighted line reported as DDP003 again",
    ),
    Mutant(
        "launcher-signal",
        "ddpkit/cluster/launch.py",
        'handled = dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", preempt])',
        'handled = dict.fromkeys(["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"])',
        ("tests/test_preemption.py::test_the_preemption_signal_sent_to_ddpkit_run_saves_and_ends_with_75",),
        "torchrun's agent does not handle the preemption signal: USR2 (as asked) kills `ddpkit run`",
    ),
    Mutant(
        "grace",
        "ddpkit/cli.py",
        '"grace": ns.grace,',
        '"grace": 30.0,',
        (
            "tests/test_preemption.py::test_a_save_longer_than_grace_is_cut_off_and_the_previous_checkpoint_stays",
        ),
        "`ddpkit run --grace S` ignored (the default 30 s)",
    ),
    Mutant(
        "agree-interval",
        "ddpkit/cluster/preemption.py",
        "        return max(1, min(wanted, int(MAX_LATENCY_S / self._step), MAX_INTERVAL))",
        "        return 1",
        (
            "tests/test_preemption.py::test_agreeing_costs_one_all_reduce_every_k_calls_and_a_scheduled_save_agrees_at_once",
        ),
        "the preemption flag is all-reduced on every s.save call, whatever it costs",
    ),
    Mutant(
        "agree-latency",
        "ddpkit/cluster/preemption.py",
        "        return max(1, min(wanted, int(MAX_LATENCY_S / self._step), MAX_INTERVAL))",
        "        return max(1, min(wanted, MAX_INTERVAL))",
        ("tests/test_preemption.py::test_a_stop_is_seen_within_about_a_second_however_dear_the_agreement",),
        "no latency bound: dear agreements are spaced seconds apart",
    ),
    Mutant(
        "preempted-is-failure",
        "ddpkit/cluster/failures.py",
        "    if stopped_cleanly(exc):\n        return",
        "    if False:\n        return",
        ("tests/test_routes.py::test_a_clean_preemption_is_not_recorded_as_a_failure",),
        "a preemption that saved (exit 75) is recorded by cluster.failures as a failure",
    ),
    Mutant(
        "signal-numbers",
        "ddpkit/cluster/signals.py",
        "None) if text.isalnum() else None",
        "None) if text.isalpha() else signal.Signals(int(text))",
        ("tests/test_routes.py::test_one_rule_for_a_signal_name_in_the_launcher_and_the_ranks",),
        'a signal number ("10": SIGUSR1 here, SIGBUS elsewhere) is accepted as a preemption signal',
    ),
    Mutant(
        "stop-at-step",
        "ddpkit/training/session.py",
        "            self._checkpoints.stepped(info.stepped)",
        "            pass",
        (
            "tests/test_preemption.py::test_every_save_idiom_is_saved_at_the_stop_and_resumes_bitwise[if-TERM]",
            "tests/test_preemption.py::test_an_accumulating_step_loop_is_stopped_at_an_optimizer_step_not_at_a_batch",
        ),
        "s.step never agrees on a preemption stop nor counts its steps: an accumulating loop is stopped by "
        "the plain loop's rule (a step a batch), its checkpoint a step ahead of its weights",
    ),
    Mutant(
        "stop-at-next-batch",
        "ddpkit/data/loader.py",
        "                self.boundary(body)",
        "                pass",
        (
            "tests/test_preemption.py::test_every_save_idiom_is_saved_at_the_stop_and_resumes_bitwise[if-TERM]",
        ),
        "the loader's next batch is no stop boundary: the stop saves at s.backward, a batch too far",
    ),
    Mutant(
        "stop-at-plain-batch",
        "ddpkit/checkpoint/checkpoints.py",
        "                    self._preemption.agree(self._ctx.distributed, self._ctx.device)",
        "                    pass",
        (
            "tests/test_preemption.py::test_every_save_idiom_is_saved_at_the_stop_and_resumes_bitwise[plain-if-TERM]",
        ),
        "the loader's next batch never agrees on a stop: the README's first loop (opt.step(), no s.step) "
        "saving under `if step % N == 0` runs on past the signal to its next periodic save",
    ),
    Mutant(
        "stop-plain-after-save",
        "ddpkit/checkpoint/checkpoints.py",
        "        self._saved = True  # this call agrees",
        "        pass  # this call agrees",
        (
            "tests/test_preemption.py::test_a_plain_loop_stops_at_the_loaders_next_batch_with_its_steps_counted",
        ),
        "a plain loop's stop counts the batch after a save's body again (the save reset the count after "
        "its step): `step` saved one too high",
    ),
    Mutant(
        "stop-plain-new-epoch",
        "ddpkit/checkpoint/checkpoints.py",
        "self._steps_since += body  #",
        "self._steps_since += 1  #",
        (
            "tests/test_preemption.py::test_a_plain_loop_stops_at_the_loaders_next_batch_with_its_steps_counted",
        ),
        "a plain loop's stop counts a new epoch's first batch as a step (no body ran before it)",
    ),
    Mutant(
        "stop-step-advanced",
        "ddpkit/checkpoint/checkpoints.py",
        '"step": step + self._steps_since',
        '"step": step',
        (
            "tests/test_preemption.py::test_every_save_idiom_is_saved_at_the_stop_and_resumes_bitwise[if-TERM]",
        ),
        "the stop saves the remembered `step` as it was given to s.load, not advanced by the steps since",
    ),
    Mutant(
        "nothing-to-save",
        "ddpkit/cluster/preemption.py",
        "            if self.remedy and not stopping:",
        "            if False:  # mutant: the remedy is never said",
        ("tests/test_preemption.py::test_a_script_that_never_gave_its_state_is_told_what_to_add",),
        "a script that never gave ddpkit its state is not told what to add at a signal",
    ),
    Mutant(
        "signalled-mark",
        "ddpkit/cluster/launch.py",
        "                marker.touch()",
        "                pass",
        (
            "tests/test_preemption.py::test_every_save_idiom_is_saved_at_the_stop_and_resumes_bitwise[if-TERM]",
        ),
        "`ddpkit run` never marks that it was signalled: the ranks take its SIGTERM for the agent's stop",
    ),
    Mutant(
        "survivor-stop",
        "ddpkit/cluster/preemption.py",
        "        while not marker.exists():",
        "        while False:  # mutant: every SIGTERM under ddpkit run is a preemption",
        (
            "tests/test_background_save.py::test_a_crash_during_a_background_write_leaves_the_previous_checkpoint[ddp-thread]",
        ),
        "the survivors of a failed rank take the agent's SIGTERM for a preemption and live on until its "
        "SIGKILL",
    ),
    Mutant(
        "elastic-auto",
        "ddpkit/data/batching.py",
        'mode = "per-rank" if accumulation > 1 else "accumulation"',
        'mode = "per-rank"',
        (
            "tests/test_launch.py::test_an_elastic_job_below_its_largest_size_keeps_the_global_batch[auto-plain-1-8]",
            "tests/test_launch.py::test_an_elastic_job_below_its_largest_size_keeps_the_global_batch[auto-step-1-8]",
        ),
        "elastic below the largest size always accumulates more: a loop without s.accumulate fails or "
        "(the README's first loop) trains at half the global batch",
    ),
    Mutant(
        "bg-optimizer-staging",
        "ddpkit/checkpoint/write.py",
        "dcp_state = checkpoint_dcp.stage(dcp_state, stage) if copy else dcp_state",
        "dcp_state = {k: checkpoint_dcp.stage(v, stage) if k == sharded[0][0] else v\n"
        "                     for k, v in dcp_state.items()}",
        (
            "tests/test_background_fsdp.py::test_a_background_fsdp_save_loads_the_weights_and_optimizer_state_of_the_call",
        ),
        "an FSDP background save copies the model only; the writer thread saves the live optimizer state",
    ),
    Mutant(
        "dead-rank-first",
        "ddpkit/cluster/run_report.py",
        "        return (0, failure_time(failure))  # killed from outside",
        "        return (1, failure_time(failure))  # mutant: a killed rank ranks like one that raised",
        ("tests/test_run_reports.py::test_a_rank_killed_from_outside_is_named_before_the_peer_it_broke",),
        "the report names the earliest error file, not the rank killed from outside",
    ),
    Mutant(
        "restart-report",
        "ddpkit/cluster/run_report.py",
        "            if result.failures:\n                print(restart_line(",
        "            if False:  # mutant: restarts are silent\n                print(restart_line(",
        ("tests/test_run_reports.py::test_each_restart_names_the_rank_that_died_first",),
        "no line per restart naming the rank that died first",
    ),
    Mutant(
        "tracker-auto",
        "ddpkit/observe/tracking.py",
        'names = ("tensorboard",) if importlib.util.find_spec("tensorboard") else ()',
        "names = ()",
        ("tests/test_tracking.py::test_by_default_a_session_logs_to_tensorboard_when_it_is_installed",),
        'log_to="auto" (the default) never picks TensorBoard',
    ),
    Mutant(
        "tracker-resume",
        "ddpkit/observe/tracking.py",
        "purge_step=resume_at)",
        "purge_step=None)",
        (
            "tests/test_tracking.py::test_tensorboard_events_read_back_and_a_resumed_session_replaces_the_points_after_its_start",
        ),
        "a resumed session's TensorBoard points are appended after the old run's, not replacing them",
    ),
    Mutant(
        "fork-threads",
        "ddpkit/cluster/spawn.py",
        '        1\n        if method == "fork"',
        '        2\n        if method == "fork"',
        ("tests/test_notebooks.py::test_forked_ranks_run_one_thread_whatever_omp_num_threads_says",),
        "forked ranks (functions from notebook cells) run two threads",
    ),
    Mutant(
        "fork-threads-refusal",
        "ddpkit/cluster/spawn.py",
        "    if threads is not None and threads > 1:",
        "    if False:  # mutant: threads>1 with fork accepted",
        ("tests/test_notebooks.py::test_forked_ranks_refuse_more_than_one_thread_with_the_fix",),
        "spawn(threads=2) with forked ranks is accepted (and hangs in GNU OpenMP)",
    ),
    Mutant(
        "progress-time",
        "ddpkit/observe/progress.py",
        " or now - self.last_line >= self.every_s",
        "",
        ("tests/test_progress.py::test_a_run_of_unknown_length_logs_a_line_every_every_s_seconds",),
        "no time-based progress line (only tenths of a known total)",
    ),
    Mutant(
        "progress-bar-on-terminal",
        "ddpkit/observe/progress.py",
        "        if is_terminal(*([stream] if stream else [])):",
        "        if False:  # mutant: plain lines on a terminal too",
        ("tests/test_progress.py::test_on_a_terminal_the_bar_refreshes_in_place",),
        "fit on a terminal prints plain progress lines instead of tqdm's bar",
    ),
    Mutant(
        "fsdp-whole-build",
        "ddpkit/strategy/fsdp.py",
        "        module, shards, peak = fsdp_init.build(factory, *self.shard_index())\n",
        "        return factory()  # mutant: every rank builds the whole model\n"
        "        module, shards, peak = fsdp_init.build(factory, *self.shard_index())\n",
        ("tests/test_fsdp_init.py::test_no_rank_ever_holds_the_whole_model_measured_by_the_kernel",),
        "s.model(factory, strategy='fsdp') builds the whole model on every rank, then shards it",
    ),
    Mutant(
        "elastic-per-rank",
        "ddpkit/data/batching.py",
        "    scaled = accumulation * (most // world_size)",
        "    scaled = accumulation",
        ("tests/test_launch.py::test_an_elastic_job_below_its_largest_size_keeps_the_global_batch",),
        "an elastic job below its largest size does not accumulate more (the per-rank default)",
    ),
    Mutant(
        "elastic-batch-accumulation",
        "ddpkit/data/batching.py",
        '    if mode != "per-rank":\n        return accumulation, (',
        "    if False:  # mutant: --elastic-batch accumulation ignored\n        return accumulation, (",
        (
            "tests/test_launch.py::test_an_elastic_job_below_its_largest_size_keeps_the_global_batch[accumulation-accumulate-1-8]",
        ),
        "`ddpkit run --elastic-batch accumulation` ignored (per-rank batch kept, more accumulation)",
    ),
    Mutant(
        "test-leak-cleanup",
        "tests/conftest.py",
        "        for pid in pids:\n            with contextlib.suppress(ProcessLookupError, Permission",
        "        for pid in []:  # mutant: only the launcher's group is killed\n"
        "            with contextlib.suppress(ProcessLookupError, Permission",
        ("tests/test_launch.py::test_a_timed_out_launch_leaves_no_worker_behind",),
        "the tests' run_cli kills only the launcher's group on a timeout (torchrun's workers live on)",
    ),
    Mutant(
        "suite-longest-first-off",
        "tests/conftest.py",
        '    return max(pending, key=lambda scope: seconds.get(Path(scope.split("::")[0]).name, default))',
        "    return pending[0]  # mutant: xdist's own order (most tests first)",
        (
            "tests/test_ci_selection.py::test_the_workers_take_the_longest_modules_first_and_the_table_names_real_modules",
        ),
        "the suite's workers take modules in xdist's order, the longest few-test modules last",
    ),
    Mutant(
        "resume-bitwise",
        "ddpkit/verify/resume.py",
        "        if not report.bitwise:  # rounding of another shape, no resume\n",
        "        if True:  # mutant: within the tolerance, whatever the report says\n",
        ("tests/test_verify_resume.py::test_a_checkpoint_of_everything_resumes_bitwise",),
        "verify --resume at the same world size compares within a tolerance, not bit for bit",
    ),
    Mutant(
        "hf-init",
        "ddpkit/strategy/hf.py",
        "setattr(utils, _DEVICE_QUESTION, lambda: None)",
        "setattr(utils, _DEVICE_QUESTION, original)",
        ("tests/test_hf_models.py::test_initial_weights_are_one_process_weights_under_every_build[gpt2]",),
        "FSDP's shard-by-shard build lets transformers skip its own initialisation on meta",
    ),
    Mutant(
        "hf-tied-cut",
        "ddpkit/strategy/fsdp_init.py",
        "setattr(module.get_submodule(name), other, shared)",
        "pass",
        ("tests/test_hf_models.py::test_initial_weights_are_one_process_weights_under_every_build[gpt2]",),
        "a model built whole loses its tied weights when cut into shards",
    ),
    Mutant(
        "hf-tied-units",
        "ddpkit/strategy/fsdp.py",
        "if not outside and sum(p.numel() for p in free) >= opts.min_block_params:",
        "if sum(p.numel() for p in free) >= opts.min_block_params:",
        ("tests/test_hf_models.py::test_size_rule_keeps_a_tied_embedding_with_its_head",),
        "the size rule puts a tied embedding and its head in two FSDP units",
    ),
    Mutant(
        "hf-export-dir",
        "ddpkit/strategy/hf.py",
        "if not is_hf(inner) or target.suffix",
        "if True or target.suffix",
        (
            "tests/test_hf_models.py::test_token_weighted_training_matches_one_process_and_exports[gpt2-fsdp-False]",
        ),
        "s.export of an HF model to a directory writes no from_pretrained layout",
    ),
    Mutant(
        "weights-rows",
        "ddpkit/strategy/weights.py",
        "        if stop > start:\n            local.copy_(",
        "        if False:\n            local.copy_(",
        ("tests/test_hf_weights.py::test_loaded_weights_equal_the_checkpoint[gpt2-fsdp-None]",),
        "s.model(weights=) under FSDP leaves the shards at their initial values",
    ),
    Mutant(
        "weights-ddp",
        "ddpkit/strategy/building.py",
        "and not chosen.shards_state and first:",
        "and not chosen.shards_state and not first:",
        ("tests/test_hf_weights.py::test_loaded_weights_equal_the_checkpoint[llama-ddp-None]",),
        "s.model(weights=) under DDP reads on a rank other than the one DDP broadcasts from",
    ),
    Mutant(
        "recompute",
        "ddpkit/strategy/building.py",
        "    if recompute is not None:  # before DDP/FSDP",
        "    if False:  # before DDP/FSDP",
        (
            "tests/test_activation_checkpointing.py::test_recomputed_blocks_train_bitwise_the_same_weights[ddp]",
        ),
        "s.model(activation_checkpointing=Block) recomputes nothing",
    ),
    Mutant(
        "recompute-units",
        "ddpkit/strategy/fsdp.py",
        "chosen = list(dict.fromkeys(checkpointing.unit_name(n) for n in found))",
        "chosen = list(dict.fromkeys(found))",
        (
            "tests/test_activation_checkpointing.py::test_recomputed_blocks_train_bitwise_the_same_weights[fsdp]",
        ),
        "FSDPOptions(blocks=) shards the block inside its checkpoint wrapper instead of the wrapper",
    ),
    Mutant(
        "recompute-reentrant",
        "ddpkit/strategy/checkpointing.py",
        "checkpoint_impl=CheckpointImpl.NO_REENTRANT",
        "checkpoint_impl=CheckpointImpl.REENTRANT",
        ("tests/test_activation_checkpointing.py::test_a_block_fed_the_raw_batch_still_trains",),
        "activation checkpointing with the reentrant implementation",
    ),
    Mutant(
        "hf-unwritten",
        "ddpkit/strategy/hf.py",
        "    if not never_written or not is_hf(module):",
        "    if True:",
        ("tests/test_hf_models.py::test_a_parameter_hf_init_never_writes_is_refused_not_zeroed",),
        "an HF model's parameter its init never wrote is silently zeros under FSDP",
    ),
    Mutant(
        "stream-workers",
        "ddpkit/data/streams.py",
        "            if j % workers == worker:",
        "            if True:  # mutant: every worker yields every batch of its rank",
        ("tests/test_data_streams.py::test_every_id_once_per_epoch_equal_batches_any_worker_count",),
        "an iterable source is not split over DataLoader workers (each worker reads the rank's whole part)",
    ),
    Mutant(
        "stream-position",
        "ddpkit/data/loader.py",
        "            self.loader = self._make_pass(epoch, skip)",
        "            self.loader = self._make_pass(epoch, 0)  # mutant: the stream restarts its epoch",
        ("tests/test_data_streams.py::test_stopped_mid_epoch_and_resumed_ends_bitwise_like_uninterrupted",),
        "a resumed iterable source re-reads its epoch from the first sample",
    ),
    Mutant(
        "stream-equalise",
        "ddpkit/data/loader.py",
        "            batches = equalised(batches, self.device)",
        "            pass  # mutant: a pre-split rank's pass ends when its own part does",
        ("tests/test_data_hf.py::test_uneven_shards_end_every_rank_at_the_shortest_ranks_last_batch",),
        "ranks of a pre-split stream end their epochs at different batches (the longer ones would hang)",
    ),
    Mutant(
        "presplit-detect",
        "ddpkit/data/sources.py",
        'return "presplit" if getattr(source, "_distributed", None) is not None or presplit else "hf"',
        'return "hf"  # mutant: a stream split by split_dataset_by_node is split again',
        ("tests/test_data_hf.py::test_streaming_every_id_once_per_epoch",),
        "a Hugging Face stream already split per rank is split a second time",
    ),
    Mutant(
        "stateful-per-rank",
        "ddpkit/checkpoint/state.py",
        "    return isinstance(obj, (ShardedLoader, torch.Generator)) or stream_position(obj)\n",
        "    return isinstance(obj, (ShardedLoader, torch.Generator))  # mutant\n",
        ("tests/test_data_hf.py::test_a_stateful_dataloader_resumes_at_each_ranks_own_position",),
        "a StatefulDataLoader's position is saved by rank 0 and loaded into every rank",
    ),
    Mutant(
        "sampler-share",
        "ddpkit/data/samplers.py",
        "            rank=self.rank,\n",
        "            rank=0,\n",
        ("tests/test_data_samplers.py::test_each_rank_takes_its_share_of_the_global_order",),
        "every rank reads rank 0's share of the user's sampler order",
    ),
    Mutant(
        "presplit-map",
        "ddpkit/data/sources.py",
        '        return "presplit" if presplit else "map"',
        '        return "map"  # mutant: presplit=True ignored, the part is split again',
        ("tests/test_data_hf.py::test_map_style_every_id_once_per_epoch",),
        "a map-style part declared presplit=True is split over the ranks again",
    ),
    Mutant(
        "verify-stream",
        "ddpkit/verify/run.py",
        "        interleaved = loader.sampler is not None",
        "        interleaved = True  # mutant: verify expects DistributedSampler's split of a stream",
        ("tests/test_data_streams.py::test_verify_reads_an_iterable_data_source",),
        "verify's single process expects the interleaved split of an iterable --data",
    ),
    Mutant(
        "batch-sampler-part",
        "ddpkit/data/samplers.py",
        "            start = self.rank * base + min(self.rank, extra)",
        "            start = 0  # mutant: every rank takes the first part of each global batch",
        ("tests/test_data_samplers.py::test_a_batch_sampler_gives_each_rank_its_part_of_every_global_batch",),
        "every rank reads the first part of each of the user's batch sampler's batches",
    ),
    Mutant(
        "flops-count",
        "ddpkit/observe/monitor.py",
        "        self.flops_per_step = float(flops * self.accumulation) if flops > 0 else None",
        "        self.flops_per_step = None  # mutant: the counted FLOPs are dropped (no FLOP/s, no MFU)",
        ("tests/test_anatomy.py::test_fit_shows_mfu_and_counts_flops",),
        "fit counts no model FLOPs: no FLOP/s and no MFU in the progress line and the logs",
    ),
    Mutant(
        "anatomy-sync",
        "ddpkit/observe/anatomy.py",
        "        if i == _BACKWARD and self._cursor < self._last_grad <= now:",
        "        if False:  # mutant: the sync wait stays inside backward",
        (
            "tests/test_anatomy.py::test_anatomy_marks_split_backward_at_the_last_gradient",
            "tests/test_anatomy.py::test_slow_rank_named_with_its_cause",
        ),
        "backward is not split at the last gradient: no gradient-sync wait measured",
    ),
    Mutant(
        "slow-rank-cause",
        "ddpkit/observe/slowrank.py",
        "        cause = max(mine, key=lambda k: mine[k] - median(t[k] for t in theirs))",
        '        cause = "compute"  # mutant: every slow rank is blamed on its compute',
        ("tests/test_anatomy.py::test_slow_rank_named_with_its_cause",),
        "a slow rank's cause is always compute, whatever phase its time goes to",
    ),
    Mutant(
        "slow-rank-threshold",
        "ddpkit/observe/slowrank.py",
        '        limit = max(self.absolute_s, self.relative * median(row["step"] for row in others))',
        "        limit = 0.0  # mutant: any difference between ranks is a slow rank",
        ("tests/test_anatomy.py::test_detector_thresholds_and_persistence",),  # pure rules: not the noise
        "no relative or absolute threshold: noise on a balanced run names a slow rank",
    ),
    Mutant(
        "rank-scalars",
        "ddpkit/observe/slowrank.py",
        '            f"anatomy/rank{r}/{name}_ms": row[name] * 1e3',
        '            f"anatomy/{name}_ms": row[name] * 1e3  # mutant: the ranks overwrite each other',
        ("tests/test_anatomy.py::test_slow_rank_named_with_its_cause",),
        "the trackers get one anatomy/<phase>_ms per phase, not one per rank",
    ),
    Mutant(
        "trace-ranks",
        "ddpkit/tools/trace.py",
        "    if ns.ranks:",
        "    if False:  # mutant: --ranks ignored",
        ("tests/test_anatomy.py::test_trace_ranks_draws_every_rank_and_names_the_planted_one",),
        "`ddpkit trace --ranks` draws the one-step timeline instead of the ranks side by side",
    ),
    Mutant(
        "session-anatomy",
        "ddpkit/training/session.py",
        "        self.anatomy.stepped(info.stepped)  # the optimizer phase; a step when it applied",
        "        pass  # mutant: s.step records no step",
        ("tests/test_anatomy.py::test_a_hand_loop_gets_its_steps_anatomy_through_the_session",),
        "s.step ends no step of the anatomy: a hand loop's medians stay empty",
    ),
    Mutant(
        "invariant-tree",
        "ddpkit/step/chunktree.py",
        "        while self._stack and self._stack[-1][0] == size:",
        "        while self._stack:  # mutant: a running sum, whose order depends on where the ranks cut it",
        ("tests/test_invariant.py::test_mlp_cnn_and_gpt_train_the_same_weights_on_1_2_and_4_ranks",),
        "reproducible='any-world' sums the chunks' gradients left to right instead of in the fixed tree",
    ),
    Mutant(
        "invariant-guard",
        "ddpkit/step/invariant.py",
        "        ddp.register_comm_hook(None, refuse)",
        "        pass  # mutant: DDP's all-reduce runs silently in reproducible='any-world'",
        (
            "tests/test_invariant.py::test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal",
        ),
        "a loss.backward() through the DDP model in reproducible='any-world' trains an ordinary DDP run",
    ),
    Mutant(
        "late-signal-exit",
        "ddpkit/cluster/launch.py",
        "        if ends.codes and all(code == 0 for code in ends.codes):",
        "        if False:  # mutant: a finished run signalled at its end is reported as stopped (143)",
        ("tests/test_preemption.py::test_a_signal_that_arrives_as_the_run_ends_is_no_failure",),
        "a run that finished as a SIGTERM arrived ends 143: a scheduler takes finished work for lost",
    ),
    Mutant(
        "invariant-anatomy",
        "ddpkit/step/invariant.py",
        "        self.phases.stepped(True)\n",
        "        pass  # mutant: s.invariant.step never reaches the step anatomy\n",
        (
            "tests/test_invariant.py::test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal",
        ),
        "an any-world loop shows no steps to StepMonitor, MFU or the slow-rank report",
    ),
    Mutant(
        "invariant-refuse-step",
        "ddpkit/step/stepping.py",
        '        self._refuse_in_invariant_mode("s.step(opt)")\n',
        "",
        (
            "tests/test_invariant.py::test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal",
        ),
        "s.step(opt) in reproducible='any-world' steps with DDP's gradients without a word",
    ),
    Mutant(
        "invariant-slices",
        "ddpkit/step/invariant.py",
        "        mine = combine(list(slices.view(self.world, width)), fresh=True)",
        "        mine = slices.view(self.world, width).sum(0)  # mutant: torch's sum order, not the tree",
        ("tests/test_invariant.py::test_mlp_cnn_and_gpt_train_the_same_weights_on_1_2_and_4_ranks",),
        "reproducible='any-world' sums the ranks' partial sums in torch's order, not the fixed tree",
    ),
    Mutant(
        "invariant-chunk-seed",
        "ddpkit/step/invariant.py",
        "            torch.manual_seed(_chunk_seed(self.seed, self.counters.steps, index))",
        "            pass  # mutant: dropout draws from the rank's own stream",
        ("tests/test_invariant.py::test_mlp_cnn_and_gpt_train_the_same_weights_on_1_2_and_4_ranks",),
        "reproducible='any-world' no longer seeds each chunk's random draws by its global index",
    ),
    Mutant(
        "invariant-batchnorm",
        "ddpkit/step/invariant.py",
        "        if isinstance(sub, nn.modules.batchnorm._BatchNorm):",
        "        if False:  # mutant: BatchNorm accepted",
        ("tests/test_invariant.py::test_batchnorm_fp16_accumulation_and_a_ragged_tree_are_refused",),
        "reproducible='any-world' accepts BatchNorm, whose statistics depend on the chunking",
    ),
    Mutant(
        "verify-bitwise",
        "ddpkit/verify/bitwise.py",
        "            if outputs.get(key, (None, None, None))[2] != digest:",
        "            if False:  # mutant: module outputs never compared",
        (
            "tests/test_invariant.py::test_verify_bitwise_passes_an_mlp_with_dropout_and_names_a_layer_with_its_own_generator",
        ),
        "verify --bitwise no longer names the first module whose output differs (only gradients and weights)",
    ),
    Mutant(
        "invariant-sampler",
        "ddpkit/step/invariant.py",
        '        options["sampler"] = global_order(dataset, shuffle)',
        "        pass  # mutant: DistributedSampler's interleaved split, not contiguous chunks",
        (
            "tests/test_invariant.py::test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal",
        ),
        "s.loader in reproducible='any-world' keeps DistributedSampler's split (rank r: rows r, r+W, ...)",
    ),
    Mutant(
        "invariant-resume",
        "ddpkit/step/invariant.py",
        '        self.counters.steps = state["steps"]',
        "        pass  # mutant: the step counter (the chunks' seeds) restarts at 0 after s.load",
        (
            "tests/test_invariant.py::test_the_session_option_is_invariant_and_a_run_resumed_on_fewer_ranks_ends_bitwise_equal",
        ),
        "s.load(invariant=s.invariant) leaves the mode's step counter at 0",
    ),
    Mutant(
        "verify-shard-path",
        "ddpkit/verify/run.py",
        '    shard = "auto" if spec.shard_optimizer is None else spec.shard_optimizer',
        '    shard = "auto"  # mutant: the N-rank side never asks for the path under test',
        ("tests/test_verify.py::test_the_sharded_step_and_its_reduce_scatter_train_one_process_weights",),
        "verify --shard-optimizer gradients passes without the reduce-scatter having run",
    ),
    Mutant(
        "cpu-allocator-keep",
        "ddpkit/parallel/cpu_allocator.py",
        '        ok = libc.mallopt(_M_MMAP_MAX, int(env.get("MALLOC_MMAP_MAX_", 0))) == 1',
        "        ok = True  # mutant: big blocks stay mmapped, faulted in again at every step",
        (
            "tests/test_cpu_allocator.py::test_a_model_with_big_tensors_reuses_blocks_instead_of_faulting_them_in",
        ),
        "a big model's freed blocks go back to the kernel and are faulted in at every step",
    ),
    Mutant(
        "cpu-allocator-heap-top",
        "ddpkit/parallel/cpu_allocator.py",
        "        _keep_heap_top()\n",
        "        pass  # mutant: glibc trims the heap's top after each step, faulted in again at the next\n",
        ("tests/test_cpu_allocator.py::test_a_small_model_keeps_the_top_of_its_heap_between_steps",),
        "a small model's freed top of the heap is given back to the kernel and faulted in at every step",
    ),
    Mutant(
        "fsdp-shm-setters",
        "ddpkit/parallel/fsdp_shm.py",
        "        module.set_custom_all_gather(ShmAllGather())\n"
        "        module.set_custom_reduce_scatter(ShmReduceScatter())",
        "        pass  # mutant: FSDP2 keeps its own gloo collectives while the note says shared memory",
        ("tests/test_fsdp_shm.py::test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas[1]",),
        "FSDPOptions(shm='auto') prints the shared-memory note but never hands FSDP2 the collectives",
    ),
    Mutant(
        "fsdp-shm-rs-own",
        "ddpkit/parallel/shm_allreduce.py",
        "            self._sum_slots(slots, lo, hi, out[start : start + n])",
        "            torch.mul(slots[self.rank, lo:hi], w, out=out[start : start + n])",
        (
            "tests/test_fsdp_shm.py::test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas[1]",
            "tests/test_fsdp_shm.py::test_shm_reduce_scatter_and_all_gather_are_exact",
        ),
        "FSDP's reduce-scatter over shared memory keeps each rank's own gradient, not the ranks' sum",
    ),
    Mutant(
        "fsdp-shm-ag-others",
        "ddpkit/parallel/shm_allreduce.py",
        "        self.all_gather_([[rows[r]] for r in range(self.world)])",
        "        self.all_gather_([[rows[r]] if r == self.rank else [] for r in range(self.world)])",
        (
            "tests/test_fsdp_shm.py::test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas[1]",
            "tests/test_fsdp_shm.py::test_shm_reduce_scatter_and_all_gather_are_exact",
        ),
        "FSDP's all-gather over shared memory publishes this rank's part but never copies in the others'",
    ),
    Mutant(
        "fsdp-shm-gather-region",
        "ddpkit/parallel/fsdp_shm.py",
        "        at = self._handed % 2\n",
        "        at = (self._handed + self.shm.rank) % 2  # mutant: ranks disagree\n",
        ("tests/test_fsdp_shm.py::test_all_gather_output_in_shared_memory_gives_the_slots_bytes",),
        "the all-gather output in shared memory: each rank writes its shard where the others do not read",
    ),
    Mutant(
        "fsdp-shm-gather-held",
        "ddpkit/parallel/fsdp_shm.py",
        "        if vote.item() > 0:",
        "        if False:  # mutant: a region handed out again while a rank still holds its last output",
        ("tests/test_fsdp_shm.py::test_shared_all_gather_output_grows_and_takes_explicit_prefetching[3]",),
        "FSDP's shared all-gather output overwritten while a deep prefetch has not copied it out yet",
    ),
    Mutant(
        "fsdp-shm-keep-held",
        "ddpkit/parallel/fsdp_shm.py",
        "        free = [buf for buf in same if _use_count(buf) <= 2]",
        "        free = same  # mutant: a kept buffer is handed out again while FSDP2 still holds it",
        ("tests/test_fsdp_shm.py::test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas[1]",),
        "FSDP's kept buffers reused while a gradient or a prefetched all-gather still lives in them",
    ),
    Mutant(
        "fsdp-shm-close",
        "ddpkit/strategy/building.py",
        "    on_close.callback(chosen.close)",
        "    pass  # mutant: the strategy's shared-memory segment stays mapped after the session",
        ("tests/test_fsdp_shm.py::test_fsdp_over_shm_trains_gloo_fsdp_weights_with_identical_replicas[1]",),
        "FSDP's shared-memory segment outlives the session that mapped it",
    ),
    Mutant(
        "fsdp-shm-default",
        "ddpkit/strategy/fsdp_options.py",
        '    shm: bool | str = "auto"',
        "    shm: bool | str = False",
        ("tests/test_fsdp_shm.py::test_verify_fsdp_passes_with_the_shm_path_on",),
        "strategy='fsdp' on CPU ranks of one machine keeps gloo unless shm=True is asked for",
    ),
    Mutant(
        "restart-global-rank",
        "ddpkit/cluster/run_report.py",
        'f"ddpkit run: restart {restart} of {budget}: rank {rank} (local rank {first.local_rank} on host "',
        'f"ddpkit run: restart {restart} of {budget}: rank {first.local_rank} '
        '(local rank {first.local_rank} on host "',
        ("tests/test_run_reports.py::test_a_restart_on_the_second_node_names_the_rank_by_its_global_rank",),
        "the restart line names the failed rank by its local rank (wrong on every node but the first)",
    ),
    Mutant(
        "hf-trunc-normal",
        "ddpkit/strategy/hf.py",
        "        table[n] = replay(fn)",
        "        pass  # mutant: transformers' captured trunc_normal_ & co. stay no-ops on meta",
        (
            "tests/test_hf_models.py::test_a_vits_trunc_normal_init_is_one_process_weights_under_the_shard_by_shard_build",
        ),
        "FSDP's shard-by-shard build of a ViT leaves its trunc_normal_ init undone (other initial weights)",
    ),
    Mutant(
        "flops-accumulation",
        "ddpkit/observe/monitor.py",
        "        self.flops_per_step = float(flops * self.accumulation) if flops > 0 else None",
        "        self.flops_per_step = float(flops) if flops > 0 else None  # mutant: one micro-batch a step",
        (
            "tests/test_anatomy.py::test_flops_per_optimizer_step_count_every_micro_batch_of_an_accumulating_step",
        ),
        "FLOPs per optimizer step count one micro-batch: FLOP/s and MFU k times too low under accumulation",
    ),
    Mutant(
        "recompute-rng",
        "ddpkit/strategy/checkpointing.py",
        "checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),",
        "checkpoint_wrapper_fn=partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT,"
        " preserve_rng_state=False),",
        ("tests/test_activation_checkpointing.py::test_a_recompute_draws_the_forwards_dropout_masks",),
        "activation checkpointing's recompute draws new dropout masks (other gradients, other weights)",
    ),
    Mutant(
        "stream-position-rank0",
        "ddpkit/checkpoint/state.py",
        "    json_name, tensor_name = rank_files(rank if own else 0)",
        "    json_name, tensor_name = rank_files(0)  # mutant: every rank loads rank 0's state",
        ("tests/test_data_hf.py::test_a_stateful_dataloader_resumes_at_each_ranks_own_position[0]",),
        "every rank resumes its own stream at rank 0's saved position",
    ),
    Mutant(
        "slow-rank-by-step",
        "ddpkit/observe/slowrank.py",
        '        slow = max(range(len(table)), key=lambda r: table[r]["busy"])',
        '        slow = max(range(len(table)), key=lambda r: table[r]["step"])  # mutant: the whole step',
        ("tests/test_anatomy.py::test_detector_thresholds_and_persistence",),
        "the slow-rank suspect is the rank with the longest whole step (often one that waits), not own work",
    ),
    Mutant(
        "agree-first-step-clock",
        "ddpkit/checkpoint/checkpoints.py",
        "            self._preemption.restart_clock()",
        "            pass  # mutant: the first s.step timed from the loader's boundary in the same step",
        ("tests/test_preemption.py::test_the_agreement_times_whole_steps_from_the_loops_first_s_step",),
        "the preemption's step estimate seeded by a fraction of a step: intervals of seconds, late stops",
    ),
    Mutant(
        "convert-checksum",
        "ddpkit/checkpoint/reading.py",
        "        return files.verify(chosen)",
        "        return files.Found(chosen, files.json.loads((chosen / files.MANIFEST).read_text()))",
        (
            "tests/test_checkpoint_tools.py::test_a_checkpoint_whose_checksum_fails_is_reported_and_never_converted",
        ),
        "ddpkit checkpoint convert reads a checkpoint without checking its checksums",
    ),
    Mutant(
        "per-rank-detect",
        "ddpkit/checkpoint/write.py",
        '    diverged = differing(parts["shared"], ctx.device) if ctx.distributed else []',
        "    diverged: list[str] = []  # mutant: state that differs between ranks saved once, rank 0's",
        (
            "tests/test_checkpoint_ranks.py::test_an_object_whose_state_differs_between_ranks_comes_back_per_rank",
        ),
        "an object whose state differs between ranks comes back as rank 0's on every rank",
    ),
    Mutant(
        "foreign-root",
        "ddpkit/checkpoint/checkpoints.py",
        "            if found is None and not skipped and (what := files.foreign(root)) is not None:",
        "            if False and (what := files.foreign(root)) is not None:  # mutant: another tool's file",
        (
            "tests/test_checkpoint_ranks.py::test_a_file_another_tool_wrote_is_refused_at_load_not_taken_for_a_fresh_start",
        ),
        "s.load on a file another tool wrote says 'no checkpoint yet' and starts fresh",
    ),
    Mutant(
        "writer-answers-unwritten",
        "ddpkit/checkpoint/writer_child.py",
        "                piece = piece[self.f.write(piece) :]  # type: ignore[attr-defined]",
        "                piece = piece[len(piece) :]  # mutant: hashed, answered, never written",
        (
            "tests/test_background_process.py::test_a_process_save_is_the_state_of_the_call_and_the_bytes_of_a_synchronous_save",
        ),
        "the writer process reports a file written (and the checkpoint committed) before its bytes are in it",
    ),
    Mutant(
        "writer-in-thread",
        "ddpkit/checkpoint/checkpoints.py",
        "        out = writer.write_file if writer is not None else None",
        "        out = None  # mutant: the big files written on training's process after all",
        (
            "tests/test_background_process.py::test_a_process_save_is_the_state_of_the_call_and_the_bytes_of_a_synchronous_save",
        ),
        'background="process" stages into shared memory but writes and hashes on training\'s interpreter',
    ),
    Mutant(
        "writer-dead-reused",
        "ddpkit/checkpoint/checkpoints.py",
        "        if self._process is not None and not self._process.alive:",
        "        if False:  # mutant: a dead writer process is asked again",
        (
            "tests/test_background_process.py::test_a_killed_writer_process_fails_its_save_and_loses_no_earlier_checkpoint",
        ),
        "after a writer process died, every later process save fails",
    ),
    Mutant(
        "remote-manifest-first",
        "ddpkit/checkpoint/remote.py",
        '        for name in sorted(manifest["files"], key=lambda n: (final / n).stat().st_size):',
        '        for name in [files.MANIFEST, *sorted(manifest["files"], '
        "key=lambda n: (final / n).stat().st_size)]:  # mutant",
        (
            "tests/test_checkpoint_remote.py::test_a_kill_during_the_upload_leaves_the_stores_checkpoint_whole_or_absent",
        ),
        "a remote checkpoint is committed (its manifest uploaded) before all its parts are in the store",
    ),
    Mutant(
        "retention-newest",
        "ddpkit/checkpoint/retention.py",
        "        keep = {name for name, _ in manifests[: max(self.last, 1)]}",
        "        keep = {name for name, _ in manifests[1 : max(self.last, 1) + 1]}  # mutant",
        ("tests/test_checkpoint_retention.py::test_the_newest_k_every_nth_and_the_best_are_kept",),
        "retention counts its newest K from the second newest: the newest survives only by a guard",
    ),
    Mutant(
        "remote-retention-rule",
        "ddpkit/checkpoint/remote.py",
        "        kept = retention.kept(manifests)",
        "        kept = Retention(retention.last).kept(manifests)  # mutant: the newest K only",
        (
            "tests/test_checkpoint_remote.py::test_a_save_to_s3_resumes_on_another_machine_and_keeps_the_newest",
        ),
        "the store's retention deletes the best checkpoint (keep_best) and every Nth (keep_every)",
    ),
    Mutant(
        "portable-fsdp-to-whole",
        "ddpkit/checkpoint/checkpoints.py",
        '        taken = portable.take(ctx.strategy, parts, manifest["objects"])',
        "        taken = None",
        ("tests/test_checkpoint_portable.py::test_a_two_rank_checkpoint_loads_in_one_process[fsdp]",),
        "an FSDP checkpoint is read as whole-model files in one process or under DDP (it has none)",
    ),
    Mutant(
        "memory-limit-check",
        "ddpkit/strategy/rank_memory.py",
        "    if state <= limit:",
        "    if True:  # mutant: DDP never refused, whatever the rank's memory limit",
        ("tests/test_memory_limit.py::test_ddp_refusal_names_fsdp_and_the_numbers",),
        "DDP wraps a model whose replicated state exceeds the rank's cgroup limit (killed mid-step)",
    ),
    Mutant(
        "plan-memory-allocator-one-thread",
        "benchmarks/plan_memory.py",
        "    old, flag.value = flag.value, True",
        "    old = flag.value  # mutant: the allocator's total kept only on the profiler's threads",
        ("tests/test_plan_memory_ranks.py::test_the_allocator_peak_counts_a_block_freed_on_another_thread",),
        "the plan's validation reads a block freed on gloo's worker thread as still held (peak too high)",
    ),
    Mutant(
        "plan-memory-activations",
        "ddpkit/observe/memory_breakdown.py",
        "                sums[_FOLD[name]] += int(value)",
        '                sums[_FOLD[name]] += 0 if _FOLD[name] == "activations" else int(value)  # mutant',
        (
            "tests/test_plan_memory.py::test_activations_grow_with_the_micro_batch_and_checkpointing_cuts_them",
            "tests/test_plan_memory_ranks.py::test_estimate_is_within_tolerance_of_the_peak_two_real_ranks_measure",
        ),
        "the memory plan leaves the activations out of a step's peak (as model-state estimators do)",
    ),
    Mutant(
        "own-tracker",
        "ddpkit/observe/tracking.py",
        "        self.logger.log(values, step)",
        "        pass  # mutant: a user's own tracker is accepted and never called",
        ("tests/test_plugins.py::test_a_users_own_tracker_receives_s_log",),
        "a tracker instance passed as log_to= receives none of s.log's scalars",
    ),
    Mutant(
        "startup-strategy-first",
        "ddpkit/training/session.py",
        'self.print(f"ddpkit: {self._choosing.describe()}; {self.plan.describe()}{detail}")',
        'self.print(f"ddpkit: {self.plan.describe()}{detail}")',
        ("tests/test_plugins.py::test_an_fsdp_session_says_its_strategy_and_shape_before_the_placement",),
        "the start-up line names the placement (mode ddp-cpu) and never the strategy and its shape",
    ),
    Mutant(
        "ci-due-changed",
        "scripts/mutation_check.py",
        "        if changed is None or files_of(m) \x26 changed:",  # escaped: this line must not match itself
        "        if changed is None:  # mutant: a changed file never makes a mutant due",
        ("tests/test_ci_selection.py::test_ci_runs_every_mutant_whose_record_does_not_cover_it",),
        "CI's mutation leg skips a mutant whose code or tests changed since the commit it was caught at",
    ),
    Mutant(
        "hsdp-swapped-mesh",
        "ddpkit/strategy/hsdp.py",
        "        self.shape = self.shape.with_mesh(replicate=replicate, shard=shard)",
        "        self.shape = self.shape.with_mesh(shard=shard, replicate=replicate)  # mutant: dims swapped",
        (
            "tests/test_hsdp.py::test_hsdp_2x2_is_fsdp2_on_a_2d_mesh_with_bitwise_replicas",
            "tests/test_hsdp.py::test_verify_strategy_hsdp_2x2_trains_the_weights_of_one_process",
        ),
        "HSDP's mesh with its replicate and shard dimensions swapped (shard groups strided across nodes)",
    ),
    Mutant(
        "hsdp-no-replica-all-reduce",
        "ddpkit/strategy/fsdp.py",
        "        mesh = self.shape.device_mesh()  # 1-D",
        "        mesh = self.shape.device_mesh()[self.shape.mesh[-1][0]]  # mutant: the shard dim only; 1-D",
        (
            "tests/test_hsdp.py::test_hsdp_2x2_is_fsdp2_on_a_2d_mesh_with_bitwise_replicas",
            "tests/test_hsdp.py::test_verify_strategy_hsdp_2x2_trains_the_weights_of_one_process",
        ),
        "HSDP sharded on the shard dimension's 1-D mesh only: no all-reduce across replica groups",
    ),
    Mutant(
        "adapters-frozen-reduced",
        "ddpkit/step/sharding.py",
        'return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]',
        'return [p for group in optimizer.param_groups for p in group["params"]]',
        ("tests/test_adapters.py::test_sharded_step_leaves_the_frozen_base_alone",),
        "the sharded step splits, reduces and publishes a PEFT model's frozen base with its adapters",
    ),
    Mutant(
        "adapters-base-saved",
        "ddpkit/strategy/adapters.py",
        "keep = set(trainable_names(module))",
        "keep = set(state)",
        (
            "tests/test_adapters.py::test_checkpoint_holds_adapters_only_and_resumes_bitwise[ddp]",
            "tests/test_adapters.py::test_checkpoint_holds_adapters_only_and_resumes_bitwise[fsdp]",
        ),
        "s.save writes the frozen base into a PEFT model's checkpoint",
    ),
    Mutant(
        "adapters-init-stream",
        "ddpkit/strategy/fsdp_init.py",
        "hf.loading_as_is(functools.partial(_as_one_process, mode))",
        "contextlib.nullcontext()",
        ("tests/test_adapters.py::test_fsdp_adapters_start_as_one_process_bit_for_bit[pretrained]",),
        "FSDP's build replays from_pretrained's meta draws: LoRA A starts from other values",
    ),
    Mutant(
        "hsdp-verify-runs-fsdp",
        "ddpkit/verify/spec.py",
        "        return HSDPOptions(replicate=replicate, shard=shard)",
        '        return "fsdp"  # mutant: verify --strategy hsdp checks FSDP instead',
        ("tests/test_hsdp.py::test_verify_strategy_hsdp_2x2_trains_the_weights_of_one_process",),
        "`ddpkit verify --strategy hsdp` runs FSDP over all ranks and reports it as HSDP",
    ),
    Mutant(
        "hsdp-checkpoint-read-as-whole",
        "ddpkit/checkpoint/dcp.py",
        '    if not found.manifest.get("objects", {}).get("sharded"):',
        '    if saved != "fsdp":  # mutant: only FSDP\'s checkpoints are read as shards',
        (
            "tests/test_hsdp.py::test_hsdp_resume_at_the_same_shape_is_bitwise",
            "tests/test_hsdp.py::test_hsdp_checkpoint_resumes_under_another_shape_exactly",
        ),
        "an HSDP checkpoint is read as a whole-model file it does not hold (no resume from HSDP shards)",
    ),
    Mutant(
        "hsdp-optimizer-shards-refused",
        "ddpkit/strategy/fsdp.py",
        'SHARDED_KINDS = ("fsdp", "hsdp")',
        "SHARDED_KINDS = (\"fsdp\",)  # mutant: HSDP's optimizer shards counted as a DDP checkpoint's",
        (
            "tests/test_hsdp.py::test_hsdp_resume_at_the_same_shape_is_bitwise",
            "tests/test_hsdp.py::test_hsdp_checkpoint_resumes_under_another_shape_exactly",
        ),
        "an HSDP checkpoint's sharded optimizer state is refused as if DDP had saved it",
    ),
    Mutant(
        "hsdp-weights-replica-rows",
        "ddpkit/strategy/weights.py",
        "    rank, world = param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)",
        "    rank, world = param.device_mesh.get_local_rank(0), param.device_mesh.size(dim)  # mutant",
        ("tests/test_hsdp.py::test_pretrained_weights_into_hsdp_shards_equal_the_file",),
        "weights= under HSDP: each rank reads the rows of its replica coordinate, not its shard coordinate",
    ),
    Mutant(
        "hsdp-regather-shard-group",
        "ddpkit/strategy/fsdp_init.py",
        "        parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]",
        "        parts = [torch.empty_like(padded) for _ in range(self.world)]  # mutant",
        ("tests/test_hsdp.py::test_shard_by_shard_build_under_hsdp_is_one_process_initial_weights",),
        "the shard-by-shard build gathers a rewritten parameter with one part per shard, not per rank",
    ),
    Mutant(
        "shards-into-ddp-no-optimizer",
        "ddpkit/checkpoint/portable.py",
        "        checkpoint_dcp.load(state, found.path)  # refuses a planted pickle",
        "        checkpoint_dcp.load({taken.name: state[taken.name]}, found.path)  # mutant: no optimizer",
        ("tests/test_hsdp.py::test_hsdp_checkpoint_resumes_under_another_shape_exactly",),
        "an FSDP/HSDP checkpoint loaded under DDP or one process reads the weights, not the optimizer state",
    ),
    Mutant(
        "plan-hsdp-no-inter-node-all-reduce",
        "ddpkit/plan/simulate.py",
        "            costs = [c + t for c, (t, _) in zip(costs, replicas, strict=True)]",
        "            costs = list(costs)  # mutant: the all-reduce between nodes costs nothing",
        (
            "tests/test_hsdp_plan.py::test_across_nodes_hsdp_sends_less_over_the_slow_link_and_steps_faster_than_fsdp",
        ),
        "`ddpkit plan --strategy hsdp` leaves the all-reduce of the shards between nodes out of the step",
    ),
    Mutant(
        "plan-gloo-reduce-scatter-as-ring",
        "ddpkit/plan/simulate.py",
        '        if self.link.backend == "gloo":\n            return self.allreduce(nbytes)[0]',
        "        if False:  # mutant: gloo's reduce-scatter costed as a ring's\n            return 0.0",
        (
            "tests/test_hsdp_plan.py::test_on_gloo_a_reduce_scatter_costs_an_all_reduce_so_fsdp_sends_four_passes",
        ),
        "`ddpkit plan` costs FSDP2's reduce-scatter on gloo as a ring's, half of what gloo sends",
    ),
    Mutant(
        "plan-ddp-wire-serial-on-busy-cores",
        "ddpkit/plan/simulate.py",
        '    elif opts.strategy == "ddp" and cluster.nodes > 1:',
        "    elif False:  # mutant: DDP's wire time across nodes added to the backward on busy cores",
        (
            "tests/test_hsdp_plan.py::test_ddp_across_nodes_on_busy_cores_waits_for_the_wire_beside_the_backward",
        ),
        "`ddpkit plan` adds DDP's all-reduce between nodes to the backward when the cores are busy",
    ),
    Mutant(
        "oom-one-rank-retries-alone",
        "ddpkit/step/oom.py",
        "            dist.all_reduce(flags)",
        "            pass  # mutant: each rank decides from its own out-of-memory error alone",
        ("tests/test_oom.py::test_an_oom_on_one_rank_reruns_the_step_split[forward]",),
        "a rank out of memory re-runs its step split while its peers go on (no agreement)",
    ),
    Mutant(
        "oom-split-keeps-accumulation",
        "ddpkit/step/oom.py",
        "        return self.base * self.parts",
        "        return self.base  # mutant: the micro-batch halved, the accumulation not doubled",
        ("tests/test_oom.py::test_an_oom_on_one_rank_reruns_the_step_split[forward]",),
        "after an out-of-memory error the micro-batch is halved, the accumulation kept (global batch halved)",
    ),
    Mutant(
        "oom-ahead-ignores-activations",
        "ddpkit/training/oom_ahead.py",
        "            return b.with_device(allowance, 0).total <= limit",
        "            return b.model_state <= limit  # mutant: the model state alone, no activations",
        ("tests/test_oom_fsdp.py::test_a_small_budget_splits_ahead_and_equals_the_smaller_loader_batch",),
        "micro_batch='auto' under FSDP chooses the split from the model state, leaving the activations out",
    ),
    Mutant(
        "oom-ahead-keeps-accumulation",
        "ddpkit/training/oom_ahead.py",
        "    s.stepper.accumulation = auto.accumulation\n    auto.ahead_note",
        "    auto.ahead_note  # mutant: the split chosen ahead, the accumulation not doubled",
        ("tests/test_oom_fsdp.py::test_a_small_budget_splits_ahead_and_equals_the_smaller_loader_batch",),
        "the split chosen ahead under FSDP halves the micro-batch without doubling the accumulation",
    ),
    Mutant(
        "oom-ahead-estimate-failure-raises",
        "ddpkit/training/oom_ahead.py",
        "        except Exception as exc:  # the estimate is advice",
        "        except ImportError as exc:  # mutant: a failed fake step crashes; the estimate is advice",
        ("tests/test_oom_fsdp.py::test_an_estimate_that_fails_trains_unsplit_and_says_why_and_how",),
        "micro_batch='auto' under FSDP crashes when its train_step cannot run on fake tensors (e.g. .item())",
    ),
    Mutant(
        "oom-ahead-estimate-failure-silent",
        "ddpkit/training/oom_ahead.py",
        "        _say_failed(s, auto, n, unestimated, failed)\n        return\n",
        "        return  # mutant: a failed estimate trains unsplit without a word\n",
        ("tests/test_oom_fsdp.py::test_an_estimate_that_fails_trains_unsplit_and_says_why_and_how",),
        "micro_batch='auto' under FSDP trains unsplit, saying nothing, when its estimate fails",
    ),
    Mutant(
        "oom-ahead-sync-deferred",
        "ddpkit/step/stepping.py",
        "        deferred = not block.sync or (self.oom is not None and not self.oom.ahead)",
        "        deferred = not block.sync or self.oom is not None  # mutant: FSDP's reduce-scatter skipped",
        ("tests/test_oom_fsdp.py::test_a_generous_budget_splits_nothing",),
        "micro_batch='auto' under FSDP skips FSDP's gradient sync in every block, as the DDP path defers it",
    ),
    Mutant(
        "oom-grads-kept",
        "ddpkit/step/stepping.py",
        "        optimizer.zero_grad(set_to_none=True)\n        if self._model is not None:\n"
        "            self._model.zero_grad(set_to_none=True)\n",
        "        pass  # mutant: the dropped step's gradients stay and add to its re-run\n",
        ("tests/test_oom.py::test_an_oom_on_one_rank_reruns_the_step_split[forward]",),
        "the gradients of a step dropped after an out-of-memory error are kept and applied with its re-run",
    ),
    Mutant(
        "oom-sync-in-backward",
        "ddpkit/step/stepping.py",
        "        deferred = not block.sync or (self.oom is not None and not self.oom.ahead)",
        "        deferred = not block.sync  # mutant: DDP's all-reduce in the last backward again",
        ("tests/test_oom.py::test_an_oom_on_one_rank_reruns_the_step_split[backward]",),
        "micro_batch='auto' all-reduces in the last backward (a peer out of memory leaves it waiting)",
    ),
    Mutant(
        "spike-one-rank-decides-alone",
        "ddpkit/training/fit.py",
        "        s.stepper.agree_loss(mean_loss)",
        "        s.stepper.agree_loss(float(local_loss[0]) / s.accumulation)  # mutant: its own loss",
        ("tests/test_spikes.py::test_a_spike_in_one_ranks_loss_is_skipped_by_every_rank",),
        "the spike guard judges each rank's own loss, so one rank skips a step its peers take",
    ),
    Mutant(
        "spike-grads-kept",
        "ddpkit/step/stepping.py",
        "            optimizer.zero_grad(set_to_none=True)\n            self.steps += spike.counted\n",
        "            self.steps += spike.counted  # mutant: the spiking step's gradients stay for the next\n",
        ("tests/test_spikes.py::test_a_planted_bad_batch_ruins_the_weights_unless_every_rank_skips_it",),
        "a step the spike guard skipped keeps its gradients, which the next step then applies",
    ),
    Mutant(
        "spike-guard-adds-a-barrier",
        "ddpkit/step/stepping.py",
        "        value = float(norm)  # the all-reduced gradients' norm",
        "        value = torch.distributed.barrier() or float(norm)  # mutant: a barrier per judged step",
        ("tests/test_spikes.py::test_the_guard_adds_no_collective_per_step",),
        "the spike guard adds a collective to every step (a barrier, as a guard that votes would)",
    ),
    Mutant(
        "spike-window-not-saved",
        "ddpkit/step/stepping.py",
        '            state["spikes"] = self.spikes.state_dict()',
        "            pass  # mutant: a resume judges against an empty window",
        (
            "tests/test_spikes.py::test_a_resume_from_before_the_spike_decides_the_same_and_ends_bitwise_equal",
        ),
        "the spike guard's window is not saved with the stepper, so a resumed run decides differently",
    ),
    Mutant(
        "spike-norm-run-cut-short",
        "ddpkit/step/spikes.py",
        "    if first.numel() == n:\n        return first\n",
        "    return first  # mutant: a run of bucket views read as its first gradient alone\n",
        (
            "tests/test_spikes.py::test_the_step_loop_judges_the_gradient_norm_alone",
            "tests/test_spikes.py::test_the_guards_own_norm_reads_each_run_of_bucket_views_as_one_tensor_and_holds_no_model",
        ),
        "the guard's own norm (no max_norm) reads only the first gradient of each run in DDP's buckets",
    ),
    Mutant(
        "spike-norm-holds-the-model",
        "ddpkit/step/spikes.py",
        "        self.watch = [weakref.ref(p, self.forget) for p in params]",
        "        self.watch = []  # mutant: the views of a freed model's buckets are kept",
        (
            "tests/test_spikes.py::test_the_guards_own_norm_reads_each_run_of_bucket_views_as_one_tensor_and_holds_no_model",
        ),
        "the guard's remembered bucket views keep a model's gradient buffers alive after the model is freed",
    ),
    Mutant(
        "export-url-json-first",
        "ddpkit/checkpoint/remote.py",
        'key=lambda n: (n.endswith(".json"), n),',
        "key=lambda n: n,  # mutant: in name order, config.json before the weights",
        ("tests/test_checkpoint_remote.py::test_a_folder_is_uploaded_with_its_json_files_last",),
        "an exported folder's config is uploaded before its weights (a cut-off upload looks whole)",
    ),
    Mutant(
        "export-url-folder-not-uploaded",
        "ddpkit/checkpoint/remote.py",
        "    if is_main:\n        upload(say)\n    return written\n",
        "    return written  # mutant: the export stays in the local cache\n",
        (
            "tests/test_checkpoint_remote.py::test_a_hugging_face_export_to_s3_is_a_folder_from_pretrained_loads",
        ),
        "s.export of a Hugging Face folder to a URL writes it locally and never uploads it",
    ),
    Mutant(
        "writer-group-training-priority",
        "ddpkit/checkpoint/background.py",
        "            idle_priority()\n            lower_priority(nice)\n        try:\n",
        "            pass  # mutant: gloo threads at training priority\n        try:\n",
        (
            "tests/test_checkpoint_writer_priority.py::test_the_threads_a_background_save_starts_run_at_the_lowest_priority",
        ),
        "the background save's process group (gloo's worker threads) runs at training's priority",
    ),
    Mutant(
        "whole-optimizer-into-fsdp-skipped",
        "ddpkit/checkpoint/dcp.py",
        "            load_whole_optimizers(model, optimizers, found, strict=strict)\n",
        "            pass  # mutant: the optimizer saved whole is not loaded into FSDP's shards\n",
        (
            "tests/test_checkpoint_portable.py::test_a_two_rank_checkpoint_loads_under_another_strategy[ddp-fsdp]",
        ),
        "a DDP checkpoint's optimizer state is dropped when an FSDP run loads it (a fresh optimizer)",
    ),
    Mutant(
        "rollback-skip-not-listed",
        "ddpkit/data/loader.py",
        '            state["skipped"] = [list(r) for r in self._skips]',
        "            pass  # mutant: the skipped samples are not in the checkpoint",
        (
            "tests/test_spike_rollback.py::test_a_resume_after_the_rollback_keeps_the_skip_listed_in_the_checkpoint",
        ),
        "the samples a rollback left out are not in the loader's checkpoint state, so a resume reads them",
    ),
    Mutant(
        "rollback-skip-not-honoured",
        "ddpkit/data/loader.py",
        "            jumped = self._past_skips(epoch, position)",
        "            jumped = position  # mutant: a pass reads the skipped range",
        (
            "tests/test_spike_rollback.py::test_the_loaders_skip_holds_at_any_world_size_and_across_a_resume",
            "tests/test_spike_rollback.py::test_a_rollback_leaves_the_bad_batch_out_and_ends_where_a_run_without_it_ends",
        ),
        "a pass reaches a skipped range of samples and reads it anyway",
    ),
    Mutant(
        "rollback-range-per-rank",
        "ddpkit/training/fit.py",
        "end - self.loader.batch.per_rank * s.world_size, end))",
        "end - self.loader.batch.per_rank, end))  # mutant: a rank's share, not the global batch",
        (
            "tests/test_spike_rollback.py::test_a_rollback_leaves_the_bad_batch_out_and_ends_where_a_run_without_it_ends",
        ),
        "the rollback names the spiking step's samples per rank instead of by global position",
    ),
    Mutant(
        "rollback-not-loaded",
        "ddpkit/training/fit.py",
        "        s.load(root, **objects)\n",
        "        pass  # mutant: no checkpoint loaded\n",
        (
            "tests/test_spike_rollback.py::test_a_rollback_leaves_the_bad_batch_out_and_ends_where_a_run_without_it_ends",
        ),
        "remedy='rollback' leaves out the samples but never goes back to the checkpoint",
    ),
    Mutant(
        "rollback-epoch-not-restored",
        "ddpkit/training/fit.py",
        "        back = max(0, pass_epoch - loader.epoch)",
        "        back = 0  # mutant: fit's epoch count stays in the spike's epoch",
        (
            "tests/test_spike_rollback.py::test_a_rollback_across_an_epoch_boundary_restores_the_epochs_order_and_ends_without_the_batch[mid-epoch]",
        ),
        "a rollback into the previous epoch leaves fit counting the spike's epoch (the run ends early)",
    ),
    Mutant(
        "rollback-epoch-end-empty-pass-refused",
        "ddpkit/training/fit.py",
        "        if batches == 0 and not resumed:",
        "        if batches == 0:  # mutant: a pass resumed at its epoch's end is an empty loader",
        (
            "tests/test_spike_rollback.py::test_a_rollback_across_an_epoch_boundary_restores_the_epochs_order_and_ends_without_the_batch[epoch-end]",
        ),
        "a rollback (or resume) to a checkpoint saved at an epoch's last step stops with 'yielded no batch'",
    ),
    Mutant(
        "rollback-epoch-end-eval-twice",
        "ddpkit/training/fit.py",
        "            self.evaluate(again=resumed and batches == 0)\n",
        "            self.evaluate()  # mutant: the repeated epoch end's evaluation added\n",
        (
            "tests/test_spike_rollback.py::test_a_rollback_across_an_epoch_boundary_restores_the_epochs_order_and_ends_without_the_batch[epoch-end]",
        ),
        "a rollback to a checkpoint at an epoch's last step leaves that epoch evaluated twice in the evals",
    ),
    Mutant(
        "rollback-abandoned-evals-kept",
        "ddpkit/training/fit.py",
        '        state.evals[:] = [e for e in state.evals if e["step"] <= state.step]',
        "        pass  # mutant: the abandoned path's evaluations stay in FitResult.evals\n",
        (
            "tests/test_spike_rollback.py::test_a_rollback_across_an_epoch_boundary_restores_the_epochs_order_and_ends_without_the_batch[mid-epoch]",
        ),
        "the evaluations a rollback undid stay in FitResult.evals beside those of the replay",
    ),
    Mutant(
        "adapters-frozen-optimizer-steps",
        "ddpkit/strategy/adapters.py",
        "    if not params or any(p.requires_grad for p in params):",
        "    if True:  # mutant: an optimizer over frozen parameters only steps nothing, silently",
        ("tests/test_adapters.py::test_an_optimizer_over_the_frozen_base_only_stops_the_first_step",),
        "an optimizer holding only frozen parameters (built before get_peft_model) is stepped silently",
    ),
    Mutant(
        "adapters-recompute-names-saved",
        "ddpkit/strategy/adapters.py",
        "    return [plain_name(n) for n, p in module.named_parameters() if p.requires_grad]",
        "    return [n for n, p in module.named_parameters() if p.requires_grad]",
        ("tests/test_adapters.py::test_checkpoint_holds_adapters_only_and_resumes_bitwise[fsdp-recompute]",),
        "with activation checkpointing a PEFT model's checkpoint keeps none of its adapters (wrapper names)",
    ),
    Mutant(
        "adapters-recompute-names-exported",
        "ddpkit/strategy/adapters.py",
        "        _plain_keys(target)\n",
        "        pass  # mutant: the adapter files keep the checkpoint wrapper's segment\n",
        ("tests/test_adapters.py::test_export_adapter_directory_and_merged_model",),
        "with activation checkpointing the exported adapter files name the wrappers: PeftModel loads none",
    ),
    Mutant(
        "adapters-fp32-upcast",
        "ddpkit/strategy/building.py",
        "    upcast = adapters.adapters_in_fp32(module)",
        "    upcast = None  # mutant: a PEFT model's bf16 adapters are trained in bf16",
        ("tests/test_adapters.py::test_bf16_base_with_fp32_adapters_trains_as_one_process[ddp-bf16-cast]",),
        "a PEFT model cast to bf16 whole trains its adapters (and AdamW state) in bf16",
    ),
    Mutant(
        "adapters-meta-cast",
        "ddpkit/strategy/adapters.py",
        "    layer._move_adapter_to_device_of_base_layer = move\n",
        "    pass  # mutant: peft's skipped cast on meta is not run\n",
        ("tests/test_adapters.py::test_bf16_base_with_fp32_adapters_trains_as_one_process[fsdp-bf16]",),
        "under FSDP over a bf16 base, LoRA A keeps its unrounded fp32 draw: not one process's start",
    ),
    Mutant(
        "adapters-resume-asks-base",
        "ddpkit/checkpoint/portable.py",
        '{k: v for k, v in whole.items() if f"{taken.name}.{k}" in held}',
        "dict(whole)",
        ("tests/test_adapters.py::test_adapter_checkpoint_resumes_in_one_process_within_the_floor[fsdp]",),
        "one process resuming a sharded PEFT checkpoint asks DCP for the frozen base it does not hold",
    ),
    Mutant(
        "tokens-count-aliased",
        "ddpkit/step/tokens.py",
        ".reshape(1).clone()  # not the",
        ".reshape(1)  # not the",
        ("tests/test_adapters.py::test_bf16_base_with_fp32_adapters_trains_as_one_process[ddp-bf16-cast]",),
        "the session's first s.backward(loss, tokens=t) all-reduces the caller's tensor t in place",
    ),
    Mutant(
        "oom-where-not-said",
        "ddpkit/step/oom.py",
        "            if is_oom(failed):  # where its memory was, for every rank (fp64: exact to 2^53)",
        "            if False:  # mutant: the rank that ran out keeps where its memory was to itself",
        ("tests/test_oom.py::test_an_oom_on_one_rank_reruns_the_step_split[forward]",),
        "an out-of-memory error's breakdown (model state, micro-batch, failed allocation) is not said",
    ),
    Mutant(
        "memory-live-untracked",
        "ddpkit/plan/memory_live.py",
        "    with tracker:\n        yield out\n",
        "    yield out  # mutant: the live step runs outside the tracker\n",
        ("tests/test_plan_memory.py::test_a_live_step_tracked_on_demand_gives_the_plans_breakdown",),
        "the on-demand breakdown of a live step is made without tracking the step",
    ),
    Mutant(
        "hsdp-resume-shape-ignored",
        "ddpkit/verify/resume.py",
        "        strategy=part.session_strategy(),\n    ) as s:",
        '        strategy="auto",  # mutant: every part runs DDP\n    ) as s:',
        (
            "tests/test_hsdp_resume.py::test_an_hsdp_2x2_run_resumed_under_fsdp_2_ends_within_the_floor",
            "tests/test_hsdp_resume.py::test_an_fsdp_2_checkpoint_under_hsdp_2x2_without_the_optimizer_is_named",
        ),
        "`ddpkit verify --resume` across shapes runs DDP on both sides and reports the shapes asked for",
    ),
    Mutant(
        "hsdp-resume-local-optimizer",
        "ddpkit/verify/resume.py",
        "    if not s.strategy.shards_state:\n        return s.stepper.optimizer_state(optimizer)",
        "    if True:  # mutant: a sharded optimizer's local state, keyed as it is\n"
        "        return s.stepper.optimizer_state(optimizer)",
        (
            "tests/test_hsdp_resume.py::test_an_hsdp_2x2_run_resumed_under_fsdp_2_ends_within_the_floor",
            "tests/test_hsdp_resume.py::test_an_fsdp_2_checkpoint_under_hsdp_2x2_without_the_optimizer_is_named",
        ),
        "`ddpkit verify --resume` compares a sharded optimizer's local shards, not the gathered state",
    ),
    Mutant(
        "hsdp-mode-line-flat",
        "ddpkit/training/choosing.py",
        '        shape = getattr(built, "shape", self.shape)',
        "        shape = self.shape  # mutant: the session's 1-D shape",
        ("tests/test_hsdp.py::test_hsdp_2x2_is_fsdp2_on_a_2d_mesh_with_bitwise_replicas",),
        "the start-up line says `strategy hsdp over 4 rank(s)` without HSDP's replicate x shard mesh",
    ),
    Mutant(
        "hsdp-tune-no-shape",
        "ddpkit/bench/tune.py",
        "    if nodes <= 1:",
        "    if nodes >= 1:  # mutant: FSDP over the node whatever the nodes",
        ("tests/test_hsdp_plan.py::test_bench_tune_names_the_hsdp_shape_where_a_node_share_fits",),
        "`ddpkit bench tune --nodes N` never names HSDP's shape where a node's share fits",
    ),
    Mutant(
        "warm-ranks",
        "ddpkit/cluster/launch.py",
        '        os.environ["PYTHON_EXEC"] = str(warm)',
        "        pass  # mutant: the ranks start as new interpreters",
        ("tests/test_warmstart.py::test_ddpkit_run_forks_its_ranks_from_the_server",),
        "`ddpkit run` ignores DDPKIT_WARM_START: every rank pays torch's imports again",
    ),
    Mutant(
        "warm-orphan",
        "ddpkit/cluster/warmstart.py",
        "        _kill(pid)  # the client ended (killed): its process goes with it",
        "        pass  # mutant: a killed client's process runs on",
        ("tests/test_warmstart.py::test_a_killed_client_takes_its_forked_process_with_it",),
        "a rank whose client torchrun killed keeps running, holding its port and cores",
    ),
    Mutant(
        "warm-load-env",
        "ddpkit/cluster/warmstart.py",
        "        return threads_ok and load_time_env(env) == self.env",
        "        return threads_ok  # mutant: load-time variables not compared",
        ("tests/test_warmstart.py::test_another_load_time_variable_or_option_starts_a_new_interpreter",),
        "a rank asked for the portable kernels (ATEN_CPU_CAPABILITY) runs on the server's",
    ),
    Mutant(
        "spawn-forkserver",
        "ddpkit/cluster/spawn.py",
        '        mp.get_context("forkserver").set_forkserver_preload(list(PRELOAD))',
        "        pass  # mutant: the forkserver imports nothing ahead",
        ("tests/test_warmstart.py::test_spawn_forks_importable_functions_from_a_preloaded_server",),
        "ranks asked for with start_method='forkserver' pay torch's imports again",
    ),
    Mutant(
        "spawn-load-env",
        "ddpkit/cluster/spawn.py",
        "    return _server_env == load_time_env(env)",
        "    return True  # mutant: load-time variables not compared",
        ("tests/test_warmstart.py::test_spawn_forks_importable_functions_from_a_preloaded_server",),
        "ranks asked for the portable kernels fork from a server that loaded the vectorised ones",
    ),
    Mutant(
        "fsdp-shards-written-on-the-thread",
        "ddpkit/checkpoint/dcp.py",
        "    write = process.write_shards if process is not None else write_here\n",
        "    write = write_here  # mutant: the writer thread writes DCP's shards after all\n",
        (
            "tests/test_background_fsdp.py::test_a_process_save_under_fsdp_is_written_by_the_writer_process_and_resumes_bitwise",
        ),
        "under FSDP, background=\"process\" writes DCP's shards from training's process (the writer thread)",
    ),
    Mutant(
        "thread-copy-fresh-memory",
        "ddpkit/checkpoint/background.py",
        "        self._arena.reset()\n        return self._arena.stage\n",
        "        return None  # mutant: each save's copy cloned into fresh memory\n",
        (
            "tests/test_background_fsdp.py::test_a_thread_save_under_fsdp_reads_nothing_back_and_reuses_the_memory_of_its_copy",
        ),
        "a thread save's copy faults in new memory on training's thread at every save",
    ),
    Mutant(
        "dcp-file-read-back",
        "ddpkit/checkpoint/writer_child.py",
        '    return {"bytes": os.stat(path).st_size, "sha256": digest.hexdigest(), "spans": spans}',
        '    return {"bytes": os.stat(path).st_size, "spans": spans,  # mutant: the file read back\n'
        '            "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}',
        (
            "tests/test_background_fsdp.py::test_a_thread_save_under_fsdp_reads_nothing_back_and_reuses_the_memory_of_its_copy",
        ),
        "the writer reads each DCP file back to hash it (a second pass over its bytes)",
    ),
    Mutant(
        "dcp-staged-segment-written",
        "ddpkit/checkpoint/dcp.py",
        "            return flat.view(t.dtype).view(t.shape)",
        "            return t  # mutant: torch.save of a view into the staging segment",
        (
            "tests/test_background_fsdp.py::test_a_thread_save_under_fsdp_reads_nothing_back_and_reuses_the_memory_of_its_copy",
        ),
        "the thread writer's DCP file holds the whole staging segment each shard was copied into",
    ),
    Mutant(
        "elastic-attempt-prefix",
        "ddpkit/cluster/lifecycle.py",
        '    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":\n',
        "    if False:  # mutant: the restart count names the store prefix in elastic jobs too\n",
        ("tests/test_elastic.py::test_a_lost_host_then_a_joining_host_and_the_job_finishes_on_both[step]",),
        "a host joining an elastic job after a lost host never meets the survivors (they count a restart, "
        "it does not: two store prefixes), and the job hangs",
    ),
    Mutant(
        "warm-client-in-place",
        "ddpkit/cluster/warmstart.py",
        "    staged.chmod(0o755)\n    os.replace(staged, path)\n",
        "    os.replace(staged, path)\n    path.chmod(0o755)  # mutant: made executable after it appears\n",
        ("tests/test_warmstart.py::test_the_client_script_appears_whole_and_executable",),
        "the warm-start client's script appears before it is executable: a launch that finds it then "
        "fails with PermissionError",
    ),
    Mutant(
        "c10d-nodes-shared-store",
        "ddpkit/cluster/launch.py",
        "    if cfg.min_nodes is not None or (cfg.nnodes > 1 and cfg.node_rank is None):\n",
        "    if cfg.min_nodes is not None:  # mutant: fixed-size nodes share torch's store across restarts\n",
        ("tests/test_launch.py::test_a_rank_failing_on_one_node_restarts_both_nodes_into_one_group",),
        "a rank failing on one node of a fixed-size job: the other node's ranks, restarted at another "
        "restart count, read the dead round's addresses (a wasted restart, or a wait until the rendezvous "
        "timeout)",
    ),
]


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
        print(f"{len(MUTANTS) - len(chosen)} of {len(MUTANTS)} mutants not run (the record covers them)")
    if ns.record:
        print(write_record([m for m in chosen if results[m.name][0] == 1]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
