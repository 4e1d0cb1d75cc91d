"""The table of every ``CLAW_*`` variable, in the order the settings reference
(docs: Reference, Settings) lists them: the sections of this package, concatenated."""

from __future__ import annotations

from .connection import CONNECTION
from .credentials import CREDENTIALS
from .delivery import DELIVERY
from .http_limits import HTTP, HttpLimits
from .ingest_limits import INGEST, IngestLimits
from .resources import RESOURCES
from .variable import Variable

VARIABLES: tuple[Variable, ...] = (
    *CONNECTION,
    *DELIVERY,
    *RESOURCES,
    *INGEST,
    *HTTP,
    *CREDENTIALS,
)
BY_NAME: dict[str, Variable] = {v.name: v for v in VARIABLES}

GROUPS: dict[str, type] = {"limits": IngestLimits, "http": HttpLimits}
"""The ``Settings`` attributes that group variables (``limits.x``, ``http.x``)."""


def markdown_table() -> str:
    """The settings reference's table, one row per variable in ``VARIABLES``' order."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default_text} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"
