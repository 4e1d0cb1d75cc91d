"""Old ``-A`` target, kept for deployments that run ``celery -A claw_tasks.app``: use
``claw_tasks.worker.app``. Goes in Claw 0.3."""

from claw_tasks.worker.app import app

__all__ = ["app"]
