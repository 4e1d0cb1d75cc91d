"""Tensors from batches (adapters.torch): writable arrays shared, read-only ones copied;
pin_memory without an accelerator warns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orchestrator.adapters.torch import ClawIterableDataset, to_tensor


# ---- PyTorch -------------------------------------------------------------------------
def test_to_tensor_shares_writable_arrays_and_copies_readonly_ones():
    writable = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = to_tensor(writable)
    writable[0, 0] = 42
    assert t[0, 0].item() == 42  # zero-copy
    readonly = np.frombuffer(np.arange(4, dtype=np.int64).tobytes(), np.int64)
    t = to_tensor(readonly)
    assert t.dtype == torch.int64 and t.tolist() == [0, 1, 2, 3]
    assert t.data_ptr() != readonly.ctypes.data


@pytest.mark.skipif(torch.accelerator.is_available(), reason="pins when it can")
def test_pin_memory_without_accelerator_warns():
    with pytest.warns(UserWarning, match="pin_memory"):
        ds = ClawIterableDataset("any", "ns", "redis://127.0.0.1:1/0", pin_memory=True)
    assert not ds.pin_memory
