"""Namespaces as a whole: which exist, the memory they use, and dropping one."""

from __future__ import annotations

from collections.abc import Iterator

import redis

SCAN_COUNT = 1000


def list_namespaces(r: redis.Redis) -> list[str]:
    """Every namespace with a config key, sorted."""
    found = set()
    for key in r.scan_iter(match="claw:{*}:config", count=SCAN_COUNT):
        name = key.decode(errors="replace")[len("claw:{") : -len("}:config")]
        if name and not any(c in name for c in "{}:"):
            found.add(name)
    return sorted(found)


def namespace_keys(r: redis.Redis, namespace: str) -> Iterator[bytes]:
    """Every key of ``namespace`` (namespace level and all shards)."""
    prefixes = (f"claw:{{{namespace}}}:".encode(), f"claw:{{{namespace}:".encode())
    pattern = "claw:{" + "".join(f"\\{c}" if c in "*?[]\\" else c for c in namespace) + "*"
    for key in r.scan_iter(match=pattern, count=SCAN_COUNT):
        if key.startswith(prefixes):
            yield key


def namespace_bytes(r: redis.Redis, namespace: str) -> int:
    """Redis memory of a namespace's keys (MEMORY USAGE; hashes are sampled)."""
    total, batch = 0, []

    def flush() -> int:
        with r.pipeline(transaction=False) as pipe:
            for k in batch:
                pipe.memory_usage(k)
            used = sum(int(u or 0) for u in pipe.execute())
        batch.clear()
        return used

    for key in namespace_keys(r, namespace):
        batch.append(key)
        if len(batch) >= SCAN_COUNT:
            total += flush()
    return total + (flush() if batch else 0)
