"""What the schemas cannot check: the rendered objects agree with each other and with what the
pdserve processes expect (GPU quantities, probe ports, selectors, the --grace drain against
terminationGracePeriodSeconds, non-root pods, the CLI's flags)."""

from __future__ import annotations

import re

from chart_testkit import (
    COMPONENTS,
    RELEASE,
    WORKERS,
    Rendered,
    flag_values,
    labels_match,
    render,
)

from pdserve import cli

GPU = "nvidia.com/gpu"
SHUTDOWN_MARGIN_S = 5  # after draining, the process closes its engine and unregisters

# The flags agreed for each command (docs/deployment/helm.md); a rendered flag outside them is a
# typo.
REDIS_FLAGS = {"--redis-url", "--redis-namespace", "--redis-tls-ca", "--redis-tls-cert",
               "--redis-tls-key"}
ENGINE_FLAGS = {"--model", "--dtype", "--kv-cache-memory-gb", "--max-num-seqs",
                "--max-num-batched-tokens", "--grace"}
TLS_FLAGS = {"--tls-cert", "--tls-key", "--tls-ca", "--tls-server-name",
             "--otlp-traces-endpoint"}  # (and tracing's, on every component too)
AGREED_FLAGS = {
    "gateway": {"--host", "--port", "--http-port", "--lease-ttl", "--max-waiting",
                "--max-queue-wait", "--prefill-policy", "--local-prefill-max-tokens",
                "--canary-idle-s", "--canary-timeout-s", "--canary-failures", "--grace",
                "--api-servers",
                "--model", "--tls-client-auth"}
    | REDIS_FLAGS | TLS_FLAGS,
    "prefill": {"--host", "--port", "--advertise-host", "--metrics-port", "--worker-id"}
    | REDIS_FLAGS | ENGINE_FLAGS | TLS_FLAGS,
    "decode": {"--host", "--port", "--advertise-host", "--metrics-port", "--worker-id",
               "--transports", "--speculative", "--num-speculative-tokens"}
    | REDIS_FLAGS | ENGINE_FLAGS | TLS_FLAGS,
}
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")


def pod_templates(rendered: Rendered):
    for workload in rendered.workloads():
        yield workload["metadata"]["name"], workload["spec"]["template"]


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def probe_port(probe: dict, container: dict) -> int | None:
    """The container port a probe targets (named ports resolved); None for an exec probe."""
    if "exec" in probe:
        return None
    handler = probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket")
    assert handler is not None, f"probe without a handler: {probe}"
    port = handler["port"]
    if isinstance(port, str):
        assert port in container_ports(container), f"probe names unknown port {port!r}"
        return container_ports(container)[port]
    return port


# ---- GPUs -------------------------------------------------------------------------------------

def test_gpu_quantities_in_gpu_values(rendered_gpu):
    for component in WORKERS:
        resources = rendered_gpu.container(component)["resources"]
        requested, limit = resources["requests"].get(GPU), resources["limits"].get(GPU)
        assert requested is not None and limit is not None, f"{component}: {GPU} in both"
        assert requested == limit, f"{component}: extended resources need requests == limits"
        # Kubernetes' schema takes any string as a quantity: our own check.
        assert isinstance(requested, str) and re.fullmatch(r"[1-9][0-9]*", requested), requested
        assert int(requested) == rendered_gpu.values[component]["gpus"]
    assert GPU not in str(rendered_gpu.container("gateway")["resources"])


def test_no_gpus_in_default_values(rendered_default):
    for component in COMPONENTS:
        assert GPU not in str(rendered_default.container(component)["resources"]), component


def test_resources_are_the_values_plus_gpus(rendered):
    """The GPU count is added to the values' resources, nothing else changes."""
    for component in COMPONENTS:
        resources = rendered.container(component)["resources"]
        without_gpu = {kind: {k: v for k, v in entries.items() if k != GPU}
                       for kind, entries in resources.items()}
        assert without_gpu == rendered.values[component]["resources"], component


# ---- probes, ports, Services, ServiceMonitors --------------------------------------------------

def test_probes(rendered):
    """Every component has startup, readiness and liveness probes on ports it exposes; startup
    gives the model minutes to load. Without TLS, gRPC probes target the container's gRPC port
    (the health service) and readiness is always gRPC health. With TLS (the kubelet's gRPC
    probes cannot do it: test_helm_tls.py checks the rest), no probe is gRPC; readiness follows
    the same health (the gateway's /health, a worker's bound gRPC port)."""
    tls = rendered.values["tls"]["enabled"]
    for component in COMPONENTS:
        container = rendered.container(component)
        ports = container_ports(container)
        for kind in PROBES:
            probe = container[kind]
            port = probe_port(probe, container)
            assert port is None or port in ports.values(), f"{component} {kind}: port {port}"
            if "grpc" in probe:
                assert not tls, f"{component} {kind}: a gRPC probe on a TLS port"
                assert probe["grpc"]["port"] == ports["grpc"], f"{component} {kind}"
        if not tls:
            assert "grpc" in container["readinessProbe"], component
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, component
    for component in WORKERS:  # worker health only turns NOT_SERVING on shutdown
        container = rendered.container(component)
        handler = "tcpSocket" if tls else "grpc"
        kinds = PROBES if tls else ("startupProbe", "livenessProbe")
        for kind in kinds:
            assert handler in container[kind], (component, kind)
            assert probe_port(container[kind], container) == container_ports(container)["grpc"]


def test_container_ports_match_the_flags(rendered):
    for component in COMPONENTS:
        container = rendered.container(component)
        flags, ports = flag_values(container["args"]), container_ports(container)
        assert int(flags["--port"]) == ports["grpc"], component
        if component == "gateway":
            assert int(flags["--http-port"]) == ports["http"]
        else:
            assert int(flags["--metrics-port"]) == ports["metrics"]
            assert flags["--advertise-host"] == "$(POD_IP)"
            assert flags["--worker-id"] == "$(POD_NAME)"
            env = {e["name"]: e for e in container["env"]}
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_services_select_one_workload_and_target_its_ports(rendered):
    pods = dict(pod_templates(rendered))
    for service in rendered.of_kind("Service"):
        name = service["metadata"]["name"]
        selected = [t for t in pods.values()
                    if labels_match({"matchLabels": service["spec"]["selector"]},
                                    t["metadata"]["labels"])]
        assert len(selected) == 1, f"Service {name} selects {len(selected)} workloads"
        (container,) = selected[0]["spec"]["containers"]
        ports = container_ports(container)
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert target in ports, f"Service {name}: targetPort {target!r} not a container port"
            assert ports[target] == port["port"], f"Service {name}: port {port['name']}"


def test_servicemonitors_name_ports_of_the_services_they_select(rendered, values_name):
    monitors = rendered.of_kind("ServiceMonitor")
    assert len(monitors) == (3 if values_name == "gpu-production" else 0)
    for monitor in monitors:
        services = [s for s in rendered.of_kind("Service")
                    if labels_match(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert len(services) == 1, monitor["metadata"]["name"]
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names, (monitor["metadata"]["name"], endpoint)
            assert endpoint["path"] == "/metrics"


# ---- PDBs, HPAs, NetworkPolicies, affinity ------------------------------------------------------

def test_pdbs_select_exactly_their_component(rendered):
    pdbs = rendered.of_kind("PodDisruptionBudget")
    assert {p["metadata"]["name"] for p in pdbs} == {f"{RELEASE}-{c}" for c in COMPONENTS}
    for pdb in pdbs:
        matched = [name for name, t in pod_templates(rendered)
                   if labels_match(pdb["spec"]["selector"], t["metadata"]["labels"])]
        assert matched == [pdb["metadata"]["name"]], pdb["metadata"]["name"]


def test_hpas_target_their_deployments(rendered):
    for hpa in rendered.of_kind("HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        deployment = rendered.get("Deployment", target["name"])
        assert "replicas" not in deployment["spec"], "the HPA owns replicas"
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert hpa["spec"]["metrics"], target["name"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Resource":  # utilisation is relative to the request
                assert metric["resource"]["name"] in deployment["spec"]["template"]["spec"][
                    "containers"][0]["resources"]["requests"]


def test_autoscaled_pools_in_gpu_values(rendered_gpu):
    hpas = {h["metadata"]["name"]: h for h in rendered_gpu.of_kind("HorizontalPodAutoscaler")}
    assert set(hpas) == {f"{RELEASE}-{c}" for c in COMPONENTS}
    for component in WORKERS:  # GPU pools scale on their own saturation (Pods metrics)
        metrics = hpas[f"{RELEASE}-{component}"]["spec"]["metrics"]
        assert {m["type"] for m in metrics} == {"Pods"}, metrics


def test_network_policies(rendered):
    """Each policy selects its component's pods; workers take gRPC only from their callers
    (prefill <- gateway; decode <- gateway, prefill: prefill pushes the KV); Redis only from
    pdserve pods; named ports exist on the selected pods."""
    pods = {name.removeprefix(f"{RELEASE}-"): t for name, t in pod_templates(rendered)}
    callers = {"prefill": {"gateway"}, "decode": {"gateway", "prefill"},
               "redis": {"gateway", "prefill", "decode"}}
    policies = rendered.of_kind("NetworkPolicy")
    assert len(policies) == len(pods)  # every pod is covered
    for policy in policies:
        name = policy["metadata"]["name"].removeprefix(f"{RELEASE}-")
        selected = [c for c, t in pods.items()
                    if labels_match(policy["spec"]["podSelector"], t["metadata"]["labels"])]
        assert selected == [name], policy["metadata"]["name"]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        (container,) = pods[name]["spec"]["containers"]
        for rule in policy["spec"]["ingress"]:
            rule_ports = {p["port"] for p in rule["ports"]}
            assert rule_ports <= set(container_ports(container)), (name, rule_ports)
            if name in callers and rule_ports & {"grpc", "redis"}:
                allowed = {c for c, t in pods.items() for peer in rule["from"]
                           if "podSelector" in peer and "namespaceSelector" not in peer
                           and labels_match(peer["podSelector"], t["metadata"]["labels"])}
                assert allowed == callers[name], (name, allowed)
            if name == "gateway":
                assert rule_ports == {"grpc", "http"}


def test_anti_affinity_spreads_each_pool(rendered_gpu):
    for component in COMPONENTS:
        spec = rendered_gpu.deployment(component)["spec"]["template"]
        (term,) = spec["spec"]["affinity"]["podAntiAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"]
        selector = term["podAffinityTerm"]["labelSelector"]
        assert labels_match(selector, spec["metadata"]["labels"]), component
        for other in set(COMPONENTS) - {component}:
            other_labels = rendered_gpu.deployment(other)["spec"]["template"]["metadata"]["labels"]
            assert not labels_match(selector, other_labels), (component, other)


def test_gpu_pools_land_on_gpu_nodes(rendered_gpu):
    for component in WORKERS:
        spec = rendered_gpu.deployment(component)["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


# ---- pods: security, shutdown, labels, command lines -------------------------------------------

def test_pods_run_as_non_root_with_a_read_only_root(rendered):
    for name, template in pod_templates(rendered):
        spec = template["spec"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 10001, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["enableServiceLinks"] is False, name  # no PDSERVE_PORT=tcp://... env
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0, name
            assert sc["allowPrivilegeEscalation"] is False, name
            assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
            assert sc["readOnlyRootFilesystem"] is True, name
            mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
            assert "emptyDir" in mounts["/tmp"], name
    for component in WORKERS:  # shared memory for torch and the shm KV transport
        spec = rendered.deployment(component)["spec"]["template"]["spec"]
        (dshm,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
        assert dshm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]


def test_termination_grace_exceeds_the_drain(rendered):
    for component in COMPONENTS:
        spec = rendered.deployment(component)["spec"]["template"]["spec"]
        grace = float(flag_values(spec["containers"][0]["args"])["--grace"])
        assert spec["terminationGracePeriodSeconds"] >= grace + SHUTDOWN_MARGIN_S, component


def test_pod_labels(rendered):
    for component in COMPONENTS:
        deployment = rendered.deployment(component)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "pdserve"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/component"] == component
        assert labels["pdserve.ai/role"] == component
        assert labels_match(deployment["spec"]["selector"], labels)


def test_command_lines_use_the_agreed_flags(rendered):
    for component in COMPONENTS:
        container = rendered.container(component)
        assert "command" not in container, "the image's ENTRYPOINT is pdserve"
        args = container["args"]
        assert args[0] == component
        flags = flag_values(args)
        assert set(flags) <= AGREED_FLAGS[component], set(flags) - AGREED_FLAGS[component]
        assert flags["--host"] == "0.0.0.0"
        assert flags["--redis-url"].startswith(("redis://", "rediss://"))


def test_command_lines_parse_with_the_cli(rendered):
    """The rendered args through pdserve's own argument parser (types, choices): the CLI defines
    every flag the chart passes."""
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = {}
    for component in COMPONENTS:
        known = set(subcommands.choices[component]._option_string_actions)
        args = [a.replace("$(POD_IP)", "10.0.0.7").replace("$(POD_NAME)", "pod-0")
                for a in rendered.container(component)["args"]]
        missing[component] = sorted(set(flag_values(args)) - known)
        if not missing[component]:
            parser.parse_args(args)  # SystemExit (with argparse's message) on a bad value
    missing = {component: flags for component, flags in missing.items() if flags}
    assert not missing, f"the chart passes flags the CLI does not define: {missing}"


def test_decode_flags(rendered, values_name):
    flags = flag_values(rendered.container("decode")["args"])
    assert flags["--transports"] == "grpc"  # no cuda_ipc between pods (docs/deployment/helm.md)
    if values_name == "gpu-production":
        assert (flags["--speculative"], flags["--num-speculative-tokens"]) == ("ngram", "4")
        assert flags["--dtype"] == flag_values(rendered.container("prefill")["args"])["--dtype"]
    else:
        assert "--speculative" not in flags


# ---- Redis -------------------------------------------------------------------------------------

def test_bundled_redis(rendered_default):
    service = rendered_default.get("Service", f"{RELEASE}-redis")
    url = f"redis://{RELEASE}-redis.pdserve.svc:{service['spec']['ports'][0]['port']}/0"
    for component in COMPONENTS:
        container = rendered_default.container(component)
        assert flag_values(container["args"])["--redis-url"] == url
        assert "PDSERVE_REDIS_PASSWORD" not in {e["name"] for e in container["env"]}
    statefulset = rendered_default.get("StatefulSet", f"{RELEASE}-redis")
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]


def test_external_redis_with_tls_and_a_password_secret(rendered_gpu):
    redis = rendered_gpu.values["redis"]
    for component in COMPONENTS:
        container = rendered_gpu.container(component)
        flags = flag_values(container["args"])
        assert flags["--redis-url"] == redis["externalUrl"]
        env = {e["name"]: e for e in container["env"]}
        ref = env["PDSERVE_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": redis["auth"]["existingSecret"], "key": redis["auth"]["passwordKey"]}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        tls_dir = mounts["redis-tls"]["mountPath"]
        assert mounts["redis-tls"]["readOnly"] is True
        assert flags["--redis-tls-ca"] == f"{tls_dir}/ca.crt"
        assert flags["--redis-tls-cert"] == f"{tls_dir}/tls.crt"
        assert flags["--redis-tls-key"] == f"{tls_dir}/tls.key"
        volumes = {v["name"]: v for v in rendered_gpu.deployment(component)["spec"]["template"][
            "spec"]["volumes"]}
        secret = volumes["redis-tls"]["secret"]
        assert secret["secretName"] == redis["tls"]["secretName"]
        assert {i["path"] for i in secret["items"]} == {"ca.crt", "tls.crt", "tls.key"}


def test_gateway_api_keys_from_a_secret(rendered, values_name):
    env = {e["name"]: e for e in rendered.container("gateway")["env"]}
    if values_name == "default":
        assert "PDSERVE_API_KEYS" not in env
        return
    keys = rendered.values["gateway"]["apiKeys"]
    assert env["PDSERVE_API_KEYS"]["valueFrom"]["secretKeyRef"] == {
        "name": keys["existingSecret"], "key": keys["secretKey"]}
    for component in WORKERS:  # only the gateway checks keys
        assert "PDSERVE_API_KEYS" not in {e["name"] for e in rendered.container(component)["env"]}


def test_tracing_reaches_every_component_only_when_set(chart, rendered_default):
    for c in COMPONENTS:
        assert "--otlp-traces-endpoint" not in rendered_default.container(c)["args"]
    url = "http://otel-collector.monitoring.svc:4317"
    rendered = render(chart, {"tracing": {"otlpTracesEndpoint": url}})
    for c in COMPONENTS:
        assert flag_values(rendered.container(c)["args"])["--otlp-traces-endpoint"] == url, c
