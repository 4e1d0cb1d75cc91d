"""Static checks of the deployment files: docker-compose.yml, ops/ and the shell scripts.

There is no Docker engine in CI, so the compose file is parsed, not run; the Redis config is
also loaded into a real redis-server to prove every directive is valid.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from flower.options import options as flower_options

from claw_tasks.connection.server import RedisServer
from tests.support.paths import ROOT

QUEUES = {"ingest", "prefetch", "maintenance"}
WORKERS = {"worker-ingest", "worker-prefetch", "worker-maintenance"}
CLAW_SERVICES = WORKERS | {"beat", "flower", "metrics", "web"}
SERVICES = CLAW_SERVICES | {"redis"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def argv(service: dict[str, Any]) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else list(command)


def option(args: list[str], *names: str) -> str | None:
    """Value of the first of `names` in `args` (`--opt value` or `--opt=value`)."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def read_conf(path: Path) -> dict[str, str]:
    """redis.conf as directive → value; every non-comment line must be `name value`."""
    conf: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition(" ")
        assert sep and value.strip(), f"{path.name}:{number}: not a `name value` line: {raw!r}"
        assert name not in conf, f"{path.name}:{number}: {name} set twice"
        conf[name] = value.strip().strip('"')
    return conf


def read_env_file(path: Path) -> dict[str, str]:
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    pairs = [ln.split("=", 1) for ln in lines if ln and not ln.startswith("#")]
    return {name: value for name, value in pairs}


def test_every_service_is_defined(services: dict[str, Any]) -> None:
    assert set(services) >= SERVICES


def test_claw_services_share_the_image_env_and_restart_policy(services: dict[str, Any]) -> None:
    for name in CLAW_SERVICES:
        service = services[name]
        assert service["build"] == {"context": ".", "dockerfile": "ops/Dockerfile"}, name
        env = service["environment"]
        assert "redis:6379" in env["CLAW_REDIS_URL"], name
        assert "redis:6379" in env["CLAW_BROKER_URL"], name
        assert service["depends_on"]["redis"]["condition"] == "service_healthy", name
    for name in SERVICES:
        assert services[name]["restart"] in {"always", "unless-stopped", "on-failure"}, name


def test_healthchecks(services: dict[str, Any]) -> None:
    # beat has none on purpose: it is the container's only process (see the compose file).
    for name in SERVICES - {"beat"}:
        assert services[name]["healthcheck"]["test"], name
    for name in WORKERS:
        check = " ".join(services[name]["healthcheck"]["test"])
        node = option(argv(services[name]), "-n", "--hostname")
        assert node is not None and node.endswith("@%h"), name
        assert f"-d {node.split('@')[0]}@$$HOSTNAME" in check, name


def test_workers_consume_known_queues(services: dict[str, Any]) -> None:
    consumed: set[str] = set()
    for name in WORKERS:
        args = argv(services[name])
        assert args[:4] == ["celery", "-A", "claw_tasks.worker.app", "worker"], name
        queues = option(args, "-Q", "--queues")
        assert queues, f"{name} names no queue"
        assert set(queues.split(",")) <= QUEUES, name
        assert option(args, "--prefetch-multiplier") == "1", name
        assert "-E" in args or "--events" in args or "--task-events" in args, name
        consumed |= set(queues.split(","))
    assert consumed == QUEUES
    assert option(argv(services["worker-ingest"]), "-c", "--concurrency") == "2"


def test_queue_set_matches_the_celery_app() -> None:
    from claw_tasks.worker.app import app

    assert {queue.name for queue in app.conf.task_queues} == QUEUES


def test_beat_uses_redbeat(services: dict[str, Any]) -> None:
    args = argv(services["beat"])
    assert args[:4] == ["celery", "-A", "claw_tasks.worker.app", "beat"]
    scheduler = option(args, "-S", "--scheduler")
    assert scheduler == "redbeat.RedBeatScheduler"
    module, cls = scheduler.rsplit(".", 1)
    assert hasattr(__import__(module), cls)


def test_flower_has_basic_auth_and_events(services: dict[str, Any]) -> None:
    flower = services["flower"]
    args = argv(flower)
    assert args[:4] == ["celery", "-A", "claw_tasks.worker.app", "flower"]
    # Basic auth from the environment, required (`:?`): no default password is committed.
    assert flower["environment"]["FLOWER_BASIC_AUTH"].startswith("${FLOWER_BASIC_AUTH:?")
    env = read_env_file(ROOT / flower["env_file"])
    assert env["FLOWER_ENABLE_EVENTS"] == "true"
    assert env["FLOWER_PERSISTENT"] == "false"
    assert "FLOWER_BASIC_AUTH" not in env
    for name in env:  # Flower fails at startup on an unknown FLOWER_* variable
        assert name.removeprefix("FLOWER_").lower() in flower_options, name
    assert any(p.endswith(f"{env['FLOWER_PORT']}:5555") for p in flower["ports"])


def test_metrics_service_and_prometheus_targets(services: dict[str, Any]) -> None:
    assert argv(services["metrics"]) == ["claw", "metrics", "--port", "9808"]
    prometheus = yaml.safe_load((ROOT / "ops/prometheus.yml").read_text())
    targets = {
        job["job_name"]: target
        for job in prometheus["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert targets == {"claw": "metrics:9808", "flower": "flower:5555"}
    for target in targets.values():
        assert target.split(":")[0] in services
    mount = "./ops/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]


def test_web_service_requires_a_password_and_binds_locally(services: dict[str, Any]) -> None:
    web = services["web"]
    args = argv(web)
    assert args[:2] == ["claw", "web"] and option(args, "--port") == "8808"
    assert "--password" not in " ".join(args)  # the password never sits in argv
    assert web["environment"]["CLAW_WEB_PASSWORD"].startswith("${CLAW_WEB_PASSWORD:?")
    assert web["ports"] == ["127.0.0.1:8808:8808"]
    assert "http://localhost:8808/login" in " ".join(web["healthcheck"]["test"])


def test_rabbitmq_profile_is_optional_durable_and_local(services: dict[str, Any]) -> None:
    rabbit = services["rabbitmq"]
    assert rabbit["profiles"] == ["rabbitmq"]  # not started unless asked for
    assert "rabbitmq-data:/var/lib/rabbitmq" in rabbit["volumes"]  # durable queues survive
    assert all(p.startswith("127.0.0.1:") for p in rabbit["ports"])
    assert rabbit["environment"]["RABBITMQ_DEFAULT_PASS"].startswith("${RABBITMQ_DEFAULT_PASS:?")
    assert "rabbitmq-diagnostics" in rabbit["healthcheck"]["test"]
    # The Claw services take their broker from CLAW_BROKER_URL (amqp:// selects RabbitMQ).
    for name in CLAW_SERVICES:
        env = services[name]["environment"]
        assert env["CLAW_BROKER_URL"].startswith("${CLAW_BROKER_URL:-")


def test_redis_service_uses_ops_conf_with_noeviction(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    conf_path = argv(redis)[-1]
    assert argv(redis)[0] == "redis-server"
    assert f"./ops/redis.conf:{conf_path}:ro" in redis["volumes"]
    conf = read_conf(ROOT / "ops/redis.conf")
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf["appendonly"] == "yes"
    assert conf["appendfsync"] == "everysec"
    # The AOF lives on a named volume.
    assert f"redis-data:{conf['dir']}" in redis["volumes"]
    assert "redis-data" in compose["volumes"]


def test_redis_conf_is_valid_for_redis_server() -> None:
    conf = read_conf(ROOT / "ops/redis.conf")
    managed = {"bind", "port", "dir", "protected-mode"}  # RedisServer sets these itself
    options = {k: v for k, v in conf.items() if k not in managed}
    with RedisServer(options=options) as server:
        client = server.client()
        for name in ("maxmemory-policy", "appendonly", "appendfsync", "maxmemory"):
            assert client.config_get(name)[name] != "", name
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert client.config_get("save")["save"] == ""
        client.close()


def test_dockerfile_builds_the_project_as_non_root() -> None:
    lines = [
        ln.strip()
        for ln in (ROOT / "ops/Dockerfile").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "FROM python:3.11-slim"
    copied = [ln.split()[1] for ln in lines if ln.startswith("COPY")]
    assert {"pyproject.toml", "claw_tasks", "orchestrator"} <= set(copied)
    for source in copied:
        assert (ROOT / source).exists(), source
    assert any(ln.startswith("RUN pip install .") for ln in lines)
    users = [ln.split()[1] for ln in lines if ln.startswith("USER")]
    assert users and users[-1] not in {"root", "0"}


def shell_scripts() -> list[Path]:
    return [*sorted((ROOT / "ops").glob("*.sh")), ROOT / ".ci/run"]


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_syntax(script: Path) -> None:
    assert os.access(script, os.X_OK), f"{script} is not executable"
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_makefile_targets_exist() -> None:
    subprocess.run(
        ["make", "-n", "test", "demo", "lint"], cwd=ROOT, check=True, capture_output=True
    )
