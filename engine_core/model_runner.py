"""Turns a SchedulerOutput into tensors, runs the model and samples.

Per-request state the GPU-side needs lives in persistent numpy arrays indexed by a row per
running request (`InputBatch`), so building a step's inputs is a handful of vectorized index
operations, not a Python loop that assembles tensors sequence by sequence.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.kv_cache.layout import KVLayout, copy_kv_blocks
from engine_core.model.attention import AttentionMetadata
from engine_core.model.decode_quant import DecodeQuantization
from engine_core.model.decoder import DecoderForCausalLM
from engine_core.model.forward_context import ForwardContext, use
from engine_core.penalties import TokenCounts
from engine_core.request import Request
from engine_core.sampler import Sampler, SamplerOutput
from engine_core.sampling_rows import SamplingRows
from engine_core.scheduler import SchedulerOutput
from engine_core.step_inputs import StepUploader
from engine_core.structured_output import MaskTimer
from engine_core.thread_governor import ThreadGovernor

if TYPE_CHECKING:
    from engine_core.decode_graphs import DecodeGraphRunner

PROMPT_LOGPROBS_ROWS = 64  # prompt positions per logits slice (64 x 49152 float32: 12 MiB)


class InputBatch:
    """Rows of token ids, block tables and sampling parameters for the requests the runner
    has seen. Invariant after `ModelRunner.sync`: a scheduled request's row holds its tokens
    so far (num_tokens) and its blocks (num_blocks); the runner writes each step's sampled
    tokens into the rows itself, so a decode step's sync finds nothing to copy."""

    def __init__(self, max_rows: int, max_model_len: int, block_size: int,
                 vocab_size: int = 1, eos_token_ids: tuple[int, ...] = ()) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int32)  # valid entries of token_ids
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # penalised requests' token counts by row, kept as tokens are appended
        self.token_counts: dict[int, TokenCounts] = {}
        self.sampling = SamplingRows(max_rows, vocab_size, eos_token_ids)

    def row(self, req: Request) -> int:
        """The request's row, created (with its tokens so far, and its penalty counts) on
        first sight: a new request, or one preempted and recomputed."""
        row = self.row_of.get(req.req_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[req.req_id] = row
            self._fill(row, req)
            self.num_blocks[row] = 0
            self.sampling.set_row(row, req)
        return row

    def _fill(self, row: int, req: Request) -> None:
        token_ids = req.all_token_ids
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        if req.sampling_params.has_penalties:
            self.token_counts[row] = TokenCounts(*req.penalty_prompt_and_output)

    def append(self, row: int, req: Request) -> None:
        """Bring the row to the request's tokens: those it gained since the row last saw it
        (a first token from a prefill worker, accepted drafts), or, where the request lost
        tokens the row holds (never in a step's normal course), all of them again."""
        have = int(self.num_tokens[row])
        if have > req.num_tokens:
            self.token_counts.pop(row, None)
            self._fill(row, req)
            return
        new = req.all_token_ids[have:]
        self.token_ids[row, have : req.num_tokens] = new
        self.num_tokens[row] = req.num_tokens
        counts = self.token_counts.get(row)
        if counts is not None:
            counts.append(new)

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """One sampled token per row, at each row's end (the step's plain samples)."""
        ends = self.num_tokens[rows]
        self.token_ids[rows, ends] = tokens
        self.num_tokens[rows] = ends + 1
        if self.token_counts:
            for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
                counts = self.token_counts.get(row)
                if counts is not None:
                    counts.append((token,))

    def sync_blocks(self, row: int, blocks: list[int], is_rewritten: bool = False) -> None:
        """is_rewritten: blocks were replaced in place (copy-on-write), not only appended."""
        have = 0 if is_rewritten else self.num_blocks[row]
        if have != len(blocks):
            self.block_table[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = len(blocks)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.token_counts.pop(row, None)
            self.sampling.clear_row(row)
            self.free_rows.append(row)


class ModelRunner:
    def __init__(self, model: DecoderForCausalLM, layout: KVLayout, num_blocks: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device,
                 eos_token_ids: tuple[int, ...],
                 quantization: DecodeQuantization | None = None,
                 kv_cache: torch.Tensor | None = None) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.block_size = layout.block_size
        if kv_cache is not None and tuple(kv_cache.shape) != layout.cache_shape(num_blocks):
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected "
                             f"{layout.cache_shape(num_blocks)}")
        self.kv_cache = kv_cache if kv_cache is not None else layout.allocate(num_blocks, device)
        self.uploader = StepUploader(device)
        # a few spare rows: finished requests release theirs only at the next step
        self.vocab_size = model.config.vocab_size
        self.batch = InputBatch(2 * max_num_seqs + 8, max_model_len, layout.block_size,
                                self.vocab_size, eos_token_ids)
        self.sampler = Sampler()
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
        self.threads = ThreadGovernor(torch.get_num_threads()
                                      if device.type == "cpu" and quantization is not None
                                      else 1)

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
        q = quantization or self.quantization
        if q is None:
            return ForwardContext(on_layer_done=on_layer_done)
        return ForwardContext(num_quant_rows, q.decode_layers, on_layer_done)

    def forward(self, input_ids, positions, meta, num_quant_rows: int, kv_cache=None,
                model=None, num_layers=None, quantization=None,
                on_layer_done=None) -> torch.Tensor:
        """The model's hidden states; the first num_quant_rows tokens take the decode path.
        on_layer_done(i): called as each layer's KV lands (the KV connector)."""
        model = model or self.model
        kv = self.kv_cache if kv_cache is None else kv_cache
        with use(self.context(num_quant_rows, quantization, on_layer_done)):
            return model(input_ids, positions, kv, meta, num_layers)

    def logits(self, hidden: torch.Tensor, num_quant_rows: int, model=None,
               quantization=None) -> torch.Tensor:
        with use(self.context(num_quant_rows, quantization)):
            return (model or self.model).compute_logits(hidden)

    def _record_prompt_logprobs(self, req, hidden: torch.Tensor, first_row: int,
                                start: int, num_new: int) -> None:
        """Append to req.prompt_logprobs the entries of this chunk's positions: the row at
        position p predicts prompt token p + 1. Raw log_softmax of dense logits, in slices of
        PROMPT_LOGPROBS_ROWS rows to bound the [rows, vocab] memory."""
        n = req.sampling_params.prompt_logprobs
        prompt = req.prompt_token_ids
        end = min(start + num_new, req.num_prompt_tokens - 1)  # last position with a next
        # the first position not recorded yet (a preempted request recomputes from 0); the
        # scheduler gives such a request no prefix-cache hits, so no position is skipped
        assert len(req.prompt_logprobs) >= start, "prompt logprobs need every position"
        p = max(len(req.prompt_logprobs), start)
        while p < end:
            q = min(end, p + PROMPT_LOGPROBS_ROWS)
            rows = hidden[first_row + p - start : first_row + q - start]  # [q - p, hidden]
            lp = self.logits(rows, 0).log_softmax(dim=-1, dtype=torch.float32)  # [q - p, V]
            targets = torch.tensor(prompt[p + 1 : q + 1], dtype=torch.int64, device=lp.device)
            chosen = lp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()  # [q - p]
            top_lps, top_ids = (lp.topk(n, dim=-1) if n else (None, None))  # [q - p, n]
            for j, token in enumerate(prompt[p + 1 : q + 1]):
                entry = {token: chosen[j]}
                if n:
                    for t, v in zip(top_ids[j].tolist(), top_lps[j].tolist(), strict=True):
                        entry.setdefault(t, v)
                req.prompt_logprobs.append(entry)
            p = q

    def _index(self, idx: np.ndarray) -> torch.Tensor:
        """Host indices as an index tensor on the engine's device (on the CPU, no copy)."""
        return torch.as_tensor(idx, dtype=torch.int64, device=self.device)

    def execute(
        self, out: SchedulerOutput, rows: np.ndarray, verifier=None, on_layer_done=None
    ) -> tuple[list[list[int]], tuple[list[int], SamplerOutput] | None]:
        """Run one step over rows from `sync`. Returns each scheduled request's new tokens
        ([] for a prefill chunk that is not done; the accepted drafts and one more token for a
        speculative decode, checked by `verifier`) and the plain sampler's output with the
        indices of the requests it sampled (their logprobs)."""
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
            result = self._execute(out, rows, verifier, on_layer_done)
        finally:  # the process's count is its own (transformers beside us in bench-engine)
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)
        if governor.is_active and key is not None:
            governor.record(key, threads, time.perf_counter() - start)
        return result

    @torch.inference_mode()
    def _execute(
        self, out: SchedulerOutput, rows: np.ndarray, verifier, on_layer_done
    ) -> tuple[list[list[int]], tuple[list[int], SamplerOutput] | None]:
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
        complete = np.flatnonzero(end == b.num_tokens[rows])
        if drafted:
            spec_set = set(drafted)
            plain = [i for i in complete.tolist() if i not in spec_set]
        else:
            plain = complete.tolist()
        masks = self._start_masks([out.reqs[i] for i in plain])
        bucket = (self.graphs.batch_size(out, on_layer_done is not None)
                  if self.graphs is not None else None)
        if bucket is not None:  # decode-only: replayed over the bucket's static buffers
            arrays, cu = self.host_inputs(rows, start, num_new, nd)
            hidden = self.graphs.run(bucket, arrays)
        else:
            input_ids, positions, meta, cu = self.build_inputs(rows, start, num_new, nd)
            ndt = int(cu[nd - 1]) if nd else 0
            hidden = self.forward(input_ids, positions, meta, ndt, on_layer_done=on_layer_done)
        for i in range(nd, len(out.reqs)):
            if out.reqs[i].needs_prompt_logprobs:
                self._record_prompt_logprobs(out.reqs[i], hidden, int(cu[i] - num_new[i]),
                                             int(start[i]), int(num_new[i]))
        sampled: list[list[int]] = [[] for _ in out.reqs]
        if len(complete) == 0:
            return sampled, None
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
                plain_rows, b.num_tokens[plain_rows], b.token_counts, logits.device,
                token_masks=None if masks is None else (masks[0], masks[1].result()))
            result = self.sampler(logits[: len(plain)], batch)
            tokens = result.sampled_token_ids.cpu().numpy()
            b.append_sampled(plain_rows, tokens)
            for i, token in zip(plain, tokens.tolist(), strict=True):
                sampled[i] = [token]
        if drafted:
            tokens = verifier([out.reqs[i] for i in drafted], logits[len(plain):])
            for i, toks in zip(drafted, tokens, strict=True):
                sampled[i] = toks
        return sampled, ((plain, result) if plain else None)

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
