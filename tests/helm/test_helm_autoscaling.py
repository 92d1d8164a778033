"""The worker pools' HPAs scale on each pool's own saturation signal
(service_infra/metrics/autoscaling.py), as Pods metrics that prometheus-adapter serves with
helm/prometheus-adapter-values.yaml: every such metric of every HPA the chart renders comes
from a rule of that file, over a series its own pool exports."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from chart_testkit import KUBE_VERSION, RELEASE, REPO, WORKERS, load_values, render

from service_infra.metrics.autoscaling import SIGNALS
from service_infra.metrics.names import PREFIX

ADAPTER_VALUES = REPO / "helm" / "prometheus-adapter-values.yaml"


def adapter_metrics() -> dict[str, tuple[str, str]]:
    """{metric name the adapter serves: (the series' name, its pool label)}, by applying each
    rule's `name` (Go regexp `matches`, `as` with ${1}) to its seriesQuery's metric."""
    out = {}
    for rule in yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]:
        series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)
        pool = re.search(r'pool="([a-z]+)"', rule["seriesQuery"]).group(1)
        assert {"namespace", "pod"} <= set(rule["resources"]["overrides"]), rule
        served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"),
                        series)
        assert ":" not in served, served
        out[served] = (series, pool)
    return out


def test_every_rule_serves_a_signal_of_its_pool():
    served = adapter_metrics()
    assert {(s, p) for s, p in served.values()} == {
        (PREFIX + name, pool) for pool, names in SIGNALS.items() for name in names}


@pytest.mark.parametrize("values_name", ["default", "gpu-production"])
def test_worker_hpas_scale_on_their_pools_signals(chart, values_name):
    values = load_values(values_name) or {}
    for pool in WORKERS:  # turned on where the values leave it off
        values.setdefault(pool, {}).setdefault("autoscaling", {})["enabled"] = True
    rendered = render(chart, values)
    served = adapter_metrics()
    for pool in WORKERS:
        hpa = rendered.get("HorizontalPodAutoscaler", f"{RELEASE}-{pool}")
        kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
        metrics = hpa["spec"]["metrics"]
        assert metrics and all(m["type"] == "Pods" for m in metrics), metrics
        for m in metrics:
            name = m["pods"]["metric"]["name"]
            assert name in served and served[name][1] == pool, (pool, name)
            assert m["pods"]["target"]["type"] == "AverageValue"
        if pool == "prefill":
            assert [m["pods"]["metric"]["name"] for m in metrics] == [
                "pdserve_prefill_queue_ttft_seconds"]
