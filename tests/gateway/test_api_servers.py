"""The parts of --api-servers that run without a stack (gateway/api_servers.py): the argv the
supervisor passes on, the canary's shared verdict, and the metrics mirror in Prometheus'
multiprocess mode (a process of its own: the mode is chosen at prometheus_client's import).
The whole of it runs in tests/e2e/test_e2e_streams.py."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from gateway.api_servers import _without
from gateway.disagg.canary import CanaryVerdict


def test_the_supervisor_passes_on_every_flag_but_its_own():
    argv = ["gateway", "--redis-url", "redis://x", "--api-servers", "3", "--port=5",
            "--http-port", "8000", "--canary-idle-s", "0"]
    assert _without(argv, ("--api-servers", "--port", "--http-port")) == [
        "gateway", "--redis-url", "redis://x", "--canary-idle-s", "0"]


def test_the_canary_verdict_is_shared_atomically(tmp_path):
    writer, reader = CanaryVerdict(tmp_path), CanaryVerdict(tmp_path)
    assert reader.is_ready()  # none written yet: ready
    writer.write(False, {"failed_rounds_in_a_row": 3})
    reader._read_at = 0.0  # (it re-reads at most every 0.2 s)
    assert not reader.is_ready()
    writer.write(True, {})
    reader._read_at = 0.0
    assert reader.is_ready()
    assert [p.name for p in tmp_path.iterdir()] == ["canary.json"]  # no temporary left


def test_the_mirror_sums_processes_and_skips_families_with_nothing_yet(tmp_path):
    """Two processes mirror a collector whose first family has no sample yet (a canary that
    has not run) and then gains one: the sums are right and the mirror keeps going."""
    script = textwrap.dedent('''
        import sys
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from gateway.api_servers import MetricsMirror

        class Collector:
            def __init__(self, running, moved):
                self.running, self.moved, self.latency = running, moved, None
            def collect(self):
                latency = GaugeMetricFamily("pdserve:canary_latency_seconds", "x",
                                            labels=["model_name"])
                if self.latency is not None:
                    latency.add_metric(["m"], self.latency)
                yield latency
                g = GaugeMetricFamily("pdserve:num_requests_running", "x",
                                      labels=["model_name", "pool"])
                g.add_metric(["m", "gateway"], self.running)
                yield g
                c = CounterMetricFamily("pdserve:request_migrations", "x",
                                        labels=["model_name", "pool"])
                c.add_metric(["m", "decode"], self.moved)
                yield c

        c = Collector(int(sys.argv[1]), 2)
        m = MetricsMirror(c)
        m.mirror()
        c.moved, c.latency = 5, 0.25
        m.mirror()
    ''')
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": "."}
    for running in (3, 4):
        subprocess.run([sys.executable, "-c", script, str(running)], env=env, check=True,
                       timeout=60)
    read = textwrap.dedent('''
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        r = CollectorRegistry()
        multiprocess.MultiProcessCollector(r)
        print(generate_latest(r).decode())
    ''')
    text = subprocess.run([sys.executable, "-c", read], env=env, check=True, timeout=60,
                          capture_output=True, text=True).stdout
    lines = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
             for line in text.splitlines() if line and not line.startswith("#")}
    assert lines['pdserve:request_migrations_total{model_name="m",pool="decode"}'] == 10.0
    assert lines['pdserve:canary_latency_seconds{model_name="m"}'] == 0.25
    # gauges sum over the processes (until the supervisor marks one dead: its exit)
    assert lines['pdserve:num_requests_running{model_name="m",pool="gateway"}'] == 7.0
