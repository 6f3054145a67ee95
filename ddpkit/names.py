"""The names users pass for a strategy, in one list (with the layout degrees each spans), and every
`DDPKIT_*` environment variable and exit code ddpkit reads or writes, each with this one owner
(torch-free, so that the tools' argument parsers, `plan` and the launcher import them without loading
torch). `ddpkit.strategy.registry` builds its built-in entries from the strategy table. No other
module spells a `DDPKIT_*` variable as a literal (`tests/test_architecture.py` checks)."""

from __future__ import annotations

# Every built-in strategy: the name `strategy=` takes -> the layout degrees it spans, outermost first
# (`ddpkit.parallel.layout.DEGREES`). Its builder is `ddpkit.strategy.<name>:build`, its options
# `ddpkit.strategy.<name>_options.<NAME>Options` (`ddpkit.strategy.registry` imports them when first used).
BUILT_IN_STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": ("replicate",),
    "fsdp": ("shard",),
    "hsdp": ("replicate", "shard"),
    "tp": ("replicate", "shard", "tensor"),  # tensor parallelism, FSDP2 over the data dimensions
}
STRATEGIES = ("auto", "single", *BUILT_IN_STRATEGIES)  # what `strategy=` accepts as a string
DISTRIBUTED = ("ddp", "fsdp")  # going: the tools ask `ddpkit.strategy.distributed()` (every registered one)

# What `ddpkit run --nnodes MIN:MAX` tells every rank (`ddpkit.data.elastic_accumulation` reads them).
ELASTIC_WORLD_ENV = "DDPKIT_ELASTIC_WORLD"  # the world size at the most nodes
ELASTIC_BATCH_ENV = "DDPKIT_ELASTIC_BATCH"  # which one a smaller world keeps (ELASTIC_BATCH_CHOICES)
ELASTIC_BATCH_CHOICES = ("auto", "per-rank", "accumulation")  # auto: per-rank if the session accumulates

# Preemption (`ddpkit run` -> every rank; `ddpkit.cluster.signals` parses them, `launch` writes them).
PREEMPTION_SIGNAL_ENV = "DDPKIT_PREEMPTION_SIGNAL"  # a signal name (besides SIGTERM): save and stop
REQUEUE_ENV = "DDPKIT_REQUEUE"  # "auto", "1" or "0": requeue the Slurm job after the save
REQUEUE_CHOICES = ("auto", "1", "0")  # what --requeue and DDPKIT_REQUEUE accept
PREEMPTION_RECORD_ENV = "DDPKIT_PREEMPTION_RECORD"  # where global rank 0 tells `ddpkit run` what it saved
CHECKPOINT_CACHE_ENV = "DDPKIT_CHECKPOINT_CACHE"  # where a remote (fsspec URL) checkpoint stages
SIGNALLED_FILE = "signalled"  # beside the record: `ddpkit run` was signalled (its SIGTERM is a preemption)
DEFAULT_PREEMPTION_SIGNAL = "USR1"  # Slurm's --signal=USR1@120
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, try again": preempted, resume me

# What `ddpkit run` tells its ranks, and the switches a user sets (README).
WARM_START_ENV = "DDPKIT_WARM_START"  # a warm-start server's directory: `ddpkit run` forks its ranks from it
KEEPER_ENV = "DDPKIT_KEEPER"  # this host's snapshot keeper (`ddpkit run`): s.load(..., memory=N) holds there
KEEPER_TOKEN_ENV = (
    "DDPKIT_KEEPER_TOKEN"  # this host's keeper's job token (`ddpkit run`; never on a command line)
)
KEEPER_ADDRESS_ENV = "DDPKIT_KEEPER_ADDRESS"  # HOST:PORT where the other hosts reach this host's keeper (TCP)
RUN_ENV = "DDPKIT_RUN"  # "1" in a rank of `ddpkit run`: the launcher reports user errors itself
DEVICE_ENV = "DDPKIT_DEVICE"  # `ddpkit run --device`: read by `cluster.topology` when device="auto"
SHARE_GPU_ENV = "DDPKIT_SHARE_GPU"  # `ddpkit run --share-gpu`: more local ranks than GPUs
EXIT_GUARD_ENV = "DDPKIT_EXIT_GUARD"  # "0" turns `cluster.exit_guard` off
WRITER_NICE_ENV = "DDPKIT_WRITER_NICE"  # the background checkpoint writer's niceness
CPU_ALLOCATOR_ENV = "DDPKIT_CPU_ALLOCATOR"  # "default" (opt out) or "hugepages" (`step.cpu_allocator`)
MEMORY_CHECK_ENV = "DDPKIT_MEMORY_CHECK"  # "off" skips `strategy.rank_memory`'s check
STEP_MEMORY_ENV = "DDPKIT_STEP_MEMORY_MIB"  # MiB a rank's step may hold (`training.oom_ahead`), read once
GPUCHECK_DEVICE_ENV = "DDPKIT_GPUCHECK_DEVICE"  # "cpu": `ddpkit gpucheck` rehearses on CPU
CUDA_MEMORY_HISTORY_ENV = "DDPKIT_CUDA_MEMORY_HISTORY"  # "0": no CUDA allocation history (micro_batch="auto")
CACHE_DIR_ENV = "DDPKIT_CACHE_DIR"  # where measured facts of this machine are kept (`observe.flops` CPU peak)
VERIFY_RECORD_ENV = "DDPKIT_VERIFY_RECORD"  # verify --resume-script: each rank records its saves, steps
VERIFY_STOP_ENV = "DDPKIT_VERIFY_STOP"  # verify --resume-script: "kill:K" or "signal:K" (step K)
