"""The keys of namespaces as Redis lists them (SCAN), parsed into namespace, shard and
name: what ``claw doctor``, the memory figures and the tools that list namespaces walk.
Every store key is ``claw:{<ns>}:<name>`` (namespace level) or ``claw:{<ns>:<shard>}:<name>``
(shard level)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from claw_tasks.format.names import NAMESPACE

_KEY = re.compile(rb"claw:\{([^{}:]+)(?::(\d+))?\}:(.*)", re.S)
SCAN_COUNT = 1000


@dataclass(frozen=True)
class NamespaceKey:
    namespace: str
    shard: int | None  # None: a namespace-level key
    name: str  # the part after the hash tag, e.g. "m:id:0" or "config"
    key: bytes


def parse_key(key: bytes) -> NamespaceKey | None:
    """The namespace, shard and name of a Claw key; None for other keys, and for a key
    whose namespace is not UTF-8 or not a namespace name (no namespace is named so: a
    foreign key, which must not stop the loops over every namespace)."""
    m = _KEY.fullmatch(key)
    if m is None:
        return None
    try:
        namespace = m.group(1).decode()
    except UnicodeDecodeError:
        return None
    if not NAMESPACE.fullmatch(namespace):
        return None
    shard = None if m.group(2) is None else int(m.group(2))
    return NamespaceKey(namespace, shard, m.group(3).decode(errors="replace"), key)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def scan_keys(r: redis.Redis, namespace: str | None = None) -> Iterator[NamespaceKey]:
    """Keys of `namespace` (all shards), or of every namespace when it is None."""
    match = "claw:{*" if namespace is None else f"claw:{{{_glob_escape(namespace)}*"
    for key in r.scan_iter(match=match, count=SCAN_COUNT):
        parsed = parse_key(key)
        if parsed and (namespace is None or parsed.namespace == namespace):
            yield parsed


def list_namespaces(r: redis.Redis) -> list[str]:
    """Every namespace with a config key, sorted."""
    found = set()
    for key in r.scan_iter(match="claw:{*}:config", count=SCAN_COUNT):
        parsed = parse_key(key)
        if parsed is not None and parsed.shard is None and parsed.name == "config":
            found.add(parsed.namespace)
    return sorted(found)


def namespace_keys(r: redis.Redis, namespace: str) -> Iterator[bytes]:
    """Every key of ``namespace`` (namespace level and all shards)."""
    return (k.key for k in scan_keys(r, namespace))
