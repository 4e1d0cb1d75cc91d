"""The trainer's end of the read-ahead pipe: each item is a buffer of its own, so a
batch decoded from it (and the tensors wrapping its arrays) is never overwritten by the
items read after it into the same read buffer."""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from orchestrator.delivery.readahead_pipe import ITEM, PIPE_BYTES, Frames, frame
from orchestrator.delivery.wire import decode_batch, to_wire


def test_an_item_read_out_of_the_pipe_outlives_the_reads_after_it():
    r, w = os.pipe()
    items = [
        to_wire({"obs": np.full((64, 8), k, np.float32)}, np.arange(64) + 100 * k).tobytes()
        for k in range(4)
    ]
    frames = Frames(r)
    got = []
    for item in items:  # one read each: every read reuses the reader's buffer
        os.write(w, frame(ITEM, item))
        kind, payload = frames.next(timeout=10)
        assert kind == ITEM and isinstance(payload, bytearray) and payload == item
        got.append(payload)
        if len(got) == 1:
            batch = decode_batch(payload)
            assert batch["obs"].flags.writeable
            tensor = torch.from_numpy(batch["obs"])  # a view: the trainer wraps the item
    os.close(w)
    os.close(r)
    views = [np.frombuffer(p, np.uint8) for p in got]
    assert not any(np.shares_memory(a, b) for i, a in enumerate(views) for b in views[i + 1 :])
    assert (tensor == 0).all() and batch.ids.tolist() == list(range(64))
    assert [bytes(p) for p in got] == items


def test_frames_longer_than_a_read_and_many_in_one_read_come_whole():
    r, w = os.pipe()
    frames = Frames(r)
    big = bytes(range(256)) * (3 * PIPE_BYTES // 256 + 7)  # spans several reads
    small = [bytes([k]) * (k + 1) for k in range(5)]
    data = b"".join(frame(ITEM, p) for p in [*small, big])
    writer = threading.Thread(target=lambda: os.write(w, data))
    writer.start()
    got = [frames.next(timeout=30) for _ in range(len(small) + 1)]
    writer.join()
    os.close(w)
    assert [p for _, p in got] == [*small, big]
    assert frames.next(timeout=1) is None and frames.eof
    os.close(r)
