"""The recipe registry under concurrent writers (threads, each with its own client)."""

from __future__ import annotations

import threading
from collections import defaultdict

from orchestrator.delivery.client import BatchClient
from orchestrator.recipe.model import Recipe

THREADS, ROUNDS = 6, 8


def _spec(batch_size: int) -> dict:
    return {
        "name": "race",
        "batch_size": batch_size,
        "fields": ["obs"],
        "sources": [{"name": "all"}],
    }


def _run(clients: list[BatchClient], work) -> list[Recipe]:
    """``work(client, thread, round)`` on every client at once, round after round."""
    barrier = threading.Barrier(len(clients))
    out: list[Recipe] = []
    errors: list[BaseException] = []

    def loop(i: int, client: BatchClient) -> None:
        try:
            for k in range(ROUNDS):
                barrier.wait()
                out.append(work(client, i, k))
        except BaseException as e:  # reported by the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=loop, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def _one_content_per_version(recipes: list[Recipe], key) -> dict[int, set]:
    contents: dict[int, set] = defaultdict(set)
    for rec in recipes:
        contents[rec.version].add(key(rec))
    assert all(len(c) == 1 for c in contents.values()), {
        v: c for v, c in contents.items() if len(c) > 1
    }
    return contents


def test_concurrent_registrations_never_share_a_version(redis_url, namespace):
    clients = [BatchClient(namespace, redis_url) for _ in range(THREADS)]
    try:
        got = _run(clients, lambda c, i, k: c.register(_spec(1 + i + THREADS * k)))
        versions = _one_content_per_version(got, lambda rec: rec.batch_size)
        assert len(versions) == THREADS * ROUNDS  # every registration changed the recipe
        assert sorted(versions) == list(range(1, THREADS * ROUNDS + 1))
        stored = clients[0].registry.get("race").recipe
        assert stored.version == THREADS * ROUNDS
        assert versions[stored.version] == {stored.batch_size}
    finally:
        clients[0].unregister("race")  # the fills asked for find nothing to do
        for c in clients:
            c.close()


def test_concurrent_set_params_keep_every_change(redis_url, namespace):
    clients = [BatchClient(namespace, redis_url) for _ in range(THREADS)]
    try:
        clients[0].register(_spec(8))
        got = _run(clients, lambda c, i, k: c.set_params("race", **{f"p{i}": k}))
        _one_content_per_version(got, lambda rec: tuple(sorted(rec.params.items())))
        assert sorted(rec.version for rec in got) == list(range(2, THREADS * ROUNDS + 2))
        final = clients[0].registry.get("race").recipe
        assert final.params == {f"p{i}": ROUNDS - 1 for i in range(THREADS)}  # none lost
    finally:
        clients[0].unregister("race")  # the fills asked for find nothing to do
        for c in clients:
            c.close()


def test_a_rollout_push_lands_once_at_its_cursor(redis_url, namespace):
    """``push_rollout`` appends a formed rollout's minibatches only at the cursor it was
    given, advancing the cursor and counters with them in one call: a second push at the
    same cursor (another fill) or of another rollout writes nothing; the recipe's version
    and whether it is registered come back with the push."""
    client = BatchClient(namespace, redis_url)
    spec = {**_spec(8), "params": {"policy_version": 0}, "rollout": {"steps": 16, "epochs": 2}}
    version = client.register(spec).version
    reg, name = client.registry, "race"
    skey = reg.rollout_keys(name)[0]
    reg.r.delete(reg.queue(name))
    reg.r.hset(skey, mapping={"no": 3, "cursor": 0})
    before = reg.counts(name)
    assert reg.push_rollout(name, 3, 0, 8, [b"a", b"b"]) == (2, version, True)
    assert reg.push_rollout(name, 3, 0, 8, [b"c"]) is None  # pushed already
    assert reg.push_rollout(name, 2, 2, 8, [b"c"]) is None  # another rollout
    assert reg.push_rollout(name, 3, 2, 8, [b"c"]) == (3, version, True)
    assert reg.r.lrange(reg.queue(name), 0, -1) == [b"a", b"b", b"c"]
    assert int(reg.r.hget(skey, "cursor")) == 3
    after = reg.counts(name)
    assert int(after["produced"]) - int(before.get("produced", 0)) == 3
    assert int(after["sampled"]) - int(before.get("sampled", 0)) == 24
    client.unregister(name)
    reg.r.hset(skey, mapping={"no": 3, "cursor": 3})
    assert reg.push_rollout(name, 3, 3, 8, [b"d"]) == (1, None, False)  # taken back by the caller
    client.close()
