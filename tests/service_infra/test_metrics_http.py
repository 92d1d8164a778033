"""A worker's /metrics endpoint (service_infra/metrics/http.py) answers the text format with
the `pdserve:` names intact, also when the scraper asks for OpenMetrics first, as Prometheus
does (prometheus_client's own server then escapes the colons away)."""

from __future__ import annotations

import httpx2 as httpx
from prometheus_client import CollectorRegistry, Gauge

from service_infra.metrics.http import serve_metrics

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_names_keep_their_colons_whatever_the_scraper_accepts():
    registry = CollectorRegistry()
    Gauge("pdserve:kv_cache_usage_perc", "doc", registry=registry).set(0.25)
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        for accept in (PROMETHEUS_ACCEPT, "text/plain", "*/*"):
            r = httpx.get(url, headers={"Accept": accept}, timeout=10)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
            assert "pdserve:kv_cache_usage_perc 0.25" in r.text, r.text
        assert httpx.get(url.replace("/metrics", "/other"), timeout=10).status_code == 404
    finally:
        server.shutdown()
