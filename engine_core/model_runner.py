"""Turns a SchedulerOutput into tensors, runs the model and samples.

Per-request state the GPU-side needs lives in persistent numpy arrays indexed by a row per
running request (`InputBatch`), so building a step's inputs is a handful of vectorized index
operations, not a Python loop that assembles tensors sequence by sequence.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.input_batch import InputBatch
from engine_core.kv_cache.layout import KVLayout, copy_kv_blocks
from engine_core.model.attention import AttentionMetadata
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.forward_context import ForwardContext, use
from engine_core.platforms import Platform
from engine_core.platforms.cpu.decode_quant import DecodeQuantization
from engine_core.prompt_logprobs import record_prompt_logprobs
from engine_core.request import Request
from engine_core.sampler import Sampler, SamplerOutput
from engine_core.scheduler import SchedulerOutput
from engine_core.step_inputs import StepUploader
from engine_core.structured_output import MaskTimer
from engine_core.thread_governor import ThreadGovernor

if TYPE_CHECKING:
    from engine_core.decode_graphs import DecodeGraphRunner



@dataclass
class StepHandle:
    """A launched step (async scheduling): its schedule, the indices of the requests it
    samples for and their rows, and the sampler's output, still on the device."""

    out: SchedulerOutput
    plain: list[int]
    plain_rows: np.ndarray
    result: SamplerOutput | None
    epochs: list[tuple[int, int]] = field(default_factory=list)  # engine_core/async_step.py
    t_launch: float = 0.0


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, layout: KVLayout, num_blocks: int,
                 max_num_seqs: int, max_model_len: int, platform: Platform,
                 eos_token_ids: tuple[int, ...],
                 quantization: DecodeQuantization | None = None,
                 kv_cache: torch.Tensor | None = None) -> None:
        self.model = model
        self.layout = layout
        self.platform = platform
        self.device = device = platform.device
        self.block_size = layout.block_size
        if kv_cache is not None and tuple(kv_cache.shape) != layout.cache_shape(num_blocks):
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected "
                             f"{layout.cache_shape(num_blocks)}")
        self.kv_cache = kv_cache if kv_cache is not None else layout.allocate(num_blocks, device)
        self.uploader = StepUploader(device, staged=platform.pin_memory)
        # a few spare rows: finished requests release theirs only at the next step
        self.vocab_size = model.config.vocab_size
        self.batch = InputBatch(2 * max_num_seqs + 8, max_model_len, layout.block_size,
                                self.vocab_size, eos_token_ids)
        self.sampler = Sampler(platform.sampling, staged=platform.pin_memory)
        self.eos_token_ids = eos_token_ids
        # decode rows run quantized matmuls (CPU): the count goes in each step's ForwardContext
        self.quantization = quantization
        # structured outputs: the grammar masks of a step are built on this thread while the
        # forward runs (llguidance drops the GIL), and timed
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.mask_timer = MaskTimer()
        # eligible decode steps run over static, padded buffers (decode_graphs.py: CUDA
        # graphs); None: every step runs eagerly
        self.graphs: DecodeGraphRunner | None = None
        # decode-only CPU steps run on 1 or all of torch's threads, whichever measures faster
        # now (a core taken by another process stalls every OpenMP barrier); steps with
        # prefill rows keep all of them (torch's matmuls, whose bits may depend on the count)
        # (only over the C decode kernels, whose results do not depend on the count)
        self.threads = ThreadGovernor(platform.decode_threads(quantization is not None))

    def sync(self, out: SchedulerOutput, block_ids: list[list[int]]) -> np.ndarray:
        """Bring the rows of the step's requests up to date (tokens not sampled here, new
        blocks); returns each request's row. Vectorized: only the rows that differ from
        their request are touched one by one."""
        b = self.batch
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            b.remove(req_id)
        reqs, n = out.reqs, len(out.reqs)
        row_of = b.row_of
        rows = np.fromiter((row_of.get(r.req_id, -1) for r in reqs), np.int64, n)
        for i in np.flatnonzero(rows < 0).tolist():  # new or recomputed: a fresh row
            rows[i] = b.row(reqs[i])
        num_tokens = np.fromiter((len(r.all_token_ids) for r in reqs), np.int32, n)
        for i in np.flatnonzero(b.num_tokens[rows] != num_tokens).tolist():
            b.append(int(rows[i]), reqs[i])
        num_blocks = np.fromiter(map(len, block_ids), np.int32, n)
        for i in np.flatnonzero(b.num_blocks[rows] != num_blocks).tolist():
            b.sync_blocks(int(rows[i]), block_ids[i])
        if out.rewritten_req_ids:
            for i, req in enumerate(reqs):
                if req.req_id in out.rewritten_req_ids:
                    b.sync_blocks(int(rows[i]), block_ids[i], is_rewritten=True)
        return rows

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV block src into dst, every layer, on the cache's device (copy-on-write)."""
        copy_kv_blocks(self.kv_cache, pairs)

    def build_inputs(
        self, rows: np.ndarray, start: np.ndarray, num_new: np.ndarray, num_decodes: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Model inputs for tokens start[i] .. start[i] + num_new[i] - 1 of the sequence in
        rows[i] (token ids from the batch's rows). The first num_decodes sequences are decodes:
        each of their tokens attends as a decode query over the positions up to its own (one
        token normally; a token and its drafts when verifying speculation). Returns input ids,
        positions, attention metadata and cu (the end offset of each sequence's tokens)."""
        arrays, cu = self.host_inputs(rows, start, num_new, num_decodes)
        ndt = int(cu[num_decodes - 1]) if num_decodes else 0
        decode_lens, prefill_lens = arrays["decode_context_lens"], arrays["prefill_seq_lens"]
        on_device = self.uploader.upload(arrays)
        input_ids_t = on_device.pop("input_ids")
        positions_t = on_device.pop("positions")
        meta = AttentionMetadata(
            num_decode_tokens=ndt,
            decode_max_len=int(decode_lens.max()) if ndt else 0,
            prefill_max_len=int(prefill_lens.max()) if len(prefill_lens) else 0,
            prefill_max_query_len=(int(np.diff(arrays["prefill_query_start_loc"]).max())
                                   if len(prefill_lens) else 0),
            **on_device,
        )
        return input_ids_t, positions_t, meta, cu

    def host_inputs(
        self, rows: np.ndarray, start: np.ndarray, num_new: np.ndarray, num_decodes: int
    ) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The integer inputs of `build_inputs` as host arrays, named as AttentionMetadata's
        fields (and input_ids, positions), and cu."""
        b = self.batch
        cu = np.cumsum(num_new)  # [num_seqs], end offset of each sequence's tokens
        total = int(cu[-1])
        # position of every flattened token: its sequence's start + its offset in the chunk
        token_rows = np.repeat(rows, num_new)  # [total]
        positions = np.repeat(start - (cu - num_new), num_new) + np.arange(total)  # [total]
        input_ids = b.token_ids[token_rows, positions]  # [total]
        bs = self.block_size
        slots = b.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (start + num_new).astype(np.int32)  # [num_seqs], KV length after the step
        nd = num_decodes
        ndt = int(cu[nd - 1]) if nd else 0  # decode tokens
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = b.block_table[rows, :max_blocks]  # [num_seqs, max_blocks]
        if ndt == nd:  # one token per decode
            decode_tables, decode_lens = tables[:nd], seq_lens[:nd]
        else:  # a query per token, each over its sequence's positions up to its own
            decode_tables = b.block_table[token_rows[:ndt], :max_blocks]
            decode_lens = (positions[:ndt] + 1).astype(np.int32)
        prefill_qsl = np.concatenate([[0], cu[nd:] - ndt]).astype(np.int32)
        prefill_lens = seq_lens[nd:]
        arrays = {
            "input_ids": input_ids.astype(np.int64),
            "positions": positions.astype(np.int64),
            "slot_mapping": slots,
            "decode_block_tables": np.ascontiguousarray(decode_tables, dtype=np.int32),
            "decode_context_lens": decode_lens.astype(np.int32),
            "prefill_block_tables": np.ascontiguousarray(tables[nd:], dtype=np.int32),
            "prefill_query_start_loc": prefill_qsl,
            "prefill_seq_lens": prefill_lens,
            # each prefill row's sequence (index into the prefill tables) and KV length
            "prefill_row_tables": np.repeat(np.arange(len(prefill_lens), dtype=np.int32),
                                            num_new[nd:]),
            "prefill_row_lens": (positions[ndt:] + 1).astype(np.int32),
        }
        return arrays, cu

    def context(self, num_quant_rows: int, quantization: DecodeQuantization | None = None,
                on_layer_done=None) -> ForwardContext:
        """The ForwardContext of a forward: the first num_quant_rows rows take the quantized
        decode path where there is one (`quantization`, default this model's)."""
        if (quantization or self.quantization) is None:
            return ForwardContext(on_layer_done=on_layer_done)
        return ForwardContext(num_quant_rows, on_layer_done)

    def forward(self, input_ids, positions, meta, num_quant_rows: int, kv_cache=None,
                model=None, num_layers=None, quantization=None,
                on_layer_done=None) -> torch.Tensor:
        """The model's hidden states, through the platform's forward; the first
        num_quant_rows tokens take the decode path. on_layer_done(i): called as each layer's
        KV lands (the KV connector)."""
        kv = self.kv_cache if kv_cache is None else kv_cache
        return self.platform.forward(model or self.model, input_ids, positions, kv, meta,
                                     self.context(num_quant_rows, quantization, on_layer_done),
                                     num_layers, quantization or self.quantization)

    def logits(self, hidden: torch.Tensor, num_quant_rows: int, model=None,
               quantization=None) -> torch.Tensor:
        with use(self.context(num_quant_rows, quantization)):
            return (model or self.model).compute_logits(hidden)

    def _index(self, idx: np.ndarray) -> torch.Tensor:
        """Host indices as an index tensor on the engine's device (on the CPU, no copy)."""
        return torch.as_tensor(idx, dtype=torch.int64, device=self.device)

    def launch(self, out: SchedulerOutput, rows: np.ndarray,
               prev: StepHandle | None) -> StepHandle:
        """Async scheduling (engine_core/async_step.py): run the step's model and sampler
        but keep the sampled ids where they are (the device); `collect` reads them. The
        inputs of requests whose last token `prev` (the step before, maybe still running)
        sampled come from its device tensor."""
        return self._governed(out, lambda: self._execute(out, rows, None, None, prev=prev,
                                                         defer=True))

    def collect(self, handle: StepHandle) -> tuple[list[list[int]],
                                                   tuple[list[int], SamplerOutput] | None]:
        """A launched step's new tokens (as `execute` returns them), read from the device
        (the one wait of the step); each is written into its request's row if the row is
        still that request's."""
        sampled: list[list[int]] = [[] for _ in handle.out.reqs]
        if handle.result is None:
            return sampled, None
        tokens = handle.result.sampled_token_ids.cpu().numpy()
        b = self.batch
        keep = [j for j, i in enumerate(handle.plain)
                if b.row_of.get(handle.out.reqs[i].req_id) == int(handle.plain_rows[j])]
        if keep:
            b.append_sampled(handle.plain_rows[keep], tokens[keep])
        for i, token in zip(handle.plain, tokens.tolist(), strict=True):
            sampled[i] = [token]
        return sampled, (handle.plain, handle.result)

    def execute(
        self, out: SchedulerOutput, rows: np.ndarray, verifier=None, on_layer_done=None
    ) -> tuple[list[list[int]], tuple[list[int], SamplerOutput] | None]:
        """Run one step over rows from `sync`. Returns each scheduled request's new tokens
        ([] for a prefill chunk that is not done; the accepted drafts and one more token for a
        speculative decode, checked by `verifier`) and the plain sampler's output with the
        indices of the requests it sampled (their logprobs)."""
        return self._governed(out, lambda: self._execute(out, rows, verifier, on_layer_done))

    def _governed(self, out: SchedulerOutput, run):
        """run() on the thread count the governor picks for this step (CPU decode steps)."""
        governor = self.threads
        decode_only = out.num_decodes == len(out.reqs)
        # steps of 2^(b-1) .. 2^b - 1 tokens share their timings
        key = out.total_num_tokens.bit_length() if decode_only else None
        threads = governor.choose(key) if key is not None else governor.max_threads
        before = torch.get_num_threads()
        if governor.is_active and threads != before:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        try:
            result = run()
        finally:  # the process's count is its own (transformers beside us in bench-engine)
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        if governor.is_active and key is not None:
            governor.record(key, threads, time.perf_counter() - start)
        return result

    @torch.inference_mode()
    def _execute(
        self, out: SchedulerOutput, rows: np.ndarray, verifier, on_layer_done,
        prev: StepHandle | None = None, defer: bool = False,
    ):
        """defer (async scheduling): the step's tokens stay on the device, in the StepHandle
        returned (out.num_pending: each request's tokens sampled but not yet known)."""
        b = self.batch
        nd = out.num_decodes
        drafted = [i for i in range(nd) if out.reqs[i].spec_token_ids]
        for i in drafted:  # drafts sit after the sequence's tokens, in place of the unknown
            req = out.reqs[i]
            b.token_ids[rows[i], req.num_tokens : req.num_tokens + len(req.spec_token_ids)] = (
                req.spec_token_ids
            )
        n = len(out.reqs)
        num_new = np.asarray(out.num_scheduled_tokens, dtype=np.int64)  # [num_seqs]
        start = np.fromiter((r.num_computed_tokens for r in out.reqs), np.int64, n)
        # requests caught up after this step sample; a prefill chunk's token would be thrown
        # away, and drawing it would advance a seeded request's generator. (The rows hold
        # each request's tokens: sync.)
        end = start + num_new
        if drafted:
            end -= np.fromiter((len(r.spec_token_ids) for r in out.reqs), np.int64, n)
        known = b.num_tokens[rows]  # [num_seqs]: tokens the host has, pending ones after
        pending = (np.asarray(out.num_pending, dtype=np.int64) if out.num_pending
                   else np.zeros(n, dtype=np.int64))
        complete = np.flatnonzero(end == known + pending)
        if drafted:
            spec_set = set(drafted)
            plain = [i for i in complete.tolist() if i not in spec_set]
        else:
            plain = complete.tolist()
        masks = self._start_masks([out.reqs[i] for i in plain])
        bucket = (self.graphs.batch_size(out, on_layer_done is not None)
                  if self.graphs is not None else None)
        fill = self._pending_inputs(out, start, known, pending, prev)
        if bucket is not None:  # decode-only: replayed over the bucket's static buffers
            arrays, cu = self.host_inputs(rows, start, num_new, nd)
            hidden = self.graphs.run(bucket, arrays, fill)
        else:
            input_ids, positions, meta, cu = self.build_inputs(rows, start, num_new, nd)
            if fill is not None:
                input_ids[fill[0]] = fill[1]
            ndt = int(cu[nd - 1]) if nd else 0
            hidden = self.forward(input_ids, positions, meta, ndt, on_layer_done=on_layer_done)
        for i in range(nd, len(out.reqs)):
            if out.reqs[i].needs_prompt_logprobs:
                record_prompt_logprobs(self.logits, out.reqs[i], hidden, int(cu[i] - num_new[i]),
                                             int(start[i]), int(num_new[i]))
        sampled: list[list[int]] = [[] for _ in out.reqs]
        if len(complete) == 0:
            return StepHandle(out, [], rows[:0], None) if defer else (sampled, None)
        # logits rows: every token of a drafted decode, the last token of any other request
        last = cu - 1
        spec_rows = [np.arange(cu[i] - num_new[i], cu[i]) for i in drafted]
        token_idx = np.concatenate([last[plain], *spec_rows]).astype(np.int64)
        # quantized (decode) rows must lead: plain decodes, then drafted decodes' rows; only
        # completed prefills (dense) follow them, so reorder to put them last
        is_prefill = np.zeros(len(token_idx), dtype=bool)
        is_prefill[: len(plain)] = np.asarray(plain) >= nd
        if is_prefill.any():
            order = np.concatenate([np.flatnonzero(~is_prefill), np.flatnonzero(is_prefill)])
            logits = self.logits(hidden[self._index(token_idx[order])],
                                 int((~is_prefill).sum()))
            logits = logits[self._index(np.argsort(order))]  # back to token_idx order
        else:  # already in order: no copy of the [rows, vocab] logits
            logits = self.logits(hidden[self._index(token_idx)], len(token_idx))
        result = None
        if plain:
            plain_rows = rows[plain]
            batch = b.sampling.batch(
                plain_rows, (known + pending)[plain], b.token_counts, logits.device,
                token_masks=None if masks is None else (masks[0], masks[1].result()))
            result = self.sampler(logits[: len(plain)], batch)
            if defer:  # (no drafts: async scheduling runs without speculation)
                return StepHandle(out, plain, plain_rows, result)
            tokens = result.sampled_token_ids.cpu().numpy()
            b.append_sampled(plain_rows, tokens)
            for i, token in zip(plain, tokens.tolist(), strict=True):
                sampled[i] = [token]
        if drafted:
            tokens = verifier([out.reqs[i] for i in drafted], logits[len(plain):])
            for i, toks in zip(drafted, tokens, strict=True):
                sampled[i] = toks
        return sampled, ((plain, result) if plain else None)

    def _pending_inputs(self, out: SchedulerOutput, start: np.ndarray, known: np.ndarray,
                        pending: np.ndarray, prev: StepHandle | None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(input rows, token ids) on the device for the decodes whose input token the step
        in flight sampled (async scheduling): its position is the first the host lacks."""
        if prev is None or prev.result is None or not pending.any():
            return None
        where = {prev.out.reqs[i].req_id: j for j, i in enumerate(prev.plain)}
        dst, src = [], []
        for i in np.flatnonzero(pending).tolist():
            assert i < out.num_decodes and start[i] == known[i], "a pending input not decoded"
            dst.append(i)  # decodes lead, one token each: row i is token i
            src.append(where[out.reqs[i].req_id])
        return (self._index(np.asarray(dst)),
                prev.result.sampled_token_ids[self._index(np.asarray(src))])

    def _start_masks(self, reqs: list[Request]) -> tuple[list[int], Future] | None:
        """The grammar masks of the constrained requests among `reqs` (the step's sampling
        rows), computed in one llguidance call on the mask thread while the forward runs:
        (their indices in `reqs`, a future of the [R, ceil(V / 32)] bitmasks)."""
        rows = [j for j, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        matchers = [reqs[j].matcher for j in rows]
        return rows, self._mask_pool.submit(self.mask_timer.timed_fill, matchers,
                                            self.vocab_size)
