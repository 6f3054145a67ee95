"""The step wing: what one training step does on every rank, below the strategy's choice.

    stepping       `Stepper`: accumulate, backward, the optimizer step, the sharded step, tokens
    precision      `PrecisionPlan`: the forward's autocast, the loss scaler, FSDP's mixed precision
    tokens         the global token mean for variable-length batches
    sharding       the optimizer step sharded: each rank updates the parameters it owns, then publishes
    syncbn         SyncBatchNorm that also runs on CPU (gloo)
    comm_hooks     DDP communication hooks by name (`s.model(net, comm_hook="fp16")`)
    shm_allreduce  an exact shared-memory all-reduce for CPU ranks on one machine (hook "shm")
    fsdp_shm       FSDP2's all-gather and reduce-scatter through that shared memory (FSDPOptions(shm=...))
    cpu_allocator  keeps big CPU tensors' memory from step to step (for models that gain from it)
    compiling      `torch.compile` in the right order with DDP/FSDP
    wrap           `DDPOptions` and the DDP wrapper; `unwrap`
    collectives    reductions, gathers and stop flags over the ranks of a session

Owns: the numerics and communication of a step. May import errors, names and the `strategy` package
(only `stepping`, which drives the strategy); never the facade (contract "facade"), nor the tools.
"""
