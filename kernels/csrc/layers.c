#include "cpu_kernels.h"

/* 1 / rms of a row of `dim` (float32, or bfloat16 widened): the sum of squares in 8 float
 * lanes then a fixed tree and the tail in order, per row: independent of the number of rows. */
static inline __attribute__((always_inline)) float inv_rms(const void *x, int64_t dim,
                                                           float eps, const int bf16) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) {
        __m256 v = bf16 ? load8_bf16((const uint16_t *)x + i)
                        : _mm256_loadu_ps((const float *)x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < dim; i++) {
        const float v = bf16 ? from_bf16(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        ss += v * v;
    }
    return 1.0f / sqrtf(ss / (float)dim + eps);
}

/* x += residual (when given), then y = rmsnorm(x) * weight, per row of `dim`. */
void pd_add_rms_norm(float *x, const float *residual, const float *weight, float eps,
                     float *y, int64_t rows, int64_t dim) {
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        if (residual != 0) {
            const float *a = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) xr[i] += a[i];
        }
        const float inv = inv_rms(xr, dim, eps, 0);
        float *yr = y + r * dim;
        for (int64_t i = 0; i < dim; i++) yr[i] = (xr[i] * inv) * weight[i];
    }
}

/* pd_add_rms_norm on bfloat16 rows, with the roundings of the model's bf16 reference:
 * x = bf16(x + residual) in place (when given); y = bf16(weight * bf16(x * inv)), inv from the
 * row's float32 sum of squares (inv_rms). Rows split over threads. */
void pd_add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                          float eps, uint16_t *y, int64_t rows, int64_t dim, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *xr = x + r * dim;
        if (residual != 0) {
            const uint16_t *a = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) xr[i] = to_bf16(from_bf16(xr[i]) + from_bf16(a[i]));
        }
        const float inv = inv_rms(xr, dim, eps, 1);
        uint16_t *yr = y + r * dim;
        for (int64_t i = 0; i < dim; i++)
            yr[i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(from_bf16(xr[i]) * inv)));
    }
}

/* ---- whole decoder layers for decode rows ------------------------------------------------
 *
 * The decode rows of a step through num_layers Llama layers in one call, float32, with the
 * kernels of matmul*.c and attention.c: no Python between the 10 operations of a layer. Per layer, with h the
 * residual stream:
 *
 *   x = rmsnorm(h) * in_norm          (layer 0; later layers get it from the add below)
 *   qkv = x @ Wqkv (+ bias); q/k heads normed (when q_norm is set); rope, K/V store,
 *   attention (over the layer's window, when set) -> a; h += a @ Wo
 *   x = rmsnorm(h) * post_norm;  g|u = x @ Wgate_up;  h += (silu(g) * u) @ Wdown
 *   (a mixture of experts' layer: h += moe_mlp(x), its routed and shared experts)
 *
 * Gemma's layer: GeGLU (gelu) instead of silu, its local layers' own rope (local_rope), and
 * the sandwich norms: h += rmsnorm(a @ Wo) * attn_out_norm, and the MLP's output likewise.
 * GPT-OSS's: attention sinks, biases on o and the experts, a router bias, its clamped SwiGLU.
 *
 * and at the end out = rmsnorm(h) * final_norm. The operations and their order are those of
 * the per-operation path (pd_add_rms_norm, pd_q4_matmul / pd_q8_matmul, pd_row_attention),
 * so every row is still batch and thread invariant. */

static int matmul(const float *x, int64_t M, const pd_matrix *w, float *y, int threads) {
    int status = 0;
    if (w->int8_x)
#ifdef __AVX512VNNI__
        status = pd_i8_matmul(x, M, w->k, w->kind, (const uint8_t *)w->qs, w->d, w->c, w->n, y,
                              threads);
#else
        return -1; /* packed for a build this is not */
#endif
    else if (w->kind == KIND_Q4)
        status = pd_q4_matmul(x, M, w->k, (const uint8_t *)w->qs, w->d, w->c, w->n, y, threads);
    else
        status = pd_q8_matmul(x, M, w->k, w->kind, (const int8_t *)w->qs, w->d, w->c, w->n, y,
                              threads);
    if (w->bias != 0)
        for (int64_t r = 0; r < M; r++)
            for (int64_t j = 0; j < w->n; j++) y[r * w->n + j] += w->bias[j];
    return status;
}

/* act[r, :] = act(gu[r, :I], gu[r, I:]) (cpu_kernels.h's ACT_*): silu(g) * u with
 * silu(g) = g / (1 + e^-g); GeGLU's tanh-approximated GELU, 0.5 g (1 + tanh(sqrt(2/pi) (g +
 * 0.044715 g^3))) * u with tanh(z) = 1 - 2 / (e^2z + 1); GPT-OSS's g / (1 + e^(-alpha g)) *
 * (u + 1) of the clamped g and u. Rows split over the threads (32 rows of 1,536 take ~16 us on
 * one Zen 5 core, 30 times a step) */
static inline __m256 gate256(__m256 g, const int act, const float alpha) {
    const __m256 one = _mm256_set1_ps(1.0f);
    if (act != ACT_GELU) {
        const __m256 ag = act == ACT_SWIGLU_OAI ? _mm256_mul_ps(_mm256_set1_ps(alpha), g) : g;
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), ag));
        return _mm256_div_ps(g, _mm256_add_ps(one, e));
    }
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                   _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    const __m256 e = exp256(_mm256_add_ps(z, z));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

/* act(g) * u of 8 lanes; ACT_SWIGLU_OAI clamps g from above and u both ways, and adds 1 to u */
static inline __m256 glu256(__m256 g, __m256 u, const int act, const float alpha,
                            const float limit) {
    if (act == ACT_SWIGLU_OAI) {
        const __m256 lim = _mm256_set1_ps(limit);
        g = _mm256_min_ps(g, lim);
        u = _mm256_add_ps(_mm256_max_ps(_mm256_min_ps(u, lim), _mm256_sub_ps(_mm256_setzero_ps(),
                                                                             lim)),
                          _mm256_set1_ps(1.0f));
    }
    return _mm256_mul_ps(gate256(g, act, alpha), u);
}

static void gated_mul(const float *gu, int64_t M, int64_t I, float *act_out, int act,
                      float alpha, float limit, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && M > 1)
    for (int64_t r = 0; r < M; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *a = act_out + r * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(a + i, glu256(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i), act,
                                           alpha, limit));
        for (; i < I; i++) {
            float gt[8] = {g[i]}, ut[8] = {u[i]}, out[8];
            _mm256_storeu_ps(out, glu256(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut), act, alpha,
                                         limit));
            a[i] = out[0];
        }
    }
}

/* out [S, H] = a mixture of experts' MLP of x [S, H] (engine_core/model/feed_forward.py,
 * SparseMoE): each row's router probabilities softmax(x . router_e (+ router_bias_e)) in
 * float32, its top_k
 * experts (pd_topk_row: equal probabilities, the lower expert first) weighted by their
 * probabilities (renormalized over the chosen where norm_topk), the routed experts as
 * pd_moe_experts runs them (experts in order, each on its rows in row order), then the shared
 * expert's output times sigmoid(x . shared_gate) added. Returns 0, or -1 when out of memory
 * or a matmul failed. */
static int moe_mlp(const float *x, int64_t S, int64_t H, const pd_moe *m, const pd_layer *L,
                   float *out, int threads) {
    const int E = m->num_experts, K = m->top_k;
    float *probs = malloc((size_t)(S * E) * sizeof(float));
    int64_t *chosen = malloc((size_t)(S * K) * sizeof(int64_t));
    int64_t *counts = calloc((size_t)E, sizeof(int64_t));
    int64_t *next = malloc((size_t)E * sizeof(int64_t));
    int64_t *rows = malloc((size_t)(S * K) * sizeof(int64_t));
    float *weights = malloc((size_t)(S * K) * sizeof(float));
    int status = (probs == 0 || chosen == 0 || counts == 0 || next == 0 || rows == 0 ||
                  weights == 0) ? -1 : 0;
    for (int64_t s = 0; s < S && status == 0; s++) {
        float *p = probs + s * E, top = -INFINITY, total = 0.0f;
        for (int e = 0; e < E; e++) {
            p[e] = dot(x + s * H, m->router + (int64_t)e * H, H);
            if (m->router_bias != 0) p[e] += m->router_bias[e];
            if (p[e] > top) top = p[e];
        }
        for (int e = 0; e < E; e++) total += (p[e] = expf(p[e] - top));
        for (int e = 0; e < E; e++) p[e] /= total;
        pd_topk_row(p, E, K, chosen + s * K);
        for (int j = 0; j < K; j++) counts[chosen[s * K + j]]++;
    }
    /* the (row, expert) pairs grouped by expert, rows ascending within each */
    int64_t first = 0;
    for (int e = 0; e < E && status == 0; e++) {
        next[e] = first;
        first += counts[e];
    }
    for (int64_t s = 0; s < S && status == 0; s++) {
        float chosen_sum = 0.0f;
        for (int j = 0; j < K; j++) chosen_sum += probs[s * E + chosen[s * K + j]];
        for (int j = 0; j < K; j++) {
            const int64_t e = chosen[s * K + j], at = next[e]++;
            rows[at] = s;
            weights[at] = probs[s * E + e] / (m->norm_topk ? chosen_sum : 1.0f);
        }
    }
    if (status == 0) {
        memset(out, 0, (size_t)(S * H) * sizeof(float));
        status = pd_moe_experts(x, S, H, m->gate_up, m->down, E, m->width, L->act, L->act_alpha,
                                L->act_limit, counts, rows, weights, out, threads);
    }
    if (status == 0 && m->shared_width > 0) {
        const int64_t I = m->shared_width;
        float *gu = malloc((size_t)(S * 2 * I) * sizeof(float));
        float *act = malloc((size_t)(S * I) * sizeof(float));
        float *y = malloc((size_t)(S * H) * sizeof(float));
        status = (gu == 0 || act == 0 || y == 0) ? -1 : 0;
        if (status == 0) {
            status |= matmul(x, S, &m->shared_gate_up, gu, threads);
            gated_mul(gu, S, I, act, L->act, L->act_alpha, L->act_limit, threads);
            status |= matmul(act, S, &m->shared_down, y, threads);
            for (int64_t s = 0; s < S && status == 0; s++) {
                const float g = 1.0f / (1.0f + expf(-dot(x + s * H, m->shared_gate, H)));
                for (int64_t h = 0; h < H; h++) out[s * H + h] += g * y[s * H + h];
            }
        }
        free(gu);
        free(act);
        free(y);
    }
    free(probs);
    free(chosen);
    free(counts);
    free(next);
    free(rows);
    free(weights);
    return status;
}

/* h [S, H]: the rows' embeddings in, their residual stream after the last layer out.
 * kv: layer l's cache at kv + l * layer_stride elements (float32 or bfloat16, kv_bf16).
 * out [S, H]: rmsnorm(h) * final_norm. Returns 0, or -1 when out of memory. */
int pd_decode_layers(float *h, int64_t S, int64_t H, const pd_layer *layers, int num_layers,
                     int64_t I, float eps, int Hq, int Hkv, int D, const float *cos_sin,
                     const float *cos_sin_local,
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
        if (L->q_norm != 0) /* Qwen3: each q and k head normed in place, before rope */
            for (int64_t s = 0; s < S; s++) {
                float *q = wide + s * qkv_n, *k = q + (int64_t)Hq * D;
                pd_add_rms_norm(q, 0, L->q_norm, eps, q, Hq, D);
                pd_add_rms_norm(k, 0, L->k_norm, eps, k, Hkv, D);
            }
        status |= pd_row_attention(wide, S, Hq, Hkv, D, L->local_rope ? cos_sin_local : cos_sin,
                                      (char *)kv + (size_t)l * layer_stride * elem, kv_bf16,
                                      slots, tables, table_stride, 0, lens, bs, scale, att,
                                      max_len, threads, L->window, L->softcap, L->sinks);
        status |= matmul(att, S, &L->o, tmp, threads);
        if (L->attn_out_norm != 0) pd_add_rms_norm(tmp, 0, L->attn_out_norm, eps, tmp, S, H);
        pd_add_rms_norm(h, tmp, L->post_norm, eps, x, S, H);
        if (L->moe != 0) {
            status |= moe_mlp(x, S, H, L->moe, L, tmp, threads);
        } else {
            status |= matmul(x, S, &L->gate_up, wide, threads);
            gated_mul(wide, S, I, att, L->act, L->act_alpha, L->act_limit, threads);
            status |= matmul(att, S, &L->down, tmp, threads);
        }
        if (L->mlp_out_norm != 0) pd_add_rms_norm(tmp, 0, L->mlp_out_norm, eps, tmp, S, H);
    }
    if (status == 0) pd_add_rms_norm(h, num_layers > 0 ? tmp : 0, final_norm, eps, out, S, H);
    free(x);
    free(wide);
    free(att);
    free(tmp);
    return status ? -1 : 0;
}

/* A mixture of experts' routed experts on decode rows (engine_core/model/decoder.py,
 * SparseMoE): x [S, H]; the (row, expert) pairs grouped by expert, counts[e] of them for
 * expert e, rows[j] the row of pair j and weights[j] its routing weight. For each expert in
 * order: out[rows[j]] += weights[j] * (act(g) * u) @ down_e with g|u = x[rows[j]] @ gate_up_e,
 * the per-operation path's operations (matmul, gated_mul, matmul), so every row is still batch
 * and thread invariant. Returns 0, or -1 when out of memory or a matmul failed. */
int pd_moe_experts(const float *x, int64_t S, int64_t H, const pd_matrix *gate_up,
                   const pd_matrix *down, int num_experts, int64_t I, int act, float act_alpha,
                   float act_limit, const int64_t *counts, const int64_t *rows,
                   const float *weights, float *out, int threads) {
    (void)S;
    int64_t most = 0;
    for (int e = 0; e < num_experts; e++)
        if (counts[e] > most) most = counts[e];
    if (most == 0) return 0;
    float *xs = malloc((size_t)(most * H) * sizeof(float));
    float *gu = malloc((size_t)(most * 2 * I) * sizeof(float));
    float *act_out = malloc((size_t)(most * I) * sizeof(float));
    float *y = malloc((size_t)(most * H) * sizeof(float));
    int status = (xs == 0 || gu == 0 || act_out == 0 || y == 0) ? -1 : 0;
    int64_t first = 0;
    for (int e = 0; e < num_experts && status == 0; e++) {
        const int64_t c = counts[e];
        if (c == 0) continue;
        for (int64_t j = 0; j < c; j++)
            memcpy(xs + j * H, x + rows[first + j] * H, (size_t)H * sizeof(float));
        status |= matmul(xs, c, gate_up + e, gu, threads);
        gated_mul(gu, c, I, act_out, act, act_alpha, act_limit, threads);
        status |= matmul(act_out, c, down + e, y, threads);
        for (int64_t j = 0; j < c; j++) {
            float *o = out + rows[first + j] * H;
            const float w = weights[first + j], *yj = y + j * H;
            for (int64_t h = 0; h < H; h++) o[h] += w * yj[h];
        }
        first += c;
    }
    free(xs);
    free(gu);
    free(act_out);
    free(y);
    return status ? -1 : 0;
}
