/* CPU kernels for decode rows: weight-only quantized matmuls with float32 activations.
 *
 * A decode step reads every weight once to produce one token per sequence, so it is bound by
 * the weights' bytes, not by arithmetic. These kernels read 4-bit or 8-bit weights in groups
 * of 32 along K, expand each group to float32 in registers (exactly the dequantized weight
 * the dense model holds) and multiply it into float32 activations with FMAs: AVX2, or AVX-512
 * in the build for CPUs that have it (kernels/native.py builds both, loads the widest).
 *
 *   q4 weights: qs [N, K/32, 16] u8   weight j of a group: qs[j] & 0xF, weight j+16: qs[j] >> 4
 *               d, c [N, K/32] f32                    (from the GGUF's own Q4_0/Q4_1 blocks:
 *               w = q * d + c                          c = m - off * d, off 8 for Q4_0, else 0)
 *   q8 weights: qs [N, K] i8, d [N, K/32] f32        w = q * d
 *
 * y[r, n] is computed by one thread in a fixed order (8 or 16 float lanes over K, then one
 * horizontal sum), whatever the number of rows or threads: a row's result is the same bit
 * for bit alone or batched (continuous batching must not change a greedy token). The two
 * builds round differently from each other; each is invariant in itself.
 *
 * Work is handed to threads with schedule(guided): chunks that shrink as the work runs out.
 * Which thread computes a column does not change its value. Behind a server, the gateway's and
 * the clients' threads share the cores; when one of ours is descheduled, the other takes the
 * remaining chunks instead of waiting at the barrier for its fixed half. Measured (colocated
 * gateway, batch-1 decode on 2 cores): tokens 18.4 ms apart with guided, 23.3 ms with static;
 * schedule(dynamic, 1) cost 30 % offline.
 *
 * Built by kernels/native.py with -O3 -mavx2 -mfma -fopenmp, plus -mavx512f/bw/vl/dq for the
 * AVX-512 build (no -ffast-math: the order of float operations is the one written here).
 */
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

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 nibbles of a q4 group as floats 0..15, in weight order. */
static inline void nibbles_q4(const uint8_t *qs, __m256 q[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(b, mask);                      /* weights 0..15 */
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);   /* weights 16..31 */
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

static inline void expand_q8(const int8_t *qs, __m256 d, __m256 w[4]) {
    for (int i = 0; i < 4; i++) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(qs + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
    }
}

/* acc[r] += x[r, group] . w for the rows of a tile; each row's operations are the same
 * whatever the tile size, so tiling does not change any result. */
static inline __attribute__((always_inline)) void fma_rows(
        const float *x, int64_t K, const int rows, const __m256 w[4], __m256 *acc) {
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) {
        const float *xr = x + r * K;
        __m256 a = acc[r];
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], a);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], a);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], a);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], a);
        acc[r] = a;
    }
}

/* a . b over n floats: 8 lanes, a fixed tree, then the tail in order. */
static inline float dot(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Rows 0 .. rows - 1 of one column: sum_g d_g * (x_g . q_g) + sum_g c_g * sum(x_g), with
 * c = m - off * d the constant part of each group's weights. The nibbles are expanded to floats
 * once per group and the group's scale applied to the 8-lane partial product; the constant
 * part multiplies the group sums of x (xsum, computed per call). `rows` is a compile-time
 * constant at every call (the tile is unrolled and its accumulators stay in registers), and
 * every row runs the same operations whatever the tile size. */
#ifdef __AVX512F__
/* AVX-512 (built when the CPU has it, see kernels/native.py): a group is two 16-float vectors.
 * The group's weights are formed once (q4: q * d + c with one FMA as in the dense model; q8:
 * q * d) and shared by the tile's rows: two FMAs per row and group (the AVX2 q4 tile below
 * needs five), and no constant-part epilogue (xsum is not used). `q4` is a compile-time
 * constant at both calls. */
static inline __attribute__((always_inline)) void tile512(
        const float *x, int64_t K, const void *qs, const float *d, const float *c, float *y,
        int64_t N, const int rows, const int q4) {
    const int64_t groups = K / GROUP;
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m512 acc[ROW_TILE];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m512 dg = _mm512_set1_ps(d[g]);
        __m512 w0, w1;
        if (q4) {
            const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + g * 16));
            const __m512 cg = _mm512_set1_ps(c[g]);
            w0 = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), dg, cg);
            w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                     _mm_and_si128(_mm_srli_epi16(b, 4), mask))), dg, cg);
        } else {
            const __m128i *q = (const __m128i *)((const int8_t *)qs + g * GROUP);
            w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), dg);
            w1 = _mm512_mul_ps(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), dg);
        }
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * K + g * GROUP;
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) y[r * N] = _mm512_reduce_add_ps(acc[r]);
}

static inline __attribute__((always_inline)) void q4_tile(
        const float *x, const float *xsum, int64_t K, const uint8_t *qs, const float *d,
        const float *c, float *y, int64_t N, const int rows) {
    (void)xsum;
    tile512(x, K, qs, d, c, y, N, rows, 1);
}
#else
static inline __attribute__((always_inline)) void q4_tile(
        const float *x, const float *xsum, int64_t K, const uint8_t *qs, const float *d,
        const float *c, float *y, int64_t N, const int rows) {
    const int64_t groups = K / GROUP;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 q[4];
        nibbles_q4(qs + g * 16, q);
        const __m256 dg = _mm256_set1_ps(d[g]);
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * K + g * GROUP;
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1], t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q[2], t);
            t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3], t);
            acc[r] = _mm256_fmadd_ps(t, dg, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
        y[r * N] = hsum(acc[r]) + dot(c, xsum + r * groups, groups);
}
#endif

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

/* Columns n0 .. n1 - 1 for all M rows. Row tiles are the outer loop: a tile's rows of x stay
 * in L1 while every column of the block reads them. With columns outer, x came from L2 for
 * each column: the 120 layer matmuls of a 32-row step took 96.6 ms, now 71.5 ms (2 threads). */
static void q4_columns(const float *x, const float *xsum, int64_t M, int64_t K,
                       const uint8_t *qs, const float *d, const float *c, int64_t n0,
                       int64_t n1, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
#define Q4_TILE(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        q4_tile(x + r * K, xsum + r * groups, K, qs + n * groups * 16, d + n * groups,     \
                c + n * groups, y + r * N + n, N, ROWS)
    int64_t r = 0;
#if ROW_TILE > 8
    if (K * ROW_TILE * sizeof(float) <= L1_ROWS_BYTES)
        for (; r + ROW_TILE <= M; r += ROW_TILE) Q4_TILE(ROW_TILE);
#endif
    for (; r + 8 <= M; r += 8) Q4_TILE(8);
    LAST_ROWS(Q4_TILE, M - r);
#undef Q4_TILE
}

#ifdef __AVX512F__
static inline __attribute__((always_inline)) void q8_tile(
        const float *x, int64_t K, const int8_t *qs, const float *d, float *y, int64_t N,
        const int rows) {
    tile512(x, K, qs, d, 0, y, N, rows, 0);
}
#else
static inline __attribute__((always_inline)) void q8_tile(
        const float *x, int64_t K, const int8_t *qs, const float *d, float *y, int64_t N,
        const int rows) {
    const int64_t groups = K / GROUP;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 w[4];
        expand_q8(qs + g * GROUP, _mm256_set1_ps(d[g]), w);
        fma_rows(x + g * GROUP, K, rows, w, acc);
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) y[r * N] = hsum(acc[r]);
}
#endif

/* Columns n0 .. n1 - 1 for all M rows, row tiles outer (see q4_columns). */
static void q8_columns(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                       int64_t n0, int64_t n1, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
#define Q8_TILE(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        q8_tile(x + r * K, K, qs + n * K, d + n * groups, y + r * N + n, N, ROWS)
    int64_t r = 0;
#if ROW_TILE > 8
    if (K * ROW_TILE * sizeof(float) <= L1_ROWS_BYTES)
        for (; r + ROW_TILE <= M; r += ROW_TILE) Q8_TILE(ROW_TILE);
#endif
    for (; r + 8 <= M; r += 8) Q8_TILE(8);
    LAST_ROWS(Q8_TILE, M - r);
#undef Q8_TILE
}

/* y [M, N] = x [M, K] @ W.T, W as q4 (see the top of the file). K % 32 == 0.
 * Returns 0, or -1 when out of memory. */
int pd_q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                 const float *c, int64_t N, float *y, int threads) {
    const int64_t blocks = (N + COL_BLOCK - 1) / COL_BLOCK;
#ifdef __AVX512F__
    float *xsum = 0; /* the AVX-512 tile adds the constant part to its weights */
#else
    const int64_t groups = K / GROUP;
    float *xsum = malloc((size_t)(M * groups) * sizeof(float));
    if (xsum == 0) return -1;
    for (int64_t i = 0; i < M * groups; i++) {
        const float *xg = x + i * GROUP;
        float s = 0.0f;
        for (int j = 0; j < GROUP; j++) s += xg[j];
        xsum[i] = s;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * COL_BLOCK < N ? (b + 1) * COL_BLOCK : N;
        q4_columns(x, xsum, M, K, qs, d, c, b * COL_BLOCK, end, y, N);
    }
    free(xsum);
    return 0;
}

/* y [M, N] = x [M, K] @ W.T, W as q8 (see the top of the file). K % 32 == 0. */
void pd_q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                  int64_t N, float *y, int threads) {
    const int64_t blocks = (N + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * COL_BLOCK < N ? (b + 1) * COL_BLOCK : N;
        q8_columns(x, M, K, qs, d, b * COL_BLOCK, end, y, N);
    }
}

/* ---- decode attention --------------------------------------------------------------------
 *
 * One call per layer for the decode rows of a step, computed in float32: rotary embedding of
 * q and k, K/V stored into the paged cache, then attention of each row over its own context.
 *
 *   qkv      [S, (Hq + 2 Hkv) * D]   the qkv projection's rows; q and k are rotated in place
 *   cos_sin  [S, D]                  cos of each row's position in the first half, sin after
 *   kv       [num_blocks, 2, bs, Hkv, D]   float32 or bfloat16 (engine_core/kv_cache/layout.py)
 *   slots    [S] int64               block * bs + offset of each row's new K/V; < 0: not stored
 *   tables   [S, table_stride] int32, lens [S] int32 (keys to attend to, the row's own included)
 *   out      [S, Hq * D]
 *
 * Every row is stored before any row attends (a draft token attends to the drafts before it).
 * A (row, head) is computed by one thread in a fixed order that depends only on its own
 * context: the result is the same alone or batched, on any number of threads. Softmax is
 * exact up to expf's rounding (exp256 below, relative error ~2e-7). */

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

static void rope_row(float *x, const float *cs, int heads, int D) {
    const int half = D / 2;
    for (int h = 0; h < heads; h++) {
        float *a = x + h * D, *b = a + half;
        for (int i = 0; i < half; i++) {
            float c = cs[i], s = cs[half + i], x1 = a[i], x2 = b[i];
            a[i] = x1 * c - x2 * s;
            b[i] = x2 * c + x1 * s;
        }
    }
}

/* The cache holds float32 or bfloat16 (a float32's upper half); the kernels compute in float32.
 * `bf16` is a compile-time constant at every call below: each function exists in both forms. */
static inline __attribute__((always_inline)) __m256 load8(const void *kv, int64_t i,
                                                          const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)kv + i))),
            16));
    return _mm256_loadu_ps((const float *)kv + i);
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch; no NaN here */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* keys[j] = element offset of position j's key, head 0, for j < len: walks the block table
 * (no division per key). Its value is at keys[j] + bs * token_stride. */
static void key_offsets(const int32_t *table, int64_t len, int bs, int64_t token_stride,
                        int64_t *keys) {
    int64_t j = 0;
    for (int64_t b = 0; j < len; b++) {
        const int64_t base = (int64_t)table[b] * 2 * bs;
        for (int off = 0; off < bs && j < len; off++, j++) keys[j] = (base + off) * token_stride;
    }
}

/* scores[j] = scale * q . k_j for j < len, 8 keys at a time (their 8 accumulators are summed
 * lane-wise by a fixed hadd tree), the tail one key at a time. D % 8 == 0. */
static inline __attribute__((always_inline)) void head_scores(
        const float *q, const void *kv, const int64_t *keys, int64_t len, int64_t head,
        int D, float scale, float *scores, const int bf16) {
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 acc[8];
        int64_t k[8];
        for (int i = 0; i < 8; i++) {
            k[i] = keys[j + i] + head;
            acc[i] = _mm256_setzero_ps();
        }
        for (int d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(qd, load8(kv, k[i] + d, bf16), acc[i]);
        }
        __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
        __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
        __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
        /* lanes: [k0 k1 k2 k3 | k0 k1 k2 k3] halves of 0..3, likewise 4..7 */
        __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
        __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(_mm256_add_ps(lo, hi),
                                                   _mm256_set1_ps(scale)));
    }
    for (; j < len; j++) {
        const int64_t k = keys[j] + head;
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(kv, k + d, bf16), acc);
        scores[j] = hsum(acc) * scale;
    }
}

/* out = softmax(scores) @ V for one head; scores is overwritten with the probabilities. */
static inline __attribute__((always_inline)) void head_output(
        float *scores, const void *kv, const int64_t *keys, int64_t len, int64_t value,
        int D, float *out, const int bf16) {
    float mx = scores[0];
    for (int64_t j = 1; j < len; j++) mx = scores[j] > mx ? scores[j] : mx;
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), vmx));
        _mm256_storeu_ps(scores + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    float sum = hsum(vsum);
    for (; j < len; j++) {
        float tail[8] = {scores[j] - mx};
        float p = _mm256_cvtss_f32(exp256(_mm256_loadu_ps(tail)));
        scores[j] = p;
        sum += p;
    }
    __m256 acc[16]; /* D <= 128 */
    const int nv = D / 8;
    for (int i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
    for (j = 0; j < len; j++) {
        const int64_t v = keys[j] + value;
        const __m256 p = _mm256_set1_ps(scores[j]);
        for (int i = 0; i < nv; i++)
            acc[i] = _mm256_fmadd_ps(p, load8(kv, v + 8 * i, bf16), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

static inline __attribute__((always_inline)) int decode_attention(
        float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin, void *kv,
        const int64_t *slots, const int32_t *tables, int64_t table_stride, const int32_t *lens,
        int bs, float scale, float *out, int64_t max_len, int threads, const int bf16) {
    const int64_t row_stride = (int64_t)(Hq + 2 * Hkv) * D, token_stride = (int64_t)Hkv * D;
    for (int64_t s = 0; s < S; s++) {
        float *row = qkv + s * row_stride;
        rope_row(row, cos_sin + s * D, Hq + Hkv, D); /* q heads, then k heads */
        if (slots[s] < 0) continue;
        int64_t block = slots[s] / bs, off = slots[s] % bs;
        int64_t k = ((block * 2) * bs + off) * token_stride;
        int64_t v = ((block * 2 + 1) * bs + off) * token_stride;
        for (int64_t i = 0; i < token_stride; i++) {
            if (bf16) {
                ((uint16_t *)kv)[k + i] = to_bf16(row[Hq * D + i]);
                ((uint16_t *)kv)[v + i] = to_bf16(row[(Hq + Hkv) * D + i]);
            } else {
                ((float *)kv)[k + i] = row[Hq * D + i];
                ((float *)kv)[v + i] = row[(Hq + Hkv) * D + i];
            }
        }
    }
    const int group = Hq / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* this thread's scratch: one row's key offsets, one head's scores */
        int64_t *keys = malloc((size_t)max_len * sizeof(int64_t)), row = -1;
        float *scores = malloc((size_t)max_len * sizeof(float));
        if (scores == 0 || keys == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < S * Hq; item++) {
            if (scores == 0 || keys == 0) continue;
            int64_t s = item / Hq;
            int hq = (int)(item % Hq), h = hq / group;
            if (s != row) { /* a thread's items come in order: a row's heads share its keys */
                key_offsets(tables + s * table_stride, lens[s], bs, token_stride, keys);
                row = s;
            }
            head_scores(qkv + s * row_stride + hq * D, kv, keys, lens[s], (int64_t)h * D, D,
                        scale, scores, bf16);
            head_output(scores, kv, keys, lens[s], bs * token_stride + (int64_t)h * D, D,
                        out + s * Hq * D + hq * D, bf16);
        }
        free(keys);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* kv_bf16: the cache holds bfloat16 (the new K/V are rounded to it), else float32.
 * max_len >= every lens[s]. D % 8 == 0, D <= 128. Returns 0, or -1 when out of memory. */
int pd_decode_attention(float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin,
                        void *kv, int kv_bf16, const int64_t *slots, const int32_t *tables,
                        int64_t table_stride, const int32_t *lens, int bs, float scale,
                        float *out, int64_t max_len, int threads) {
    if (kv_bf16)
        return decode_attention(qkv, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride,
                                lens, bs, scale, out, max_len, threads, 1);
    return decode_attention(qkv, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride, lens,
                            bs, scale, out, max_len, threads, 0);
}

/* x += residual (when given), then y = rmsnorm(x) * weight, per row of `dim`. Sum of squares
 * in 8 float lanes then a fixed tree, per row: independent of the number of rows. */
void pd_add_rms_norm(float *x, const float *residual, const float *weight, float eps,
                     float *y, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (residual != 0) {
            const float *a = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) xr[i] += a[i];
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        float *yr = y + r * dim;
        for (i = 0; i < dim; i++) yr[i] = (xr[i] * inv) * weight[i];
    }
}

/* ---- whole decoder layers for decode rows ------------------------------------------------
 *
 * The decode rows of a step through num_layers Llama layers in one call, float32, with the
 * kernels above: no Python between the 10 operations of a layer. Per layer, with h the
 * residual stream:
 *
 *   x = rmsnorm(h) * in_norm          (layer 0; later layers get it from the add below)
 *   qkv = x @ Wqkv (+ bias); rope, K/V store, attention -> a; h += a @ Wo
 *   x = rmsnorm(h) * post_norm;  g|u = x @ Wgate_up;  h += (silu(g) * u) @ Wdown
 *
 * and at the end out = rmsnorm(h) * final_norm. The operations and their order are those of
 * the per-operation path (pd_add_rms_norm, pd_q4_matmul / pd_q8_matmul, pd_decode_attention),
 * so every row is still batch and thread invariant. */

typedef struct {
    int32_t kind; /* 4: q4 (qs u8 [N, K/32, 16], d, c); 8: q8 (qs i8 [N, K], d) */
    int32_t unused;
    int64_t n, k;
    const void *qs;
    const float *d, *c, *bias; /* c: q4 only; bias [N] or NULL */
} pd_matrix;

typedef struct {
    const float *in_norm, *post_norm; /* [hidden] float32 */
    pd_matrix qkv, o, gate_up, down;
} pd_layer;

static int matmul(const float *x, int64_t M, const pd_matrix *w, float *y, int threads) {
    int status = 0;
    if (w->kind == 4)
        status = pd_q4_matmul(x, M, w->k, (const uint8_t *)w->qs, w->d, w->c, w->n, y, threads);
    else
        pd_q8_matmul(x, M, w->k, (const int8_t *)w->qs, w->d, w->n, y, threads);
    if (w->bias != 0)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < w->n; j++) y[r * w->n + j] += w->bias[j];
    return status;
}

/* act[r, :] = silu(gu[r, :I]) * gu[r, I:], silu(g) = g / (1 + e^-g) */
static void silu_mul(const float *gu, int64_t M, int64_t I, float *act) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            _mm256_storeu_ps(a + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) {
            float tail[8] = {-g[i]};
            float e = _mm256_cvtss_f32(exp256(_mm256_loadu_ps(tail)));
            a[i] = g[i] / (1.0f + e) * u[i];
        }
    }
}

/* h [S, H]: the rows' embeddings in, their residual stream after the last layer out.
 * kv: layer l's cache at kv + l * layer_stride elements (float32 or bfloat16, kv_bf16).
 * out [S, H]: rmsnorm(h) * final_norm. Returns 0, or -1 when out of memory. */
int pd_decode_layers(float *h, int64_t S, int64_t H, const pd_layer *layers, int num_layers,
                     int64_t I, float eps, int Hq, int Hkv, int D, const float *cos_sin,
                     void *kv, int64_t layer_stride, int kv_bf16, const int64_t *slots,
                     const int32_t *tables, int64_t table_stride, const int32_t *lens, int bs,
                     float scale, int64_t max_len, const float *final_norm, float *out,
                     int threads) {
    const int64_t qkv_n = (int64_t)(Hq + 2 * Hkv) * D, att_n = (int64_t)Hq * D;
    const int64_t widest = qkv_n > 2 * I ? qkv_n : 2 * I;
    float *x = malloc((size_t)(S * H) * sizeof(float));
    float *wide = malloc((size_t)(S * widest) * sizeof(float)); /* qkv, then gate|up */
    float *att = malloc((size_t)(S * (att_n > I ? att_n : I)) * sizeof(float)); /* a, act */
    float *tmp = malloc((size_t)(S * H) * sizeof(float));
    int status = (x == 0 || wide == 0 || att == 0 || tmp == 0) ? -1 : 0;
    const size_t elem = kv_bf16 ? 2 : 4;
    for (int l = 0; l < num_layers && status == 0; l++) {
        const pd_layer *L = layers + l;
        if (l == 0)
            pd_add_rms_norm(h, 0, L->in_norm, eps, x, S, H);
        else
            pd_add_rms_norm(h, tmp, L->in_norm, eps, x, S, H);
        status |= matmul(x, S, &L->qkv, wide, threads);
        status |= pd_decode_attention(wide, S, Hq, Hkv, D, cos_sin,
                                      (char *)kv + (size_t)l * layer_stride * elem, kv_bf16,
                                      slots, tables, table_stride, lens, bs, scale, att,
                                      max_len, threads);
        status |= matmul(att, S, &L->o, tmp, threads);
        pd_add_rms_norm(h, tmp, L->post_norm, eps, x, S, H);
        status |= matmul(x, S, &L->gate_up, wide, threads);
        silu_mul(wide, S, I, att);
        status |= matmul(att, S, &L->down, tmp, threads);
    }
    if (status == 0) pd_add_rms_norm(h, num_layers > 0 ? tmp : 0, final_norm, eps, out, S, H);
    free(x);
    free(wide);
    free(att);
    free(tmp);
    return status ? -1 : 0;
}
