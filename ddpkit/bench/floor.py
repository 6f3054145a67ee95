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
