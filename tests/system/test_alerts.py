"""The alerts shipped in ops/: Prometheus' own promtool checks the rules and runs their unit
tests (ops/alerts.test.yml: reward collapse, a starved skill, NaN values and the others
fire on synthetic series and stay quiet on healthy ones); every series the alerts and the
Grafana dashboard read is one `claw metrics` exports; Compose's monitoring profile mounts
the rules, their overridable thresholds and the provisioned dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from claw_tasks.connection.client import redis_client
from claw_tasks.store import Store
from orchestrator.cli.exporter import registry_for
from orchestrator.delivery.registry import Registry
from orchestrator.delivery.samplestats import Observed
from orchestrator.maintenance.quality import quality_namespace
from orchestrator.recipe.model import Recipe
from tests.support.paths import ROOT
from tests.support.stepdata import batch

OPS = ROOT / "ops"
PROMTOOL = shutil.which("promtool")
NAME = re.compile(r"\b(claw_[a-z_]+|claw:threshold:[a-z0-9_]+)")


def _promtool(*args: str) -> str:
    if PROMTOOL is None:
        pytest.fail(
            "promtool is missing: apt-get install -y prometheus (Debian's package ships it; "
            "make test does it as root)"
        )
    done = subprocess.run([PROMTOOL, *args], cwd=OPS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    out = _promtool("check", "rules", "alerts.yml", "alert-thresholds.yml")
    assert out.count("SUCCESS") == 2
    tests = yaml.safe_load((OPS / "alerts.test.yml").read_text())
    tested = {t["alertname"] for case in tests["tests"] for t in case["alert_rule_test"]}
    alerts = {r["alert"] for g in _rules("alerts.yml") for r in g["rules"]}
    assert {"ClawRewardCollapse", "ClawDataStarved", "ClawNonFiniteValues"} <= tested
    assert tested == alerts - {"ClawQualityStale"}  # every alert but the staleness one
    assert "SUCCESS" in _promtool("test", "rules", "alerts.test.yml")


def _rules(name: str) -> list[dict]:
    return yaml.safe_load((OPS / name).read_text())["groups"]


def test_alerts_and_dashboard_read_what_claw_metrics_exports(own_redis_url):
    r = redis_client(own_redis_url)
    r.config_set("maxmemory", 2**30)
    try:
        store = Store(r, "watched")
        store.create(capacity=1000)
        store.commit(
            batch([{"ep": e, "step": i, "skill_tag": "a"} for e in range(3) for i in range(9)])
        )
        quality_namespace(store)
        reg = Registry(store)
        reg.put(
            Recipe.model_validate(
                {"name": "train", "batch_size": 4, "fields": ["obs"], "sources": [{"name": "all"}]}
            ),
            None,
        )
        seen = Observed()
        seen.batch(0.004, 4)
        seen.hit_rates(("all",), (27,), 27)
        reg.bump("train", **seen.fields())
        scrape = registry_for(own_redis_url, own_redis_url).collect()
        exported = {s.name for fam in scrape for s in fam.samples}
    finally:
        r.config_set("maxmemory", 0)
    text = (OPS / "alerts.yml").read_text()
    dashboard = json.loads((OPS / "grafana/dashboards/claw.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    read = set(NAME.findall(text + "\n".join(exprs)))
    thresholds = {r["record"] for g in _rules("alert-thresholds.yml") for r in g["rules"]}
    assert {n for n in read if n.startswith("claw:")} <= thresholds
    missing = {n for n in read if not n.startswith("claw:")} - exported
    assert not missing, f"read but not exported by claw metrics: {sorted(missing)}"


def test_compose_monitoring_profile_mounts_rules_thresholds_and_dashboard():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    prom, grafana = compose["prometheus"], compose["grafana"]
    assert prom["profiles"] == grafana["profiles"] == ["monitoring"]
    config = yaml.safe_load((OPS / "prometheus.yml").read_text())
    mounted = {v.split(":")[-2] for v in prom["volumes"]}
    assert set(config["rule_files"]) <= mounted
    assert "${ALERT_THRESHOLDS:-./ops/alert-thresholds.yml}" in " ".join(prom["volumes"])
    for volume in grafana["volumes"]:
        assert (ROOT / volume.split(":")[0]).is_dir()
    source = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((OPS / "grafana/provisioning/dashboards/claw.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    panels = json.loads((OPS / "grafana/dashboards/claw.json").read_text())["panels"]
    uids = {p["datasource"]["uid"] for p in panels if "datasource" in p}
    assert uids == {source["datasources"][0]["uid"]}
