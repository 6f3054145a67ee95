"""The names users pass for a strategy, in one list (torch-free, so that the tools' argument parsers
and `plan` import them without loading torch). `ddpkit.strategy` re-exports them."""

from __future__ import annotations

STRATEGIES = ("auto", "single", "ddp", "fsdp")  # what `strategy=` accepts as a string
DISTRIBUTED = ("ddp", "fsdp")  # the kinds that run over several ranks (verify, trace, plan offer these)
