"""The names users pass for a strategy, in one list, and the variables and codes `ddpkit run` and its
ranks share, elastic and preemption, each with this one owner (torch-free, so that the tools' argument
parsers, `plan` and the launcher import them without loading torch). `ddpkit.strategy` re-exports the
strategy names."""

from __future__ import annotations

STRATEGIES = ("auto", "single", "ddp", "fsdp")  # what `strategy=` accepts as a string
DISTRIBUTED = ("ddp", "fsdp")  # the kinds that run over several ranks (verify, trace, plan offer these)

# What `ddpkit run --nnodes MIN:MAX` tells every rank (`ddpkit.data.elastic_accumulation` reads them).
ELASTIC_WORLD_ENV = "DDPKIT_ELASTIC_WORLD"  # the world size at the most nodes
ELASTIC_BATCH_ENV = "DDPKIT_ELASTIC_BATCH"  # "per-rank" or "accumulation": which one a smaller world keeps

# Preemption (`ddpkit run` -> every rank; `ddpkit.cluster.preemption` reads them, `launch` writes them).
PREEMPTION_SIGNAL_ENV = "DDPKIT_PREEMPTION_SIGNAL"  # a signal name (besides SIGTERM): save and stop
REQUEUE_ENV = "DDPKIT_REQUEUE"  # "auto", "1" or "0": requeue the Slurm job after the save
PREEMPTION_RECORD_ENV = "DDPKIT_PREEMPTION_RECORD"  # where global rank 0 tells `ddpkit run` what it saved
DEFAULT_PREEMPTION_SIGNAL = "USR1"  # Slurm's --signal=USR1@120
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "temporary failure, try again": preempted, resume me
