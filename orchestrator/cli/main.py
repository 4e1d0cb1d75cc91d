"""The `claw` command line: dev stack, demo, and tools to look into the step store.

The app and its shared helpers are in orchestrator.cli.app, the commands in
orchestrator.cli.commands (one module per group); this module puts them together and is
the console entry point (`claw`, `python -m orchestrator.cli.main`)."""

from __future__ import annotations

import orchestrator.cli.commands  # noqa: F401  (registers every command on the app)
from orchestrator.cli.app import app

__all__ = ["app", "main"]


def main() -> None:
    app()


if __name__ == "__main__":
    main()
