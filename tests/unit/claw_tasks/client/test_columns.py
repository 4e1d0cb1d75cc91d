"""StepColumns: the rows as appended, refused values before anything is written, columns
that grow up to a batch, constant metadata and tags, flushes from another thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from claw_tasks.client.columns import GROW_ROWS, StepColumns
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.schema import FieldSpec, Schema, SchemaError

SCHEMA = Schema(
    fields={"obs": FieldSpec("<f4", (3,)), "action": FieldSpec("<i8", (1,))},
)


def writer(rows: int, **kw) -> tuple[StepColumns, list[StepBatch]]:
    got: list[StepBatch] = []
    return StepColumns(SCHEMA, rows, got.append, **kw), got


def obs(i: int) -> np.ndarray:
    return np.array([i, i + 0.5, -i], np.float32)


def test_rows_come_back_as_appended_in_batches_of_rows():
    w, got = writer(4, meta={"task_id": "t", "policy_version": 7}, tags={"level": 2.0, "m": "x"})
    for i in range(10):
        nxt = obs(100 + i) if i % 3 == 2 else None
        prio = 0.5 * i if i in (1, 6) else None
        w.append(
            f"ep{i // 5}",
            i % 5,
            obs(i),
            np.array([i % 2]),
            i / 10,
            next_obs=nxt,
            priority=prio,
            terminated=i == 4,
            truncated=i == 9,
        )
    assert [b.n for b in got] == [4, 4] and len(w) == 2
    w.flush()
    w.flush()  # nothing left: nothing more
    assert [b.n for b in got] == [4, 4, 2]
    rows = [r for b in got for r in range(b.n)]
    allobs = np.concatenate([b.fields["obs"] for b in got])
    np.testing.assert_array_equal(allobs, [obs(i) for i in range(10)])
    eps = [b.episode.values[j] for b in got for j in b.episode.index.tolist()]
    assert eps == [f"ep{i // 5}" for i in range(10)] and len(rows) == 10
    steps = np.concatenate([b.step_index for b in got])
    assert steps.tolist() == [i % 5 for i in range(10)]
    np.testing.assert_allclose(np.concatenate([b.reward for b in got]), np.arange(10) / 10, 1e-6)
    term = np.concatenate([b.terminated for b in got])
    trunc = np.concatenate([b.truncated for b in got])
    assert np.flatnonzero(term).tolist() == [4] and np.flatnonzero(trunc).tolist() == [9]
    first, second, third = got
    assert first.priority is not None and np.isnan(first.priority[[0, 2, 3]]).all()
    assert first.priority[1] == 0.5 and third.priority is None
    assert second.priority is not None and second.priority[2] == 3.0
    assert first.next_rows.tolist() == [2] and second.next_rows.tolist() == [1]
    np.testing.assert_array_equal(second.next_obs, [obs(105)])
    for b in got:
        b.check_columns()
        assert b.row_errors() == {}
        assert b.strs["task_id"].strings() == ["t"] * b.n
        assert b.strs["t:m"].strings() == ["x"] * b.n
        assert (b.nums["t:level"] == 2.0).all() and (b.policy_version == 7).all()
        assert b.schema().fields == SCHEMA.fields


def test_bad_values_are_refused_before_anything_is_written():
    w, got = writer(8)
    good = (obs(0), np.array([1]))
    bad = [
        ({"obs": obs(0).astype(np.float64)}, "dtype float64, schema says float32"),
        ({"obs": obs(0)[:2]}, "shape"),
        ({"action": np.array([[1]])}, "shape"),
        ({"reward": float("nan")}, "reward is nan"),
        ({"reward": 1e39}, "finite as float32"),
        ({"priority": -1.0}, "priority is -1.0"),
        ({"step_index": 2**31}, "step_index"),
        ({"step_index": 1.5}, "step_index"),
        ({"next_obs": np.zeros(4, np.float32)}, "next_obs"),
    ]
    for change, message in bad:
        args = {"obs": good[0], "action": good[1], "reward": 0.0, "step_index": 0, **change}
        with pytest.raises(SchemaError, match=message):
            w.append("e", args.pop("step_index"), args.pop("obs"), args.pop("action"), **args)
    with pytest.raises(SchemaError, match="not in the schema"):
        w.append("e", 0, *good, 0.0, extra=np.zeros(1))
    assert len(w) == 0
    w.flush()
    assert got == []
    with pytest.raises(SchemaError, match="ragged"):
        StepColumns(
            Schema(fields={"obs": FieldSpec("<f4", (None,)), "action": FieldSpec("<i8", (1,))}),
            4,
            got.append,
        )


def test_columns_grow_to_a_batch_and_flush_from_another_thread():
    rows = 3 * GROW_ROWS + 5
    w, got = writer(rows)
    for i in range(rows + 2):
        w.append("e", i, obs(i), np.array([0]), 1.0, priority=1.0 if i == GROW_ROWS + 1 else None)
    assert [b.n for b in got] == [rows]
    np.testing.assert_array_equal(got[0].fields["obs"][:, 0], np.arange(rows, dtype=np.float32))
    p = got[0].priority
    assert p is not None and p[GROW_ROWS + 1] == 1.0 and np.isnan(np.delete(p, GROW_ROWS + 1)).all()
    stop = threading.Event()

    def flusher():
        while not stop.is_set():
            w.flush()

    t = threading.Thread(target=flusher)
    t.start()
    for i in range(2000):
        w.append("f", i, obs(i), np.array([0]), 0.0)
    stop.set()
    t.join()
    w.flush()
    steps = np.concatenate([b.step_index for b in got[1:]])
    assert steps.tolist() == [rows, rows + 1, *range(2000)]  # every row once, in order
