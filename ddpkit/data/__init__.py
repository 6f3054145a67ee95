"""Data loading that cannot forget the distributed traps: `s.loader(source, batch_size=GLOBAL, ...)`.

Every kind of source is read so that each sample is trained on once per epoch over all ranks, every
rank has as many batches (a rank that runs out would hang the others), the order changes every epoch,
and the position inside an epoch goes into a checkpoint:

    batching   the global batch split over ranks and accumulation steps (and elastic jobs' rule)
    sources    which kind of source it is: map-style, iterable, Hugging Face, pre-split; what is refused
    samplers   map-style: DistributedSampler's split (resumable), evaluation's, a pre-split part's
    streams    iterable: the index split over ranks x DataLoader workers, the tail rule, the shuffle buffer
    position   the saved position and what each kind of source does with it at another world size
    loader     `ShardedLoader` (one pass per epoch, batches on the device) and `make_loader`

The tables of what is exact for which source: docs/equivalence.md, "Data".

Owns: which samples each rank reads, in which order, and where in the epoch it stands. May import
errors and names only (torch's DataLoader and samplers underneath); never the facade.
"""

from ddpkit.data.batching import BatchPlan, elastic_accumulation, plan_batch
from ddpkit.data.loader import ShardedLoader, make_loader, seed_worker, to_device
from ddpkit.data.samplers import EvalShardSampler, OwnPartSampler, ResumableSampler

__all__ = [
    "BatchPlan",
    "EvalShardSampler",
    "OwnPartSampler",
    "ResumableSampler",
    "ShardedLoader",
    "elastic_accumulation",
    "make_loader",
    "plan_batch",
    "seed_worker",
    "to_device",
]
