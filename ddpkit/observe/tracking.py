"""Experiment trackers behind one call: `s.log({"loss": ..., "lr": ...}, step=step)`.

    with ddpkit.session(log_to="tensorboard", log_dir="runs/exp1") as s:   # or ["tensorboard", "mlflow",
        ...                                                                  #     "wandb"], or None
        s.log({"loss": loss.item()}, step=step)

Global rank 0 writes; on every other rank `log` returns at once. Each tracker is a small adapter whose
package is imported the first time something is logged, so `import ddpkit` and `ddpkit.session()` cost
the same with or without the extras installed (docs/tracking.md has the figures).

`log_to="auto"` (the default) means TensorBoard when the `tensorboard` package is installed, else none.
A tracker of your own is an object with `log(values, step)` and `close()` (the `Logger` protocol): pass
it as `log_to=` or in its list (`log_to=["tensorboard", MyTracker()]`); it receives every `s.log`.

One `log_dir` holds one run. A session that opens a `log_dir` an earlier session wrote continues that
run: the same TensorBoard directory, MLflow run id and W&B run id (`resume="allow"`), kept in
`log_dir/ddpkit-tracking.json`, so a job killed and resumed from a checkpoint draws one curve. The step
axis continues from the first step the new session logs, without repeats: TensorBoard purges the
earlier points at or after it (`purge_step`: the resumed values replace them); MLflow, which cannot
delete points, skips the steps the earlier session wrote (`ddpkit-steps.txt`); W&B skips those of an
earlier session that finished cleanly, and after a kill logs them again, because W&B's service
process had not necessarily written them (it buffers until finish). Without `log_dir`, each run gets a
new directory `runs/<time>`, or `runs/<run id>` under torchrun's agent, so the restarts of one
`ddpkit run --max-restarts` job continue one run.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, Union, runtime_checkable

from ddpkit.errors import problem

TRACKERS = ("tensorboard", "mlflow", "wandb")
STATE_FILE = "ddpkit-tracking.json"
STEPS_FILE = "ddpkit-steps.txt"


@runtime_checkable
class Logger(Protocol):
    """A tracker of your own (`log_to=MyTracker()`): receives `s.log`'s scalars on global rank 0."""

    def log(self, values: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


LogTo = Union[str, Logger, Sequence[Union[str, Logger]], None]  # noqa: UP007 (a runtime alias on 3.10)


class Tracker(Protocol):
    """One adapter per tracker: open lazily, write scalars at a step, close."""

    skip_through: int  # steps up to here were written by an earlier session of this run

    def durable_through(self, written: int) -> int: ...
    def log(self, values: Mapping[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class _Own:
    """A user's `Logger` as a `Tracker`: it receives every step (no earlier session to skip)."""

    skip_through = -1

    def __init__(self, logger: Logger) -> None:
        self.logger = logger
        self.name = getattr(logger, "name", type(logger).__name__)

    def durable_through(self, written: int) -> int:
        return -1

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.logger.log(values, step)

    def close(self) -> None:
        self.logger.close()


def own_loggers(log_to: LogTo) -> tuple[Logger, ...]:
    """The tracker instances in `log_to` (names are for `parse`)."""
    if log_to is None or isinstance(log_to, str):
        return ()
    items = (log_to,) if isinstance(log_to, Logger) else log_to
    return tuple(t for t in items if isinstance(t, Logger) and not isinstance(t, str))


def parse(log_to: LogTo) -> tuple[str, ...]:
    """The tracker names `log_to` asks for ("auto" stays "auto"); a clear error for an unknown one."""
    if log_to is None or log_to is False or isinstance(log_to, Logger):  # type: ignore[comparison-overlap]
        return ()  # False: from a user's config
    names = (log_to,) if isinstance(log_to, str) else tuple(t for t in log_to if not isinstance(t, Logger))
    if names == ("auto",):
        return names
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise problem(
            f"log_to={log_to!r} names unknown tracker(s) {unknown}",
            f"Use any of {list(TRACKERS)}, a list of them, 'auto' (TensorBoard when installed) or None",
        )
    return tuple(dict.fromkeys(names))


def default_dir(env: Mapping[str, str]) -> str:
    """`runs/<torchrun run id>` under torchrun's agent with a unique run id (`--standalone`, `ddpkit run`
    on one node, `--rdzv-id=$SLURM_JOB_ID`): its restarts continue one run. Else a new `runs/<time>`."""
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id not in ("", "none", "ddpkit"):  # torchrun's defaults, and the fixed id of ddpkit's c10d launch
        return os.path.join("runs", run_id)
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


class Tracking:
    """The session's trackers. Built at session start (no imports); opened by the first `log`."""

    def __init__(
        self,
        log_to: LogTo,
        log_dir: str | os.PathLike | None,
        *,
        enabled: bool,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.names = parse(log_to)
        self.own = own_loggers(log_to)  # a user's own trackers (the `Logger` protocol)
        self.enabled = enabled and bool(self.names or self.own)  # global rank 0 with a tracker asked for
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.project = project  # None: $WANDB_PROJECT / $MLFLOW_EXPERIMENT_NAME, else "ddpkit"
        self.config = dict(config or {})
        self._trackers: list[Any] | None = None
        self._state: dict[str, Any] = {}
        self._steps: Any = None  # the append-only file of the steps written

    @property
    def trackers(self) -> list[str]:
        """The trackers that are writing (empty until the first `log`, and on other ranks)."""
        return [t.name for t in self._trackers or []]

    def log(self, values: Mapping[str, Any], step: int) -> None:
        if not self.enabled:
            return
        if self._trackers is None:
            self._open(step)
            if not self.enabled:
                return
        scalars = {k: float(v) for k, v in values.items()}
        for tracker in self._trackers:  # type: ignore[union-attr]
            if step > tracker.skip_through:  # written by an earlier session of this run
                tracker.log(scalars, step)
        if self._steps is not None:  # only ddpkit's trackers resume a run
            self._steps.write(f"{step}\n")  # through to the OS at once: it survives a killed process
            self._steps.flush()

    def _open(self, first_step: int) -> None:
        names = self.names
        if names == ("auto",):
            names = ("tensorboard",) if importlib.util.find_spec("tensorboard") else ()
        if not names:
            self._trackers = [_Own(t) for t in self.own]
            self.enabled = bool(self.own)
            return
        root = self.log_dir or default_dir(os.environ)
        os.makedirs(root, exist_ok=True)
        state_path = os.path.join(root, STATE_FILE)
        if os.path.exists(state_path):
            with open(state_path) as f:
                self._state = json.load(f)
        steps_path = os.path.join(root, STEPS_FILE)
        written = _last_step(steps_path)
        resume_at = first_step if self._state or written >= 0 else None
        built: dict[str, Callable[..., Tracker]] = {
            "tensorboard": TensorBoard,
            "mlflow": MLflow,
            "wandb": WandB,
        }
        self._trackers = []
        for name in names:
            tracker = built[name](
                root, self._state.setdefault(name, {}), resume_at, self.project, self.config
            )
            tracker.skip_through = tracker.durable_through(written) if resume_at is not None else -1
            self._trackers.append(tracker)
        self._trackers.extend(_Own(t) for t in self.own)
        _write_json(state_path, self._state)  # the run ids the adapters chose, for the next session
        self._steps = open(steps_path, "a")  # noqa: SIM115 -- held open for the session, closed in close()
        self.log_dir = root

    def close(self) -> None:
        for tracker in self._trackers or []:
            tracker.close()
        if self._steps is not None:
            _write_json(os.path.join(self.log_dir, STATE_FILE), self._state)  # type: ignore[arg-type]
        if self._steps is not None:
            self._steps.close()
        self._trackers, self._steps = None, None


class TensorBoard:
    """Event files in `log_dir/tensorboard`; on resume, `purge_step` drops the earlier points from there."""

    name = "tensorboard"

    def __init__(
        self, root: str, state: dict, resume_at: int | None, project: str | None, config: Mapping
    ) -> None:
        _require("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(root, "tensorboard"), purge_step=resume_at)
        self.skip_through = -1

    def durable_through(self, written: int) -> int:
        return -1  # nothing to skip: the purge step replaces what the earlier session wrote from there

    def log(self, values: Mapping[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()  # ~as cheap as not flushing (measured: ~100 us per 5 scalars either way)

    def close(self) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run; `MLFLOW_TRACKING_URI` wins (a server, or sqlite: with the full `mlflow`), else
    MLflow's file store in `log_dir/mlruns`, which `mlflow-skinny` can write and `mlflow ui` reads."""

    name = "mlflow"

    def __init__(
        self, root: str, state: dict, resume_at: int | None, project: str | None, config: Mapping
    ) -> None:
        _require("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or state.get("tracking_uri")
        uri = uri or "file:" + os.path.abspath(os.path.join(root, "mlruns"))
        if uri.startswith("file:"):  # MLflow 3 keeps its file store behind this switch ("maintenance mode")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        if "run_id" in state:
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddpkit"
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment).info.run_id
            for key, value in config.items():
                self.client.log_param(self.run_id, key, value)
            state.update(run_id=self.run_id, tracking_uri=uri)
        self.skip_through = -1

    def durable_through(self, written: int) -> int:
        return written  # log_batch(synchronous=True) returned before the step went to ddpkit-steps.txt

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandB:
    """One W&B run, resumed by id (`resume="allow"`); `WANDB_MODE=offline` keeps it on disk."""

    name = "wandb"

    def __init__(
        self, root: str, state: dict, resume_at: int | None, project: str | None, config: Mapping
    ) -> None:
        _require("wandb", "wandb")
        import wandb

        state.setdefault("run_id", uuid.uuid4().hex[:12])
        self.state = state
        project = project or os.environ.get("WANDB_PROJECT") or "ddpkit"
        self.run = wandb.init(
            project=project, id=state["run_id"], resume="allow", dir=root, config=dict(config)
        )
        self.skip_through = -1
        self.last = -1

    def durable_through(self, written: int) -> int:
        # W&B's service process buffers its writes until finish (offline: its .wandb file, every 15 s):
        # only what a cleanly finished session logged is sure to be there; after a kill, log again.
        return self.state.get("finished_through", -1)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)
        self.last = max(self.last, step)

    def close(self) -> None:
        self.run.finish()
        self.state["finished_through"] = max(self.last, self.state.get("finished_through", -1))


def _require(package: str, extra: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise problem(
            f"log_to asks for {package}, which is not installed",
            f"pip install 'ddpkit[{extra}]' (or {package}), or leave {package!r} out of log_to",
        )


def _last_step(path: str) -> int:
    """The last step an earlier session wrote to the trackers, or -1."""
    if not os.path.exists(path):
        return -1
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip().isdigit()]
    return int(lines[-1]) if lines else -1


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
    os.replace(tmp, path)
