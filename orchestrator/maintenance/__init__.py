"""What beat runs, one module per task (``claw.maintenance.<name>``): ``refill`` (prefetch
queues), ``evict`` (retention, choosing with ``eviction_choice``, pruning dictionaries with
``dictprune``), ``priorities`` (recomputed by rules), ``vectors`` (vector indexes),
``cleaning`` (declared sources cleaned into a namespace) and ``archive`` (Parquet, its
files in ``archive_files``, the table layout in ``steptable``); beside them what the CLI
runs on the same data: ``restore``, ``plaincopy`` and ``lifecycle`` (namespaces as a
whole)."""
