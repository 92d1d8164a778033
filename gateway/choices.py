"""The n samples of a request (OpenAI `n`, a batch of prompts, gRPC `n`): one backend request
per choice, pumped into one stream of (choice index, chunk).

Choice index = prompt index * n + sample index. Sample i of a seeded request is seeded
seed + i, and runs as backend request f"{req_id}-{index}" (the request's own id when there is
one choice). The samples of a prompt share its KV through the prefix cache: sample 0 starts
alone, the others once its first chunk arrived (its prompt is prefilled and its full blocks
are cached), so their reservations take those blocks instead of prefilling them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from gateway.validation import ValidationError
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
            inputs.append(dataclasses.replace(
                inp, req_id=f"{req_id}-{len(inputs)}" if many else req_id, params=params))
    return tuple(inputs)


class ChoiceStreams:
    """The backend streams of one request's choices, each pumped by its own task into one
    queue; `close` cancels them all (which aborts them in the backend)."""

    def __init__(self, backend: Backend, inputs: Sequence[GenerateInput], n: int) -> None:
        self.queue: asyncio.Queue[tuple[int, GenerateChunk] | BaseException] = asyncio.Queue()
        self.num_choices = len(inputs)
        self.inputs = tuple(inputs)
        self.tasks: list[asyncio.Task] = []
        self.is_aborted = False  # samples not started yet end at once, finish_reason "abort"
        for first in range(0, self.num_choices, n):
            prefilled = asyncio.Event()
            self._start(backend, inputs, first, prefilled)
            if n > 1:
                self.tasks.append(asyncio.create_task(
                    self._start_rest(backend, inputs, range(first + 1, first + n), prefilled)))

    def _start(self, backend: Backend, inputs: Sequence[GenerateInput], index: int,
               prefilled: asyncio.Event | None = None) -> None:
        self.tasks.append(asyncio.create_task(self._pump(backend, inputs[index], index,
                                                         prefilled)))

    async def _start_rest(self, backend: Backend, inputs: Sequence[GenerateInput],
                          indices: range, prefilled: asyncio.Event) -> None:
        await prefilled.wait()
        for index in indices:
            if self.is_aborted:
                inp = inputs[index]
                self.queue.put_nowait((index, GenerateChunk(
                    [], "", None, "abort", len(inp.prompt_token_ids), 0)))
            else:
                self._start(backend, inputs, index)

    async def abort(self, backend: Backend) -> bool:
        """Abort every choice: those running in the backend, and those not started yet.
        True if any was running."""
        self.is_aborted = True
        found = [await backend.abort(inp.req_id) for inp in self.inputs]
        return any(found)

    async def _pump(self, backend: Backend, inp: GenerateInput, index: int,
                    prefilled: asyncio.Event | None) -> None:
        try:
            async with contextlib.aclosing(backend.generate(inp)) as chunks:
                async for chunk in chunks:
                    if prefilled is not None:
                        prefilled.set()
                    self.queue.put_nowait((index, chunk))
        except asyncio.CancelledError:
            self.queue.put_nowait(BackendUnavailable("the client disconnected"))
            raise
        except Exception as e:  # handed to the consumer
            self.queue.put_nowait(e)
        finally:
            if prefilled is not None:
                prefilled.set()  # the others start (and fail alike) if sample 0 failed

    async def chunks(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(choice index, chunk) in arrival order, until every choice's last chunk; a
        choice's error is raised here."""
        num_done = 0
        while num_done < self.num_choices:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            num_done += item[1].is_last

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()
