"""The plan: profiles and a link in, predictions for each N and the best bucket size and hook out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ddpkit.data import plan_batch
from ddpkit.errors import problem
from ddpkit.plan import profile as prof
from ddpkit.plan.links import Link
from ddpkit.plan.simulate import Cluster, Options, Prediction, step, with_efficiency

BUCKET_CAPS_MB = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0)
HOOK_VARIANTS = (("fp16", 1), ("bf16", 1), ("powersgd", 1), ("powersgd", 4))


def counts_up_to(max_n: int) -> list[int]:
    """1, 2, 4, ... up to max_n, and max_n itself."""
    out, n = [], 1
    while n < max_n:
        out.append(n)
        n *= 2
    return [*out, max_n]


def per_rank_batches(
    counts: Sequence[int], *, batch: int | None, global_batch: int | None, tensor: int = 1
) -> dict[int, int]:
    """Per-rank batch at each n: fixed (weak scaling) or the global batch split (strong scaling) over
    the ranks that read different batches (with a tensor degree T, n / T: a tensor group reads one)."""
    if global_batch is None:
        return dict.fromkeys(counts, batch or 1)
    readers = {n: n // tensor if n >= tensor else n for n in counts}
    bad = [n for n in counts if global_batch % readers[n]]
    if bad:
        raise problem(
            f"global batch {global_batch} is not divisible by {bad}",
            "Pick counts that divide it (--counts), or plan with a per-rank batch (--batch-size)",
        )
    return {n: plan_batch(global_batch, None, world_size=readers[n]).per_rank for n in counts}  # the loader's


def batches_to_profile(wanted: Sequence[int], limit: int = 3) -> list[int]:
    """Profile every wanted per-rank batch when there are few; else the smallest, largest and middle
    (the others are interpolated, see profile.interpolate)."""
    distinct = sorted(set(wanted))
    if len(distinct) <= limit:
        return distinct
    return sorted({distinct[0], distinct[len(distinct) // 2], distinct[-1]})


@dataclass(frozen=True, kw_only=True)
class Planner:
    """Predicts a step for any n, options and per-rank batch from the measured profiles."""

    profiles: dict[int, prof.Profile]
    link: Link
    per_node: int
    algorithm: str = "auto"
    compute_scale: float = 1.0  # the target device is this many times faster than the profiled one
    batches: dict[int, int] = field(default_factory=dict)  # per-rank batch at each n
    beside: dict[int, prof.Profile] = field(default_factory=dict)  # n -> profiled with n ranks at once

    def profile_at(self, batch: int, n: int = 1) -> prof.Profile:
        p = self.beside[n] if n in self.beside and self.beside[n].batch == batch else None
        p = p or prof.interpolate(self.profiles, batch)
        return p.scaled(1 / self.compute_scale) if self.compute_scale != 1.0 else p

    def cluster(self, n: int) -> Cluster:
        if self.link.inter is None and n > self.per_node:
            raise problem(
                f"{n} devices do not fit one node of {self.per_node} and --link {self.link.name} "
                "has no link between nodes",
                f"Pass a link with an inter-node level (e.g. --link ib-ndr), or --gpus-per-node {n}",
            )
        return Cluster(n=n, per_node=self.per_node, link=self.link, algorithm=self.algorithm)

    def predict(self, n: int, opts: Options, batch_factor: float = 1.0) -> Prediction:
        batch = max(1, round(self.batches[n] * batch_factor))
        return step(self.profile_at(batch, n), self.cluster(n), opts)

    def curve(self, counts: Sequence[int], opts: Options) -> list[Prediction]:
        base = self.predict(1, replace(opts, accumulation=1, hook="none", strategy="ddp"))
        return with_efficiency([self.predict(n, opts) for n in counts], base)

    def at_band(self, end: int) -> Planner:
        """This planner with every profile at the low (`end`=0) or high (1) end of its repeat band."""
        return replace(
            self,
            profiles={b: p.at_band(end) for b, p in self.profiles.items()},
            beside={n: p.at_band(end) for n, p in self.beside.items()},
        )

    def band(self, counts: Sequence[int], opts: Options) -> list[dict[str, tuple[float, float]]]:
        """Per n: the step time and efficiency with the profiles at either end of their noise band.

        The one-device base and an n-rank profile are separate runs, so the efficiency's band pairs
        the slow end of one with the fast end of the other (at n = 1, the same run: the same end)."""
        lo, hi = self.at_band(0), self.at_band(1)
        base_opts = replace(opts, accumulation=1, hook="none", strategy="ddp")
        b_lo, b_hi = lo.predict(1, base_opts), hi.predict(1, base_opts)
        out = []
        for n in counts:
            fast, slow = lo.predict(n, opts), hi.predict(n, opts)
            if n == 1:
                eff = (slow.samples_per_s / b_hi.samples_per_s, fast.samples_per_s / b_lo.samples_per_s)
            else:
                eff = (
                    slow.samples_per_s / (n * b_lo.samples_per_s),
                    fast.samples_per_s / (n * b_hi.samples_per_s),
                )
            out.append({"step_s": (fast.step_s, slow.step_s), "efficiency": (min(eff), max(eff))})
        return out

    def base(self) -> Prediction:
        return self.predict(1, Options())

    def bucket_sweep(self, n: int, opts: Options) -> list[Prediction]:
        return [self.predict(n, replace(opts, bucket_cap_mb=cap)) for cap in BUCKET_CAPS_MB]

    def best_bucket(self, n: int, opts: Options) -> Prediction:
        """The fastest cap; a cap within 1% of the fastest that is nearer DDP's 25 MB wins the tie."""
        sweep = self.bucket_sweep(n, opts)
        fastest = min(q.step_s for q in sweep)
        close = [q for q in sweep if q.step_s <= fastest * 1.01]
        return min(close, key=lambda q: abs(q.options["bucket_cap_mb"] - 25.0))

    def hook_sweep(self, n: int, opts: Options) -> list[Prediction]:
        return [self.predict(n, replace(opts, hook=h, powersgd_rank=r)) for h, r in HOOK_VARIANTS]
