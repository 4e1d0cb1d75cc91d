"""The admission budget on a real Redis, without HTTP: what a trainer's recipe declares
(register, set_params, a restart from an earlier version, unregister), how the gate of a
gateway admits against it (group reservations, n trajectories at once, a full budget, two
gates sharing it), and how slots come back (a stale trajectory's group, rewarded ones the
version moved past before a fill served them, dropped batches), exactly once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from claw_tasks.client import Ingestor
from claw_tasks.format.schema import tag_column
from orchestrator import BatchClient
from orchestrator.delivery import admission, giveback, prefetch, shm
from orchestrator.delivery.admission import AdmissionError
from orchestrator.delivery.prefetch import run_fill
from orchestrator.delivery.registry import Registry
from orchestrator.gateway import recorder
from orchestrator.gateway.gate import Gate, Principal, key_hash
from orchestrator.gateway.metrics import GatewayMetrics
from orchestrator.gateway.recorder import TURN, Recorder
from orchestrator.recipe.model import Recipe
from tests.support.llmturns import turns_batch


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
        assert admission.release_stale(store, "g1-2", "g1", 2) == 0  # fresh enough: it waits
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


def test_a_trajectory_never_rewarded_expires(store, redis_url):
    """An admitted trajectory that goes ``expiry`` seconds without a turn or its reward
    gives its slots back (its group's reservation, once), counted expired; a rewarded one
    is no longer open; a turn moves the expiry; a full budget looks for expired slots at
    once."""
    import time

    with BatchClient(store.namespace, redis_url) as client:
        client.register(recipe(staleness=0))  # budget (0 + 0 + 1) * 8 = 8, groups of 4

        async def run() -> None:
            # sweeps only when told, or when the budget is full (not in the background)
            gate = Gate(store, redis_url, GatewayMetrics(), wait=0.0, expiry=0.6, sweep_s=3600)
            anyone = Principal()
            for j in range(4):
                assert (await gate.enter(anyone, (f"a-{j}",), "ga")).status == "ok"
            assert (await gate.enter(anyone, ("solo",), None)).status == "ok"
            assert admission.state(store)["admitted"] == 5
            # a-0 is rewarded (fresh: nothing released), a-1 makes a turn (moved on)
            assert admission.release_stale(store, "a-0", "ga", 0) == 0
            T = [admission.trajectory_key(store, "a-1"), admission.admission_key(store)]
            TURN(store.r, [*T, admission.open_key(store)], ["turn", 60, 0, "", 5.0, "a-1"])
            assert admission.state(store)["open"] == 4
            time.sleep(0.8)
            assert await gate.sweep() == 3  # a-2, a-3 and solo; a-1 not yet
            st = admission.state(store)
            # the group's reservation (4 slots) came back once, solo's 1
            assert (st["expired"], st["admitted"], st["open"], st["released"]) == (3, 0, 1, 0)
            counted = "claw_gateway_admission_expired_trajectories_total"
            assert gate.metrics.registry.get_sample_value(counted) == 3
            assert await gate.sweep() == 0
            # a late reward of an expired trajectory gives nothing back a second time
            assert admission.release_stale(store, "a-2", "ga", -5) == 0
            # fill the budget; once full, a first try sweeps: expired slots let it in
            for j in range(8):
                got = await gate.enter(anyone, (f"b-{j}",), "gb" if j < 4 else "gc")
                assert got.status == "ok"
            assert (await gate.enter(anyone, ("late",), None)).status == "refused"
            time.sleep(1.1)  # the b- group expires; a full budget sweeps at most once a second
            assert (await gate.enter(anyone, ("late2",), None)).status == "ok"
            await gate.aclose()

        asyncio.run(run())
        ops = [e["op"] for e in admission.read_log(store)]
        assert ops.count("expire") >= 3 and "release" not in ops
        client.set_params("grpo", policy_version=0)  # a live change keeps the open ones
        assert admission.state(store)["open"] > 0
        client.register({**recipe(staleness=0), "batch_size": 3})  # fresh: none in flight
        assert admission.state(store)["open"] == 0


def test_no_budget_declared_skips_the_script_until_one_is(store, redis_url):
    """While no trainer declares a budget, a process asks once, then lets shared-token
    first calls through for ``NO_BUDGET_S`` without a round trip; a declaration ends that
    at once (its announcement), so the next new trajectory is counted."""

    async def run() -> None:
        gate = Gate(store, redis_url, GatewayMetrics(), wait=0.0)
        anyone = Principal()
        for i in range(200):  # asks (none declared) until the announcements are listened to
            assert (await gate.enter(anyone, (f"u-{i}",), "g")).status == "ok"
            if gate.no_budget_known:
                break
            await asyncio.sleep(0.01)
        assert store.r.hexists(admission.trajectory_key(store, "u-0"), "adm")
        assert (await gate.enter(anyone, ("u-x",), "g")).status == "ok"
        assert not store.r.exists(admission.trajectory_key(store, "u-x"))  # no round trip
        with BatchClient(store.namespace, redis_url) as client:
            client.register(recipe(staleness=0))  # budget 8
            for _ in range(100):
                if not gate.no_budget_known:
                    break
                await asyncio.sleep(0.02)
            assert (await gate.enter(anyone, ("c-0",), "gc")).status == "ok"
            assert admission.state(store)["admitted"] == 4  # counted: the group reserved
            client.unregister("grpo")
        await gate.aclose()

    asyncio.run(run())


@pytest.mark.both_stores
def test_rewarded_unserved_trajectories_lapse_exactly_once(store, redis_url):
    """A trajectory rewarded while fresh and never served holds its slot only until the
    version moves past its bound: then its slots (its group's reservation, once) come back
    exactly once, whichever of two racing gateways or the trainer gets there first; a
    served one keeps its slot (the trainer consumed it). Rewarded and stale trajectories
    are counted by turns."""
    with BatchClient(store.namespace, redis_url) as client:
        client.register(recipe(staleness=1))  # budget (1 + 0 + 1) * 8 = 16, groups of 4
        turn_keys = [admission.admission_key(store), admission.open_key(store)]

        async def run() -> None:
            a = Gate(store, redis_url, GatewayMetrics(), wait=0.0, sweep_s=3600)
            b = Gate(store, redis_url, GatewayMetrics(), wait=0.0, sweep_s=3600)
            anyone = Principal()
            for g, gate in (("g1", a), ("g2", b)):
                for j in range(4):
                    assert (await gate.enter(anyone, (f"{g}-{j}",), g)).status == "ok"
            assert (await a.enter(anyone, ("solo",), None)).status == "ok"
            assert admission.state(store)["admitted"] == 9
            for t in [f"g1-{j}" for j in range(4)]:  # g1's trajectories make 3 turns each
                for _ in range(3):
                    TURN(
                        store.r,
                        [admission.trajectory_key(store, t), *turn_keys],
                        ["turn", 60, 0, "", 0, t],
                    )
            for t in [*(f"g{i}-{j}" for i in (1, 2) for j in range(4)), "solo"]:
                assert admission.release_stale(store, t, t[:2] if t != "solo" else "", 0) == 0
            st = admission.state(store)
            assert (st["waiting"], st["released"], st["admitted"]) == (9, 0, 9)
            with store.r.pipeline(transaction=True) as pipe:  # a fill serves g2
                admission.serve(pipe, store, [f"g2-{j}" for j in range(4)])
                pipe.execute()
            # the version moves past them (a trainer whose own sweep did not run: the
            # gateways' sweeps race for the slots)
            store.r.hset(admission.admission_key(store), "version", 2)  # bound 1 > 0
            got = await asyncio.gather(a.sweep(), b.sweep(), a.sweep(), b.sweep())
            assert sum(got) == 5  # g1's 4 and solo
            assert await a.sweep() == 0 and await b.sweep() == 0
            released = "claw_gateway_admission_released_slots_total"
            by = [g.metrics.registry.get_sample_value(released) or 0 for g in (a, b)]
            assert sum(by) == 5  # g1's reservation once (4 slots), solo's 1
            for g in (a, b):
                await g.aclose()

        asyncio.run(run())
        st = admission.state(store)
        # what is left counted is g2, served: 4 slots the trainer consumed
        assert (st["admitted"], st["released"], st["lapsed"], st["waiting"]) == (4, 5, 5, 0)
        assert st["rewarded_by_turns"]["4"] == 4 and st["rewarded_by_turns"]["1"] == 5
        assert st["stale_by_turns"]["4"] == 4 and st["stale_by_turns"]["1"] == 1
        assert sum(e["slots"] for e in admission.read_log(store) if e["op"] == "release") == 5

        # the trainer's declaration releases at once, no gateway needed
        client.set_params("grpo", policy_version=2)  # budget 32, min_version 1
        assert admission.state(store)["admitted"] == 4
        store.r.hset(admission.admission_key(store), "admitted", 20)  # in flight elsewhere

        async def more() -> None:
            gate = Gate(store, redis_url, GatewayMetrics(), wait=0.0, sweep_s=3600)
            for j in range(4):
                assert (await gate.enter(Principal(), (f"g3-{j}",), "g3")).status == "ok"
            await gate.aclose()

        asyncio.run(more())
        for j in range(4):
            assert admission.release_stale(store, f"g3-{j}", "g3", 2) == 0
        assert admission.state(store)["admitted"] == 24
        client.set_params("grpo", policy_version=4)  # bound 3: g3 (version 2) lapses
        st = admission.state(store)
        assert (st["admitted"], st["lapsed"], st["waiting"]) == (20, 9, 0)
        assert admission.lapse(store) == (0, 0)


def test_a_trajectory_served_as_its_reward_lands_never_lapses(store, redis_url, monkeypatch):
    """The reward makes a trajectory's steps servable, so a fill may serve it before the
    reward call returns (here: a push in the instant after the rewards are written).
    Admission learns of the reward first, so the served trajectory, its slot consumed by
    the trainer, is not left among the rewarded, unserved ones to lapse later."""
    with BatchClient(store.namespace, redis_url) as client:
        client.register(recipe(staleness=1))

        async def enter() -> None:
            gate = Gate(store, redis_url, GatewayMetrics(), wait=0.0, sweep_s=3600)
            assert (await gate.enter(Principal(), ("t",), None)).status == "ok"
            await gate.aclose()

        asyncio.run(enter())
        keys = [admission.trajectory_key(store, "t"), admission.admission_key(store)]
        keys.append(admission.open_key(store))
        TURN(store.r, keys, ["turn", 60, 0, "", 0, "t"])
        store.commit(
            turns_batch([{"traj": "t", "turn": 0, "prompt": [1], "response": [2], "key": 1}])
        )
        attach = recorder.attach_rewards

        def attach_then_serve(*args, **kwargs):
            n = attach(*args, **kwargs)
            with store.r.pipeline(transaction=True) as pipe:  # a fill's push, right then
                admission.serve(pipe, store, ["t"])
                pipe.execute()
            return n

        monkeypatch.setattr(recorder, "attach_rewards", attach_then_serve)
        rec = Recorder(Ingestor(store.namespace, redis_url, flush_interval=None), GatewayMetrics())
        try:
            assert rec.reward("t", 1.0, None, None, timeout=30) == 1
        finally:
            rec.close()
        assert admission.state(store)["waiting"] == 0
        # a reward posted again (the first failed after admission learnt of it) counts
        # once and does not put the served trajectory back
        assert admission.release_stale(store, "t", "", 0) == 0
        st = admission.state(store)
        assert (st["waiting"], st["rewarded_by_turns"]["1"]) == (0, 1)
        client.set_params("grpo", policy_version=3)  # bound 2: t (version 0) is past it
        st = admission.state(store)
        assert (st["lapsed"], st["released"], st["admitted"]) == (0, 0, 1)


def llm_groups(store, groups: range, size: int = 4) -> None:
    """Group g: ``size`` one-turn trajectories ``g<g>-<j>`` at policy version g (and
    ``tags.min_version`` g), key 1000 + g, one commit per group (the older first)."""
    for g in groups:
        turns = [
            {"traj": f"g{g}-{j}", "turn": 0, "prompt": [1, g], "response": [5, j]}
            | {"last": True, "key": 1000 + g, "version": g, "reward": float(j)}
            for j in range(size)
        ]
        b = turns_batch(turns)
        b.nums[tag_column("min_version")] = np.full(size, float(g))
        store.commit(b)


@pytest.mark.both_stores
def test_a_fill_serves_within_the_declared_bound_oldest_first_and_served_never_lapse(
    store, redis_url
):
    """An admission recipe without a ``where`` serves nothing older than v - s (the
    gateway released those at their reward), ready groups oldest first; what a fill
    serves never lapses, and what a push takes back returns to the waiting set and lapses
    once the version moves past it."""
    llm_groups(store, range(4))
    reg = Registry(store)
    rec = Recipe.model_validate(
        {
            "name": "grpo",
            "batch_size": 1,
            "fields": ["response_ids", "policy_version"],
            "params": {"policy_version": 3},
            "admission": {"max_staleness": 1, "trajectories": 8},  # min_version 2
            "prefetch": {"depth": 2},
            "sources": [{"name": "s", "sampler": {"kind": "group", "group_size": 4, "once": True}}],
        }
    )
    reg.put(rec, None)
    admission.declare(store, rec, fresh=True)  # budget (1 + 3 + 1) * 8 = 40, 24 consumed

    async def enter(groups: range) -> None:
        gate = Gate(store, redis_url, GatewayMetrics(), wait=0.0, sweep_s=3600)
        for g in groups:
            for j in range(4):
                assert (await gate.enter(Principal(), (f"g{g}-{j}",), f"g{g}")).status == "ok"
        await gate.aclose()

    asyncio.run(enter(range(4)))
    released = [
        admission.release_stale(store, f"g{g}-{j}", f"g{g}", g) for g in range(4) for j in range(4)
    ]
    assert sum(released) == 8  # g0 and g1 (versions 0, 1 < 2): stale at their reward
    assert admission.state(store)["waiting"] == 8
    assert run_fill(reg, "grpo")["made"] == 2
    items = reg.drain("grpo")
    batches = [shm.from_message(i) for i in items]
    assert [set(b["policy_version"].tolist()) for b in batches] == [{2}, {3}]  # oldest first
    st = admission.state(store)
    assert (st["waiting"], st["admitted"]) == (0, 40 - 8)
    # a push taken back (the recipe changed while it was made) puts back the trajectories
    # it took, and only those (g3 was served by the batch before)
    asyncio.run(enter(range(4, 5)))
    assert sum(admission.release_stale(store, f"g4-{j}", "g4", 3) for j in range(4)) == 0
    reg.r.hset(reg.versions_key, "grpo", rec.version + 1)
    served = [f"g{g}-{j}" for g in (3, 4) for j in range(4)]
    assert prefetch.push(reg, rec, items[1], served=served) == "stale"
    assert admission.state(store)["waiting"] == 4
    reg.r.hset(reg.versions_key, "grpo", rec.version)
    # a queued once-batch dropped unserved (g2's): its claims and its trajectories go back
    giveback.drop(store, rec, [items[0]])
    assert admission.state(store)["waiting"] == 8
    giveback.give_back(store, rec, 0, [batches[0].claim], "dropped again")  # nothing twice
    assert admission.state(store)["waiting"] == 8
    # the version moves past every group: g2 and g4, put back unserved, lapse; g3 stays
    admission.declare(store, rec.model_copy(update={"params": {"policy_version": 5}}), False)
    st = admission.state(store)
    assert (st["lapsed"], st["waiting"], st["admitted"]) == (8, 0, 40 - 8 + 4 - 8)
