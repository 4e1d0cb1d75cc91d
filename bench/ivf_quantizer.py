"""IVF's coarse quantizer: flat (what retrieval runs) against HNSW over the same centroids.

    python bench/ivf_quantizer.py      # needs faiss-cpu; 1M x 32 states, 4,096 lists

Same states, queries and k-means as bench/ann.py; recall@10 against an exact scan, and the
median CPU time of a 256-state batch at k = 10 over 40 batches, one thread.
"""

from __future__ import annotations

import time

import faiss
import numpy as np
from statesets import states


def main() -> None:
    faiss.omp_set_num_threads(1)
    x, q = states(1_000_000, seed=0), states(1024, seed=99)
    _, truth = faiss.knn(q, x, 10)
    sample = x[np.random.default_rng(1).choice(len(x), 39 * 4096, replace=False)]
    km = faiss.Kmeans(32, 4096, niter=10, seed=1234)
    km.train(sample)
    for name in ("flat", "hnsw"):
        quant = faiss.IndexFlatL2(32) if name == "flat" else faiss.IndexHNSWFlat(32, 32)
        if name == "hnsw":
            quant.hnsw.efSearch = 64
        quant.add(km.centroids)
        ivf = faiss.IndexIVFFlat(quant, 32, 4096)
        ivf.is_trained = True
        ivf.add(x)
        for nprobe in (8, 16):
            ivf.nprobe = nprobe
            found = np.concatenate([ivf.search(q[i : i + 256], 10)[1] for i in range(0, 1024, 256)])
            hits = [len(set(a) & set(b)) / 10 for a, b in zip(found, truth, strict=True)]
            cpu = []
            for r in range(40):
                c = time.process_time()
                ivf.search(q[(r % 4) * 256 : (r % 4 + 1) * 256], 10)
                cpu.append(time.process_time() - c)
            print(name, nprobe, round(float(np.mean(hits)), 4), round(np.median(cpu) * 1e3, 2))


if __name__ == "__main__":
    main()
