"""`pdserve generate`: a gRPC client of the public API that prints the generated text (a
thinking model's reasoning, which a chat's responses carry apart, goes to stderr)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TextIO

import grpc

from protos.pdserve.v1 import generate_pb2 as pb
from protos.pdserve.v1 import generate_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParameters(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    req = pb.GenerateRequest(model=args.model, sampling=sampling)
    if args.chat:
        req.chat.messages.add(role="user", content=args.prompt)
        req.chat.chat_template_kwargs_json = args.chat_template_kwargs
    else:
        req.text = args.prompt
    return req


def _channel(args: argparse.Namespace) -> grpc.Channel:
    """Plaintext, or TLS when a CA bundle or a client certificate is given."""
    if not (args.tls_ca or args.tls_cert):
        return grpc.insecure_channel(args.gateway)

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.secure_channel(args.gateway, grpc.ssl_channel_credentials(
        read(args.tls_ca), read(args.tls_key), read(args.tls_cert)))


def run_generate(args: argparse.Namespace, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr) -> int:
    with _channel(args) as channel:
        stub = pb_grpc.GenerationStub(channel)
        texts: list[str] = []
        reasoning: list[str] = []
        final = pb.GenerateResponse()
        try:
            key = args.api_key or os.environ.get("PDSERVE_API_KEY")
            metadata = (("authorization", f"Bearer {key}"),) if key else None
            for msg in stub.Generate(build_request(args), timeout=args.timeout,
                                     metadata=metadata):
                texts.append(msg.text)
                reasoning.append(msg.reasoning)
                if args.stream:
                    err.write(msg.reasoning)
                    if msg.text and any(reasoning) and not any(texts[:-1]):
                        err.write("\n")  # the reasoning ends where the answer starts
                    err.flush()
                    out.write(msg.text)
                    out.flush()
                final = msg
        except grpc.RpcError as e:
            if args.stream:
                out.write("\n")
            print(f"pdserve: error: {e.code().name}: {e.details()}", file=err)
            return 1
    if any(reasoning) and not args.stream:
        print("".join(reasoning), file=err)
    out.write(("" if args.stream else "".join(texts)) + "\n")
    if args.timing:
        t, u = final.timing, final.usage
        print(f"finish={pb.FinishReason.Name(final.finish_reason)} "
              f"prompt_tokens={u.prompt_tokens} completion_tokens={u.completion_tokens} "
              f"ttft={t.ttft_s:.3f}s queue={t.queue_s:.3f}s prefill={t.prefill_s:.3f}s "
              f"kv_transfer={t.kv_transfer_s:.3f}s first_decode_step="
              f"{t.first_decode_step_s:.3f}s total={t.total_s:.3f}s "
              f"prefill_where={t.prefill_where or '?'}"
              + (f" ({t.prefill_reason})" if t.prefill_reason else ""), file=err)
    return 0
