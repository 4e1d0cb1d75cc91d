"""Stable-Baselines3's own buffer tests (``tests/test_buffers.py`` of the installed
release's sdist, fetched with pip at test time and cached; not copied here) run with
Claw's buffers in place of SB3's (tests/support/sb3_substitute.py), against a real
Redis and workers. docs/adapters.md lists the tests that do not apply and why
(``NOT_APPLICABLE`` below deselects them)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.paths import ROOT

NOT_APPLICABLE = {
    "test_buffer_dtypes": "reads SB3's in-memory arrays (buffer.observations) and samples a "
    "buffer of size 1 marked full with nothing added; Claw's rows live in Redis "
    "(test_sb3_rollout.py::test_buffer_dtypes adapts it)",
}


@pytest.fixture(scope="session")  # session: set up before the workers, so a skip costs none
def sb3_tests() -> Path:
    """The installed SB3 release's tests/test_buffers.py, from its sdist, kept in the
    temporary directory: fetched once per machine (~20 s under load; the test skips, saying
    why, when the package index cannot be reached)."""
    release = version("stable-baselines3")
    cache = Path(tempfile.gettempdir()) / f"claw-sb3-tests-{release}"
    wanted = cache / "test_buffers.py"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "lock", "w") as lock:  # one test run fetches it at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not wanted.exists():
            _fetch(release, cache, wanted)
    return wanted


def _fetch(release: str, cache: Path, wanted: Path) -> None:
    # --no-build-isolation: pip reads the sdist's metadata with the installed setuptools
    # instead of downloading a build environment (measured under load: ~17 s against ~50 s).
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
        *("--no-build-isolation", f"stable-baselines3=={release}", "-d", str(cache), "-q"),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("SB3's sdist could not be fetched: pip download took over 180 s")
    if done.returncode != 0:
        pytest.skip(f"SB3's sdist could not be fetched: {done.stderr[-500:]}")
    (sdist,) = cache.glob(f"stable_baselines3-{release}.tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.getmember(f"stable_baselines3-{release}/tests/test_buffers.py")
        source = tar.extractfile(member)
        assert source is not None
        (cache / "test_buffers.py.part").write_bytes(source.read())
    (cache / "test_buffers.py.part").rename(wanted)


@pytest.mark.timeout(900)
def test_sb3s_own_buffer_tests_pass_on_claws_buffers(sb3_tests, redis_url, workers, tmp_path):
    src = sb3_tests
    run = tmp_path / "sb3"
    run.mkdir()
    (run / "test_buffers.py").write_text(src.read_text())
    deselect = " and ".join(f"not {name}" for name in NOT_APPLICABLE)
    env = {
        **{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
        "CLAW_REDIS_URL": redis_url,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-p", "tests.support.sb3_substitute", "--rootdir", str(run)),
            *("-k", deselect, "-W", "ignore::DeprecationWarning", str(run)),
        ],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
