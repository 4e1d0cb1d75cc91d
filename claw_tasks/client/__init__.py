"""The client SDK: ``Ingestor`` buffers steps and ships them as Celery ingest tasks.

``ingestor`` holds the producing API, ``buffering`` the buffer, the sending thread and
``flush``/``close``, ``sending`` the publishing and confirmation, ``episode`` the
per-episode writer, ``columns`` the column writer, ``checks`` the value checks run before
anything is buffered, ``backpressure`` the wait on a full Redis, ``gym`` the
``RecordSteps`` wrapper, ``pettingzoo`` the multi-agent ``RecordParallelSteps`` (both
importable from here, loaded on first use: gymnasium and pettingzoo are imported only
then). ``Schema`` and ``FieldSpec`` (``claw_tasks.format.schema``) are here too: an
``Ingestor`` takes them.
Builds no worker app: it sends through ``claw_tasks.broker.app.client_app``. May import
every layer below ``worker``; never ``worker``."""

from typing import TYPE_CHECKING, Any

from claw_tasks.client.episode import Episode
from claw_tasks.client.ingestor import Ingestor
from claw_tasks.client.sending import FlushResult, IngestError
from claw_tasks.format.schema import FieldSpec, Schema

if TYPE_CHECKING:
    from claw_tasks.client.gym import RecordSteps
    from claw_tasks.client.pettingzoo import RecordParallelSteps

__all__ = [
    "Episode",
    "FieldSpec",
    "FlushResult",
    "IngestError",
    "Ingestor",
    "RecordParallelSteps",
    "RecordSteps",
    "Schema",
]

# Imported on first use: gymnasium and pettingzoo load only for the wrapper asked for.
_LAZY = {
    "RecordSteps": "claw_tasks.client.gym",
    "RecordParallelSteps": "claw_tasks.client.pettingzoo",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'claw_tasks.client' has no attribute {name!r}")
