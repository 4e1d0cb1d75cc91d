"""Adapters from Claw batches to training libraries (PyTorch, Stable-Baselines3); each needs
the ``torch`` extra and is imported on its own."""
