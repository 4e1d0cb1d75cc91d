"""docs/adapters.md's reference table of every adapter's constructor arguments is the
signatures as they are, and the arguments the adapters share have one name and one
default (orchestrator.adapters.options): a shared name's default differs only where
``DEFAULTS_DIFFER`` says why, no adapter takes an old spelling, and ``policy_version``
names one of the shared counters."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from orchestrator.adapters.options import DEFAULTS_DIFFER, POLICY_VERSIONS, RENAMED, SHARED
from tests.support.paths import ROOT

pytest.importorskip("ray.rllib")
pytest.importorskip("trl")

BEGIN = "<!-- adapter arguments: begin (tests/system/test_adapter_table.py writes it) -->"
END = "<!-- adapter arguments: end -->"


def adapters() -> dict[str, Any]:
    from orchestrator.adapters.rllib import (
        ClawEpisodeReplayBuffer,
        ClawMultiAgentEpisodeReplayBuffer,
        ClawPrioritizedEpisodeReplayBuffer,
    )
    from orchestrator.adapters.sb3 import (
        ClawDictReplayBuffer,
        ClawDictRolloutBuffer,
        ClawReplayBuffer,
        ClawRolloutBuffer,
    )
    from orchestrator.adapters.torch import ClawIterableDataset
    from orchestrator.adapters.torchrl import ClawStorage
    from orchestrator.adapters.trl import ClawRollouts

    return {
        "ClawReplayBuffer": ClawReplayBuffer,
        "ClawDictReplayBuffer": ClawDictReplayBuffer,
        "ClawRolloutBuffer": ClawRolloutBuffer,
        "ClawDictRolloutBuffer": ClawDictRolloutBuffer,
        "ClawStorage": ClawStorage,
        "ClawEpisodeReplayBuffer": ClawEpisodeReplayBuffer,
        "ClawPrioritizedEpisodeReplayBuffer": ClawPrioritizedEpisodeReplayBuffer,
        "ClawMultiAgentEpisodeReplayBuffer": ClawMultiAgentEpisodeReplayBuffer,
        "ClawIterableDataset": ClawIterableDataset,
        "ClawRollouts": ClawRollouts,
    }


def parameters(cls: Any) -> dict[str, inspect.Parameter]:
    """The constructor's named arguments, following ``**kwargs`` to the parent's (the
    RLlib subclasses pass theirs on)."""
    out: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        for p in params:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                out.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out


def _cell(p: inspect.Parameter | None) -> str:
    if p is None:
        return ""
    if p.default is inspect.Parameter.empty:
        return "required"
    return f"`{p.default!r}`"


def table() -> str:
    found = {name: parameters(cls) for name, cls in adapters().items()}
    names: list[str] = []
    for params in found.values():
        names += [n for n in params if n not in names]
    shared = [n for n in SHARED if n in names] + ["policy_version"]
    own = sorted(n for n in names if n not in shared)
    head = "| argument | " + " | ".join(f"`{a}`" for a in found) + " |"
    lines = [head, "|" + "---|" * (len(found) + 1)]
    for n in [*shared, *own]:
        cells = [_cell(params.get(n)) for params in found.values()]
        lines.append(f"| `{n}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_docs_table_is_the_signatures() -> None:
    doc = (ROOT / "docs" / "adapters.md").read_text()
    assert BEGIN in doc and END in doc
    written = doc[doc.index(BEGIN) + len(BEGIN) : doc.index(END)].strip()
    assert written == table(), (
        "docs/adapters.md: rewrite the table with tests/system/test_adapter_table.py's table()"
    )


def test_shared_arguments_have_one_default() -> None:
    for name, cls in adapters().items():
        params = parameters(cls)
        assert not set(params) & set(RENAMED), name
        for arg, (default, _) in SHARED.items():
            if arg in params and (name, arg) not in DEFAULTS_DIFFER:
                assert params[arg].default == default, (name, arg)
        if "policy_version" in params:
            assert params["policy_version"].default in POLICY_VERSIONS, name
