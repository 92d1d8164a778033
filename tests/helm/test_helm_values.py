"""values.schema.json rejects bad values with a message naming the key (through Helm's own
schema validation), the templates refuse inconsistent combinations, and the optional features
(Redis auth, a model volume, Redis persistence) render valid objects."""

from __future__ import annotations

import json

import helm_python as helm
import jsonschema
import pytest
from chart_testkit import (
    CHART_DIR,
    COMPONENTS,
    RELEASE,
    VALUES_FILES,
    flag_values,
    load_values,
    render,
    validate,
)

from kv_transfer import transports


def test_schema_is_valid_draft_7():
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    assert schema["additionalProperties"] is False  # a misspelt top-level key is an error


def test_schema_offers_the_registry_s_transports():
    """values.schema.json is static; the transports a decode worker may accept are the
    registry's (kv_transfer/transports/), in its order."""
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    decode = schema["properties"]["decode"]["properties"]
    assert decode["transports"]["items"]["enum"] == list(transports.names())


@pytest.mark.parametrize("name", list(VALUES_FILES))
def test_values_files_pass_the_schema(chart, name):
    chart.validate_schema(load_values(name))


@pytest.mark.parametrize(("values", "where", "why"), [
    ({"decode": {"replicas": "2"}}, "/decode/replicas", "got string, want integer"),
    ({"prefill": {"replicas": -1}}, "/prefill/replicas", "minimum"),
    ({"decode": {"gpus": -1}}, "/decode/gpus", "minimum: got -1, want 0"),
    ({"prefill": {"gpus": 0.5}}, "/prefill/gpus", "want integer"),
    ({"decode": {"transports": ["grpc", "tcp"]}}, "/decode/transports/1", "must be one of"),
    ({"decode": {"speculative": {"method": "medusa"}}}, "/decode/speculative/method",
     "must be one of"),
    ({"model": {"dtype": "fp8"}}, "/model/dtype", "must be one of"),
    ({"gateway": {"ports": {"grpc": 70000}}}, "/gateway/ports/grpc", "maximum"),
    ({"decode": {"replica": 2}}, "/decode", "additional properties 'replica' not allowed"),
    ({"redis": {"bundled": False}}, "/redis/externalUrl", "minLength"),
    ({"redis": {"bundled": False, "externalUrl": "redis.example:6379"}}, "/redis/externalUrl",
     "does not match pattern"),
    ({"metrics": {"serviceMonitor": {"interval": "30"}}}, "/metrics/serviceMonitor/interval",
     "does not match pattern"),
    ({"gateway": {"pdb": {"maxUnavailable": "one"}}}, "/gateway/pdb/maxUnavailable", ""),
    ({"tls": {"enabled": "yes"}}, "/tls/enabled", "got string, want boolean"),
    ({"tls": {"gatewayClientAuth": 1}}, "/tls/gatewayClientAuth", "want boolean"),
    ({"tls": {"enabled": True, "existingSecret": "My_Secret"}}, "/tls/existingSecret",
     "does not match pattern"),
    ({"tls": {"certKey": ""}}, "/tls/certKey", "does not match pattern"),
    ({"tls": {"caKey": "ca/crt"}}, "/tls/caKey", "does not match pattern"),
    ({"tls": {"serverName": "https://pdserve.svc"}}, "/tls/serverName", "does not match pattern"),
    ({"tls": {"secretName": "pdserve-tls"}}, "/tls",
     "additional properties 'secretName' not allowed"),
    ({"tls": {"keyKey": None}}, "/tls", "missing property 'keyKey'"),
    ({"kvOffload": {"disk": {"hostPath": "relative/dir"}}}, "/kvOffload/disk/hostPath",
     "does not match pattern"),
    ({"kvOffload": {"redis": {"url": "http://redis:6379"}}}, "/kvOffload/redis/url",
     "does not match pattern"),
])
def test_schema_rejects_bad_values(chart, values, where, why):
    with pytest.raises(helm.HelmValuesError) as error:
        chart.validate_schema(values)
    message = str(error.value)
    assert f"at '{where}'" in message and why in message, message
    with pytest.raises(helm.HelmValuesError):  # rendering (helm install/template) refuses too
        chart.render(values, name=RELEASE, namespace="pdserve")


@pytest.mark.parametrize(("values", "why"), [
    ({"decode": {"grace": 120, "terminationGracePeriodSeconds": 100}},
     "decode.terminationGracePeriodSeconds (100) must be at least decode.grace + 5 (125)"),
    ({"redis": {"tls": {"enabled": True, "secretName": "tls"}}},
     "redis.tls is for an external Redis"),
    ({"redis": {"bundled": False, "externalUrl": "rediss://r:6380", "tls": {"enabled": True}}},
     "redis.tls.enabled needs redis.tls.secretName"),
    ({"redis": {"auth": {"enabled": True}}}, "needs redis.auth.password or"),
    ({"model": {"pvc": {"claimName": "models"}}}, "model.pvc.claimName needs model.path"),
    ({"prefill": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": 80},
                  "resources": {"requests": {"cpu": None}}}},
     "prefill.autoscaling.targetCPUUtilizationPercentage needs prefill.resources.requests.cpu"),
    ({"decode": {"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None,
                                 "metrics": []}}},
     "decode.autoscaling is enabled without a metric"),
    ({"gateway": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "gateway.autoscaling.minReplicas is above maxReplicas"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.existingSecret"),
    ({"redis": {"auth": {"enabled": True, "password": "s3cret"}},
      "kvOffload": {"redis": {"enabled": True}}},
     "kvOffload.redis: the chart's Redis requires a password"),
    ({"tls": {"gatewayClientAuth": True}}, "tls.gatewayClientAuth needs tls.enabled"),
    ({"tls": {"enabled": True, "existingSecret": "tls"},
      "decode": {"livenessProbe": {"grpc": {"port": 50071}}}},
     "decode.livenessProbe: gRPC probes cannot do TLS"),
    ({"tls": {"enabled": True, "existingSecret": "tls", "gatewayClientAuth": True},
      "gateway": {"startupProbe": {"httpGet": {"path": "/metrics", "port": "grpc"}}}},
     "gateway.startupProbe: httpGet port \"grpc\" is not the gateway's HTTP port"),
])
def test_templates_refuse_inconsistent_values(chart, values, why):
    with pytest.raises(helm.HelmRenderError) as error:
        chart.render(values, name=RELEASE, namespace="pdserve")
    assert why in str(error.value), str(error.value)


def validate_all(objects) -> None:
    for obj in objects:
        validate(obj)


def test_bundled_redis_with_a_password(chart):
    rendered = render(chart, {"redis": {"auth": {"enabled": True, "password": "s3cret"}}})
    validate_all(rendered.objects)
    secret = rendered.get("Secret", f"{RELEASE}-redis")
    assert secret["data"] == {"password": "czNjcmV0"}  # base64 of s3cret
    redis = rendered.get("StatefulSet", f"{RELEASE}-redis")["spec"]["template"]["spec"]
    (container,) = redis["containers"]
    assert flag_values(["redis-server", *container["args"]])["--requirepass"] == "$(REDISCLI_AUTH)"
    (env,) = container["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": f"{RELEASE}-redis", "key": "password"}
    for component in COMPONENTS:
        env = {e["name"]: e for e in rendered.container(component)["env"]}
        assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{RELEASE}-redis", "key": "password"}
        assert "s3cret" not in str(rendered.container(component)), "only in the Secret"


def test_model_from_a_volume(chart):
    rendered = render(chart, {"model": {"path": "/mnt/model/llama.gguf",
                                        "pvc": {"claimName": "models"}}})
    validate_all(rendered.objects)
    for component in COMPONENTS:
        container = rendered.container(component)
        assert flag_values(container["args"])["--model"] == "/mnt/model/llama.gguf"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/mnt/model", "readOnly": True}
        volumes = {v["name"]: v for v in rendered.deployment(component)["spec"]["template"]["spec"][
            "volumes"]}
        assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models",
                                                             "readOnly": True}


def test_redis_persistence_and_large_numbers(chart):
    """A volume claim for Redis; integers past a million render as integers, not 1e+06."""
    rendered = render(chart, {"redis": {"persistence": {"enabled": True, "size": "2Gi"}},
                              "gateway": {"maxWaiting": 2_000_000},
                              "prefill": {"engine": {"maxNumBatchedTokens": 1_048_576}}})
    validate_all(rendered.objects)
    redis = rendered.get("StatefulSet", f"{RELEASE}-redis")["spec"]
    (claim,) = redis["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "2Gi"
    assert "data" not in {v["name"] for v in redis["template"]["spec"]["volumes"]}
    assert flag_values(rendered.container("gateway")["args"])["--max-waiting"] == "2000000"
    prefill = flag_values(rendered.container("prefill")["args"])
    assert prefill["--max-num-batched-tokens"] == "1048576"


def test_network_policy_and_dashboards_can_be_turned_off(chart):
    rendered = render(chart, {"networkPolicy": {"enabled": False},
                              "dashboards": {"enabled": False}})
    kinds = {o["kind"] for o in rendered.objects}
    assert "NetworkPolicy" not in kinds and "ConfigMap" not in kinds


def test_kv_offload_tiers_on_the_workers(chart):
    """kvOffload: every worker gets the tiers' flags; the disk tier on a hostPath volume
    (shared by a node's pods, kept across restarts) or an emptyDir; the Redis tier on the
    chart's Redis unless a URL is given; the gateway gets neither."""
    rendered = render(chart, {"kvOffload": {"cpuGb": 8, "disk": {
        "enabled": True, "gb": 100, "hostPath": "/var/cache/pdserve-kv"},
        "redis": {"enabled": True, "gb": 2}}})
    validate_all(rendered.objects)
    for worker in ("prefill", "decode"):
        container = rendered.container(worker)
        flags = flag_values(container["args"])
        assert flags["--kv-offload-cpu-gb"] == "8" and flags["--kv-offload-disk-gb"] == "100"
        assert flags["--kv-offload-dir"] == "/var/cache/pdserve-kv"
        assert flags["--kv-offload-redis-url"] == flags["--redis-url"]
        assert flags["--kv-offload-redis-gb"] == "2"
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["kv-offload"] == "/var/cache/pdserve-kv"
        volumes = {v["name"]: v for v in rendered.deployment(worker)["spec"]["template"][
            "spec"]["volumes"]}
        assert volumes["kv-offload"]["hostPath"] == {"path": "/var/cache/pdserve-kv",
                                                     "type": "DirectoryOrCreate"}
    assert not any(a.startswith("--kv-offload") for a in rendered.container("gateway")["args"])
    scratch = render(chart, {"kvOffload": {"disk": {"enabled": True, "sizeLimit": "5Gi"},
                                           "redis": {"enabled": True,
                                                     "url": "redis://:pw@kv-cache:6379/1"}}})
    validate_all(scratch.objects)
    flags = flag_values(scratch.container("decode")["args"])
    assert flags["--kv-offload-redis-url"] == "redis://:pw@kv-cache:6379/1"
    assert "--kv-offload-cpu-gb" not in flags
    volumes = {v["name"]: v for v in scratch.deployment("decode")["spec"]["template"]["spec"][
        "volumes"]}
    assert volumes["kv-offload"]["emptyDir"] == {"sizeLimit": "5Gi"}
    default = render(chart, None)
    assert not any(a.startswith("--kv-offload") for a in default.container("decode")["args"])
