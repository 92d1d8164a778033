/* CPU kernels for decode rows: weight-only quantized matmuls with float32 activations.
 *
 * A decode step reads every weight once to produce one token per sequence, so it is bound by
 * the weights' bytes, not by arithmetic. These kernels read 4-bit or 8-bit weights in groups
 * of 32 along K, expand each group to float32 in registers (exactly the dequantized weight
 * the dense model holds) and multiply it into float32 activations with AVX2 FMAs.
 *
 *   q4 weights: qs [N, K/32, 16] u8   weight j of a group: qs[j] & 0xF, weight j+16: qs[j] >> 4
 *               d, c [N, K/32] f32                    (from the GGUF's own Q4_0/Q4_1 blocks:
 *               w = q * d + c                          c = m - off * d, off 8 for Q4_0, else 0)
 *   q8 weights: qs [N, K] i8, d [N, K/32] f32        w = q * d
 *
 * y[r, n] is computed by one thread in a fixed order (8 float lanes over K, then one
 * horizontal sum), whatever the number of rows or threads: a row's result is the same bit
 * for bit alone or batched (continuous batching must not change a greedy token).
 *
 * Work is handed to threads with schedule(guided): chunks that shrink as the work runs out.
 * Which thread computes a column does not change its value. Behind a server, the gateway's and
 * the clients' threads share the cores; when one of ours is descheduled, the other takes the
 * remaining chunks instead of waiting at the barrier for its fixed half. Measured (colocated
 * gateway, batch-1 decode on 2 cores): tokens 18.4 ms apart with guided, 23.3 ms with static;
 * schedule(dynamic, 1) cost 30 % offline.
 *
 * Built by kernels/native.py with -O3 -mavx2 -mfma -fopenmp (no -ffast-math: the order of
 * float operations is the one written here).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 32
#define ROW_TILE 8 /* rows sharing one expanded weight group (8 accumulators + 4 weights) */
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
    for (; r + 8 <= M; r += 8) Q4_TILE(8);
    if (r + 4 <= M) { Q4_TILE(4); r += 4; }
    if (r + 2 <= M) { Q4_TILE(2); r += 2; }
    if (r < M) Q4_TILE(1);
#undef Q4_TILE
}

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

/* Columns n0 .. n1 - 1 for all M rows, row tiles outer (see q4_columns). */
static void q8_columns(const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d,
                       int64_t n0, int64_t n1, float *y, int64_t N) {
    const int64_t groups = K / GROUP;
#define Q8_TILE(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        q8_tile(x + r * K, K, qs + n * K, d + n * groups, y + r * N + n, N, ROWS)
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) Q8_TILE(8);
    if (r + 4 <= M) { Q8_TILE(4); r += 4; }
    if (r + 2 <= M) { Q8_TILE(2); r += 2; }
    if (r < M) Q8_TILE(1);
#undef Q8_TILE
}

/* y [M, N] = x [M, K] @ W.T, W as q4 (see the top of the file). K % 32 == 0.
 * Returns 0, or -1 when out of memory. */
int pd_q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *qs, const float *d,
                 const float *c, int64_t N, float *y, int threads) {
    const int64_t groups = K / GROUP;
    const int64_t blocks = (N + COL_BLOCK - 1) / COL_BLOCK;
    float *xsum = malloc((size_t)(M * groups) * sizeof(float));
    if (xsum == 0) return -1;
    for (int64_t i = 0; i < M * groups; i++) {
        const float *xg = x + i * GROUP;
        float s = 0.0f;
        for (int j = 0; j < GROUP; j++) s += xg[j];
        xsum[i] = s;
    }
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
 * One call per layer for the decode rows of a step, float32: rotary embedding of q and k,
 * K/V stored into the paged cache, then attention of each row over its own context.
 *
 *   qkv      [S, (Hq + 2 Hkv) * D]   the qkv projection's rows; q and k are rotated in place
 *   cos_sin  [S, D]                  cos of each row's position in the first half, sin after
 *   kv       [num_blocks, 2, bs, Hkv, D]   (engine_core/kv_cache/layout.py)
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

static inline const float *kv_row(const float *kv, const int32_t *table, int64_t pos, int bs,
                                  int64_t token_stride, int h, int D, int which) {
    int64_t block = table[pos / bs];
    return kv + ((block * 2 + which) * bs + pos % bs) * token_stride + (int64_t)h * D;
}

/* scores[j] = scale * q . k_j for j < len, 8 keys at a time (their 8 accumulators are summed
 * lane-wise by a fixed hadd tree), the tail one key at a time. D % 8 == 0. */
static void head_scores(const float *q, const float *kv, const int32_t *table, int64_t len,
                        int bs, int64_t token_stride, int h, int D, float scale, float *scores) {
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 acc[8];
        const float *k[8];
        for (int i = 0; i < 8; i++) {
            k[i] = kv_row(kv, table, j + i, bs, token_stride, h, D, 0);
            acc[i] = _mm256_setzero_ps();
        }
        for (int d = 0; d < D; d += 8) {
            __m256 qd = _mm256_loadu_ps(q + d);
            for (int i = 0; i < 8; i++)
                acc[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k[i] + d), acc[i]);
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
        const float *k = kv_row(kv, table, j, bs, token_stride, h, D, 0);
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
        scores[j] = hsum(acc) * scale;
    }
}

/* out = softmax(scores) @ V for one head; scores is overwritten with the probabilities. */
static void head_output(float *scores, const float *kv, const int32_t *table, int64_t len,
                        int bs, int64_t token_stride, int h, int D, float *out) {
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
        const float *v = kv_row(kv, table, j, bs, token_stride, h, D, 1);
        const __m256 p = _mm256_set1_ps(scores[j]);
        for (int i = 0; i < nv; i++)
            acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

/* max_len >= every lens[s]. D % 8 == 0, D <= 128. Returns 0, or -1 when out of memory. */
int pd_decode_attention(float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin,
                        float *kv, const int64_t *slots, const int32_t *tables,
                        int64_t table_stride, const int32_t *lens, int bs, float scale,
                        float *out, int64_t max_len, int threads) {
    const int64_t row_stride = (int64_t)(Hq + 2 * Hkv) * D, token_stride = (int64_t)Hkv * D;
    for (int64_t s = 0; s < S; s++) {
        float *row = qkv + s * row_stride;
        rope_row(row, cos_sin + s * D, Hq + Hkv, D); /* q heads, then k heads */
        if (slots[s] < 0) continue;
        int64_t block = slots[s] / bs, off = slots[s] % bs;
        float *k = kv + ((block * 2) * bs + off) * token_stride;
        float *v = kv + ((block * 2 + 1) * bs + off) * token_stride;
        for (int64_t i = 0; i < token_stride; i++) {
            k[i] = row[Hq * D + i];
            v[i] = row[(Hq + Hkv) * D + i];
        }
    }
    const int group = Hq / Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scores = malloc((size_t)max_len * sizeof(float)); /* this thread's scratch */
        if (scores == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < S * Hq; item++) {
            if (scores == 0) continue;
            int64_t s = item / Hq;
            int hq = (int)(item % Hq), h = hq / group;
            const int32_t *table = tables + s * table_stride;
            head_scores(qkv + s * row_stride + hq * D, kv, table, lens[s], bs, token_stride, h,
                        D, scale, scores);
            head_output(scores, kv, table, lens[s], bs, token_stride, h, D,
                        out + s * Hq * D + hq * D);
        }
        free(scores);
    }
    return failed ? -1 : 0;
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
