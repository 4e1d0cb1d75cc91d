"""Array transforms a recipe names (augmentation ops): numpy only, no Redis, no Celery.

The bottom of the orchestrator: the recipe validates against these ops, the prefetch
workers run them."""
