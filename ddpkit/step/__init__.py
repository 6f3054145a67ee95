"""The step wing: what one training step does on every rank, driving the strategy the session chose.

    stepping        `Stepper`: accumulate, backward, the optimizer step, the sharded step, tokens
    sharding        the optimizer step sharded: each rank updates the parameters it owns, then publishes
    shard_exchange  ZeRO-2: gradients reduce-scattered into each rank's share
    tokens          the global token mean for variable-length batches
    oom             a step out of memory: agreed by every rank; micro_batch='auto' re-runs it split
    micro_batches   batch arithmetic: a micro-batch's sample count, and its cut into equal parts
    spikes          spike_guard=: a loss or gradient-norm spike skipped by every rank in the same step
    spike_norm      the guard's own gradient norm without max_norm (DDP's bucket runs read as one tensor)
    fingerprint     replica fingerprints: every N steps one small collective checks the replicas' bits
    invariant       reproducible="any-world": results bitwise independent of the world size
    chunktree       the fixed summation tree any-world reduces with

Owns: the accumulation state machine and the optimizer step. May import errors, names, the parallel
wing (`ddpkit.parallel`) and the `strategy` package (`stepping` drives the strategy); never the facade
(contract "facade"), nor the tools.
"""
