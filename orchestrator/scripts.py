"""The orchestrator's Lua scripts, kept as package files in ``orchestrator/lua/``.

They only read (but ``unlock.lua``, a lock's compare-and-delete) and run by EVALSHA on
plain pipelines: redis-py's pipelined ``Script`` asks SCRIPT EXISTS first, one more round
trip on every call. A server that does not know a script (restarted, flushed) answers
NOSCRIPT: :func:`execute` loads it and runs again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from functools import cache
from importlib.resources import files
from typing import Any

import redis
from redis.exceptions import NoScriptError


@cache
def lua_source(name: str) -> str:
    return files("orchestrator").joinpath("lua", f"{name}.lua").read_text()


class Lua:
    """One read-only script: queue calls with :meth:`queue`, run them with :func:`execute`."""

    def __init__(self, name: str) -> None:
        self.source = lua_source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        pipe.evalsha(self.sha, len(keys), *keys, *args)


def execute(client: redis.Redis, scripts: Sequence[Lua], queue: Callable[[Any], None]) -> list[Any]:
    """Run the commands ``queue`` puts on a pipeline in one round trip; on NOSCRIPT load
    ``scripts`` and run them again."""
    try:
        return _run(client, queue)
    except NoScriptError:
        for script in scripts:
            client.script_load(script.source)
        return _run(client, queue)


def _run(client: redis.Redis, queue: Callable[[Any], None]) -> list[Any]:
    with client.pipeline(transaction=False) as pipe:
        queue(pipe)
        return pipe.execute()
