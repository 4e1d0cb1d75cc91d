"""The stages of a fill: how one drawn batch becomes a queue item.

A recipe's :class:`Pipeline` is a list of stages chosen from its sections, each owning one
feature and meeting the others only through the :class:`Draft` it is handed (the way
TorchRL chains transforms):

    Draw -> CountStaleness -> PartOrder -> AttachNearest -> Augment | AugmentInto
         -> CollateTokens | Collate -> AttachGroups -> Cast -> Deliver -> Observe

A stage the recipe does not ask for is not in its pipeline (no stage checks whether its
feature is on), so a new recipe feature is a new stage and a line in :meth:`Pipeline.of`.
The fill (:func:`orchestrator.delivery.prefetch.run_fill`) gates each batch on the queue's
room and the rate limit, makes it here and pushes it; a stage that took something for a
batch the push refused gives it back in :meth:`Stage.taken_back`.

Stages add no Redis round trip and copy no array but what the recipe's ``layout`` asks
for (:class:`PartOrder`'s gather, :class:`Cast`'s casts: work done here so that the
trainer only wraps the delivered bytes): the fields flow as the draw returned them until
:class:`Deliver` lays them out, and :class:`AugmentInto` augments straight into the
laid-out batch.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np

from claw_tasks.store import Store
from orchestrator.delivery import admission, shm
from orchestrator.delivery.collate import cast, collate
from orchestrator.delivery.quarantine import sample_clean
from orchestrator.delivery.registry import Entry
from orchestrator.delivery.samplestats import Observed
from orchestrator.delivery.tokens import collate_tokens, group_arrays
from orchestrator.delivery.wire import Pending, to_wire
from orchestrator.recipe.model import Recipe, recipe_digest
from orchestrator.recipe.options import Layout, Nearest, Tokens
from orchestrator.retrieval.query import neighbour_fields
from orchestrator.sampling.batch import Batch, part_order, take_rows
from orchestrator.sampling.candidates import InsufficientData
from orchestrator.sampling.sample import hit_rates
from orchestrator.transforms.augment import AugmentPlan, augment_rng


def stats_field(name: str) -> str:
    """The field carrying the version of the namespace statistics ``name`` was normalised with."""
    return f"stats_version.{name}"


class Draft:
    """One batch on its way through the stages.

    ``rng`` is the batch's random stream (its draw), ``seed`` the seed of its augmentation
    (drawn from ``rng`` first, delivered with the batch and recorded in its lineage entry,
    so ``claw replay`` augments it again bit for bit) and ``began`` when it was started
    (for the time a batch takes); :class:`Draw` sets ``batch`` (as drawn) and starts
    ``fields``, ``ids``, ``weights``, ``source_index`` and ``meta`` from it, which later
    stages replace;
    ``arrays`` are the collated fields, ``fill`` writes the fields laid out as
    :class:`~orchestrator.delivery.wire.Pending`, ``message`` is the queue item,
    ``counts`` the counter increments pushed with it and ``served`` the trajectories it
    serves (admission recipes). ``end`` set ends the fill with that
    state (``""``: the fill's own).
    """

    __slots__ = (
        "arrays",
        "batch",
        "began",
        "counts",
        "end",
        "fields",
        "fill",
        "ids",
        "message",
        "meta",
        "rng",
        "seed",
        "served",
        "source_index",
        "weights",
    )

    def __init__(self, rng: np.random.Generator, began: float) -> None:
        self.rng, self.began = rng, began
        self.seed = int(rng.integers(2**63))
        self.batch: Batch
        self.fields: dict[str, Any]
        self.ids: np.ndarray
        self.weights: np.ndarray
        self.source_index: np.ndarray
        self.meta: dict[str, Any]
        self.arrays: dict[str, np.ndarray]
        self.fill: Callable[[dict[str, np.ndarray]], None] | None = None
        self.message = b""
        self.counts: dict[str, float] = {}
        self.served: list[str] = []
        self.end: str | None = None


class Stage(ABC):
    """One feature of a fill, applied to every batch in turn."""

    @abstractmethod
    def __call__(self, d: Draft) -> None:
        """Work on ``d``; set ``d.end`` to end the fill here."""

    def taken_back(self, d: Draft, why: str) -> None:
        """The push took ``d``'s item back (``why``: ``"stale"`` or ``"unregistered"``):
        give back what this stage took for it. Most stages took nothing."""
        return None


class Draw(Stage):
    """The batch as the recipe's sources draw it, its clean rules passed; too few
    candidates end the fill (``insufficient data``)."""

    def __init__(self, store: Store, recipe: Recipe) -> None:
        self.store, self.recipe = store, recipe

    def __call__(self, d: Draft) -> None:
        try:
            batch = sample_clean(self.store, self.recipe, d.rng)
        except InsufficientData as e:
            d.end = f"insufficient data: {e}"
            return
        d.batch, d.fields, d.meta = batch, batch.fields, batch.meta
        d.ids, d.weights, d.source_index = batch.ids, batch.weights, batch.source_index


class CountStaleness(Stage):
    """Served staleness: each batch counts its rows by how far their policy version lags
    (``staleness`` counters, pushed with the batch), and names the trajectories it serves
    (``served``: the push takes them out of admission's done set, so their slots never
    lapse). ``draw`` is the recipe to draw: with ``policy_version`` and ``episode_id``
    (metadata, no payload read) when the recipe does not ask for them, which this stage
    then takes out again. A batch the push takes back puts its trajectories back (the
    push does it: it knows which it took)."""

    def __init__(self, store: Store, recipe: Recipe) -> None:
        self.store, self.recipe = store, recipe
        self.added = [f for f in ("policy_version", "episode_id") if f not in recipe.fields]
        self.draw = (
            recipe.model_copy(update={"fields": [*recipe.fields, *self.added]})
            if self.added
            else recipe
        )

    def __call__(self, d: Draft) -> None:
        version = d.fields["policy_version"]
        episodes = d.meta["episode_id"]
        for f in self.added:
            (d.meta if f == "episode_id" else d.fields).pop(f)
        d.counts = admission.staleness_counts(self.recipe, np.asarray(version))
        flat = [e for x in episodes for e in (x if isinstance(x, list) else [x])]
        d.served = sorted({e for e in flat if e is not None})


class PartOrder(Stage):
    """The rows in the order of the recipe's ``layout.parts``: each part contiguous
    (:func:`~orchestrator.sampling.batch.part_order`), before anything is computed from
    them, so augmentation and ``claw replay`` (which draws the recorded ids in this
    order) see the rows alike."""

    def __init__(self, parts: int) -> None:
        self.parts = parts

    def __call__(self, d: Draft) -> None:
        rows = part_order(len(d.ids), self.parts)
        d.fields = {k: take_rows(v, rows) for k, v in d.fields.items()}
        d.meta = {k: take_rows(v, rows) for k, v in d.meta.items()}
        d.ids, d.weights, d.source_index = d.ids[rows], d.weights[rows], d.source_index[rows]


class AttachNearest(Stage):
    """Each row's nearest stored neighbours' fields, queried with the states as drawn
    (before augmentation)."""

    def __init__(self, store: Store, spec: Nearest) -> None:
        self.store, self.spec = store, spec

    def __call__(self, d: Draft) -> None:
        got = neighbour_fields(self.store, self.spec, d.fields[self.spec.query], d.ids)
        d.fields.update(got)


class Augment(Stage):
    """The recipe's augmentation, into new arrays, and the version of the namespace
    statistics each normalised field used."""

    def __init__(self, plan: AugmentPlan) -> None:
        self.plan = plan

    def __call__(self, d: Draft) -> None:
        d.fields = self.plan.apply(d.fields, augment_rng(d.seed))
        for f, version in self.plan.stats_versions().items():
            d.fields[stats_field(f)] = np.full(len(d.ids), version, np.int64)


class AugmentInto(Stage):
    """The recipe's augmentation written where the batch is delivered: the augmented
    fields are laid out first (their dtypes and shapes known before the plan runs) and
    :class:`Deliver` has the plan write them into a reused shared-memory segment's
    mapping, or into new arrays (one copy fewer than :class:`Augment` plus the layout). A
    batch whose results the plan cannot tell beforehand is augmented as :class:`Augment`
    does."""

    def __init__(self, plan: AugmentPlan) -> None:
        self.plan, self.otherwise = plan, Augment(plan)

    def __call__(self, d: Draft) -> None:
        specs = self.plan.out_specs(d.fields)
        if specs is None:
            self.otherwise(d)
            return
        drawn, n = d.fields, len(d.ids)
        d.fields = dict(drawn)
        d.fields.update({f: Pending(*spec) for f, spec in specs.items()})
        stats = self.plan.stats_versions()
        d.fields.update({stats_field(f): Pending(np.int64, (n,)) for f in stats})
        d.fill = partial(self.write, drawn, augment_rng(d.seed))

    def write(
        self, fields: Mapping[str, Any], rng: np.random.Generator, out: dict[str, np.ndarray]
    ) -> None:
        """Augment ``fields`` into ``out`` (views of the laid-out batch), then write the
        statistics versions the plan used."""
        self.plan.apply(fields, rng, out={f: out[f] for f in self.plan.fields})
        for f, version in self.plan.stats_versions().items():
            out[stats_field(f)][:] = version


class CollateTokens(Stage):
    """Token batches: a row per sequence, its last turn's (:mod:`orchestrator.delivery.
    tokens`), collated with the recipe's other fields."""

    def __init__(self, spec: Tokens) -> None:
        self.spec = spec

    def __call__(self, d: Draft) -> None:
        tokens = collate_tokens(d.fields, d.ids, d.batch.groups, self.spec)
        d.arrays = collate(tokens.rest)
        d.arrays.update(tokens.arrays)
        rows = tokens.rows
        d.ids, d.weights, d.source_index = d.ids[rows], d.weights[rows], d.source_index[rows]
        d.meta = {k: take_rows(v, rows) for k, v in d.meta.items()}


class Collate(Stage):
    """Fields as the trainer gets them (:mod:`orchestrator.delivery.collate`)."""

    def __call__(self, d: Draft) -> None:
        d.arrays = collate(d.fields)


class AttachGroups(Stage):
    """A group recipe's rows' groups, trajectories and advantages as arrays (its draw
    always has its groups)."""

    def __call__(self, d: Draft) -> None:
        d.arrays.update(group_arrays(d.batch.groups))  # type: ignore[arg-type]  # a group recipe's batch has groups


class Cast(Stage):
    """Fields cast to the dtypes of the recipe's ``layout`` (what its trainer takes)."""

    def __init__(self, layout: Layout) -> None:
        self.dtypes = {k: np.dtype(v) for k, v in layout.dtypes.items()}

    def __call__(self, d: Draft) -> None:
        d.arrays = cast(d.arrays, self.dtypes)


class Deliver(Stage):
    """The queue item: the batch laid out for the wire, in a shared-memory segment when
    its reader shares this host (:mod:`orchestrator.delivery.shm`), else inline; pending
    fields are written by the draft's ``fill`` where the batch goes."""

    def __init__(self, recipe: Recipe, reader_host: str | None) -> None:
        self.recipe_version, self.reader_host = recipe.version, reader_host
        self.digest = recipe_digest(recipe)

    def __call__(self, d: Draft) -> None:
        wire = to_wire(
            d.arrays,
            d.ids,
            weights=d.weights,
            source_index=d.source_index,
            sources=d.batch.sources,
            recipe_version=self.recipe_version,
            meta=d.meta,
            claim=d.batch.claim,
            seed=d.seed,
            recipe_digest=self.digest,
        )
        if wire.pending:
            assert d.fill is not None
            d.message = shm.deliver(wire, d.fill, reader_host=self.reader_host)
        else:
            d.message = shm.to_message(wire, reader_host=self.reader_host)


class Observe(Stage):
    """The time the batch took and its rows, and its sources' hit rates, for the fill's
    counters (:mod:`orchestrator.delivery.samplestats`)."""

    def __init__(self, store: Store, recipe: str, seen: Observed) -> None:
        self.store, self.recipe, self.seen = store, recipe, seen

    def __call__(self, d: Draft) -> None:
        self.seen.batch(time.perf_counter() - d.began, len(d.ids))
        self.seen.hit_rates(d.batch.sources, *hit_rates(self.store, self.recipe))


class Pipeline:
    """A recipe's stages, in order."""

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages

    @classmethod
    def of(cls, store: Store, entry: Entry, plan: AugmentPlan | None, seen: Observed) -> Pipeline:
        """The stages ``entry``'s recipe asks for (``plan``: its augmentation), reading
        ``store``; ``seen`` gathers what the batches measured."""
        recipe, layout = entry.recipe, entry.recipe.layout
        admit = CountStaleness(store, recipe) if recipe.admission is not None else None
        stages: list[Stage] = [Draw(store, admit.draw if admit else recipe)]
        stages += [admit] if admit else []
        if layout is not None and layout.parts > 1 and len(recipe.sources) > 1:
            stages.append(PartOrder(layout.parts))  # one source: its rows are in any order
        if recipe.nearest is not None:
            stages.append(AttachNearest(store, recipe.nearest))
        cast = {} if layout is None else layout.dtypes
        if plan is not None:
            # laid out first unless token batches cut its rows or a cast changes its fields
            into = recipe.tokens is None and not set(cast) & set(recipe.augment)
            stages.append(AugmentInto(plan) if into else Augment(plan))
        if recipe.tokens is not None:
            stages.append(CollateTokens(recipe.tokens))
        else:
            stages += [Collate(), AttachGroups()] if recipe.grouped else [Collate()]
        stages += [Cast(layout)] if layout is not None and cast else []
        stages += [Deliver(recipe, entry.shm_host), Observe(store, recipe.name, seen)]
        return cls(stages)

    def make(self, rng: np.random.Generator) -> Draft:
        """One batch drawn with ``rng`` through every stage (``end`` set: not made)."""
        d = Draft(rng, time.perf_counter())
        for stage in self.stages:
            stage(d)
            if d.end is not None:
                break
        return d

    def taken_back(self, d: Draft, why: str) -> None:
        """Each stage gives back what it took for ``d``, whose item the push took back."""
        for stage in self.stages:
            stage.taken_back(d, why)
