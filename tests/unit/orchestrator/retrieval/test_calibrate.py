"""``nprobe`` calibrated to a recall target: held-out states reach it where a fixed
``nprobe`` does not, a higher target probes more, and the queries are whole episodes the
exact search leaves out; a definition stored with the fixed default is read as calibrated."""

from __future__ import annotations

import json

import faiss
import numpy as np
import pytest

from orchestrator.retrieval import calibrate as calibrate_module
from orchestrator.retrieval.calibrate import MIN_GROUPS, SAMPLE, calibrate, held_out
from orchestrator.retrieval.coarse import Coarse, quantizer
from orchestrator.retrieval.spec import IndexSpec
from orchestrator.retrieval.storage import stored_spec
from orchestrator.retrieval.vectors import ivf_search, new_ivf
from orchestrator.retrieval.writer import train_centroids

DIM, N, NLIST = 16, 30_000, 256
EPISODES = np.arange(N) // 100


@pytest.fixture(scope="module")
def built():
    """30,000 i.i.d. Gaussian states in episodes of 100, 256 lists, as the writer builds
    them; 500 held-out states; their exact 10 nearest."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, DIM), dtype=np.float32)
    out = held_out(EPISODES, rng)  # as the writer: held-out episodes are not trained on
    pool = np.flatnonzero(~out)
    centroids = train_centroids(x[rng.choice(pool, 39 * NLIST, replace=False)], NLIST, False)
    readers = Coarse(centroids, "l2")
    lists = readers.assign(x) - 1
    ivf = new_ivf(readers, DIM, "l2")
    ivf.add(x)
    q = rng.standard_normal((500, DIM), dtype=np.float32)
    _, truth = faiss.knn(q, x, 10)
    return x, centroids, lists, (ivf, readers, x), q, truth, out


def held_out_recall(ivf, q, truth, nprobe: int) -> float:
    """Recall@10 of ``q`` as readers search (``ivf_search``, no row masked)."""
    index, readers, x = ivf
    _, found = ivf_search(index, readers, q, 10, np.ones(N, bool), nprobe, x)
    return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found, truth, strict=True)]))


def test_the_calibrated_nprobe_reaches_the_target_where_a_fixed_one_misses(built):
    x, centroids, lists, ivf, q, truth, out = built
    spec = IndexSpec()
    cal = calibrate(x, lists, centroids, spec, ivf[1], EPISODES, out)
    assert cal.bound >= spec.recall and cal.recall >= cal.bound
    assert held_out_recall(ivf, q, truth, cal.nprobe) >= spec.recall
    assert held_out_recall(ivf, q, truth, 12) < spec.recall  # a fixed nprobe of 12


def test_a_higher_target_probes_more_lists(built):
    x, centroids, lists, _, _, _, out = built
    readers = Coarse(centroids, "l2")
    got = [
        calibrate(x, lists, centroids, IndexSpec(recall=r), readers, EPISODES, out).nprobe
        for r in (0.8, 0.95, 0.99)
    ]
    assert got[0] < got[1] < got[2] <= NLIST


def test_queries_are_whole_episodes_left_out_of_the_exact_search():
    groups = np.repeat(np.arange(1000), 50)  # 1,000 episodes of 50 steps
    out = held_out(groups, np.random.default_rng(0))
    whole = np.unique(groups[out])
    assert np.isin(groups, whole).sum() == out.sum()  # every step of a held-out episode
    assert len(whole) >= MIN_GROUPS and out.sum() >= SAMPLE
    few = held_out(np.repeat(np.arange(8), 50), np.random.default_rng(0))
    assert few.sum() == 50  # one episode: at most an eighth of the vectors, at least one
    alone = held_out(np.zeros(400, np.int64), np.random.default_rng(0))  # one episode
    assert alone.sum() == 50  # single vectors: an eighth of them
    fresh = groups >= 900  # written since the last training: only their episodes
    assert (groups[held_out(groups, np.random.default_rng(0), fresh)] >= 900).all()
    endless = held_out(np.repeat([0, 1], 400), np.random.default_rng(0))  # two episodes
    assert endless.sum() == 100  # neither whole (each is half): single vectors, an eighth


def test_a_stored_definition_with_the_fixed_default_is_calibrated_one_naming_recall_kept():
    fixed_default = IndexSpec(nprobe=12).model_dump(exclude={"recall"})
    assert stored_spec(json.dumps(fixed_default).encode()).nprobe is None
    pinned = IndexSpec(nprobe=12).model_dump_json().encode()  # written with ``recall``
    assert stored_spec(pinned).nprobe == 12
    assert stored_spec(IndexSpec().model_dump_json().encode()) == IndexSpec()


def test_two_level_training_gives_no_list_to_a_few_far_states():
    """A first-level cluster of three states far from every other is too small for a list
    of its own (faiss's two_level_clustering fails on it): its share goes elsewhere."""
    from faiss.contrib.clustering import two_level_clustering

    x = np.random.default_rng(0).standard_normal((4 * 8192, 4)).astype(np.float32)
    x[:3] += 1000
    with pytest.raises(RuntimeError):  # what the writer met on a Gaussian mixture at 1M
        args = {"clustering_niter": 10, "min_points_per_centroid": 1, "seed": 1234}
        two_level_clustering(x, 91, 8192, verbose=False, **args)
    centroids = train_centroids(x, 8192, False)
    assert centroids.shape == (8192, 4) and np.isfinite(centroids).all()
    # The far states join the list of their nearest centroid and are found there.
    ivf = faiss.IndexIVFFlat(quantizer(centroids, "l2"), 4, 8192)
    ivf.is_trained = True
    ivf.add(x)
    _, found = ivf.search(x[:3], 3, params=faiss.SearchParametersIVF(nprobe=1))
    assert (np.sort(found, axis=1) == [0, 1, 2]).all()


@pytest.mark.parametrize("ip", [False, True])
def test_the_exact_search_by_parts_finds_what_one_search_does(built, monkeypatch, ip):
    x, _, _, _, q, _, out = built
    monkeypatch.setattr(calibrate_module, "EXACT_ROWS", 1000)
    base = np.flatnonzero(~out)
    got = calibrate_module.exact_neighbours(q, x, base, ip)
    fm = faiss.METRIC_INNER_PRODUCT if ip else faiss.METRIC_L2
    _, want = faiss.knn(q, x[base], 10, metric=fm)
    assert (np.sort(got, axis=1) == np.sort(base[want], axis=1)).all()
