"""The HTTP endpoint of a worker's metrics: GET /metrics in Prometheus' text format 0.0.4,
whatever the scraper's Accept header asks.

Why not prometheus_client's own server: given `Accept: application/openmetrics-text` (what
Prometheus sends first) it answers OpenMetrics with the names escaped, `pdserve:kv_cache_usage_perc`
becoming `pdserve_kv_cache_usage_perc`, so every dashboard panel and alert over the workers'
series found nothing (tests/e2e/test_e2e_prometheus.py runs a real Prometheus). The text
format keeps the names as vLLM's dashboards and ours write them, as the gateway's /metrics
(FastAPI, the same format) always did.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> ThreadingHTTPServer:
    """Serve `registry` at http://host:port/metrics (port 0: any free one: see the returned
    server's server_port) from a daemon thread; server.shutdown() stops it."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_PLAIN_0_0_4)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # one line per scrape would flood the log
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
