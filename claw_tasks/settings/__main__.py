"""``python -m claw_tasks.settings``: the README's configuration table."""

import sys

from .table import markdown_table

sys.stdout.write(markdown_table())
