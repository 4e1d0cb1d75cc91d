"""What a replay buffer uses when its caller does not say: its seed, its ingest options
and the namespace of its next reset."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np


def ingest_options(ingest: Mapping[str, Any], capacity: int) -> dict[str, Any]:
    """Ingestor options for a buffer of ``capacity`` rows: ``ingest`` over the adapters'
    defaults, never flushing more than half the ring at once (a commit of more steps than
    the ring holds keeps none of them)."""
    options = {"flush_steps": 256, "flush_interval": 0.25, **ingest}
    options["flush_steps"] = min(options["flush_steps"], max(1, capacity // 2))
    return options


def generation_namespace(base: str, generation: int) -> str:
    """The namespace of a buffer's ``generation``-th reset: ``<base>.r<generation>`` (the
    first is ``base`` itself), so a reset starts empty without deleting the old data."""
    return base if not generation else f"{base}.r{generation}"


def global_seed() -> int:
    """A seed from numpy's global state without drawing from it: SB3 and RLlib seed that
    state before they build their buffer, so the algorithm's seed decides this one."""
    state = np.random.get_state()
    digest = hashlib.blake2b(state[1].tobytes() + int(state[2]).to_bytes(4), digest_size=4)
    return int.from_bytes(digest.digest(), "little") & 0x7FFFFFFF
