"""The verdict, as a table a person reads and as JSON a CI job keeps."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorRow:
    """One parameter or buffer: how far DDP's copy came from the single run's, over all steps."""

    name: str
    kind: str  # "parameter" or "buffer"
    dtype: str
    numel: int
    max_abs_diff: float  # over steps and elements
    max_rel_diff: float  # over steps and elements, |ddp - single| / max(|single|, eps * max|single|)
    rel_norm: float  # over steps: ||ddp - single|| / ||single||
    floor_rel_norm: float  # the noise floor's rel norm at the last step
    excess: float  # over steps: deviation / tolerance; <= 1 passes
    dev_over_update: float  # over steps: ||ddp - single|| / ||single's update in that step||
    first_step_over: int | None  # first step over the tolerance (0: before any step), or None

    @property
    def passed(self) -> bool:
        return self.first_step_over is None


@dataclass(frozen=True)
class Diagnosis:
    """A plain-words reason for a failure (`cause`), or a risk that did not fail this run (`warning`)."""

    code: str  # stable id: batchnorm, sum_loss, changed_after_wrap, per_rank_init, data_mismatch, ...
    severity: str  # "cause" or "warning"
    message: str
    fix: str


@dataclass
class Report:
    passed: bool
    config: dict[str, Any]
    tolerance: dict[str, Any]
    tensors: list[TensorRow]
    replicas_identical: bool
    replica_divergence: dict[str, Any] | None  # first step where the replicas' bits differ, and where
    floor: dict[str, float]
    losses: dict[str, list[float]]
    diagnoses: list[Diagnosis] = field(default_factory=list)
    error: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> TensorRow | None:
        return max(self.tensors, key=lambda r: (r.excess, r.rel_norm), default=None)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tensors"] = [{**asdict(r), "passed": r.passed} for r in self.tensors]
        return _finite(data)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @property
    def side(self) -> str:
        """What ran on the N ranks, as the report names it: "DDP", or "FSDP" under --strategy fsdp."""
        return str(self.config.get("strategy", "ddp")).upper()

    def render(self, max_rows: int = 30) -> str:
        c = self.config
        side = self.side
        lines = [
            f"ddpkit verify: {side} on {c['nproc']} ranks vs 1 process, {c['steps']} step(s), global batch "
            f"{c['batch_size']} ({c['batch_size'] // c['nproc']} per rank), {c['precision']}, "
            f"optimizer {c['optimizer']}, seed {c['seed']}",
            f"noise floor ({' + '.join(c['floor'])} reference runs): up to {self.floor['max_rel_norm']:.2g} "
            f"relative norm; tolerance {self.tolerance['floor_multiple']:g} x floor, at least "
            f"{self.tolerance['eps_multiple']:g} eps ({self.tolerance['min_rel_norm']:.2g}) or "
            f"{self.tolerance['update_fraction']:g} of the step's update",
            "",
        ]
        rows = self.tensors
        if len(rows) > max_rows:
            keep = set(id(r) for r in sorted(rows, key=lambda r: -r.excess)[:max_rows])
            rows = [r for r in rows if id(r) in keep]
        width = max([len(r.name) for r in rows] + [6])
        head = ("tensor", "max abs", "max rel", "rel norm", "floor", "x tol", "dev/upd", "over at")
        lines.append(f"{head[0]:<{width}}  " + "  ".join(f"{h:>9}" for h in head[1:]))
        for r in rows:
            over = "-" if r.first_step_over is None else f"step {r.first_step_over}"
            cells = (
                r.max_abs_diff,
                r.max_rel_diff,
                r.rel_norm,
                r.floor_rel_norm,
                r.excess,
                r.dev_over_update,
            )
            lines.append(f"{r.name:<{width}}  " + "  ".join(f"{_num(v):>9}" for v in cells) + f"  {over:>9}")
        if len(rows) < len(self.tensors):
            lines.append(f"... {len(self.tensors) - len(rows)} more tensor(s), all within tolerance")
        lines.append("")
        if self.replicas_identical:
            lines.append(f"replicas: bitwise identical on all {c['nproc']} ranks at every step")
        elif self.replica_divergence:
            names = ", ".join(list(self.replica_divergence["tensors"])[:4])
            lines.append(f"replicas: DIFFER from step {self.replica_divergence['step']} on ({names})")
        if c.get("compile"):
            built = c.get("graphs_compiled", 0)
            lines.append(f"compile: {built} graph(s) built by torch.compile on {side} rank 0")
        if c.get("step_path"):
            lines.append(f"step (rank 0): {c['step_path']}")
        if self.error:
            lines.append(f"{side} run failed: {self.error.splitlines()[0]}")
        if self.losses.get("single"):
            s, d = self.losses["single"][-1], (self.losses.get("ddp") or [math.nan])[-1]
            lines.append(f"last loss: single {s:.6g}, {side} (mean over ranks) {d:.6g}")
        for diag in self.diagnoses:
            tag = "why" if diag.severity == "cause" else "note"
            lines.append(f"{tag} [{diag.code}]: {diag.message} Fix: {diag.fix}")
        worst = self.worst
        if self.passed:
            detail = f"; worst {worst.name} at {worst.excess:.2g} of its tolerance" if worst else ""
            lines.append(f"verdict: PASS, {side} trains the same weights as one process{detail}")
        else:
            lines.append("verdict: FAIL, " + self._failure())
        return "\n".join(lines)

    def _failure(self) -> str:
        if self.error:
            return f"the {self.side} run stopped with an error"
        bad = [r for r in self.tensors if not r.passed]
        parts = []
        if bad:
            first = min(bad, key=lambda r: (r.first_step_over, -r.excess))
            parts.append(
                f"{len(bad)} of {len(self.tensors)} tensor(s) beyond tolerance, first {first.name} at step "
                f"{first.first_step_over}"
            )
        if not self.replicas_identical:
            parts.append("the replicas are not identical")
        return "; ".join(parts) or "see above"


def _num(v: float) -> str:
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf"
    return f"{v:.2e}" if v < 1e-2 or v >= 1e4 else f"{v:.3g}"


def _finite(value: Any) -> Any:
    """JSON has no inf or NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
