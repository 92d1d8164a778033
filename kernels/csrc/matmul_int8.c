/* int8 activations on VNNI (AVX-512 build)
 *
 * matmul.c expands the weights to float32 and multiplies them with FMAs: 32 multiply-adds
 * per instruction. VNNI's vpdpbusd does 64 u8 x s8 multiply-adds into 16 int32 lanes in one
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
 *       the rest of the q8 family (cpu_kernels.h) packs q the same way, and c as q4's d;
 *       a half kind has d (and c) [N/16, K/32, 2, 16]: k 0..15 of a group (m 0..3) take
 *       the first 16 columns' scales, k 16..31 (m 4..7) the second, each half its own dot
 *   nl: w and d as q4's, the nibbles indices into a 16-entry i8 table (c points to it): in
 *       the kernel each index becomes table + 128 (u8, one vpshufb), and the + 128 is taken
 *       back as q8's
 * Columns past N are zero in the packing and not stored.
 *
 * y[r, n] = sum_g (d[n, g] * sx[r, g]) * dot_int(q[n, g], xq[r, g]) (+ c[n, g] * xsum[r, g]),
 * summed over g in order by one thread, the same operations whatever the tile or batch: each
 * row is batch and thread invariant here too. */

#include "cpu_kernels.h"

#ifdef __AVX512VNNI__
#define I8_COLS 16
#define I8_ROWS 8 /* rows of a tile: 8 int and 8 float accumulators, 8 weight vectors */
#define FAR_TILES 3 /* tiles ahead whose weights are asked into L2 (the next one into L1) */

/* The quantized rows, group-major: a tile's rows of one group lie together, at fixed offsets
 * from one pointer (row-major, each row's address took a register of its own, and 8 rows'
 * did not fit in the 16). */
typedef struct {
    int8_t *xq;      /* [G, M, 32] */
    float *sx;       /* [G, M] */
    float *xsum;     /* [G, M] */
    int32_t *xoff;   /* [G, M]: -128 * sum(xq), the q8 family's + 128 taken back */
    float *xsum_lo;  /* [G, M]: of the group's first 16 (the half kinds) */
    float *xsum_hi;  /* [G, M]: xsum - xsum_lo */
    int32_t *xoff_lo, *xoff_hi; /* [G, M]: xoff of each half */
    int64_t M;
} pd_xq;

static int quantize_rows(const float *x, int64_t M, int64_t K, pd_xq *q) {
    const int64_t G = K / GROUP;
    const size_t n = (size_t)(M * G);
    q->M = M;
    q->xq = malloc((size_t)(M * K));
    q->sx = malloc(n * sizeof(float));
    q->xsum = malloc(n * sizeof(float));
    q->xoff = malloc(n * sizeof(int32_t));
    q->xsum_lo = malloc(n * sizeof(float));
    q->xsum_hi = malloc(n * sizeof(float));
    q->xoff_lo = malloc(n * sizeof(int32_t));
    q->xoff_hi = malloc(n * sizeof(int32_t));
    if (q->xq == 0 || q->sx == 0 || q->xsum == 0 || q->xoff == 0 || q->xsum_lo == 0 ||
        q->xsum_hi == 0 || q->xoff_lo == 0 || q->xoff_hi == 0)
        return -1;
    const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t xi = 0; xi < M * G; xi++) {
        const float *xg = x + xi * GROUP;
        const int64_t i = (xi % G) * M + xi / G; /* group-major */
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
        q->xsum_lo[i] = _mm512_reduce_add_ps(a);
        q->xsum_hi[i] = q->xsum[i] - q->xsum_lo[i];
        const int32_t lo = _mm512_reduce_add_epi32(qa), hi = _mm512_reduce_add_epi32(qb);
        q->xoff[i] = -128 * (lo + hi);
        q->xoff_lo[i] = -128 * lo;
        q->xoff_hi[i] = -128 * hi;
    }
    return 0;
}

static void free_xq(pd_xq *q) {
    free(q->xq);
    free(q->sx);
    free(q->xsum);
    free(q->xoff);
    free(q->xsum_lo);
    free(q->xsum_hi);
    free(q->xoff_lo);
    free(q->xoff_hi);
}

/* Rows 0 .. rows - 1 (rows <= I8_ROWS) of one tile of 16 columns (`rows` and `kind`
 * compile-time constants). Within a group the rows' integer dots are interleaved, m outer and
 * rows inner: each vpdpbusd depends on the one before it for the same row, ~4 cycles, so a
 * row's 8 in a chain would leave the unit idle unless the out-of-order window held 4 rows'
 * chains at once. Written row after row (16 rows, each its chain then its float work), the
 * layer matmuls of Gemma 3 270M at 32 rows made ~100 GMAC/s on one Zen 4 core; interleaved,
 * ~160 (the same results bit for bit: the integer dots are exact and the float operations
 * are the same, in the same order). I8_ROWS rows keep their int and float accumulators and
 * the group's 8 weight vectors in the 32 registers.
 * next, far: the weights of the next tile and of the one FAR_TILES ahead, asked for group by
 * group into L1 and L2 while this one computes (NULL: none). A step's weights (~110 MB with
 * the lm_head) stream from memory, and the hardware prefetchers alone kept a 32-row call of
 * the 28 MB lm_head at about a third of the bandwidth; the far prefetch took 30 layers' 120
 * matmuls of 32 rows from ~8.2 to ~7.95 ms. */
static inline __attribute__((always_inline)) void i8_tile(
        const pd_xq *xq, int64_t r0, int64_t K, const uint8_t *w, const float *d,
        const float *c, float *y, int64_t N, __mmask16 cols, const uint8_t *next,
        const uint8_t *far, const int rows, const int kind) {
    const int64_t G = K / GROUP;
    const int nl = kind == KIND_NL, q4 = kind == KIND_Q4 || nl; /* q4: nibbles */
    const int half = KIND_HALF(kind), min = kind == KIND_Q4 || KIND_MIN(kind);
    const int64_t scales = half ? 2 * I8_COLS : I8_COLS; /* floats of d (and c) per group */
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* nl: the table + 128 in each 128-bit lane (vpshufb looks up within a lane) */
    const __m512i table = nl ? _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(
                                   (const __m128i *)c)), _mm512_set1_epi8((char)128))
                             : _mm512_setzero_si512();
    const int64_t group_bytes = q4 ? 256 : 512;
    __m512 acc[I8_ROWS];
    __m512i ia[I8_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        if (next) {
            for (int64_t b = 0; b < group_bytes; b += 64)
                _mm_prefetch((const char *)next + g * group_bytes + b, _MM_HINT_T0);
            if (far)
                for (int64_t b = 0; b < group_bytes; b += 64)
                    _mm_prefetch((const char *)far + g * group_bytes + b, _MM_HINT_T1);
            _mm_prefetch((const char *)(d + (G + g) * scales), _MM_HINT_T0);
            if (min) _mm_prefetch((const char *)(c + (G + g) * scales), _MM_HINT_T0);
        }
        __m512i wv[8];
        if (q4) {
            const uint8_t *wg = w + g * 256;
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512i b = _mm512_loadu_si512(wg + 64 * j);
                wv[2 * j] = _mm512_and_si512(b, low);
                wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), low);
                if (nl) {
                    wv[2 * j] = _mm512_shuffle_epi8(table, wv[2 * j]);
                    wv[2 * j + 1] = _mm512_shuffle_epi8(table, wv[2 * j + 1]);
                }
            }
        } else {
#pragma GCC unroll 8
            for (int m = 0; m < 8; m++) wv[m] = _mm512_loadu_si512(w + g * 512 + 64 * m);
        }
        const int64_t rg0 = g * xq->M + r0; /* row r0 + r's group g: rg0 + r */
        const int32_t *xg = (const int32_t *)(xq->xq + rg0 * GROUP); /* row r: + 8 r */
        /* the group's dot (or, half kinds, each half's) of every row, then its float terms;
         * the q8 family's + 128 is taken back as the rows' -128 * sum(xq), q4's needs none */
        for (int part = 0; part < (half ? 2 : 1); part++) {
            const int m0 = half ? 4 * part : 0, nm = half ? 4 : 8;
            const int32_t *off = half ? (part ? xq->xoff_hi : xq->xoff_lo) : xq->xoff;
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++)
                ia[r] = kind == KIND_Q4 ? _mm512_setzero_si512()
                                        : _mm512_set1_epi32(off[rg0 + r]);
#pragma GCC unroll 8
            for (int m = m0; m < m0 + nm; m++)
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++)
                    ia[r] = _mm512_dpbusd_epi32(ia[r], wv[m],
                                                _mm512_set1_epi32(xg[8 * r + m]));
            const __m512 dv = _mm512_loadu_ps(d + g * scales + part * I8_COLS);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]),
                                         _mm512_mul_ps(dv, _mm512_set1_ps(xq->sx[rg0 + r])),
                                         acc[r]);
        }
        if (min) /* after both halves' dots, as c * sum(x) of each part */
            for (int part = 0; part < (half ? 2 : 1); part++) {
                const __m512 cv = _mm512_loadu_ps(c + g * scales + part * I8_COLS);
                const float *xs = half ? (part ? xq->xsum_hi : xq->xsum_lo) : xq->xsum;
#pragma GCC unroll 8
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_fmadd_ps(cv, _mm512_set1_ps(xs[rg0 + r]), acc[r]);
            }
    }
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * N, cols, acc[r]);
}

static inline __attribute__((always_inline)) void i8_columns(
        const pd_xq *xq, int64_t M, int64_t K, int64_t t, const uint8_t *w, const float *d,
        const float *c, float *y, int64_t N, const int kind) {
    const int q4 = kind == KIND_Q4 || kind == KIND_NL, min = kind == KIND_Q4 || KIND_MIN(kind);
    const int64_t scales = KIND_HALF(kind) ? 2 * I8_COLS : I8_COLS;
    const int64_t G = K / GROUP, n0 = t * I8_COLS, tile_bytes = G * (q4 ? 256 : 512);
    const int64_t ncols = N - n0 < I8_COLS ? N - n0 : I8_COLS;
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1);
    const uint8_t *wt = w + t * tile_bytes;
    /* c: the kind's constants of this tile, or (nl) the one table */
    const float *dt = d + t * G * scales, *ct = min ? c + t * G * scales
                                                    : (kind == KIND_NL ? c : 0);
    /* the next tile's weights and scales, fetched during the first row block */
    const uint8_t *next = n0 + I8_COLS < N ? wt + tile_bytes : 0;
    const uint8_t *far = n0 + FAR_TILES * I8_COLS < N ? wt + FAR_TILES * tile_bytes : 0;
#define I8_TILE(ROWS)                                                                      \
    do {                                                                                   \
        const uint8_t *pf = r == 0 ? next : 0, *pff = r == 0 ? far : 0;                    \
        i8_tile(xq, r, K, wt, dt, ct, y + r * N + n0, N, cols, pf, pff, ROWS, kind);       \
    } while (0)
    int64_t r = 0;
    for (; r + I8_ROWS <= M; r += I8_ROWS) I8_TILE(I8_ROWS);
    LAST_ROWS(I8_TILE, M - r);
#undef I8_TILE
}

static void i8_tiles(const pd_xq *xq, int64_t M, int64_t K, int64_t t, const uint8_t *w,
                     const float *d, const float *c, float *y, int64_t N, int kind) {
    switch (kind) { /* each kind its own compiled tile */
    case KIND_Q4: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_Q4); break;
    case KIND_Q8: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_Q8); break;
    case KIND_Q8_MIN: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_Q8_MIN); break;
    case KIND_Q8_HALF: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_Q8_HALF); break;
    case KIND_NL: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_NL); break;
    default: i8_columns(xq, M, K, t, w, d, c, y, N, KIND_Q8_HALF_MIN); break;
    }
}

/* y [M, N] = x [M, K] @ W.T with W packed as above (any kind of cpu_kernels.h) and x
 * quantized to int8. Returns 0, -1 when out of memory, or -2 for an unknown kind. */
int pd_i8_matmul(const float *x, int64_t M, int64_t K, int kind, const uint8_t *w,
                 const float *d, const float *c, int64_t N, float *y, int threads) {
    if (kind != KIND_Q4 && kind != KIND_Q8 && kind != KIND_Q8_MIN && kind != KIND_Q8_HALF &&
        kind != KIND_Q8_HALF_MIN && kind != KIND_NL)
        return -2;
    pd_xq xq;
    if (quantize_rows(x, M, K, &xq) != 0) {
        free_xq(&xq);
        return -1;
    }
    const int64_t tiles = (N + I8_COLS - 1) / I8_COLS;
#pragma omp parallel for num_threads(threads) schedule(guided) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++) i8_tiles(&xq, M, K, t, w, d, c, y, N, kind);
    free_xq(&xq);
    return 0;
}
#endif
