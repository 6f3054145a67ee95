"""The observe wing: what a run reports while it trains.

    metrics    `Accuracy`, `Mean`, `Sum`, `MetricSet`: metrics reduced over ranks
    progress   progress lines and `RunLog` (JSON-lines or CSV rows, global rank 0)
    tracking   `s.log` to TensorBoard, MLflow, Weights & Biases (opened lazily)
    anatomy    where one rank's step time goes (phase marks; the gradient-sync wait from the last gradient)
    slowrank   every rank's medians to rank 0 (one small all_gather), the slow rank named with its cause
    flops      model FLOPs (counted once), FLOP/s and MFU against a GPU table or a measured CPU peak
    monitor    the pieces above, as `fit` drives them
    memory_breakdown  where a step's peak memory went (`Breakdown`: parameters, gradients, ..., activations)
    step_memory       torch's memory tracker on one step (real or fake tensors), folded into a `Breakdown`
    profiling         session(profile=...): torch.profiler on chosen ranks and steps, a trace file per rank

Owns: numbers leaving the run. May import errors and `parallel.collectives`; never the facade.
"""
