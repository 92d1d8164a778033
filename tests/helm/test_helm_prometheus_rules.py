"""The chart's SLO rules (templates/prometheusrule.yaml) as Prometheus runs them: the rendered
PrometheusRule's groups pass `promtool check rules`, and `promtool test rules` with
prometheus_rules_test.yaml shows each alert firing for the series that cross it (after its
`for`) and not for the others, and each recording rule's value. Needs Debian's prometheus
package (promtool); without it the tests fail saying so."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from chart_testkit import render

from tests.helpers import prometheus_tool

TESTS = Path(__file__).with_name("prometheus_rules_test.yaml")
ALERTS = {"PdserveTimeToFirstTokenHigh", "PdserveInterTokenLatencyHigh",
          "PdserveKVCacheNearlyFull", "PdserveCanaryFailing", "PdserveWorkerDown",
          "PdservePoolWithoutHealthyWorker", "PdserveWorkerMissing"}


def rendered_groups(chart, **rule_values) -> list[dict]:
    values = {"metrics": {"prometheusRule": {"enabled": True, **rule_values}}}
    (rule,) = render(chart, values).of_kind("PrometheusRule")
    return rule["spec"]["groups"]


def promtool(tmp_path: Path, groups: list[dict]) -> subprocess.CompletedProcess:
    """`promtool check rules` then `promtool test rules` over `groups`."""
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(TESTS, tmp_path / TESTS.name)
    tool = prometheus_tool("promtool")
    check = subprocess.run([tool, "check", "rules", "rules.yaml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    return subprocess.run([tool, "test", "rules", TESTS.name], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_the_slo_rules_pass_promtools_checks_and_unit_tests(chart, tmp_path):
    groups = rendered_groups(chart)
    assert {r["alert"] for g in groups for r in g["rules"] if "alert" in r} == ALERTS
    done = promtool(tmp_path, groups)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
    tested = {line.split(":", 1)[1].strip() for line in TESTS.read_text().splitlines()
              if line.strip().startswith("alertname:")}
    assert tested == ALERTS  # every alert has a unit test


def test_the_unit_tests_catch_a_wrong_threshold(chart, tmp_path):
    """Rendered with TTFT p99 at 10 s, the alert that should fire at 5 s does not: promtool
    fails (the tests are not vacuous), and the threshold is the values'."""
    groups = rendered_groups(chart, ttftP99Seconds=10)
    (ttft,) = [r for g in groups for r in g["rules"]
               if r.get("alert") == "PdserveTimeToFirstTokenHigh"]
    assert ttft["expr"].endswith("> 10")
    done = promtool(tmp_path, groups)
    assert done.returncode != 0
    assert "PdserveTimeToFirstTokenHigh" in done.stdout + done.stderr


def test_gpu_production_installs_the_rules_for_the_operator(rendered_gpu):
    (rule,) = rendered_gpu.of_kind("PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (ttft,) = [r for g in rule["spec"]["groups"] for r in g["rules"]
               if r.get("alert") == "PdserveTimeToFirstTokenHigh"]
    assert ttft["expr"].endswith("> 1")
