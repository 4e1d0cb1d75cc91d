"""Lua scripts, kept as package files and registered once per client."""

from __future__ import annotations

from functools import cache
from importlib.resources import files

import redis
from redis.commands.core import Script


@cache
def lua_source(name: str) -> str:
    """A script's source, with the files it names in ``--! include <name>`` lines first
    (Redis scripts cannot import each other)."""
    text = files("claw_tasks").joinpath("lua", f"{name}.lua").read_text()
    parts = [
        lua_source(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("--! include ")
    ]
    return "\n".join([*parts, text])


class Scripts:
    """The store's scripts bound to one client (EVALSHA, reloaded on NOSCRIPT)."""

    def __init__(self, client: redis.Redis) -> None:
        self.alloc: Script = client.register_script(lua_source("alloc"))
        self.commit: Script = client.register_script(lua_source("commit"))
        self.update: Script = client.register_script(lua_source("update"))
        self.dict: Script = client.register_script(lua_source("dict"))
        self.deadletter: Script = client.register_script(lua_source("deadletter"))
