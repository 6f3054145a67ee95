"""The parallel wing: what strategies are built from, below them (torchtitan's `distributed/`).

    layout         `Layout`: every degree of parallelism (replicate, shard, context, tensor) and `build`,
                   its one rule per degree; torch-free, so the tools build it as the session does
    shape          `Shape`: the cluster's shape a strategy is built with (nodes, local ranks, world, mesh)
    collectives    reductions, gathers and stop flags over the ranks of a session (`Ranks`)
    partition      which rank owns which tensor in a sharded optimizer step (ZeRO-1), pure
    precision      `PrecisionPlan`: the forward's autocast, the loss scaler, FSDP's mixed precision
    compiling      `torch.compile` in the right order with DDP/FSDP
    modules        `unwrap` (the user's module inside DDP / compile wrappers) and `ddp_of`
    syncbn         SyncBatchNorm that also runs on CPU (gloo); BatchNorm conversion
    comm_hooks     DDP communication hooks by name (`s.model(net, comm_hook="fp16")`)
    shm_allreduce  an exact shared-memory all-reduce for CPU ranks on one machine (`ShmAllReduce`)
    shm_segment    its segment: layout, create / map / unlink, stale segments of killed creators
    shm_hook       it as a DDP communication hook ("shm")
    fsdp_shm       FSDP2's all-gather and reduce-scatter through that shared memory (FSDPOptions(shm=...))
    cpu_allocator  keeps big CPU tensors' memory from step to step (for models that gain from it)

Owns: the pieces a strategy assembles (communication, numerics, module helpers, the shape). May import
errors and names only; never a strategy, the step, the facade (contract "facade") or the tools. A new
strategy (`ddpkit.strategy`) is built from these without any of them knowing it.
"""
