"""``ClawStorage``: a TorchRL ``Storage`` whose rows live in a Claw namespace (see the
package docstring for how TorchRL's parts map onto Claw)."""

from __future__ import annotations

import json
import logging
import uuid
import weakref
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.data.replay_buffers.storages import Storage, StoreStorage

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import FieldSpec, Schema
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from orchestrator.adapters.cadence import Cadence
from orchestrator.adapters.defaults import generation_namespace, global_seed, ingest_options
from orchestrator.adapters.link import BufferLink, close_quietly
from orchestrator.adapters.options import refuse_renamed, refuse_renamed_state
from orchestrator.adapters.transitions import Transitions
from orchestrator.adapters.urls import with_env_password, without_password
from orchestrator.adapters.versions import PolicyVersion, Versions
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.collate import collate
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.recipe.model import as_recipe
from orchestrator.sampling.batch import Batch
from orchestrator.sampling.sample import sample as sample_here

log = logging.getLogger(__name__)

FIELDS = ["obs", "action", "reward", "next_obs", "terminated", "truncated"]
TRAJ_KEY = ("collector", "traj_ids")
NestedKey = str | tuple[str, ...]


def numpy_of(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A tensor of ``a``: a view when it is writable (a batch's own bytes, delivered
    through a read-ahead process or shared memory), else a copy (bytes popped inline are
    read-only)."""
    return torch.from_numpy(a if a.flags.writeable else np.array(a, copy=True))


class ClawStorage(StoreStorage):
    """A TorchRL ``Storage`` whose rows live in Claw namespace ``namespace`` (a unique one
    per storage when None, logged). Sample it with :class:`ClawSampler` or
    :class:`ClawPrioritizedSampler`.

    ``obs_key`` and ``action_key`` name the observation and action entries (``("next",
    obs_key)`` is the next observation); ``priority_key`` is read at extend time, when
    present, as each row's initial priority. ``recipe`` overrides keys of the recipes the
    samplers register (e.g. ``where``, ``rate_limit``); ``capacity`` (the namespace's ring)
    defaults to ``max_size`` when the namespace is new, so that samples draw only the rows
    TorchRL's own storage would still hold (the ring keeps the newest rows committed:
    rows sent in separate messages, as a small ring's are, may commit out of order
    across ingest processes; ``deterministic=True`` keeps one order). Sampling an empty
    storage raises ``RuntimeError`` at once, as TorchRL's storages do. ``episode`` holds
    keyword arguments of :meth:`Ingestor.episode` (``task_id``, tags), ``ingest`` those of
    the :class:`Ingestor`. ``readahead`` batches (at most ``readahead_bytes``) wait decoded
    in this process, each drawn ``batches_per_pop`` times as large as a sample and split
    into that many samples (every ``batches_per_pop``-th row): the workers' and the
    read-ahead's per-batch costs are paid once per that many samples, at the price of
    priorities reaching the draws that much later. Unless either is given, both follow
    the trainer's bursts of samples between extends as SB3's buffer does (one per sample
    at first, 8 for bursts of 128:
    :func:`~orchestrator.adapters.cadence.plan_for`). ``timeout`` bounds a pop. Samples are
    put on ``device``. ``seed`` seeds the draws (None: from numpy's global state);
    ``deterministic=True`` draws each sample here, when it is asked for, from every row
    extended before it, with a stream seeded by ``(seed, k)``: the same extends and samples
    give the same batches (no read-ahead, one commit order).

    ``policy_version``: what each sample is recorded as training in the lineage log
    (``claw lineage NS --policy v``): ``"updates"`` (the default) the number of samples
    drawn so far, this one included (TorchRL's loops draw one per optimizer step, so
    version ``v`` is the policy after ``v`` updates); ``"timesteps"`` the rows extended so
    far (a collector's frame count); a callable gets the sample's number and returns the
    version (not saved by ``state_dict``: set ``storage.policy_version`` again after
    loading); None records nothing. Both counters are kept by ``state_dict``.

    It subclasses TorchRL's Redis-backed ``StoreStorage`` only so that replay buffers pass
    its samples through as they are (no collate); none of that class's code runs.
    """

    @refuse_renamed
    def __init__(
        self,
        max_size: int,
        namespace: str | None = None,
        redis_url: str | None = None,
        *,
        broker_url: str | None = None,
        obs_key: NestedKey = "observation",
        action_key: NestedKey = "action",
        priority_key: NestedKey = "td_error",
        recipe: Mapping[str, Any] | None = None,
        capacity: int | None = None,
        episode: Mapping[str, Any] | None = None,
        ingest: Mapping[str, Any] | None = None,
        readahead: int | None = None,
        readahead_bytes: int = 64 << 20,
        batches_per_pop: int | None = None,
        timeout: float | None = 30.0,
        seed: int | None = None,
        deterministic: bool = False,
        device: str | torch.device = "cpu",
        drop_on_reset: bool = False,
        policy_version: PolicyVersion = "updates",
    ) -> None:
        Storage.__init__(self, max_size)  # not StoreStorage's: it opens its own Redis store
        if namespace is None:
            namespace = f"{get_settings().namespace}-torchrl-{uuid.uuid4().hex[:10]}"
            log.info("ClawStorage: namespace %r (pass namespace= to choose one)", namespace)
        self._kw: dict[str, Any] = {
            "max_size": max_size,
            "namespace": namespace,
            "redis_url": redis_url,
            "broker_url": broker_url,
            "obs_key": obs_key,
            "action_key": action_key,
            "priority_key": priority_key,
            "recipe": dict(recipe or {}),
            "capacity": capacity,
            "episode": dict(episode or {}),
            "ingest": dict(ingest or {}),
            "readahead": readahead,
            "readahead_bytes": readahead_bytes,
            "batches_per_pop": batches_per_pop,
            "timeout": timeout,
            "seed": global_seed() if seed is None else int(seed),
            "deterministic": deterministic,
            "device": str(device),
            "drop_on_reset": drop_on_reset,
            "policy_version": policy_version if isinstance(policy_version, str) else None,
        }
        self._setup(generation=0, added=0)
        self.samples = self.frames = 0
        self.policy_version = policy_version

    def _setup(self, generation: int, added: int) -> None:
        kw = self._kw
        self.base_namespace: str = kw["namespace"]
        self.generation, self._added = generation, added
        self.device = torch.device(kw["device"])
        self.obs_key, self.action_key = kw["obs_key"], kw["action_key"]
        self.priority_key = kw["priority_key"]
        self.timeout = kw["timeout"]
        self.seed: int = kw.get("seed") or 0
        self.deterministic: bool = kw.get("deterministic", False)
        self._cadence = (
            Cadence(1, 1, 0)  # one batch per call, drawn here: nothing read ahead
            if self.deterministic
            else Cadence(None, kw["batches_per_pop"], kw["readahead"])
        )
        # Own recipe names: closing this storage never unregisters another's.
        self.recipe_base = f"torchrl-{uuid.uuid4().hex[:8]}"
        # Dtypes and trailing shapes a sample gives back: those the rows were extended with.
        self._layout: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        self._link: BufferLink | None = None
        self._finalizer: weakref.finalize | None = None
        self._drawn: tuple[torch.Tensor, TensorDict] | None = None

    @property
    def policy_version(self) -> PolicyVersion:
        """What each sample is recorded as training (see the class docstring)."""
        return self._versions.declare

    @policy_version.setter
    def policy_version(self, declare: PolicyVersion) -> None:
        self._versions = Versions(
            declare, {"updates": lambda: self.samples, "timesteps": lambda: self.frames}
        )

    @property
    def namespace(self) -> str:
        return generation_namespace(self.base_namespace, self.generation)

    # ---- connection ----------------------------------------------------------------
    def _connect(self, schema: Schema | None) -> BufferLink:
        if self._link is not None:
            return self._link
        kw, namespace = self._kw, self.namespace
        capacity = kw["capacity"]
        if capacity is None:
            probe = Store(kw["redis_url"] or get_settings().redis_url, namespace)
            if not probe.exists():  # TorchRL's ring: the newest max_size rows, no more
                capacity = self.max_size
            probe.r.close()
        ingest_kw = ingest_options(kw["ingest"], capacity or self.max_size)
        if self.deterministic:  # written at each draw and waited for: one commit order
            ingest_kw.update(flush_steps=1 << 30, flush_interval=None)
        ingestor = Ingestor(
            namespace,
            kw["redis_url"],
            broker_url=kw["broker_url"],
            capacity=capacity,
            schema=schema,
            **ingest_kw,
        )
        client = BatchClient(namespace, kw["redis_url"], broker_url=kw["broker_url"], readahead=0)
        self._link = BufferLink(ingestor, client, Transitions(ingestor, kw["episode"]))
        self._finalizer = weakref.finalize(self, close_quietly, self._link)
        self._link.start_readahead(self._cadence.plan)
        return self._link

    def close(self) -> None:
        """Write what is pending, unregister this storage's recipes, release connections
        (also done on garbage collection and at exit)."""
        if self._finalizer is not None and self._finalizer.alive:
            self._finalizer.detach()
            assert self._link is not None
            self._link.close()
        self._link = self._finalizer = None

    def flush(self, timeout: float = 60.0) -> None:
        """Write every row extended and every priority submitted so far, and wait until
        the store has them."""
        if self._link is not None:
            self._link.flush(timeout)
            self._link.client.flush_priorities(timeout)

    # ---- writing -------------------------------------------------------------------
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Ingest ``data`` (a TensorDict of transitions; the writer's ``cursor`` is not a
        Claw id and is ignored)."""
        if not isinstance(data, TensorDictBase):
            raise TypeError(
                f"ClawStorage stores TensorDicts of transitions, got "
                f"{type(data).__name__}: extend a TensorDict (e.g. a collector's "
                "batch)"
            )
        if data.ndim == 0:
            data = data.unsqueeze(0)
        data = data.reshape(-1)
        rows = self._rows(data)
        link = self._connect(self._schema(rows))
        if (plan := self._cadence.added()) is not None:
            link.resize(plan)
        obs, act, rew, nxt, term, trunc, streams, prio = rows
        for i in range(len(obs)):
            link.transitions.add(
                streams[i],
                obs[i],
                act[i],
                float(rew[i]),
                nxt[i],
                terminated=bool(term[i]),
                truncated=bool(trunc[i]) and not term[i],
                priority=None if prio is None else float(prio[i]),
            )
        self._added += len(obs)
        self.frames += len(obs)
        if self.deterministic:  # each extend committed before the next: one commit order
            link.flush()
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _rows(self, data: TensorDictBase) -> tuple[Any, ...]:
        """The columns Claw stores, as numpy (and the layout a sample gives back)."""

        def get(key: NestedKey, name: str) -> torch.Tensor:
            value = data.get(key, None)
            if value is None:
                raise KeyError(
                    f"ClawStorage: the extended TensorDict has no {key!r} ({name}); "
                    f"its keys: {sorted(map(str, data.keys(True, True)))}. Pass "
                    "obs_key=/action_key= to name yours"
                )
            return value

        n = data.shape[0]
        obs, act = get(self.obs_key, "observation"), get(self.action_key, "action")
        nxt, rew = (
            get(("next", *_tuple(self.obs_key)), "next observation"),
            get(("next", "reward"), "reward"),
        )
        done = data.get(("next", "done"), None)
        term = data.get(("next", "terminated"), done)
        if term is None:
            raise KeyError(
                "ClawStorage: the extended TensorDict has neither ('next', "
                "'terminated') nor ('next', 'done')"
            )
        trunc = data.get(("next", "truncated"), None)
        if trunc is None:
            trunc = torch.zeros_like(term) if done is None else (done & ~term)
        if rew[0].numel() != 1:
            raise ValueError(
                f"ClawStorage stores one scalar reward per row, got shape {tuple(rew.shape)}"
            )
        self._layout = {
            name: (t.dtype, tuple(t.shape[1:]))
            for name, t in (("obs", obs), ("action", act), ("reward", rew), ("done", term))
        }
        streams: Any = (
            numpy_of(data.get(TRAJ_KEY)).reshape(n, -1)[:, 0].tolist()
            if TRAJ_KEY in data.keys(True)
            else [0] * n
        )
        prio = data.get(self.priority_key, None)
        prio = None if prio is None else np.abs(numpy_of(prio).reshape(n, -1)[:, 0])
        act_np = numpy_of(act)
        if act_np.dtype == np.bool_:  # one-hot booleans: Claw stores bytes
            act_np = act_np.astype(np.uint8)
        return (
            numpy_of(obs),
            act_np,
            numpy_of(rew).reshape(n),
            numpy_of(nxt),
            numpy_of(term).reshape(n),
            numpy_of(trunc).reshape(n),
            streams,
            prio,
        )

    @staticmethod
    def _schema(rows: tuple[Any, ...]) -> Schema:
        obs, act = rows[0], rows[1]
        return Schema(
            fields={
                "obs": FieldSpec(obs.dtype.str, obs.shape[1:]),
                "action": FieldSpec(act.dtype.str, act.shape[1:]),
            }
        )

    # ---- reading -------------------------------------------------------------------
    def draw(self, source: Mapping[str, Any], batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pop the next prefetched batch of ``batch_size`` rows drawn with ``source``'s
        sampler; returns its step ids and importance weights (the batch waits for
        :meth:`get`)."""
        if not len(self):  # as TorchRL's storages: at once, not after a pop's timeout
            raise RuntimeError("Cannot sample from an empty storage")
        if self.deterministic:
            return self._draw_here(source, batch_size)
        link, kw = self._connect(None), self._kw
        if (resized := self._cadence.sampled()) is not None:
            link.resize(resized)
        plan = self._cadence.plan
        key: Hashable = (json.dumps(source, sort_keys=True), batch_size)
        name = (
            f"{self.recipe_base}-{link.replans}.{len(link.names)}"
            if key not in link.names
            else None
        )
        spec = {
            "name": name,
            "batch_size": batch_size * plan.parts,
            "fields": FIELDS,
            "sources": [{"name": "all", "sampler": dict(source)}],
            "prefetch": {"depth": plan.depth},
            "seed": self.seed,
            **kw["recipe"],
        }
        name = link.recipe(
            key,
            spec,
            plan.readahead,
            kw["readahead_bytes"],
            plan.parts,
            convert=self._drawable,
        )
        self.samples += 1
        ids, weights, td = link.pop(name, self.timeout, self._versions.of(self.samples))
        self._drawn = (ids, td)
        return ids, weights

    def _draw_here(
        self, source: Mapping[str, Any], batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k-th sample drawn here from every row extended before it, seeded by
        ``(seed, k)``: the same extends and samples give the same batches."""
        link = self._connect(None)
        link.flush()
        self.samples += 1
        spec = {
            "name": f"{self.recipe_base}-here",
            "batch_size": batch_size,
            "fields": FIELDS,
            "sources": [{"name": "all", "sampler": dict(source)}],
            **self._kw["recipe"],
        }
        rng = np.random.default_rng([self.seed, self.samples])
        got = sample_here(link.client.store, as_recipe(spec), rng=rng)
        batch = Batch(
            collate(got.fields),
            got.ids,
            got.weights,
            got.source_index,
            got.sources,
            got.recipe_version,
            got.meta,
        )
        if (version := self._versions.of(self.samples)) is not None:
            link.client.trained(spec["name"], batch, version)
        ids, weights, td = self._drawable(batch)
        self._drawn = (ids, td)
        return ids, weights

    def _drawable(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, TensorDict]:
        """A batch's ids, weights and TensorDict (made in the read-ahead thread, so the
        trainer's sample is a dequeue)."""
        ids = torch.from_numpy(batch.ids.astype(np.int64))
        return ids, _tensor(batch.weights), self._tensordict(batch)

    def _tensordict(self, batch: Batch) -> TensorDict:
        n = len(batch)
        layout = self._layout

        def col(
            name: str, field: str, default: tuple[torch.dtype, tuple[int, ...]]
        ) -> torch.Tensor:
            dtype, shape = layout.get(field, default)
            return _tensor(batch[name]).reshape(n, *shape).to(dtype)

        obs_default = (_torch_dtype(batch["obs"].dtype), tuple(batch["obs"].shape[1:]))
        act_default = (_torch_dtype(batch["action"].dtype), tuple(batch["action"].shape[1:]))
        term = col("terminated", "done", (torch.bool, (1,)))
        trunc = col("truncated", "done", (torch.bool, (1,)))
        td = TensorDict(batch_size=[n], device=self.device)
        td.set(self.obs_key, col("obs", "obs", obs_default).to(self.device))
        td.set(self.action_key, col("action", "action", act_default).to(self.device))
        td.set(("next", *_tuple(self.obs_key)), col("next_obs", "obs", obs_default).to(self.device))
        td.set(("next", "reward"), col("reward", "reward", (torch.float32, (1,))).to(self.device))
        td.set(("next", "terminated"), term.to(self.device))
        td.set(("next", "truncated"), trunc.to(self.device))
        td.set(("next", "done"), (term.bool() | trunc.bool()).to(term.dtype).to(self.device))
        return td

    def get(self, index: Any) -> TensorDict:
        """The batch the Claw sampler just drew (``index`` is its step ids)."""
        drawn = self._drawn
        if (
            drawn is not None
            and isinstance(index, torch.Tensor)
            and (index is drawn[0] or torch.equal(index.to(drawn[0].device), drawn[0]))
        ):
            return drawn[1]
        raise KeyError(
            "ClawStorage serves the batches its Claw sampler draws (Claw has no slots to "
            "index): sample with sampler=ClawSampler() or ClawPrioritizedSampler(), not "
            "TorchRL's own samplers or rb[index]"
        )

    def update_priorities(
        self, ids: np.ndarray, priorities: np.ndarray, *, wait: bool = False
    ) -> int | None:
        """Set Claw priorities of steps ``ids`` (skipped when evicted), written behind in
        order, later ones winning (``BatchClient.update_priorities``; :meth:`flush` waits
        for them). ``wait=True`` writes them now and returns how many steps were updated."""
        return self._connect(None).client.update_priorities(ids, priorities, wait=wait)

    def contains(self, item: Any) -> bool:
        raise NotImplementedError(
            "ClawStorage has no slots to test; steps are found by id with claw_tasks.store.Store"
        )

    def __len__(self) -> int:
        return min(self._added, self.max_size)

    # ---- state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Namespace, settings and counters (plain values: never the data nor a password)."""
        self.flush()
        kw = {
            **self._kw,
            "redis_url": without_password(self._kw["redis_url"]),
            "broker_url": without_password(self._kw["broker_url"]),
        }
        return {
            "claw": kw,
            "generation": self.generation,
            "added": self._added,
            "samples": self.samples,
            "frames": self.frames,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Reconnect to the namespace (and generation) a :meth:`state_dict` was taken on."""
        kw = dict(state_dict["claw"])
        refuse_renamed_state(kw, "ClawStorage.load_state_dict")
        settings = get_settings()
        kw["redis_url"] = with_env_password(kw["redis_url"], settings.redis_url)
        kw["broker_url"] = with_env_password(kw["broker_url"], settings.broker_url)
        self.close()
        self._kw = kw
        self.max_size = int(kw["max_size"])
        self._setup(generation=state_dict["generation"], added=state_dict["added"])
        self.samples = int(state_dict.get("samples", 0))
        self.frames = int(state_dict.get("frames", 0))
        self.policy_version = kw.get("policy_version", "updates")

    def dumps(self, path: str | Path) -> None:
        """Write :meth:`state_dict` as JSON in directory ``path`` (the data stays in Redis)."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "claw_storage.json").write_text(json.dumps(self.state_dict()))

    def loads(self, path: str | Path) -> None:
        self.load_state_dict(json.loads((Path(path) / "claw_storage.json").read_text()))
        self._bump_mutation_revision()

    def _empty(self) -> None:
        """Start empty (``ReplayBuffer.empty``): move to a new namespace generation; the old
        one is dropped only with ``drop_on_reset``."""
        old, url = self.namespace, self._kw["redis_url"] or get_settings().redis_url
        self.close()
        if self._kw["drop_on_reset"]:
            r = Store(url, old).r
            drop_namespace(r, old)
            r.close()
        self._setup(generation=self.generation + 1, added=0)
        log.info("ClawStorage emptied: namespace %r -> %r", old, self.namespace)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (e.g. to another process) as its :meth:`state_dict`; that process opens
        its own connections."""
        return {"state": self.state_dict()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__init__(self, state["state"]["claw"]["max_size"])
        self._link = self._finalizer = None
        self.load_state_dict(state["state"])

    def __repr__(self) -> str:
        return (
            f"ClawStorage(namespace={self.namespace!r}, max_size={self.max_size}, len={len(self)})"
        )


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _tuple(key: NestedKey) -> tuple[str, ...]:
    return (key,) if isinstance(key, str) else tuple(key)
