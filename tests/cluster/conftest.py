"""Fixtures of the cluster tests: pdserve clusters over simulated hosts (pdserve/cluster/), each
test module starting the one it needs. They need root (namespaces, veth, tc): without it every
test here fails with the harness's message, never skips (.ci/run runs as root).

The model is a tiny random Llama (tests/tiny_model.py) in float32: a worker starts in seconds,
and its greedy output is exact against the offline engine on the same weights."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

from pdserve.cluster.netns import NeedsRoot, require_root
from pdserve.cluster.stack import ClusterSpec, ClusterStack


@pytest.fixture(autouse=True, scope="session")
def _needs_root():
    try:
        require_root()
    except NeedsRoot as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from tests.tiny_model import write_tiny_llama

    return str(write_tiny_llama(tmp_path_factory.mktemp("cluster-tiny")))


@pytest.fixture(scope="session")
def tiny_offline(tiny_model):
    """The offline engine on the workers' settings (float32, the CPU defaults)."""
    from engine_core.llm import LLM
    from tests.conftest import Offline

    return Offline(LLM(tiny_model, dtype="float32", kv_cache_memory_gb=0.05))


_STARTED: list[ClusterStack] = []  # the clusters running now (their logs on a failure)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        item.cluster_failed = True


@pytest.fixture(autouse=True)
def _logs_on_failure(request):
    """A failed test prints the tail of every running cluster process's log."""
    yield
    if getattr(request.node, "cluster_failed", False):
        for cluster in _STARTED:
            print(cluster.logs())


@contextlib.contextmanager
def running_cluster(spec: ClusterSpec, workdir) -> Iterator[ClusterStack]:
    """A started cluster; afterwards every process is killed and the network torn down. The
    logs in `workdir` are deleted unless PDSERVE_TEST_KEEP_LOGS is set."""
    with ClusterStack(spec, workdir) as cluster:
        _STARTED.append(cluster)
        try:
            yield cluster
        finally:
            _STARTED.remove(cluster)
    if not os.environ.get("PDSERVE_TEST_KEEP_LOGS"):
        for log in workdir.glob("*.log"):
            log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory, tiny_model):
    """start(**ClusterSpec fields) -> a running cluster of the tiny model, torn down when the
    module ends."""
    with contextlib.ExitStack() as stack:

        def start(**fields) -> ClusterStack:
            spec = ClusterSpec(model=tiny_model, **fields)
            return stack.enter_context(running_cluster(spec,
                                                       tmp_path_factory.mktemp("cluster")))

        yield start
