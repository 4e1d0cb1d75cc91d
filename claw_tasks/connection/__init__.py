"""URL → data store client (``client``); commands packed as RESP by hand where redis-py's
per-command cost shows (``resp``: batched reads, large writes, the gateway's asyncio
client); private redis-servers (``server``) and Redis Clusters (``cluster``) for tests,
benchmarks, ``claw up`` and ``claw demo``. Imports only ``settings``."""
