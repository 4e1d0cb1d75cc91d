"""Staleness-bounded admission, the trainer's side: a recipe with an ``admission`` section
declares the namespace's budget (its current policy version v, its trajectories per batch
B, its ``max_staleness`` s) each time it is installed (``register``, ``set_params``), and
every capture gateway of the namespace admits new trajectories against it
(``orchestrator/lua/admission.lua`` has the rule and the key layout; docs/llm.md,
"Admission"). Here: the keys, the declaration, the state and the log read back, and the
served-staleness counters a fill adds to a recipe's counters."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from claw_tasks.store import Store
from claw_tasks.store.scripts import Lua, execute
from orchestrator.recipe.model import Recipe

SCRIPT = Lua("admission", "orchestrator")
LOG_ENTRIES = 10_000
"""The admission log keeps about this many entries (a capped stream)."""
STALE_PREFIX = "stale:"
"""Counter fields of served staleness: ``stale:n`` batches, ``stale:sum`` the sum of their
mean staleness, ``stale:max:<k>`` the batches whose oldest turn is k versions old."""


COUNTERS = ("admitted", "total", "waited", "refused", "released", "expired", "lapsed")
"""The admission hash's counters (``admitted`` is running + accepted, a level)."""

LENGTHS = ("1", "2", "4", "8", "16", "32", "64", "65+")
"""The turn-count buckets of ``rewarded`` and ``stale`` (a trajectory of n turns counts in
the first bucket >= n)."""


class AdmissionError(ValueError):
    """The namespace's budget is declared by another recipe."""


def admission_key(store: Store) -> str:
    return store.owned_key("admission")


def log_key(store: Store) -> str:
    return store.owned_key("admission:log")


def open_key(store: Store) -> str:
    """The trajectories admitted against the budget and not rewarded, by expiry time."""
    return store.owned_key("admission:open")


def done_key(store: Store) -> str:
    """The rewarded trajectories no fill has served yet, scored by their oldest turn's
    version: each holds its slot until a fill serves it or the version moves past it."""
    return store.owned_key("admission:done")


def reservation_key(store: Store, group: str) -> str:
    """A group's reservations (``gwres:``; trajectory hashes are ``gw:<id>``, and ids may
    hold ``:``, so the two prefixes differ before the first colon)."""
    return store.owned_key(f"gwres:{group}")


def trajectory_key(store: Store, trajectory_uid: str) -> str:
    """The gateway's hash of one trajectory (``orchestrator/lua/turn.lua``)."""
    return store.owned_key(f"gw:{trajectory_uid}")


def owner(store: Store) -> str | None:
    """The recipe that declares the namespace's budget, if any."""
    raw = store.r.hget(admission_key(store), "recipe")
    return None if raw is None else raw.decode()


def check_owner(store: Store, recipe: Recipe) -> None:
    """Refuse a second recipe with ``admission`` in one namespace (one budget each)."""
    if recipe.admission is None:
        return
    cur = owner(store)
    if cur is not None and cur != recipe.name:
        raise AdmissionError(
            f"recipe {recipe.name!r}: namespace {store.namespace!r}'s admission budget is "
            f"declared by recipe {cur!r}; one recipe per namespace declares it (unregister "
            "that one first)"
        )


def declare(store: Store, recipe: Recipe, fresh: bool) -> None:
    """Write ``recipe``'s budget (a no-op without ``admission``). ``fresh``: a new
    registration (not a live-param change): nothing is counted in flight."""
    adm = recipe.admission
    if adm is None:
        return
    version = int(recipe.params[adm.version_param])  # type: ignore[arg-type]  # the recipe validates the version param as an int
    args = [
        "declare",
        recipe.name,
        recipe.version,
        version,
        recipe.admission_batch,
        adm.max_staleness,
        recipe.group_size if recipe.grouped else 1,
        int(fresh),
    ]
    if int(SCRIPT(store.r, _keys(store), args)) < 0:
        check_owner(store, recipe)  # raises, naming the owner
        raise AdmissionError(f"recipe {recipe.name!r}: the admission budget is not its own")
    lapse(store, "trainer")  # the version may have moved past rewarded, unserved ones


def _keys(store: Store) -> list[str]:
    """The script's keys for the ops that touch no trajectory (declare, give)."""
    a = admission_key(store)
    return [a, log_key(store), a, a, open_key(store), done_key(store)]


def clear(store: Store, recipe_name: str) -> None:
    """Drop the budget if ``recipe_name`` declared it (the recipe is unregistered): the
    gateways admit every trajectory again."""
    if owner(store) == recipe_name:
        store.r.delete(admission_key(store), open_key(store), done_key(store))


def state(store: Store) -> dict[str, Any] | None:
    """The declared budget and the counters, or None when no recipe declares one:
    ``recipe``, ``version``, ``batch``, ``max_staleness``, ``group``, ``budget``,
    ``admitted`` (running + accepted), ``total``, ``waited``, ``refused``, ``released``,
    ``expired`` (trajectories that went ``expiry`` seconds without a turn or a reward),
    ``lapsed`` (rewarded trajectories the version moved past before a fill served them),
    ``open`` (admitted trajectories not rewarded yet), ``waiting`` (rewarded, not served
    yet), ``rewarded_by_turns`` and ``stale_by_turns`` (trajectories rewarded, and rewarded
    then released unserved, by turn-count bucket, :data:`LENGTHS`: a length bias of what
    goes stale shows as a rising ratio)."""
    with store.r.pipeline(transaction=False) as p:  # one slot: the keys share its tag
        p.hgetall(admission_key(store))
        p.zcard(open_key(store))
        p.zcard(done_key(store))
        raw, n_open, n_done = p.execute()
    return state_of(raw, n_open, n_done)


def state_of(raw: Mapping[bytes, bytes], n_open: int, n_done: int = 0) -> dict[str, Any] | None:
    """:func:`state` of the admission hash and the open and done sets' sizes as read (a
    reader on another client, the gateway's event loop, decodes them here too)."""
    if not raw or b"batch" not in raw:
        return None
    d = {k.decode(): v.decode() for k, v in raw.items()}
    n = {k: int(float(d.get(k, 0))) for k in ("version", "batch", "staleness", "group")}
    out: dict[str, Any] = {
        "recipe": d.get("recipe"),
        "version": n["version"],
        "batch": n["batch"],
        "max_staleness": n["staleness"],
        "group": n["group"],
        "budget": (n["staleness"] + n["version"] + 1) * n["batch"],
    }
    for k in COUNTERS:
        out[k] = int(float(d.get(k, 0)))
    out["open"] = int(n_open)
    out["waiting"] = int(n_done)
    for k in ("rewarded", "stale"):
        out[f"{k}_by_turns"] = {b: int(d.get(f"{k}:{b}", 0)) for b in LENGTHS}
    return out


def read_log(store: Store, count: int | None = None) -> list[dict[str, Any]]:
    """The admission log, oldest first (the last ``count`` entries): ``op`` (``admit`` or
    ``release``), ``t`` (the trajectory ids), ``g`` (the group), ``slots``, ``admitted``
    (after it), ``budget``, ``v`` (the declared version then), ``w`` (the gateway)."""
    key = log_key(store)
    rows = store.r.xrevrange(key, count=count) if count else store.r.xrange(key)
    if count:
        rows = rows[::-1]
    out = []
    for _, fields in rows:
        e: dict[str, Any] = {k.decode(): v.decode() for k, v in fields.items()}
        for k in ("slots", "admitted", "budget", "v"):
            e[k] = int(float(e[k]))
        e["t"] = e["t"].split(" ")
        out.append(e)
    return out


def staleness_counts(recipe: Recipe, versions: np.ndarray) -> dict[str, float]:
    """A batch's served-staleness counter increments: its rows' policy versions against the
    recipe's current version (empty without ``admission``)."""
    adm = recipe.admission
    if adm is None or not len(versions):
        return {}
    v = int(recipe.params[adm.version_param])  # type: ignore[arg-type]  # the recipe validates the version param as an int
    stale = v - np.asarray(versions, np.float64)
    worst = max(0, int(stale.max()))
    return {
        f"{STALE_PREFIX}n": 1,
        f"{STALE_PREFIX}sum": float(stale.mean()),
        f"{STALE_PREFIX}max:{worst}": 1,
    }


def served_staleness(counts: Mapping[str, Any]) -> dict[str, Any] | None:
    """``{"batches", "mean", "max"}`` of a recipe's counters (None before a batch)."""
    n = int(float(counts.get(f"{STALE_PREFIX}n", 0)))
    if n <= 0:
        return None
    worst = [
        int(k[len(STALE_PREFIX) + 4 :])
        for k, v in counts.items()
        if k.startswith(f"{STALE_PREFIX}max:") and float(v) > 0
    ]
    mean = float(counts.get(f"{STALE_PREFIX}sum", 0.0)) / n
    return {
        "batches": n,
        "mean": round(mean, 6) if math.isfinite(mean) else None,
        "max": max(worst, default=0),
    }


def give_back(store: Store, slots: int, why: str, who: str = "") -> int:
    """Give back the slots of trajectories accepted and then never served (the batches a
    recipe change dropped): they are no longer counted as running or accepted."""
    if slots <= 0:
        return 0
    return int(SCRIPT(store.r, _keys(store), ["give", slots, who, LOG_ENTRIES, why]))


def due(store: Store, now: float, count: int = 256) -> list[str]:
    """Open trajectories whose expiry is before ``now`` (this clock; :func:`expire` checks
    the server's), at most ``count``."""
    raw = store.r.zrangebyscore(open_key(store), "-inf", now, start=0, num=count)
    return [m.decode() for m in raw]


def expire(store: Store, trajectories: list[str], who: str = "") -> tuple[int, int]:
    """Expire the open trajectories among ``trajectories`` whose expiry has passed: no
    reward came in time (an agent that died, a rollout abandoned), so their slots (a
    group's reservation: an incomplete group is never served) come back. Returns
    (trajectories expired, slots released). Two round trips: their groups, then the
    script for each (pipelined)."""
    if not trajectories:
        return 0, 0
    with store.r.pipeline(transaction=False) as pipe:
        for t in trajectories:
            pipe.hget(trajectory_key(store, t), "grp")
        groups = pipe.execute()
    a, lg, op = admission_key(store), log_key(store), open_key(store)

    def queue(pipe: Any) -> None:
        for t, g in zip(trajectories, groups, strict=True):
            res = reservation_key(store, g.decode() if g else t)
            keys = [a, lg, res, trajectory_key(store, t), op]
            SCRIPT.queue(pipe, keys, ["expire", who, LOG_ENTRIES, t])

    got = execute(store.r, [SCRIPT], queue)
    return sum(int(e) for e, _ in got), sum(int(n) for _, n in got)


def trajectories_in(batch: Any) -> int:
    """The trajectories a popped group batch holds (0 for other batches)."""
    t = getattr(batch, "fields", {}).get("trajectory_index")
    return 0 if t is None else len(np.unique(np.asarray(t)))


def release_stale(
    store: Store, trajectory_uid: str, group: str, vmin: int | None, who: str = ""
) -> int:
    """At a trajectory's reward, before the rewards make its steps servable (it is no
    longer open, so it does not expire): if its oldest turn (``vmin``; None: its
    admission version) is older than the declared ``v - max_staleness``, no recipe will
    serve it, so the slots its reservation took (its group's, once) are given back, as
    AReaL does with a rejected rollout; else it joins the rewarded, unserved ones
    (:func:`done_key`) until a fill serves it or it lapses (:func:`lapse`). Called after
    the rewards, a fill could serve it first and it would then lapse, releasing consumed
    slots. Returns the slots released."""
    keys = [
        admission_key(store),
        log_key(store),
        reservation_key(store, group or trajectory_uid),
        trajectory_key(store, trajectory_uid),
        open_key(store),
        done_key(store),
    ]
    args = ["finish", "" if vmin is None else vmin, who, LOG_ENTRIES, trajectory_uid]
    return int(SCRIPT(store.r, keys, args))


def lapse(store: Store, who: str = "", count: int = 1024) -> tuple[int, int]:
    """Release the rewarded trajectories no fill served before the declared version moved
    past them (oldest turn < v - max_staleness): no recipe may serve them any more. Run by
    the trainer after each declaration and by every gateway's sweep; each trajectory is
    released by exactly one caller (the script that removes it from the done set).
    Returns (trajectories, slots) released. At most ``count`` per call; one round trip
    when none is due, four when some are."""
    a, done = admission_key(store), done_key(store)
    with store.r.pipeline(transaction=False) as pipe:
        pipe.hmget(a, "version", "staleness")
        pipe.zrange(done, 0, 0, withscores=True)  # the oldest
        (v, s), oldest = pipe.execute()
    if v is None or s is None or not oldest:
        return 0, 0
    bound = int(float(v)) - int(float(s))
    if oldest[0][1] >= bound:  # nothing past it: one round trip
        return 0, 0
    due = [m.decode() for m in store.r.zrangebyscore(done, "-inf", f"({bound}", 0, count)]
    if not due:
        return 0, 0
    with store.r.pipeline(transaction=False) as pipe:
        for t in due:
            pipe.hget(trajectory_key(store, t), "grp")
        groups = pipe.execute()
    lg, op = log_key(store), open_key(store)

    def queue(pipe: Any) -> None:
        for t, g in zip(due, groups, strict=True):
            res = reservation_key(store, g.decode() if g else t)
            keys = [a, lg, res, trajectory_key(store, t), op, done]
            SCRIPT.queue(pipe, keys, ["lapse", who, LOG_ENTRIES, t])

    got = execute(store.r, [SCRIPT], queue)
    return sum(int(n) for n, _ in got), sum(int(k) for _, k in got)


CLAIM_TTL_S = 86_400
"""How long a ``once`` batch's record of the trajectories it took lives: a batch dropped
unserved within it puts them back (a queued batch is dropped within its recipe's life, a
step or a restart later)."""

_SERVE = Lua("serve", "orchestrator")


def claim_key(store: Store, token: str) -> str:
    """The trajectories a ``once`` batch (its claim's token) took from the done set."""
    return store.owned_key(f"admission:claim:{token}")


def serve(pipe: Any, store: Store, trajectories: list[str], token: str | None = None) -> None:
    """Queue on ``pipe`` (a fill's push transaction) the removal of ``trajectories`` from
    the done set: served, they no longer hold a slot that may lapse (``lua/serve.lua``,
    sent whole: a transaction cannot load a script). ``token``: a ``once`` batch's claim,
    under which the removed ones are recorded for :func:`unclaimed`. One reply: the
    removed ones with their scores, for :func:`unserve`."""
    keys = [done_key(store)] + ([claim_key(store, token)] if token else [])
    pipe.execute_command("EVAL", _SERVE.source, len(keys), *keys, CLAIM_TTL_S, *trajectories)


def unserve(store: Store, removed: list[Any]) -> int:
    """Put back the trajectories a push removed (``removed`` as :func:`serve` replied: id,
    score, ...) when its batch was taken back unserved, then :func:`lapse` the ones now
    too old. Returns the slots released."""
    back = {_text(t): float(x) for t, x in zip(removed[::2], removed[1::2], strict=True)}
    if not back:
        return 0
    store.r.zadd(done_key(store), back)
    return lapse(store, "fill")[1]


def unclaimed(store: Store, tokens: list[str]) -> int:
    """``once`` batches dropped unserved after their push (their groups go back to the
    pool): the trajectories each took go back to the done set, once (the record is read
    and deleted in one command), and lapse if they are now too old. Returns the slots
    released."""
    if not tokens:
        return 0
    with store.r.pipeline(transaction=False) as pipe:
        for t in tokens:
            pipe.getdel(claim_key(store, t))
        records = pipe.execute()
    removed = [x for raw in records if raw for x in json.loads(raw)]
    return unserve(store, removed)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
