"""The documentation site: `mkdocs build --strict` (a broken link or anchor, a missing API
reference or a page not in the nav fails it), the generated reference pages in it, and the
built site in a real headless Chromium (Debian's chromium, driven by Playwright): the home
page and a generated API page load every asset from the site itself, and search answers."""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.paths import ROOT

CHROMIUM = os.environ.get("CLAW_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,  # inside pytest's own 300 s, so a hung build reports its output
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def test_the_site_builds_strict_with_the_generated_reference(site: Path) -> None:
    for page in ("settings", "cli", "metrics", "recipe-keys", "schedule", "api/orchestrator"):
        assert (site / "reference" / page / "index.html").is_file(), page
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "claw gateway" in cli and "--upstream" in cli
    assert "CLAW_REDIS_URL" in (site / "reference" / "settings" / "index.html").read_text()
    assert (
        "claw_steps_committed_total" in (site / "reference" / "metrics" / "index.html").read_text()
    )
    api = (site / "reference" / "api" / "orchestrator" / "index.html").read_text()
    assert "BatchClient" in api and "update_priorities" in api
    assert (site / "changelog" / "index.html").is_file()


def test_a_page_outside_the_nav_fails_the_build(tmp_path: Path) -> None:
    """The strictness the site relies on: a docs page the nav leaves out is an error."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n")
    (docs / "stray.md").write_text("# Stray\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nstrict: true\nnav:\n  - Home: index.md\n"
        "validation:\n  nav:\n    omitted_files: warn\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode != 0 and "stray.md" in proc.stderr


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """The site's own validation settings: a link to a heading that does not exist fails."""
    validation = (ROOT / "mkdocs.yml").read_text().split("validation:", 1)[1].split("\n\n")[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[there](other.md#nowhere)\n")
    (docs / "other.md").write_text("# Other\n\n## Somewhere\n")
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nstrict: true\n"
        "nav:\n  - index.md\n  - other.md\nvalidation:" + validation + "\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode != 0 and "#nowhere" in proc.stderr


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP (search fetches its index, which a file:// page cannot)."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (make test does it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def _open(browser, url: str, base: str):
    """A page at `url`, recording every request that failed, answered >= 400, or went to
    another host, and every uncaught script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    problems: list[str] = []
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
    page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
    page.on(
        "response", lambda r: problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None
    )
    page.on(
        "request",
        lambda r: (
            None if r.url.startswith((base, "data:")) else problems.append(f"off-site: {r.url}")
        ),
    )
    page.goto(url, wait_until="networkidle")
    return context, page, problems


def test_home_page_loads_and_search_answers(browser, served: str) -> None:
    context, page, problems = _open(browser, served + "/", served)
    try:
        assert "Claw" in page.title()
        page.wait_for_selector("text=Getting started")
        page.click("label.md-search__icon, .md-search__input")
        # The search index is built by a web worker after the page loads; a query typed
        # before it is ready is not run again, so wait for it (slow on a loaded machine).
        meta = page.locator(".md-search-result__meta")
        page.wait_for_function(
            "() => !document.querySelector('.md-search-result__meta')"
            "?.textContent.includes('Initializing')",
            timeout=120_000,
        )
        assert "Initializing" not in meta.inner_text()
        page.type("input.md-search__input", "recipe")  # key by key: search runs on keyup
        page.wait_for_selector(".md-search-result__item")
        assert page.locator(".md-search-result__item").count() > 0
        page.wait_for_load_state("networkidle")
        assert not problems, problems
    finally:
        context.close()


def test_generated_api_page_loads(browser, served: str) -> None:
    context, page, problems = _open(browser, served + "/reference/api/orchestrator/", served)
    try:
        page.wait_for_selector("article .doc-heading")
        article = page.locator("article").inner_text()
        assert "BatchClient" in article and "sample" in article
        assert not problems, problems
    finally:
        context.close()
