"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's way).

A decode step of a small model is hundreds of short kernel launches; the host issuing them,
not the GPU, sets the step time. A graph captured once per bucket launches them all in one
call. Captured at engine start (`capture`), replayed by every eligible step:

    step of n decodes -> bucket B, the smallest capture size >= n
    host arrays --(numpy)--> staging[:B] --copy_(non_blocking)--> static buffers[:B]
    graphs[B].replay()                (eagerly: the model over the static buffers)
    hidden = outputs[B][:n]           (logits and the sampler run outside the graph)

Eligible steps (`graph_batch_size`): decode-only, one token per request (no drafts to verify),
no layer observer (the KV connector's Python callback between layers), at most the largest
bucket of requests. Every other step runs eagerly, as without graphs.

Padding rows n..B-1 are harmless by construction:
- token 0 at position 0, slot -1: every store_kv backend (Triton, torch, C) skips a negative
  slot, so a padding row's K/V lands nowhere;
- context length 1 over a block table row of zeros: the row attends to position 0 of block 0,
  whatever it holds (a read, never a write; every backend needs a length >= 1);
- their outputs are never read.

The static buffers are sized for the largest bucket; each graph reads the first B rows of
them, so one copy of the step's rows feeds whichever graph replays. The block tables keep
every column a sequence can use (max_model_len / block_size), so no graph depends on the
step's context lengths, which the kernels read from device memory.

The same path runs without CUDA graphs (`use_cuda_graphs=False`): the model is called over
the static, padded buffers. The CPU tests use it to check that padding changes no real row's
output and no real KV block.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine_core.model.attention import AttentionMetadata
from engine_core.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from engine_core.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PAD_SLOT = -1  # store_kv skips it: a padding row writes no K/V
PAD_CONTEXT_LEN = 1  # a padding row attends to position 0 of block 0 (a read only)

# the step's host arrays a decode-only graph reads, with their static dtypes
_INPUTS = {
    "input_ids": torch.int64,  # [B]
    "positions": torch.int64,  # [B]
    "slot_mapping": torch.int64,  # [B]
    "decode_context_lens": torch.int32,  # [B]
    "decode_block_tables": torch.int32,  # [B, max_blocks_per_seq]
}


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch-size buckets: vLLM's list (1, 2, 4, every multiple of 8 to 256, of 16 after)
    below max_num_seqs, and max_num_seqs itself, so every decode batch has a bucket."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs, 16)]
    return (*[s for s in sizes if s < max_num_seqs], max_num_seqs)


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= num_seqs (sizes ascending), None when num_seqs exceeds them all."""
    if num_seqs < 1:
        raise ValueError(f"num_seqs must be >= 1, got {num_seqs}")
    return next((s for s in sizes if s >= num_seqs), None)


def graph_batch_size(out: SchedulerOutput, sizes: tuple[int, ...],
                     has_layer_observer: bool) -> int | None:
    """The bucket a step replays in, or None when it runs eagerly: a step with a prefill
    chunk (its rows vary in number and attend varlen), a decode verifying drafts (1 + k rows),
    a layer observer (Python between layers cannot be captured), or more requests than the
    largest bucket. Sampling, penalties, grammars and logprobs run outside the graph, so they
    leave a step eligible; prompt logprobs come only with prefill chunks."""
    n = len(out.reqs)
    if n == 0 or has_layer_observer or out.num_decodes != n:
        return None
    if any(k != 1 for k in out.num_scheduled_tokens) or any(r.spec_token_ids for r in out.reqs):
        return None
    return bucket_for(n, sizes)


class DecodeGraphRunner:
    """Runs eligible decode steps over static, padded buffers: replaying a captured CUDA graph
    per bucket, or (use_cuda_graphs=False) calling the model over the same buffers."""

    def __init__(self, runner: ModelRunner, sizes: tuple[int, ...], max_model_len: int,
                 use_cuda_graphs: bool) -> None:
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be ascending and >= 1, got {sizes}")
        if use_cuda_graphs and not runner.platform.cuda_graphs:
            raise ValueError(f"CUDA graphs need a CUDA device, the engine is on {runner.device}")
        self.runner = runner
        self.sizes = tuple(sizes)
        self.max_model_len = max_model_len
        self.use_cuda_graphs = use_cuda_graphs
        device = runner.device
        rows = self.sizes[-1]
        width = -(-max_model_len // runner.block_size)  # max blocks per sequence
        shapes = {name: (rows, width) if name == "decode_block_tables" else (rows,)
                  for name in _INPUTS}
        pin = runner.platform.pin_memory
        # host staging, written through numpy, and its device twin the graphs read
        self._staging = {n: torch.zeros(shapes[n], dtype=_INPUTS[n], pin_memory=pin)
                         for n in _INPUTS}
        self._host = {n: t.numpy() for n, t in self._staging.items()}
        self._static = {n: torch.zeros(shapes[n], dtype=_INPUTS[n], device=device)
                        for n in _INPUTS}
        # a decode-only step's (empty) prefill fields
        self._no_prefill = {
            "prefill_block_tables": torch.zeros((0, width), dtype=torch.int32, device=device),
            "prefill_query_start_loc": torch.zeros(1, dtype=torch.int32, device=device),
            "prefill_seq_lens": torch.zeros(0, dtype=torch.int32, device=device),
            "prefill_row_tables": torch.zeros(0, dtype=torch.int32, device=device),
            "prefill_row_lens": torch.zeros(0, dtype=torch.int32, device=device),
        }
        self._copied: torch.cuda.Event | None = None  # the last copy out of the staging
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [B, hidden] each graph writes
        self.num_padded_steps = 0  # steps run over the static buffers, replayed or eager
        self.num_replays = 0  # of them, replayed from a captured graph
        self.capture_seconds: float | None = None

    def batch_size(self, out: SchedulerOutput, has_layer_observer: bool) -> int | None:
        """This step's bucket, or None: it runs eagerly (see `graph_batch_size`)."""
        return graph_batch_size(out, self.sizes, has_layer_observer)

    def run(self, bucket: int, arrays: dict[str, np.ndarray],
            fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states [n, hidden] from its host arrays (ModelRunner.host_inputs
        of a decode-only step, one token per request), computed over `bucket` rows.
        fill (rows, token ids), device tensors: input ids known only on the device (the
        step in flight's samples, under async scheduling) written over the host's."""
        n = len(arrays["input_ids"])
        if not 1 <= n <= bucket or bucket not in self.sizes:
            raise ValueError(f"{n} decodes do not fit bucket {bucket} (sizes {self.sizes})")
        graph = self.graphs.get(bucket)
        if self.use_cuda_graphs and graph is None:
            raise RuntimeError(f"no CUDA graph captured for bucket {bucket}: call capture()")
        self._upload(bucket, arrays)
        if fill is not None:
            self._static["input_ids"][fill[0]] = fill[1]
        self.num_padded_steps += 1
        if graph is None:  # eagerly, over the same buffers
            max_len = int(arrays["decode_context_lens"].max())
            return self._forward(bucket, max_len)[:n]
        graph.replay()
        self.num_replays += 1
        return self.outputs[bucket][:n]

    def _upload(self, bucket: int, arrays: dict[str, np.ndarray] | None) -> None:
        """Rows 0..n-1 from `arrays` (none: every row padding), rows n..bucket-1 padding,
        into the staging, then one copy per input to the static buffers."""
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has left the staging buffer
        host = self._host
        n = 0 if arrays is None else len(arrays["input_ids"])
        host["input_ids"][:bucket] = 0
        host["positions"][:bucket] = 0
        host["slot_mapping"][:bucket] = PAD_SLOT
        host["decode_context_lens"][:bucket] = PAD_CONTEXT_LEN
        host["decode_block_tables"][:bucket] = 0
        if arrays is not None:
            for name in ("input_ids", "positions", "slot_mapping", "decode_context_lens"):
                host[name][:n] = arrays[name]
            tables = arrays["decode_block_tables"]  # [n, blocks this step needs]
            host["decode_block_tables"][:n, : tables.shape[1]] = tables
        for name, static in self._static.items():
            static[:bucket].copy_(self._staging[name][:bucket], non_blocking=True)
        if self.runner.platform.pin_memory:  # the copies are asynchronous: mark their end
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self.runner.device))

    def _forward(self, bucket: int, decode_max_len: int) -> torch.Tensor:
        """The model over the first `bucket` rows of the static buffers: [bucket, hidden].
        decode_max_len: a bound on the context lengths, for kernels that size scratch by it
        (the C kernels; Triton reads the lengths on the device)."""
        s = self._static
        meta = AttentionMetadata(
            slot_mapping=s["slot_mapping"][:bucket],
            num_decode_tokens=bucket,
            decode_block_tables=s["decode_block_tables"][:bucket],
            decode_context_lens=s["decode_context_lens"][:bucket],
            decode_max_len=decode_max_len,
            prefill_max_len=0,
            **self._no_prefill,
        )
        return self.runner.forward(s["input_ids"][:bucket], s["positions"][:bucket], meta,
                                   bucket)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, all in one memory pool (a smaller
        graph reuses the larger's memory: only one replays at a time). Each bucket runs once
        eagerly first, on the capture stream as torch's recipe has it, so the Triton kernels
        are compiled and the libraries initialised outside the capture. Every row is
        padding: capturing writes no K/V."""
        if not self.use_cuda_graphs:
            raise ValueError("capture() needs use_cuda_graphs=True")
        device = self.runner.device
        t0 = time.monotonic()
        free_before = torch.cuda.mem_get_info(device)[0]
        with torch.cuda.device(device):  # graphs capture on the current device
            stream = torch.cuda.Stream(device)
            pool = None
            for bucket in reversed(self.sizes):
                self._upload(bucket, None)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    self._forward(bucket, self.max_model_len)  # warm-up
                torch.cuda.current_stream(device).wait_stream(stream)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bucket] = self._forward(bucket, self.max_model_len)
                pool = graph.pool()
                self.graphs[bucket] = graph
            torch.cuda.synchronize(device)
        self.capture_seconds = time.monotonic() - t0
        used = free_before - torch.cuda.mem_get_info(self.runner.device)[0]
        logger.info("captured %d CUDA graphs for decode batch sizes %s in %.1f s (%.0f MiB)",
                    len(self.graphs), list(self.sizes), self.capture_seconds, used / 2**20)


def init_decode_graphs(engine, enforce_eager: bool, max_num_seqs: int) -> str:
    """Capture an engine's decode-step CUDA graphs where they can run (its runner replays
    them); returns the decode mode in words, for the log. The KV cache is sized by
    kv_cache_memory_gb, not by the free memory, so the graphs' memory (logged) comes on top
    of it rather than out of it."""
    refusal = engine.platform.graphs_refusal(enforce_eager)
    if refusal is not None:
        return refusal
    graphs = DecodeGraphRunner(engine.runner, capture_sizes(max_num_seqs),
                               engine.max_model_len, use_cuda_graphs=True)
    graphs.capture()
    engine.runner.graphs = graphs
    return (f"from CUDA graphs (batch sizes {list(graphs.sizes)}, captured in "
            f"{graphs.capture_seconds:.1f} s)")
