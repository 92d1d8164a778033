"""The Dockerfile (not buildable here: no docker daemon) agrees with the chart and the package:
the user the chart runs as, the ports it opens, the torch pin, every package copied in, the
model baked in where the CLI looks for it, `pdserve` as the entrypoint."""

from __future__ import annotations

import json
import re
import shlex
from fnmatch import fnmatch

import pytest
from chart_testkit import COMPONENTS, REPO, render

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the image's Python)

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        pending += " " + stripped.removesuffix("\\")
        if stripped.endswith("\\"):
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    return out


def all_of(keyword: str) -> list[str]:
    return [rest for kw, rest in instructions() if kw == keyword]


def test_user_matches_the_charts_run_as_user(rendered_default):
    (user,) = all_of("USER")
    uid = int(user.split(":")[0])
    for workload in rendered_default.of_kind("Deployment"):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsUser"] == uid
        assert all(c["securityContext"]["runAsUser"] == uid for c in spec["containers"])
    assert any(f"--uid {uid}" in run for run in all_of("RUN")), "the user exists in the image"


def test_exposed_ports_are_the_charts_container_ports(rendered_default):
    exposed = {int(p.split("/")[0]) for ports in all_of("EXPOSE") for p in ports.split()}
    chart_ports = {p["containerPort"] for c in COMPONENTS
                   for p in rendered_default.container(c)["ports"]}
    assert exposed == chart_ports


def test_entrypoint_is_pdserve(rendered_default):
    (entrypoint,) = all_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["pdserve"]
    for component in COMPONENTS:  # the chart passes only the sub-command and its flags
        container = rendered_default.container(component)
        assert "command" not in container and container["args"][0] == component


def test_torch_pin_matches_pyproject():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pin,) = [d for d in pyproject["project"]["dependencies"] if d.startswith("torch")]
    installs = [run for run in all_of("RUN") if re.search(r"\btorch==", run)]
    assert installs and all(pin in shlex.split(run) for run in installs), (pin, installs)
    assert any(a.startswith("TORCH_INDEX_URL=") for a in all_of("ARG")), "the GPU build arg"


def test_every_package_is_copied_and_not_ignored():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"][
        "include"]}
    copied = {shlex.split(c)[0].rstrip("/") for c in all_of("COPY")}
    assert packages <= copied, packages - copied
    assert {"pyproject.toml", "README.md"} <= {p for c in all_of("COPY") for p in shlex.split(c)}
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    for path in packages | {"pyproject.toml", "README.md"}:
        assert not any(fnmatch(path, pattern) for pattern in ignored), path


def test_model_is_baked_under_pdserve_home():
    env = " ".join(all_of("ENV"))
    assert re.search(r"\bPDSERVE_HOME=/models\b", env)
    runs = all_of("RUN")
    pull = next(i for i, run in enumerate(runs) if "pdserve model pull" in run)
    install = next(i for i, run in enumerate(runs) if "pip install ." in run)
    assert install < pull, "the CLI is installed before it pulls the model"
    (base,) = [a for a in all_of("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert re.fullmatch(r"PYTHON_IMAGE=python:3\.11-slim\S*", base)


def test_exec_probes_run_the_images_python(chart):
    """With tls.gatewayClientAuth the gateway's HTTP probes run `python -c` in the container:
    the official Python image puts `python` on PATH, and the script uses the standard library
    only."""
    rendered = render(chart, {"tls": {"enabled": True, "existingSecret": "pdserve-tls",
                                      "gatewayClientAuth": True}})
    (base,) = [a for a in all_of("ARG") if a.startswith("PYTHON_IMAGE=")]
    assert base.startswith("PYTHON_IMAGE=python:")
    assert all_of("FROM") == ["${PYTHON_IMAGE}"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = rendered.container("gateway")[kind]["exec"]["command"]
        assert command[:2] == ["python", "-c"], kind
        imported = re.match(r"import ([\w.,]+);", command[2]).group(1).split(",")
        assert set(imported) <= {"http.client", "ssl", "sys"}, imported
