"""Minari interchange: export a namespace as a Minari dataset, import one as offline steps.

A Minari episode has N+1 observations: the N steps' ``obs`` and the final ``next_obs``
(stored explicitly with an episode's last step). Only complete episodes travel: steps
0..N-1 all stored, the last one with its next_obs. The observation and action spaces come
from the namespace config (``RecordSteps`` records them); without them, unbounded ``Box``
spaces of the fields' dtype and shape are used. Imported steps are tagged
``origin = offline`` (``RecordSteps`` tags live ones ``online``) so one recipe can mix
them with ``where: {tags.origin: offline}``. Images are written without JPEG (lossless).
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.format.schema import FieldSpec, tag_column
from claw_tasks.format.stepmeta import EXPLICIT_NEXT
from claw_tasks.store import Store
from orchestrator.maintenance.steptable import batch_problem

__all__ = [
    "ExportResult",
    "ImportResult",
    "MinariError",
    "datasets_root",
    "export_minari",
    "import_minari",
    "load",
    "namespace_spaces",
    "serialize_spaces",
]

ORIGIN_TAG = "origin"
GROUP_STEPS = 1 << 16  # steps read or committed at a time
_SUPPORTED = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)
_KINDS = ", ".join(t.__name__ for t in _SUPPORTED)

Progress = Callable[[int], None]  # steps done since the last call


DATASET_ID = re.compile(r"(?:[\w.-]+/)?[\w.-]+-v\d{1,9}", re.ASCII)
"""A Minari dataset id as ``export_minari`` writes one: [namespace/]name-vN."""


class MinariError(ValueError):
    """A namespace or dataset cannot be converted (the message says why)."""


@contextmanager
def datasets_root(root: Path | str | None) -> Iterator[None]:
    """Minari finds datasets under ``MINARI_DATASETS_PATH`` (default ~/.minari/datasets)."""
    if root is None:
        yield
        return
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MINARI_DATASETS_PATH", None)
        else:
            os.environ["MINARI_DATASETS_PATH"] = old


def serialize_spaces(observation: gym.Space, action: gym.Space) -> tuple[str, str]:
    from minari.serialization import serialize_space

    return serialize_space(observation), serialize_space(action)


def _space_of(spec: FieldSpec) -> gym.Space:
    if spec.ragged:
        raise MinariError("a ragged field has no Minari space; record the spaces instead")
    dtype = np.dtype(spec.dtype)
    bound = np.inf if dtype.kind == "f" else np.iinfo(dtype).max if dtype.kind in "iu" else 1
    low = -bound if dtype.kind in "fi" else 0
    return gym.spaces.Box(low, bound, tuple(spec.shape), dtype)  # type: ignore[arg-type]  # a fixed shape (no None)


def namespace_spaces(store: Store) -> tuple[gym.Space, gym.Space]:
    """The namespace's recorded spaces, or unbounded Boxes from its schema."""
    from minari.serialization import deserialize_space

    cfg = store.config(refresh=True)
    if cfg.spaces:
        return (
            deserialize_space(cfg.spaces["observation"]),
            deserialize_space(cfg.spaces["action"]),
        )
    if cfg.schema is None or not {"obs", "action"} <= set(cfg.schema.fields):
        raise MinariError(f"namespace {store.namespace!r} has no obs/action fields to export")
    return _space_of(cfg.schema.fields["obs"]), _space_of(cfg.schema.fields["action"])


@dataclass
class ExportResult:
    dataset_id: str
    path: str
    episodes: int = 0
    steps: int = 0
    skipped_episodes: int = 0  # incomplete: a step missing, or no final next_obs


def _episodes(store: Store) -> Iterator[tuple[np.ndarray, bool]]:
    """Ids of each episode in step order, and whether it is complete; shard by shard."""
    cfg = store.config()
    for shard in range(cfg.n_shards):
        cols = store.meta_columns(shard, ["episode", "step_index", "flags", "id"])
        alive = np.flatnonzero(cols["alive"])
        order = alive[np.lexsort((cols["step_index"][alive], cols["episode"][alive]))]
        eps = cols["episode"][order]
        bounds = np.flatnonzero(np.diff(eps)) + 1
        for run in np.split(order, bounds):
            if len(run) == 0:
                continue
            idx = cols["step_index"][run]
            last_has_next = cols["flags"][run[-1]] & EXPLICIT_NEXT
            complete = np.array_equal(idx, np.arange(len(run))) and bool(last_has_next)
            yield cols["id"][run], complete


def export_minari(
    store: Store,
    dataset_id: str,
    *,
    root: Path | str | None = None,
    progress: Progress | None = None,
) -> ExportResult:
    """Write the namespace's complete episodes as Minari dataset ``dataset_id``."""
    import minari
    from minari.data_collector.episode_buffer import EpisodeBuffer

    if not DATASET_ID.fullmatch(dataset_id):  # Minari's own parse fails on a missing -vN
        raise MinariError(
            f"dataset id {dataset_id[:200]!r}: write it as [namespace/]name-vN, e.g. cartpole-v0"
        )
    tell = progress or (lambda n: None)
    obs_space, act_space = namespace_spaces(store)
    for space in (obs_space, act_space):
        if not isinstance(space, _SUPPORTED):
            raise MinariError(f"{type(space).__name__} spaces cannot be exported ({_KINDS} can)")
    with warnings.catch_warnings(), datasets_root(root):
        warnings.simplefilter("ignore")  # Minari warns about every credit field left unset
        dataset = minari.create_dataset_from_buffers(
            dataset_id,
            [],
            observation_space=obs_space,
            action_space=act_space,
            data_format="arrow",
            jpeg_encoding=False,
            author="claw",
            description=f"Exported from Claw namespace {store.namespace!r}",
        )
    storage = dataset.storage
    # Minari re-measures the whole dataset directory after every episode it writes
    # (quadratic: 200 episodes take seconds, thousands hours); measure once at the end.
    storage.get_size = lambda: 0
    result = ExportResult(dataset_id, str(storage.data_path.parent))
    group: list[np.ndarray] = []

    def flush() -> None:
        if not group:
            return
        ids = np.concatenate(group)
        got = store.get(ids, ["obs", "action", "next_obs"])
        buffers, names, at = [], [], 0
        for ep_ids in group:
            s = slice(at, at + len(ep_ids))
            at += len(ep_ids)
            buffers.append(
                EpisodeBuffer(
                    id=result.episodes + len(buffers),
                    observations=np.concatenate([got["obs"][s], got["next_obs"][s][-1:]]),
                    actions=got["action"][s],
                    rewards=got["reward"][s],
                    terminations=got["terminated"][s],
                    truncations=got["truncated"][s],
                )
            )
            names.append(got["episode_id"][s.start])
        dataset.update_dataset_from_buffer(buffers)
        first = result.episodes
        dataset.storage.update_episode_metadata(
            [{"claw_episode_id": n} for n in names], range(first, first + len(names))
        )
        result.episodes += len(buffers)
        result.steps += len(ids)
        tell(len(ids))
        group.clear()

    try:
        for ep_ids, complete in _episodes(store):
            if not complete:
                result.skipped_episodes += 1
                continue
            group.append(ep_ids)
            if sum(len(g) for g in group) >= GROUP_STEPS:
                flush()
        flush()
    finally:
        del storage.get_size
    storage.update_metadata({"dataset_size": storage.get_size()})
    return result


@dataclass
class ImportResult:
    dataset_id: str
    episodes: int = 0
    steps: int = 0
    replayed: int = 0


def load(dataset: str, root: Path | str | None = None) -> Any:
    """A Minari dataset by id (``minari.load_dataset``) or by its directory."""
    import minari

    path = Path(dataset)
    if (path / "data").is_dir():
        return minari.MinariDataset(path / "data")
    if (path / "metadata.json").is_file():
        return minari.MinariDataset(path)
    try:
        with datasets_root(root):
            return minari.load_dataset(dataset)
    except ImportError as e:  # Minari's hdf5 format needs h5py, not a Claw dependency
        raise MinariError(f"dataset {dataset!r} needs {e.name or e}: pip install it") from None


def import_minari(
    dataset: str,
    store: Store,
    *,
    root: Path | str | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Commit every episode of a Minari dataset into ``store``'s namespace, through the
    store's writer, tagged ``origin = offline``. Batch ids derive from the dataset and the
    episode, so importing the same dataset again stores nothing twice."""
    ds = load(dataset, root)
    tell = progress or (lambda n: None)
    obs_space, act_space = ds.observation_space, ds.action_space
    for space in (obs_space, act_space):
        if not isinstance(space, _SUPPORTED):
            raise MinariError(f"{type(space).__name__} spaces cannot be imported ({_KINDS} can)")
    if not store.exists():
        store.create()
    if not store.config(refresh=True).spaces:
        store.set_spaces(*serialize_spaces(obs_space, act_space))
    ds_id = ds.spec.dataset_id
    tag = hashlib.blake2b(ds_id.encode(), digest_size=6).hexdigest()
    indices = [int(i) for i in ds.episode_indices]
    names = {
        int(m["id"]): m.get("claw_episode_id") for m in ds.storage.get_episode_metadata(indices)
    }
    result = ImportResult(ds_id)
    pending: list[tuple[str, Any]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        if not pending:
            return
        batch = _batch(pending, f"minari-{tag}-{pending[0][1].id}-{pending[-1][1].id}")
        problem = batch_problem(batch)
        if problem:
            raise MinariError(f"dataset {ds_id!r}: {problem}")
        res = store.commit(batch)
        result.steps += res.committed
        result.replayed += res.replayed
        result.episodes += len(pending)
        tell(batch.n)
        pending.clear()
        size = 0

    for ep in ds.iterate_episodes(indices):
        name = names.get(int(ep.id)) or f"{ds_id}/{int(ep.id)}"
        pending.append((name, ep))
        size += len(ep)
        if size >= GROUP_STEPS:
            flush()
    flush()
    return result


def _batch(episodes: list[tuple[str, Any]], batch_id: str) -> StepBatch:
    obs = np.concatenate([np.asarray(ep.observations)[:-1] for _, ep in episodes])
    n = len(obs)
    lengths = [len(ep) for _, ep in episodes]
    last = np.cumsum(lengths) - 1
    return StepBatch(
        episode=StrColumn(
            [name for name, _ in episodes],
            np.repeat(np.arange(len(episodes)), lengths).astype(np.int32),
        ),
        step_index=np.concatenate([np.arange(k) for k in lengths]).astype(np.int64),
        reward=np.concatenate([ep.rewards for _, ep in episodes]).astype(np.float32),
        terminated=np.concatenate([ep.terminations for _, ep in episodes]).astype(bool),
        truncated=np.concatenate([ep.truncations for _, ep in episodes]).astype(bool),
        fields={
            "obs": obs,
            "action": np.concatenate([np.asarray(ep.actions) for _, ep in episodes]),
        },
        strs={tag_column(ORIGIN_TAG): StrColumn.constant("offline", n)},
        next_rows=last.astype(np.int32),
        next_obs=np.stack([np.asarray(ep.observations)[-1] for _, ep in episodes]),
        batch_id=batch_id,
    )
