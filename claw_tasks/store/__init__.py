"""The Redis step store."""

from claw_tasks.store.store import CommitResult, NamespaceConfig, NamespaceError, Store

__all__ = ["CommitResult", "NamespaceConfig", "NamespaceError", "Store"]
