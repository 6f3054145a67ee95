"""The cluster wing: processes, ranks and their lifetime (the launch side and the rank's membership).

    environments  which launcher started this process (torchrun, SLURM, MPI, ...): its rank contract
    topology      the hardware and the environment -> the `Placement` (mode, device, backend, world size)
    launch        `ddpkit run`: the local torchrun agent, restarts, signals, the run report
    spawn         `ddpkit.spawn`: N local rank processes from a function (notebooks, tests, tools)
    warmstart     a server that imported torch once forks the processes of short runs (a warm start)
    warm_client   its client: `python SCRIPT ...` forked from the server (standard library only)
    rank_output   every rank's stdout and stderr line-buffered: lines of ranks sharing a stream never tear
    keeper        the per-host process that holds the ranks' memory snapshots (they outlive a rank)
    failures      which rank failed first, and why (the error file torchrun's agent reads)
    run_report    what `ddpkit run` says when workers fail: at every restart, and when the job ends
    lifecycle     `Membership`: the only calls to init/destroy_process_group (group, store, watchdog)
    rendezvous_report  a start-up meeting that ran out of time: who never arrived, where, the fix
    watchdog      where every rank stands: Python stacks through the c10d store, for stall reports
    exit_guard    an exit that cannot turn a finished run into a failure
    preemption    a signal asks the job to stop: every rank stops at the same step, saves, exits 75
    requeue       the scheduler's requeue behind the environment (Slurm's `scontrol`; a place for others)
    signals       the stop policy, parsed once (which signal, whether to requeue)
    ranks         `RankContext`: rank, world size, print once, `s.all_reduce`, ...

Owns: who runs where, and for how long. May import errors, names and the parallel wing's helpers
(`parallel.collectives`, `parallel.cpu_allocator`); never the training facade (contract "facade") nor
the tools.
"""
