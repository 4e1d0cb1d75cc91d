"""The README's and the guide's snippets as written, run against a real stack: the README's
quick start, then Getting started and the user guide pages in reading order, in one
interpreter (a page may use what an earlier one recorded); the metrics reference names
exactly the metrics /metrics serves; docs/replay.md's worked example, run the same way."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from orchestrator.cli.exporter import registry_for
from orchestrator.delivery.registry import Registry
from orchestrator.recipe.model import Recipe
from tests.stack.test_cli import fill
from tests.support.paths import ROOT

README = (ROOT / "README.md").read_text()
REPLAY = (ROOT / "docs" / "replay.md").read_text()
# The pages whose Python blocks run, in this order, after the README's.
PAGES = [
    "docs/getting-started.md",
    "docs/guide/recording.md",
    "docs/guide/training.md",
    "docs/guide/inspecting.md",
    "docs/guide/multi-agent.md",
    "docs/adapters.md",
]
TEXTS = [README, *((ROOT / page).read_text() for page in PAGES)]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks(lang: str, text: str = README) -> list[str]:
    return [body for kind, body in BLOCK.findall(text) if kind == lang]


def _rllib(body: str) -> bool:
    """A block that needs the rllib extra: it runs on its own (test_readme_rllib_block)."""
    return "ray.rllib" in body


def test_readme_says_what_to_start_before_the_python_blocks():
    first_python = README.index("```python")
    assert "claw up" in README[README.index("## Quick start") : first_python]


def _run(script: str, redis_url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """README code in a fresh interpreter against the test stack (the store's Redis as
    the broker too, as a reader who set only CLAW_REDIS_URL has it); it must succeed."""
    env = {**os.environ, "CLAW_REDIS_URL": redis_url, "PYTHONPATH": str(ROOT)}
    env.pop("CLAW_BROKER_URL", None)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_readme_and_guide_python_blocks_run_as_written(redis_url, workers, tmp_path):
    """Extracted verbatim and run in order, in one interpreter, with the stack up (a worker
    on `ingest` and `prefetch`, as `claw up` runs)."""
    code = [b for text in TEXTS for b in blocks("python", text) if not _rllib(b)]
    assert len(blocks("python")) == 1  # the README's quick start
    assert len(code) >= 9
    proc = _run("\n".join(code), redis_url, tmp_path)
    assert "(256, 4) (256,)" in proc.stdout  # the README's n-step batch
    assert "'popped': 5" in proc.stdout  # client.stats after the five pops
    assert "(4, 4)" in proc.stdout  # orchestrator.sample's obs
    assert "(64, 3, 18) (64, 3) (64, 54)" in proc.stdout  # the joint batch of simple_spread
    assert "(4, 5) (4, 5)" in proc.stdout  # nearest: 5 neighbours of each of 4 states
    assert "rollouts served: 4" in proc.stdout  # SB3 PPO with ClawRolloutBuffer
    assert "(4, 84, 84, 3) uint8" in proc.stdout  # the png codec's frames, decoded


def test_replay_doc_example_runs_as_written(redis_url, workers, tmp_path):
    """The debugging example: twelve updates, the worst and a median one replayed, each
    giving back its loss to the last bit (the example asserts it)."""
    (code,) = blocks("python", REPLAY)
    proc = _run(code, redis_url, tmp_path)
    assert proc.stdout.count("update ") == 2, proc.stdout


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="the rllib extra (ray[rllib]) is not installed"
)
def test_readme_rllib_block_runs_as_written(redis_url, workers, tmp_path):
    """The RLlib block (docs/guide/training.md), alone (it needs only its own imports),
    with the stack up."""
    (code,) = [b for text in TEXTS for b in blocks("python", text) if _rllib(b)]
    proc = _run(code, redis_url, tmp_path)
    assert proc.stdout.startswith("32 (4,)"), proc.stdout  # 32 transitions of CartPole obs


def test_the_metrics_reference_names_what_is_served(redis_url):
    """The reference is generated from an empty store's scrape; a store with data and a
    recipe serves no family it does not list."""
    from tools.docsgen import metric_families

    ns = f"readme-{uuid.uuid4().hex[:8]}"
    store = fill(redis_url, ns)
    recipe = {"name": "r", "batch_size": 2, "fields": ["obs"], "sources": [{"name": "a"}]}
    Registry(store).put(Recipe.model_validate(recipe), None)
    text = generate_latest(registry_for(redis_url, redis_url)).decode()
    served = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    listed = {name for name, *_ in metric_families()}
    assert listed == served


def test_readme_and_guide_shell_blocks_are_valid_bash():
    for body in [b for text in TEXTS for b in blocks("bash", text)]:
        proc = subprocess.run(["bash", "-n", "-c", body], capture_output=True, text=True)
        assert proc.returncode == 0, (body, proc.stderr)
