"""The observe wing: what a run reports while it trains.

    metrics    `Accuracy`, `Mean`, `Sum`, `MetricSet`: metrics reduced over ranks
    progress   progress lines and `RunLog` (JSON-lines or CSV rows, global rank 0)
    tracking   `s.log` to TensorBoard, MLflow, Weights & Biases (opened lazily)

Owns: numbers leaving the run. May import errors and `step.collectives`; never the facade.
"""
