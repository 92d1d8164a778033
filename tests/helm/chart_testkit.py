"""Render helm/pdserve offline (helm-python-sdk: Helm's Go SDK, no helm binary) and look at the
result as parsed objects; write and compare the golden files.

Golden files are the rendered output of each values file under tests/helm/golden/, compared
exactly. Regenerate them after a deliberate chart change with

    PDSERVE_UPDATE_GOLDEN=1 python -m pytest tests/helm

and review the diff. The dashboards ConfigMap's file contents are left out of the golden files
(the dashboards change on their own schedule; test_dashboards_configmap compares them with
helm/pdserve/dashboards/ instead).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "helm" / "pdserve"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
RELEASE = "pdserve"
NAMESPACE = "pdserve"
KUBE_VERSION = "1.31.0"  # the Kubernetes version manifests are validated and linted against
UPDATE_GOLDEN_ENV = "PDSERVE_UPDATE_GOLDEN"
COMPONENTS = ("gateway", "prefill", "decode")
WORKERS = ("prefill", "decode")

# ServiceMonitor is a CRD (not in Kubernetes' schemas): checked against the schema below.
DURATION = {"type": "string", "pattern": "^([0-9]+(\\.[0-9]+)?(ms|s|m|h))+$"}
SECRET_KEY_REF = {"type": "object", "required": ["name", "key"], "additionalProperties": False,
                  "properties": {"name": {"type": "string", "minLength": 1},
                                 "key": {"type": "string", "minLength": 1}}}
# The endpoint TLS fields we use (SafeTLSConfig: Secrets of the ServiceMonitor's namespace).
TLS_CONFIG = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "serverName": {"type": "string", "minLength": 1},
        "ca": {"type": "object", "required": ["secret"], "additionalProperties": False,
               "properties": {"secret": SECRET_KEY_REF}},
        "cert": {"type": "object", "required": ["secret"], "additionalProperties": False,
                 "properties": {"secret": SECRET_KEY_REF}},
        "keySecret": SECRET_KEY_REF,
    },
}
# The ServiceMonitor fields we use (monitoring.coreos.com/v1), closed so that a typo fails.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                    "maxLength": 63}},
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"any": {"type": "boolean"},
                                   "matchNames": {"type": "array", "items": {"type": "string"}}},
                },
                "selector": {
                    "type": "object", "additionalProperties": False, "minProperties": 1,
                    "properties": {"matchLabels": {"type": "object"},
                                   "matchExpressions": {"type": "array"}},
                },
                "endpoints": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["port"], "additionalProperties": False,
                        "properties": {"port": {"type": "string", "minLength": 1},
                                       "path": {"type": "string", "pattern": "^/"},
                                       "interval": DURATION, "scrapeTimeout": DURATION,
                                       "scheme": {"enum": ["http", "https"]},
                                       "tlsConfig": TLS_CONFIG},
                    },
                },
            },
        },
    },
}

# The PrometheusRule fields we use (monitoring.coreos.com/v1), closed so that a typo fails; the
# rules themselves are checked by promtool (test_helm_prometheus_rules.py).
_RULE = {
    "type": "object", "required": ["expr"], "additionalProperties": False,
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
    "properties": {
        "record": {"type": "string", "pattern": "^[a-zA-Z_:][a-zA-Z0-9_:]*$"},
        "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9]*$"},
        "expr": {"type": "string", "minLength": 1},
        "for": DURATION,
        "labels": {"type": "object", "additionalProperties": {"type": "string"}},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}
PROMETHEUS_RULE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": SERVICE_MONITOR_SCHEMA["properties"]["metadata"],
        "spec": {
            "type": "object", "required": ["groups"], "additionalProperties": False,
            "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string", "minLength": 1},
                               "interval": DURATION,
                               "rules": {"type": "array", "minItems": 1, "items": _RULE}}}}},
        },
    },
}

# kinds that are CRDs (not in Kubernetes' schemas), and the schema each is checked against
CRD_SCHEMAS = {"ServiceMonitor": SERVICE_MONITOR_SCHEMA, "PrometheusRule": PROMETHEUS_RULE_SCHEMA}


def validate(obj: dict[str, Any]) -> None:
    """A rendered object against Kubernetes' schemas (strict), or a CRD against its own."""
    if obj["kind"] in CRD_SCHEMAS:
        jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
    else:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


# name -> values file (None: the chart's defaults)
VALUES_FILES: dict[str, Path | None] = {
    "default": None,
    "gpu-production": CHART_DIR / "values-gpu-production.yaml",
}


def load_values(name: str) -> dict[str, Any] | None:
    path = VALUES_FILES[name]
    return None if path is None else helm.values_from_yaml(path.read_text())


@dataclass
class Rendered:
    """One render of the chart: the manifests by template path and the objects in them."""

    values: dict[str, Any]  # the merged values the templates saw
    manifests: dict[str, str]  # template path -> rendered text (NOTES.txt left out)
    objects: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: found {len(found)}"
        return found[0]

    def deployment(self, component: str) -> dict[str, Any]:
        return self.get("Deployment", f"{RELEASE}-{component}")

    def container(self, component: str) -> dict[str, Any]:
        (container,) = self.deployment(component)["spec"]["template"]["spec"]["containers"]
        return container

    def workloads(self) -> list[dict[str, Any]]:
        """Deployments and StatefulSets: everything with a pod template."""
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")


def render(chart: helm.Chart, values: dict[str, Any] | None) -> Rendered:
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests = {path: text for path, text in manifests.items() if not path.endswith("NOTES.txt")}
    objects = [doc for _, text in sorted(manifests.items())
               for doc in yaml.safe_load_all(text) if doc]
    return Rendered(values=chart.merge_values(values), manifests=manifests, objects=objects)


def flag_values(args: list[str]) -> dict[str, str]:
    """{"--flag": "value"} from an args list written as "--flag", "value" pairs (the first
    item is the sub-command)."""
    out: dict[str, str] = {}
    rest = args[1:]
    i = 0
    while i < len(rest):
        flag = rest[i]
        assert flag.startswith("--"), f"expected a flag at {rest[i:]}"
        if i + 1 < len(rest) and not rest[i + 1].startswith("--"):
            out[flag] = rest[i + 1]
            i += 2
        else:
            out[flag] = ""
            i += 1
    return out


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions)."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _is_dashboards(doc: dict[str, Any], values: dict[str, Any]) -> bool:
    label = values["dashboards"]["label"]
    return doc.get("kind") == "ConfigMap" and label in doc["metadata"].get("labels", {})


def golden_text(rendered: Rendered) -> str:
    """helm-template-like output: each template's documents under a `# Source:` line, templates
    in path order; the dashboards' JSON replaced by a pointer to the file."""
    parts = []
    for path, text in sorted(rendered.manifests.items()):
        for raw in re.split(r"^---[ \t]*$", text, flags=re.MULTILINE):
            doc = yaml.safe_load(raw)
            if not doc:
                continue
            if _is_dashboards(doc, rendered.values):
                doc["data"] = {key: f"<helm/pdserve/dashboards/{key}>" for key in doc["data"]}
                raw = yaml.safe_dump(doc, sort_keys=False)
            parts.append(f"---\n# Source: {path}\n{raw.strip(chr(10))}\n")
    return "".join(parts)


def check_golden(name: str, rendered: Rendered) -> None:
    path = GOLDEN_DIR / f"{name}.yaml"
    text = golden_text(rendered)
    if os.environ.get(UPDATE_GOLDEN_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    how = (f"regenerate with: {UPDATE_GOLDEN_ENV}=1 python -m pytest tests/helm "
           "(then review the diff)")
    assert path.exists(), f"no golden file {path.relative_to(REPO)}; {how}"
    expected = path.read_text()
    if text != expected:
        import difflib

        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), text.splitlines(keepends=True),
            fromfile=f"{path.relative_to(REPO)} (committed)", tofile="rendered now", n=2))
        raise AssertionError(
            f"the chart renders differently from {path.relative_to(REPO)}.\n"
            f"If the change is intended, {how}.\n{diff[:6000]}")
