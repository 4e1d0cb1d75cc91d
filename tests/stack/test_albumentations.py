"""Albumentations transforms named by a recipe: run in the prefetch workers with the
recipe's seeded stream, equal to albumentations called directly with the same seed; only
the transforms the workers' allowlist names."""

from __future__ import annotations

import numpy as np

from claw_tasks.store import Store
from orchestrator import sample
from orchestrator.delivery.client import BatchClient
from orchestrator.transforms.augment import augment_rng
from tests.support.albu import DROPOUT, direct, images
from tests.support.stepdata import one_episode


def test_prefetched_batch_matches_albumentations_with_the_recipe_seed(
    redis_url, namespace, start_worker
):
    n = 64
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    frames = images(n)
    store.commit(one_episode(frames))
    start_worker("prefetch", 1)
    client = BatchClient(namespace, redis_url)
    recipe = client.register(
        {
            "name": "drop",
            "batch_size": 8,
            "fields": ["obs"],
            "sources": [{"name": "all"}],
            "seed": 11,
            "prefetch": {"depth": 1},
            "augment": {"obs": [{"albumentations": {"CoarseDropout": DROPOUT}}]},
        }
    )
    batch = client.pop("drop", timeout=60)
    client.close()
    # Batch k of a seeded recipe draws from default_rng([seed, version, k]): first its
    # augmentation seed, then the sampler (replayed here); the op's seed comes from the
    # augmentation's own stream.
    rng = np.random.default_rng([11, recipe.version, 1])
    seed = int(rng.integers(2**63))
    assert batch.seed == seed
    here = sample(store, recipe, rng=rng)
    np.testing.assert_array_equal(here.ids, batch.ids)
    expected = direct(store.get(batch.ids)["obs"], int(augment_rng(seed).integers(2**32)))
    np.testing.assert_array_equal(batch["obs"], expected)
    assert not np.array_equal(batch["obs"], store.get(batch.ids)["obs"])
