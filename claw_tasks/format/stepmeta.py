"""What a step's metadata values mean, apart from where they are stored: the flag bits,
the dictionary-encoded columns and the episode code. A leaf module: the where language
reads these without importing the store package (whose settings use the where language);
:mod:`claw_tasks.store.layout` has where they are stored (keys and column layout)."""

from __future__ import annotations

import hashlib

DICT_COLUMNS = ("agent_id", "task_id", "skill_tag", "reward_source", "quality")
"""Metadata columns stored as codes of a per-namespace string dictionary."""

# flags bits
TERMINATED, TRUNCATED, EXPLICIT_NEXT, UNTRAINABLE = 1, 2, 4, 8


def episode_code(episode_id: str) -> int:
    """Stable positive 63-bit code of an episode id."""
    digest = hashlib.blake2b(episode_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF) or 1
