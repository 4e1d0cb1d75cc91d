"""Claw's configuration: every ``CLAW_*`` variable, declared once, read once per process.

``VARIABLES`` is the table (name, type, default, one line of doc), the way Celery's
``celery/app/defaults.py`` declares its settings, kept in sections by subject
(``connection``, ``delivery``, ``resources``, ``ingest_limits``, ``http_limits``,
``credentials``; ``table`` joins them); ``Settings.from_env`` (``environment``) reads it
and ``get_settings()`` keeps the result for the process. This package is the only reader
of ``CLAW_*`` in Claw (``tests/unit/claw_tasks/test_settings.py`` greps for others): a
component that reads a variable itself is how it ends up on a different broker from the
workers. It imports nothing else of Claw.

Rebuilding: ``Settings.from_env(mapping)`` reads any mapping (tests, a CLI flag merged into
the environment); ``use_settings(settings)`` installs one as the process's settings, and
``use_settings()`` makes the next ``get_settings()`` read ``os.environ`` again (tests call
it after changing the environment). ``python -m claw_tasks.settings`` prints the table
the documentation's settings reference is generated from.
"""

from __future__ import annotations

from .connection import (
    CLUSTER_SCHEMES,
    DEFAULT_REDIS_URL,
    METRICS_PORT,
    WEB_PORT,
    is_cluster_url,
    redact_url,
)
from .environment import Settings, get_settings, use_settings
from .http_limits import HttpLimits
from .ingest_limits import IngestLimits
from .table import BY_NAME, GROUPS, VARIABLES, markdown_table
from .variable import MIB, Variable

__all__ = [
    "BY_NAME",
    "CLUSTER_SCHEMES",
    "DEFAULT_REDIS_URL",
    "GROUPS",
    "METRICS_PORT",
    "MIB",
    "VARIABLES",
    "WEB_PORT",
    "HttpLimits",
    "IngestLimits",
    "Settings",
    "Variable",
    "get_settings",
    "is_cluster_url",
    "markdown_table",
    "redact_url",
    "use_settings",
]
