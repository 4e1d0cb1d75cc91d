"""A batch as the parts it serves: a recipe registered ``parts`` times larger than a
trainer's sample serves ``parts`` samples from each popped batch."""

from __future__ import annotations

import numpy as np

from orchestrator.sampling.batch import Batch


def split(batch: Batch, parts: int) -> list[Batch]:
    """``batch`` as ``parts`` batches of rows ``j::parts`` (views, no copy). Strided, not
    contiguous: a recipe lays its sources' rows out one source after another, so each part
    keeps the mix of sources. Rows are independent draws, so each part is a batch of the
    same recipe; importance weights stay normalized over the whole batch."""
    return [batch.take(slice(j, None, parts)) for j in range(parts)]


def interleaved(batch: Batch, parts: int) -> Batch:
    """``batch`` with the rows of :func:`split`'s part ``j`` (``j::parts``) at
    ``j*m:(j+1)*m``, ``m = len(batch) // parts``: one gather into fresh arrays, so a
    conversion of the whole batch cuts into the parts by contiguous views."""
    return batch.take(np.arange(len(batch)).reshape(-1, parts).T.ravel())
