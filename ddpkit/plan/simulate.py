"""Replay one profiled step on N ranks: cost models of the collectives, and the overlap with backward.

Collectives (n ranks, S bytes, per-step latency α, per-rank bandwidth β; Thakur et al. 2005, and
nccl-tests' PERFORMANCE.md for the bus-bandwidth factors):

    ring all-reduce      2(n-1)·α + 2(n-1)/n · S/β      reduce-scatter, then all-gather, around a ring
    tree all-reduce      2·depth·α + 2·S/β              reduce up and broadcast down a pipelined tree
    all-gather (ring)    (n-1)·α + (n-1)/n · S/β        S = the gathered (full) size
    reduce-scatter       (n-1)·α + (n-1)/n · S/β        S = the input (full) size
                         (gloo, CPU ranks: an all-reduce of S; its reduce_scatter_tensor is one)

Across nodes (g ranks per node, m nodes) the latencies follow NCCL's tuning model (src/graph/tuning.cc):
a ring pays the network's α on its 2(m-1) steps that cross nodes and the node's α on the others; a
tree is a chain inside each node and a binary tree between nodes, latency 2((g-1)·α_intra + ⌈log2 m⌉·
α_inter), at 0.9 of the ring's bandwidth. The bandwidth across nodes is the smaller of a rank's
intra-node β and the node's NICs together (nics·β_inter: each of NCCL's rings crosses a node boundary
through its own NIC). "auto" takes the faster, as NCCL's tuner does per message size.

The step: forward, then backward during which each bucket's all-reduce is launched once its last
gradient is ready, on one communication stream (a bucket waits for the one before it), then the
optimizer step once the last all-reduce is done:

    start_i = max(ready_i, end_{i-1}),  end_i = start_i + cost_i
    step    = forward + max(backward, end_last) + optimizer,  exposed = max(0, end_last - backward)

CPU ranks on one machine share its cores: compute slows by max(1, ranks·threads/cores) -- or, better,
the profile is taken with n ranks computing at once (`profile.measure(ranks=n)`), which also captures
shared memory bandwidth and hyper-threads, and how long the slowest rank keeps the others waiting
(added to the step); when no core is left over for the communication threads, communication cannot
overlap compute (it is added), except the wait on the wire of DDP's all-reduce between nodes (only its
copies, the all-reduce at one node's speed, are added; `_stream_on_busy_cores`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ddpkit.errors import problem
from ddpkit.names import BUILT_IN_STRATEGIES
from ddpkit.parallel.layout import ClusterShape, Layout, build
from ddpkit.plan.links import Link, log2_ceil
from ddpkit.plan.profile import Bucket, Profile

ALGORITHMS = ("auto", "ring", "tree")
HOOKS = ("none", "fp16", "bf16", "powersgd")
TREE_BANDWIDTH = 0.9  # NCCL's tuner rates a tree's bus bandwidth at 0.9 of the ring's (src/graph/tuning.cc)


# -- collectives on one level ----------------------------------------------------------------------
def ring_allreduce(nbytes: float, n: int, alpha: float, beta: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def tree_allreduce(nbytes: float, n: int, alpha: float, beta: float, depth: int | None = None) -> float:
    if n <= 1:
        return 0.0
    return 2 * (log2_ceil(n) if depth is None else depth) * alpha + 2 * nbytes / beta


def ring_allgather(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """All-gather into `nbytes` (the full output); reduce-scatter of an `nbytes` input costs the same."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + (n - 1) / n * nbytes / beta


# -- the cluster -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Cluster:
    """n ranks, `per_node` of them per node, over `link`; which all-reduce algorithm to assume."""

    n: int
    per_node: int
    link: Link
    algorithm: str = "auto"

    @property
    def nodes(self) -> int:
        return math.ceil(self.n / self.per_node)

    def layout(self, opts: Options) -> Layout:
        """The strategy's layout on these ranks, by the library's builder (`parallel.layout.build`): plan
        states its cluster as `n` ranks in nodes of `min(per_node, n)`; for a strategy spanning both
        replicate and shard (HSDP) as whole nodes, so the builder's default rule gives shard = a node's
        ranks and replicate = the nodes (a last node not full is modelled as a full one: the layout's
        world is then the padded one)."""
        dims = BUILT_IN_STRATEGIES.get(opts.strategy, opts.dims or ("replicate",))
        local = min(self.per_node, self.n)
        if "replicate" in dims and "shard" in dims:
            return build(dims, ClusterShape(self.nodes * local, local))
        return build(dims, ClusterShape(self.n, local))

    def _levels(self) -> tuple[float, float, float]:
        """(α inside a node, α between nodes, bottleneck β per rank)."""
        a_in, b_in = self.link.intra.at(self.n)
        if self.nodes == 1 or self.link.inter is None:
            return a_in, a_in, b_in
        a_out, b_out = self.link.inter.at(self.nodes)
        return a_in, a_out, min(b_in, self.link.nics_per_node * b_out)

    def allreduce(self, nbytes: float) -> tuple[float, str]:
        """Seconds for an all-reduce of `nbytes` on every rank, and the algorithm that gives them."""
        if self.n <= 1 or nbytes <= 0:
            return 0.0, "-"
        a_in, a_out, beta = self._levels()
        m = self.nodes
        measured = self.link.intra.measured_allreduce(self.n, nbytes) if m == 1 else None
        if measured is not None and self.algorithm == "auto":
            return measured + self.link.launch_s, "measured"
        if m == 1:
            ring = ring_allreduce(nbytes, self.n, a_in, beta)
            tree = tree_allreduce(nbytes, self.n, a_in, beta * TREE_BANDWIDTH, depth=self.n - 1)
        else:  # NCCL's tuning model: the ring's 2(m-1) steps that cross nodes pay the network's latency
            steps = 2 * (self.n - 1)
            ring = (steps - 2 * (m - 1)) * a_in + 2 * (m - 1) * a_out + steps / self.n * nbytes / beta
            depth = (min(self.per_node, self.n) - 1) * a_in + log2_ceil(m) * a_out
            tree = 2 * depth + 2 * nbytes / (beta * TREE_BANDWIDTH)
        options = {"ring": ring + self.link.launch_s, "tree": tree + self.link.launch_s}
        if self.algorithm != "auto":
            return options[self.algorithm], self.algorithm
        name = min(options, key=options.__getitem__)
        return options[name], name

    def allgather(self, nbytes: float) -> float:
        if self.n <= 1 or nbytes <= 0:
            return 0.0
        a_in, a_out, beta = self._levels()
        m = self.nodes  # as for the ring all-reduce: the m-1 node-crossing steps pay the network's α
        latency = (self.n - m) * a_in + (m - 1) * a_out
        return self.link.launch_s + latency + ring_allgather(nbytes, self.n, 0.0, beta)

    def reduce_scatter(self, nbytes: float) -> float:
        """A reduce-scatter of an `nbytes` input: a ring's (n-1)/n of it, as an all-gather (NCCL); on gloo
        an all-reduce of all of it (its reduce_scatter_tensor reduces everything, then keeps a chunk)."""
        if self.link.backend == "gloo":
            return self.allreduce(nbytes)[0]
        return self.allgather(nbytes)

    def compute_slowdown(self, threads: int) -> float:
        """How much slower each rank computes because the ranks share this machine's cores."""
        if not self.link.shares_cores or not self.link.cores:
            return 1.0
        return max(1.0, self.n * threads / self.link.cores)

    def overlaps(self, threads: int) -> bool:
        """Whether communication can run beside compute: always on devices with their own copy engines
        or NICs; on shared CPU cores only when a core is left over for the communication threads."""
        if self.n <= 1 or not self.link.shares_cores or not self.link.cores:
            return True
        return self.n * threads < self.link.cores


# -- the step --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Options:
    """What the simulated run uses: bucket cap, hook, strategy, accumulation, sharded optimizer step."""

    bucket_cap_mb: float = 25.0
    hook: str = "none"
    powersgd_rank: int = 1
    strategy: str = "ddp"
    accumulation: int = 1
    sharded_step: bool = False  # ddpkit's sharded optimizer step (CPU ranks): each rank steps 1/n
    # a registered strategy's layout degrees (`ddpkit.strategy.entry(name).dims`, which the command line
    # passes; () a replicating one's); a built-in's come from `ddpkit.names.BUILT_IN_STRATEGIES` (so a
    # `replace(opts, strategy="fsdp")` is FSDP's), and this module stays torch-free
    dims: tuple[str, ...] = ()
    # tensor parallelism: the tensor degree and each split layer's activation collectives per sample,
    # forward and backward ((kind, bytes), ...: `ddpkit.plan.tp_time.collectives`)
    tensor: int = 1
    tp_forward: tuple[tuple[str, float], ...] = ()
    tp_backward: tuple[tuple[str, float], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The options a plan reports (the dims are the strategy's, named by it; with a tensor degree,
        the degree and the collectives by their count and bytes per sample)."""
        tp = ("tensor", "tp_forward", "tp_backward")
        out = {k: v for k, v in self.__dict__.items() if k != "dims" and k not in tp}
        if self.tensor > 1:
            out["tensor"] = self.tensor
            every = (*self.tp_forward, *self.tp_backward)
            out["tp_collectives"] = {"count": len(every), "bytes_per_sample": sum(b for _, b in every)}
        return out


@dataclass(frozen=True, kw_only=True)
class Prediction:
    n: int
    per_rank_batch: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_s: float  # all communication time of the step (hidden or not)
    exposed_s: float  # what communication adds to the step
    buckets: int
    algorithm: str
    samples_per_s: float = 0.0
    efficiency: float = 1.0
    slow_link_bytes: float = 0.0  # bytes each node sends over the inter-node link per step (ring model)
    options: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def bucket_bytes(profile: Profile, bucket: Bucket, opts: Options) -> list[float]:
    """Bytes of each collective a bucket needs under the hook: one all-reduce, or PowerSGD's two
    (P and Q of the compressible matrices) plus one for what it leaves uncompressed."""
    if opts.hook in ("fp16", "bf16"):
        return [bucket.bytes / 2]
    if opts.hook != "powersgd":
        return [float(bucket.bytes)]
    r = opts.powersgd_rank
    p_bytes = q_bytes = plain = 0.0
    for i in bucket.params:
        prm = profile.params[i]
        rows = prm.shape[0] if prm.shape else 1
        cols = prm.bytes // 4 // max(rows, 1)
        if len(prm.shape) >= 2 and (rows + cols) * r * 2 < rows * cols:  # torch's min_compression_rate 2
            p_bytes += rows * r * 4
            q_bytes += cols * r * 4
        else:
            plain += prm.bytes
    return [b for b in (plain, p_bytes, q_bytes) if b > 0]


def _stream(ready: list[float], costs: list[float]) -> float:
    """When the last of the collectives, launched at `ready` in order on one stream, finishes."""
    end = 0.0
    for r, c in zip(ready, costs, strict=True):
        end = max(r, end) + c
    return end


def _stream_on_busy_cores(
    p: Profile, cluster: Cluster, buckets: list[Bucket], costs: list[float], opts: Options
) -> float:
    """DDP's all-reduces across nodes when no core is left over: only their work on the cores (the same
    all-reduce inside one node, memory speed) takes it from the backward; the rest of each is waiting
    on the wire, which gloo's threads do beside the backward (two hosts over a 200 Mbit/s link: DDP's
    31.7 MB per node per step took 0.2 s more than its compute, not 1.3 s; benchmarks/hsdp_step.py)."""
    one_node = replace(cluster, per_node=cluster.n)
    cpu = [
        min(c, sum(one_node.allreduce(nb)[0] for nb in bucket_bytes(p, b, opts)))
        for b, c in zip(buckets, costs, strict=True)
    ]
    shifted, taken = [], 0.0
    for b, c in zip(buckets, cpu, strict=True):
        shifted.append(b.ready_s + taken)  # the backward is later by the copies run before this bucket
        taken += c
    return max(p.backward_s + sum(cpu), _stream(shifted, costs))


def step(profile: Profile, cluster: Cluster, opts: Options) -> Prediction:
    """Predict one optimizer step on `cluster.n` ranks of `profile.batch` samples each (with a tensor
    degree: `profile.batch` samples per tensor group, `tensor_step`)."""
    if opts.tensor > 1 and cluster.n > 1:
        return tensor_step(profile, cluster, opts)
    n = cluster.n
    measured_beside = n > 1 and profile.ranks == n  # profiled with n ranks computing at once
    slow = 1.0 if measured_beside else cluster.compute_slowdown(profile.threads)
    p = profile.scaled(slow) if slow != 1.0 else profile
    optimizer = p.optimizer_s
    if opts.sharded_step and n > 1:
        optimizer = p.optimizer_s / n + p.copy_s * (n - 1) / n
    buckets = p.buckets(opts.bucket_cap_mb)
    algos: set[str] = set()
    forward_comm = 0.0
    layout = cluster.layout(opts)
    sharded = "shard" in layout.dims
    if sharded:
        # All-gather each unit's parameters before use (forward and again in backward, prefetched one
        # unit ahead), reduce-scatter its gradients when ready: 3 x (n-1)/n x S against DDP's 2 (on
        # gloo the reduce-scatter is an all-reduce: 4 x (n-1)/n x S).
        # HSDP: the same inside each node (the shard group, on the node's links), then one all-reduce of
        # each unit's gradient shard across the nodes: a node's shards together are S bytes, sent
        # through the node's NICs (modelled as one all-reduce of S between the nodes).
        shard = replace(cluster, n=layout.shard)  # FSDP: the whole cluster; HSDP: one node's ranks
        across = replace(cluster, n=layout.replicate, per_node=1) if "replicate" in layout.dims else None
        gathers = [shard.allgather(b.bytes) for b in buckets]
        costs = [g + shard.reduce_scatter(b.bytes) for g, b in zip(gathers, buckets, strict=True)]
        if across is not None:
            replicas = [across.allreduce(b.bytes) for b in buckets]
            costs = [c + t for c, (t, _) in zip(costs, replicas, strict=True)]
            algos.update(a for _, a in replicas)
        total_bytes = sum(b.bytes for b in buckets) or 1
        comm_t = comp_t = 0.0
        for g, b in zip(reversed(gathers), reversed(buckets), strict=True):  # forward: the other order
            comm_t += g  # gathers are issued back to back (prefetch); a unit computes once it has its own
            comp_t = max(comp_t, comm_t) + p.forward_s * b.bytes / total_bytes  # compute ~ parameter bytes
        forward_comm, forward_end = sum(gathers), comp_t
        algos.add("ring")
    else:
        costs = []
        for b in buckets:
            c = 0.0
            for nbytes in bucket_bytes(p, b, opts):
                t, algo = cluster.allreduce(nbytes)
                c += t
                algos.add(algo)
            costs.append(c)
        forward_end = p.forward_s
    ready = [b.ready_s for b in buckets]
    comm = sum(costs) + forward_comm
    if n <= 1:
        comm_end, comm, forward_end = 0.0, 0.0, p.forward_s
    elif cluster.overlaps(profile.threads):
        comm_end = _stream(ready, costs)
    elif not sharded and cluster.nodes > 1:
        comm_end = _stream_on_busy_cores(p, cluster, buckets, costs, opts)
    else:  # no core left for communication: it runs instead of compute, not beside it
        comm_end = p.backward_s + sum(costs)
        forward_end = p.forward_s + forward_comm
    backward = max(p.backward_s, comm_end)
    k = max(1, opts.accumulation)
    micro = p.forward_s + p.backward_s
    total = (k - 1) * micro + forward_end + backward + optimizer
    if measured_beside:  # every step's first all-reduce waits for the slowest rank
        total += profile.straggler_s
    exposed = total - (k * micro + optimizer)
    samples = profile.batch * n * k
    return Prediction(
        n=n,
        per_rank_batch=profile.batch,
        step_s=total,
        forward_s=p.forward_s * k,
        backward_s=p.backward_s * k,
        optimizer_s=optimizer,
        comm_s=comm,
        exposed_s=max(0.0, exposed),
        buckets=len(buckets),
        algorithm="/".join(sorted(algos - {"-"})) or "-",
        samples_per_s=samples / total,
        options=opts.as_dict(),
        slow_link_bytes=slow_link_bytes(cluster, layout, sum(b.bytes for b in buckets)),
    )


def _tp_cost(group: Cluster, kind: str, nbytes: float) -> float:
    if kind == "allgather":
        return group.allgather(nbytes)
    if kind == "reduce_scatter":
        return group.reduce_scatter(nbytes)
    return group.allreduce(nbytes)[0]


# Host time per activation collective on a CPU rank, beyond the link's figure for it: DTensor's dispatch
# of the split layer's ops and the wait for the peer tensor rank at each of these in-line rendezvous,
# whose compute shares the cores. Fitted on benchmarks/tp_vs_fsdp.py's model (docs/planning.md, tensor
# parallelism on 2 CPU ranks): torch's TP(2) step less one tensor rank's share of the compute less the
# link's 8 all-reduces left 16-24 ms per step (2.0-2.9 ms each) in three windows; the one-rank mesh
# alone (no peer) showed 2-19 ms of dispatch per step. On CUDA the host runs ahead of the kernels and
# the waits are the link's: not charged.
TP_HOST_CPU_S = 2.4e-3


def tp_host_s(profile: Profile, opts: Options) -> tuple[float, float]:
    """(forward, backward) host seconds a CPU rank adds to its compute around the activation collectives."""
    if profile.device != "cpu":
        return 0.0, 0.0
    return len(opts.tp_forward) * TP_HOST_CPU_S, len(opts.tp_backward) * TP_HOST_CPU_S


def tensor_step(profile: Profile, cluster: Cluster, opts: Options) -> Prediction:
    """One step under tensor parallelism: `opts.tensor` ranks split each planned layer, the data
    dimensions (replicate x shard, FSDP2's; shard 1: an all-reduce, DDP's arithmetic) over the rest.

    Each rank computes 1/T of the profiled step (the split layers carry the step's matmuls: an upper
    bound on the gain, since norms, attention's softmax and the loss are not divided by every plan) and
    steps the optimizer over 1/T of the parameters; the split layers' activation collectives run on the
    tensor group's link (a node's, unless T exceeds a node) in line with the compute that needs them, so
    nothing hides them (torch's async TP overlaps them on CUDA; not modelled); on CPU ranks each
    collective adds host time, DTensor's dispatch and the wait for the peer (`tp_host_s`); the data
    dimensions then move 1/T of the gradients (and, sharded, the parameters) on their own ranks."""
    t, n = opts.tensor, cluster.n
    if n % t:
        raise problem(
            f"{n} devices do not split into tensor groups of {t}",
            f"Plan device counts that are multiples of {t} (--counts), or another --tensor-degree",
        )
    local = min(cluster.per_node, n)
    layout = build(
        ("replicate", "shard", "tensor"),
        ClusterShape(cluster.nodes * local, local),
        tensor=t,
        tensor_across_nodes=True,
    )
    group = replace(cluster, n=t)  # consecutive ranks: inside a node while t <= per_node
    k = max(1, opts.accumulation)
    fwd = sum(_tp_cost(group, kind, b * profile.batch) for kind, b in opts.tp_forward)
    bwd = sum(_tp_cost(group, kind, b * profile.batch) for kind, b in opts.tp_backward)
    host_fwd, host_bwd = tp_host_s(profile, opts)
    data = replace(cluster, n=n // t, per_node=max(1, local // t))
    # CPU ranks sharing cores: all n ranks compute at once, not only the n / T the data step below sees
    # (it applies its own slowdown, or none for a profile measured with n / T ranks beside): the rest here
    full = 1.0 if profile.ranks == n else cluster.compute_slowdown(profile.threads)
    seen = 1.0 if data.n > 1 and profile.ranks == data.n else data.compute_slowdown(profile.threads)
    p = profile.scaled(full / seen / t)
    # CPU ranks: host time around each collective, not divided by T, slowed by the shared cores as compute
    host_fwd, host_bwd = host_fwd * full / seen, host_bwd * full / seen
    stretch = (p.backward_s + host_bwd + bwd / seen) / p.backward_s if p.backward_s > 0 else 1.0
    p = replace(  # the collectives in line with the compute (over `seen`: the data step scales it back)
        p,
        forward_s=p.forward_s + host_fwd + fwd / seen,
        backward_s=p.backward_s + host_bwd + bwd / seen,
        params=tuple(replace(q, bytes=q.bytes // t, ready_s=q.ready_s * stretch) for q in p.params),
        state_bytes=p.state_bytes // t,
    )
    # shard 1: FSDP2's replicate mesh, one all-reduce of the gradients (DDP's arithmetic)
    inner = ("hsdp" if layout.replicate > 1 else "fsdp") if layout.shard > 1 else "ddp"
    got = step(p, data, replace(opts, tensor=1, strategy=inner, dims=(), tp_forward=(), tp_backward=()))
    tp_comm = k * (fwd + bwd)
    return replace(
        got,
        n=n,
        comm_s=got.comm_s + tp_comm,
        exposed_s=got.exposed_s + tp_comm,
        forward_s=got.forward_s - k * fwd,
        backward_s=got.backward_s - k * bwd,
        options=opts.as_dict(),
    )


def slow_link_bytes(cluster: Cluster, layout: Layout, nbytes: float) -> float:
    """Bytes each node sends between nodes per step for `nbytes` of gradients (parameters alike), on
    rings: a ring over all n ranks crosses out of each node once, carrying (n-1)/n of the data per
    all-gather or reduce-scatter (DDP's all-reduce is both: 2; FSDP's step is 3: two all-gathers and a
    reduce-scatter, 4 on gloo, whose reduce-scatter is an all-reduce); HSDP crosses only with its
    all-reduce of the node's shards between the m nodes, 2 (m-1)/m of the data. 0 on one node."""
    m, n = cluster.nodes, cluster.n
    if m <= 1:
        return 0.0
    if "shard" in layout.dims and "replicate" in layout.dims:
        return 2 * (m - 1) / m * nbytes
    if "shard" in layout.dims:
        return (4 if cluster.link.backend == "gloo" else 3) * (n - 1) / n * nbytes
    return 2 * (n - 1) / n * nbytes


def with_efficiency(preds: list[Prediction], base: Prediction) -> list[Prediction]:
    """Scaling efficiency: throughput at n over n times the one-rank throughput (1.0 is linear)."""
    return [replace(q, efficiency=q.samples_per_s / (q.n * base.samples_per_s)) for q in preds]
