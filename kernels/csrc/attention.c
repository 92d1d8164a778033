/* Row attention: decode rows, and on CPU prefill rows too
 *
 * One call per layer for a step's decode rows (and one for its prefill rows), computed in
 * float32: rotary embedding of q and k, K/V stored into the paged cache, then attention of
 * each row over its own context. A prefill token is a row whose context ends at its own
 * position, so causal varlen prefill over a cached prefix needs nothing more. Per row, the
 * keys stay in L2 across its heads; measured on 2 Zen 5 cores over a bf16 cache, 2,048 rows
 * (16 prompts of 128) take 2.6 ms against 5.3 ms for torch's SDPA, and one 2,048-token prompt
 * 24 ms against 35 ms.
 *
 *   qkv      [S, (Hq + 2 Hkv) * D]   the qkv projection's rows; q and k are rotated in place
 *   cos_sin  [S, D]                  cos of each row's position in the first half, sin after
 *   kv       [num_blocks, 2, bs, Hkv, D]   float32 or bfloat16 (engine_core/kv_cache/layout.py)
 *   slots    [S] int64               block * bs + offset of each row's new K/V; < 0: not stored
 *   tables   [T, table_stride] int32 block tables; row s reads table table_of_row[s], or
 *            table s when table_of_row is NULL (a prefill chunk's rows share their sequence's)
 *   lens     [S] int32 (keys to attend to, the row's own included)
 *   out      [S, Hq * D]
 *
 * Every row is stored before any row attends (a draft token attends to the drafts before it).
 * A (row, head) is computed by one thread in a fixed order that depends only on its own
 * context: the result is the same alone or batched, on any number of threads. Softmax is
 * exact up to expf's rounding (exp256 in cpu_kernels.h, relative error ~2e-7). */

#include "cpu_kernels.h"

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
        return load8_bf16((const uint16_t *)kv + i);
    return _mm256_loadu_ps((const float *)kv + i);
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

/* Ask for one head's key or value row ahead of use: a sequence's blocks lie anywhere in the
 * pool and the hardware prefetchers do not follow the block table. Keys are asked for twice:
 * into L2 PREFETCH_FAR keys ahead (L2 tracks more misses at once than L1), then into L1
 * PREFETCH_NEAR keys ahead. */
#define PREFETCH_FAR 64
#define PREFETCH_NEAR 8
#define PREFETCH_VALUES 32 /* the value pass's distance (its rows mostly come in with the keys) */
static inline __attribute__((always_inline)) void prefetch_row(const void *kv, int64_t i,
                                                               const int D, const int bf16) {
    const char *p = (const char *)kv + i * (bf16 ? 2 : 4);
    for (int b = 0; b < D * (bf16 ? 2 : 4); b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
}

static inline __attribute__((always_inline)) void prefetch_row_l2(const void *kv, int64_t i,
                                                                  const int D, const int bf16) {
    const char *p = (const char *)kv + i * (bf16 ? 2 : 4);
    for (int b = 0; b < D * (bf16 ? 2 : 4); b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

/* scores[j] = scale * q . k_j for j < len, 8 keys at a time (their 8 accumulators are summed
 * lane-wise by a fixed hadd tree), the tail one key at a time. D % 8 == 0. */
static inline __attribute__((always_inline)) void head_scores(
        const float *q, const void *kv, const int64_t *keys, int64_t len, int64_t head,
        int D, float scale, float *scores, const int bf16) {
    int64_t j = 0;
    for (; j < len && j < PREFETCH_FAR; j++) prefetch_row_l2(kv, keys[j] + head, D, bf16);
    for (j = 0; j < len && j < PREFETCH_NEAR; j++) prefetch_row(kv, keys[j] + head, D, bf16);
    for (j = 0; j + 8 <= len; j += 8) {
        if (j + PREFETCH_FAR + 8 <= len)
            for (int i = 0; i < 8; i++)
                prefetch_row_l2(kv, keys[j + PREFETCH_FAR + i] + head, D, bf16);
        if (j + PREFETCH_NEAR + 8 <= len)
            for (int i = 0; i < 8; i++)
                prefetch_row(kv, keys[j + PREFETCH_NEAR + i] + head, D, bf16);
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

/* scores := e^(scores - max), returns their sum (8 lanes, a fixed tree, the tail in order).
 * softcap > 0 first caps each score to softcap * tanh(score / softcap) (Gemma 2). A finite
 * sink (GPT-OSS's attention sink; -INFINITY: none) joins the max and adds e^(sink - max) to
 * the sum, a softmax term with no value. */
static inline float softmax_numerators(float *scores, int64_t len, float softcap, float sink) {
    if (softcap > 0)
        for (int64_t j = 0; j < len; j++) scores[j] = softcap * tanhf(scores[j] / softcap);
    float mx = scores[0];
    for (int64_t j = 1; j < len; j++) mx = scores[j] > mx ? scores[j] : mx;
    if (sink > mx) mx = sink;
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
    if (sink > -INFINITY) sum += expf(sink - mx);
    return sum;
}

/* acc[0..NV) += p_j * v_j over the keys, for NV <= 8 vectors of a value row starting at
 * element `first`: NV is a compile-time constant at every call, so the accumulators stay in
 * registers (a runtime count kept them on the stack, each FMA waiting on the last store). */
static inline __attribute__((always_inline)) void value_slice(
        const float *scores, const void *kv, const int64_t *keys, int64_t len, int64_t value,
        int64_t first, int D, float inv, float *out, const int NV, const int bf16) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int i = 0; i < NV; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        if (first == 0 && j + PREFETCH_VALUES < len)
            prefetch_row(kv, keys[j + PREFETCH_VALUES] + value, D, bf16);
        const int64_t v = keys[j] + value + first;
        const __m256 p = _mm256_set1_ps(scores[j]);
#pragma GCC unroll 8
        for (int i = 0; i < NV; i++)
            acc[i] = _mm256_fmadd_ps(p, load8(kv, v + 8 * i, bf16), acc[i]);
    }
    const __m256 vinv = _mm256_set1_ps(inv);
#pragma GCC unroll 8
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(out + first + 8 * i, _mm256_mul_ps(acc[i], vinv));
}

/* out = softmax(scores) @ V for one head; scores is overwritten with the probabilities. The
 * row is done in slices of 8 vectors (64 floats), then one of 1, 2 or 4: every element
 * still sums p * v in key order, as one pass over the whole row would. */
static inline __attribute__((always_inline)) void head_output(
        float *scores, const void *kv, const int64_t *keys, int64_t len, int64_t value,
        int D, float *out, float softcap, float sink, const int bf16) {
    const float inv = 1.0f / softmax_numerators(scores, len, softcap, sink);
    for (int64_t j = 0; j < len && j < PREFETCH_VALUES; j++)
        prefetch_row(kv, keys[j] + value, D, bf16);
    int64_t first = 0;
    for (; first + 64 <= D; first += 64)
        value_slice(scores, kv, keys, len, value, first, D, inv, out, 8, bf16);
    if (D - first >= 32) {
        value_slice(scores, kv, keys, len, value, first, D, inv, out, 4, bf16);
        first += 32;
    }
    if (D - first >= 16) {
        value_slice(scores, kv, keys, len, value, first, D, inv, out, 2, bf16);
        first += 16;
    }
    if (D - first >= 8) value_slice(scores, kv, keys, len, value, first, D, inv, out, 1, bf16);
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
    __m512 kd[16]; /* D <= 256 */
#pragma GCC unroll 16
    for (int c = 0; c < D / 16; c++) kd[c] = load16(kv, k + 16 * c, bf16);
#pragma GCC unroll 8
    for (int h = 0; h < G; h++) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kd[0]);
#pragma GCC unroll 16
        for (int c = 1; c < D / 16; c++)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + 16 * c), kd[c], acc);
        dots[h] = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1));
    }
}

static inline __attribute__((always_inline)) void group_attention(
        const float *q, const void *kv, const int64_t *keys, int64_t len, int64_t head,
        int64_t value, float scale, float *scores, int64_t score_stride, float *out,
        float softcap, const float *sinks, const int D, const int G, const int bf16) {
    /* the first keys at once, then each key ahead as above; a key's value row is asked for
     * as its key is used, so the value pass finds it near. 30 layers x 32 rows at ctx 192 over
     * a 1,400-block cache on 2 MiB pages: 7.3 ms with one prefetch 32 keys ahead and none for
     * values, 6.5 with the value rows, 6.0-6.3 with the two distances (paired runs). */
    int64_t j = 0;
    for (; j < len && j < PREFETCH_FAR; j++) prefetch_row_l2(kv, keys[j] + head, D, bf16);
    for (j = 0; j < len && j < PREFETCH_NEAR; j++) prefetch_row(kv, keys[j] + head, D, bf16);
    for (j = 0; j + 8 <= len; j += 8) {
        __m256 d[8][8]; /* [key][head] */
        if (j + PREFETCH_FAR + 8 <= len)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                prefetch_row_l2(kv, keys[j + PREFETCH_FAR + i] + head, D, bf16);
        if (j + PREFETCH_NEAR + 8 <= len)
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                prefetch_row(kv, keys[j + PREFETCH_NEAR + i] + head, D, bf16);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) prefetch_row(kv, keys[j + i] + value, D, bf16);
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
    for (j = 0; j < len && j < PREFETCH_VALUES; j++) prefetch_row(kv, keys[j] + value, D, bf16);
    float inv[8];
#pragma GCC unroll 8
    for (int h = 0; h < G; h++)
        inv[h] = 1.0f / softmax_numerators(scores + h * score_stride, len, softcap,
                                           sinks != 0 ? sinks[h] : -INFINITY);
    /* the output in slices of CH <= 8 vectors of D, at most 16 accumulators (G x CH) at
     * once: a slice's pass over the keys reads its part of each value row, so every value is
     * still loaded once, and every output element sums p * v in key order whatever the
     * slicing (D 256: two or more passes). With 32 accumulators (G 4) the CH value vectors
     * and the broadcast had no register left and spilled: Gemma 3's G 4, D 256, 32 rows at
     * 192 positions took 0.50 ms, 0.37 with 16 (the same results, bit for bit). */
    const int CH = D / 16 < 16 / G ? (D / 16 < 8 ? D / 16 : 8) : (16 / G < 8 ? 16 / G : 8);
    for (int c0 = 0; c0 < D / 16; c0 += CH) {
        __m512 acc[8][8]; /* [head][16 floats of the slice] */
#pragma GCC unroll 8
        for (int h = 0; h < G; h++)
#pragma GCC unroll 8
            for (int c = 0; c < CH; c++) acc[h][c] = _mm512_setzero_ps();
        for (j = 0; j < len; j++) {
            if (c0 == 0 && j + PREFETCH_VALUES < len)
                prefetch_row(kv, keys[j + PREFETCH_VALUES] + value, D, bf16);
            __m512 vd[8];
#pragma GCC unroll 8
            for (int c = 0; c < CH; c++)
                vd[c] = load16(kv, keys[j] + value + 16 * (c0 + c), bf16);
#pragma GCC unroll 8
            for (int h = 0; h < G; h++) {
                const __m512 p = _mm512_set1_ps(scores[h * score_stride + j]);
#pragma GCC unroll 8
                for (int c = 0; c < CH; c++) acc[h][c] = _mm512_fmadd_ps(p, vd[c], acc[h][c]);
            }
        }
#pragma GCC unroll 8
        for (int h = 0; h < G; h++)
#pragma GCC unroll 8
            for (int c = 0; c < CH; c++)
                _mm512_storeu_ps(out + h * D + 16 * (c0 + c),
                                 _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inv[h])));
    }
}

/* The (D, G) pairs with a compiled group kernel; others take the per-head path. */
#define GROUP_ATTENTION(D_, G_)                                                            \
    if (D == D_ && G == G_) {                                                              \
        if (bf16)                                                                          \
            group_attention(q, kv, keys, len, head, value, scale, scores, stride, out,     \
                            softcap, sinks, D_, G_, 1);                                    \
        else                                                                               \
            group_attention(q, kv, keys, len, head, value, scale, scores, stride, out,     \
                            softcap, sinks, D_, G_, 0);                                    \
        return 1;                                                                          \
    }

static int group_kernel(const float *q, const void *kv, const int64_t *keys, int64_t len,
                        int64_t head, int64_t value, float scale, float *scores,
                        int64_t stride, float *out, float softcap, const float *sinks, int D,
                        int G, int bf16) {
    GROUP_ATTENTION(32, 1) GROUP_ATTENTION(32, 2) GROUP_ATTENTION(32, 4)
    GROUP_ATTENTION(64, 1) GROUP_ATTENTION(64, 2) GROUP_ATTENTION(64, 3)
    GROUP_ATTENTION(64, 4) GROUP_ATTENTION(64, 8) GROUP_ATTENTION(128, 1) GROUP_ATTENTION(128, 2)
    GROUP_ATTENTION(128, 4) GROUP_ATTENTION(256, 1) GROUP_ATTENTION(256, 2)
    GROUP_ATTENTION(256, 4)
    return 0;
}
#undef GROUP_ATTENTION
#endif

/* qkv16, out16 (both or neither): the rows come in bfloat16 (qkv16, converted into qkv, the
 * float32 work rows) and the output goes out in bfloat16 (out16, rounded to nearest even as
 * torch's .to(bfloat16) does; `out` unused): what torch's conversions around the float32 call
 * would give, bit for bit, without them. */
static inline __attribute__((always_inline)) int row_attention(
        float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin, void *kv,
        const int64_t *slots, const int32_t *tables, int64_t table_stride,
        const int32_t *table_of_row, const int32_t *lens, int bs, float scale, float *out,
        int64_t max_len, int threads, int64_t window, float softcap, const float *sinks,
        const int bf16, const uint16_t *qkv16, uint16_t *out16) {
    const int64_t row_stride = (int64_t)(Hq + 2 * Hkv) * D, token_stride = (int64_t)Hkv * D;
    if (qkv16) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && S > 16)
        for (int64_t i = 0; i < S * row_stride; i++) qkv[i] = from_bf16(qkv16[i]);
    }
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
        float *wide = out16 ? malloc((size_t)(group * D) * sizeof(float)) : 0; /* one item */
        if (scores == 0 || keys == 0 || (out16 && wide == 0)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(guided)
        for (int64_t item = 0; item < S * Hkv; item++) { /* a row's KV head and its group */
            if (scores == 0 || keys == 0 || (out16 && wide == 0)) continue;
            const int64_t s = item / Hkv, h = item % Hkv;
            if (s != row) { /* a thread's items come in order: a row's heads share its keys */
                const int64_t t = table_of_row ? table_of_row[s] : s;
                key_offsets(tables + t * table_stride, lens[s], bs, token_stride, keys);
                row = s;
            }
            const float *q = qkv + s * row_stride + h * group * D;
            float *o = out16 ? wide : out + s * Hq * D + h * group * D;
            const int64_t value = bs * token_stride + h * D;
            /* a sliding window: the context's last `window` keys only */
            const int64_t first = window > 0 && lens[s] > window ? lens[s] - window : 0;
            const int64_t *seen = keys + first, len = lens[s] - first;
            int done = 0;
#ifdef __AVX512F__
            done = group_kernel(q, kv, seen, len, h * D, value, scale, scores, max_len, o,
                                softcap, sinks != 0 ? sinks + h * group : 0, D, group, bf16);
#endif
            for (int i = 0; !done && i < group; i++) {
                head_scores(q + i * D, kv, seen, len, h * D, D, scale, scores, bf16);
                head_output(scores, kv, seen, len, value, D, o + i * D, softcap,
                            sinks != 0 ? sinks[h * group + i] : -INFINITY, bf16);
            }
            if (out16) {
                uint16_t *dst = out16 + s * Hq * D + h * group * D;
                for (int64_t i = 0; i < (int64_t)group * D; i++)
                    dst[i] = to_bf16(wide[i]);
            }
        }
        free(keys);
        free(scores);
        free(wide);
    }
    return failed ? -1 : 0;
}

/* kv_bf16: the cache holds bfloat16 (the new K/V are rounded to it), else float32.
 * max_len >= every lens[s]. D % 8 == 0, D <= 256. window > 0: each row attends to the last
 * `window` positions of its context (a sliding window), 0: to all of them. softcap > 0: each
 * scaled score is capped to softcap * tanh(score / softcap) before the softmax (Gemma 2).
 * sinks [Hq] (GPT-OSS; NULL: none): query head h's softmax has the term e^sinks[h] beside its
 * scores, with no value. Returns 0, or -1 when out of memory. */
int pd_row_attention(float *qkv, int64_t S, int Hq, int Hkv, int D, const float *cos_sin,
                        void *kv, int kv_bf16, const int64_t *slots, const int32_t *tables,
                        int64_t table_stride, const int32_t *table_of_row, const int32_t *lens,
                        int bs, float scale, float *out, int64_t max_len, int threads,
                        int64_t window, float softcap, const float *sinks) {
    if (kv_bf16)
        return row_attention(qkv, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride,
                             table_of_row, lens, bs, scale, out, max_len, threads, window,
                             softcap, sinks, 1, 0, 0);
    return row_attention(qkv, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride,
                         table_of_row, lens, bs, scale, out, max_len, threads, window, softcap,
                         sinks, 0, 0, 0);
}

/* pd_row_attention over bfloat16 rows: qkv16 [S, (Hq + 2 Hkv) D] in, `work` float32 rows of
 * that shape (scratch: converted, then rotated), out16 [S, Hq D] bfloat16 out. */
int pd_row_attention_bf16(const uint16_t *qkv16, float *work, int64_t S, int Hq, int Hkv, int D,
                          const float *cos_sin, void *kv, int kv_bf16, const int64_t *slots,
                          const int32_t *tables, int64_t table_stride,
                          const int32_t *table_of_row, const int32_t *lens, int bs, float scale,
                          uint16_t *out16, int64_t max_len, int threads, int64_t window,
                          float softcap, const float *sinks) {
    if (kv_bf16)
        return row_attention(work, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride,
                             table_of_row, lens, bs, scale, 0, max_len, threads, window,
                             softcap, sinks, 1, qkv16, out16);
    return row_attention(work, S, Hq, Hkv, D, cos_sin, kv, slots, tables, table_stride,
                         table_of_row, lens, bs, scale, 0, max_len, threads, window, softcap,
                         sinks, 0, qkv16, out16);
}
