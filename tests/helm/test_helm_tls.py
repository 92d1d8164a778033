"""TLS (values `tls`): off, the chart renders as before; on, every pdserve container gets the
certificate, its key and the CA from the Secret's volume and flags that point to them, the
gateway asks for client certificates only when told to, no probe is a (plaintext) gRPC probe,
HTTP probes of the gateway use HTTPS or, with client auth, an exec probe that presents the
pod's certificate, and the gateway's ServiceMonitor scrapes over HTTPS."""

from __future__ import annotations

import copy

import jsonschema
import pytest
from chart_testkit import (
    COMPONENTS,
    RELEASE,
    SERVICE_MONITOR_SCHEMA,
    WORKERS,
    Rendered,
    flag_values,
    golden_text,
    load_values,
    render,
    validate,
)

from pdserve import cli

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
FILES = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-ca": "ca.crt"}
DEFAULT_SERVER_NAME = f"{RELEASE}-gateway.pdserve.svc"  # the gateway Service's DNS name

# name -> values layered on the chart's defaults (None: a values file)
TLS_VALUES = {
    "tls-on": {"tls": {"enabled": True, "existingSecret": "pdserve-tls"},
               "metrics": {"serviceMonitor": {"enabled": True}}},
    "client-auth": {"tls": {"enabled": True, "existingSecret": "certs", "certKey": "pod.pem",
                            "keyKey": "pod-key.pem", "caKey": "root.pem",
                            "serverName": "workers.pdserve.internal",
                            "gatewayClientAuth": True},
                    "metrics": {"serviceMonitor": {"enabled": True}}},
    "gpu-production": None,
}


@pytest.fixture(scope="module", params=list(TLS_VALUES))
def tls_rendered(request, chart) -> Rendered:
    values = TLS_VALUES[request.param]
    return render(chart, load_values(request.param) if values is None else values)


def secret_keys(rendered: Rendered) -> dict[str, str]:
    """Mounted file name -> the Secret key it comes from, as the values say."""
    tls = rendered.values["tls"]
    return {"tls.crt": tls["certKey"], "tls.key": tls["keyKey"], "ca.crt": tls["caKey"]}


def pod_spec(rendered: Rendered, component: str) -> dict:
    return rendered.deployment(component)["spec"]["template"]["spec"]


# ---- off --------------------------------------------------------------------------------------

def test_tls_off_renders_as_before(chart, rendered_default):
    """Disabled, the other tls keys change nothing (the default golden file pins the output);
    nothing TLS in any pdserve container."""
    ignored = render(chart, {"tls": {"enabled": False, "existingSecret": "pdserve-tls",
                                     "serverName": "x.example", "certKey": "a.pem"}})
    assert golden_text(ignored) == golden_text(rendered_default)
    for component in COMPONENTS:
        container = rendered_default.container(component)
        assert not any(a.startswith("--tls") for a in container["args"]), component
        assert "tls" not in {m["name"] for m in container["volumeMounts"]}
        assert "tls" not in {v["name"] for v in pod_spec(rendered_default, component)["volumes"]}
    for monitor in rendered_default.of_kind("ServiceMonitor"):
        assert all("tlsConfig" not in e for e in monitor["spec"]["endpoints"])


# ---- on ---------------------------------------------------------------------------------------

def test_gpu_production_turns_tls_on(rendered_gpu):
    tls = rendered_gpu.values["tls"]
    assert tls["enabled"] is True and tls["existingSecret"]


def test_tls_renders_valid_objects(tls_rendered):
    for obj in tls_rendered.objects:
        validate(obj)


def test_every_container_gets_the_secret_and_flags_to_its_files(tls_rendered):
    tls = tls_rendered.values["tls"]
    for component in COMPONENTS:
        container = tls_rendered.container(component)
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        assert mount["readOnly"] is True and "subPath" not in mount, component
        (volume,) = [v for v in pod_spec(tls_rendered, component)["volumes"]
                     if v["name"] == "tls"]
        secret = volume["secret"]
        assert secret["secretName"] == tls["existingSecret"], component
        assert secret["defaultMode"] == 0o440, component  # group-readable: fsGroup 10001
        assert {i["path"]: i["key"] for i in secret["items"]} == secret_keys(tls_rendered)
        flags = flag_values(container["args"])
        for flag, file in FILES.items():
            assert flags[flag] == f'{mount["mountPath"]}/{file}', (component, flag)
        assert flags["--tls-server-name"] == (tls["serverName"] or DEFAULT_SERVER_NAME)
        env = {e["name"] for e in container["env"]}
        assert not env & {"PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA"}, "flags only"


def test_the_default_server_name_is_the_gateway_services(rendered_gpu):
    """The name the workers' callers expect must be one the shared certificate carries: by
    default the gateway Service's, which clients inside the cluster connect to anyway."""
    assert rendered_gpu.values["tls"]["serverName"] == ""
    service = rendered_gpu.get("Service", f"{RELEASE}-gateway")
    name = f'{service["metadata"]["name"]}.{service["metadata"]["namespace"]}.svc'
    for component in COMPONENTS:
        flags = flag_values(rendered_gpu.container(component)["args"])
        assert flags["--tls-server-name"] == name, component


def test_gateway_client_auth_only_when_asked(tls_rendered, rendered_default):
    asked = tls_rendered.values["tls"]["gatewayClientAuth"]
    assert ("--tls-client-auth" in tls_rendered.container("gateway")["args"]) is asked
    for component in WORKERS:  # a gateway-only flag: workers always require client certs
        assert "--tls-client-auth" not in tls_rendered.container(component)["args"]
    assert "--tls-client-auth" not in rendered_default.container("gateway")["args"]


def test_command_lines_parse_with_the_cli(tls_rendered):
    """The real parser takes the TLS flags and they land where service_infra/tls.py reads them."""
    parser = cli.build_parser()
    for component in COMPONENTS:
        args = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "pod-0")
                for a in tls_rendered.container(component)["args"]]
        parsed = parser.parse_args(args)
        flags = flag_values(args)
        assert (parsed.tls_cert, parsed.tls_key, parsed.tls_ca) == (
            flags["--tls-cert"], flags["--tls-key"], flags["--tls-ca"]), component
        assert parsed.tls_server_name == flags["--tls-server-name"]
        if component == "gateway":
            assert parsed.tls_client_auth is tls_rendered.values["tls"]["gatewayClientAuth"]


# ---- probes -----------------------------------------------------------------------------------

def test_no_grpc_probe_on_a_tls_port(tls_rendered):
    for component in COMPONENTS:
        container = tls_rendered.container(component)
        for kind in PROBES:
            assert "grpc" not in container[kind], (component, kind)


def test_worker_probes_connect_to_the_grpc_port(tls_rendered):
    """The port is bound once the model has loaded, right before health turns SERVING."""
    for component in WORKERS:
        container = tls_rendered.container(component)
        for kind in PROBES:
            probe = container[kind]
            assert probe["tcpSocket"] == {"port": "grpc"}, (component, kind)
            # the values' timing is kept
            expected = {k: v for k, v in tls_rendered.values[component][kind].items()}
            assert {k: v for k, v in probe.items() if k != "tcpSocket"} == expected


def test_gateway_probes_use_https_or_present_a_certificate(tls_rendered):
    container = tls_rendered.container("gateway")
    values = tls_rendered.values["gateway"]
    http_port = values["ports"]["http"]
    tls_dir = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "tls")
    # the values' httpGet paths; readiness without a handler: /health (the gRPC health status)
    paths = {kind: (values[kind].get("httpGet") or {"path": "/health"})["path"]
             for kind in PROBES}
    for kind in PROBES:
        probe = container[kind]
        if not tls_rendered.values["tls"]["gatewayClientAuth"]:
            assert probe["httpGet"]["scheme"] == "HTTPS", kind
            assert probe["httpGet"]["port"] == "http" and probe["httpGet"]["path"] == paths[kind]
            continue
        # the kubelet cannot present a client certificate: the pod makes the request itself
        assert "httpGet" not in probe and "tcpSocket" not in probe, kind
        python, dash_c, script, port, path, timeout = probe["exec"]["command"]
        assert (python, dash_c) == ("python", "-c")
        compile(script, f"gateway {kind}", "exec")  # valid Python
        for file in FILES.values():
            assert f'"{tls_dir}/"' in script and f'"{file}"' in script, (kind, file)
        assert "load_cert_chain" in script and "HTTPSConnection" in script
        assert (int(port), path) == (http_port, paths[kind]), kind
        assert int(timeout) == probe["timeoutSeconds"]


def test_explicit_probes_keep_their_handler(chart):
    """A tcpSocket or exec probe from the values is left alone; a worker httpGet probe on the
    (plaintext) metrics port keeps HTTP. (The gateway's default httpGet is dropped with null.)"""
    rendered = render(chart, {
        "tls": {"enabled": True, "existingSecret": "pdserve-tls", "gatewayClientAuth": True},
        "decode": {"livenessProbe": {"exec": {"command": ["true"]}}},
        "prefill": {"livenessProbe": {"httpGet": {"path": "/metrics", "port": "metrics"}}},
        "gateway": {"livenessProbe": {"httpGet": None, "tcpSocket": {"port": "http"}}},
    })
    handlers = {"grpc", "httpGet", "tcpSocket", "exec"}

    def handler(component: str) -> dict:
        probe = rendered.container(component)["livenessProbe"]
        return {k: v for k, v in probe.items() if k in handlers}

    assert handler("decode") == {"exec": {"command": ["true"]}}
    assert handler("prefill") == {"httpGet": {"path": "/metrics", "port": "metrics"}}
    assert handler("gateway") == {"tcpSocket": {"port": "http"}}


# ---- ServiceMonitors --------------------------------------------------------------------------

def test_gateway_metrics_are_scraped_over_https(tls_rendered):
    tls = tls_rendered.values["tls"]
    monitors = {m["metadata"]["name"]: m for m in tls_rendered.of_kind("ServiceMonitor")}
    assert monitors, "every TLS render here enables the ServiceMonitors"
    (endpoint,) = monitors[f"{RELEASE}-gateway"]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    config = endpoint["tlsConfig"]
    assert config["serverName"] == (tls["serverName"] or DEFAULT_SERVER_NAME)
    assert config["ca"]["secret"] == {"name": tls["existingSecret"], "key": tls["caKey"]}
    if tls["gatewayClientAuth"]:
        assert config["cert"]["secret"] == {"name": tls["existingSecret"], "key": tls["certKey"]}
        assert config["keySecret"] == {"name": tls["existingSecret"], "key": tls["keyKey"]}
    else:
        assert "cert" not in config and "keySecret" not in config
    for component in WORKERS:  # the workers' metrics ports are plain HTTP
        (endpoint,) = monitors[f"{RELEASE}-{component}"]["spec"]["endpoints"]
        assert "scheme" not in endpoint and "tlsConfig" not in endpoint


def test_service_monitor_schema_is_not_vacuous(tls_rendered):
    monitor = copy.deepcopy(tls_rendered.get("ServiceMonitor", f"{RELEASE}-gateway"))
    monitor["spec"]["endpoints"][0]["tlsConfig"]["insecureSkipVerfy"] = True
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)
