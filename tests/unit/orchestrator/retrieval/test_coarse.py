"""How a query finds its lists: the HNSW graph at a small ``nprobe`` over many lists, the
flat scan of every centroid from ``nlist / FLAT_SHARE`` on or over few lists (the exact
nearest lists); ``ivf_search`` answers each query with the nearest allowed rows of its
lists (fp16 codes re-ranked exactly: the exact distances and order), in the caller's
order, and never returns a masked row."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from orchestrator.retrieval.coarse import FLAT_SHARE, GRAPH_FROM, Coarse
from orchestrator.retrieval.vectors import FP16_SAFE, fits_fp16, ivf_search, new_ivf

DIM, N, NLIST = 16, 20_000, 2048


@pytest.fixture(scope="module")
def built():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, DIM), dtype=np.float32)
    centroids = x[rng.choice(N, NLIST, replace=False)].copy()
    coarse = Coarse(centroids, "l2", "hnsw", ef=16)
    ivf = new_ivf(coarse, DIM, "l2")  # a reader's: fp16 residual codes
    ivf.add(x)
    q = rng.standard_normal((300, DIM), dtype=np.float32)
    return x, centroids, coarse, ivf, q


def test_from_a_share_of_the_lists_on_the_flat_scan_finds_the_exact_nearest_lists(built):
    _, centroids, coarse, _, q = built
    large = NLIST // FLAT_SHARE
    assert coarse.uses_graph(large - 1) and not coarse.uses_graph(large)
    _, exact = faiss.knn(q, centroids, large)
    _, found = coarse.search(q, large)
    assert np.array_equal(found, exact)
    assert not Coarse(centroids, "l2", "flat").uses_graph(1)
    assert not Coarse(centroids[: GRAPH_FROM - 1], "l2", "hnsw").uses_graph(1)


def test_a_vectors_list_is_its_nearest_centroid(built):
    x, centroids, coarse, _, _ = built
    _, nearest = faiss.knn(x[:1000], centroids, 1)
    assert np.array_equal(coarse.assign(x[:1000]), nearest[:, 0] + 1)


@pytest.mark.parametrize(
    ("nprobe", "graph", "sorted_"),
    [(2, True, False), (7, True, True), (64, False, True)],  # 3, 10 and 92 lists probed
)
def test_ivf_search_scans_each_querys_lists_in_the_callers_order_under_the_mask(
    built, nprobe, graph, sorted_
):
    x, _, coarse, ivf, q = built
    mask = np.random.default_rng(4).random(N) < 0.7
    dist, rows = ivf_search(ivf, coarse, q, 10, mask, nprobe, x)
    assert not (~mask[rows[rows >= 0]]).any()  # no masked row
    probes = int(np.ceil(nprobe / (mask.sum() / N)))  # divided by the share kept
    assert coarse.uses_graph(probes) == graph and (len(q) * probes >= NLIST) == sorted_
    _, lists = coarse.search(q, probes)
    of = coarse.assign(x) - 1
    for i in range(len(q)):  # each query: an exact search of its lists' allowed rows
        rows_i = np.flatnonzero(mask & np.isin(of, lists[i]))
        d = ((x[rows_i] - q[i]) ** 2).sum(axis=1)
        best = np.argsort(d)[:10]
        found = len(best)  # -1 past the candidates of the probed lists
        assert np.array_equal(rows[i, :found], rows_i[best]) and (rows[i, found:] == -1).all()
        np.testing.assert_allclose(dist[i, :found], d[best], rtol=1e-4)


def test_vectors_beyond_fp16s_range_are_not_given_fp16_codes():
    assert fits_fp16(np.full((2, 3), FP16_SAFE / 2, np.float32))
    assert not fits_fp16(np.array([[0, -FP16_SAFE]], np.float32))
    assert not fits_fp16(np.array([[np.nan, 0]], np.float32))


def test_fp16_codes_for_dimensions_faiss_decodes_with_simd():
    centroids = np.random.default_rng(0).standard_normal((64, 24), dtype=np.float32)
    assert new_ivf(Coarse(centroids, "l2", "flat"), 24, "l2").code_size == 2 * 24
    odd = Coarse(centroids[:, :17].copy(), "l2", "flat")
    assert new_ivf(odd, 17, "l2").code_size == 4 * 17  # float32


def test_inner_product_answers_are_the_exact_ones_with_every_list_probed():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4000, DIM), dtype=np.float32)
    coarse = Coarse(x[:64].copy(), "ip", "flat")
    ivf = new_ivf(coarse, DIM, "ip")
    ivf.add(x)
    assert ivf.code_size == 2 * DIM  # fp16 residual codes, re-ranked by inner product
    q = rng.standard_normal((50, DIM), dtype=np.float32)
    mask = rng.random(len(x)) < 0.8
    dist, rows = ivf_search(ivf, coarse, q, 10, mask, 64, x)
    allowed = np.flatnonzero(mask)
    want = allowed[np.argsort(-(q @ x[allowed].T), axis=1, kind="stable")[:, :10]]
    assert (rows == want).all()  # largest inner product first
    np.testing.assert_allclose(dist, np.take_along_axis(q @ x.T, want, axis=1), rtol=1e-5)
