"""Read-only views over a namespace for people: summary statistics and ad-hoc queries from
the sampling index. Shared by the CLI (``claw stats``, ``claw query``, metrics) and the web
inspector."""
