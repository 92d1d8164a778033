"""The Responses API's stream (gateway/openai/responses_api.py): OpenAI's typed server-sent events,
numbered by sequence_number, as the chat output is split (gateway/openai/chat_output.py).

    response.created, response.in_progress
    for each output item, in the order generated (reasoning, message, function calls):
        response.output_item.added
        response.content_part.added          (a reasoning item's or a message's one part)
        response.reasoning_text.delta / response.output_text.delta (with the logprobs of
        the tokens since the last one, where asked for) /
        response.function_call_arguments.delta ...
        their .done, response.content_part.done, response.output_item.done
    response.completed, or response.incomplete (cut by max_output_tokens)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from gateway.openai.chat_output import ChatStream
from gateway.openai.responses_api import (
    ReasoningTokens,
    ResponsesRequest,
    call_item,
    message_item,
    new_id,
    reasoning_item,
    response_json,
    text_part,
)
from service_infra.backend import GenerateChunk


class _Events:
    """The stream's events, numbered, with the output items they open and close."""

    def __init__(self, rr: ResponsesRequest,
                 event: Callable[[str, dict[str, Any]], bytes]) -> None:
        self.rr, self._event, self.seq = rr, event, 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being generated
        self.kind = ""  # its kind: "reasoning", "message" or a call's index as text
        self.pending: list[dict[str, Any]] = []  # logprobs not sent with a text delta yet

    def emit(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return self._event(kind, {"type": kind, "sequence_number": self.seq - 1, **fields})

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def start(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.open, self.kind = item, kind
        out.append(self.emit("response.output_item.added", output_index=len(self.output),
                             item=item))
        if item["type"] == "message":
            item["content"].append(text_part(""))
            out.append(self.emit("response.content_part.added", **self._where(),
                                 content_index=0, part=text_part("")))
        elif item["type"] == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
            out.append(self.emit("response.content_part.added", **self._where(),
                                 content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def delta(self, delta: str) -> bytes:
        item = self.open
        if item["type"] == "function_call":
            item["arguments"] += delta
            return self.emit("response.function_call_arguments.delta", **self._where(),
                             delta=delta)
        item["content"][0]["text"] += delta
        if item["type"] == "message":
            logprobs, self.pending = self.pending, []
            item["content"][0]["logprobs"] += logprobs
            return self.emit("response.output_text.delta", **self._where(), content_index=0,
                             delta=delta, logprobs=logprobs)
        return self.emit("response.reasoning_text.delta", **self._where(), content_index=0,
                         delta=delta)

    def hold_logprobs(self, logprobs: list[dict[str, Any]]) -> None:
        """The end: logprobs no text delta carried join the message's part, if there is one
        (the response's output then holds every token's, as a whole response does)."""
        messages = [i for i in [*self.output, self.open] if i and i["type"] == "message"]
        if messages:
            messages[-1]["content"][0]["logprobs"] += logprobs

    def close(self) -> list[bytes]:
        item, out = self.open, []
        if item is None:
            return out
        if item["type"] == "function_call":
            out.append(self.emit("response.function_call_arguments.done", **self._where(),
                                 name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" \
                else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            out.append(self.emit(done, **self._where(), content_index=0, text=part["text"],
                                 **extra))
            out.append(self.emit("response.content_part.done", **self._where(),
                                 content_index=0, part=part))
        item["status"] = "completed"
        out.append(self.emit("response.output_item.done", output_index=len(self.output),
                             item=item))
        self.output.append(item)
        self.open, self.kind = None, ""
        return out


async def events(rr: ResponsesRequest, first: tuple[int, GenerateChunk],
                 chunks: AsyncIterator[tuple[int, GenerateChunk]],
                 event: Callable[[str, dict[str, Any]], bytes]) -> AsyncIterator[bytes]:
    """The stream: response.created and .in_progress, each output item's added, deltas and
    done events as the text is generated, then response.completed (or .incomplete)."""
    ev = _Events(rr, event)
    yield ev.emit("response.created", response=response_json(rr, [], None))
    yield ev.emit("response.in_progress", response=response_json(rr, [], None))
    stream = ChatStream(rr.chat.reasoning, rr.chat.reasoning_open, rr.chat.tool_choice)
    reasoning_tokens = ReasoningTokens()
    item: tuple[int, GenerateChunk] | None = first
    last = None
    while item is not None:
        _, chunk = item
        if rr.logprobs is not None:
            ev.pending += rr.logprobs(chunk.logprobs or [])
        reasoning, content, calls = stream.feed(chunk.text_delta)
        if chunk.is_last:
            more, rest, last_calls = stream.finish()
            reasoning, content, calls = reasoning + more, content + rest, calls + last_calls
            last = chunk
        reasoning_tokens.feed(chunk, reasoning, content, calls)
        for out in _pieces(ev, reasoning, content, calls):
            yield out
        item = await anext(chunks, None)
    if not ev.output and ev.open is None:  # nothing generated: an empty message
        for out in ev.start("message", message_item(new_id("msg_"), None, "in_progress")):
            yield out
    ev.hold_logprobs(ev.pending)
    for out in ev.close():
        yield out
    done = "response.incomplete" if last is not None and last.finish_reason == "length" \
        else "response.completed"
    yield ev.emit(done, response=response_json(rr, ev.output, last, reasoning_tokens.count))


def _pieces(ev: _Events, reasoning: str, content: str,
            calls: list[dict[str, Any]]) -> list[bytes]:
    """The events of one chunk's reasoning, content and tool call deltas, in that order."""
    out = []
    if reasoning:
        if ev.kind != "reasoning":
            out += ev.start("reasoning", reasoning_item(new_id("rs_"), None, "in_progress"))
        out.append(ev.delta(reasoning))
    if content:
        if ev.kind != "message":
            out += ev.start("message", message_item(new_id("msg_"), None, "in_progress"))
        out.append(ev.delta(content))
    for call in calls:
        kind = f"call {call['index']}"
        if ev.kind != kind:  # a call's first piece: its id and name
            out += ev.start(kind, call_item(new_id("fc_"), call["id"], call["function"]["name"],
                                             "", "in_progress"))
        if call["function"]["arguments"]:
            out.append(ev.delta(call["function"]["arguments"]))
    return out
