"""Array transforms a recipe names (augmentation ops) and frame stacks: numpy and OpenCV
(albumentations when a recipe names it), no Redis, no Celery.

The bottom of the orchestrator: the recipe validates against these ops, the prefetch
workers run them."""
