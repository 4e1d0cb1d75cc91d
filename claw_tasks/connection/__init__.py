"""URL → data store client (``client``), and private redis-servers (``server``) and Redis
Clusters (``cluster``) for tests, benchmarks, ``claw up`` and ``claw demo``. Imports only
``settings``."""
