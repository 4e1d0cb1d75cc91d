"""The `claw` commands, one module per group; importing this package registers them on
orchestrator.cli.app.app, in the order `claw --help` lists them (hence the import order)."""

from orchestrator.cli.commands import services

# isort: split
from orchestrator.cli.commands import store

# isort: split
from orchestrator.cli.commands import versions

# isort: split
from orchestrator.cli.commands import maintenance

# isort: split
from orchestrator.cli.commands import archive

# isort: split
from orchestrator.cli.commands import retrieval

__all__ = ["archive", "maintenance", "retrieval", "services", "store", "versions"]
