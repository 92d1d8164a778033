"""Turns a SchedulerOutput into tensors, runs the model and samples.

Per-request state the GPU-side needs lives in persistent numpy arrays indexed by a row per
running request (`InputBatch`), so building a step's inputs is a handful of vectorized index
operations, not a Python loop that assembles tensors sequence by sequence.
"""

from __future__ import annotations

import numpy as np
import torch

from engine_core.kv_cache.layout import KVLayout
from engine_core.model.attention import AttentionMetadata
from engine_core.model.decode_quant import DecodeRows
from engine_core.model.llama import LlamaForCausalLM
from engine_core.sampler import Sampler, SamplerOutput, SamplingBatch
from engine_core.scheduler import SchedulerOutput


class InputBatch:
    """Rows of token ids and block tables for the requests the runner has seen."""

    def __init__(self, max_rows: int, max_model_len: int, block_size: int) -> None:
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_rows, max_model_len), dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int32)  # valid entries of token_ids
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def row(self, req_id: str, token_ids: list[int]) -> int:
        """The request's row, created (with its tokens so far) on first sight."""
        row = self.row_of.get(req_id)
        if row is None:
            row = self.free_rows.pop()
            self.row_of[req_id] = row
            self.token_ids[row, : len(token_ids)] = token_ids
            self.num_tokens[row] = len(token_ids)
            self.num_blocks[row] = 0
        return row

    def sync_blocks(self, row: int, blocks: list[int]) -> None:
        have = self.num_blocks[row]
        if have != len(blocks):  # blocks are only ever appended while a row lives
            self.block_table[row, have : len(blocks)] = blocks[have:]
            self.num_blocks[row] = len(blocks)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.free_rows.append(row)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, layout: KVLayout, num_blocks: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device,
                 eos_token_ids: tuple[int, ...], decode_rows: DecodeRows | None = None,
                 kv_cache: torch.Tensor | None = None) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.block_size = layout.block_size
        if kv_cache is not None and tuple(kv_cache.shape) != layout.cache_shape(num_blocks):
            raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}, expected "
                             f"{layout.cache_shape(num_blocks)}")
        self.kv_cache = kv_cache if kv_cache is not None else layout.allocate(num_blocks, device)
        # a few spare rows: finished requests release theirs only at the next step
        self.batch = InputBatch(2 * max_num_seqs + 8, max_model_len, layout.block_size)
        self.sampler = Sampler()
        self.eos_token_ids = eos_token_ids
        self.vocab_size = model.config.vocab_size
        self.decode_rows = decode_rows  # set per step when decode rows run quantized matmuls

    def prepare(
        self, out: SchedulerOutput, block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        b = self.batch
        for req_id in out.finished_req_ids + out.preempted_req_ids:
            b.remove(req_id)
        rows = np.empty(len(out.reqs), dtype=np.int64)
        for i, (req, blocks) in enumerate(zip(out.reqs, block_ids, strict=True)):
            row = b.row(req.req_id, req.all_token_ids)
            if b.num_tokens[row] < req.num_tokens:  # tokens sampled since the last step
                b.token_ids[row, b.num_tokens[row] : req.num_tokens] = (
                    req.all_token_ids[b.num_tokens[row] :]
                )
                b.num_tokens[row] = req.num_tokens
            b.sync_blocks(row, blocks)
            rows[i] = row
        num_new = np.asarray(out.num_scheduled_tokens, dtype=np.int64)  # [num_seqs]
        start = np.asarray([r.num_computed_tokens for r in out.reqs], dtype=np.int64)
        cu = np.cumsum(num_new)  # [num_seqs], end offset of each sequence's tokens
        total = int(cu[-1])
        # position of every flattened token: its sequence's start + its offset in the chunk
        token_rows = np.repeat(rows, num_new)  # [total]
        positions = np.repeat(start - (cu - num_new), num_new) + np.arange(total)  # [total]
        input_ids = b.token_ids[token_rows, positions]  # [total]
        bs = self.block_size
        slots = b.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = (start + num_new).astype(np.int32)  # [num_seqs], KV length after the step
        nd = out.num_decodes
        max_blocks = int(-(-seq_lens.max() // bs))
        tables = b.block_table[rows, :max_blocks]  # [num_seqs, max_blocks]
        prefill_qsl = np.concatenate([[0], cu[nd:] - (cu[nd - 1] if nd else 0)]).astype(np.int32)
        t = torch.from_numpy
        meta = AttentionMetadata(
            slot_mapping=t(slots).to(self.device),
            num_decode_tokens=nd,
            decode_block_tables=t(np.ascontiguousarray(tables[:nd])).to(self.device),
            decode_context_lens=t(seq_lens[:nd]).to(self.device),
            prefill_block_tables=t(np.ascontiguousarray(tables[nd:])).to(self.device),
            prefill_query_start_loc=t(prefill_qsl).to(self.device),
            prefill_seq_lens=t(seq_lens[nd:]).to(self.device),
        )
        logits_indices = t(cu - 1).to(self.device)  # last token of each sequence
        return t(input_ids).to(self.device), t(positions).to(self.device), meta, logits_indices

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_ids: list[list[int]]
    ) -> tuple[torch.Tensor, tuple[list[int], SamplerOutput] | None]:
        """Run one step. Returns the sampled token of every scheduled request (-1 for prefill
        chunks that are not done) and the sampler's output for the rows that sampled."""
        input_ids, positions, meta, logits_indices = self.prepare(out, block_ids)
        if self.decode_rows is not None:
            self.decode_rows.n = out.num_decodes
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        # only requests caught up after this step sample; a prefill chunk's token would be
        # thrown away, and drawing it would advance a seeded request's generator
        complete = [i for i, (r, n) in enumerate(zip(out.reqs, out.num_scheduled_tokens,
                                                     strict=True))
                    if r.num_computed_tokens + n == r.num_tokens]
        sampled = torch.full((len(out.reqs),), -1, dtype=torch.int64)
        if not complete:
            return sampled, None
        if self.decode_rows is not None:  # decodes lead `complete` as they lead the step
            self.decode_rows.n = sum(i < out.num_decodes for i in complete)
        logits = self.model.compute_logits(hidden[logits_indices[complete]])  # [n, vocab]
        reqs = [out.reqs[i] for i in complete]
        batch = SamplingBatch.from_requests(
            [r.sampling_params for r in reqs],
            [r.prompt_token_ids for r in reqs],
            [r.output_token_ids for r in reqs],
            [r.generator for r in reqs],
            self.vocab_size,
            eos_token_ids=self.eos_token_ids,
        )
        result = self.sampler(logits, batch)
        sampled[complete] = result.sampled_token_ids.cpu()
        return sampled, (complete, result)
