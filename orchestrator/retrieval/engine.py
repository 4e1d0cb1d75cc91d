"""Faiss, imported when first used: the ``retrieval`` extra (``faiss-cpu``), so that
``import orchestrator`` and every recipe without ``nearest`` work without it."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def load() -> ModuleType:
    try:
        return importlib.import_module("faiss")
    except ImportError:
        raise ImportError(
            "vector indexes need Faiss: pip install 'claw[retrieval]' (faiss-cpu==1.15.1)"
        ) from None


class _Faiss:
    """Attribute access imports Faiss (``faiss.IndexIVFFlat``, ``faiss.knn``, ...)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(load(), name)


faiss: Any = _Faiss()
