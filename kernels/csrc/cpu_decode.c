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
 * AVX-512 build and -mavx512vnni for the VNNI build, which adds the int8-activation matmul
 * below (no -ffast-math: the order of float operations is the one written here).
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

/* ---- int8 activations on VNNI (AVX-512 build) ---------------------------------------------
 *
 * The weights above are expanded to float32 and multiplied with FMAs: 32 multiply-adds per
 * instruction. VNNI's vpdpbusd does 64 u8 x s8 multiply-adds into 16 int32 lanes in one
 * instruction, so with the activations quantized to int8 a step's matmuls need about a third
 * of the instructions. It is lossy like llama.cpp's Q8 activations, and used only when asked
 * (decode_quant.py: decode_activations="int8").
 *
 * Activations: each row of x is quantized per group of 32 along K, xq = round(x / sx) with
 * sx = amax / 127 (0 for a zero group), in [-127, 127]; also kept per group: sx, the exact
 * float sum of x (q4's constant part) and the sum of xq (q8's offset, below).
 *
 * Weights, packed once (decode_quant.py) in tiles of 16 output columns, lanes = columns, and
 * within a 32-bit lane 4 consecutive k as vpdpbusd wants them:
 *   q4: w [N/16, K/32, 4, 16, 4] u8: byte (j, n, i) = q[n, 8j + i] | q[n, 8j + 4 + i] << 4
 *       d, c [N/16, K/32, 16] f32                      w = q * d + c as above
 *   q8: w [N/16, K/32, 8, 16, 4] u8: byte (m, n, i) = q[n, 4m + i] + 128 (u8 for vpdpbusd)
 *       d [N/16, K/32, 16] f32                        w = q * d; the + 128 is taken back
 *                                                     as 128 * sum(xq) per row and group
 * Columns past N are zero in the packing and not stored.
 *
 * y[r, n] = sum_g (d[n, g] * sx[r, g]) * dot_int(q[n, g], xq[r, g]) (+ c[n, g] * xsum[r, g]),
 * summed over g in order by one thread, the same operations whatever the tile or batch: each
 * row is batch and thread invariant here too. */
#ifdef __AVX512VNNI__
#define I8_COLS 16

typedef struct {
    int8_t *xq;    /* [M, K] */
    float *sx;     /* [M, G] */
    float *xsum;   /* [M, G] */
    int32_t *xqs;  /* [M, G] */
} pd_xq;

static int quantize_rows(const float *x, int64_t M, int64_t K, pd_xq *q) {
    const int64_t G = K / GROUP;
    q->xq = malloc((size_t)(M * K));
    q->sx = malloc((size_t)(M * G) * sizeof(float));
    q->xsum = malloc((size_t)(M * G) * sizeof(float));
    q->xqs = malloc((size_t)(M * G) * sizeof(int32_t));
    if (q->xq == 0 || q->sx == 0 || q->xsum == 0 || q->xqs == 0) return -1;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < M * G; i++) {
        const float *xg = x + i * GROUP;
        const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
        const float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_and_ps(a, sign), _mm512_and_ps(b, sign)));
        const float sx = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inv)));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inv)));
        _mm_storeu_si128((__m128i *)(q->xq + i * GROUP), _mm512_cvtsepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(q->xq + i * GROUP + 16), _mm512_cvtsepi32_epi8(qb));
        q->sx[i] = sx;
        q->xsum[i] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        q->xqs[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
    return 0;
}

static void free_xq(pd_xq *q) {
    free(q->xq);
    free(q->sx);
    free(q->xsum);
    free(q->xqs);
}

/* Rows 0 .. rows - 1 of one tile of 16 columns (`rows` and `q4` compile-time constants). */
static inline __attribute__((always_inline)) void i8_tile(
        const pd_xq *xq, int64_t r0, int64_t K, const uint8_t *w, const float *d,
        const float *c, float *y, int64_t N, __mmask16 cols, const int rows, const int q4) {
    const int64_t G = K / GROUP;
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROW_TILE];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        __m512i wv[8];
        if (q4) {
            const uint8_t *wg = w + g * 256;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i b = _mm512_loadu_si512(wg + 64 * j);
                wv[2 * j] = _mm512_and_si512(b, low);
                wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
            }
        } else {
#pragma GCC unroll 8
            for (int m = 0; m < 8; m++) wv[m] = _mm512_loadu_si512(w + g * 512 + 64 * m);
        }
        const __m512 dv = _mm512_loadu_ps(d + g * I8_COLS);
        const __m512 cv = q4 ? _mm512_loadu_ps(c + g * I8_COLS) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const int64_t rg = (r0 + r) * G + g;
            const int32_t *xr = (const int32_t *)(xq->xq + rg * GROUP);
            __m512i ia = q4 ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * xq->xqs[rg]);
#pragma GCC unroll 8
            for (int m = 0; m < 8; m++)
                ia = _mm512_dpbusd_epi32(ia, wv[m], _mm512_set1_epi32(xr[m]));
            const __m512 s = _mm512_mul_ps(dv, _mm512_set1_ps(xq->sx[rg]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), s, acc[r]);
            if (q4) acc[r] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xq->xsum[rg]), acc[r]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * N, cols, acc[r]);
}

static void i8_columns(const pd_xq *xq, int64_t M, int64_t K, int64_t t, const uint8_t *w,
                       const float *d, const float *c, float *y, int64_t N, const int q4) {
    const int64_t G = K / GROUP, n0 = t * I8_COLS;
    const int64_t ncols = N - n0 < I8_COLS ? N - n0 : I8_COLS;
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1);
    const uint8_t *wt = w + t * G * (q4 ? 256 : 512);
    const float *dt = d + t * G * I8_COLS, *ct = q4 ? c + t * G * I8_COLS : 0;
#define I8_TILE(ROWS)                                                                      \
    do {                                                                                   \
        if (q4)                                                                            \
            i8_tile(xq, r, K, wt, dt, ct, y + r * N + n0, N, cols, ROWS, 1);               \
        else                                                                               \
            i8_tile(xq, r, K, wt, dt, ct, y + r * N + n0, N, cols, ROWS, 0);               \
    } while (0)
    int64_t r = 0;
    for (; r + ROW_TILE <= M; r += ROW_TILE) I8_TILE(ROW_TILE);
    for (; r + 8 <= M; r += 8) I8_TILE(8);
    LAST_ROWS(I8_TILE, M - r);
#undef I8_TILE
}

/* y [M, N] = x [M, K] @ W.T with W packed as above (kind 4 or 8) and x quantized to int8.
 * Returns 0, or -1 when out of memory. */
int pd_i8_matmul(const float *x, int64_t M, int64_t K, int kind, const uint8_t *w,
                 const float *d, const float *c, int64_t N, float *y, int threads) {
    pd_xq xq;
    if (quantize_rows(x, M, K, &xq) != 0) {
        free_xq(&xq);
        return -1;
    }
    const int64_t tiles = (N + I8_COLS - 1) / I8_COLS;
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++)
        i8_columns(&xq, M, K, t, w, d, c, y, N, kind == 4);
    free_xq(&xq);
    return 0;
}
#endif

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

/* scores := e^(scores - max), returns their sum (8 lanes, a fixed tree, the tail in order). */
static inline float softmax_numerators(float *scores, int64_t len) {
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
    return sum;
}

/* out = softmax(scores) @ V for one head; scores is overwritten with the probabilities. */
static inline __attribute__((always_inline)) void head_output(
        float *scores, const void *kv, const int64_t *keys, int64_t len, int64_t value,
        int D, float *out, const int bf16) {
    const float sum = softmax_numerators(scores, len);
    __m256 acc[16]; /* D <= 128 */
    const int nv = D / 8;
    for (int i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        const int64_t v = keys[j] + value;
        const __m256 p = _mm256_set1_ps(scores[j]);
        for (int i = 0; i < nv; i++)
            acc[i] = _mm256_fmadd_ps(p, load8(kv, v + 8 * i, bf16), acc[i]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int i = 0; i < nv; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

#ifdef __AVX512F__
/* AVX-512: the G query heads that share a KV head are computed together, so each key and
 * value is loaded (and widened from bf16) once for all of them, 16 floats at a time. D and G
 * are compile-time constants (GROUP_ATTENTION below). Per head, the score of a key is its
 * 16-lane product folded to 8 lanes, then 8 keys are summed by head_scores' hadd tree; the
 * output sums p * v per element in key order, the same sums as head_output's. */
static inline __attribute__((always_inline)) __m512 load16(const void *kv, int64_t i,
                                                           const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)kv + i))), 16));
    return _mm512_loadu_ps((const float *)kv + i);
}

/* q . k for each head of the group, 8 lanes (a 16-lane product folded once). */
static inline __attribute__((always_inline)) void group_dots(
        const float *q, const void *kv, int64_t k, const int D, const int G, __m256 *dots,
        const int bf16) {
    __m512 kd[8]; /* D <= 128 */
#pragma GCC unroll 8
    for (int c = 0; c < D / 16; c++) kd[c] = load16(kv, k + 16 * c, bf16);
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kd[0]);
#pragma GCC unroll 8
        for (int c = 1; c < D / 16; c++)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + 16 * c), kd[c], acc);
        dots[h] = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    }
}

/* Ask for one head's key or value row ahead of use: a sequence's blocks lie anywhere in the
 * pool and the hardware prefetchers do not follow the block table. */
#define PREFETCH_KEYS 32
static inline __attribute__((always_inline)) void prefetch_row(const void *kv, int64_t i,
                                                               const int D, const int bf16) {
    const char *p = (const char *)kv + i * (bf16 ? 2 : 4);
    for (int b = 0; b < D * (bf16 ? 2 : 4); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void group_attention(
        const float *q, const void *kv, const int64_t *keys, int64_t len, int64_t head,
        int64_t value, float scale, float *scores, int64_t score_stride, float *out,
        const int D, const int G, const int bf16) {
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
        __m256 d[8][8]; /* [key][head] */
        if (j + PREFETCH_KEYS + 8 <= len)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) prefetch_row(kv, keys[j + PREFETCH_KEYS + i] + head, D, bf16);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) group_dots(q, kv, keys[j + i] + head, D, G, d[i], bf16);
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) {
            __m256 s01 = _mm256_hadd_ps(d[0][h], d[1][h]), s23 = _mm256_hadd_ps(d[2][h], d[3][h]);
            __m256 s45 = _mm256_hadd_ps(d[4][h], d[5][h]), s67 = _mm256_hadd_ps(d[6][h], d[7][h]);
            __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
            __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
            __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
            _mm256_storeu_ps(scores + h * score_stride + j,
                             _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale)));
        }
    }
    for (; j < len; j++) {
        __m256 d[8];
        group_dots(q, kv, keys[j] + head, D, G, d, bf16);
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) scores[h * score_stride + j] = hsum(d[h]) * scale;
    }
    for (j = 0; j < len && j < PREFETCH_KEYS; j++) prefetch_row(kv, keys[j] + value, D, bf16);
    float inv[8];
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) inv[h] = 1.0f / softmax_numerators(scores + h * score_stride, len);
    __m512 acc[8][8]; /* [head][16 floats of D] */
#pragma GCC unroll 8
    for (int h = 0; h < G; h++)
#pragma GCC unroll 8
        for (int c = 0; c < D / 16; c++) acc[h][c] = _mm512_setzero_ps();
    for (j = 0; j < len; j++) {
        if (j + PREFETCH_KEYS < len) prefetch_row(kv, keys[j + PREFETCH_KEYS] + value, D, bf16);
        __m512 vd[8];
#pragma GCC unroll 8
        for (int c = 0; c < D / 16; c++) vd[c] = load16(kv, keys[j] + value + 16 * c, bf16);
#pragma GCC unroll 8
        for (int h = 0; h < G; h++) {
            const __m512 p = _mm512_set1_ps(scores[h * score_stride + j]);
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) acc[h][c] = _mm512_fmadd_ps(p, vd[c], acc[h][c]);
        }
    }
#pragma GCC unroll 8
    for (int h = 0; h < G; h++)
#pragma GCC unroll 8
        for (int c = 0; c < D / 16; c++)
            _mm512_storeu_ps(out + h * D + 16 * c,
                             _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
}

/* The (D, G) pairs with a compiled group kernel; others take the per-head path. */
#define GROUP_ATTENTION(D_, G_)                                                            \
    if (D == D_ && G == G_) {                                                              \
        if (bf16)                                                                          \
            group_attention(q, kv, keys, len, head, value, scale, scores, stride, out, D_, \
                            G_, 1);                                                        \
        else                                                                               \
            group_attention(q, kv, keys, len, head, value, scale, scores, stride, out, D_, \
                            G_, 0);                                                        \
        return 1;                                                                          \
    }

static int group_kernel(const float *q, const void *kv, const int64_t *keys, int64_t len,
                        int64_t head, int64_t value, float scale, float *scores,
                        int64_t stride, float *out, int D, int G, int bf16) {
    GROUP_ATTENTION(64, 1) GROUP_ATTENTION(64, 2) GROUP_ATTENTION(64, 3)
    GROUP_ATTENTION(64, 4) GROUP_ATTENTION(128, 1) GROUP_ATTENTION(128, 2)
    GROUP_ATTENTION(128, 4)
    return 0;
}
#undef GROUP_ATTENTION
#endif

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
        /* this thread's scratch: one row's key offsets, the scores of one KV head's group */
        int64_t *keys = malloc((size_t)max_len * sizeof(int64_t)), row = -1;
        float *scores = malloc((size_t)(max_len * group) * sizeof(float));
        if (scores == 0 || keys == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < S * Hkv; item++) { /* a row's KV head and its group */
            if (scores == 0 || keys == 0) continue;
            const int64_t s = item / Hkv, h = item % Hkv;
            if (s != row) { /* a thread's items come in order: a row's heads share its keys */
                key_offsets(tables + s * table_stride, lens[s], bs, token_stride, keys);
                row = s;
            }
            const float *q = qkv + s * row_stride + h * group * D;
            float *o = out + s * Hq * D + h * group * D;
            const int64_t value = bs * token_stride + h * D;
#ifdef __AVX512F__
            if (group_kernel(q, kv, keys, lens[s], h * D, value, scale, scores, max_len, o, D,
                             group, bf16))
                continue;
#endif
            for (int i = 0; i < group; i++) {
                head_scores(q + i * D, kv, keys, lens[s], h * D, D, scale, scores, bf16);
                head_output(scores, kv, keys, lens[s], value, D, o + i * D, bf16);
            }
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

/* idx [M, k]: the k largest values of each row of x [M, N], largest first (equal values:
 * the lower index first), k <= 64 <= N. One pass per row: 16 values at a time are compared
 * with the smallest kept one and only those above it are inserted, so a row of 49,152 logits
 * costs little more than reading it. Rows are spread over the threads; each row's result does
 * not depend on which thread or how many rows. */
#define TOPK_MAX 64
#ifdef __AVX512F__
#define TOPK_LANES 16
static inline unsigned above_mask(const float *p, float bar) {
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(p), _mm512_set1_ps(bar), _CMP_GT_OQ);
}
#else
#define TOPK_LANES 8
static inline unsigned above_mask(const float *p, float bar) {
    return (unsigned)_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_loadu_ps(p), _mm256_set1_ps(bar), _CMP_GT_OQ));
}
#endif

/* Keep x[j] when it beats the smallest kept value; `low` becomes the new smallest. */
static inline void topk_offer(float *val, int64_t *at, int k, int *low, float v, int64_t j) {
    if (!(v > val[*low])) return;
    val[*low] = v;
    at[*low] = j;
    int m = 0;
    for (int i = 1; i < k; i++)
        if (val[i] < val[m] || (val[i] == val[m] && at[i] > at[m])) m = i;
    *low = m;
}

void pd_topk(const float *x, int64_t M, int64_t N, int k, int64_t *idx, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++) {
        const float *row = x + r * N;
        float val[TOPK_MAX];
        int64_t at[TOPK_MAX];
        int low = 0;
        for (int i = 0; i < k; i++) {
            val[i] = row[i];
            at[i] = i;
            if (val[i] < val[low] || (val[i] == val[low] && at[i] > at[low])) low = i;
        }
        int64_t j = k;
        for (; j + TOPK_LANES <= N; j += TOPK_LANES)
            for (unsigned above = above_mask(row + j, val[low]); above; above &= above - 1) {
                const int b = __builtin_ctz(above);
                topk_offer(val, at, k, &low, row[j + b], j + b); /* the bar may have risen */
            }
        for (; j < N; j++) topk_offer(val, at, k, &low, row[j], j);
        for (int i = 1; i < k; i++) { /* largest first, equal values by index */
            const float v = val[i];
            const int64_t a = at[i];
            int p = i;
            for (; p > 0 && (val[p - 1] < v || (val[p - 1] == v && at[p - 1] > a)); p--) {
                val[p] = val[p - 1];
                at[p] = at[p - 1];
            }
            val[p] = v;
            at[p] = a;
        }
        memcpy(idx + r * k, at, (size_t)k * sizeof(int64_t));
    }
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
    int32_t kind;   /* 4: q4 (qs u8 [N, K/32, 16], d, c); 8: q8 (qs i8 [N, K], d) */
    int32_t int8_x; /* 1: qs, d, c packed in tiles for pd_i8_matmul (VNNI build only) */
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
    if (w->int8_x)
#ifdef __AVX512VNNI__
        status = pd_i8_matmul(x, M, w->k, w->kind, (const uint8_t *)w->qs, w->d, w->c, w->n, y,
                              threads);
#else
        return -1; /* packed for a build this is not */
#endif
    else if (w->kind == 4)
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
