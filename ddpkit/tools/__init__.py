"""The tools built on ddpkit's public API, one module each; the larger tools have their own package
beside this one (`ddpkit.verify`, `ddpkit.bench`, `ddpkit.plan`, `ddpkit.lint`, kept at those documented
paths).

    doctor           `ddpkit doctor`: what this machine offers, and a 2-rank smoke test
    demo             `ddpkit demo`: a CNN on scikit-learn's digits with DDP
    trace            `ddpkit trace`: a per-rank timeline of forward, backward, buckets and all-reduce
    trace_ranks      `ddpkit trace --ranks`: every rank's step anatomy side by side over many steps
    gpucheck         `python -m ddpkit.tools.gpucheck`: prove the CUDA paths on the GPU(s) at hand
    gpucheck_checks  the checks it runs
    gpucheck_tp      its checks of tensor parallelism (NCCL, async TP) and the CUDA step (plan, OOM, trace)
    workloads        the named benchmark workloads (cnn, mlp, gpt, ...) and `Workload`
    plotting         matplotlib on a headless backend, for every command that draws (trace, bench, plan)

Owns: the commands' behaviour and output, and the named workloads.
May import `ddpkit` (the public namespace) and the public modules (strategy, precision, topology,
environments, launch, workloads, comm_hooks, data, metrics, tokens, names, errors); never the internals
the "tools" contract in `.importlinter` lists (session, stepping, sharding, checkpoint, ...).
"""
