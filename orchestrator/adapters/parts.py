"""A batch as the parts it serves: a recipe registered ``parts`` times larger than a
trainer's sample serves ``parts`` samples from each popped batch."""

from __future__ import annotations

from orchestrator.sampling.batch import Batch


def split(batch: Batch, parts: int, *, contiguous: bool = False) -> list[Batch]:
    """``batch`` as ``parts`` batches of rows ``j::parts`` (views, no copy). Strided, not
    contiguous: a recipe lays its sources' rows out one source after another, so each part
    keeps the mix of sources. Rows are independent draws, so each part is a batch of the
    same recipe; importance weights stay normalized over the whole batch. ``contiguous``:
    part ``j`` is rows ``j*m:(j+1)*m`` (a batch whose recipe's ``layout.parts`` put each
    part's rows together)."""
    if contiguous:
        m = len(batch) // parts
        return [batch.take(slice(j * m, (j + 1) * m)) for j in range(parts)]
    return [batch.take(slice(j, None, parts)) for j in range(parts)]
