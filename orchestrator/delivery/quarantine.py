"""Quarantining steps by rule, and a recipe's own cleaning (``clean:``) in the prefetch
workers.

A quarantined step is curated ``trainable: false``, ``quality: quarantine``: never
deleted (``not trainable`` finds it; sampling and ``nearest`` never return it), and
counted by rule in ``claw:{ns}:clean:counts`` as ``<who>:<rule>`` (a source's name, or
``recipe/<name>`` for a recipe's cleaning), which ``claw stats`` prints. The maintenance
task that cleans sources (orchestrator/maintenance/cleaning.py) quarantines through here
too, and keeps its dedup digests here (:func:`seen_before`, ``lua/dedup.lua``).

A recipe's cleaning maps the drawn batch's fields and checks its rules and outliers; a
batch with a failing row is not served: its bad steps are quarantined (for the namespace:
a NaN state is bad data for every recipe) and the batch drawn again, up to
``CLEAN_ATTEMPTS`` times. The outlier statistics are the recipe's own
(``claw:{ns}:cstats:<recipe>``: the rows it drew that passed, shared by its workers).

Keys (``claw:{ns}:``): ``clean:counts`` (hash), ``clean:seen:1`` and ``clean:seen:2``
(sets of digests: the current generation and the one before), ``clean:seen`` (which is
current), ``cstats:<recipe>`` (hash, as
:class:`~orchestrator.delivery.augstats.RedisStats` keeps statistics).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua
from orchestrator.delivery.augstats import RedisStats
from orchestrator.recipe.model import Recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import sample
from orchestrator.transforms.cleaning import RecipeClean, bad_rows, map_fields, violations
from orchestrator.transforms.quantiles import QuantileSample
from orchestrator.transforms.running import RunningStats

QUARANTINE = "quarantine"
CLEAN_ATTEMPTS = 8
"""Draws of a recipe with ``clean`` before a fill gives up (each one quarantines the bad
rows it met, so the next draws meet fewer)."""
_DEDUP = Lua("dedup", "orchestrator")


def clean_key(store: Store, part: str = "") -> str:
    return store.owned_key("clean" + (f":{part}" if part else ""))


def quarantined(store: Store) -> dict[str, int]:
    """Counts by ``<who>:<rule>`` (and ``<source>:steps`` brought in)."""
    raw = store.r.hgetall(clean_key(store, "counts"))
    return {k.decode(): int(v) for k, v in sorted(raw.items())}


def quarantine(
    store: Store,
    ids: np.ndarray,
    found: Mapping[str, np.ndarray],
    who: str,
    counts: Mapping[str, int] | None = None,
) -> np.ndarray:
    """Quarantine the steps ``ids`` (0: none) that failed a rule of ``found`` (rule ->
    mask), count them by rule as ``<who>:<rule>`` (with ``counts`` besides); returns the
    mask of bad steps."""
    ids = np.asarray(ids, np.int64)
    bad = bad_rows(found, len(ids))
    add = dict(counts or {})
    for rule, mask in found.items():
        if mask.any():
            add[f"{who}:{rule}"] = int(mask.sum())
    doomed = ids[bad & (ids > 0)]
    if len(doomed):
        store.curate(doomed, quality=QUARANTINE, trainable=False, by=f"clean:{who}")
    if add:
        with store.r.pipeline(transaction=False) as pipe:
            for key, value in add.items():
                pipe.hincrby(clean_key(store, "counts"), key, value)
            pipe.execute()
    return bad


def seen_before(store: Store, digests: Sequence[bytes], window: int) -> np.ndarray:
    """Which ``digests`` the namespace's dedup saw before (in an earlier call, or earlier
    in this one); the new ones are recorded. One atomic script call."""
    if not digests:
        return np.zeros(0, bool)
    keys = [clean_key(store, "seen:1"), clean_key(store, "seen:2"), clean_key(store, "seen")]
    reply = _DEDUP(store.r, keys, [window, *digests])
    return np.frombuffer(reply, np.uint8) == ord("1")


def batch_keys(ids: np.ndarray, n: int) -> np.ndarray:
    """Uniform keys for a batch's rows in a quartile sample, from the batch itself (the
    same rows, the same keys: a replayed batch does not skew the sample)."""
    seed = hashlib.blake2b(np.asarray(ids, "<i8").tobytes(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(seed, "little")).random(n)


def fold(
    stats: RedisStats, clean: RecipeClean, fields: Mapping[str, np.ndarray], keys: np.ndarray
) -> None:
    """Merge rows that passed into the statistics the outlier rules of ``clean`` read."""
    for name in sorted({o.field for o in clean.outliers if o.iqr is None}):
        stats.merge(name, RunningStats.of(np.asarray(fields[name])))
    for name in sorted({o.field for o in clean.outliers if o.iqr is not None}):
        stats.merge_sample(name, QuantileSample.of(np.asarray(fields[name]), keys))


def outlier_stats(store: Store, recipe: Recipe) -> RedisStats:
    """A recipe's outlier statistics (another ``clean`` section starts afresh)."""
    assert recipe.clean is not None
    digest = hashlib.sha1(recipe.clean.model_dump_json().encode()).hexdigest()[:16]
    return RedisStats(store.r, store.owned_key(f"cstats:{recipe.name}"), digest)


def clean_batch(store: Store, recipe: Recipe, batch: Batch) -> Batch | None:
    """``batch`` with the recipe's cleaning applied, or None when some of its rows failed a
    rule (quarantined and counted now: draw again)."""
    clean = recipe.clean
    assert clean is not None
    fields = map_fields(clean, {k: np.asarray(v) for k, v in batch.fields.items()})
    stats = outlier_stats(store, recipe)
    z = {o.field: stats.get(o.field) for o in clean.outliers if o.iqr is None}
    samples = {o.field: stats.get_sample(o.field) for o in clean.outliers if o.iqr is not None}
    found = violations(clean, fields, z, samples)
    if bad_rows(found, len(batch.ids)).any():
        quarantine(store, batch.ids, found, f"recipe/{recipe.name}")
        return None
    fold(stats, clean, fields, batch_keys(batch.ids, len(batch.ids)))
    batch.fields.update(fields)
    return batch


def sample_clean(store: Store, recipe: Recipe, rng: np.random.Generator) -> Batch:
    """A batch of ``recipe`` that passed its ``clean`` section (if it has one)."""
    for _ in range(CLEAN_ATTEMPTS):
        batch = sample(store, recipe, rng=rng)
        if recipe.clean is None:
            return batch
        done = clean_batch(store, recipe, batch)
        if done is not None:
            return done
    raise InsufficientData(
        f"recipe {recipe.name!r}: {CLEAN_ATTEMPTS} draws in a row had rows its clean rules "
        "quarantine (quarantined now; the next fill draws from the rest)"
    )
