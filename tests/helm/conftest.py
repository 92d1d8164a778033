"""Fixtures for the chart tests: the loaded chart and one render per values file, cached for the
module (rendering goes through Helm's Go SDK; it is fast, but every test looks at it)."""

from __future__ import annotations

import helm_python as helm
import pytest
from chart_testkit import CHART_DIR, VALUES_FILES, Rendered, load_values, render


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.fixture(scope="module", params=list(VALUES_FILES))
def values_name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def rendered(chart, values_name) -> Rendered:
    return render(chart, load_values(values_name))


@pytest.fixture(scope="module")
def rendered_default(chart) -> Rendered:
    return render(chart, load_values("default"))


@pytest.fixture(scope="module")
def rendered_gpu(chart) -> Rendered:
    return render(chart, load_values("gpu-production"))
