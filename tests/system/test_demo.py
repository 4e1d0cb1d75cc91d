"""`claw demo` end to end (real Redis, Celery worker, actor processes), and its parts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from typer.testing import CliRunner

from claw_tasks.store import Store
from claw_tasks.store.keyscan import scan_keys
from orchestrator.cli.demo import dqn, weights
from orchestrator.cli.demo.pixels import SIZE, render
from orchestrator.cli.demo.report import PNG_NAME
from orchestrator.cli.main import app
from tests.support.paths import ROOT

CLAW = [sys.executable, "-m", "orchestrator.cli.main"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CLAW_REDIS_URL", "CLAW_BROKER_URL")}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "100", **extra}


def test_demo_runs_on_its_own_redis_and_writes_the_curve(tmp_path):
    """No Redis given: the demo starts its own (never the shared default port) and stops it."""
    out = tmp_path / "out"
    args = [
        *CLAW,
        "demo",
        "--steps",
        "1500",
        "--no-images",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(
        args,
        env=_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert (out / PNG_NAME).stat().st_size > 10_000
    url = re.search(r"Redis (redis://\S+) \(the demo's own", text).group(1)
    assert ":6379/" not in url
    assert "mean return of the last 20 episodes" in text and "stored in 'demo'" in text
    assert "phase 3" not in text and "pixels" not in text  # --no-images
    # the on-policy phase: 3 rollouts, each its version's 256 steps, once per epoch
    assert "rollout 3/3: policy_version 2, 256 steps (versions [2])" in text, text
    assert "each step once per epoch: yes; dropped stale 0, lost 0" in text, text
    assert str(tmp_path / "cache" / "claw" / "demo-redis") in text.replace("\n", "")
    assert not list((tmp_path / "cache" / "claw" / "demo-redis").iterdir())  # its files too
    try:  # stopped with the demo (its port may serve another test's server by now)
        served = redis.Redis.from_url(url, socket_connect_timeout=1).config_get("dir")["dir"]
    except redis.ConnectionError:
        served = None
    assert served is None or "demo-redis" not in served
    pid = int(re.search(r"worker pid (\d+)", text).group(1))
    assert not Path(f"/proc/{pid}").exists()


def test_demo_image_phase_on_a_given_redis_and_cleans_up(redis_url, tmp_path):
    ns = f"demo-{uuid.uuid4().hex[:8]}"
    args = [
        *CLAW,
        "--redis-url",
        redis_url,
        "demo",
        "--steps",
        "800",
        "--namespace",
        ns,
        "--actors",
        "1",
        "--out",
        str(tmp_path),
        "--log-dir",
        str(tmp_path),
    ]
    proc = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=240)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    row = re.search(r"([\d.]+) ms popped \(in-loop: ([\d.]+) ms\)", text)
    assert row and float(row.group(1)) > 0 and float(row.group(2)) > 0, text
    assert f"stored in '{ns}-pixels'" in text
    # the pixel steps' obs is compressed in Redis: a step takes less than its raw frame
    under = re.search(r"obs stored zstd: ([\d.,]+)x", text)
    assert under and float(under.group(1).replace(",", "")) > 1.0, text
    assert (tmp_path / PNG_NAME).exists()
    r = redis.Redis.from_url(redis_url)
    assert not list(scan_keys(r, ns)) and not list(scan_keys(r, f"{ns}-pixels"))  # removed
    assert r.ping()  # a given Redis is left running


def test_demo_refuses_a_namespace_that_exists(redis_url, tmp_path):
    ns = f"demo-{uuid.uuid4().hex[:8]}"
    Store(redis_url, ns).create(capacity=100, n_shards=1)
    args = [
        "--redis-url",
        redis_url,
        "demo",
        "--namespace",
        ns,
        "--out",
        str(tmp_path),
        "--log-dir",
        str(tmp_path),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert f"namespace {ns!r} already exists" in result.output.replace("\n", "")
    assert Store(redis_url, ns).exists()  # not removed: it was not the demo's


@pytest.mark.slow
def test_demo_learns_cartpole(tmp_path):
    """The full default run: mean return of the last 20 episodes >= 195."""
    args = [*CLAW, "demo", "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    proc = subprocess.run(
        args,
        env=_env(XDG_CACHE_HOME=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=900,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    mean = float(re.search(r"last 20 episodes ([\d.]+)", text).group(1))
    assert mean >= 195 and "solved in" in text, text


def test_weights_round_trip_through_redis(r, namespace):
    net = dqn.mlp(4, 2)
    weights.publish(r, namespace, 7, dqn.to_arrays(net))
    assert weights.latest_version(r, namespace) == 7
    version, arrays = weights.fetch(r, namespace, dqn.layout(net))
    other = dqn.mlp(4, 2)
    dqn.load_arrays(other, arrays)
    x = torch.randn(5, 4)
    assert version == 7 and torch.equal(net(x), other(x))
    assert b"pickle" not in r.get(weights.weights_key(namespace))  # msgpack frames


def test_weights_that_do_not_fit_are_refused(r, namespace):
    weights.publish(r, namespace, 1, dqn.to_arrays(dqn.mlp(4, 2, hidden=8)))
    with pytest.raises(weights.WeightsError, match=r"'0.weight': <f4\[8, 4\], the network has"):
        weights.fetch(r, namespace, dqn.layout(dqn.mlp(4, 2)))
    r.set(weights.weights_key(namespace), b"\x93garbage")
    with pytest.raises(weights.WeightsError, match="malformed weights"):
        weights.fetch(r, namespace, dqn.layout(dqn.mlp(4, 2)))


def test_render_draws_the_cart_where_the_state_says():
    left, right = render(np.array([-2.0, 0, 0, 0])), render(np.array([2.0, 0, 0, 0]))
    assert left.shape == (SIZE, SIZE, 3) and left.dtype == np.uint8
    blue = lambda img: np.flatnonzero((img[..., 2] == 200).any(axis=0)).mean()  # noqa: E731
    assert blue(left) < SIZE / 3 < 2 * SIZE / 3 < blue(right)


def test_next_steps_paste_into_a_shell_and_name_the_store():
    from rich.text import Text

    from orchestrator.cli.demo.report import next_steps

    url = "redis://127.0.0.1:45678/0"
    lines = [Text.from_markup(ln).plain for ln in next_steps(url, "demo", True, None)]
    commands = [ln for ln in lines if ln.startswith("claw ")]
    assert len(commands) == 4 and all(f"--redis-url {url} " in c for c in commands)
    for c in commands:
        assert subprocess.run(["bash", "-n", "-c", c]).returncode == 0, c
    secret = next_steps("redis://:pw@127.0.0.1:45678/0", "demo", True, None)
    assert not any("pw@" in ln for ln in secret)  # then the commands rely on CLAW_REDIS_URL
