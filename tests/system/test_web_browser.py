"""The inspector in a real headless Chromium (Debian's chromium, driven by Playwright):
log in, search, open an episode with image thumbnails, label two episodes untrainable and
see a recipe's next batches (made by a real prefetch worker) leave them out, edit a
recipe param and see its version change; hostile ``info`` and tags render inert.

Screenshots go to ``$CLAW_ARTIFACTS`` (default ``tmp/artifacts``)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from claw_tasks.connection.server import RedisServer
from orchestrator.delivery.client import BatchClient
from tests.support.webdata import XSS, fill
from tests.support.webserver import ROOT, WebServer

CHROMIUM = os.environ.get("CLAW_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("CLAW_ARTIFACTS", ROOT / "tmp" / "artifacts"))
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]

sync_api = pytest.importorskip("playwright.sync_api")
if not shutil.which(CHROMIUM):
    pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (make test does it as root)")


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A private server: the inspector's front page lists the namespaces it finds (the
    session server holds every earlier test's)."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def ns(redis_server) -> str:
    name = f"browse-{uuid.uuid4().hex[:8]}"
    fill(redis_server.url, name, episodes=8, length=20, hostile=(5,))
    return name


@pytest.fixture(scope="module")
def web(redis_server, tmp_path_factory) -> Iterator[WebServer]:
    server = WebServer(redis_server.url, tmp_path_factory.mktemp("web") / "web.log")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser, web) -> Iterator:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.goto(web.url + "/")
    assert "/login" in page.url
    page.fill("input[name=user]", "claw")
    page.fill("input[name=password]", "pw")
    page.click("button[type=submit]")
    page.wait_for_selector("#namespaces")
    yield page
    context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_search_and_episode_with_thumbnails(page, ns):
    assert page.locator(f"#namespaces a:text-is('{ns}')").count() == 1
    shot(page, "namespaces")
    page.click(f"#namespaces a:text-is('{ns}')")
    page.fill("#where", "task_id == 'grasp' and tags.level < 2")
    page.click("#search")
    page.wait_for_selector("#summary")
    # grasp: even episodes 0, 2, 4, 6, at level ep % 3 = 0, 2, 1, 0: three are below 2
    assert "60 of 160 live steps match" in page.inner_text("#summary")
    names = page.locator("#results tbody td:nth-child(2) a").all_inner_texts()
    assert sorted(names) == ["ep0", "ep4", "ep6"]
    assert page.locator("svg rect").count() == 30  # the reward histogram
    shot(page, "search")
    page.fill("#where", "reward >")  # a mistake: the parser's message, with its caret
    page.click("#search")
    assert "expected a value" in page.inner_text("#problem")
    page.fill("#where", "")
    page.click("#search")
    page.click("#results a:text-is('ep4')")
    page.wait_for_selector("#steps")
    assert page.inner_text("#episode-name") == "ep4"
    thumbs = page.locator("img.thumb")
    assert thumbs.count() == 20
    page.wait_for_function(
        "() => [...document.querySelectorAll('img.thumb')].every(i => i.complete)"
    )
    widths = page.eval_on_selector_all("img.thumb", "els => els.map(e => e.naturalWidth)")
    assert widths == [128] * 20  # 16 px frames, drawn 8x by the server
    steps = page.locator("#steps tbody td:nth-child(2)").all_inner_texts()
    assert steps == [str(i) for i in range(20)]
    shot(page, "episode")


def test_labelled_episodes_leave_the_next_batches(page, ns, redis_server, workers):
    client = BatchClient(ns, redis_server.url)
    try:
        recipe = client.register(
            {
                "name": "curated",
                "batch_size": 64,
                "fields": ["state", "action"],
                "sources": [{"name": "all", "where": "reward > $floor"}],
                "params": {"floor": -2.0},
                "prefetch": {"depth": 4},
            }
        )
        first = client.pop("curated", timeout=60)
        excluded = set()
        for ep in ("ep1", "ep2"):
            excluded |= set(client.store.episode(ep, fields=[])["id"].tolist())
        page.goto(page.url.split("/", 3)[0] + f"//{page.url.split('/')[2]}/ns/{ns}/search")
        page.check("#results input[value=ep1]")
        page.check("#results input[value=ep2]")
        page.select_option("#trainable", "false")
        page.click("#apply")
        page.wait_for_selector("#candidates")
        row = page.locator("#candidates tbody tr").first.locator("td").all_inner_texts()
        assert row[:3] == ["curated", "160", "120"]
        assert row[3] == f"{recipe.version} → {recipe.version + 1}"
        shot(page, "curated")
        assert first.recipe_version == recipe.version
        for _ in range(5):  # batches made after the labels: none holds a step of ep1/ep2
            batch = client.pop("curated", timeout=60)
            assert batch.recipe_version == recipe.version + 1
            assert not excluded & set(np.asarray(batch.ids).tolist())
        # the search page shows the labels
        page.goto(page.url.split("/ns/")[0] + f"/ns/{ns}/search?where=not+trainable")
        assert "40 of 160 live steps match" in page.inner_text("#summary")
    finally:
        client.unregister("curated")
        client.close()


def test_edit_param_bumps_version(page, ns, redis_server, web):
    client = BatchClient(ns, redis_server.url)
    try:
        recipe = client.register(
            {
                "name": "curriculum",
                "batch_size": 8,
                "fields": ["state"],
                "sources": [{"name": "all", "where": "reward > $floor"}],
                "params": {"floor": -2.0},
            }
        )
        page.goto(f"{web.url}/ns/{ns}/recipes")
        section = page.locator("#recipe-curriculum")
        assert section.locator(".version").inner_text() == str(recipe.version)
        section.locator("input[name='p.floor']").fill("'high'")
        section.locator("button[type=submit]").click()
        section = page.locator("#recipe-curriculum")
        assert "floor" in section.locator(".problem").inner_text()  # shown inline
        assert section.locator(".version").inner_text() == str(recipe.version)
        section.locator("input[name='p.floor']").fill("0.25")
        section.locator("button[type=submit]").click()
        page.wait_for_selector(f"#recipe-curriculum .version:text-is('{recipe.version + 1}')")
        assert client.registry.get("curriculum").recipe.params["floor"] == 0.25
        shot(page, "recipes")
    finally:
        client.unregister("curriculum")
        client.close()


def test_hostile_info_renders_inert(page, ns, web):
    page.goto(f"{web.url}/ns/{ns}/episode?e=ep5")
    page.wait_for_selector("#steps")
    cell = page.locator("#steps td.info").first.inner_text()
    assert "<script>window.__xss = 1</script>" in cell  # shown as text
    assert "onerror" in page.locator("#steps tbody").inner_text()
    page.hover("#steps td.info >> nth=0")
    assert page.evaluate("() => window.__xss") is None
    assert page.locator("#steps img:not(.thumb)").count() == 0  # no injected element
    assert page.locator("#steps svg").count() == 0
    page.goto(f"{web.url}/ns/{ns}/search?where=" + "%3Cscript%3Ewindow.__xss%3D5%3C%2Fscript%3E")
    assert "<script>" in page.inner_text("#problem")
    assert page.evaluate("() => window.__xss") is None
    shot(page, "xss")


def test_llm_trajectory_transcript_tokens_and_group(page, web, redis_server, workers):
    from claw_tasks.client import Ingestor
    from claw_tasks.format.schema import Schema
    from claw_tasks.store.turns import attach_rewards

    ns = f"llm-{uuid.uuid4().hex[:8]}"
    ing = Ingestor(ns, redis_server.url, schema=Schema.llm(response_mask=True), flush_interval=None)
    for traj, group in (("t-a", "q1"), ("t-b", "q1"), ("t-c", "q2")):
        for turn in range(2):
            ing.llm_turn(
                traj,
                turn,
                [1, 2, 3],
                [10 + turn, 20, 30],
                [-0.05, -1.2, -3.0],
                prompt_uid=group,
                response_mask=[1, 1, 0],
                is_last=turn == 1,
                messages=[
                    {"role": "user", "content": f"question {turn}"},
                    {"role": "assistant", "content": XSS},
                ],
                tool_calls=[{"name": "calc", "arguments": {"x": "<b onclick=alert(1)>"}}],
            )
    assert ing.close().committed == 6
    attach_rewards(ing.store, "t-a", 1.0)
    attach_rewards(ing.store, "t-b", 0.0)
    page.goto(f"{web.url}/ns/{ns}/episode?e=t-a")
    page.wait_for_selector("#llm")
    assert page.locator("#llm .turn").count() == 2
    transcript = page.inner_text("#llm")
    assert "question 0" in transcript and "<script>window.__xss = 1</script>" in transcript
    assert '"<b onclick=alert(1)>"' in transcript  # tool call arguments, as text
    first = page.locator("#llm .turn").first.locator(".tok")
    assert first.all_inner_texts() == ["10", "20", "30"]
    assert first.nth(1).get_attribute("title") == "token 20 · log-prob -1.2000"
    assert "masked" in first.nth(2).get_attribute("class")
    rollouts = page.locator("#group .rollout").all_inner_texts()
    assert len(rollouts) == 2 and "t-a" in rollouts[0] and "t-b" in rollouts[1]
    assert "final reward 1" in rollouts[0]
    page.hover("#llm .msg.assistant >> nth=0")
    assert page.evaluate("() => window.__xss") is None
    shot(page, "llm")


def test_data_quality_page_and_snapshots(page, web, redis_server):
    """A namespace with an hour of steps whose skill mix drifts: the page shows each
    field's statistics and histogram as the quality pass computed them, and the shares."""
    from claw_tasks.format.batch import StepBatch, StrColumn
    from claw_tasks.store import Store
    from orchestrator.maintenance import snapshots as versions
    from orchestrator.maintenance.quality import quality_namespace

    ns = f"quality-{uuid.uuid4().hex[:8]}"
    store = Store(redis_server.url, ns)
    store.create(capacity=20_000)
    rng = np.random.default_rng(5)
    now = time.time()
    n = 6_000
    ts = np.sort(now - rng.uniform(0, 3500, n))
    late = (ts - ts.min()) / (ts.max() - ts.min())  # 0 (an hour ago) .. 1 (now)
    state = rng.normal(0, 1, (n, 4)).astype(np.float32)
    state[rng.random((n, 4)) < 0.002] = np.nan
    skills = np.where(
        rng.random(n) < 0.7 - 0.5 * late, "walk", np.where(rng.random(n) < 0.5, "run", "jump")
    )
    b = StepBatch(
        episode=StrColumn.of([f"q{i // 50}" for i in range(n)]),
        step_index=np.arange(n) % 50,
        reward=(rng.normal(1.0, 0.3, n) - 0.8 * late).astype(np.float32),
        terminated=np.arange(n) % 50 == 49,
        truncated=np.zeros(n, bool),
        fields={"state": state, "action": rng.integers(0, 4, n)},
        strs={
            "task_id": StrColumn.of([("reach", "grasp")[i % 2] for i in range(n)]),
            "skill_tag": StrColumn.of(skills.tolist()),
        },
    )
    store.commit(b, now=ts)
    q = quality_namespace(store)
    page.goto(f"{web.url}/ns/{ns}/quality")
    page.wait_for_selector("#fields")
    names = page.locator("#fields td.name").all_inner_texts()
    assert set(names) == {"reward", "priority", "step_index", "state", "action"}
    st = q["fields"]["state"]
    assert page.inner_text("#field-state td.count") == str(st["count"])
    assert page.inner_text("#field-state td.nan") == str(st["nan"]) != "0"
    bars = page.eval_on_selector_all(
        "#field-state svg rect title", "els => els.map(e => e.textContent)"
    )
    assert len(bars) == 32 and sum(int(t.rsplit(": ", 1)[1]) for t in bars) == sum(st["hist"][1:-1])
    assert page.locator("#shares-skill_tag polyline.series").count() == 3  # walk, run, jump
    assert page.locator("#rewards polyline.series").count() == 1
    assert "run" in page.inner_text("#counts-skill_tag")
    shot(page, "quality")  # docs/img/inspector-quality.png is this screenshot

    versions.take(store, "before-labels")
    store.curate(store.labels().ids[:100], trainable=False)
    page.goto(f"{web.url}/ns/{ns}/snapshots")
    row = page.locator("#snapshot-before-labels")
    assert row.locator("td.name").inner_text() == "before-labels"
    row.locator("td.compare a").click()  # the listing reads headers; compare reads it whole
    page.wait_for_selector("#snapshot-before-labels td.labels")
    assert row.locator("td.labels").inner_text() == "100"  # changed since
    shot(page, "snapshots")
