"""Where fp16 residual codes lose neighbours that float32 vectors keep: a clump of 300
near-duplicate vectors (spread ``sigma`` per feature) far from its list's centroid, among
20,000 32-d Gaussian vectors in 64 lists, every list probed. A code's distance is off by
up to ~``2 * 2**-11 * |q - x| * |r|`` (``r``: the vector's residual to its centroid), so
where the clump's own spread is below that, the codes rank its vectors almost at random
and the exact re-rank of ``k + RERANK`` candidates finds only some of a query's ``k``
nearest. Recall@10 of 50 queries inside the clump, fp16 codes and float32 vectors, through
``ivf_search``. docs/retrieval.md, "Limits".

    python bench/fp16_clumps.py
"""

from __future__ import annotations

import json
import os

import numpy as np


def main() -> None:
    from orchestrator.retrieval.coarse import Coarse
    from orchestrator.retrieval.vectors import ivf_search, new_ivf

    rng, dim, k = np.random.default_rng(0), 32, 10
    base = rng.standard_normal((20_000, dim)).astype(np.float32)
    coarse = Coarse(base[rng.choice(len(base), 64, replace=False)], "l2", "flat")
    for sigma in (1e-2, 1e-3, 1e-4):
        at = (3 * rng.standard_normal(dim)).astype(np.float32)
        clump = (at + sigma * rng.standard_normal((300, dim))).astype(np.float32)
        x = np.concatenate([base, clump])
        q = (at + sigma * rng.standard_normal((50, dim))).astype(np.float32)
        truth = np.argsort(((q[:, None] - x[None]) ** 2).sum(-1), axis=1)[:, :k]
        residual = float(
            np.linalg.norm(at - coarse.flat.reconstruct(int(coarse.assign(at[None])[0] - 1)))
        )
        row = {"sigma": sigma, "residual": round(residual, 1)}
        for fp16 in (True, False):
            ivf = new_ivf(coarse, dim, "l2", fp16)
            ivf.add(x)
            _, got = ivf_search(ivf, coarse, q, k, np.ones(len(x), bool), 64, x)
            hits = [len(set(a) & set(b)) / k for a, b in zip(got, truth, strict=True)]
            row["fp16" if fp16 else "float32"] = round(float(np.mean(hits)), 3)
        print(json.dumps(row | {"load": round(os.getloadavg()[0], 1)}), flush=True)


if __name__ == "__main__":
    main()
