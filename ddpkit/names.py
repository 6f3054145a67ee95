"""The names users pass for a strategy, in one list, and the elastic variables `ddpkit run` sets
(torch-free, so that the tools' argument parsers, `plan` and the launcher import them without loading
torch). `ddpkit.strategy` re-exports the strategy names."""

from __future__ import annotations

STRATEGIES = ("auto", "single", "ddp", "fsdp")  # what `strategy=` accepts as a string
DISTRIBUTED = ("ddp", "fsdp")  # the kinds that run over several ranks (verify, trace, plan offer these)

# What `ddpkit run --nnodes MIN:MAX` tells every rank (`ddpkit.data.elastic_accumulation` reads them).
ELASTIC_WORLD_ENV = "DDPKIT_ELASTIC_WORLD"  # the world size at the most nodes
ELASTIC_BATCH_ENV = "DDPKIT_ELASTIC_BATCH"  # "per-rank" or "accumulation": which one a smaller world keeps
