"""What an engine is built with, beside its model's ModelConfig (engine_core/config.py): frozen
configuration objects, checked once when made and passed narrowly, as vLLM's config parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PREFILL_WEIGHTS = ("auto", "dense", "quantized")
QUANTIZED_PREFILL_NEEDS = (
    "prefill_weights='quantized' reads 4/8-bit blocks with the C kernels: it needs a GGUF "
    "model or a checkpoint with MXFP4 experts, quantized decode on the CPU and the native "
    "kernels (a C compiler, AVX2)")
QUANTIZATIONS = ("int8",)  # what --quantization may ask for (none: the weights as loaded)


@dataclass(frozen=True)
class LoadConfig:
    """Which model an engine loads and how its weights are computed.

    model: a folder, a .gguf file or a registered name (engine_core/model_files.py; None:
    the default model). dtype: "auto" (None) is the platform's (engine_core/platforms/).
    quantization: None (or "none") computes the weights as loaded, a GGUF's 4/5/6/8-bit
    blocks as stored and float weights as floats; "int8" (CPU only) also requantizes float
    weights to int8 per 32 for the decode rows (faster, lossy), vLLM's --quantization.
    quantize_decode: decode rows use the quantized matmuls (the file's blocks, and with
    "int8" the requantized floats); None: on for the CPU where there is anything to use them
    for; False: exact dense math in every row. decode_activations: what those matmuls
    multiply with, "float32" or "int8" (lossy, as llama.cpp's); "auto"/None: int8 for
    bfloat16 on a VNNI CPU. prefill_weights: whether prefill rows keep a dense float copy of
    a GGUF's 4/8-bit weights ("dense") or multiply the blocks ("quantized"); "auto": the
    blocks where the dense copy would not fit (platforms/cpu/weights.py). load_tokenizer:
    False runs on token ids alone (tests' random models have no tokenizer)."""

    model: str | None = None
    dtype: str | torch.dtype | None = None
    quantization: str | None = None
    quantize_decode: bool | None = None
    decode_activations: str | None = None
    prefill_weights: str = "auto"
    load_tokenizer: bool = True

    def __post_init__(self) -> None:
        if self.quantization not in (None, "none", *QUANTIZATIONS):
            raise ValueError(f"quantization must be none or one of {', '.join(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.prefill_weights not in PREFILL_WEIGHTS:
            raise ValueError(f"prefill_weights must be one of {', '.join(PREFILL_WEIGHTS)}, "
                             f"got {self.prefill_weights!r}")


@dataclass(frozen=True)
class DeviceConfig:
    """Where an engine runs and how its steps are driven there.

    device: "cpu", "cuda" or "cuda:N" (None: the first CUDA device where there is one, else
    the CPU); the engine's platform (engine_core/platforms/) follows from it. enforce_eager:
    never run decode steps from CUDA graphs (engine_core/decode_graphs.py; a CPU has none).
    async_scheduling: schedule and prepare each step while the one before runs on the device
    (engine_core/async_step.py); None: the platform's default (on for CUDA)."""

    device: str | None = None
    enforce_eager: bool = False
    async_scheduling: bool | None = None


@dataclass(frozen=True)
class KVOffloadConfig:
    """Tiers below the KV pool (engine_core/kv_offload/), each off until given a size or a
    place; checked in this order:

    cpu_gb: host RAM (a CUDA engine's; on a CPU the pool is host RAM already, so it is off).
    disk_dir, disk_gb: a directory (shared by the workers of a host, kept across restarts).
    redis_url, redis_gb: a Redis server (shared across hosts).

    Each tier holds at most its gigabytes, least recently used entries evicted first."""

    cpu_gb: float = 0.0
    disk_dir: str | None = None
    disk_gb: float = 16.0
    redis_url: str | None = None
    redis_gb: float = 4.0

    def __post_init__(self) -> None:
        for name in ("cpu_gb", "disk_gb", "redis_gb"):
            if getattr(self, name) < 0:
                raise ValueError(f"kv_offload {name} must be >= 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_gb or (self.disk_dir and self.disk_gb)
                    or (self.redis_url and self.redis_gb))


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: how many blocks of how many tokens."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0
    enable_prefix_caching: bool = True
    # Also publish full blocks that hold generated tokens. Their KV came from decode steps,
    # whose matmuls differ from a prefill's (4/8-bit weights, int8 activations by default):
    # a later prompt that hits them continues differently from the same prompt computed
    # afresh. Off (the offline LLM's default), the prefix cache holds prefill-computed KV
    # only, so greedy output depends only on the tokens and a follow-up turn prefills the
    # previous reply again. The serving commands turn it on (--cache-decoded-blocks,
    # service_infra/worker_args.py): a chat's next turn then finds its reply where it was
    # decoded.
    cache_decoded_blocks: bool = False
    offload: KVOffloadConfig = KVOffloadConfig()  # tiers below the pool (none by default)

    def __post_init__(self) -> None:
        if self.offload.enabled and not self.enable_prefix_caching:
            raise ValueError("kv offload tiers are keyed by the prefix cache's block hashes: "
                             "they need enable_prefix_caching")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two > 0, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling limits."""

    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill above it)
    max_model_len: int | None = None  # None: the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


SPEC_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: propose k tokens per decoding sequence, verify them in one target
    forward (see spec_decode.py).

    method "ngram": prompt lookup, the k tokens that followed the latest earlier occurrence of
    the sequence's last n tokens (n from ngram_max down to ngram_min). method "draft": a
    smaller model with the target's vocabulary proposes; `draft_model` is its path, or None for
    the target itself truncated to its first `draft_num_layers` layers (self-speculative; it
    shares the target's weights and KV cache, so it costs no memory and needs no prefill).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None
    draft_num_layers: int | None = None  # None: a quarter of the target's layers (self-spec)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16], got "
                             f"{self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError("need 1 <= ngram_min <= ngram_max <= 16, got "
                             f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")

