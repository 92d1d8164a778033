"""GGUF quant types: every supported type loads bit-equal to `gguf.quants.dequantize`, a model
in each family matches transformers on the same weights, and every quantized type decodes in
the C kernels from the file's own integers and scales.

The tiny model is 256 wide (a K-quant super-block is 256 weights). gguf writes F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 itself; the K-quants and IQ types it reads but does not write,
so their blocks are random with small, finite scales (tiny_models.random_blocks)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine_core.weights import gguf_loader
from engine_core.weights.gguf_loader import SUPPORTED_TYPES, GGUFFile
from tests.engine_core import tiny_models as tm

transformers = pytest.importorskip("transformers")

WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, vocab_size=256)
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
         Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, *tm.IQ_TYPES, Q.MXFP4]


def test_supported_types_are_the_issue_list():
    assert set(TYPES) == SUPPORTED_TYPES


def gguf_model(tmp_path, qtype, **overrides):
    """(transformers model holding the GGUF's dequantized weights, GGUF path)."""
    hf = tm.build_hf(transformers.LlamaConfig, tmp_path / "hf", **{**WIDE, **overrides})
    path = tmp_path / f"m-{qtype.name}.gguf"
    held = tm.write_gguf(hf, path, qtype=qtype)
    tm.use_held_weights(hf, held)
    return hf, path


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_weights_bit_equal_to_gguf_dequantize(qtype, tmp_path, monkeypatch):
    # a few rows per call of gguf's dequantize, as on a real model's largest tensors
    monkeypatch.setattr(gguf_loader, "DEQUANTIZE_CHUNK_ELEMENTS", 3 * 256)
    hf, path = gguf_model(tmp_path, qtype)
    f = GGUFFile(path)
    ours = dict(f.weights(f.model_config()))
    expected = {n: p for n, p in hf.state_dict().items() if "rotary" not in n}
    assert set(ours) == set(expected)
    for name, w in ours.items():
        assert w.dtype == torch.float32
        assert torch.equal(w, expected[name]), name  # bit for bit (Q/K unpermuted)
    types = set(f.tensor_types().values())
    assert qtype in types


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.BF16, Q.IQ4_XS, Q.IQ2_XXS],
                         ids=lambda q: q.name)
def test_quantized_model_matches_transformers(qtype, tmp_path):
    hf, path = gguf_model(tmp_path, qtype)
    eng = tm.engine(path)
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    for p in prompts:
        assert tm.relative_error(tm.prompt_logits(eng, p), tm.hf_logits(hf, p)) < 1e-3
    for p, got in zip(prompts, tm.greedy(eng, prompts, 48), strict=True):
        assert got == tm.hf_greedy(hf, p, 48)


def test_q4_1_keeps_its_c_decode_path(tmp_path):
    from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeQ4Matmul
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    _, path = gguf_model(tmp_path, Q.Q4_1)
    eng = tm.engine(path, quantize_decode=True)
    proj = eng.model.layers[0].self_attn.qkv_proj
    assert isinstance(proj, DecodeQuantLinear) and isinstance(proj.quant, NativeQ4Matmul)
    assert eng.runner.quantization.decode_layers is not None  # every layer in one C call


def test_q4_k_blocks_expand_to_gguf_dequantize():
    """Q4_K as 4-bit groups of 32 (gguf_q4.unpack_q4_k): the groups' expansion is gguf's own
    dequantization bit for bit."""
    import numpy as np
    from gguf.quants import dequantize

    from engine_core.weights.gguf_q4 import unpack_q4

    raw = tm.random_blocks(Q.Q4_K, 6, 512, seed=3)
    w = unpack_q4(raw, Q.Q4_K)
    expected = np.asarray(dequantize(raw, Q.Q4_K), dtype=np.float32).reshape(6, 512)
    assert torch.equal(w.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_q4_k_decodes_in_c(activations, tmp_path):
    """Q4_K tensors take the C 4-bit decode path (all layers in one call) as Q4_1 does; with
    float32 activations the greedy tokens equal the dense engine's."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeQ4Matmul
    from kernels import native

    lib = native.load()
    if lib is None:
        pytest.skip("the C kernels do not load here")
    if activations == "int8" and not native.has_int8(lib):
        pytest.skip("int8 activations are in the VNNI build only")
    _, path = gguf_model(tmp_path, Q.Q4_K)
    eng = tm.engine(path, quantize_decode=True, decode_activations=activations)
    proj = eng.model.layers[0].mlp.down_proj
    assert isinstance(proj, DecodeQuantLinear) and isinstance(proj.quant, NativeQ4Matmul)
    assert eng.runner.quantization.decode_layers is not None
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    got = tm.greedy(eng, prompts, 16)
    if activations == "float32":
        assert got == tm.greedy(tm.engine(path), prompts, 16)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_q5_0_and_q8_0_decode_in_c_with_the_files_scales(qtype, tmp_path):
    """Q5_0 (d * (q - 16)) and Q8_0 (d * q) are int8 with the file's block scales: the C
    int8 matmul's weights are the file's values exactly (d * q back equals the dense
    weight), and the decode rows' greedy tokens equal the dense engine's."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeQ8Matmul
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    _, path = gguf_model(tmp_path, qtype)
    eng = tm.engine(path, quantize_decode=True, decode_activations="float32")
    proj = eng.model.layers[1].self_attn.qkv_proj
    assert isinstance(proj, DecodeQuantLinear) and isinstance(proj.quant, NativeQ8Matmul)
    q = proj.quant.qs.float().view(proj.quant.n, -1, 32)  # [N, K / 32, 32]
    back = (q * proj.quant.d[..., None]).view(proj.quant.n, -1)
    assert torch.equal(back, proj.dense.weight.float())
    assert eng.runner.quantization.decode_layers is not None
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    assert tm.greedy(eng, prompts, 16) == tm.greedy(tm.engine(path), prompts, 16)


def raw_blocks(qtype, rows: int, cols: int, seed: int):
    """[rows, bytes] raw blocks: gguf's own quantization of random weights where it writes the
    type, random blocks (tiny_models.random_blocks) for the K-quants it only reads."""
    import numpy as np
    from gguf.quants import quantize

    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, *tm.IQ_TYPES):
        return tm.random_blocks(qtype, rows, cols, seed)
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return quantize(w, qtype)


@pytest.mark.parametrize("qtype", [Q.Q5_K, Q.Q6_K, Q.Q3_K, Q.Q2_K, Q.Q5_1, Q.Q5_0, Q.Q8_0,
                                   *tm.IQ_TYPES, Q.MXFP4], ids=lambda q: q.name)
def test_q8_family_expands_to_gguf_dequantize_and_multiplies_in_c(qtype):
    """The q8 form of a tensor (gguf_q8.unpack_q8) expands to gguf's own dequantization bit
    for bit, and the C matmul of decode rows (float32 activations) equals that dequantized
    weight times x, computed by torch in float64, to float32 rounding."""
    import numpy as np
    from gguf.quants import dequantize

    from engine_core.platforms.cpu.decode_quant import NativeQ8Matmul
    from engine_core.weights.gguf_q8 import unpack_q8
    from kernels import native

    raw = raw_blocks(qtype, 40, 512, seed=qtype.value)
    w = unpack_q8(raw, qtype)
    expected = torch.from_numpy(np.asarray(dequantize(raw, qtype), dtype=np.float32)
                                .reshape(40, 512))
    assert torch.equal(w.dequantize(), expected)
    half = {Q.Q6_K: 6, Q.Q3_K: 6, Q.IQ2_XS: 6, Q.IQ2_S: 6, Q.Q2_K: 7}  # scales per 16
    nl = dict.fromkeys((Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4), 9)  # 4-bit indices into a table
    assert w.kind == {**half, **nl, Q.Q5_K: 5, Q.Q5_1: 5}.get(qtype, 8)
    lib = native.load()
    if lib is None:
        pytest.skip("the C kernels do not load here")
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(NativeQ8Matmul(w, lib)(x).double(),
                               x.double() @ expected.double().T, atol=1e-5, rtol=1e-5)


def test_fused_projection_of_q4_k_and_q6_k_parts_is_one_exact_matrix():
    """q/k in Q4_K and v in Q6_K (as Q4_K_M files hold them) fuse into one half-kind matrix
    with a constant (kind 7) whose weights are each part's gguf dequantization."""
    import numpy as np
    from gguf.quants import dequantize

    from engine_core.weights.gguf_q4 import unpack_q4
    from engine_core.weights.gguf_q8 import Q8Weight, unpack_q8

    a, b = tm.random_blocks(Q.Q4_K, 8, 256, 1), tm.random_blocks(Q.Q6_K, 4, 256, 2)
    fused = Q8Weight.cat([Q8Weight.from_q4(unpack_q4(a, Q.Q4_K)), unpack_q8(b, Q.Q6_K)])
    assert fused.kind == 7
    expected = np.concatenate([np.asarray(dequantize(a, Q.Q4_K)).reshape(8, 256),
                               np.asarray(dequantize(b, Q.Q6_K)).reshape(4, 256)])
    assert torch.equal(fused.dequantize(), torch.from_numpy(expected.astype(np.float32)))


@pytest.mark.parametrize("qtype", [Q.Q6_K, Q.Q5_K, Q.Q3_K, Q.Q2_K, *tm.IQ_TYPES],
                         ids=lambda q: q.name)
def test_k_quants_and_iq_types_decode_in_c(qtype, tmp_path):
    """Q6_K, Q5_K, Q3_K, Q2_K and the IQ types decode in C from their own integers and scales
    (all layers in one call); float32 activations give the dense engine's tokens."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeQ8Matmul
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    _, path = gguf_model(tmp_path, qtype)
    eng = tm.engine(path, quantize_decode=True, decode_activations="float32")
    proj = eng.model.layers[0].mlp.down_proj
    assert isinstance(proj, DecodeQuantLinear) and isinstance(proj.quant, NativeQ8Matmul)
    # its weights are the file's: q * d (+ c), or table[q] * d, is the dense weight
    assert torch.equal(proj.quant.expanded(), proj.dense.weight.float())
    # the 4-bit table types keep 4 bits a weight (kind 9), half the bytes of int8
    assert (proj.quant.kind == 9) == (qtype in (Q.IQ4_NL, Q.IQ4_XS))
    assert eng.runner.quantization.decode_layers is not None
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    assert tm.greedy(eng, prompts, 16) == tm.greedy(tm.engine(path), prompts, 16)


@pytest.mark.parametrize("qtype", [Q.Q3_K, Q.Q2_K, Q.IQ3_XXS, Q.IQ2_XXS, Q.IQ1_S],
                         ids=lambda q: q.name)
def test_low_bit_types_on_the_cpu_defaults(qtype, tmp_path):
    """The types below 4 bits (most of a Q3_K_M, Q2_K, IQ3_XXS or IQ2_XXS file) on the
    defaults users get: bf16, int8 decode activations where the CPU has VNNI. Every
    projection and the layers' one C call take the file's integers, and each projection's
    decode rows stay within int8 activations' error of the dense weight's product."""
    from engine_core.platforms.cpu.decode_quant import DecodeQuantLinear, NativeQ8Matmul
    from kernels import native

    lib = native.load()
    if lib is None:
        pytest.skip("the C kernels do not load here")
    _, path = gguf_model(tmp_path, qtype)
    eng = tm.engine(path, quantize_decode=True, dtype="bfloat16")  # activations: the default
    layer = eng.model.layers[1]
    x = torch.randn(5, WIDE["hidden_size"], generator=torch.Generator().manual_seed(2))
    for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        assert isinstance(proj, DecodeQuantLinear) and isinstance(proj.quant, NativeQ8Matmul)
        assert proj.quant.int8 == native.has_int8(lib)  # int8 activations where VNNI is
        exact = x.double() @ proj.dense.weight.double().T  # (bf16: within 0.4 % of the file)
        got = proj.quant(x).double()
        assert ((got - exact).norm() / exact.norm()).item() < 0.02
    assert eng.runner.quantization.decode_layers is not None
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    for tokens in tm.greedy(eng, prompts, 16):
        assert len(tokens) == 16


@pytest.mark.parametrize("qtype", [Q.Q3_K, Q.IQ2_XXS], ids=lambda q: q.name)
def test_the_decode_integers_reuse_the_dense_loads_dequantization(qtype, tmp_path,
                                                                  monkeypatch):
    """With a dense copy (prefill_weights dense), each q8-family matrix is dequantized once:
    its integers come from the dequantization the dense load made (the IQ types' grid lookups
    are most of a load); only the output head, which the int8 path requantizes from the dense
    copy instead, would unpack its own, but a head this small is dense for every row. Without
    a dense copy (quantized) every tensor unpacks its own. Both recover the integers a few blocks at a time."""
    from engine_core.weights import gguf_q8
    from kernels import native

    if native.load() is None:
        pytest.skip("the C kernels do not load here")
    monkeypatch.setattr(gguf_q8, "UNPACK_CHUNK_ELEMENTS", 3 * 256)  # several chunks a tensor
    own = []  # the shapes of the tensors unpacked from their own blocks
    real = gguf_loader.unpack_q8
    monkeypatch.setattr(gguf_loader, "unpack_q8", lambda data, q, dense=None: (
        own.append(data.shape) if dense is None else None) or real(data, q, dense))
    _, path = gguf_model(tmp_path, qtype)
    eng = tm.engine(path, quantize_decode=True, decode_activations="float32",
                    prefill_weights="dense")
    # a head this small stays dense for decode rows (decode_quant.DENSE_LM_HEAD_MAX_BYTES):
    # the dense load's dequantization serves it, nothing is unpacked
    assert own == []
    for proj in (eng.model.layers[0].self_attn.qkv_proj, eng.model.layers[1].mlp.down_proj):
        assert torch.equal(proj.quant.expanded(), proj.dense.weight.float())
    prompts = tm.prompts(WIDE["vocab_size"], [9, 40])
    want = tm.greedy(eng, prompts, 8)
    own.clear()
    blocks_only = tm.engine(path, quantize_decode=True, decode_activations="float32",
                            prefill_weights="quantized")
    assert len(own) > 2 * 4  # every layer's matrices
    assert tm.greedy(blocks_only, prompts, 8) == want
