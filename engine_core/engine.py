"""The colocated engine: one process, one KV pool, continuous batching.

    step():  schedule -> run the model -> update requests -> detokenize and emit
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from engine_core.async_step import RunAhead
from engine_core.config import dtype_name
from engine_core.decode_graphs import init_decode_graphs
from engine_core.engine_config import (
    CacheConfig,
    DeviceConfig,
    LoadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.kv_cache.layout import KVLayout
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_connector import KVConnector
from engine_core.kv_offload import KVOffloader, build_offloader
from engine_core.model_files import resolve_model
from engine_core.model_loader import load_model
from engine_core.model_runner import ModelRunner
from engine_core.output_processor import (
    RequestTextState,
    advance_text,
    make_delta,
    record_logprobs,
)
from engine_core.outputs import RequestDelta, RequestOutput, RequestOutputs, snapshot
from engine_core.platforms import device_check, select_platform
from engine_core.request import Request, RequestStatus
from engine_core.sampler import skip_draw
from engine_core.sampling_params import GREEDY_TEMPERATURE_EPS, SamplingParams
from engine_core.scheduler import Scheduler, SchedulerOutput
from engine_core.spec_decode import SpecDecoder, build_spec_decoder
from engine_core.stats import EngineStats
from engine_core.structured_output import GrammarCompiler
from engine_core.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        load_config: LoadConfig,
        device_config: DeviceConfig | None = None,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        speculative_config: SpeculativeConfig | None = None,
        *,
        kv_allocator: Callable[[KVLayout, int, torch.device], torch.Tensor] | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        """load_config: the model and how its weights are computed; device_config: where it
        runs (engine_core/engine_config.py: frozen, checked when made). speculative_config:
        speculative decoding (spec_decode.py); None decodes plainly.
        kv_allocator(layout, num_blocks, device): where the KV cache tensor lives (default: a
        plain zeroed tensor; the decode worker passes a shared-memory pool).
        kv_connector: what moves KV out while a step runs (kv_connector.py): the prefill
        worker's handoff; None moves nothing."""
        load = load_config
        device_config = device_config or DeviceConfig()
        self.kv_connector = kv_connector
        # every device- and kernel-dependent decision below is the platform's
        self.platform = select_platform(device_config.device)
        self.device = self.platform.device
        self._use_device()
        # PDSERVE_CHECK_DEVICE=1 (tests): every step's ops read only tensors on self.device
        self._device_check = (device_check.DeviceCheck(self.device)
                              if device_check.is_enabled() else None)
        self.dtype = self.platform.resolve_dtype(load.dtype)
        self.source = resolve_model(load.model)
        self.quantization = self.platform.check_quantization(load.quantization)
        quantize_decode = self.platform.quantize_decode(load.quantize_decode)
        # what the CPU's decode matmuls multiply with ("float32" or "int8"); None: dense rows
        self.decode_activations = (self.platform.resolve_activations(load.decode_activations,
                                                                     self.dtype)
                                   if quantize_decode else None)
        self.model, self.model_config, quantization = load_model(
            self.source, self.dtype, self.platform, quantize_decode,
            self.decode_activations or "float32", load.prefill_weights,
            requantize=self.quantization == "int8",
        )
        if quantization is None or not quantization.quantized:  # float weights as loaded
            self.decode_activations = None
        # what prefill_weights resolved to: "quantized" where projections have no dense copy
        self.prefill_weights = ("quantized" if any(getattr(m, "quant_only", False)
                                                   for m in self.model.modules()) else "dense")
        cfg = self.model_config
        self.tokenizer: Tokenizer | None = (
            load_tokenizer(self.source, cfg.eos_token_ids) if load.load_tokenizer else None
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else cfg.eos_token_ids
        if outside := [t for t in eos if not 0 <= t < cfg.vocab_size]:
            logger.warning("EOS token ids %s are outside the model's vocabulary of %d (the "
                           "config and tokenizer disagree with the weights): the model can "
                           "never sample them, so they are ignored", outside, cfg.vocab_size)
        self.eos_token_ids = tuple(t for t in eos if 0 <= t < cfg.vocab_size)
        cache_config = cache_config or CacheConfig()
        scheduler_config = scheduler_config or SchedulerConfig()
        self.max_model_len = min(
            scheduler_config.max_model_len or cfg.max_position_embeddings,
            cfg.max_position_embeddings,
        )
        if cfg.rope_kind == "longrope":  # its factors follow the context served
            self.model.init_rope(self.device, served_len=self.max_model_len)
        self.layout = KVLayout(
            model=self.source.name, dtype=dtype_name(self.dtype),
            block_size=cache_config.block_size, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        )
        num_blocks = cache_config.num_blocks or int(
            cache_config.kv_cache_memory_gb * 2**30
            // (self.layout.block_nbytes * cfg.num_layers)
        )
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching,
                                 cache_config.cache_decoded_blocks)
        self.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(
            scheduler_config, self.kv, self.max_model_len,
            speculative_config.num_speculative_tokens if speculative_config else 0,
        )
        self.runner = ModelRunner(self.model, self.layout, num_blocks,
                                  scheduler_config.max_num_seqs, self.max_model_len,
                                  self.platform, self.eos_token_ids, quantization,
                                  kv_allocator(self.layout, num_blocks, self.device)
                                  if kv_allocator else None)
        self.offloader: KVOffloader | None = build_offloader(
            cache_config.offload, self.platform, self.runner.kv_cache, self.layout.fingerprint(),
            self.source.path, f"dtype={self.layout.dtype};prefill={self.prefill_weights}",
            num_blocks)
        if self.offloader is not None:
            self.kv.published = []
            self.scheduler.tiers.offload = self.offloader
        self.decode_mode = init_decode_graphs(self, device_config.enforce_eager,
                                              scheduler_config.max_num_seqs)
        self.spec: SpecDecoder | None = (
            build_spec_decoder(speculative_config, self) if speculative_config else None
        )
        async_scheduling = device_config.async_scheduling
        if async_scheduling is None:
            async_scheduling = self.platform.async_scheduling
        self.async_scheduling = async_scheduling
        self._ahead = RunAhead(self) if async_scheduling else None
        self.text_states: dict[str, RequestTextState] = {}
        self._outputs = RequestOutputs()  # step()'s whole outputs (the offline API)
        self.stats = EngineStats()  # read by metrics exporters
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self._grammars_lock = threading.Lock()
        logger.info("engine ready: %s, %s, %d KV blocks of %d tokens, decode steps %s",
                    self.source.name, self.dtype, num_blocks, cache_config.block_size,
                    self.decode_mode)

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        req_id: str | None = None,
        num_prior_output_tokens: int = 0,
        fork_of: str | None = None,
    ) -> str:
        """Queue a request; `num_prior_output_tokens`: the prompt's last tokens were generated
        by an earlier attempt of it (a continuation), which the penalties count as output.
        `fork_of`: another sample of the same prompt, whose prompt KV this one shares (the
        scheduler's forks; computed once, the last partial block copied on write)."""
        req, text = self._new_request(prompt, params, req_id, num_prior_output_tokens)
        self.scheduler.add_request(req, fork_of)
        self.text_states[req.req_id] = RequestTextState(req, self.tokenizer, text)
        return req.req_id

    def _new_request(
        self, prompt: str | list[int], params: SamplingParams | None, req_id: str | None,
        num_prior_output_tokens: int = 0,
    ) -> tuple[Request, str | None]:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {ids}")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got "
                             f"{[t for t in params.stop_token_ids if t >= vocab]}")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}), got "
                             f"{[t for t, _ in params.logit_bias if t >= vocab]}")
        req_id = req_id if req_id is not None else str(next(self._ids))
        req = Request(req_id, ids, params, self.eos_token_ids, num_prior_output_tokens)
        if params.structured is not None:
            after = params.structured.after_tokens
            if any(t >= vocab for t in after):
                raise ValueError(f"structured after_tokens must be in [0, {vocab}), got "
                                 f"{list(after)}")
            # a continuation: the earlier attempt's output is already part of the grammar's text
            prior = ids[len(ids) - num_prior_output_tokens:] if num_prior_output_tokens else []
            if not req.start_grammar(self.grammar_compiler.matcher(params.structured), after,
                                     prior):
                raise ValueError("the prompt's prior output tokens do not match the grammar "
                                 f"of structured: {req.matcher.get_error()}")
        return req, text

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output grammars for this engine's tokenizer (cached; safe to
        use from other threads, as a colocated gateway does to compile ahead of the engine)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs need the engine's tokenizer")
                self._grammars = GrammarCompiler(self.tokenizer.hf,
                                                 self.model_config.vocab_size,
                                                 self.eos_token_ids)
            return self._grammars

    # -- disaggregated decode: prompt KV written by a prefill worker ------------------------
    def reserve(
        self, prompt_token_ids: list[int], params: SamplingParams, req_id: str,
        num_prior_output_tokens: int = 0,
    ) -> tuple[list[int], int] | None:
        """Reserve blocks for a request whose prompt KV a prefill worker will write. Returns
        (all its block ids, number of prompt tokens already cached here) or None if full.
        `num_prior_output_tokens` as in `add_request`."""
        # the prompt's logprobs come from the prefill worker, never from the decode side
        params = dataclasses.replace(params, prompt_logprobs=None)
        req, _ = self._new_request(list(prompt_token_ids), params, req_id,
                                   num_prior_output_tokens)
        blocks = self.scheduler.reserve(req)
        if blocks is None:
            return None
        self.text_states[req_id] = RequestTextState(req, self.tokenizer, None)
        return list(blocks), req.num_cached_tokens

    def admit_prefilled(
        self, req_id: str, first_token: int, first_logprobs: dict[int, float] | None = None
    ) -> RequestDelta:
        """The reserved request's KV is verified: it joins the batch with its first token
        (sampled by the prefill worker), which this returns as the request's first output."""
        req = self.scheduler.reserved[req_id]
        p = req.sampling_params
        if req.generator is not None and p.temperature >= GREEDY_TEMPERATURE_EPS:
            # the prefill worker drew the first token from this seed's first state: draw the
            # same amount here, so the rest matches a colocated run of the same seed
            skip_draw(req.generator)
        if first_logprobs is not None:
            req.output_logprobs.append(first_logprobs)
        now = time.monotonic()
        req.times.first_scheduled = req.times.first_scheduled or now
        self.scheduler.admit_prefilled(req_id, first_token)
        return self.emit([req], now)[0]

    def prefill_reserved(self, req_id: str, max_chunk_tokens: int) -> None:
        """Compute the reserved request's prompt in this engine (a decode worker's local
        prefill), chunked by max_chunk_tokens per step beside the running decodes; its first
        output is the first token, sampled here. Its times count from now."""
        req = self.scheduler.prefill_reserved(req_id, max_chunk_tokens)
        req.times.arrival = time.monotonic()

    def abort_request(self, req_ids: str | list[str]) -> None:
        ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        for req_id in ids:
            self.text_states.pop(req_id, None)
            self._outputs.discard(req_id)

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has anything to do: requests, or blocks published for the offload
        tiers whose stores hold them pinned until a step releases them."""
        if self.scheduler.has_unfinished():
            return True
        off = self.offloader
        return off is not None and bool(off.num_pinned or off.has_backlog or self.kv.published)

    def has_work(self) -> bool:
        """Whether `step` would compute anything (reserved requests wait for their KV)."""
        return self.scheduler.has_work()

    # -- the step ---------------------------------------------------------------------------
    def _use_device(self) -> None:
        """Make the engine's CUDA device current on this thread: streams, events and Triton
        launches without a device of their own take the current one, which is per thread
        (0 unless set), and steps may run on another thread than the one that built us."""
        self.platform.use_device()

    def step(self) -> list[RequestOutput]:
        """One step; each request that advanced as its whole output so far (vLLM's shape).
        Servers stream `step_deltas` instead, which costs nothing per earlier token."""
        return [snapshot(self._outputs.add(d, d.req.prompt_token_ids))
                for d in self.step_deltas()]

    def step_deltas(self) -> list[RequestDelta]:
        """One step: schedule, run the model, update the requests; each request that gained
        tokens or ended gives its RequestDelta. With async scheduling (async_step.py) the
        deltas are the step before's, read once this one is launched."""
        self._use_device()
        if self.offloader is not None:
            self._offload_tick()
        if self._ahead is not None:
            deltas = self._ahead.step()
            if deltas is not None:
                return deltas
            return self._ahead.flush() + self._step()  # a step that cannot run ahead
        return self._step()

    def _offload_tick(self) -> None:
        """Between steps: unpin the blocks whose stores are done, requeue the requests whose
        loads are done, queue the blocks published since for storing. When nothing but loads
        is left, wait for one (briefly) rather than spin."""
        off, sched = self.offloader, self.scheduler
        if (sched.loading or off.num_pinned) and not sched.has_work():
            off.wait(0.05)  # nothing else to run: wait for a load or a store
        loaded, stored = off.poll()
        if stored:
            self.kv.unpin(stored)
        for req_id, num_loaded in loaded:
            sched.finish_load(req_id, num_loaded)
        published = self.kv.take_published()
        if published or off.has_backlog:
            off.store(published, self.kv.pin, self.kv.is_cached)

    def flush_offload(self, wait: bool = False) -> None:
        """Queue the blocks the last steps published for the offload tiers (the next step
        would); wait: until every queued store is done."""
        if self.offloader is not None:
            self._offload_tick()
            if wait:
                self.offloader.drain()
                self._offload_tick()  # unpin them

    def close(self) -> None:
        """Let queued KV stores finish (a restart on the same offload directory finds them)
        and stop the offload threads; the engine serves nothing after."""
        if self.offloader is not None:
            self.flush_offload(wait=True)
            self.offloader.close()

    def prepare(self, out: SchedulerOutput) -> np.ndarray:
        """The step's copies on write, then its rows brought up to date (async_step.py)."""
        block_ids = [self.kv.block_ids(r.req_id) for r in out.reqs]
        if out.blocks_to_copy:
            self.runner.copy_blocks(out.blocks_to_copy)
        return self.runner.sync(out, block_ids)

    def forget_rows(self, out: SchedulerOutput) -> None:
        """A step that runs nothing: the runner hears of finished requests only with a
        step, so tell it now."""
        assert not out.blocks_to_copy, "copies queued for a step that runs nothing"
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            self.runner.batch.remove(req_id)

    def is_live(self, req: Request, epoch: tuple[int, int]) -> bool:
        """Still the running request a launched step computed for (async_step.py)."""
        return req.status == RequestStatus.RUNNING and (id(req), req.num_preemptions) == epoch

    def _step(self) -> list[RequestDelta]:
        t_start = time.monotonic()
        out = self.scheduler.schedule()
        if out.is_empty:
            self.forget_rows(out)
            return []
        now = time.monotonic()
        for req in out.reqs:
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
        block_ids = [self.kv.block_ids(r.req_id) for r in out.reqs]
        kv_step = self.kv_connector.build_step(out, block_ids) if self.kv_connector else None
        save_layer = kv_step.save_layer if kv_step is not None else None
        check = self._device_check
        if check is not None and save_layer is not None:
            save_layer = check.exempt(save_layer)  # it stages KV off the device on purpose
        try:
            with check if check is not None else contextlib.nullcontext():
                if out.blocks_to_copy:  # copy-on-write, before the forward writes anything
                    self.runner.copy_blocks(out.blocks_to_copy)
                    if self.spec is not None:
                        self.spec.copy_blocks(out.blocks_to_copy)
                rows = self.runner.sync(out, block_ids)
                if self.spec is not None:
                    self.spec.propose(out, rows, self.runner)
                sampled, sampler_out = self.runner.execute(
                    out, rows, self.spec.verify if self.spec is not None else None, save_layer)
            if sampler_out is not None and sampler_out[1].sampled_logprobs is not None:
                record_logprobs(out, *sampler_out)
            advanced = self.scheduler.update_from_output(out, sampled)
            self.stats.add_step(out.total_num_tokens,
                                sum(out.num_scheduled_tokens[out.num_decodes:]),
                                sum(map(len, sampled)), time.monotonic() - t_start)
            return self.emit(advanced, time.monotonic())
        finally:  # after the step's outputs exist, as the connector's callers expect
            if kv_step is not None:
                kv_step.finish()

    def emit(self, advanced: list[Request], now: float) -> list[RequestDelta]:
        """Detokenize the requests' new tokens, apply stop strings, build their deltas."""
        deltas = []
        states = self.text_states
        for req in advanced:
            if req.times.first_token is None:
                req.times.first_token = now
            state = states[req.req_id]
            if advance_text(req, state):
                self.scheduler.finish_requests([req.req_id], RequestStatus.FINISHED_STOPPED)
            finished = req.is_finished
            if finished:
                req.times.finished = now
                del states[req.req_id]
            deltas.append(make_delta(req, state, finished))
        return deltas
