"""Conversions between proto messages (protos/pdserve/v1) and engine types, shared by every
hop: sampling parameters, finish reasons and logprobs. Here, not in protos/, so that the
generated stubs stay a leaf that imports nothing of ours."""

from __future__ import annotations

import json
from typing import Any

from engine_core.sampling_params import SamplingParams
from engine_core.structured_output import StructuredOutput
from protos.pdserve.v1 import generate_pb2 as pb

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {v: k for k, v in FINISH_REASONS.items()}


def sampling_to_proto(p: SamplingParams) -> pb.SamplingParameters:
    msg = pb.SamplingParameters(
        max_tokens=p.max_tokens, min_tokens=p.min_tokens, temperature=p.temperature,
        top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, repetition_penalty=p.repetition_penalty,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens, logit_bias=dict(p.logit_bias),
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(p.structured))
    return msg


def structured_to_proto(so: StructuredOutput) -> pb.StructuredOutput:
    after = {"after_tokens": so.after_tokens}
    if so.kind == "json":
        return pb.StructuredOutput(json_schema=so.spec, **after)
    if so.kind == "json_object":
        return pb.StructuredOutput(json_object=True, **after)
    if so.kind == "choice":
        return pb.StructuredOutput(choice=pb.Choices(values=json.loads(so.spec)), **after)
    return pb.StructuredOutput(**{so.kind: so.spec}, **after)


def structured_from_proto(m: pb.StructuredOutput) -> StructuredOutput | None:
    """None when no constraint is set (json_object: false is none either)."""
    kind = m.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not m.json_object):
        return None
    after = tuple(m.after_tokens)
    if kind == "json_schema":
        return StructuredOutput("json", m.json_schema, after)
    if kind == "json_object":
        return StructuredOutput("json_object", after_tokens=after)
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(list(m.choice.values)), after)
    return StructuredOutput(kind, getattr(m, kind), after)


def sampling_kwargs_from_proto(m: pb.SamplingParameters,
                               max_tokens_default: int | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments of a SamplingParameters message: the one conversion
    of the proto's sampling parameters, for the workers and the gateway. An `optional` field
    left unset is left out, so it takes SamplingParams's default; max_tokens takes
    `max_tokens_default` where one is given (the gateway's). ValueError naming the problem
    for a structured constraint that cannot be read; bounds are SamplingParams's to check."""
    kwargs: dict[str, Any] = dict(
        min_tokens=m.min_tokens, top_k=m.top_k, min_p=m.min_p,
        presence_penalty=m.presence_penalty, frequency_penalty=m.frequency_penalty,
        stop=tuple(m.stop), stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos,
        logit_bias=dict(m.logit_bias), structured=structured_from_proto(m.structured),
    )
    if max_tokens_default is not None:
        kwargs["max_tokens"] = max_tokens_default
    for name in ("max_tokens", "temperature", "top_p", "repetition_penalty", "seed",
                 "logprobs", "skip_special_tokens", "prompt_logprobs"):
        if m.HasField(name):
            kwargs[name] = getattr(m, name)
    return kwargs


def sampling_from_proto(m: pb.SamplingParameters) -> SamplingParams:
    """The engine's parameters; fields left unset take the engine defaults. Raises ValueError
    naming the field for values out of bounds."""
    return SamplingParams(**sampling_kwargs_from_proto(m))


def logprob_to_proto(token_id: int, entry: dict[int, float]) -> pb.TokenLogprob:
    """entry: {token id: logprob}, the sampled token's first is not required; top entries are
    the others, most likely first."""
    top = sorted(((t, lp) for t, lp in entry.items()), key=lambda x: -x[1])
    return pb.TokenLogprob(
        token_id=token_id, logprob=entry.get(token_id, 0.0),
        top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def prompt_logprobs_to_proto(prompt_ids: list[int],
                             entries: list[dict[int, float] | None]) -> list[pb.TokenLogprob]:
    """Entries 1.. of a prompt's logprobs (entry 0, the first token's, is None)."""
    return [logprob_to_proto(t, e) for t, e in zip(prompt_ids[1:], entries[1:], strict=True)
            if e is not None]


def prompt_logprobs_from_proto(msgs) -> list[dict[int, float] | None]:
    return [None, *(logprob_from_proto(m) for m in msgs)]


def logprob_from_proto(m: pb.TokenLogprob) -> dict[int, float]:
    entry = {m.token_id: m.logprob}
    entry.update((t.token_id, t.logprob) for t in m.top)
    return entry
