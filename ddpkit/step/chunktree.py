r"""The fixed binary tree that makes a sum of chunk gradients the same on 1, 2, 4, ... ranks.

Floating-point addition is commutative but not associative: a + b == b + a bit for bit, while
(a + b) + c may differ from a + (b + c). A sum is therefore reproducible when its *tree* is fixed.
`ddpkit.step.invariant` fixes the tree over the global chunk index: the C chunks of a step (C a power
of two) are the leaves of one balanced binary tree, and every internal node is (left + right).

    chunk:   0   1   2   3   4   5   6   7          C = 8
              \ /     \ /     \ /     \ /
              01      23      45      67            rank r of W = 2 holds chunks 4r..4r+3:
                \    /          \    /               its partial sum is the node 0123 or 4567
                0123              4567
                     \          /
                      01234567                       the same node, whatever W

Within a rank, `TreeSum` adds chunks in index order like a binary counter: a new leaf is merged with
the top of the stack while both cover subtrees of the same size, so at most log2(n) + 1 buffers are
alive and the additions are exactly the tree's (a subtree of a power-of-two size starting at a
multiple of its size is a node of the global tree). Across ranks, `combine` applies the same rule to
the W partial sums in rank order: rank r's range starts at r * n, so they are the tree's nodes of one
level, and pairing them finishes the same tree every rank and every world size computes.

No process group and no model here: plain tensors, testable in one process.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddpkit.errors import problem


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


class TreeSum:
    """Pairwise sum of leaves added in order; `total()` once the count is a power of two."""

    def __init__(self) -> None:
        self._stack: list[tuple[int, torch.Tensor]] = []  # (subtree size, its sum), sizes decreasing
        self.leaves = 0
        self.peak_buffers = 0  # the most sums alive at once (log2(n) + 1 for n leaves)

    def add(self, leaf: torch.Tensor) -> None:
        """Add the next leaf (the caller's tensor is kept and summed into in place: pass a fresh one)."""
        size, node = 1, leaf
        while self._stack and self._stack[-1][0] == size:
            _, left = self._stack.pop()
            node = left.add_(node)  # left + right: the tree's order (addition itself is commutative)
            size *= 2
        self._stack.append((size, node))
        self.leaves += 1
        self.peak_buffers = max(self.peak_buffers, len(self._stack))

    def total(self) -> torch.Tensor:
        """The root: the sum of all leaves along the balanced tree."""
        if len(self._stack) != 1:
            raise problem(
                f"{self.leaves} chunk(s) were added, not a power of two, so they are no balanced tree",
                "Give each rank a power-of-two number of chunks (global batch = chunk x C, C a power of two)",
            )
        return self._stack[0][1]


def combine(parts: Sequence[torch.Tensor], *, fresh: bool = False) -> torch.Tensor:
    """The ranks' partial sums (rank order; each a node of the same level) summed along the tree.
    `fresh`: the parts are the caller's scratch buffers (an all-gather's), summed into in place."""
    if not is_power_of_two(len(parts)):
        raise problem(f"{len(parts)} partial sums are not a power of two", "Use 1, 2, 4, 8, ... ranks")
    tree = TreeSum()
    for part in parts:
        tree.add(part if fresh else part.clone())
    return tree.total()
