"""What beat runs: refill, retention and eviction, priority recomputation, dictionary
pruning and archival (Parquet), with restore, the plain copy of an archive and namespace
drop beside them."""
