"""Read-only views over a namespace for people: its statistics, read by one collector
(:mod:`~orchestrator.inspect.stats`), ad-hoc queries from the sampling index, and the
batches a policy trained on made again from the lineage log (:mod:`~orchestrator.inspect.
replay`, ``claw replay``). Shared by the CLI (``claw stats``, ``claw query``, metrics), the
web inspector and the gateway."""
