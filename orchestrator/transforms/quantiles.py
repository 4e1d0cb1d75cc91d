"""Running quartiles of feature vectors, for IQR outlier rules: a mergeable uniform sample.

Quantiles, unlike a mean and a variance, do not merge from summaries. A
:class:`QuantileSample` keeps a uniform sample instead: every row merged in carries a random
key and the sample keeps the ``size`` rows with the smallest keys (a bottom-k sample), so
merging batches in any order, on any worker, gives the same sample, and its quartiles
estimate those of everything merged so far (a few percent of the IQR at 2,048 rows). The
keys come from the caller (a seeded stream per batch, so replaying a batch gives it the
same keys).
"""

from __future__ import annotations

import numpy as np

SAMPLE_ROWS = 2048
"""Rows a sample keeps."""


class QuantileSample:
    """A bottom-``size`` sample of rows (float32 ``(n, d)``) and how many rows it stands for."""

    def __init__(self, size: int = SAMPLE_ROWS) -> None:
        self.size = size
        self.count = 0
        self.keys = np.zeros(0, np.float64)
        self.rows = np.zeros((0, 0), np.float32)

    @classmethod
    def of(cls, rows: np.ndarray, keys: np.ndarray, size: int = SAMPLE_ROWS) -> QuantileSample:
        """The sample of one batch: ``rows`` (first axis: samples), ``keys`` uniform in [0, 1)."""
        st = cls(size)
        flat = np.asarray(rows, np.float32).reshape(len(rows), -1)
        st.count = len(flat)
        keep = np.argsort(keys, kind="stable")[:size]
        st.keys, st.rows = np.asarray(keys, np.float64)[keep], flat[keep]
        return st

    def merge(self, other: QuantileSample) -> None:
        """Fold in another sample (of other rows)."""
        if not other.count:
            return
        if self.count and self.rows.shape[1] != other.rows.shape[1]:
            raise ValueError(f"{other.rows.shape[1]} features, the sample has {self.rows.shape[1]}")
        keys = np.concatenate([self.keys, other.keys])
        rows = other.rows if not self.count else np.concatenate([self.rows, other.rows])
        keep = np.argsort(keys, kind="stable")[: self.size]
        self.keys, self.rows = keys[keep], rows[keep]
        self.count += other.count

    def quartiles(self) -> tuple[np.ndarray, np.ndarray]:
        """The first and third quartile of each feature."""
        q1, q3 = np.quantile(self.rows.astype(np.float64), [0.25, 0.75], axis=0)
        return q1, q3

    def outside(self, rows: np.ndarray, k: float) -> np.ndarray:
        """Which of ``rows`` have a feature outside Tukey's fences ``[q1 - k * IQR, q3 + k *
        IQR]``. A feature whose quartiles coincide (constant, or one value three times in
        four, as a one-hot's) has no spread to judge by and is not checked."""
        q1, q3 = self.quartiles()
        iqr = q3 - q1
        flat = np.asarray(rows, np.float64).reshape(len(rows), -1)
        with np.errstate(invalid="ignore"):
            out = ((flat < q1 - k * iqr) | (flat > q3 + k * iqr)) & (iqr > 0)
        return out.any(axis=1)
