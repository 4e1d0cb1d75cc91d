"""What beat runs: the scheduled maintenance tasks (refill today)."""
