"""Vector indexes end to end: built by a real maintenance worker, queried with ``nearest``
(exact answers, where-restricted, fields read), never returning an evicted step while
eviction runs, persisted so a restarted worker projects nothing again, a recipe's
``nearest`` section filled by a real prefetch worker, and ``claw nearest``."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from claw_tasks.broker.app import client_app
from claw_tasks.format.batch import StepBatch
from claw_tasks.format.columns import StrColumn
from claw_tasks.settings import get_settings
from claw_tasks.store import Store
from claw_tasks.worker.context import context_for, forget
from claw_tasks.worker.lru import LRU
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from orchestrator.maintenance.lifecycle import drop_namespace
from orchestrator.maintenance.vectors import WRITERS, update_indexes
from orchestrator.retrieval import define_index, drop_index, nearest
from orchestrator.retrieval.calibrate import Calibration
from orchestrator.retrieval.query import INDEX_SESSIONS, SESSIONS, open_session
from orchestrator.retrieval.storage import IndexKeys
from orchestrator.retrieval.vectors import FP16_SAFE, ivf_search
from tests.support.processes import Worker

DIM = 8


@pytest.fixture(scope="module")
def worker(store_url, broker_url, redis_server, tmp_path_factory):
    """One maintenance and prefetch worker for the module's tests (2 pool processes)."""
    log = tmp_path_factory.mktemp("worker") / "maintenance-prefetch.log"
    w = Worker(store_url, "maintenance,prefetch", 2, log, {}, broker_url)
    yield w
    w.stop()


def steps(obs: np.ndarray, episode: str, origin: str, first_action: int = 0) -> StepBatch:
    n = len(obs)
    b = StepBatch(
        episode=StrColumn.of([episode] * n),
        step_index=np.arange(n),
        reward=np.zeros(n, np.float32),
        terminated=np.zeros(n, bool),
        truncated=np.zeros(n, bool),
        fields={
            "obs": obs.astype(np.float32),
            "action": np.arange(first_action, first_action + n, dtype=np.int64),
        },
    )
    b.strs["t:origin"] = StrColumn.of([origin] * n)
    return b


def tick(redis_url: str) -> None:
    """One ``claw.maintenance.vectors`` run, as beat sends it."""
    app = client_app(get_settings().broker_for(redis_url))
    app.send_task("claw.maintenance.vectors", queue="maintenance")


def runs(store: Store, name: str = "default") -> int:
    return int(store.r.hget(IndexKeys(store, name).head, "runs") or 0)


def built(store: Store, redis_url: str, name: str = "default", trained: bool = True) -> None:
    """Ask for ticks until the index has no pending steps (and is trained)."""
    head = IndexKeys(store, name).head
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        before = runs(store, name)
        tick(redis_url)
        while runs(store, name) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        h = store.r.hgetall(head)
        if h.get(b"pending") == b"0" and (not trained or int(h.get(b"gen", 0)) >= 1):
            return
    raise AssertionError(f"index {name} not built: {store.r.hgetall(head)}")


def exact(base: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    d = ((queries[:, None, :] - base[None, :, :]) ** 2).sum(-1)
    return np.argsort(d, axis=1, kind="stable")[:, :k]


@pytest.fixture
def expert(redis_url: str, namespace: str) -> tuple[Store, np.ndarray]:
    """3,000 steps: two expert episodes and a noisy one; step i has action i, id i + 1."""
    store = Store(redis_url, namespace)
    store.create(capacity=4000)
    x = np.random.default_rng(0).standard_normal((3000, DIM)).astype(np.float32)
    for i, origin in enumerate(("expert", "expert", "noisy")):
        store.commit(steps(x[i * 1000 : (i + 1) * 1000], f"e{i}", origin, i * 1000))
    yield store, x
    forget(namespace, dropped=False)


def test_the_beat_task_builds_indexes_that_answer_exactly(redis_url, expert, worker):
    store, x = expert
    # IVF forced (exact_below 0) with every list probed: the approximate path, exact answers.
    define_index(store, {"nlist": 16, "nprobe": 16, "exact_below": 0})
    define_index(store, {"name": "flat", "kind": "exact", "metric": "cosine"})
    built(store, redis_url)
    built(store, redis_url, "flat", trained=False)
    q = x[[5, 1500, 2999]] + 0.01

    got = nearest(store, q, 5, fields=["action", "reward", "tags.origin"])
    want = exact(x, q, 5)
    assert (got.ids == want + 1).all()  # one shard: id = seq = row + 1
    assert (got.fields["action"] == want).all()
    assert got.fields["reward"].shape == (3, 5)
    assert got.meta["tags.origin"][2][0] == "noisy"
    assert (np.diff(got.distances, axis=1) >= 0).all()

    experts = nearest(store, q, 5, where="tags.origin == 'expert'", fields=["action"])
    assert (experts.fields["action"] < 2000).all()
    assert (experts.ids == exact(x[:2000], q, 5) + 1).all()

    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    cos = nearest(store, q, 3, index="flat")
    want = np.argsort(-(q / np.linalg.norm(q, axis=1, keepdims=True)) @ unit.T, axis=1)[:, :3]
    assert (cos.ids == want + 1).all()
    assert np.allclose(cos.distances[:, 0], 1, atol=1e-3)  # inner products of unit vectors

    few = nearest(store, q, 5, where="tags.origin == 'noisy' and step_index < 2")
    assert (few.ids[:, :2] > 2000).all() and (few.ids[:, 2:] == -1).all()  # only 2 match


def test_no_evicted_step_is_ever_returned(redis_url, expert, worker):
    """Retention-style evictions and ring overwrites run while queries run: no answer
    holds a step whose eviction had finished before the query started."""
    store, x = expert
    define_index(store, {"nlist": 16, "nprobe": 4, "exact_below": 0})
    built(store, redis_url)
    gone: list[tuple[float, np.ndarray]] = []  # (when its eviction finished, ids)
    stop = threading.Event()
    errors: list[BaseException] = []

    def evict() -> None:
        rng, writer = np.random.default_rng(1), Store(redis_url, store.namespace)
        seq, more = 3000, np.random.default_rng(2)
        try:
            while not stop.is_set():
                ids = rng.choice(np.arange(max(1, seq - 3900), seq + 1), 50, replace=False)
                writer.evict(ids.tolist())
                gone.append((time.monotonic(), ids))
                new = more.standard_normal((200, DIM)).astype(np.float32)
                writer.commit(steps(new, f"n{seq}", "expert", seq))
                seq += 200  # the ring (4,000) overwrites the oldest 200 past its capacity
                gone.append((time.monotonic(), np.arange(1, max(1, seq - 3999))))
                tick(redis_url)
                time.sleep(0.02)
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    thread = threading.Thread(target=evict, daemon=True)
    thread.start()
    answered, rng = 0, np.random.default_rng(3)
    try:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline and not errors:
            started = time.monotonic()
            q = x[rng.choice(3000, 16)] + 0.01
            got = nearest(store, q, 10, fields=["action"])
            dead = [ids for t, ids in gone if t < started]
            returned = got.ids[got.ids > 0]
            assert not np.isin(returned, np.concatenate(dead) if dead else []).any()
            answered += int((got.ids > 0).all())
    finally:
        stop.set()
        thread.join(30)
    assert not errors, errors
    assert answered >= 5 and len(gone) >= 10


def test_a_worker_restart_reuses_the_persisted_index(redis_url, expert, start_worker):
    store, _ = expert
    define_index(store, {"nlist": 16, "nprobe": 16, "exact_below": 0})
    first = start_worker("maintenance")
    built(store, redis_url)
    keys = IndexKeys(store, "default")
    log_len, centroids = store.r.xlen(keys.log), store.r.hget(keys.head, "centroids")
    # A run counts itself before it unlocks: killed in between, its lock would hold the
    # second worker off for the lock's TTL. Kill it idle.
    deadline = time.monotonic() + 60
    while store.r.exists(keys.lock) and time.monotonic() < deadline:
        time.sleep(0.05)
    first.kill()  # SIGKILL: nothing is flushed on the way out

    second = start_worker("maintenance")
    before = runs(store)
    tick(redis_url)
    deadline = time.monotonic() + 60
    while runs(store) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runs(store) > before
    assert store.r.xlen(keys.log) == log_len  # nothing projected or written again
    assert store.r.hget(keys.head, "centroids") == centroids  # nor trained again

    new = np.random.default_rng(9).standard_normal((10, DIM)).astype(np.float32)
    store.commit(steps(new, "late", "expert", 3000))
    built(store, redis_url)
    late = list(range(3000, 3010))

    def logged() -> list[list[int]]:  # the rows entries (the log also has nprobe entries)
        return [
            np.frombuffer(e[b"rows"], "<i8").tolist()
            for _, e in store.r.xrevrange(keys.log, count=50)
            if b"rows" in e
        ]

    deadline = time.monotonic() + 60  # the second worker projects the late rows, once
    while late not in logged() and time.monotonic() < deadline:
        tick(redis_url)
        time.sleep(0.2)
    assert logged()[0] == late
    second.stop()

    forget(store.namespace, dropped=False)  # a fresh reader: loads the arrays, no worker needed
    got = nearest(store, new[:2] + 0.001, 1, fields=["action"])
    assert got.fields["action"][:, 0].tolist() == [3000, 3001]


def test_a_recipe_attaches_each_rows_nearest_expert_steps(redis_url, expert, namespace, worker):
    store, x = expert
    define_index(store, {"kind": "exact"})
    built(store, redis_url, trained=False)
    learner = Store(redis_url, f"{namespace}-learner")
    learner.create(capacity=1000)
    states = x[:64] + 0.01
    learner.commit(steps(states, "l0", "learner"))
    client = BatchClient(learner.namespace, redis_url)
    try:
        client.register(
            {
                "name": "dagger",
                "batch_size": 32,
                "fields": ["obs", "action"],
                "sources": [{"name": "learner"}],
                "nearest": {
                    "namespace": store.namespace,
                    "k": 3,
                    "where": "tags.origin == 'expert'",
                    "fields": ["action", "obs"],
                },
            }
        )
        batch = client.pop("dagger", timeout=60)
    finally:
        client.close()
    assert batch["nearest.action"].shape == (32, 3)
    assert batch["nearest.obs"].shape == (32, 3, DIM)
    want = exact(x[:2000], batch["obs"], 3)
    assert (batch["nearest.action"] == want).all()
    assert (batch["nearest.id"] == want + 1).all()
    assert np.allclose(batch["nearest.obs"], x[want])


def test_claw_nearest_answers_from_the_shell(redis_url, expert, worker):
    store, x = expert
    runner, env = CliRunner(), {"CLAW_REDIS_URL": redis_url, "COLUMNS": "200"}

    def claw(*args: str) -> str:
        done = runner.invoke(app, ["nearest", store.namespace, *args], env=env)
        assert done.exit_code == 0, done.output
        return done.output

    assert "'default'" in claw("--define", '{"kind": "exact"}')
    built(store, redis_url, trained=False)
    out = json.loads(claw("--of", "11", "--k", "3", "--fields", "action", "--json"))
    assert out["ids"][0][0] == 11 and out["action"][0][0] == 10
    assert out["ids"][0] == (exact(x, x[[10]], 3) + 1).tolist()[0]
    table = claw("--state", ",".join(map(str, x[10].tolist())), "--k", "2", "--fields", "action")
    assert "state 0" in table and " 11 " in table


def test_claw_nearest_bounds_k_and_prints_json_without_nan(redis_url, expert, worker):
    """`--k 1000000000` asked Faiss for a (1, 10**9 + 8) result (MemoryError, a traceback);
    `--json` with fewer matches than k printed NaN, which no JSON parser reads."""
    store, _ = expert
    runner, env = CliRunner(), {"CLAW_REDIS_URL": redis_url, "COLUMNS": "200"}
    base = ["nearest", store.namespace, "--of", "11"]
    assert runner.invoke(app, [*base, "--define", '{"kind": "exact"}'], env=env).exit_code == 0
    built(store, redis_url, trained=False)
    for k in ("1000000000", "0", "-5", "100000000000000000000"):
        done = runner.invoke(app, [*base, "--k", k], env=env)
        assert done.exit_code == 2, done.output
        assert "--k" in done.output and "1..1024" in done.output, done.output
        assert "Traceback" not in done.output and done.exception.__class__ is SystemExit
    # Three steps match: the other 97 neighbours are id -1 with null distance and fields.
    done = runner.invoke(
        app,
        [*base, "--k", "100", "--json", "--fields", "action,obs", "--where", "id <= 3"],
        env=env,
    )
    assert done.exit_code == 0, done.output
    out = json.loads(done.output, parse_constant=lambda c: pytest.fail(f"{c} in --json"))
    assert sorted(out["ids"][0][:3]) == [1, 2, 3]
    assert out["ids"][0][3:] == [-1] * 97
    assert out["distances"][0][3:] == [None] * 97 and None not in out["distances"][0][:3]
    assert out["action"][0][3:] == [None] * 97 and sorted(out["action"][0][:3]) == [0, 1, 2]
    # A vector field's missing neighbour is one null, not a list of nulls.
    assert out["obs"][0][3:] == [None] * 97 and all(len(o) == DIM for o in out["obs"][0][:3])


def test_a_namespace_made_again_is_queried_afresh(redis_url, namespace):
    """A process's session notices, in the round trip that reads the index's log, that the
    namespace was dropped and made again (another capacity, other steps)."""
    x = np.random.default_rng(4).standard_normal((200, DIM)).astype(np.float32)
    store = Store(redis_url, namespace)
    store.create(capacity=500)
    store.commit(steps(x, "a", "expert"))
    define_index(store, {"kind": "exact"})
    update_indexes(store)
    try:
        assert nearest(store, x[:3], 1).ids[:, 0].tolist() == [1, 2, 3]
        old = open_session(store, None, "default")
        drop_namespace(store.r, namespace)  # forgets this process's sessions: keep the old
        sessions = context_for(store).part(SESSIONS, lambda: LRU(INDEX_SESSIONS))
        sessions.put("default", old)  # one, as a process that did not drop it still has it
        again = Store(redis_url, namespace)
        again.create(capacity=300)
        y = x[:100] + 5
        again.commit(steps(y, "b", "expert", 1000))
        define_index(again, {"kind": "exact"})
        update_indexes(again)
        got = nearest(again, y[:2], 1, fields=["action"])  # the same session key as before
        assert got.fields["action"][:, 0].tolist() == [1000, 1001]
        assert open_session(again, None, "default") is not old
    finally:
        forget(namespace, dropped=False)


def test_the_quantizer_is_trained_again_as_the_vectors_double(redis_url, namespace):
    """Trained on the first 1,000 steps, again at 2,000 (a reader reloads once for it),
    and no more (the next double, 4,000, exceeds the capacity); answers stay exact with
    every list probed."""
    x = np.random.default_rng(7).standard_normal((3000, DIM)).astype(np.float32)
    store = Store(redis_url, namespace)
    store.create(capacity=3500)
    define_index(store, {"nlist": 16, "nprobe": 16, "exact_below": 0})
    head = IndexKeys(store, "default").head
    try:
        gens = []
        for i in range(3):
            store.commit(steps(x[i * 1000 : (i + 1) * 1000], f"e{i}", "expert", i * 1000))
            update_indexes(store)
            gens.append((int(store.r.hget(head, "gen")), int(store.r.hget(head, "trained"))))
            got = nearest(store, x[[5, 999, i * 1000 + 7]] + 0.01, 3)
            assert (
                got.ids == exact(x[: (i + 1) * 1000], x[[5, 999, i * 1000 + 7]] + 0.01, 3) + 1
            ).all()
        assert gens == [(1, 1000), (2, 2000), (2, 2000)]
        assert open_session(store, None, "default").vectors.loads == 2  # cold, then gen 2
    finally:
        forget(namespace, dropped=False)


def test_a_namespace_keeps_a_writer_per_index_however_many(redis_url, namespace):
    """More indexes than a process keeps retrieval sessions of: every tick runs each
    index's writer, kept from the tick before (none made again round robin); the writer of
    an index dropped goes at the next tick."""
    x = np.random.default_rng(5).standard_normal((50, DIM)).astype(np.float32)
    store = Store(redis_url, namespace)
    store.create(capacity=100)
    store.commit(steps(x, "a", "expert"))
    names = [f"i{i}" for i in range(INDEX_SESSIONS + 2)]
    for name in names:
        define_index(store, {"name": name, "kind": "exact"})
    try:
        update_indexes(store)
        writers = context_for(store).part(WRITERS, dict)
        first = dict(writers)
        assert sorted(key[0] for key in first) == sorted(names)
        update_indexes(store)
        assert all(writers[key] is writer for key, writer in first.items())
        drop_index(store, names[0])
        update_indexes(store)
        assert sorted(key[0] for key in writers) == sorted(names[1:])
    finally:
        forget(namespace, dropped=False)


def test_a_narrow_where_probes_more_lists(redis_url, expert):
    """``nprobe`` 2 of 16 lists, a where keeping 1/15 of the steps: it probes every list,
    so the answers are the exact ones among those steps (2 lists would miss some)."""
    store, x = expert
    define_index(store, {"nlist": 16, "nprobe": 2, "exact_below": 0})
    update_indexes(store)
    kept = np.flatnonzero(np.arange(3000) % 1000 < 67)  # step_index < 67 in each episode
    q = np.random.default_rng(8).standard_normal((40, DIM)).astype(np.float32)
    got = nearest(store, q, 5, where="step_index < 67")
    assert (got.ids == kept[exact(x[kept], q, 5)] + 1).all()


def test_a_vector_beyond_fp16s_range_gives_a_reader_float32_codes(redis_url, expert):
    """A reader holding fp16 codes catches up, from the log, on a step with a component
    past ``FP16_SAFE``: its IVF holds every row's vector again, as float32, and answers
    stay exact with every list probed, none of them an evicted step. ``codes: float32``
    gives float32 codes from the start."""
    store, x = expert
    define_index(store, {"nlist": 16, "nprobe": 16, "exact_below": 0})
    f32 = {"name": "f32", "codes": "float32", "nlist": 16, "nprobe": 16, "exact_below": 0}
    define_index(store, f32)
    update_indexes(store)
    q = x[[5, 1500, 2999]] + 0.01
    assert (nearest(store, q, 5).ids == exact(x, q, 5) + 1).all()
    vectors = open_session(store, None, "default").vectors
    assert vectors.ivf is not None and vectors.ivf.code_size == 2 * DIM  # fp16
    assert (nearest(store, q, 5, index="f32").ids == exact(x, q, 5) + 1).all()
    assert open_session(store, None, "f32").vectors.ivf.code_size == 4 * DIM  # as defined
    gone = np.unique(exact(x, q, 2).ravel())  # each query's two nearest rows
    store.evict((gone + 1).tolist())
    far = np.zeros(DIM, np.float32)
    far[0] = 4 * FP16_SAFE
    new = np.stack([x[5] + 0.002, far, x[1500] - 0.003])  # rows 3000-3002
    store.commit(steps(new, "far", "expert", 3000))
    update_indexes(store)

    got = nearest(store, q, 5)
    every = np.concatenate([x, new])
    live = np.setdiff1d(np.arange(len(every)), gone)
    want = live[exact(every[live], q, 5)]
    assert (got.ids == want + 1).all() and not np.isin(got.ids - 1, gone).any()
    d = ((q[:, None, :] - every[want]) ** 2).sum(-1)
    np.testing.assert_allclose(got.distances, d, rtol=1e-5)
    assert vectors.loads == 1 and vectors.ivf.code_size == 4 * DIM  # float32, no reload
    assert vectors.ivf.ntotal == len(every) == np.count_nonzero(vectors.vid)  # every row
    unmasked = np.ones(len(vectors.vid), bool)  # the IVF's own answers: exact over every row
    _, rows = ivf_search(vectors.ivf, vectors.coarse, q, 8, unmasked, 16, vectors.vectors)
    assert (rows == exact(every, q, 8)).all()


def test_the_writer_calibrates_nprobe_and_readers_take_it(redis_url, namespace):
    """Without an ``nprobe`` in the definition the writer calibrates one to the recall
    target when it trains, and again once the vectors have grown by half (a reader takes
    the new one from the log, without reloading); held-out states reach the target. An
    ``nprobe`` in the definition is kept as it is."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5000, DIM)).astype(np.float32)
    store = Store(redis_url, namespace)
    store.create(capacity=8000)
    define_index(store, {"nlist": 64, "exact_below": 0})
    define_index(store, {"name": "pinned", "nlist": 64, "nprobe": 3, "exact_below": 0})
    head = IndexKeys(store, "default").head
    try:
        for e in range(30):  # episodes of 100 steps; training takes 39 per list: 2,496
            store.commit(steps(x[e * 100 : (e + 1) * 100], f"e{e}", "expert", e * 100))
        update_indexes(store)
        h = store.r.hgetall(head)
        first = int(h[b"nprobe"])
        assert int(h[b"gen"]) == 1 and int(h[b"calibrated"]) == 3000
        assert float(h[b"recall_bound"]) >= 0.95 and 1 < first < 64
        q = rng.standard_normal((200, DIM)).astype(np.float32)  # states of no stored episode
        got = nearest(store, q, 10)
        want = exact(x[:3000], q, 10) + 1
        hits = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got.ids, want, strict=True)])
        assert hits >= 0.95
        session = open_session(store, None, "default")
        assert session.vectors.nprobe == first and session.vectors.loads == 1

        for e in range(30, 50):  # 5,000 vectors: grown by half, not doubled
            store.commit(steps(x[e * 100 : (e + 1) * 100], f"e{e}", "expert", e * 100))
        update_indexes(store)
        h = store.r.hgetall(head)
        assert int(h[b"gen"]) == 1 and int(h[b"calibrated"]) == 5000
        nearest(store, q, 10)
        assert session.vectors.nprobe == int(h[b"nprobe"]) and session.vectors.loads == 1
        # Whatever the value, a new calibration reaches a live reader through the log.
        other = first + 5 if first + 5 != int(h[b"nprobe"]) else first + 6
        session.vectors.storage.set_calibrated(Calibration(other, 0.97, 0.96), 5000)
        nearest(store, q, 10)
        assert session.vectors.nprobe == other and session.vectors.loads == 1

        nearest(store, q, 10, index="pinned")
        assert open_session(store, None, "pinned").vectors.nprobe == 3
        assert store.r.hget(IndexKeys(store, "pinned").head, "nprobe") is None
    finally:
        forget(namespace, dropped=False)


def test_steps_an_index_skips_do_not_count_as_growth(redis_url, namespace):
    """An index whose ``where`` keeps half the steps counts only the steps it holds: the
    writer's next ticks neither calibrate nor train it again for the skipped half."""
    x = np.random.default_rng(12).standard_normal((6000, DIM)).astype(np.float32)
    store = Store(redis_url, namespace)
    store.create(capacity=8000)
    define_index(store, {"nlist": 64, "where": "tags.origin == 'expert'"})
    names = IndexKeys(store, "default")
    try:
        for e in range(60):  # 3,000 expert steps, 3,000 others
            origin = "expert" if e % 2 else "other"
            store.commit(steps(x[e * 100 : (e + 1) * 100], f"e{e}", origin, e * 100))
        for _ in range(10):
            if not update_indexes(store)["default"]["pending"]:
                break
        h = store.r.hgetall(names.head)
        assert int(h[b"gen"]) == 1 and int(h[b"calibrated"]) == 3000
        log = len(store.r.xrange(names.log))
        update_indexes(store)
        update_indexes(store)
        entries = store.r.xrange(names.log)
        assert len(entries) == log and not any(b"nprobe" in e for _, e in entries)
        assert int(store.r.hget(names.head, "gen")) == 1
    finally:
        forget(namespace, dropped=False)
