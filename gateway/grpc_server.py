"""The public gRPC service (pdserve.v1.Generation) on grpc.aio, over a Backend.

Translates protobuf <-> GenerateInput/GenerateChunk and errors -> status codes; nothing
deeper knows about gRPC:

    ValidationError -> INVALID_ARGUMENT (trailing metadata `pdserve-invalid-field` names it)
    DuplicateRequestError -> ALREADY_EXISTS     BackendUnavailable -> UNAVAILABLE
    DeadlineExceeded -> DEADLINE_EXCEEDED       client cancel -> the request is aborted
    Overloaded -> RESOURCE_EXHAUSTED

Requests are registered with a raw-bytes deserializer and parsed here: grpcio would otherwise
reject invalid UTF-8 in a `string` field with UNKNOWN before any handler runs; parsing
ourselves turns that into INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateway.auth import APIKeys, key_from_metadata
from gateway.openai import validation
from gateway.openai.choices import (
    DEFAULT_MAX_NUM_CHOICES,
    ChoiceStreams,
    check_num_choices,
    fan_out,
)
from gateway.openai.grpc_chat import render, split_output
from gateway.openai.reasoning import resolve_parser
from gateway.openai.validation import ValidationError
from protos.pdserve.v1 import generate_pb2 as pb
from service_infra.backend import (
    Backend,
    BackendUnavailable,
    DeadlineExceeded,
    DuplicateRequestError,
    GenerateChunk,
    GenerateInput,
    Overloaded,
)
from service_infra.proto_convert import prompt_logprobs_to_proto
from service_infra.tls import TLSConfig, add_port

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "pdserve.v1.Generation"
MAX_REQUEST_BYTES = 4 << 20  # larger requests: INVALID_ARGUMENT naming the bound
MAX_RECEIVE_BYTES = 2 * MAX_REQUEST_BYTES  # beyond this grpc refuses (RESOURCE_EXHAUSTED)
MAX_SEND_BYTES = 4 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_SEND_BYTES),
    ("grpc.so_reuseport", 0),  # a port in use is an error, not a shared listener
]
_FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
           "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}
M = TypeVar("M", bound=Message)


class GenerationServicer:
    def __init__(self, backend: Backend,
                 on_reject: Callable[[str], None] = lambda reason: None,
                 api_keys: APIKeys | None = None,
                 max_num_choices: int = DEFAULT_MAX_NUM_CHOICES,
                 reasoning_parser: str = "auto") -> None:
        self.on_reject = on_reject  # counts requests refused before the backend saw them
        self.backend = backend
        self.api_keys = api_keys or APIKeys()
        self.max_num_choices = max_num_choices  # GenerateRequest.n at most
        # chats' reasoning apart from content (gateway/openai/reasoning.py): auto, think, harmony, none
        self.reasoning_parser = reasoning_parser
        self._samples: dict[str, ChoiceStreams] = {}  # request id with n > 1 -> its samples

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self.api_keys.admits(key_from_metadata(context.invocation_metadata())):
            self.on_reject("unauthenticated")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "a valid API key is required: metadata 'authorization: Bearer "
                                "<key>' or 'x-api-key: <key>'")

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateResponse.SerializeToString),
            "Abort": grpc.unary_unary_rpc_method_handler(
                self.abort, response_serializer=pb.AbortResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, response_serializer=pb.ListModelsResponse.SerializeToString),
        })

    async def generate(self, raw: bytes,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        await self._authorize(context)
        try:
            req = parse(pb.GenerateRequest, raw)
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            is_chat = req.WhichOneof("prompt") == "chat"
            req, chat_output = await render(req, self.backend, resolve_parser(
                self.reasoning_parser, self.backend.tokenizer.chat_template))
            inp = await validation.from_proto(req, self.backend, deadline,
                                              "chat" if is_chat else None)
        except ValidationError as e:
            self.on_reject("invalid_argument")
            await _invalid(context, e)
        n = max(req.n, 1)
        try:
            check_num_choices(n, 1, self.max_num_choices)
        except ValidationError as e:
            self.on_reject("invalid_argument")
            await _invalid(context, e)
        try:
            async with contextlib.aclosing(self._responses(inp, n)) as responses:
                async for msg in split_output(responses, chat_output):
                    yield msg
        except DuplicateRequestError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(e))
        except DeadlineExceeded as e:
            await _abort_past_deadline(context, e)
        except BackendUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _responses(self, inp: GenerateInput,
                         n: int) -> AsyncIterator[pb.GenerateResponse]:
        num_top = inp.params.logprobs
        if n == 1:
            async with contextlib.aclosing(self.backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    yield to_proto(inp.req_id, chunk, num_top, inp.prompt_token_ids)
            return
        inputs = fan_out([inp], n, inp.req_id)
        streams = ChoiceStreams(self.backend, inputs, n)
        self._samples[inp.req_id] = streams
        try:
            async for index, chunk in streams.chunks():
                msg = to_proto(inp.req_id, chunk, num_top, inp.prompt_token_ids)
                msg.index = index
                yield msg
        finally:
            streams.close()
            self._samples.pop(inp.req_id, None)

    async def abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        await self._authorize(context)
        try:
            req = parse(pb.AbortRequest, raw)
        except ValidationError as e:
            await _invalid(context, e)
        samples = self._samples.get(req.request_id)
        if samples is None:
            return pb.AbortResponse(found=await self.backend.abort(req.request_id))
        await samples.abort(self.backend)
        return pb.AbortResponse(found=True)  # running: its samples end with "abort"

    async def list_models(self, raw: bytes,
                          context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        await self._authorize(context)
        m = self.backend.model
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=name, max_model_len=m.max_model_len, vocab_size=m.vocab_size)
            for name in m.served_names])


async def _abort_past_deadline(context: grpc.aio.ServicerContext, e: DeadlineExceeded) -> None:
    """DEADLINE_EXCEEDED, unless gRPC has ended the call already.

    The request's deadline is the client's: when it passes, gRPC ends the call with that
    status itself, and a status sent after it fails inside grpc (logged with a traceback,
    though the client has its answer). Which side notices first is a race.
    """
    if context.done():
        return
    try:
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
    except grpc.aio.AbortError:
        raise
    except Exception:  # the call ended between the check and the send
        if not context.done():
            raise


async def _invalid(context: grpc.aio.ServicerContext, e: ValidationError) -> None:
    context.set_trailing_metadata((("pdserve-invalid-field", e.field),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.message)


def to_proto(req_id: str, chunk: GenerateChunk, num_top: int | None,
             prompt_ids: list[int] | None = None) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=req_id, token_ids=chunk.token_ids,
                              text=chunk.text_delta, finish_reason=_FINISH[chunk.finish_reason])
    for entry in chunk.logprobs or ():
        (token_id, logprob), *_ = entry.items()  # the sampled token comes first
        top = sorted(entry.items(), key=lambda kv: -kv[1])[: num_top or 0]
        msg.logprobs.add(token_id=token_id, logprob=logprob,
                         top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top])
    if chunk.prompt_logprobs is not None and prompt_ids is not None:
        msg.prompt_logprobs.extend(prompt_logprobs_to_proto(prompt_ids, chunk.prompt_logprobs))
    if chunk.is_last:
        msg.usage.prompt_tokens = chunk.num_prompt_tokens
        msg.usage.completion_tokens = chunk.num_output_tokens
        msg.usage.cached_prompt_tokens = chunk.num_cached_tokens
        if chunk.timing is not None:
            t = chunk.timing
            msg.timing.CopyFrom(pb.Timing(
                queue_s=t.queue_s, prefill_s=t.prefill_s, kv_transfer_s=t.kv_transfer_s,
                first_decode_step_s=t.first_decode_step_s, ttft_s=t.ttft_s, total_s=t.total_s,
                prefill_where=t.prefill_where, prefill_reason=t.prefill_reason))
    return msg


# -- parsing -----------------------------------------------------------------------------------
def parse(cls: type[M], raw: bytes) -> M:
    """Parse a request, naming the field when it is not a valid message."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise ValidationError("request", f"the request must be at most {MAX_REQUEST_BYTES} "
                              f"bytes, got {len(raw)}")
    try:
        return cls.FromString(raw)
    except DecodeError:
        field = _invalid_utf8_field(raw, cls.DESCRIPTOR)
    if field is not None:
        raise ValidationError(field, f"{field} must be valid UTF-8")
    raise ValidationError("request", f"the request is not a valid {cls.DESCRIPTOR.full_name}")


def _invalid_utf8_field(raw: bytes, desc: Descriptor, path: str = "") -> str | None:
    """The path of the first string field holding invalid UTF-8 (e.g. "chat.messages[1]
    .content"), or None. Walks the wire format, since the parser only says "error"."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(raw):
            key, pos = _varint(raw, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(raw, pos)
            elif wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                size, pos = _varint(raw, pos)
                data, pos = raw[pos:pos + size], pos + size
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                name = path + field.name
                if field.is_repeated:
                    name += f"[{index}]"
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        data.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = _invalid_utf8_field(data, field.message_type, name + ".")
                    if inner is not None:
                        return inner
            else:
                return None  # groups or garbage: not a UTF-8 problem we can name
    except IndexError:
        return None
    return None


def _varint(raw: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


# -- the server ----------------------------------------------------------------------------------
def create_server(backend: Backend, address: str, health_servicer: health.aio.HealthServicer,
                  on_reject: Callable[[str], None] = lambda reason: None,
                  api_keys: APIKeys | None = None,
                  tls: TLSConfig | None = None,
                  max_num_choices: int = DEFAULT_MAX_NUM_CHOICES,
                  reasoning_parser: str = "auto",
                  reuse_port: bool = False) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server with Generation, health checking and reflection, bound to address
    (host:port; port 0 picks a free one). Returns (server, bound port); not started yet.
    reuse_port: share the port with the other API servers (gateway/api_servers.py)."""
    options = [o for o in SERVER_OPTIONS if o[0] != "grpc.so_reuseport"]
    server = grpc.aio.server(options=[*options, ("grpc.so_reuseport", int(reuse_port))])
    server.add_generic_rpc_handlers(
        (GenerationServicer(backend, on_reject, api_keys, max_num_choices,
                            reasoning_parser).handler(),))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = add_port(server, address, tls)
    return server, port
