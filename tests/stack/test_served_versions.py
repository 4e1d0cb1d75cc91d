"""What trainers are served, through real prefetch workers (one per module): a recipe
``as_of`` a snapshot never serves a step committed after it while an Ingestor keeps
committing, nor one the snapshot had labelled untrainable; and lineage: in a training loop
of 200 updates each popped batch declares the policy it trains, and "which data trained
policy v" is exactly the trainer's own record of the ids it popped for v, "which policies
trained on step s / episode e" its inverse, from the log's index and its tail; the CLI
answers the same; the log is bounded, and its index answers as a scan of it does."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter, defaultdict

import numpy as np
from prometheus_client import generate_latest
from typer.testing import CliRunner

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import FieldSpec, Schema
from orchestrator.cli.exporter import registry_for
from orchestrator.cli.main import app
from orchestrator.delivery.client import BatchClient
from orchestrator.delivery.lineage import LineageLog, decode_ids, encode_ids, record
from orchestrator.delivery.lineage_index import LineageIndex, format_sid
from orchestrator.maintenance import snapshots as versions

UPDATES = 200


def test_which_data_trained_policy_v_is_the_trainers_record(redis_url, namespace, workers):
    schema = Schema(fields={"obs": FieldSpec("<f4", (4,)), "action": FieldSpec("<i8", ())})
    ing = Ingestor(namespace, redis_url, schema=schema, flush_interval=None)
    for e in range(30):
        with ing.episode(f"e{e}") as ep:
            for i in range(40):
                ep.add(np.full(4, i, np.float32), i % 3, float(i))
    ing.close()
    client = BatchClient(namespace, redis_url)
    mine: dict[str, list[int]] = defaultdict(list)  # the trainer's own record
    try:
        client.register(
            {
                "name": "train",
                "batch_size": 32,
                "fields": ["obs"],
                "sources": [{"name": "all"}],
                "prefetch": {"depth": 64},
            }
        )
        for update in range(UPDATES):
            policy = f"v{update // 10}"  # a new policy every 10 updates
            if update % 2:
                batch = client.pop("train", timeout=60, policy_version=policy)
            else:  # popped first, declared after (as a read-ahead does)
                batch = client.pop("train", timeout=60)
                client.trained("train", batch, policy)
            mine[policy] += np.asarray(batch.ids).tolist()
            if update == 120:  # the beat's pass: the queries read its segment and the tail
                client.flush_lineage()
                assert LineageLog(client.store).build_index(force=True).entries == 121
        client.flush_lineage()
        log = LineageLog(client.store)
        assert log.length() == UPDATES
        for policy, ids in mine.items():
            found = log.trained(policy)
            assert len(found) == 10 and {e.recipe for e in found} == {"train"}
            got = np.sort(np.concatenate([e.ids for e in found]))
            assert np.array_equal(got, np.sort(ids)), policy
        # the inverse: which policies trained on a step, on an episode
        by_step: dict[int, Counter] = defaultdict(Counter)
        for policy, ids in mine.items():
            for i in ids:
                by_step[i][policy] += 1
        some = sorted(by_step)[::50]
        assert {k: Counter(v) for k, v in log.policies(np.array(some)).items()} == {
            k: by_step[k] for k in some
        }
        runner = CliRunner()
        res = runner.invoke(
            app,
            ["--redis-url", redis_url, "lineage", namespace, "--policy", "v3", "--ids", "--json"],
        )
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["ids"] == sorted(mine["v3"])
        episode_ids = client.store.episode("e7", fields=[])["id"].tolist()
        res = runner.invoke(
            app, ["--redis-url", redis_url, "lineage", namespace, "--episode", "e7", "--json"]
        )
        assert res.exit_code == 0, res.output
        expected: Counter = Counter()
        for i in episode_ids:
            expected.update(by_step.get(i, {}))
        assert json.loads(res.output)["policies"] == dict(expected)
        res = runner.invoke(app, ["--redis-url", redis_url, "lineage", namespace, "--policy", "v3"])
        assert res.exit_code == 0, res.output
        assert f"policy 'v3' of {namespace!r}: 10 batches" in " ".join(res.output.split())
        res = runner.invoke(app, ["--redis-url", redis_url, "lineage", namespace])
        assert res.exit_code == 0, res.output
        assert "v3" in res.output and "batches" in res.output  # the table of policies
        # the fills' sampling figures, as claw metrics exports them
        # A fill counts each batch as it pushes it and its timings when it ends: read both
        # once no fill is midway (the queue is full, so the counts stop moving).
        labels = f'namespace="{namespace}",recipe="train"'
        for _ in range(100):
            made = client.stats("train")["train"]["produced"]
            scrape = generate_latest(registry_for(redis_url, redis_url)).decode()
            if f"claw_sample_seconds_count{{{labels}}} {float(made)}" in scrape:
                break
            time.sleep(0.1)
        assert f"claw_sample_seconds_count{{{labels}}} {float(made)}" in scrape
        assert f'claw_sample_batch_rows_bucket{{le="32",{labels}}} {float(made)}' in scrape
        assert f'claw_sample_hit_rate{{{labels},source="all"}} 1.0' in scrape
    finally:
        client.close()


def test_ids_round_trip_and_the_log_is_bounded(redis_url, namespace):
    rng = np.random.default_rng(3)
    for ids in (rng.integers(1, 10**6, 256), rng.integers(1, 2**62, 64), np.array([5, 5, 5])):
        assert np.array_equal(decode_ids(encode_ids(ids)), np.sort(ids))
    from claw_tasks.store import Store

    store = Store(redis_url, namespace)
    log = LineageLog(store, maxlen=100)
    with store.r.pipeline(transaction=False) as pipe:
        for k in range(1000):
            log.queue(pipe, record("r", 1, k, rng.integers(1, 10**6, 8)))
        pipe.execute()
    assert 100 <= log.length() <= 200  # MAXLEN ~: trimmed by whole stream nodes
    assert [e.policy for e in log.entries()][-1] == "999"


def test_the_index_answers_as_the_whole_log_does(redis_url, namespace):
    """Segments, a tail, trimming (whole segments dropped, the oldest one partly): every
    query equals a scan of what the log holds."""
    from claw_tasks.store import Store

    store = Store(redis_url, namespace)
    rng = np.random.default_rng(4)
    index = LineageIndex(store.r, f"{store.layout_keys.base}lineage", segment=300, min_segment=150)
    log = LineageLog(store, maxlen=1500, index=index)

    def append(k0: int, k1: int) -> None:
        with store.r.pipeline(transaction=False) as pipe:
            for k in range(k0, k1):  # two trainers' policies interleave; ids spread or recent
                ids = rng.integers(1, 5000, 16) if k % 3 else rng.integers(k, k + 400, 16)
                log.queue(pipe, record("r", 1, f"{'ab'[k % 2]}{k // 40}", ids))
            pipe.execute()

    def check() -> None:
        held = list(log.entries())  # the reference: a scan of the log
        by_step: dict[int, Counter] = defaultdict(Counter)
        by_policy: dict[str, list[str]] = defaultdict(list)
        for e in held:
            by_policy[e.policy].append(e.entry_id)
            for i in e.ids.tolist():
                by_step[i][e.policy] += 1
        names = list(by_policy)  # the oldest (maybe partly trimmed), the newest, some between
        for p in {names[0], names[-1], *names[::6]}:
            assert [e.entry_id for e in log.trained(p)] == by_policy[p], p
        assert log.trained("nope") == []
        some = np.concatenate([rng.choice(sorted(by_step), 40), [0, 10**9]])
        got = log.policies(some)
        assert {k: Counter(v) for k, v in got.items()} == {int(k): by_step[k] for k in some}
        assert log.counts() == {p: len(v) for p, v in by_policy.items()}

    append(0, 1000)
    assert index.build().segments == 3  # 3 x 300; the 100 left: too few, and young
    check()
    append(1000, 2600)  # the log trims its oldest (MAXLEN ~ 1500), unindexed ones too
    report = index.build(force=True)
    segs, wm, _ = index.state()
    assert report.dropped >= 1 and wm == log.r.xrevrange(log.key, count=1)[0][0].decode()
    check()
    sids = index.sids(segs[:1])[0]  # trimmed to the middle of the oldest segment
    log.r.xtrim(log.key, minid=format_sid(*sids[len(sids) // 2].tolist()), approximate=False)
    check()
    append(2600, 2700)  # and a tail again
    check()
    fields = {**record("r", 1, "bad", [1]), "ids": b"\x07junk"}  # not a client's entry
    log.r.xadd(log.key, fields)
    assert index.build(force=True).entries == 101  # indexed with no rows: the pass goes on
    assert log.policies(np.array([1]))[1].get("bad") is None


def test_as_of_serves_only_the_snapshots_steps_while_ingest_runs(redis_url, namespace, workers):
    schema = Schema(fields={"obs": FieldSpec("<f4", (4,)), "action": FieldSpec("<i8", ())})
    ing = Ingestor(namespace, redis_url, schema=schema, capacity=100_000, flush_interval=None)
    for e in range(20):
        with ing.episode(f"e{e}") as ep:
            for i in range(50):
                ep.add(np.full(4, i, np.float32), 0, float(i))
    ing.flush(wait=True)
    store = ing.store
    live = store.labels()
    ids = live.ids[live.alive]
    store.curate(ids[:100], trainable=False)
    info = versions.take(store, "v1")
    member = set(ids.tolist())
    untrainable = set(ids[:100].tolist())
    store.curate(ids[:100], trainable=True)  # after the snapshot: trainable again

    stop = threading.Event()

    def produce() -> None:  # commits go on while the recipe of the snapshot is served
        k = 0
        while not stop.is_set():
            with ing.episode(f"late{k}") as ep:
                for _ in range(20):
                    ep.add(np.zeros(4, np.float32), 0, -1.0)
            ing.flush(wait=True)
            k += 1

    thread = threading.Thread(target=produce)
    thread.start()
    client = BatchClient(namespace, redis_url)
    try:
        name = f"asof-{uuid.uuid4().hex[:6]}"
        client.register(
            {
                "name": name,
                "batch_size": 128,
                "fields": ["obs", "reward"],
                "sources": [{"name": "all"}],
                "as_of": "v1",
                "prefetch": {"depth": 2},
            }
        )
        served = set()
        for _ in range(15):
            b = client.pop(name, timeout=60)
            served |= set(np.asarray(b.ids).tolist())
            assert (np.asarray(b["reward"]) >= 0).all()  # no late step (reward -1)
        assert served <= member - untrainable and len(served) > 500
        client.unregister(name)
    finally:
        stop.set()
        thread.join()
        client.close()
        ing.close()
    assert store.labels().alive.sum() > info.steps  # ingest did go on meanwhile
