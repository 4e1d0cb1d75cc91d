"""Sums (for proportional draws) and maxima over a fixed number of leaves, all vectorized.

:class:`SumTree` keeps prefix sums in blocks of blocks (its docstring); :class:`MaxTree` is a B-ary
tree: level 0 holds the leaves, each level above the maxima of blocks of ``B`` nodes of
the level below, up to a single root. Both recompute what an update touches from the
leaves (no drift).
"""

from __future__ import annotations

import numpy as np

B = 16  # MaxTree's fan-out
S = 32  # SumTree's block
TOP = S**3  # SumTree's top level keeps the prefix sums of at most this many nodes whole


class _Tree:
    _ufunc: np.ufunc
    _fill: float

    def __init__(self, leaves: np.ndarray, dtype: type = np.float64):
        x = np.asarray(leaves, dtype=dtype)
        self.levels: list[np.ndarray] = []
        while True:
            level = np.full(-(-max(len(x), 1) // B) * B, self._fill, dtype=dtype)
            level[: len(x)] = x
            self.levels.append(level)
            if len(level) == B:
                break
            x = self._reduce(level)
        self.root = self._ufunc.reduce(self.levels[-1])

    def _reduce(self, level: np.ndarray) -> np.ndarray:
        """Reduce blocks of B by repeated halving (much faster than a short-axis reduce)."""
        for _ in range(B.bit_length() - 1):
            level = self._ufunc(level[0::2], level[1::2])
        return level

    def update(self, idx: np.ndarray, values: np.ndarray) -> None:
        """Set leaves ``idx`` (sorted, unique) to ``values`` and recompute their ancestors."""
        changed = self.levels[0][idx] != values
        idx, values = idx[changed], values[changed]
        if not len(idx):
            return
        self.levels[0][idx] = values
        for lower, upper in zip(self.levels, self.levels[1:], strict=False):
            idx //= B
            idx = idx[np.concatenate(([True], idx[1:] != idx[:-1]))]
            upper[idx] = self._reduce(lower.reshape(-1, B).take(idx, axis=0).ravel())
        self.root = self._ufunc.reduce(self.levels[-1])


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
        changed = self.leaves[idx] != values
        idx = idx[changed]
        if not len(idx):
            return
        self.leaves[idx] = values[changed]
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
            # the first node whose prefix sum exceeds u (a zero node repeats its predecessor's)
            j = np.count_nonzero(sums <= u[:, None], axis=1)
            u -= np.where(j > 0, sums[pick, j - 1], 0.0)
            node = node * S + j
        return node


class MaxTree(_Tree):
    """Maxima of the leaves (``-inf`` = no value)."""

    _ufunc = np.maximum
    _fill = -np.inf

    @property
    def max(self) -> float:
        """Largest leaf, ``-inf`` when there is none."""
        return float(self.root)
