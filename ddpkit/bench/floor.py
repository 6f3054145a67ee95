"""The floor of a data-parallel step on CPU ranks of one machine: the gradient exchange at copy bandwidth.

    bw = copy_bandwidth()                                   # bytes copied per second by one core
    ms = exchange_floor_s(grad_bytes, world=2, copy_bps=bw) * 1e3
    print(floor_line(measured_s, one_process_s, grad_bytes, world=2, copy_bps=bw))

Why: on one machine, C ranks x 1 thread do the same arithmetic as 1 process x C threads; what ranks
add is moving gradients between processes, which no core can hide when every core runs a rank. The
least any exchange must move, per rank, with G bytes of gradients over W ranks (a copy of n bytes =
n read + n written; traffic counted as bytes read plus bytes written):

- reduce-scatter: write the others' shares of its gradients where they can read them (G(W-1)/W read,
  G(W-1)/W written), then sum its own share: read its own part and the W-1 others' (G), write G/W;
- all-gather of the updated share: its share out (2 G/W), the others' shares in (2 G(W-1)/W).

Together G (5W - 1) / W of traffic (4.5 G at W = 2), moved at one core's copy bandwidth c (bytes
copied per second, 2c of traffic). The step's floor is the one-process step plus that time. ddpkit's
reduce-scatter step (`ddpkit.step.shard_exchange`) moves G (5W + 1) / W (5.5 G at W = 2: it streams
the whole gradient through its slot, 2 G instead of 2 G(W-1)/W, the same slot layout on every rank),
so it can approach the floor, not reach it. `measured / floor` says how close a run is.

FSDP (`fsdp_traffic`, `fsdp_floor_s`): FSDP2 keeps only a shard of each parameter and exchanges P bytes
of parameters (= G of gradients) three times a step: an all-gather before forward, another before
backward (`reshard_after_forward=True`, the default) and a reduce-scatter of the gradients. Its floor
counts the copies torch 2.13's FSDP2 makes below the custom-collective API (`_fsdp_collectives.py`),
which no collective can avoid, and lets the collective itself add nothing beyond them:

- all-gather: FSDP2 copies the shard into its rank's chunk of the output the collective allocated
  (`all_gather_copy_in`, P/W copied); if that output is shared memory this copy is the publishing, and
  the others' chunks are already there; then FSDP2 copies the whole output out into each parameter's
  own storage (`split_with_sizes_copy`, P copied), which the module computes with and which FSDP2
  frees after the block. Least: P (W + 1) / W copied, 2 P (W + 1) / W of traffic, twice a step;
- reduce-scatter: FSDP2 copies every unsharded gradient into the collective's input
  (`foreach_reduce_scatter_copy_in`, G copied; autograd wrote each gradient to its own tensor); if
  that input is shared memory it is the publishing; then this rank sums its share of every rank's
  input (G read, G/W written; the division by W applied as the values are read). The output is the
  sharded gradient itself (FSDP2 views it): no copy-out. Least: 3 G + G/W of traffic.

Together G (7 W + 5) / W per rank per step (9.5 G at W = 2), against 4.5 G for DDP's least exchange:
FSDP moves more, and every byte on the step's critical path (CPU ranks have no side streams). What
ddpkit's shared-memory FSDP path moves is `fsdp_ddpkit_traffic`. Not counted: page faults (FSDP2 frees
each block's parameter storages after use and allocates them again, fresh pages from the kernel on
ranks that return freed blocks) and the optimizer's DTensor dispatch: costs of the measured step, not
of moving bytes.
"""

from __future__ import annotations

import statistics
import time

import torch

COPY_BYTES = 64 * 2**20  # well past the last-level cache of a CPU: memory, not cache, bandwidth


def copy_bandwidth(nbytes: int = COPY_BYTES, reps: int = 7) -> float:
    """Bytes copied per second by one thread (`b.copy_(a)`), median of `reps` after one warm-up."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(nbytes // 4)
        b = torch.empty_like(a)
        b.copy_(a)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            b.copy_(a)
            times.append(time.perf_counter() - start)
        return nbytes / statistics.median(times)
    finally:
        torch.set_num_threads(threads)


def ideal_traffic(grad_bytes: float, world: int) -> float:
    """Bytes read + written per rank by the least exchange: reduce-scatter, then all-gather (module doc)."""
    g, w = float(grad_bytes), world
    reduce_scatter = 2 * g * (w - 1) / w + g + g / w
    all_gather = 2 * g
    return reduce_scatter + all_gather


def ddpkit_traffic(grad_bytes: float, world: int) -> float:
    """Bytes read + written per rank by ddpkit's shm reduce-scatter step: the whole gradient through the
    slot (2 G), the share summed (G + G/W), the all-gather (2 G)."""
    g = float(grad_bytes)
    return 2 * g + g + g / world + 2 * g


def exchange_floor_s(grad_bytes: float, world: int, copy_bps: float) -> float:
    """Seconds the least exchange takes at `copy_bps` (bytes copied per second: 2x that in traffic)."""
    return ideal_traffic(grad_bytes, world) / (2 * copy_bps) if world > 1 else 0.0


def grad_bytes_of(model: torch.nn.Module) -> int:
    """The bytes of the gradients a step exchanges: every trained parameter's."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def floor_line(
    measured_s: float, one_process_s: float, grad_bytes: float, world: int, copy_bps: float
) -> str:
    """One line: the ranks' measured step against the floor (the one-process step + the least exchange)."""
    exchange = exchange_floor_s(grad_bytes, world, copy_bps)
    floor = one_process_s + exchange
    return (
        f"floor: {grad_bytes / 1e6:.0f} MB of gradients over {world} ranks at {copy_bps / 1e9:.1f} GB/s "
        f"(one core's copy) cannot be exchanged in less than {exchange * 1e3:.1f} ms; with the one-process "
        f"step ({one_process_s * 1e3:.0f} ms) the floor is {floor * 1e3:.0f} ms "
        f"({floor / one_process_s:.2f}x it); measured {measured_s * 1e3:.0f} ms = "
        f"{measured_s / floor:.2f}x the floor"
    )


def fsdp_traffic(param_bytes: float, world: int) -> float:
    """Bytes read + written per rank per step by FSDP2's least exchange over shared memory (module doc):
    two all-gathers of P (W + 1) / W copied each (shard in, whole block out to the parameters) and a
    reduce-scatter of G copied in plus G read and G/W written by the sum."""
    p, w = float(param_bytes), world
    all_gather = 2 * (p / w + p)
    reduce_scatter = 2 * p + p + p / w
    return 2 * all_gather + reduce_scatter


def fsdp_ddpkit_traffic(param_bytes: float, world: int, shared_output: bool = False) -> float:
    """Bytes read + written per rank per step by ddpkit's FSDP path (`ddpkit.parallel.fsdp_shm`). Per
    all-gather: FSDP2's copy-in (P/W) and copy-out (P), plus, unless the output is itself in shared
    memory (`shared_output`), the shard into the slot (P/W) and the others' slots into the output
    (P (W-1)/W). Reduce-scatter: FSDP2's copy-in (G), the input divided into the slot (G read, G
    written), the share summed (G read, G/W written)."""
    p, w = float(param_bytes), world
    all_gather = 2 * (p / w + p) + (0.0 if shared_output else 2 * (p / w + p * (w - 1) / w))
    reduce_scatter = 2 * p + 2 * p + p + p / w
    return 2 * all_gather + reduce_scatter


def fsdp_floor_s(compute_s: float, param_bytes: float, world: int, copy_bps: float, cores: int) -> float:
    """The least FSDP step: a rank's compute plus its least exchange (`fsdp_traffic`) at `copy_bps`
    (bytes copied per second, 2x that in traffic); ranks beyond `cores` (1 thread each) share them, so
    W > cores stretches both by W / cores. `compute_s` is one rank's arithmetic alone: forward and
    backward on its part of the batch, the optimizer on its shard."""
    exchange = fsdp_traffic(param_bytes, world) / (2 * copy_bps) if world > 1 else 0.0
    return (compute_s + exchange) * max(1.0, world / cores)


def fsdp_floor_line(
    measured_s: float,
    compute_s: float,
    param_bytes: float,
    world: int,
    copy_bps: float,
    cores: int,
    shared_output: bool = True,
) -> str:
    """One line: the FSDP step measured against `fsdp_floor_s`, and what ddpkit's path moves (with the
    all-gather output in shared memory, `fsdp_shm.SHARED_GATHER`, or not)."""
    least = fsdp_traffic(param_bytes, world)
    ours = fsdp_ddpkit_traffic(param_bytes, world, shared_output)
    floor = fsdp_floor_s(compute_s, param_bytes, world, copy_bps, cores)
    stretch = f" x {world / cores:.1f} ({world} ranks on {cores} cores)" if world > cores else ""
    return (
        f"FSDP floor at {world} ranks: compute {compute_s * 1e3:.0f} ms + least exchange "
        f"{least / 1e6:.0f} MB read+written at {copy_bps / 1e9:.1f} GB/s copied "
        f"({least / (2 * copy_bps) * 1e3:.0f} ms){stretch} = {floor * 1e3:.0f} ms; measured "
        f"{measured_s * 1e3:.0f} ms = {measured_s / floor:.2f}x the floor (ddpkit's path moves "
        f"{ours / 1e6:.0f} MB, {ours / (2 * copy_bps) * 1e3:.0f} ms at that rate)"
    )
