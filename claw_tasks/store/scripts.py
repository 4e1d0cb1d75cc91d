"""Lua scripts, kept as package files (``<package>/lua/<name>.lua``) and run by EVALSHA.

No redis-py ``Script`` objects: pipelined, they ask SCRIPT EXISTS first, one more round
trip on every call. A server that does not know a script (restarted, flushed) answers
NOSCRIPT; the script is then loaded and the call made again (pipelines:
:func:`~claw_tasks.connection.resp.execute`, which this module hands on).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from typing import Any

from redis.exceptions import NoScriptError

from claw_tasks.connection.client import Client
from claw_tasks.connection.resp import execute as execute


@cache
def lua_source(name: str, package: str = "claw_tasks") -> str:
    """A script's source, with the files it names in ``--! include <name>`` lines first
    (Redis scripts cannot import each other)."""
    text = files(package).joinpath("lua", f"{name}.lua").read_text()
    parts = [
        lua_source(line.split()[-1], package)
        for line in text.splitlines()
        if line.startswith("--! include ")
    ]
    return "\n".join([*parts, text])


class Lua:
    """One script: call it on a client, or queue it on a pipeline run by :func:`execute`."""

    def __init__(self, name: str, package: str = "claw_tasks") -> None:
        self.name = name
        self.source = lua_source(name, package)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def queue(self, pipe: Any, keys: Sequence[str], args: Sequence[Any]) -> None:
        # execute_command, not pipe.evalsha: redis-py's cluster pipeline refuses the
        # method, but routes the command by its keys (all in one slot: the caller's rule).
        pipe.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)

    def __call__(self, client: Client, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)


class _Bound:
    """A script bound to a client: ``script(keys=..., args=...)``."""

    def __init__(self, script: Lua, client: Client) -> None:
        self.script, self.client = script, client

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self.script(self.client, keys, args)


class Scripts:
    """The store's scripts bound to one client."""

    ALL = {name: Lua(name) for name in ("alloc", "commit", "update", "dict")}

    def __init__(self, client: Client) -> None:
        self.alloc = _Bound(self.ALL["alloc"], client)
        self.commit = _Bound(self.ALL["commit"], client)
        self.update = _Bound(self.ALL["update"], client)
        self.dict = _Bound(self.ALL["dict"], client)
