"""The settings table (claw_tasks/settings/): the broker rule, parsing, the cache and the
CLI's flag; the docs' settings reference is the table; nothing else in claw_tasks/ or
orchestrator/ reads a ``CLAW_*`` variable, and nothing names one that does not exist."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from claw_tasks import settings as settings_module
from claw_tasks.settings import (
    BY_NAME,
    DEFAULT_REDIS_URL,
    VARIABLES,
    Settings,
    get_settings,
    markdown_table,
    redact_url,
    use_settings,
)
from orchestrator.cli.main import app
from tests.support.paths import ROOT

PRODUCT = ("claw_tasks", "orchestrator")
STORE, BROKER = "redis://h:6379/0", "redis://h:6379/1"  # the Compose defaults
# Variables of the repo's own tooling (tests, ops scripts, the Compose file's port), not
# of Claw: product code never names them.
TOOLING = {
    "CLAW_TEST_AMQP",
    "CLAW_FUZZ_SEED",
    "CLAW_ARTIFACTS",
    "CLAW_CHROMIUM",
    "CLAW_CLUSTER_BASE_PORT",
    "CLAW_CLUSTER_DIR",
    "CLAW_REDIS_PORT",
}


def test_the_broker_is_claw_broker_url_whatever_store_a_client_names():
    s = Settings.from_env({"CLAW_REDIS_URL": STORE, "CLAW_BROKER_URL": BROKER})
    assert s.broker_url == BROKER
    assert s.broker_for(None) == BROKER
    assert s.broker_for(STORE) == BROKER  # the gateway's case: the store URL alone
    assert s.broker_for("redis://elsewhere:6379/0") == BROKER


def test_without_claw_broker_url_the_broker_is_the_stores_server():
    s = Settings.from_env({"CLAW_REDIS_URL": STORE})
    assert s.broker_url == s.beat_url == STORE
    assert s.broker_for("redis://elsewhere:6379/3") == "redis://elsewhere:6379/3"
    assert Settings.from_env({}).broker_for(None) == DEFAULT_REDIS_URL
    with pytest.raises(ValueError, match="cannot be the Celery broker: set CLAW_BROKER_URL"):
        s.broker_for("redis+cluster://h:7000")


def test_values_are_typed_and_bad_text_names_its_variable():
    s = Settings.from_env(
        {
            "CLAW_VISIBILITY_TIMEOUT": "30",
            "CLAW_SHARED_INDEX": "off",
            "CLAW_SCORERS": "a:b, c:d",
            "CLAW_ALBUMENTATIONS": "",
            "CLAW_CODEC_THREADS": "0",
            "CLAW_MAX_BATCH_STEPS": "100",
        }
    )
    assert s.visibility_timeout == 30 and s.stage_ttl == 86400
    assert s.shared_index is False
    assert s.scorers == ("a:b", "c:d")
    assert s.albumentations == ()  # empty: no transform allowed (not the default)
    assert s.codec_threads == 1
    assert s.limits.batch_steps == 100
    assert Settings.from_env({"CLAW_VISIBILITY_TIMEOUT": "40000"}).stage_ttl == 160000
    with pytest.raises(ValueError, match="CLAW_MAX_BATCH_STEPS='many'"):
        Settings.from_env({"CLAW_MAX_BATCH_STEPS": "many"})
    with pytest.raises(ValueError, match="CLAW_COMPRESS_AT='gpu'"):
        Settings.from_env({"CLAW_COMPRESS_AT": "gpu"})
    with pytest.raises(ValueError, match="at most a quarter"):
        Settings.from_env({"CLAW_DEAD_LETTER_PREFIX": str(64 * 1024 * 1024)})


def test_secrets_stay_out_of_the_repr():
    s = Settings.from_env({"CLAW_GATEWAY_TOKEN": "tok-123", "CLAW_WEB_PASSWORD": "pw-456"})
    assert s.gateway_token == "tok-123" and s.web_password == "pw-456"
    assert "tok-123" not in repr(s) and "pw-456" not in repr(s)


def test_settings_are_read_once_until_rebuilt(monkeypatch):
    monkeypatch.setenv("CLAW_NAMESPACE", "first")
    use_settings()
    kept = get_settings()
    monkeypatch.setenv("CLAW_NAMESPACE", "second")
    assert get_settings() is kept and kept.namespace == "first"
    use_settings()
    assert get_settings().namespace == "second"
    mine = Settings.from_env({"CLAW_NAMESPACE": "mine"})
    use_settings(mine)
    assert get_settings() is mine


def test_the_redis_url_flag_stands_for_claw_redis_url(monkeypatch):
    """`claw --redis-url URL`: the settings every command reads have it as the store,
    the broker still the configured one (or, unset, the flag's server)."""
    monkeypatch.delenv("CLAW_REDIS_URL", raising=False)
    monkeypatch.setenv("CLAW_BROKER_URL", BROKER)
    flag = "redis://flag:6379/0"
    done = CliRunner().invoke(app, ["--redis-url", flag, "acl", "ns", "user"])
    assert done.exit_code == 0, done.output
    assert get_settings().redis_url == flag and get_settings().broker_for(flag) == BROKER
    monkeypatch.delenv("CLAW_BROKER_URL")
    CliRunner().invoke(app, ["--redis-url", flag, "acl", "ns", "user"])
    assert get_settings().broker_url == flag


def test_every_settings_attribute_is_a_declared_variable():
    attrs = {f.name for f in dataclasses.fields(Settings)} - {"given"}
    assert attrs == {v.attr.partition(".")[0] for v in VARIABLES}
    limits = {f.name for f in dataclasses.fields(type(Settings.from_env({}).limits))}
    assert limits == {v.attr[len("limits.") :] for v in VARIABLES if v.attr.startswith("limits.")}
    assert len(BY_NAME) == len(VARIABLES)


def test_the_settings_reference_is_the_settings_table():
    """Every variable documented, nothing documented that does not exist: the site's
    settings page is generated from the table (tools/docsgen.py)."""
    from tools.docsgen import settings_page

    page = settings_page()
    assert markdown_table() in page
    rows = [line for line in page.splitlines() if line.startswith("|")]
    documented = {m for row in rows[2:] for m in re.findall(r"^\| `(CLAW_\w+)`", row)}
    assert documented == set(BY_NAME)


def _python_files() -> list[Path]:
    return [p for top in PRODUCT for p in sorted((ROOT / top).rglob("*.py"))]


def env_reads(source: str) -> list[tuple[int, str]]:
    """Lines that read a ``CLAW_*`` variable: ``os.environ[...]``, ``.get``/``.pop``/
    ``getenv`` of a ``CLAW_*`` name, ``"CLAW_X" in ...``, or a click/typer ``envvar=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[ast.expr] = []
        if isinstance(node, ast.Subscript):
            names = [node.slice]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("get", "pop", "getenv", "setdefault") and node.args:
                names = [node.args[0]]
            names += [k.value for k in node.keywords if k.arg == "envvar"]
        elif isinstance(node, ast.Compare) and any(
            isinstance(op, ast.In | ast.NotIn) for op in node.ops
        ):
            names = [node.left]
        for n in names:
            if isinstance(n, ast.Constant) and str(n.value).startswith("CLAW_"):
                found.append((node.lineno, n.value))
    return found


def test_the_scan_finds_reads():
    code = (
        "import os\nos.environ.get('CLAW_A')\nos.environ['CLAW_B']\nos.getenv('CLAW_C')\n"
        "'CLAW_D' in os.environ\nOption(envvar='CLAW_E')\nenv = {'CLAW_F': 1}\n"
    )
    assert {name for _, name in env_reads(code)} == {
        "CLAW_A",
        "CLAW_B",
        "CLAW_C",
        "CLAW_D",
        "CLAW_E",
    }


def test_only_the_settings_module_reads_claw_variables():
    here = Path(settings_module.__file__).resolve().parent  # the package
    offenders = [
        f"{path.relative_to(ROOT)}:{line} reads {name}"
        for path in _python_files()
        if not path.resolve().is_relative_to(here)
        for line, name in env_reads(path.read_text())
    ]
    assert not offenders, "read it from get_settings() instead:\n" + "\n".join(offenders)


def test_no_undeclared_claw_variable_is_named():
    """Product code, the README, docs/ and the Compose file name only declared
    variables (or, outside product code, the repo's tooling ones)."""
    texts = {p: p.read_text() for p in _python_files()}
    docs = [ROOT / "README.md", ROOT / "docker-compose.yml", *sorted((ROOT / "docs").rglob("*.md"))]
    unknown = []
    for path, text in {**texts, **{p: p.read_text() for p in docs}}.items():
        allowed = set(BY_NAME) | (set() if path in texts else TOOLING)
        for name in set(re.findall(r"\bCLAW_[A-Z0-9_]*[A-Z0-9]\b", text)) - allowed:
            unknown.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unknown, "\n".join(sorted(unknown))


def test_urls_are_printed_without_their_password() -> None:
    assert redact_url("redis://:s3cret@10.0.0.1:6380/2") == "redis://:***@10.0.0.1:6380/2"
    assert redact_url("amqp://claw:s3cret@rabbit/vh") == "amqp://claw:***@rabbit/vh"
    assert redact_url("rediss://u:p%40ss@[::1]:6379/0") == "rediss://u:***@[::1]:6379/0"
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
