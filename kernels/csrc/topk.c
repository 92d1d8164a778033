#include "cpu_kernels.h"

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

void pd_topk_row(const float *row, int64_t N, int k, int64_t *idx) {
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
    memcpy(idx, at, (size_t)k * sizeof(int64_t));
}

void pd_topk(const float *x, int64_t M, int64_t N, int k, int64_t *idx, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++) pd_topk_row(x + r * N, N, k, idx + r * k);
}

#define SELECT_BUF (4 * TOPK_MAX)

typedef struct {
    float v;
    int64_t i;
} topk_cand;

static inline int better(topk_cand a, topk_cand b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

/* Reorder c[0..n) so that c[0..k) are its k best (in no order), c[k - 1] the k-th. */
static void keep_best(topk_cand *c, int n, int k) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const topk_cand pivot = c[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (better(c[i], pivot)) i++;
            while (better(pivot, c[j])) j--;
            if (i <= j) {
                const topk_cand t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
}

/* idx[0..k): the k largest of row[0..n) (k <= 64 <= n), largest first, equal values by
 * index: pd_topk_row's result. Values above a bar (the k-th best so far) are appended to a
 * buffer; a full buffer is cut back to its k best, which raises the bar: most of the row costs
 * one vector compare, and a value that enters costs O(1), not pd_topk_row's O(k) scan. */
void pd_select_top(const float *row, int64_t n, int k, int64_t *idx) {
    topk_cand c[SELECT_BUF];
    int m = 0;
    for (; m < k; m++) c[m] = (topk_cand){row[m], m};
    float bar = -INFINITY;
    int64_t j = k;
    for (; j + 8 <= n; j += 8) {
        unsigned above = (unsigned)_mm256_movemask_ps(
            _mm256_cmp_ps(_mm256_loadu_ps(row + j), _mm256_set1_ps(bar), _CMP_GT_OQ));
        for (; above; above &= above - 1) {
            const int64_t at = j + __builtin_ctz(above);
            if (!(row[at] > bar)) continue; /* the bar rose within this vector */
            c[m++] = (topk_cand){row[at], at};
            if (m == SELECT_BUF) {
                keep_best(c, m, k);
                m = k;
                bar = c[k - 1].v;
            }
        }
    }
    for (; j < n; j++) {
        if (!(row[j] > bar)) continue;
        c[m++] = (topk_cand){row[j], j};
        if (m == SELECT_BUF) {
            keep_best(c, m, k);
            m = k;
            bar = c[k - 1].v;
        }
    }
    keep_best(c, m, k);
    for (int i = 1; i < k; i++) { /* largest first */
        const topk_cand v = c[i];
        int p = i;
        for (; p > 0 && better(v, c[p - 1]); p--) c[p] = c[p - 1];
        c[p] = v;
    }
    for (int i = 0; i < k; i++) idx[i] = c[i].i;
}
