"""``python -m claw_tasks.settings``: the settings reference's table."""

import sys

from .table import markdown_table

sys.stdout.write(markdown_table())
