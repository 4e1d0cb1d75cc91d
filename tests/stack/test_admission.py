"""The admission budget on a real Redis, without HTTP: what a trainer's recipe declares
(register, set_params, a restart from an earlier version, unregister), how the gate of a
gateway admits against it (group reservations, n trajectories at once, a full budget, two
gates sharing it), and how slots come back (a stale trajectory's group, dropped batches)."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator import BatchClient
from orchestrator.delivery import admission
from orchestrator.delivery.admission import AdmissionError
from orchestrator.gateway.gate import Gate, Principal, key_hash
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import TURN


def recipe(name: str = "grpo", staleness: int = 1, version: int = 0) -> dict:
    return {
        "name": name,
        "batch_size": 2,
        "fields": ["response_ids"],
        "params": {"policy_version": version},
        "admission": {"max_staleness": staleness},
        "sources": [
            {
                "name": "s",
                "where": "tags.min_version >= $min_version",
                "sampler": {"kind": "group", "group_size": 4},
            }
        ],
    }


def test_the_trainer_declares_the_budget(store, redis_url):
    with BatchClient(store.namespace, redis_url) as client:
        r = client.register(recipe())
        assert r.params["min_version"] == 0
        st = admission.state(store)
        assert (st["version"], st["batch"], st["group"], st["budget"]) == (0, 8, 4, 16)
        with pytest.raises(AdmissionError, match="declared by recipe 'grpo'"):
            client.register(recipe("other"))
        store.r.hset(admission.admission_key(store), "admitted", 11)
        client.set_params("grpo", policy_version=2)  # a live change: the count stays
        st = admission.state(store)
        assert (st["version"], st["budget"], st["admitted"]) == (2, 32, 11)
        assert client.stats("grpo")["grpo"]["admission"]["budget"] == 32
        client.set_params("grpo", policy_version=1)  # restarted from an earlier version
        assert admission.state(store)["admitted"] == 8  # nothing counted in flight
        client.unregister("grpo")
        assert admission.state(store) is None
        client.register(recipe("other"))  # the budget is free again
        assert admission.owner(store) == "other"


def test_the_gate_admits_groups_within_the_budget(store, redis_url):
    with BatchClient(store.namespace, redis_url) as client:
        client.register(recipe(staleness=1))  # budget (1 + 0 + 1) * 8 = 16

        async def run() -> None:
            a = Gate(store, redis_url, GatewayMetrics(), wait=0.0)
            b = Gate(store, redis_url, GatewayMetrics(), wait=0.0)  # another gateway
            anyone = Principal()
            for j in range(4):  # the group's first trajectory reserves its 4 slots
                assert (await a.enter(anyone, (f"g1-{j}",), "g1")).status == "ok"
                assert admission.state(store)["admitted"] == 4
            assert (await b.enter(anyone, ("g1-4",), "g1")).status == "ok"  # a 5th: a new group
            assert admission.state(store)["admitted"] == 8
            choices = tuple(f"n~{i}" for i in range(8))  # an n = 8 call: 8 slots at once
            assert (await b.enter(anyone, choices, "g2")).status == "ok"
            assert admission.state(store)["admitted"] == 16
            full = await a.enter(anyone, ("g3-0",), "g3")
            assert full.status == "refused" and full.budget == 16
            assert (await b.enter(anyone, ("g1-2",), "g1")).status == "ok"  # admitted before
            assert (await a.enter(anyone, ("solo",), None)).status == "refused"
            st = admission.state(store)
            assert (st["waited"], st["refused"], st["admitted"]) == (2, 2, 16)
            client.set_params("grpo", policy_version=1)  # budget 24
            assert (await a.enter(anyone, ("g3-0",), "g3")).status == "ok"
            assert (await a.enter(anyone, ("solo",), None)).status == "ok"
            assert admission.state(store)["admitted"] == 21
            for g in (a, b):
                await g.aclose()

        asyncio.run(run())
        log = admission.read_log(store)
        # every start is logged; one within a group's reservation takes no new slots
        assert [e["slots"] for e in log] == [4, 0, 0, 0, 4, 8, 4, 1]
        assert [e["admitted"] for e in log] == [4, 4, 4, 4, 8, 16, 20, 21]
        assert [len(e["t"]) for e in log] == [1, 1, 1, 1, 1, 8, 1, 1]
        assert all(e["admitted"] <= e["budget"] for e in log)
        assert len({e["w"] for e in log}) == 1  # one process here: both gates share its name

        # rewarded too old to be served (vmin < v - s): its group's reservation comes back
        client.set_params("grpo", policy_version=3)  # min_version 2
        assert admission.release_stale(store, "g1-0", "g1", 2) == 0  # fresh enough
        assert admission.release_stale(store, "g1-0", "g1", 1) == 4
        assert admission.release_stale(store, "g1-1", "g1", 1) == 0  # the same group: once
        assert admission.release_stale(store, "g1-4", "g1", 0) == 4  # its second group
        # no version known: its admission version (1 < 2); a trajectory without a group
        assert admission.release_stale(store, "solo", "", None) == 1
        assert admission.release_stale(store, "solo", "", None) == 0
        assert admission.give_back(store, 3, "test") == 3
        st = admission.state(store)
        assert (st["admitted"], st["released"]) == (21 - 12, 12)
        assert admission.read_log(store, count=1)[0]["op"] == "release"


def test_session_keys_are_checked_against_their_trajectory(store, redis_url):
    key = "cs~t1~" + "s" * 40
    made = TURN(
        store.r,
        [admission.trajectory_key(store, "t1"), admission.admission_key(store)],
        ["session", 60, key_hash(key), "grp", 0],
    )
    assert made == 1

    async def run() -> None:
        gate = Gate(store, redis_url, GatewayMetrics())
        info = await gate.session(Principal("t1", key_hash(key)))
        assert info is not None and (info.group, info.may_reward) == ("grp", False)
        assert await gate.session(Principal("t1", key_hash(key + "x"))) is None
        assert await gate.session(Principal("t2", key_hash(key))) is None
        ok = await gate.enter(Principal("t1", key_hash(key)), ("t1",), None)
        assert ok.status == "ok"
        bad = await gate.enter(Principal("t1", key_hash(key)), ("t1",), "other")
        assert bad.status == "bad_group"
        assert Principal("t1").allows("t1~3") and not Principal("t1").allows("t1~x")
        assert not Principal("t1").allows("t2") and Principal().allows("anything")
        await gate.aclose()

    asyncio.run(run())
