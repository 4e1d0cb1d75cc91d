"""``CommitHere``, the rollout buffer's in-process commit of its last message: a transient
Redis error leaves the message to the broker and a worker (nothing is lost, nothing
raised); any other error is the caller's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import redis

from claw_tasks.format.message import IngestArgs
from claw_tasks.store import Store
from orchestrator.adapters.sb3.rollout_claw import CommitHere


def _failing(error: Exception) -> Store:
    class Failing(Store):
        def revalidate(self, also: Sequence[str] = ()) -> list[bytes | None]:
            raise error  # the ingest task's first call to the store

    return Failing("redis://127.0.0.1:1/0", "ns")  # never connected


def test_a_transient_redis_error_leaves_the_message_to_be_published() -> None:
    here = CommitHere(_failing(redis.ConnectionError("down")))
    assert here(IngestArgs("ns", "b1", b"\x80", None).to_args()) is False
    assert here.outcomes == []


def test_another_error_is_raised() -> None:
    here = CommitHere(_failing(ValueError("not a transient error")))
    with pytest.raises(ValueError, match="not a transient"):
        here(IngestArgs("ns", "b1", b"\x80", None).to_args())
