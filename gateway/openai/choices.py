"""The n samples of a request (OpenAI `n`, a batch of prompts, gRPC `n`): one backend request
per choice, pumped into one stream of (choice index, chunk) (a single choice, the common
case, is iterated directly: no task or queue per chunk).

Choice index = prompt index * n + sample index. Sample i of a seeded request is seeded
seed + i, and runs as backend request f"{req_id}-{index}" (the request's own id when there is
one choice). The samples of a prompt share its KV: every sample starts at once, sample 0
(the parent) first, the others as forks of it (`GenerateInput.fork_of`): the backend
prefills the prompt once and the children take its blocks (engine_core/scheduler.py; in
disaggregated mode on the parent's decode worker, gateway/disagg/forks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from gateway.openai.validation import ValidationError
from service_infra.backend import Backend, BackendUnavailable, GenerateChunk, GenerateInput

DEFAULT_MAX_NUM_CHOICES = 64  # n x prompts per request; `pdserve gateway --max-num-choices`


def check_num_choices(n: int, num_prompts: int, max_num_choices: int, field: str = "n") -> None:
    if n * num_prompts > max_num_choices:
        raise ValidationError(field, f"{field} x prompts must be <= max_num_choices "
                              f"({max_num_choices}), got {n} x {num_prompts} = "
                              f"{n * num_prompts}")


def fan_out(prompts: Sequence[GenerateInput], n: int, req_id: str) -> tuple[GenerateInput, ...]:
    """One input per choice, by choice index, from one input per prompt."""
    many = n * len(prompts) > 1
    inputs: list[GenerateInput] = []
    for inp in prompts:
        for sample in range(n):
            params = inp.params
            if params.seed is not None and sample:
                params = dataclasses.replace(params, seed=params.seed + sample)
            parent = inputs[-sample].req_id if sample else None
            inputs.append(dataclasses.replace(
                inp, req_id=f"{req_id}-{len(inputs)}" if many else req_id, params=params,
                fork_of=parent))
    return tuple(inputs)


class ChoiceStreams:
    """The backend streams of one request's choices, each pumped by its own task into one
    queue; `close` cancels them all (which aborts them in the backend)."""

    def __init__(self, backend: Backend, inputs: Sequence[GenerateInput], n: int) -> None:
        """Starts every choice now, in index order: each parent's backend call begins before
        its forks' (tasks run in creation order), so the backend knows it when they come."""
        self.queue: asyncio.Queue[tuple[int, GenerateChunk] | BaseException] = asyncio.Queue()
        self.num_choices = len(inputs)
        self.inputs = tuple(inputs)
        # one choice (most requests): its consumer iterates the backend itself, no task
        # between (cancelling the consumer ends the request)
        self._single = backend.generate(inputs[0]) if len(inputs) == 1 else None
        self.tasks = [] if self._single is not None else [
            asyncio.create_task(self._pump(backend, inp, index))
            for index, inp in enumerate(inputs)]

    async def abort(self, backend: Backend) -> bool:
        """Abort every choice. True if any was running."""
        found = [await backend.abort(inp.req_id) for inp in self.inputs]
        return any(found)

    async def _pump(self, backend: Backend, inp: GenerateInput, index: int) -> None:
        try:
            async with contextlib.aclosing(backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    self.queue.put_nowait((index, chunk))
        except asyncio.CancelledError:
            self.queue.put_nowait(BackendUnavailable("the client disconnected"))
            raise
        except Exception as e:  # handed to the consumer
            self.queue.put_nowait(e)

    async def chunks(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) in arrival order, until every choice's last chunk; a
        choice's error is raised here."""
        if self._single is not None:
            async with contextlib.aclosing(self._single) as chunks:
                async for chunk in chunks:
                    yield 0, chunk
            return
        num_done = 0
        while num_done < self.num_choices:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            num_done += item[1].is_last

    def close(self) -> None:
        """End every choice still running (one choice: its consumer closes it, by leaving
        `chunks` or being cancelled)."""
        for task in self.tasks:
            task.cancel()
