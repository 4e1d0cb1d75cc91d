"""A lineage entry's fields as ``XADD`` sends them and ``XRANGE`` gives them back: the ids
in batch order, weights (one value or every one, bit for bit), source indexes, the
augmentation seed and the recipe version's digest; entries without them read as None."""

from __future__ import annotations

import numpy as np
import pytest

from orchestrator.delivery.lineage import (
    Entry,
    Replayable,
    Served,
    decode_weights,
    encode_weights,
    read_entry,
    record,
)
from orchestrator.delivery.wire import decode_batch, to_wire


def _read(fields: dict[str, bytes | str]) -> Entry:
    """The entry as a reader gets it from Redis (bytes keys and values)."""
    raw = {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}
    return read_entry(b"1-0", raw)


@pytest.mark.parametrize("n", [1, 7, 256, 300])
def test_an_entry_gives_back_the_batch_order_weights_sources_and_seed(n):
    rng = np.random.default_rng(n)
    ids = rng.integers(1, 10**6, n)
    ids[-1] = ids[0]  # a repeat (a draw with replacement)
    weights = rng.uniform(0.1, 1.0, n).astype(np.float32)
    sources = rng.integers(0, 3, n).astype(np.int16)
    replay = Replayable(weights, sources, 2**63 - 5, "0123456789abcdef")
    e = _read(record("r", 4, 7, ids, 1.0, replay))
    assert e.batch_ids.tolist() == ids.tolist()
    assert e.ids.tolist() == sorted(ids.tolist())
    assert e.weights.tobytes() == weights.tobytes()
    got = np.zeros(n, np.int16) if e.source_index is None else e.source_index
    assert got.tolist() == sources.tolist()
    assert (e.seed, e.recipe_digest, e.recipe_version, e.policy) == (
        2**63 - 5,
        "0123456789abcdef",
        4,
        "7",
    )


def test_equal_weights_take_one_value_and_sorted_ids_no_order():
    ids = np.arange(10, 266)
    fields = record("r", 1, None, ids, 1.0, Replayable(np.ones(256, np.float32)))
    assert "o" not in fields and "x" not in fields and "s" not in fields
    assert len(fields["w"]) == 5
    e = _read(fields)
    assert e.order is None and e.source_index is None and e.seed is None
    assert e.batch_ids.tolist() == ids.tolist()
    assert e.weights.tobytes() == np.ones(256, np.float32).tobytes()


def test_an_entry_without_replay_fields_reads_as_before():
    e = _read(record("r", 1, "p", np.array([5, 3, 9]), 1.0))
    assert e.weights is None and e.seed is None and e.recipe_digest is None
    assert e.ids.tolist() == [3, 5, 9]


def test_weights_round_trip_bit_for_bit_nan_and_subnormals_too():
    w = np.array([1.0, np.nan, 1e-45, 0.5, -0.0, np.inf], np.float32)
    assert decode_weights(encode_weights(w), len(w)).tobytes() == w.tobytes()
    zeros = np.array([0.0, -0.0, 0.0], np.float32)  # equal as numbers, not as bits
    assert decode_weights(encode_weights(zeros), 3).tobytes() == zeros.tobytes()
    nan = np.full(4, np.nan, np.float32)
    assert decode_weights(encode_weights(nan), 4).tobytes() == nan.tobytes()


def test_a_served_part_records_what_it_has():
    part = Served(3, np.array([9, 2]), np.array([0.5, 1.0], np.float32), None, "ab")
    e = _read(record("r", 3, 1, part.ids, 1.0, Replayable.of(part)))
    assert e.seed is None and e.recipe_digest == "ab" and e.batch_ids.tolist() == [9, 2]


def test_the_wire_carries_the_seed_and_the_recipe_digest():
    item = to_wire({"x": np.zeros(2)}, [1, 2], seed=2**63 - 1, recipe_digest="ff00").tobytes()
    b = decode_batch(item)
    assert (b.seed, b.recipe_digest) == (2**63 - 1, "ff00")
    plain = decode_batch(to_wire({"x": np.zeros(2)}, [1, 2]).tobytes())
    assert (plain.seed, plain.recipe_digest) == (None, None)


def test_what_replays_a_batch_is_taken_when_declared():
    """The entry is encoded with the next pop: weights scaled in place meanwhile (a
    trainer's normalisation) do not reach it."""
    batch = Served(1, np.array([4, 2]), np.array([0.5, 1.0], np.float32), 9, "ab")
    held = Replayable.of(batch)
    batch.weights[:] *= 2  # in place
    e = _read(record("r", 1, 1, batch.ids, 1.0, held))
    assert e.weights.tolist() == [0.5, 1.0]
