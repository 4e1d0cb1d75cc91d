"""Sums (for proportional draws) and maxima over a fixed number of leaves, all vectorized.

:class:`SumTree` keeps prefix sums in blocks of blocks, :class:`MaxTree` the maxima of
blocks of leaves (their docstrings). Both recompute what an update touches from the
leaves (no drift).
"""

from __future__ import annotations

import numpy as np

MAX_BLOCK = 1024  # MaxTree's leaves per block
S = 32  # SumTree's block
TOP = S**3  # SumTree's top level keeps the prefix sums of at most this many nodes whole


class SumTree:
    """Sums of non-negative leaves; :meth:`find` maps uniforms to leaves proportionally.

    Blocks of ``S`` nodes keep their float64 inclusive prefix sums; the block totals are the
    nodes of the level above, up to a top level of at most ``TOP`` nodes, which keeps its
    prefix sums whole. A draw is one ``searchsorted`` over the top (in cache), then per
    level a count of the prefix sums at or below the rest of its uniform in the block it
    reached: one gather of ``S`` contiguous values, no short-axis ``cumsum`` (a 16-ary
    descent made ~6 numpy calls of which one was a cumsum per level; a ``searchsorted``
    over all leaves waits for a cache miss at nearly every step of each draw, ~0.4 ms for
    256 draws at 2M leaves). Updates recompute the touched blocks from their nodes (no
    drift).
    """

    def __init__(self, leaves: np.ndarray) -> None:
        x = np.asarray(leaves, dtype=np.float64)
        blocks, m = [], max(len(x), 1)  # per level below the top: its blocks
        while m > TOP:
            m = -(-m // S)
            blocks.append(m)
        self.leaves = np.zeros(blocks[0] * S if blocks else m)
        """The leaf values (padded with zeros to whole blocks)."""
        self.leaves[: len(x)] = x
        # per level: (blocks, S) inclusive prefix sums, rows padded to the next level's blocks
        self._local = [np.zeros((nxt * S, S)) for nxt in blocks[1:]]
        self._local += [np.zeros((blocks[-1], S))] if blocks else []
        nodes = self.leaves
        for local in self._local:
            np.cumsum(nodes.reshape(-1, S), axis=1, out=local[: len(nodes) // S])
            nodes = local[:, -1]  # the block totals: the nodes of the level above
        self._top = np.cumsum(nodes)

    @property
    def total(self) -> float:
        """Sum of all leaves."""
        return float(self._top[-1])

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (sorted, unique) to ``values`` and recompute their blocks."""
        if not len(idx := _set_changed(self.leaves, idx, values)):
            return
        nodes = self.leaves
        for local in self._local:  # the touched blocks of each level, from their nodes
            b = idx // S
            idx = b[np.concatenate(([True], b[1:] != b[:-1]))]
            # indexing, not take: take copies a strided array (the totals) whole first
            local[idx] = np.cumsum(nodes.reshape(-1, S)[idx], axis=1)
            nodes = local[:, -1]
        np.cumsum(nodes, out=self._top)

    def find(self, u: np.ndarray) -> np.ndarray:
        """Leaf index for each ``u`` in ``[0, total)``: leaf i is hit with prob. leaf_i/total.

        Needs ``total > 0``; a leaf of value 0 is never returned.
        """
        top = self._top
        u = np.minimum(u, np.nextafter(top[-1], 0.0))  # rounding at the top edge
        node = np.searchsorted(top, u, side="right")  # top[node-1] <= u < top[node]: mass
        below = top.take(node - 1)
        below[node == 0] = 0.0
        u -= below  # >= 0 (below <= u)
        pick = np.arange(len(u))
        for local in reversed(self._local):
            sums = local.take(node, axis=0)
            np.minimum(u, np.nextafter(sums[:, -1], 0.0), out=u)  # < the block's total
            # the first node whose prefix sum exceeds u (a zero node repeats its predecessor's):
            # the rows are non-decreasing and their last exceeds u, so an argmax finds it
            # (a count over the short axis of the compares costs ~6x more)
            j = np.argmax(sums > u[:, None], axis=1)
            u -= np.where(j > 0, sums[pick, j - 1], 0.0)
            node = node * S + j
        return node


class MaxTree:
    """Maxima of the leaves (``-inf`` = no value): the leaves in blocks of ``MAX_BLOCK``
    and each block's maximum. An update recomputes the blocks it touches and the maximum
    of the block maxima (at 1M leaves ~1,000: in cache): ~8 numpy calls where the 16-ary
    tree it replaced made ~10 per level, 5 levels at 1M (``docs/benchmarks.md``)."""

    def __init__(self, leaves: np.ndarray, dtype: type = np.float64) -> None:
        x = np.asarray(leaves, dtype=dtype)
        n = -(-max(len(x), 1) // MAX_BLOCK) * MAX_BLOCK
        self.leaves = np.full(n, -np.inf, dtype=dtype)
        """The leaf values (padded with ``-inf`` to whole blocks)."""
        self.leaves[: len(x)] = x
        self._blocks = self.leaves.reshape(-1, MAX_BLOCK).max(axis=1)
        self.root = self._blocks.max()

    @property
    def max(self) -> float:
        """Largest leaf, ``-inf`` when there is none."""
        return float(self.root)

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (sorted, unique) to ``values`` and recompute their blocks."""
        if not len(idx := _set_changed(self.leaves, idx, values)):
            return
        b = idx // MAX_BLOCK
        b = b[np.concatenate(([True], b[1:] != b[:-1]))]
        self._blocks[b] = self.leaves.reshape(-1, MAX_BLOCK)[b].max(axis=1)
        self.root = self._blocks.max()


def _set_changed(leaves: np.ndarray, idx: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Write ``values`` at ``idx`` where they differ; the leaves that changed (their
    blocks are the ones to recompute)."""
    changed = leaves[idx] != values
    hit = idx[changed]
    leaves[hit] = values[changed]
    return hit
