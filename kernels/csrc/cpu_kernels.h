/* What the C kernels of kernels/csrc share: one library, built by kernels/native.py from every
 * .c file here with -O3 -mavx2 -mfma -fopenmp, plus -mavx512f/bw/vl/dq for the AVX-512 build
 * and -mavx512vnni for the VNNI build, which adds the int8-activation matmul (no -ffast-math:
 * the order of float operations is the one written in each kernel).
 *
 *   matmul.c        4-bit / 8-bit weights, float32 activations   pd_q4_matmul, pd_q8_matmul
 *   matmul_int8.c   the same weights, int8 activations (VNNI)    pd_i8_matmul
 *   attention.c     rope, K/V store and attention of query rows  pd_row_attention (_bf16)
 *   topk.c          each row's k largest values                  pd_topk, pd_select_top
 *   sample.c        temperature/top-k/top-p/min-p and the draw   pd_sample
 *   layers.c        RMSNorm, and whole decoder layers            pd_add_rms_norm (_bf16),
 *                                                                pd_decode_layers
 *   layout.c        the ctypes structs' layout, checked at load  pd_struct_layout
 *
 * Every kernel computes a row's result in an order that depends only on that row, so a row is
 * the same bit for bit alone or batched, on any number of threads (continuous batching must
 * not change a greedy token).
 */
#ifndef PD_CPU_KERNELS_H
#define PD_CPU_KERNELS_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define GROUP 32
#ifdef __AVX512F__
#define ROW_TILE 16 /* rows sharing one expanded weight group: 16 accumulators + 2 weights */
#else
#define ROW_TILE 8 /* 8 accumulators + 4 weights of the 16 AVX2 registers */
#endif
#define L1_ROWS_BYTES (40 * 1024) /* 16-row tiles only while their x fits in L1 (48 KiB) */
#define COL_BLOCK 16 /* output columns per scheduling unit */

static inline uint32_t float_bits(float f) { /* (positive floats order as their bits) */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bfloat16 is a float32's upper half: widening is exact; narrowing rounds to nearest even, as
 * torch does (no NaN here). */
static inline float from_bf16(uint16_t b) { return bits_float((uint32_t)b << 16); }

static inline uint16_t to_bf16(float f) {
    const uint32_t u = float_bits(f);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256 load8_bf16(const uint16_t *p) { /* 8 bfloat16 values as float32 */
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* a . b over n floats: 8 lanes, a fixed tree, then the tail in order (a row's value does not
 * depend on the other rows). */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* e^x for softmax and silu, relative error ~2e-7 */
static inline __m256 exp256(__m256 x) {
    /* e^x = 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2], e^r by a degree-6 polynomial */
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                   _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The last 1..7 rows in one tile, so the weights expand once for them (a step verifying 4
 * drafts has 5 rows: one pass, not a 4-row and a 1-row one). */
#define LAST_ROWS(TILE, LEFT)                                                              \
    switch (LEFT) {                                                                        \
    case 7: TILE(7); break;                                                                \
    case 6: TILE(6); break;                                                                \
    case 5: TILE(5); break;                                                                \
    case 4: TILE(4); break;                                                                \
    case 3: TILE(3); break;                                                                \
    case 2: TILE(2); break;                                                                \
    case 1: TILE(1); break;                                                                \
    default: break;                                                                        \
    }

/* The structs Python passes in through ctypes (kernels/native.py mirrors them, and checks the
 * mirror against pd_struct_layout of layout.c when it loads the library). */
/* Weight kinds (pd_matrix.kind). q4: qs u8 [N, K/32, 16] nibbles, w = q * d + c per 32.
 * The q8 family: qs i8 [N, K], w = q * d (+ c), d (and c) per group of 32 or, "half", of 16:
 *   8: q * d, per 32        Q8_0, Q5_0 (d * (q - 16)), a float tensor requantized
 *   5: q * d + c, per 32    Q5_K, Q5_1, and a Q4_K/Q4_1 part fused beside them
 *   6: q * d, per 16        Q6_K (d * scale_j * (q - 32) per 16)
 *   7: q * d + c, per 16    a fused projection mixing 6 with 5 (q/k Q4_K, v Q6_K)
 * The product is rounded, then c added (two roundings, as gguf's dequantizers do). */
#define KIND_Q4 4
#define KIND_Q8 8
#define KIND_Q8_MIN 5
#define KIND_Q8_HALF 6
#define KIND_Q8_HALF_MIN 7
/* 9: q4's nibbles through a 16-entry table, w = table[q] * d per 32 (IQ4_NL, IQ4_XS, MXFP4:
 * the GGUF's own 4-bit indices and table). qs as q4's [N, K/32, 16], d [N, K/32]; `c` points
 * to the table (16 x i8), not to constants. pd_q8_matmul and pd_i8_matmul take it. */
#define KIND_NL 9
/* Float weights as loaded, [N, K] row-major: 32 float32, 16 bfloat16 (a float32's upper half).
 * No d or c. pd_q8_matmul takes them, with float32 activations only (not pd_i8_matmul). */
#define KIND_F32 32
#define KIND_BF16 16
#define KIND_FLOAT(kind) ((kind) == KIND_F32 || (kind) == KIND_BF16)
#define KIND_HALF(kind) ((kind) == KIND_Q8_HALF || (kind) == KIND_Q8_HALF_MIN)
#define KIND_MIN(kind) ((kind) == KIND_Q8_MIN || (kind) == KIND_Q8_HALF_MIN)

typedef struct {
    int32_t kind;   /* KIND_*, above */
    int32_t int8_x; /* 1: qs, d, c packed in tiles for pd_i8_matmul (VNNI build only) */
    int64_t n, k;
    const void *qs;
    const float *d, *c, *bias; /* c: q4 only; bias [N] or NULL */
} pd_matrix;

/* A mixture of experts' MLP in place of a layer's gate_up and down (pd_decode_layers): a
 * router, num_experts routed experts (each `width` wide) of which top_k run on each row, and
 * an optional shared expert scaled by sigmoid(x . shared_gate). */
typedef struct {
    const float *router;  /* [num_experts, hidden] float32 */
    int32_t num_experts, top_k;
    int32_t norm_topk;    /* 1: the chosen experts' probabilities renormalized to sum to 1 */
    int32_t reserved;
    int64_t width;        /* an expert's intermediate size */
    const pd_matrix *gate_up, *down; /* [num_experts] each */
    int64_t shared_width; /* the shared expert's intermediate size; 0: none */
    pd_matrix shared_gate_up, shared_down;
    const float *shared_gate; /* [hidden] float32 */
    const float *router_bias; /* [num_experts] float32 (GPT-OSS); NULL: none */
} pd_moe;

/* The gated MLP's activation (pd_layer.act): act(g) * u of its gate g and up u, with
 *   ACT_SILU        silu(g) * u
 *   ACT_GELU        gelu_tanh(g) * u (GeGLU)
 *   ACT_SWIGLU_OAI  g' * sigmoid(alpha * g') * (u' + 1), g' = min(g, limit),
 *                   u' = clamp(u, -limit, limit) (GPT-OSS) */
#define ACT_SILU 0
#define ACT_GELU 1
#define ACT_SWIGLU_OAI 2

typedef struct {
    const float *in_norm, *post_norm; /* [hidden] float32: before attention, before the MLP */
    pd_matrix qkv, o, gate_up, down;
    int64_t window; /* a sliding window (pd_row_attention's), 0: global */
    const float *q_norm, *k_norm; /* [D] float32: RMSNorm of each q and k head; NULL: none */
    /* Gemma's sandwich: RMSNorm of the attention's and the MLP's outputs before they join the
     * residual stream, [hidden] float32; NULL: none */
    const float *attn_out_norm, *mlp_out_norm;
    int32_t act;        /* the MLP's activation: ACT_*, above */
    int32_t local_rope; /* 1: rotate with the call's cos_sin_local (Gemma's local layers) */
    float softcap;      /* attention scores capped by softcap * tanh(s / softcap); 0: none */
    float act_alpha, act_limit; /* ACT_SWIGLU_OAI's */
    const float *sinks; /* [Hq] attention sinks (pd_row_attention's); NULL: none */
    const pd_moe *moe;  /* routed experts instead of gate_up and down; NULL: the dense MLP */
} pd_layer;

int pd_q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                 const float *c, int64_t N, float *y, int threads);
int pd_q8_matmul(const float *x, int64_t M, int64_t K, int kind, const int8_t *qs,
                 const float *d, const float *c, int64_t N, float *y, int threads);
#ifdef __AVX512VNNI__
int pd_i8_matmul(const float *x, int64_t M, int64_t K, int kind, const uint8_t *w,
                 const float *d, const float *c, int64_t N, float *y, int threads);
#endif
int pd_row_attention(float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin,
                        void *kv, int kv_bf16, const int64_t *slots, const int32_t *tables,
                        int64_t table_stride, const int32_t *table_of_row, const int32_t *lens,
                        int bs, float scale, float *out, int64_t max_len, int threads,
                        int64_t window, float softcap, const float *sinks);
int pd_row_attention_bf16(const uint16_t *qkv16, float *work, int64_t S, int Hq, int Hkv, int D,
                          const float *cos_sin, void *kv, int kv_bf16, const int64_t *slots,
                          const int32_t *tables, int64_t table_stride,
                          const int32_t *table_of_row, const int32_t *lens, int bs, float scale,
                          uint16_t *out16, int64_t max_len, int threads, int64_t window,
                          float softcap, const float *sinks);
int pd_moe_experts(const float *x, int64_t S, int64_t H, const pd_matrix *gate_up,
                   const pd_matrix *down, int num_experts, int64_t I, int act, float act_alpha,
                   float act_limit,
                   const int64_t *counts, const int64_t *rows, const float *weights, float *out,
                   int threads);
void pd_topk_row(const float *row, int64_t N, int k, int64_t *idx);
void pd_select_top(const float *row, int64_t n, int k, int64_t *idx);
void pd_sample(float *x, int64_t M, int64_t V, const float *temperature, const int64_t *top_k,
               const float *top_p, const float *min_p, const double *u, int64_t *out,
               int64_t *num_kept, int threads);
void pd_add_rms_norm(float *x, const float *residual, const float *weight, float eps,
                     float *y, int64_t rows, int64_t dim);
void pd_add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                          float eps, uint16_t *y, int64_t rows, int64_t dim, int threads);
int pd_struct_layout(int s, int i, const char **name, int64_t *offset, int64_t *size);

#endif
