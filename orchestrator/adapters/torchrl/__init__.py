"""TorchRL replay buffers backed by Claw: ``ClawStorage`` with ``ClawSampler`` (uniform) or
``ClawPrioritizedSampler``::

    rb = TensorDictReplayBuffer(
        storage=ClawStorage(100_000, namespace="dqn"),
        sampler=ClawPrioritizedSampler(alpha=0.6, beta=0.4),
        batch_size=128,
    )
    rb.extend(collector_batch.reshape(-1))   # ingested into Claw
    batch = rb.sample()                      # a prefetched Claw batch, as a TensorDict
    ...
    rb.update_tensordict_priority(batch)     # the loss's "td_error" -> Claw priorities

How TorchRL's parts map onto Claw, and why:

- TorchRL's sampler picks indices and its storage reads them; in Claw the prefetch
  workers do both. So :class:`ClawSampler` pops a whole prefetched batch from the storage's
  recipe (registered on first use per sampler kind and batch size, read ahead in this
  process), returns its step ids as the ``index`` (and Claw's importance weights as
  ``priority_weight``), and :meth:`ClawStorage.get` hands back that batch. Any other
  index cannot be served (Claw has no slots): use a Claw sampler.
- ``extend`` ingests each row as one transition of a Claw episode: rows of one
  trajectory (``("collector", "traj_ids")``, else all rows) in order, an episode ending at
  ``("next", "done")``; ``next_obs`` is stored once when it is the next row's observation.
  The writer's slot positions are not Claw ids (those are assigned at commit), so
  priorities given at extend time come from the data's ``priority_key`` entry (unset ones
  are sampled at the running maximum, as in TorchRL), and an ``update_priority`` on
  indices the sampler never returned is ignored with a warning.
- A sample holds ``observation``, ``action``, ``("next", observation)``,
  ``("next", "reward"|"done"|"terminated"|"truncated")`` with the shapes and dtypes they
  were extended with; other keys are not stored. A timeout (``truncated``) bootstraps.
- ``len`` counts the rows this storage extended (capped at ``max_size``), as TorchRL's
  storages do; ``state_dict``/``dumps`` keep the namespace, settings and counters, never
  the data (it stays in Redis) nor a password; ``empty()`` moves to a new namespace
  generation (the old data stays unless ``drop_on_reset``).
- TorchRL's own ``PrioritizedSampler`` needs its C++ extension built for the exact torch
  version; Claw's sampler draws in the prefetch workers and has no such dependency.
"""

from orchestrator.adapters.torchrl.samplers import ClawPrioritizedSampler, ClawSampler
from orchestrator.adapters.torchrl.storage import ClawStorage

__all__ = ["ClawPrioritizedSampler", "ClawSampler", "ClawStorage"]
