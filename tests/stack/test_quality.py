"""Data-quality statistics on a real Redis equal a numpy reference computed over the stored
data: after ingest (NaN and inf in a payload field), after eviction and the ring's
overwrites (the incremental pass recomputes only the chunks that changed), and after an
archive is restored into another namespace; ``claw stats --quality`` and ``claw metrics``
show them. (Beat running the task on a real worker: tests/stack/test_maintenance_stack.py.)"""

from __future__ import annotations

import json
import math

import numpy as np
from prometheus_client import generate_latest
from typer.testing import CliRunner

from claw_tasks.format.batch import StepBatch, StrColumn
from claw_tasks.format.schema import tag_column
from claw_tasks.store import Store
from claw_tasks.store.layout import payload_chunk_slots
from orchestrator.cli.exporter import registry_for
from orchestrator.cli.main import app
from orchestrator.maintenance.archive import archive_namespace
from orchestrator.maintenance.lifecycle import synced_index
from orchestrator.maintenance.quality import BINS, KEYS, quality_namespace
from orchestrator.maintenance.restore import restore

CAP = 40_000  # one shard: three metadata chunks of 16,376 slots


def _commit(store: Store, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    obs = rng.normal(3.0, 2.0, (n, 3)).astype(np.float32)
    obs[rng.random((n, 3)) < 0.001] = np.nan
    obs[rng.random((n, 3)) < 0.0005] = np.inf
    b = StepBatch(
        episode=StrColumn.of([f"s{seed}-{i // 100}" for i in range(n)]),
        step_index=np.arange(n) % 100,
        reward=rng.normal(0.5, 1.0, n).astype(np.float32),
        terminated=np.arange(n) % 100 == 99,
        truncated=np.zeros(n, bool),
        fields={"obs": obs, "action": rng.integers(0, 5, n).astype(np.int64)},
    )
    b.strs["task_id"] = StrColumn.of([("reach", "grasp", "push")[i % 3] for i in range(n)])
    b.strs["skill_tag"] = StrColumn.of([("a", "b")[i % 7 == 0] for i in range(n)])
    b.nums[tag_column("difficulty")] = np.where(np.arange(n) % 4 == 0, np.nan, np.arange(n) % 9)
    return store.commit(b).ids


def _reference(store: Store) -> dict:
    """Every tracked field's statistics and the counts, from the stored data with numpy."""
    index, _ = synced_index(store)
    cols = index.columns
    slots = np.flatnonzero(cols["alive"])  # one shard: rows are slots
    values = {
        name: _whole(store, name)[slots].ravel().astype(np.float64) for name in ("obs", "action")
    }
    values |= {
        "reward": cols["reward"][cols["alive"]].astype(np.float64),
        "step_index": cols["step_index"][cols["alive"]].astype(np.float64),
        "priority": cols["priority"][cols["alive"]].astype(np.float64),
        "t:difficulty": cols["t:difficulty"][cols["alive"]],
    }
    counts = {}
    for key in KEYS:
        names = store.decode_codes(key, cols[key][cols["alive"]].tolist())
        uniq, n = np.unique(["" if v is None else v for v in names], return_counts=True)
        counts[key] = dict(zip(uniq.tolist(), n.tolist(), strict=True))
    return {"values": values, "counts": counts, "steps": len(slots)}


def _whole(store: Store, name: str) -> np.ndarray:
    """A payload field of every slot, from whole chunk strings (plain GETs)."""
    spec = store.config().schema.fields[name]
    per = payload_chunk_slots(spec.row_bytes)
    cap = store.config().cap
    keys = [store.layout_keys.field(0, name, c) for c in range(-(-cap // per))]
    raw = b"".join((v or b"").ljust(per * spec.row_bytes, b"\0") for v in store.r.mget(keys))
    return np.frombuffer(raw, np.dtype(spec.dtype)).reshape(-1, *spec.shape)[:cap]


def _check(summary: dict, ref: dict) -> None:
    assert summary["steps"] == ref["steps"]
    assert summary["counts"] == ref["counts"]
    for name, v in ref["values"].items():
        st = summary["fields"][name]
        missing = name in ("priority", "t:difficulty")  # NaN there: unset
        finite = v[np.isfinite(v)]
        assert st["count"] == len(finite), name
        assert st["nan"] == (0 if missing else int(np.isnan(v).sum())), name
        assert st["inf"] == int(np.isinf(v).sum()), name
        if not len(finite):
            assert st["mean"] is None
            continue
        assert (st["min"], st["max"]) == (finite.min(), finite.max()), name
        assert math.isclose(st["mean"], finite.mean(), rel_tol=1e-9, abs_tol=1e-9), name
        assert math.isclose(st["std"], finite.std(), rel_tol=1e-9, abs_tol=1e-9), name
        lo, hi = st["edges"]
        inside = finite[(finite >= lo) & (finite <= hi)]
        want = [int((finite < lo).sum()), *np.histogram(inside, BINS, (lo, hi))[0].tolist()]
        assert st["hist"] == [*want, int((finite > hi).sum())], name


def test_quality_equals_numpy_after_ingest_eviction_and_restore(redis_url, namespace, tmp_path):
    store = Store(redis_url, namespace)
    store.create(capacity=CAP)
    ids = _commit(store, 30_000, seed=1)
    store.update_priorities(ids[::3], np.linspace(0.1, 4, len(ids[::3]), dtype=np.float32))
    _check(quality_namespace(store), _reference(store))

    store.evict(ids[6000:9000:2])  # in the first chunk only
    _commit(store, 15_000, seed=2)  # past capacity: the ring overwrites the oldest 5,000
    q = quality_namespace(store)
    ref = _reference(store)
    _check(q, ref)
    assert ref["steps"] == CAP - 1_500 and q["fields"]["obs"]["nan"] > 0
    live = ids[20_000:25_000]  # priorities of the middle chunk change, its steps do not:
    store.update_priorities(live, np.full(len(live), 9.0, np.float32))  # payload stats kept
    _check(quality_namespace(store), _reference(store))

    runner = CliRunner()
    out = runner.invoke(
        app, ["--redis-url", redis_url, "stats", "-n", namespace, "--quality", "--json"]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)[namespace]["fields"]["obs"] == q["fields"]["obs"]
    text = runner.invoke(app, ["--redis-url", redis_url, "stats", "-n", namespace, "--quality"])
    assert "grasp" in text.output and "reward mean per 5 min window" in text.output
    scrape = generate_latest(registry_for(redis_url, redis_url)).decode()
    nan = q["fields"]["obs"]["nan"]
    assert (
        f'claw_quality_nonfinite_values{{field="obs",kind="nan",namespace="{namespace}"}} {nan}.0'
        in scrape
    )
    assert (
        f'claw_quality_field_bucket{{field="reward",le="+Inf",namespace="{namespace}"}}' in scrape
    )
    assert (
        f'claw_quality_window_steps{{key="task_id",namespace="{namespace}",value="grasp",window="recent"}}'
        in scrape
    )

    archive_namespace(store, tmp_path)
    other = Store(redis_url, namespace + "-r")
    restore(tmp_path / f"ns={namespace}", other)
    _check(quality_namespace(other), _reference(other))
