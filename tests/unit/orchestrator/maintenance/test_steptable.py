"""Step rows to an Arrow table and back (maintenance.steptable): bit exact for odd dtypes
and shapes, through a Parquet file."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from claw_tasks.format.batch import Ragged, StrColumn
from claw_tasks.format.schema import FieldSpec, Schema
from orchestrator.maintenance.steptable import StepRows, from_table, to_table


@pytest.mark.parametrize(
    "dtype, shape",
    [
        ("<f8", ()),
        ("|b1", (3,)),
        ("<c8", (2,)),
        (">i4", (2, 2)),
        ("<f2", (300,)),
        ("<u2", (None,)),
        ("<f4", (None, 3)),
    ],
)
def test_table_round_trip_is_bit_exact(dtype, shape):
    rng = np.random.default_rng(3)
    spec = FieldSpec(dtype, shape)
    n = 6

    def random(k: int, dims: tuple) -> np.ndarray:
        """Any bit pattern (NaN payloads, odd bools aside) of ``k`` rows of ``dims``."""
        raw = rng.integers(0, 256, (k, spec.row_bytes), dtype=np.uint8)
        if np.dtype(dtype).kind == "b":
            raw %= 2
        return raw.view(np.dtype(dtype)).reshape(k, *dims)

    lengths = np.array([0, 2, 1, 3, 0, 1], np.int32)
    if spec.ragged:
        obs = Ragged(random(int(lengths.sum()), shape[1:]), lengths)
    else:
        obs = random(n, shape)
    schema = Schema(fields={"obs": spec}, tags={"color": "str", "w": "num"})
    next_obs = {r: obs.row(r) if spec.ragged else obs[r] for r in (2, 5)}
    step_rows = StepRows(
        id=np.arange(n, dtype=np.int64),
        episode_id=StrColumn.of(["a", "a", "b", "b", "c", "c"]),
        step_index=np.arange(n, dtype=np.int32),
        policy_version=np.zeros(n, np.int32),
        timestamp=np.full(n, 1.5),
        reward=np.arange(n, dtype=np.float32),
        priority=np.array([np.nan, 1, 2, 3, 4, 5], np.float32),
        terminated=np.arange(n) % 2 == 1,
        truncated=np.zeros(n, bool),
        trainable=np.ones(n, bool),
        strs={
            "agent_id": StrColumn.of([None] * n),
            "task_id": StrColumn.of(["t"] * n),
            "skill_tag": StrColumn.of([None, "s"] * 3),
            "reward_source": StrColumn.of([None] * n),
            "quality": StrColumn.of([None] * n),
            "tags.color": StrColumn.of(["r", None] * 3),
        },
        nums={"tags.w": np.array([np.nan, 1, 2, 3, 4, 5])},
        fields={"obs": obs},
        next_obs=next_obs,
        info={1: {"k": 1, "s": "v", "f": 0.1}},
    )
    back = from_table(pq.read_table(_parquet(to_table(step_rows, schema, {}))))
    got, want = back.fields["obs"], obs
    if spec.ragged:
        assert np.array_equal(got.lengths, want.lengths)
        got, want = got.values, want.values
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    assert back.next_obs.keys() == next_obs.keys()
    for k, v in next_obs.items():
        assert back.next_obs[k].tobytes() == np.asarray(v).tobytes()
        assert back.next_obs[k].shape == np.asarray(v).shape
    assert back.info == step_rows.info
    assert back.strs["tags.color"].strings() == step_rows.strs["tags.color"].strings()
    assert back.priority.tobytes() == step_rows.priority.tobytes()


def _parquet(table: pa.Table) -> pa.BufferReader:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return pa.BufferReader(sink.getvalue())
