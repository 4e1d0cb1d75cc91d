"""A process's namespace contexts (worker.context): bounded, one per (server, namespace),
forgotten in one call that closes every part (each, whatever another's close raised),
telling them whether the namespace was dropped; a namespace made again starts afresh.
Building a context makes no Redis traffic."""

from __future__ import annotations

from claw_tasks.worker import context
from claw_tasks.worker.lru import LRU


class Part:
    def __init__(self) -> None:
        self.closed: list[bool] = []

    def close(self, dropped: bool) -> None:
        self.closed.append(dropped)


def _held() -> set[str]:
    return {key[-2] for key in context.contexts}


def test_contexts_are_bounded_and_forgotten(monkeypatch):
    monkeypatch.setattr(context.contexts, "maxsize", 3)
    for i in range(5):
        context.store_for(f"ctx{i}")  # no Redis traffic: a Store connects on first use
    assert {"ctx2", "ctx3", "ctx4"} <= _held() and not {"ctx0", "ctx1"} & _held()
    assert context.context_for("ctx3") is context.context_for("ctx3")
    assert context.context_for(context.store_for("ctx3")) is context.context_for("ctx3")
    context.forget("ctx3", dropped=False)
    assert "ctx3" not in _held() and {"ctx2", "ctx4"} <= _held()


class Broken(Part):
    def close(self, dropped: bool) -> None:
        super().close(dropped)
        raise OSError("cannot close")


def test_forget_closes_every_part_and_close_all_detaches(caplog):
    ctx = context.context_for("ctx-parts")
    a, broken, b = ctx.part("a", Part), ctx.part("broken", Broken), ctx.part("b", Part)
    assert ctx.part("a", Part) is a  # made once
    ctx.part("plain", dict)  # a part without close is simply let go
    held = ctx.part("by name", lambda: LRU(2))  # a part of parts: each is closed
    inner = held.get("x", Part)
    context.forget("ctx-parts", dropped=True)
    assert a.closed == broken.closed == b.closed == inner.closed == [True]
    assert "cannot close" in caplog.text and len(held) == 0
    assert context.context_for("ctx-parts") is not ctx
    c = context.context_for("ctx-parts").part("c", Part)
    context.forget("ctx-parts", dropped=False)  # a pass failed: only this process lets go
    assert c.closed == [False] and "ctx-parts" not in _held()
    d = context.context_for("ctx-parts").part("d", Part)
    context.close_all()
    assert d.closed == [False] and "ctx-parts" not in _held()


def test_a_namespace_made_again_is_forgotten():
    ctx = context.context_for("ctx-made-again")
    part = ctx.part("a", Part)
    assert ctx.check_created(1.0) and ctx.check_created(1.0)
    assert not ctx.check_created(2.0)  # made again: every part of it goes
    assert part.closed == [True]
    fresh = context.context_for("ctx-made-again")
    assert fresh is not ctx and fresh.check_created(2.0)
    context.forget("ctx-made-again", dropped=False)


class Columns:
    """A part holding arrays, as a sampling index holds its columns."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.columns = {"a": np.zeros(nbytes // 2, np.uint8), "b": np.zeros(nbytes // 2, np.uint8)}
        self.view = self.columns["a"][:10]  # a view of an array counted already
        self.closed: list[bool] = []

    def close(self, dropped: bool) -> None:
        self.closed.append(dropped)


Columns.__module__ = "claw_tasks.tests"  # weigh follows Claw's own classes' attributes


def test_weigh_counts_each_array_once_through_parts_and_views():
    ctx = context.context_for("ctx-weigh")
    ctx.part("cols", lambda: Columns(1000))
    ctx.part("lru", lambda: LRU(4)).get("x", lambda: Columns(500))
    ctx.part("plain", lambda: {"k": [Columns(100)]})
    assert context.weigh(ctx) == 1600
    context.forget("ctx-weigh", dropped=False)


def test_contexts_past_the_byte_budget_are_let_go_least_recently_used_first(monkeypatch):
    """A worker serving many namespaces of large capacity held every context (64, of
    ~93 MiB each at capacity 1M): now only what fits ``CLAW_WORKER_CACHE_BYTES``, plus
    the context in use, which is never let go."""
    monkeypatch.setenv("CLAW_WORKER_CACHE_BYTES", "2500")
    from claw_tasks.settings import use_settings

    use_settings()
    parts = []
    for i in range(5):
        ctx = context.context_for(f"ctx-bytes{i}")
        parts.append(ctx.part("cols", lambda: Columns(1000)))
    context.context_for("ctx-other")  # turning away from ctx-bytes4 weighs it
    held = _held()
    # 2 x 1000 fit 2500 (a third does not): the newest two stay, the rest were closed.
    assert {"ctx-bytes3", "ctx-bytes4", "ctx-other"} <= held
    assert not {"ctx-bytes0", "ctx-bytes1", "ctx-bytes2"} & held
    assert [p.closed for p in parts] == [[False]] * 3 + [[]] * 2
    big = context.context_for("ctx-big").part("cols", lambda: Columns(10_000))
    context.context_for("ctx-big")  # the one in use stays, however large
    assert "ctx-big" in _held() and big.closed == []
    context.context_for("ctx-other")  # turning away: ctx-big alone is over the budget
    assert "ctx-big" not in _held() and big.closed == [False]
    for ns in list(_held()):
        context.forget(ns, dropped=False)


def test_a_context_pushed_out_by_the_count_is_closed(monkeypatch):
    """Its shared-memory mappings and files are released at once, not at a collection."""
    monkeypatch.setattr(context.contexts, "maxsize", 2)
    parts = [
        context.context_for(f"ctx-count{i}").part("cols", lambda: Columns(10)) for i in range(3)
    ]
    assert "ctx-count0" not in _held() and [p.closed for p in parts] == [[False], [], []]
    for ns in list(_held()):
        context.forget(ns, dropped=False)


def test_a_context_another_thread_uses_is_never_let_go(monkeypatch):
    """The context in use is per thread: a thread serving one namespace keeps its parts
    while another turns through namespaces far past the budget."""
    import threading

    monkeypatch.setenv("CLAW_WORKER_CACHE_BYTES", "1500")
    from claw_tasks.settings import use_settings

    use_settings()
    holding, done = threading.Event(), threading.Event()
    kept: list[Columns] = []

    def serve() -> None:
        kept.append(context.context_for("ctx-thread").part("cols", lambda: Columns(1000)))
        holding.set()
        done.wait(30)

    t = threading.Thread(target=serve)
    t.start()
    assert holding.wait(30)
    others = [
        context.context_for(f"ctx-turn{i}").part("cols", lambda: Columns(1000)) for i in range(4)
    ]
    context.context_for("ctx-turn0")
    assert kept[0].closed == [] and "ctx-thread" in _held()
    assert any(p.closed for p in others)  # the budget still holds for the rest
    done.set()
    t.join()
    for ns in list(_held()):
        context.forget(ns, dropped=False)
