"""Stable-Baselines3's own buffer tests (``tests/test_buffers.py`` of the installed
release's sdist, fetched with pip at test time and cached; not copied here) run with
Claw's buffers in place of SB3's (tests/support/sb3_own/conftest.py), against a real
Redis and workers. docs/adapters.md lists the tests that do not apply and why
(``NOT_APPLICABLE`` below deselects them)."""

from __future__ import annotations

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


def _sb3_tests() -> Path:
    """The installed SB3 release's tests/test_buffers.py, from its sdist (cached)."""
    release = version("stable-baselines3")
    cache = Path(tempfile.gettempdir()) / f"claw-sb3-tests-{release}"
    wanted = cache / "test_buffers.py"
    if not wanted.exists():
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
                *(f"stable-baselines3=={release}", "-d", str(cache), "-q"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            pytest.skip(f"SB3's sdist could not be fetched: {done.stderr[-500:]}")
        (sdist,) = cache.glob("stable_baselines3-*.tar.gz")
        with tarfile.open(sdist) as tar:
            member = tar.getmember(f"stable_baselines3-{release}/tests/test_buffers.py")
            source = tar.extractfile(member)
            assert source is not None
            (cache / "test_buffers.py.part").write_bytes(source.read())
        (cache / "test_buffers.py.part").rename(wanted)
    return wanted


@pytest.mark.timeout(900)
def test_sb3s_own_buffer_tests_pass_on_claws_buffers(redis_url, workers, tmp_path):
    src = _sb3_tests()
    run = tmp_path / "sb3"
    run.mkdir()
    (run / "test_buffers.py").write_text(src.read_text())
    deselect = " and ".join(f"not {name}" for name in NOT_APPLICABLE)
    env = {
        **{k: v for k, v in __import__("os").environ.items() if k != "PYTEST_ADDOPTS"},
        "CLAW_REDIS_URL": redis_url,
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"),
            *("-p", "tests.support.sb3_own.conftest", "--rootdir", str(run)),
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
