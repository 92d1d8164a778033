"""API keys at the gateway: a real `pdserve gateway --colocated` with keys from a flag, a file
and the environment. The public APIs refuse calls without a valid key (gRPC UNAUTHENTICATED,
HTTP 401 in OpenAI's error shape, counted in requests_rejected); health and metrics stay open;
`pdserve generate --api-key` and the official openai client get through with one."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import httpx2 as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.auth import APIKeys, bearer_token, key_from_metadata
from protos.pdserve.v1 import generate_pb2 as pb
from tests.gateway.conftest import spawn_gateway, stop_gateway, wait_ready

FLAG_KEY, FILE_KEY, ENV_KEY = "flag-key-1", "file-key-2", "env-key-3"


def test_api_keys_parsing(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"{FILE_KEY}\n\n")
    keys = APIKeys.from_sources([FLAG_KEY], str(keys_file), {"PDSERVE_API_KEYS": f" {ENV_KEY},"})
    assert keys.is_enabled
    assert all(keys.admits(k) for k in (FLAG_KEY, FILE_KEY, ENV_KEY))
    assert not any(keys.admits(k) for k in (None, "", "flag-key", FLAG_KEY + "x"))
    assert APIKeys().admits(None) and not APIKeys([" ", ""]).is_enabled  # no keys: open
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token(None) is None
    assert key_from_metadata([("x-api-key", "k ")]) == "k"
    assert key_from_metadata([("authorization", "Bearer k")]) == "k"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys_file.write_text(FILE_KEY + "\n")
    env = {"PDSERVE_API_KEYS": ENV_KEY}
    os.environ.update(env)  # spawn_pdserve passes this process's environment on
    try:
        proc, log = spawn_gateway("--api-key", FLAG_KEY, "--api-key-file", str(keys_file))
    finally:
        del os.environ["PDSERVE_API_KEYS"]
    gw = wait_ready(proc, log)
    yield gw
    assert stop_gateway(gw) == 0, gw.log.read_text()[-4000:]
    gw.log.unlink(missing_ok=True)


def _generate(gw, metadata):
    with gw.channel() as channel:
        req = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParameters(max_tokens=2))
        return list(gw.stub(channel).Generate(req, timeout=60, metadata=metadata))


@pytest.mark.parametrize("metadata", [None, (("authorization", "Bearer wrong"),),
                                      (("authorization", FLAG_KEY),),  # no "Bearer"
                                      (("x-api-key", "wrong"),)],
                         ids=["none", "wrong", "no-scheme", "wrong-x-api-key"])
def test_grpc_refuses_without_a_valid_key(keyed, metadata):
    with pytest.raises(grpc.RpcError) as info:
        _generate(keyed, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in info.value.details()


@pytest.mark.parametrize("metadata", [(("authorization", f"Bearer {FLAG_KEY}"),),
                                      (("x-api-key", FILE_KEY),),
                                      (("authorization", f"Bearer {ENV_KEY}"),)],
                         ids=["flag", "file", "env"])
def test_grpc_admits_each_key(keyed, metadata):
    msgs = _generate(keyed, metadata)
    assert msgs[-1].usage.completion_tokens == 2


def test_grpc_list_models_gated_health_open(keyed):
    with keyed.channel() as channel:
        with pytest.raises(grpc.RpcError) as info:
            keyed.stub(channel).ListModels(pb.ListModelsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_http_refuses_without_key_and_admits_with_one(keyed):
    with pytest.raises(openai.AuthenticationError) as info:
        openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key="wrong").completions.create(
            model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401 and "API key" in str(info.value)
    r = httpx.get(f"{keyed.http_url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{keyed.http_url}/v1", api_key=FILE_KEY)
    done = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert done.usage.completion_tokens == 2
    assert httpx.get(f"{keyed.http_url}/health", timeout=10).status_code == 200
    for path, body in (("tokenize", {"prompt": "Hi"}), ("detokenize", {"tokens": [1]})):
        assert httpx.post(f"{keyed.http_url}/{path}", json=body, timeout=10).status_code == 401
        assert httpx.post(f"{keyed.http_url}/{path}", json=body, timeout=10, headers={
            "authorization": f"Bearer {FILE_KEY}"}).status_code == 200
    metrics = httpx.get(f"{keyed.http_url}/metrics", timeout=10)
    assert metrics.status_code == 200
    line = next(ln for ln in metrics.text.splitlines()
                if ln.startswith('pdserve:requests_rejected_total{')
                and 'reason="unauthenticated"' in ln)
    assert float(line.split()[-1]) >= 2


def test_generate_cli_sends_the_key(keyed):
    base = [sys.executable, "-m", "pdserve", "generate", "--gateway", keyed.grpc_addr,
            "--max-tokens", "2", "Hi"]
    ok = subprocess.run([*base, "--api-key", FLAG_KEY], capture_output=True, text=True,
                        timeout=60)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60,
                             env={k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"})
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr + refused.stdout
