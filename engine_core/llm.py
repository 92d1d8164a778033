"""The offline API, shaped like vLLM's `LLM`: the colocated baseline in one process.

    llm = LLM()          # the default model; bf16 where the CPU/GPU has native bf16, else fp32
    llm.generate(["Hello"], SamplingParams(max_tokens=32))[0].outputs[0].text
    llm.chat([{"role": "user", "content": "What is the capital of France?"}])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm import tqdm

from engine_core.engine import LLMEngine
from engine_core.engine_config import (
    CacheConfig,
    DeviceConfig,
    KVOffloadConfig,
    LoadConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.heap import frozen_heap
from engine_core.outputs import RequestOutput, RequestOutputs
from engine_core.sampling_params import SamplingParams

Messages = list[dict[str, str]]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype | None = None,
        device: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        quantize_decode: bool | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        decode_activations: str | None = None,
        cache_decoded_blocks: bool = False,
        enforce_eager: bool = False,
        prefill_weights: str = "auto",
        async_scheduling: bool | None = None,
        quantization: str | None = None,
        kv_offload: KVOffloadConfig | dict | None = None,
    ) -> None:
        """quantization: None computes the weights as loaded (a GGUF's blocks as stored, float
        weights as floats); "int8" requantizes float weights to int8 for the CPU's decode rows
        (faster, lossy), as vLLM's --quantization names it.
        speculative_config: e.g. {"method": "ngram", "num_speculative_tokens": 4} or
        {"method": "draft"} (the model's first layers as draft); see SpeculativeConfig.
        decode_activations: "auto", "float32" or "int8", for the CPU's quantized decode
        matmuls (see platforms/cpu/decode_quant.resolve_activations).
        cache_decoded_blocks: see CacheConfig.cache_decoded_blocks.
        enforce_eager: no CUDA graphs for decode steps (engine_core/decode_graphs.py); they
        are only ever used on CUDA.
        prefill_weights: "auto", "dense" or "quantized": whether prefill rows multiply a dense
        copy of a GGUF's 4/8-bit weights or the blocks (model_loader.load_model).
        async_scheduling: schedule each step while the one before runs on the device
        (engine_core/async_step.py); None: on for CUDA.
        kv_offload: tiers below the KV pool, e.g. {"disk_dir": "/var/cache/pdserve",
        "disk_gb": 20} (KVOffloadConfig; engine_core/kv_offload/)."""
        if isinstance(kv_offload, dict):
            kv_offload = KVOffloadConfig(**kv_offload)
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig(**speculative_config)
        self.engine = LLMEngine(
            LoadConfig(model=model, dtype=dtype, quantization=quantization,
                       quantize_decode=quantize_decode, decode_activations=decode_activations,
                       prefill_weights=prefill_weights),
            DeviceConfig(device=device, enforce_eager=enforce_eager,
                         async_scheduling=async_scheduling),
            CacheConfig(block_size=block_size, num_blocks=num_kv_blocks,
                        kv_cache_memory_gb=kv_cache_memory_gb,
                        enable_prefix_caching=enable_prefix_caching,
                        cache_decoded_blocks=cache_decoded_blocks,
                        offload=kv_offload or KVOffloadConfig()),
            SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len),
            speculative_config,
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); results in the prompts' order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"sampling_params must be one or one per prompt ({len(prompts)}), "
                f"got {len(params)}"
            )
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template and generate a reply per conversation."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer")
        params = sampling_params or SamplingParams(max_tokens=256, temperature=0.0)
        prompts = [self.engine.tokenizer.apply_chat_template(c) for c in convs]
        return self.generate(prompts, params, use_tqdm)

    def _run(self, req_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(req_ids)
        outputs = RequestOutputs()  # each request's deltas folded (its output once finished)
        # the engine's heap out of the collector's walks for the call (engine_core/heap.py)
        with frozen_heap(), tqdm(total=len(req_ids), disable=not use_tqdm,
                                 desc="generating") as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step_deltas():
                    out = outputs.add(delta, delta.req.prompt_token_ids)
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        self.engine.flush_offload()
        return [final[r] for r in req_ids]

    def close(self) -> None:
        """Finish the KV stores still queued for the offload tiers and stop their threads."""
        self.engine.close()
