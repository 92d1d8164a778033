"""Read a GGUF file: the model's hyperparameters and its weights under Hugging Face names.

Weights are dequantized to float32 with the `gguf` package's own `gguf.quants.dequantize`, for
every type in SUPPORTED_TYPES. For architectures whose GGUFs llama.cpp writes with its
interleaved rope (Architecture.gguf_permutes_qk: llama, mistral), the rows of Q and K are
permuted in the file; we undo it, because our model (like Hugging Face's) rotates the two
halves of each head (`rotate_half`). Llama 3's rope scaling comes as the `rope_freqs` tensor
(one divisor per frequency), which goes into the config, not the weights.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Set

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine_core.config import ModelConfig
from engine_core.model import architectures
from engine_core.model.rope import partial_rotary_rows
from engine_core.weights.gguf_config import ROPE_TENSORS
from engine_core.weights.gguf_file import GGUFMetadata
from engine_core.weights.gguf_q4 import Q4_TYPES, Q4Weight, unpack_q4
from engine_core.weights.gguf_q8 import Q8_TYPES, Q8Weight, unpack_q8

Q = GGMLQuantizationType
# the quantized types' matmuls take the file's own integers and scales in the C kernels
# (gguf_q4.py, gguf_q8.py); float tensors are requantized to int8 as decode_quant.py describes
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, *Q4_TYPES, *Q8_TYPES}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # mixtures of experts: the router, every expert's matrix stacked in one 3-D tensor
    # ({} is the expert), a shared expert and its gate (Qwen2-MoE: a vector)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# rows dequantized per call of gguf's dequantize: it holds its whole output twice (a list of
# row groups, then their concatenation), so a whole 128k-row embedding would peak at 4 GB
DEQUANTIZE_CHUNK_ELEMENTS = 1 << 24


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A tensor's data as a writable float32 array of its own, [rows, row length] (or 1-D),
    by gguf's `dequantize`, a chunk of rows at a time into one array: its peak is the output
    and one chunk, not twice the output and a copy."""
    if data.ndim < 2 or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        array = dequantize(data, qtype)  # F32: a view of the file, so copied below
        return array if array.flags.writeable and array.dtype == np.float32 \
            else np.array(array, dtype=np.float32)
    rows = data.reshape(-1, data.shape[-1])
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_length = rows.shape[-1] // type_size * block_size  # elements per row
    out = np.empty((rows.shape[0], row_length), dtype=np.float32)
    step = max(1, DEQUANTIZE_CHUNK_ELEMENTS // row_length)
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = dequantize(rows[start:start + step], qtype)
    return out


def hf_name(gguf_name: str, arch: architectures.Architecture | None = None) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    names = _LAYER_NAMES if arch is None else {**_LAYER_NAMES, **dict(arch.gguf_layer_names)}
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m is None or m.group(2) not in names:
        raise ValueError(f"unknown GGUF tensor name {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{names[m.group(2)]}"


def hf_names(t, arch: architectures.Architecture) -> list[str]:
    """The Hugging Face names of a GGUF tensor's matrices: one, or one per expert of a 3-D
    stacked tensor (`ffn_*_exps`, experts outermost)."""
    name = hf_name(t.name, arch)
    if "{}" not in name:
        return [name]
    return [name.format(e) for e in range(int(t.shape[-1]))]  # dims innermost-first


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> two halves per head)."""
    out_dim = w.shape[0]
    head_dim = out_dim // n_heads
    # rows are [head, head_dim/2, 2] in GGUF; Hugging Face wants [head, 2, head_dim/2]
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _per_expert(names: list[str], w):
    """A stacked experts' Q4Weight or Q8Weight (experts' rows one after another) split into
    one weight per expert, under `names`."""
    rows = w.q.shape[0] // len(names)
    for e, name in enumerate(names):
        yield name, w.permute_rows(torch.arange(e * rows, (e + 1) * rows))


class _LazyBlocks(Mapping):
    """HF name -> a Q4Weight or Q8Weight of one family's tensors, unpacked on access
    (GGUFFile.block_weights). The last few tensors' unpacked weights are kept, since a stacked
    experts' tensor holds many weights asked for one after another."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig, types) -> None:
        tensors = gguf._block_tensors(types)
        by_name = {t.name: t for t in tensors}
        self._tensor_of = {name: t.name for t in tensors
                           for name in hf_names(t, gguf.architecture)}  # HF -> GGUF name
        self._gguf_names = set(by_name)
        self._unpack = functools.lru_cache(maxsize=3)(
            lambda gguf_name: dict(gguf._unpacked(by_name[gguf_name], config)))
        # weights unpacked ahead, from a dequantization the dense load made anyway (prime)
        self._primed: dict[str, Q4Weight | Q8Weight] = {}

    def holds(self, gguf_name: str) -> bool:
        """Whether this family unpacks GGUF tensor `gguf_name`."""
        return gguf_name in self._gguf_names

    def prime(self, weights: list[tuple[str, Q4Weight | Q8Weight]]) -> None:
        """Keep these unpacked weights for their first access."""
        self._primed.update(weights)

    def __getitem__(self, name: str):
        primed = self._primed.pop(name, None)
        if primed is not None:
            return primed
        return self._unpack(self._tensor_of[name])[name]

    def __contains__(self, name: object) -> bool:  # (Mapping's would unpack the tensor)
        return name in self._tensor_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensor_of)

    def __len__(self) -> int:
        return len(self._tensor_of)


class GGUFFile(GGUFMetadata):
    """One open GGUF file: metadata, config and weights."""

    def tensor_types(self) -> dict[str, GGMLQuantizationType]:
        """The GGUF type of every weight, by Hugging Face name."""
        return {name: GGMLQuantizationType(t.tensor_type)
                for t in self.reader.tensors if t.name not in ROPE_TENSORS
                for name in hf_names(t, self.architecture)}

    def weights(self, config: ModelConfig, skip: Set[str] = frozenset(),
                blocks: _LazyBlocks | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (Hugging Face name, float32 tensor) for every tensor in the file but those
        whose names are all in `skip` (never read nor dequantized). `blocks`: the q8 family's
        weights (block_weights), primed with each of its tensors unpacked from the
        dequantization made here, so that none is dequantized twice (the IQ types' grid
        lookups are most of a load). Not the output head: with int8 activations the decode
        path requantizes it from the dense copy instead (decode_quant's int4 screen), and a
        Llama 3 head is half a billion weights."""
        permute = self.architecture.gguf_permutes_qk
        holds = set() if blocks is None else {
            t.name for t in self.reader.tensors if blocks.holds(t.name)
            and "lm_head.weight" not in hf_names(t, self.architecture)}
        for t in self.reader.tensors:
            if t.name in ROPE_TENSORS:  # in the config (rope_freq_factors, rope_scaling)
                continue
            if skip and all(n in skip for n in hf_names(t, self.architecture)):
                continue
            qtype = GGMLQuantizationType(t.tensor_type)
            if qtype not in SUPPORTED_TYPES:
                raise ValueError(
                    f"tensor {t.name!r} has GGUF type {qtype.name}, which is not supported "
                    f"(supported: {', '.join(sorted(q.name for q in SUPPORTED_TYPES))})"
                )
            # GGUF lists dims innermost-first; numpy wants them outermost-first
            shape = tuple(int(d) for d in reversed(t.shape))
            array = dequantized(t.data, qtype)
            if t.name in holds:
                blocks.prime(self._unpacked(t, config, dense=array))
            w = torch.from_numpy(array).reshape(shape)
            names = hf_names(t, self.architecture)
            if len(names) > 1:  # stacked experts
                yield from zip(names, w, strict=True)
                continue
            name = names[0]
            if permute and name.endswith("q_proj.weight"):
                w = unpermute_qk(w, config.num_heads)
            elif permute and name.endswith("k_proj.weight"):
                w = unpermute_qk(w, config.num_kv_heads)
            elif name.endswith("shared_expert_gate.weight"):
                w = w.reshape(1, -1)  # llama.cpp's vector: transformers' [1, hidden] matrix
            yield name, w

    def q4_weights(self, config: ModelConfig) -> Iterator[tuple[str, Q4Weight]]:
        """Yield (Hugging Face name, 4-bit weight) for every Q4_0/Q4_1/Q4_K tensor, rows in
        the same order as `weights` gives them (Q/K unpermuted)."""
        for t in self._block_tensors(Q4_TYPES):
            yield from self._unpacked(t, config)

    def q8_weights(self, config: ModelConfig) -> Iterator[tuple[str, Q8Weight]]:
        """Yield (Hugging Face name, q8-family weight) for every matrix in a q8-family type
        (gguf_q8.Q8_TYPES) but the embedding (looked up, not multiplied), rows in the same order as
        `weights` gives them."""
        for t in self._block_tensors(Q8_TYPES):
            yield from self._unpacked(t, config)

    def block_weights(self, config: ModelConfig) -> tuple[Mapping[str, Q4Weight],
                                                          Mapping[str, Q8Weight]]:
        """What q4_weights and q8_weights yield, as mappings that unpack a tensor when one of
        its weights is asked for and keep none: loading holds one tensor's unpacked form at
        a time (a few, for stacked experts), not the whole model's."""
        return _LazyBlocks(self, config, Q4_TYPES), _LazyBlocks(self, config, Q8_TYPES)

    def _block_tensors(self, types) -> list:
        """The tensors of `types` that the block loaders give: no rope factors, and no
        embedding (looked up, not multiplied) in the q8 family."""
        return [t for t in self.reader.tensors
                if GGMLQuantizationType(t.tensor_type) in types and t.name not in ROPE_TENSORS
                and not (types is Q8_TYPES and t.name == "token_embd.weight")]

    def _unpacked(self, t, config: ModelConfig,
                  dense: np.ndarray | None = None) -> list[tuple[str, Q4Weight | Q8Weight]]:
        """One tensor's blocks as (Hugging Face name, weight): one, or one per expert.
        dense: a q8-family tensor's dequantization, where the caller made it already."""
        qtype = GGMLQuantizationType(t.tensor_type)
        rows = t.data.reshape(-1, t.data.shape[-1])
        w = unpack_q4(rows, qtype) if qtype in Q4_TYPES else unpack_q8(rows, qtype, dense)
        names = hf_names(t, self.architecture)
        if len(names) > 1:  # stacked experts: each its rows
            return list(_per_expert(names, w))
        name = names[0]
        heads = {"q_proj.weight": config.num_heads, "k_proj.weight": config.num_kv_heads}
        for suffix, n in heads.items():
            if self.architecture.gguf_permutes_qk and name.endswith(suffix):
                w = w.permute_rows(unpermute_qk(torch.arange(w.q.shape[0]), n))
        return [(name, self._partial_rotary(name, w, config))]

    @staticmethod
    def _partial_rotary(name: str, w, config: ModelConfig):
        """A q/k weight's rows in partial rotary's order, as load_weights orders the dense
        ones (rope.partial_rotary_order)."""
        if config.rotary_dim is None:
            return w
        rows = partial_rotary_rows(name, config.num_heads, config.num_kv_heads,
                                   config.head_dim, config.rotary_dim)
        return w if rows is None else w.permute_rows(rows)
