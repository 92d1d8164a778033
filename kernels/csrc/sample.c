#include "cpu_kernels.h"

#include <float.h>

/* One token per row of logits x [M, V]: temperature, top-k, top-p and min-p, then a draw by
 * the inverse CDF of one uniform u in [0, 1) per row. No row is sorted.
 *
 *   1. candidates   the 64 largest logits (pd_select_top, one pass); the first is the max m
 *   2. weights      e_i = exp((x_i - m) / T), written over x (e = 0 below e^-87: a blocked
 *                   -inf logit has no mass); the max has e = 1 exactly
 *   3. cut          the kept tokens are those with e >= cut:
 *                     top-k: cut = the k-th largest e, ties kept
 *                     top-p: over the top-k set, the smallest prefix of (e descending, index
 *                            ascending) whose mass reaches p; tokens equal to the last one
 *                            and after it in index order get e = 0
 *                     min-p: cut = max(cut, min_p), ties kept (probability >= min_p * max)
 *                   When the kept set lies inside the candidates (the usual case: every kept e
 *                   is above the weakest candidate's), all of this is arithmetic on 64 values.
 *                   Otherwise the set is widened, never truncated: the cut is found by
 *                   bisection over the bits of e (positive floats order as their bits), each
 *                   step one vectorized pass counting or summing {e >= t} over the row, until
 *                   the few tokens inside the range are gathered.
 *   4. draw         the first kept token whose running mass exceeds u * (kept mass): over the
 *                   candidates, or in index order over the row (block sums, then the block).
 *
 * Temperature <= 0 is greedy: the argmax, equal values the lower index (as torch). Masses are
 * summed in double. A row's token depends only on that row and its u, not on the threads or
 * the other rows. */
#define CAND 64

static inline double hsum_pd(__m256d v) {
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

static inline __m256d add_halves(__m256d acc, __m256 v) {
    acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

/* e = exp((x - m) * inv_t), 0 where that is below -87 (or NaN) */
static inline __m256 weight8(__m256 x, __m256 m, __m256 inv_t) {
    __m256 z = _mm256_mul_ps(_mm256_sub_ps(x, m), inv_t);
    return _mm256_and_ps(exp256(z), _mm256_cmp_ps(z, _mm256_set1_ps(-87.0f), _CMP_GE_OQ));
}

static void weights(float *x, int64_t n, float m, float inv_t) {
    const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(inv_t);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) _mm256_storeu_ps(x + j, weight8(_mm256_loadu_ps(x + j), vm, vt));
    if (j < n) {
        float tail[8];
        for (int i = 0; i < 8; i++) tail[i] = j + i < n ? x[j + i] : -INFINITY;
        _mm256_storeu_ps(tail, weight8(_mm256_loadu_ps(tail), vm, vt));
        memcpy(x + j, tail, (size_t)(n - j) * sizeof(float));
    }
}

/* The mass (by_mass) or the number of the e >= t, t > 0; four accumulators in flight. */
static double at_least(const float *e, int64_t n, float t, int by_mass) {
    const __m256 vt = _mm256_set1_ps(t), one = _mm256_set1_ps(1.0f);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const __m256 v0 = _mm256_loadu_ps(e + j), v1 = _mm256_loadu_ps(e + j + 8);
        const __m256 w0 = by_mass ? v0 : one, w1 = by_mass ? v1 : one;
        const __m256 k0 = _mm256_and_ps(w0, _mm256_cmp_ps(v0, vt, _CMP_GE_OQ));
        const __m256 k1 = _mm256_and_ps(w1, _mm256_cmp_ps(v1, vt, _CMP_GE_OQ));
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(k0)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(k0, 1)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(k1)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(k1, 1)));
    }
    double s = hsum_pd(_mm256_add_pd(_mm256_add_pd(a0, a1), _mm256_add_pd(a2, a3)));
    for (; j < n; j++) s += e[j] >= t ? (by_mass ? e[j] : 1.0) : 0.0;
    return s;
}

/* A buffer of n floats for this thread, kept for its next rows (no page faults per row). */
static float *scratch(int64_t n) {
    static _Thread_local float *buf = NULL;
    static _Thread_local int64_t size = 0;
    if (size < n) {
        free(buf);
        buf = malloc((size_t)n * sizeof(float));
        if (buf == NULL) abort();
        size = n;
    }
    return buf;
}

/* The tokens with lo <= e < hi into out; how many. */
static int64_t gather(const float *e, int64_t n, float lo, float hi, float *out) {
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    int64_t c = 0, j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(e + j);
        unsigned in = (unsigned)_mm256_movemask_ps(_mm256_and_ps(
            _mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, vhi, _CMP_LT_OQ)));
        for (; in; in &= in - 1) out[c++] = e[j + __builtin_ctz(in)];
    }
    for (; j < n; j++)
        if (e[j] >= lo && e[j] < hi) out[c++] = e[j];
    return c;
}

/* The largest key t in [lo, hi) with at_least(t) >= target, given at_least(lo) >= target >
 * at_least(hi); *above = at_least(the next key after t). The tokens inside [lo, hi) are
 * gathered first, so each bisection step reads only them. */
static uint32_t bisect(const float *e, int64_t n, int by_mass, double target, uint32_t lo,
                       uint32_t hi, double *above) {
    double at_hi = at_least(e, n, bits_float(hi), by_mass);
    if (hi - lo > 1) {
        float *inside = scratch(n);
        const int64_t c = gather(e, n, bits_float(lo), bits_float(hi), inside);
        const double base = at_hi; /* the tokens at or above the hi they were gathered under */
        while (hi - lo > 1) {
            const uint32_t mid = lo + (hi - lo) / 2;
            const double m = base + at_least(inside, c, bits_float(mid), by_mass);
            if (m >= target) lo = mid;
            else {
                hi = mid;
                at_hi = m;
            }
        }
    }
    *above = at_hi;
    return lo;
}

#define BLOCK 64

/* The kept mass of each BLOCK of tokens (kept: e >= cut > 0) into sums, and their total. */
static double block_sums(const float *e, int64_t n, float cut, double *sums) {
    const __m256 vc = _mm256_set1_ps(cut);
    double total = 0;
    for (int64_t j = 0, b = 0; j < n; j += BLOCK, b++) {
        double s = 0;
        if (j + BLOCK <= n) {
            __m256d a0 = _mm256_setzero_pd(), a1 = a0;
            for (int i = 0; i < BLOCK; i += 16) {
                const __m256 v0 = _mm256_loadu_ps(e + j + i), v1 = _mm256_loadu_ps(e + j + i + 8);
                a0 = add_halves(a0, _mm256_and_ps(v0, _mm256_cmp_ps(v0, vc, _CMP_GE_OQ)));
                a1 = add_halves(a1, _mm256_and_ps(v1, _mm256_cmp_ps(v1, vc, _CMP_GE_OQ)));
            }
            s = hsum_pd(_mm256_add_pd(a0, a1));
        } else {
            for (int64_t i = j; i < n; i++) s += e[i] >= cut ? e[i] : 0.0;
        }
        sums[b] = s;
        total += s;
    }
    return total;
}

/* The kept token (e >= cut > 0) where the running mass, in index order, first exceeds
 * u * (kept mass). */
static int64_t draw_row(const float *e, int64_t n, float cut, double u, int64_t argmax,
                        int64_t *num_kept) {
    if (num_kept) {
        int64_t c = 0;
        for (int64_t i = 0; i < n; i++) c += e[i] >= cut;
        *num_kept = c;
    }
    const int64_t num_blocks = (n + BLOCK - 1) / BLOCK;
    double *sums = malloc((size_t)num_blocks * sizeof(double));
    if (sums == NULL) abort();
    const double target = u * block_sums(e, n, cut, sums);
    double acc = 0;
    int64_t block = -1; /* where the draw lands: the last block with kept mass at worst */
    int reached = 0;
    for (int64_t b = 0; b < num_blocks && !reached; b++) {
        if (sums[b] > 0) block = b;
        if (acc + sums[b] > target) reached = 1;
        else acc += sums[b];
    }
    free(sums);
    if (block < 0) return argmax;
    int64_t last = argmax;
    for (int64_t i = block * BLOCK; i < (block + 1) * BLOCK && i < n; i++) {
        if (!(e[i] >= cut)) continue;
        last = i;
        acc += e[i]; /* reached: acc was the mass before the block */
        if (reached && acc > target) return i;
    }
    return last; /* u * total rounded up to total, or the element sums below the block's */
}

static int64_t sample_row(float *x, int64_t V, float temperature, int64_t top_k, float top_p,
                          float min_p, double u, int64_t *num_kept) {
    int64_t cand[CAND];
    const int filtered = (top_k > 0 && top_k < V) || top_p < 1.0f || min_p > 0.0f;
    const int C = filtered ? (int)(V < CAND ? V : CAND) : 1;
    if (C == 1) pd_topk_row(x, V, 1, cand);
    else pd_select_top(x, V, C, cand);
    const float m = x[cand[0]];
    if (temperature <= 0.0f || !isfinite(m)) {
        if (num_kept) *num_kept = 1;
        return cand[0];
    }
    weights(x, V, m, 1.0f / temperature);
    float ce[CAND] = {0};
    for (int i = 0; i < C; i++) ce[i] = x[cand[i]];
    for (int i = 1; i < C; i++) { /* e descending, index ascending (distinct x, equal e) */
        const float v = ce[i];
        const int64_t a = cand[i];
        int p = i;
        for (; p > 0 && (ce[p - 1] < v || (ce[p - 1] == v && cand[p - 1] > a)); p--) {
            ce[p] = ce[p - 1];
            cand[p] = cand[p - 1];
        }
        ce[p] = v;
        cand[p] = a;
    }
    /* Every token outside the candidates has e <= ce[C - 1]: a cut above that keeps only
     * candidates; all_in says every token is a candidate. */
    const int all_in = C == V;
    const float weakest = ce[C - 1];
    float cut = FLT_TRUE_MIN; /* kept: e >= cut */
    int n_keep = -1; /* >= 0: the kept set is cand[0 .. n_keep) */

    double kept_mass = -1; /* mass of the top-k set, once known */
    if (top_k > 0 && top_k < V) {
        if (top_k <= C && (all_in || ce[top_k - 1] > weakest)) {
            cut = ce[top_k - 1];
            n_keep = (int)top_k;
            while (n_keep < C && ce[n_keep] == cut) n_keep++;
            kept_mass = 0;
            for (int i = 0; i < n_keep; i++) kept_mass += ce[i];
        } else {
            double above;
            cut = bits_float(bisect(x, V, 0, (double)top_k, 0, float_bits(weakest) + 1, &above));
            kept_mass = at_least(x, V, cut, 1);
        }
    }
    if (top_p < 1.0f) {
        if (kept_mass < 0) kept_mass = at_least(x, V, 0.0f, 1);
        const double target = (double)top_p * kept_mass;
        const int limit = n_keep >= 0 ? n_keep : C;
        double acc = 0;
        int found = -1;
        for (int i = 0; i < limit && ce[i] >= cut; i++) {
            acc += ce[i];
            if (acc >= target) {
                found = i;
                break;
            }
        }
        if (found >= 0 && (n_keep >= 0 || all_in || ce[found] > weakest)) {
            n_keep = found + 1;
            cut = ce[found];
        } else { /* the nucleus reaches past the candidates: widen to the whole row */
            /* the tokens below t hold at most (number of them) * t: a t with
             * V * t <= kept_mass - target leaves at least target above it */
            const float floor_t = nextafterf((float)((kept_mass - target) / (double)V), 0.0f);
            uint32_t lo = float_bits(cut), hi = float_bits(weakest) + 1;
            if (float_bits(floor_t) > lo && float_bits(floor_t) < hi) lo = float_bits(floor_t);
            double above;
            cut = bits_float(bisect(x, V, 1, target, lo, hi, &above));
            /* of the tokens equal to the cut, the first in index order that reach the
             * target stay; the others get no weight */
            const double need = target - above;
            double ties = 0;
            for (int64_t i = 0; i < V; i++) {
                if (x[i] != cut) continue;
                if (ties >= need) x[i] = 0.0f;
                else ties += x[i];
            }
        }
    }
    if (min_p > cut) {
        cut = min_p;
        if (n_keep >= 0 || all_in || min_p > weakest) {
            int n = 1; /* ce[0] = 1 >= min_p */
            while (n < C && ce[n] >= min_p && (n_keep < 0 || n < n_keep)) n++;
            n_keep = n;
        }
    }
    if (!(cut > 0.0f)) cut = FLT_TRUE_MIN; /* a zero weight is never drawn */
    if (n_keep < 0) return draw_row(x, V, cut, u, cand[0], num_kept);
    while (n_keep > 1 && !(ce[n_keep - 1] > 0)) n_keep--;
    if (num_kept) *num_kept = n_keep;
    double total = 0;
    for (int i = 0; i < n_keep; i++) total += ce[i];
    const double target = u * total;
    double acc = 0;
    for (int i = 0; i < n_keep; i++) {
        acc += ce[i];
        if (acc > target) return cand[i];
    }
    return cand[n_keep - 1];
}

void pd_sample(float *x, int64_t M, int64_t V, const float *temperature, const int64_t *top_k,
               const float *top_p, const float *min_p, const double *u, int64_t *out,
               int64_t *num_kept, int threads) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++)
        out[r] = sample_row(x + r * V, V, temperature[r], top_k[r], top_p[r], min_p[r], u[r],
                            num_kept ? num_kept + r : NULL);
}
