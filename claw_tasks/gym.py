"""Old import path of ``RecordSteps``: use ``claw_tasks.client.gym``. Goes in Claw 0.3."""

from claw_tasks.client.gym import RecordSteps

__all__ = ["RecordSteps"]
