"""Where the repository is, for tests that run its scripts, read its docs or start its
processes from the checkout (``cwd=ROOT``, ``PYTHONPATH=ROOT``)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
