"""How a batch reaches the trainer: augmentation, collation and token batches in the
prefetch workers, the wire format, shared memory, the recipe registry, the rate limiter,
the trainer's read-ahead, ``BatchClient`` (with what its pops report, what a dropped batch
gives back, its stats)."""
