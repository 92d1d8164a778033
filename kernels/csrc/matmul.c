/* Weight-only quantized matmuls for decode rows, float32 activations.
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
 *               (the q8 family of cpu_kernels.h: d, and c [N, K/32] where the kind has
 *               one, or both per 16, [N, K/16]; w = q * d + c, the product rounded first)
 *   nl weights: qs as q4's, d [N, K/32] f32, c: a 16-entry i8 table   w = table[q] * d
 *               (KIND_NL, through pd_q8_matmul: IQ4_NL, IQ4_XS, MXFP4)
 *   float weights: [N, K] f32 or bf16, as loaded (KIND_F32, KIND_BF16, through pd_q8_matmul:
 *               a model's float weights, so its decode rows take the one-call C layers too)
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
 */

#include "cpu_kernels.h"

/* The bytes of one column's weights: q4 and nl nibbles, q8 integers, or floats. */
static inline int64_t column_bytes(const int kind, int64_t K) {
    return kind == KIND_Q4 || kind == KIND_NL ? K / 2
           : kind == KIND_F32                 ? 4 * K
           : kind == KIND_BF16                ? 2 * K
                                              : K;
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

/* The 32 weights of a q8-family group (kind: see cpu_kernels.h) as 4 x 8 floats. dg, cg:
 * the group's d and c (two of each for a half kind: lanes 0..15, then 16..31). */
static inline __attribute__((always_inline)) void expand_q8(
        const int8_t *qs, const float *dg, const float *cg, __m256 w[4], const int kind) {
    for (int i = 0; i < 4; i++) {
        const int h = KIND_HALF(kind) ? i / 2 : 0;
        __m128i b = _mm_loadl_epi64((const __m128i *)(qs + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(dg[h]));
        if (KIND_MIN(kind)) w[i] = _mm256_add_ps(w[i], _mm256_set1_ps(cg[h]));
    }
}

/* The 32 weights of an nl group (KIND_NL): table[nibble] * dg, in weight order. */
static inline __attribute__((always_inline)) void expand_nl(
        const uint8_t *qs, const int8_t *table, float dg, __m256 w[4]) {
    const __m128i mask = _mm_set1_epi8(0x0F), t = _mm_loadu_si128((const __m128i *)table);
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i lo = _mm_shuffle_epi8(t, _mm_and_si128(b, mask));                 /* 0..15 */
    const __m128i hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(b, 4), mask)); /* 16.. */
    const __m256 d = _mm256_set1_ps(dg);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
}

/* The 32 weights of a float group (KIND_F32 or KIND_BF16) as 4 x 8 floats. */
static inline __attribute__((always_inline)) void expand_float(const void *w32, __m256 w[4],
                                                               const int kind) {
    for (int i = 0; i < 4; i++)
        w[i] = kind == KIND_F32
                   ? _mm256_loadu_ps((const float *)w32 + 8 * i)
                   : load8_bf16((const uint16_t *)w32 + 8 * i);
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

/* Rows 0 .. rows - 1 of one column: sum_g d_g * (x_g . q_g) + sum_g c_g * sum(x_g), with
 * c = m - off * d the constant part of each group's weights. The nibbles are expanded to floats
 * once per group and the group's scale applied to the 8-lane partial product; the constant
 * part multiplies the group sums of x (xsum, computed per call). `rows` is a compile-time
 * constant at every call (the tile is unrolled and its accumulators stay in registers), and
 * every row runs the same operations whatever the tile size. */
#ifdef __AVX512F__
/* AVX-512 (built when the CPU has it, see kernels/native.py): a group is two 16-float vectors.
 * The group's weights are formed once (q4: q * d + c with one FMA as in the dense model; q8:
 * q * d; float kinds: loaded) and shared by the tile's rows: two FMAs per row and group (the
 * AVX2 q4 tile below needs five), and no constant-part epilogue (xsum is not used). */
static inline __attribute__((always_inline)) void weights512(
        const void *qs, const float *d, const float *c, int64_t g, const int kind, __m512 *w0,
        __m512 *w1) {
    const int per = KIND_HALF(kind) ? 2 : 1; /* d (and c) per group */
    const __m128i mask = _mm_set1_epi8(0x0F);
    if (kind == KIND_F32) {
        *w0 = _mm512_loadu_ps((const float *)qs + g * GROUP);
        *w1 = _mm512_loadu_ps((const float *)qs + g * GROUP + 16);
        return;
    }
    if (kind == KIND_BF16) {
        const __m256i *b = (const __m256i *)((const uint16_t *)qs + g * GROUP);
        *w0 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(b)), 16));
        *w1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(b + 1)), 16));
        return;
    }
    const __m512 d0 = _mm512_set1_ps(d[g * per]), d1 = _mm512_set1_ps(d[g * per + per - 1]);
    if (kind == KIND_Q4) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + g * 16));
        const __m512 cg = _mm512_set1_ps(c[g]);
        *w0 = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask))), d0, cg);
        *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                  _mm_and_si128(_mm_srli_epi16(b, 4), mask))), d0, cg);
    } else if (kind == KIND_NL) { /* c is the table */
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + g * 16));
        const __m128i t = _mm_loadu_si128((const __m128i *)c);
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_shuffle_epi8(t, _mm_and_si128(b, mask)))), d0);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(
                                t, _mm_and_si128(_mm_srli_epi16(b, 4), mask)))), d0);
    } else {
        const __m128i *q = (const __m128i *)((const int8_t *)qs + g * GROUP);
        *w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d0);
        *w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))),
                            d1);
        if (KIND_MIN(kind)) {
            *w0 = _mm512_add_ps(*w0, _mm512_set1_ps(c[g * per]));
            *w1 = _mm512_add_ps(*w1, _mm512_set1_ps(c[g * per + per - 1]));
        }
    }
}

/* Rows 0 .. rows - 1 of `cols` (1 or 2) adjacent columns: (qs, d, c) the first's weights,
 * (qs2, d2, c2) the second's; rows <= 16 for one column, <= 8 for two (32 registers). Two
 * columns share each load of a row's x, where one column alone makes one FMA per load: the
 * float kinds, whose weights cost nothing to form, go in pairs (256 rows of a 1,728 x 576
 * float32 matrix, one core of an AVX-512 Xeon: 6.3 ms a column at a time, 5.6 ms in pairs),
 * and so do fewer than 16 rows of any kind (one row of one column is a single chain of
 * dependent FMAs; two columns are two); 16 rows of the other kinds go one column at a time,
 * forming each group's weights once for 16 (in pairs of 8 rows, a 16-row float32 step over
 * the default model's Q4_1 blocks ran 0.94x as fast). Every column's sums are the same
 * operations in any tile, so results do not depend on the tiling. `rows`, `kind` and `cols`
 * are compile-time constants at every call. */
static inline __attribute__((always_inline)) void tile512(
        const float *x, int64_t K, const void *qs, const float *d, const float *c,
        const void *qs2, const float *d2, const float *c2, float *y, int64_t N, const int rows,
        const int kind, const int cols) {
    const int64_t groups = K / GROUP;
    __m512 acc[2][ROW_TILE];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 w0, w1, v0 = _mm512_setzero_ps(), v1 = v0;
        weights512(qs, d, c, g, kind, &w0, &w1);
        if (cols == 2) weights512(qs2, d2, c2, g, kind, &v0, &v1);
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const float *xr = x + r * K + g * GROUP;
            const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
            acc[0][r] = _mm512_fmadd_ps(x1, w1, _mm512_fmadd_ps(x0, w0, acc[0][r]));
            if (cols == 2) acc[1][r] = _mm512_fmadd_ps(x1, v1, _mm512_fmadd_ps(x0, v0, acc[1][r]));
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        y[r * N] = _mm512_reduce_add_ps(acc[0][r]);
        if (cols == 2) y[r * N + 1] = _mm512_reduce_add_ps(acc[1][r]);
    }
}

/* Columns n0 .. n1 - 1 for all M rows, AVX-512, any kind: row tiles outer (a tile's rows of
 * x stay in L1 while every column of the block reads them, see q4_columns), columns inner:
 * 16-row tiles one column at a time (not the float kinds; while their x fits in L1), then
 * 8 rows and the last 1..7 in pairs of columns (an odd last column alone; see tile512). */
static inline __attribute__((always_inline)) void columns512(
        const float *x, int64_t M, int64_t K, const void *qs, const float *d, const float *c,
        int64_t n0, int64_t n1, float *y, int64_t N, const int kind) {
    const int64_t scales = K / GROUP * (KIND_HALF(kind) ? 2 : 1); /* d (and c) per column */
    const int64_t bytes = column_bytes(kind, K);
    /* a column's weights: d none for the float kinds; c the kind's constants, or nl's table */
#define COLUMN(n)                                                                          \
    (const char *)qs + (n) * bytes, KIND_FLOAT(kind) ? 0 : d + (n) * scales,              \
        kind == KIND_Q4 || KIND_MIN(kind) ? c + (n) * scales : (kind == KIND_NL ? c : 0)
#define PAIRS(ROWS)                                                                        \
    {                                                                                      \
        int64_t n = n0;                                                                    \
        for (; n + 2 <= n1; n += 2)                                                        \
            tile512(x + r * K, K, COLUMN(n), COLUMN(n + 1), y + r * N + n, N, ROWS, kind, 2); \
        if (n < n1) tile512(x + r * K, K, COLUMN(n), COLUMN(n), y + r * N + n, N, ROWS, kind, 1); \
    }
#define SINGLES(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        tile512(x + r * K, K, COLUMN(n), COLUMN(n), y + r * N + n, N, ROWS, kind, 1)
    int64_t r = 0;
    if (!KIND_FLOAT(kind) && K * ROW_TILE * sizeof(float) <= L1_ROWS_BYTES)
        for (; r + ROW_TILE <= M; r += ROW_TILE) SINGLES(ROW_TILE);
    for (; r + 8 <= M; r += 8) PAIRS(8);
    LAST_ROWS(PAIRS, M - r);
#undef SINGLES
#undef PAIRS
#undef COLUMN
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

/* Columns n0 .. n1 - 1 for all M rows. Row tiles are the outer loop: a tile's rows of x stay
 * in L1 while every column of the block reads them. With columns outer, x came from L2 for
 * each column: the 120 layer matmuls of a 32-row step took 96.6 ms, now 71.5 ms (2 threads). */
static void q4_columns(const float *x, const float *xsum, int64_t M, int64_t K,
                       const uint8_t *qs, const float *d, const float *c, int64_t n0,
                       int64_t n1, float *y, int64_t N) {
#ifdef __AVX512F__
    (void)xsum;
    columns512(x, M, K, qs, d, c, n0, n1, y, N, KIND_Q4);
#else
    const int64_t groups = K / GROUP;
#define Q4_TILE(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        q4_tile(x + r * K, xsum + r * groups, K, qs + n * groups * 16, d + n * groups,     \
                c + n * groups, y + r * N + n, N, ROWS)
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) Q4_TILE(8);
    LAST_ROWS(Q4_TILE, M - r);
#undef Q4_TILE
#endif
}

#ifndef __AVX512F__
static inline __attribute__((always_inline)) void q8_tile(
        const float *x, int64_t K, const int8_t *qs, const float *d, const float *c, float *y,
        int64_t N, const int rows, const int kind) {
    const int64_t groups = K / GROUP;
    const int per = KIND_HALF(kind) ? 2 : 1;
    __m256 acc[ROW_TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 w[4];
        if (KIND_FLOAT(kind))
            expand_float((const char *)qs + g * GROUP * (kind == KIND_F32 ? 4 : 2), w, kind);
        else if (kind == KIND_NL) /* c is the table */
            expand_nl((const uint8_t *)qs + g * 16, (const int8_t *)c, d[g], w);
        else
            expand_q8(qs + g * GROUP, d + g * per, KIND_MIN(kind) ? c + g * per : 0, w, kind);
        fma_rows(x + g * GROUP, K, rows, w, acc);
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) y[r * N] = hsum(acc[r]);
}
#endif

/* Columns n0 .. n1 - 1 for all M rows, row tiles outer (see q4_columns). */
static inline __attribute__((always_inline)) void q8_columns(
        const float *x, int64_t M, int64_t K, const int8_t *qs, const float *d, const float *c,
        int64_t n0, int64_t n1, float *y, int64_t N, const int kind) {
#ifdef __AVX512F__
    columns512(x, M, K, qs, d, c, n0, n1, y, N, kind);
#else
    const int64_t scales = K / GROUP * (KIND_HALF(kind) ? 2 : 1); /* d (and c) per column */
    const int64_t bytes = column_bytes(kind, K);
    /* d: none for the float kinds; c: the kind's constants per column, or (nl) the table */
#define Q8_TILE(ROWS)                                                                      \
    for (int64_t n = n0; n < n1; n++)                                                      \
        q8_tile(x + r * K, K, qs + n * bytes, KIND_FLOAT(kind) ? 0 : d + n * scales,       \
                KIND_MIN(kind) ? c + n * scales : (kind == KIND_NL ? c : 0), y + r * N + n, \
                N, ROWS, kind)
    int64_t r = 0;
    for (; r + 8 <= M; r += 8) Q8_TILE(8);
    LAST_ROWS(Q8_TILE, M - r);
#undef Q8_TILE
#endif
}

static void q8_block(const float *x, int64_t M, int64_t K, int kind, const int8_t *qs,
                     const float *d, const float *c, int64_t n0, int64_t n1, float *y,
                     int64_t N) {
    switch (kind) { /* each kind its own compiled tile */
    case KIND_Q8: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_Q8); break;
    case KIND_Q8_MIN: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_Q8_MIN); break;
    case KIND_Q8_HALF: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_Q8_HALF); break;
    case KIND_NL: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_NL); break;
    case KIND_F32: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_F32); break;
    case KIND_BF16: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_BF16); break;
    default: q8_columns(x, M, K, qs, d, c, n0, n1, y, N, KIND_Q8_HALF_MIN); break;
    }
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

/* y [M, N] = x [M, K] @ W.T, W in the q8 family (kind 8, 5, 6 or 7), nl (kind 9) or float
 * (kind 32 or 16; see the top of the file and cpu_kernels.h). K % 32 == 0. Returns 0, or -2
 * for another kind. */
int pd_q8_matmul(const float *x, int64_t M, int64_t K, int kind, const int8_t *qs,
                 const float *d, const float *c, int64_t N, float *y, int threads) {
    if (kind != KIND_Q8 && kind != KIND_Q8_MIN && kind != KIND_Q8_HALF &&
        kind != KIND_Q8_HALF_MIN && kind != KIND_NL && !KIND_FLOAT(kind))
        return -2;
    const int64_t blocks = (N + COL_BLOCK - 1) / COL_BLOCK;
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        int64_t end = (b + 1) * COL_BLOCK < N ? (b + 1) * COL_BLOCK : N;
        q8_block(x, M, K, kind, qs, d, c, b * COL_BLOCK, end, y, N);
    }
    return 0;
}
