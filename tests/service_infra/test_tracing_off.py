"""Tracing is off by default and costs nothing then (service_infra/tracing.py): no
interceptor on any channel or server, the gateway's backend unwrapped, and OpenTelemetry's
tracing SDK and exporter not even imported by the servers' modules."""

from __future__ import annotations

import subprocess
import sys

from gateway.tracing_backend import traced
from service_infra import tracing
from tests.helpers import ROOT


def test_off_without_an_endpoint():
    assert tracing.setup("gateway", "gw", None) is False
    assert not tracing.is_on()
    assert tracing.client_interceptors() == [] and tracing.server_interceptors() == []
    backend = object()
    assert traced(backend) is backend
    tracing.phase("queue", 0.0, 1.0)  # a no-op, not an error


def test_the_servers_do_not_import_the_sdk():
    """Not OpenTelemetry's tracing SDK, its exporter or our interceptors. (redis-py imports
    the SDK's metrics part by itself wherever the SDK is installed: not ours to load.)"""
    code = ("import sys, gateway.server, prefill_service.server, decode_service.server; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry', "
            "'service_infra.tracing'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = eval(done.stdout)
    assert "service_infra.tracing" in loaded  # the check sees our modules at all
    assert not [m for m in loaded if m.startswith(("opentelemetry.sdk.trace",
                                                   "opentelemetry.exporter",
                                                   "service_infra.tracing_grpc"))], loaded


def test_every_server_command_takes_the_flag():
    from pdserve.cli import build_parser

    parser = build_parser()
    for command in ("gateway", "prefill", "decode", "up"):
        args = parser.parse_args([command, "--otlp-traces-endpoint", "http://collector:4317"])
        assert args.otlp_traces_endpoint == "http://collector:4317", command
        assert parser.parse_args([command]).otlp_traces_endpoint is None
