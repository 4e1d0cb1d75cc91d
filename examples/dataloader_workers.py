"""A PyTorch ``DataLoader`` with worker processes over Claw: ``ClawIterableDataset``.

Each item of the dataset is one whole batch the prefetch workers already sampled, augmented
and collated, so the DataLoader runs with ``batch_size=None``. With ``num_workers > 0`` each
DataLoader worker process opens its own ``BatchClient`` and pops from the recipe's one
queue: the workers share it, none sees a batch twice. Needs a running stack and torch:

    claw up                                        # in another terminal
    python examples/dataloader_workers.py --batches 20 --num-workers 2

``pin_memory``: on a machine with an accelerator (CUDA, ...), ``pin_memory=True`` copies
each batch once into page-locked host memory, from which ``tensor.to(device,
non_blocking=True)`` is an asynchronous DMA that overlaps the next training step; without
it the copy to the device goes through a staging buffer and blocks. Pass it to
``ClawIterableDataset`` (it pins while building the tensors, in the DataLoader worker),
not to the DataLoader (which would copy a second time). Without an accelerator it does
nothing useful: the dataset warns and turns it off.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.utils.data import DataLoader

from claw_tasks.client import Ingestor
from orchestrator.adapters.torch import ClawIterableDataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="dataloader-example")
    p.add_argument("--batches", type=int, default=20, help="batches per DataLoader worker")
    p.add_argument("--num-workers", type=int, default=2)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    ing = Ingestor(args.namespace, flush_interval=None)
    with ing.episode() as ep:
        for t in range(500):
            ep.add(
                rng.normal(size=8).astype(np.float32),
                np.int64(t % 2),
                1.0,
                terminated=t == 499,
                next_obs=np.zeros(8, np.float32) if t == 499 else None,
            )
    ing.close()
    recipe = {
        "name": "loader",
        "batch_size": 64,
        "fields": ["obs", "action", "reward"],
        "sources": [{"name": "all"}],
    }
    ds = ClawIterableDataset(
        recipe,
        args.namespace,
        timeout=120,
        num_batches=args.batches,
        pin_memory=torch.accelerator.is_available(),
    )
    loader = DataLoader(ds, batch_size=None, num_workers=args.num_workers)
    seen = 0
    for batch in loader:
        assert batch["obs"].shape == (64, 8) and batch["ids"].shape == (64,)
        seen += 1
    ds.close()
    print(f"done: {seen} batches from {args.num_workers} DataLoader workers")


if __name__ == "__main__":
    main()
