"""The gRPC client against a fake Generation service that streams several tokens per message
(what speculative decoding does), and its error path."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.bench.client import GrpcClient, HttpClient, Sampling
from pdserve.bench.workloads import BenchRequest
from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc

GAP_S = 0.05


class FakeGeneration(pb_grpc.GenerationServicer):
    """One token, then three at once, then two at once, then the final message."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []

    async def Generate(self, request, context):
        self.requests.append(request)
        if request.sampling.max_tokens == 99:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens too large")
        for ids in ([7], [8, 9, 10], [11, 12]):
            yield pb.GenerateResponse(token_ids=ids, text=f"<{len(ids)}>")
            await asyncio.sleep(GAP_S)
        yield pb.GenerateResponse(usage=pb.Usage(prompt_tokens=3, completion_tokens=6),
                                  finish_reason=pb.FINISH_REASON_LENGTH,
                                  timing=pb.Timing(queue_s=0.5, prefill_s=0.25,
                                                   prefill_where="local"))

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="fake", max_model_len=64)])


async def with_server(body, sampling: Sampling | None = None):
    servicer = FakeGeneration()
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = GrpcClient(f"127.0.0.1:{port}", sampling or Sampling())
    try:
        return await body(client), servicer
    finally:
        await client.close()
        await server.stop(0)


def test_multi_token_messages_give_one_itl_per_token():
    async def body(client):
        assert await client.model_id() == "fake"
        return await client.send(BenchRequest(output_len=6, input_len=0,
                                              prompt_ids=(1, 2, 3)))

    r, servicer = asyncio.run(with_server(body))
    assert r.is_success and (r.input_len, r.output_len) == (3, 6)
    # 3 tokens a gap after the first: 3 entries of gap / 3; then 2 entries of gap / 2
    assert len(r.itl) == 5
    assert r.itl[0] == pytest.approx(r.itl[2]) and r.itl[3] == pytest.approx(r.itl[4])
    assert sum(r.itl[:3]) == pytest.approx(GAP_S, abs=0.03)
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert r.text == "<1><3><2>"  # the answer, for a chat's next turn
    assert r.timing == {"queue_s": 0.5, "prefill_s": 0.25, "prefill_where": "local"}
    sent = servicer.requests[0]
    assert list(sent.token_ids.ids) == [1, 2, 3]  # ids alone: no text to chat with
    assert sent.sampling.ignore_eos and sent.sampling.temperature == 0.0


def test_plain_prompts_go_out_as_chat_by_default_with_the_servers_sampling():
    req = BenchRequest(output_len=6, input_len=3, prompt_ids=(1, 2, 3), prompt_text="Hi there")

    async def body(client):
        return await client.send(req)

    _, servicer = asyncio.run(with_server(body, Sampling(None)))
    sent = servicer.requests[0]
    assert [(m.role, m.content) for m in sent.chat.messages] == [("user", "Hi there")]
    assert not sent.sampling.HasField("temperature")  # left out: the server's 1.0

    async def http_body(api):
        client = HttpClient("http://unused", Sampling(None, repetition_penalty=1.1), api)
        client._model = "m"
        try:
            return await client._body(req)
        finally:
            await client.http.aclose()

    path, chat = asyncio.run(http_body("chat"))
    assert path == "/v1/chat/completions" and "temperature" not in chat
    assert chat["messages"] == [{"role": "user", "content": "Hi there"}]
    assert (chat["max_completion_tokens"], chat["repetition_penalty"]) == (6, 1.1)
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    path, plain = asyncio.run(http_body("completions"))
    assert (path, plain["prompt"], plain["max_tokens"]) == ("/v1/completions", "Hi there", 6)


def test_an_rpc_error_is_a_failed_result():
    async def body(client):
        return await client.send(BenchRequest(output_len=99, input_len=0, messages=(
            ("user", "hi"),)))

    r, servicer = asyncio.run(with_server(body))
    assert not r.is_success and not r.is_incomplete
    assert r.error == "INVALID_ARGUMENT: max_tokens too large"
    assert servicer.requests[0].chat.messages[0].content == "hi"


def test_sampling_flags_reach_the_request_and_unset_ones_stay_out():
    async def body(client):
        return await client.send(BenchRequest(output_len=6, input_len=0, prompt_ids=(1,)))

    _, servicer = asyncio.run(with_server(body, Sampling(0.7, top_p=0.95, top_k=50)))
    sent = servicer.requests[0].sampling
    assert (sent.temperature, sent.top_p, sent.top_k) == (pytest.approx(0.7), 0.95, 50)
    _, servicer = asyncio.run(with_server(body, Sampling(1.0)))
    assert not servicer.requests[0].sampling.HasField("top_p")

    async def http_body(sampling):
        client = HttpClient("http://unused", sampling)
        client._model = "m"
        try:
            return (await client._body(BenchRequest(output_len=4, input_len=0,
                                                    prompt_ids=(1,))))[1]
        finally:
            await client.http.aclose()

    body_ = asyncio.run(http_body(Sampling(1.0, top_p=0.95)))
    assert (body_["temperature"], body_["top_p"]) == (1.0, 0.95) and "top_k" not in body_
