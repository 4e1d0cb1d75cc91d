"""Dead letters: what the ingest side keeps of a message it refused, under a byte cap.

A letter holds the reason, a code (counted forever in the outcome counters, so a trimmed
letter is still accounted for), a bounded prefix of the payload and the digest of all of
it. Messages that name no existing namespace go to one worker-level stream, ``claw:rejects``.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from claw_tasks.format.arrays import packb
from claw_tasks.settings import IngestLimits
from claw_tasks.store.batches import REJECTS, REJECTS_OUTCOMES, dead_letter_keys, done_key
from claw_tasks.store.scripts import Lua

DONE_TTL = 86400
MAX_REASON = 4096
_SCRIPT = Lua("deadletter")
_ENTRY_OVERHEAD = 160  # stream node, radix tree and listpack headers of one entry


@dataclass
class Letter:
    code: str  # short and stable: counted per code
    reason: str
    payload: bytes | None = None
    rows: list[int] | None = None  # None: the whole message
    batch_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def fields(self, prefix: int) -> list[Any]:
        out: list[Any] = ["reason", self.reason[:MAX_REASON], "at", repr(time.time())]
        if self.batch_id is not None:
            out += ["batch_id", self.batch_id]
        if self.rows is not None:
            out += ["rows", packb(self.rows)]
        if self.payload is not None:
            p = self.payload
            out += [
                "payload",
                p[:prefix],
                "payload_bytes",
                len(p),
                "digest",
                "sha256:" + hashlib.sha256(p).hexdigest(),
            ]
        for k, v in self.extra.items():
            out += [k, str(v)[:256]]
        return out


def _bytes(v: Any) -> bytes | str:
    return v if isinstance(v, bytes | str) else str(v)


def alloc_size(n: int) -> int:
    """``n`` rounded up to jemalloc's size class (four per doubling), so the cap bounds
    the memory the letters take, not just their bytes."""
    if n <= 128:
        return max(16, -(-n // 16) * 16)
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class Target:
    """Where a message's outcome is recorded: a namespace, or the worker-level rejects."""

    outcomes: str
    stream: str
    namespace: str | None

    @classmethod
    def of(cls, namespace: str | None) -> Target:
        if namespace is None:
            return cls(REJECTS_OUTCOMES, REJECTS, None)
        return cls(*dead_letter_keys(namespace), namespace)

    def done_key(self, batch_id: str | None) -> str | None:
        if self.namespace is None or batch_id is None:
            return None
        return done_key(self.namespace, batch_id)


def finish(
    r: redis.Redis,
    target: Target,
    outcome: str,
    limits: IngestLimits,
    done: tuple[str, bytes] | None = None,
    letter: Letter | None = None,
) -> bool:
    """Count ``outcome``, set the ``done`` key (key, value) once and add ``letter``, in one
    atomic step. False when the done key was already set (another delivery finished the
    batch first): then this delivery is counted ``duplicate`` and nothing else is written."""
    keys = [target.outcomes, target.stream]
    args: list[Any] = [outcome, b"", DONE_TTL, limits.dead_letter_bytes, 0, ""]
    if done is not None:
        keys.append(done[0])
        args[1] = done[1]
    if letter is not None:
        fields = letter.fields(limits.dead_letter_prefix)
        size = sum(len(f.encode() if isinstance(f, str) else f) for f in map(_bytes, fields))
        args[4:6] = [alloc_size(size + _ENTRY_OVERHEAD), letter.code]
        args += fields
    else:
        args = args[:4]
    return bool(_SCRIPT(r, keys, args))
