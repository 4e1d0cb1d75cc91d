"""Read-only views over a namespace for people: its statistics, read by one collector
(:mod:`~orchestrator.inspect.stats`), and ad-hoc queries from the sampling index. Shared by
the CLI (``claw stats``, ``claw query``, metrics), the web inspector and the gateway."""
