"""helm/pdserve renders, lints clean, and every object it renders is valid Kubernetes: built-in
kinds against Kubernetes' own schemas (kubernetes-validate, strict, pinned version), the
Prometheus Operator's ServiceMonitor against a schema of its required fields. The output is
golden-filed (chart_testkit.py says how to regenerate)."""

from __future__ import annotations

import copy
import json

import helm_python as helm
import kubernetes_validate
import pytest
from chart_testkit import (
    CHART_DIR,
    COMPONENTS,
    CRD_SCHEMAS,
    KUBE_VERSION,
    RELEASE,
    check_golden,
    load_values,
    validate,
)


def test_lint_has_no_errors_or_warnings(values_name):
    values = load_values(values_name)
    report = helm.lint(CHART_DIR, values, kube_version=f"v{KUBE_VERSION}")
    errors = [m for m in report["messages"] if m["severity"] >= 3]
    assert not errors, errors
    strict = helm.lint(CHART_DIR, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    findings = [m for m in strict["messages"] if m["severity"] >= 2]
    assert not findings and not strict["errors"], (findings, strict["errors"])


def test_object_set(rendered, values_name):
    """What each values file deploys, by kind and name."""
    names = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects}
    per_component = {(kind, f"{RELEASE}-{c}") for c in COMPONENTS
                     for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy")}
    expected = per_component | {("ServiceAccount", RELEASE), ("ConfigMap", f"{RELEASE}-dashboards")}
    if values_name == "default":  # bundled Redis, no HPA, no ServiceMonitor
        expected |= {("StatefulSet", f"{RELEASE}-redis"), ("Service", f"{RELEASE}-redis"),
                     ("NetworkPolicy", f"{RELEASE}-redis")}
    else:  # external Redis, an HPA per pool, a ServiceMonitor per component, the SLO rules
        expected |= {(kind, f"{RELEASE}-{c}") for c in COMPONENTS
                     for kind in ("HorizontalPodAutoscaler", "ServiceMonitor")}
        expected |= {("PrometheusRule", RELEASE)}
    assert names == expected
    assert len(names) == len(rendered.objects), "two objects share a kind and name"
    assert all(o["metadata"]["namespace"] == "pdserve" for o in rendered.objects)


def test_every_object_validates_against_kubernetes_schemas(rendered):
    for obj in rendered.objects:
        if obj["kind"] in CRD_SCHEMAS:
            continue
        where = f'{obj["kind"]}/{obj["metadata"]["name"]}'
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError as e:
            pytest.fail(f"{where}: {e.message}")
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{where} is not valid Kubernetes {KUBE_VERSION}: {path}: {e.message}")


def test_kubernetes_validate_is_not_vacuous(rendered_default):
    """The validator does reject what the API server would: a string replica count and an
    unknown field (strict)."""
    deployment = copy.deepcopy(rendered_default.deployment("decode"))
    deployment["spec"]["replicas"] = "2"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)
    deployment = copy.deepcopy(rendered_default.deployment("decode"))
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpcc"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_crd_objects(rendered):
    for obj in rendered.objects:
        if obj["kind"] in CRD_SCHEMAS:
            validate(obj)


def test_dashboards_configmap(rendered):
    """The ConfigMap the Grafana sidecar loads holds exactly helm/pdserve/dashboards/*.json."""
    (configmap,) = rendered.of_kind("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = {p.name: p.read_text() for p in sorted((CHART_DIR / "dashboards").glob("*.json"))}
    assert files, "helm/pdserve/dashboards/ has no dashboard"
    assert configmap["data"] == files
    for name, text in files.items():
        dashboard = json.loads(text)
        assert dashboard.get("title") and dashboard.get("uid"), name
    assert sum(len(t.encode()) for t in files.values()) < 900_000, "ConfigMaps hold 1 MiB at most"


def test_golden(rendered, values_name):
    check_golden(values_name, rendered)
