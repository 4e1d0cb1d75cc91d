"""The client SDK: ``Ingestor`` buffers steps and ships them as Celery ingest tasks.

``ingestor`` holds the producing API, ``buffering`` the buffer, the sending thread and
``flush``/``close``, ``sending`` the publishing and confirmation, ``episode`` the
per-episode writer, ``columns`` the column writer, ``checks`` the value checks run before
anything is buffered, ``backpressure`` the wait on a full Redis, ``gym`` the
``RecordSteps`` wrapper (import it from ``claw_tasks.client.gym``: gymnasium is loaded only
then), ``pettingzoo`` the multi-agent ``RecordParallelSteps`` (likewise: pettingzoo).
Builds no worker app: it sends through ``claw_tasks.broker.app.client_app``. May import
every layer below ``worker``; never ``worker``."""

from claw_tasks.client.episode import Episode
from claw_tasks.client.ingestor import Ingestor
from claw_tasks.client.sending import FlushResult, IngestError

__all__ = ["Episode", "FlushResult", "IngestError", "Ingestor"]
