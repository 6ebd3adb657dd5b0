/*
 * pf_draft.c: a small DFlash draft's pass and greedy head on the CPU (see pf_draft.h).
 *
 * Everything is computed in float32 (weights float32 or bf16) on one thread: a pass of the embedded draft (3 layers, H = 192)
 * is about 9 M multiply-adds, a few hundred microseconds on one core, where the same pass as
 * PyTorch operators costs milliseconds in per-operator overhead. The products run through
 * one linear kernel (rows of x against rows of W), in portable C or AVX2 + FMA chosen per
 * call; attention, norms, rotary and SwiGLU are plain loops over the few rows of a step.
 */
#define _GNU_SOURCE
#include "pf_draft.h"
#include "pf_cpu.h"
#include "pf_simd.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 1024

typedef struct kernels {
    /* y[r * ys + o] = x[r] . w[o] (+ bias[o]) for r < m, o < nout; x rows xs apart; w rows of k
     * float32 (bf == 0) or bf16 (bf == 1) elements */
    void (*linear)(const float *x, int m, int k, int xs, const void *w, int bf, const float *bias, int nout,
                   float *y, int ys);
    float (*dot)(const float *a, const float *b, int n);
    void (*axpy)(float *y, float a, const float *x, int n); /* y += a x */
} kernels;

static inline float weight_at(const void *w, int bf, size_t i) {
    return bf ? pf_bf16_to_f32(((const uint16_t *)w)[i]) : ((const float *)w)[i];
}

/* ---- portable ------------------------------------------------------------------------ */
static void linear_c(const float *x, int m, int k, int xs, const void *w, int bf, const float *bias, int nout,
                     float *y, int ys) {
    for (int r = 0; r < m; r++)
        for (int o = 0; o < nout; o++) {
            const float *xr = x + (size_t)r * xs;
            float s = 0.0f;
            for (int i = 0; i < k; i++) s += xr[i] * weight_at(w, bf, (size_t)o * k + i);
            y[(size_t)r * ys + o] = bias ? s + bias[o] : s;
        }
}

static float dot_c(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void axpy_c(float *y, float a, const float *x, int n) {
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static const kernels KERNELS_C = {linear_c, dot_c, axpy_c};

/* ---- AVX2 + FMA ---------------------------------------------------------------------- */
#if PF_X86
#define T_AVX2 __attribute__((target("avx2,fma")))
#define INL static inline __attribute__((always_inline))

T_AVX2 INL float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

T_AVX2 INL __m256 load_w(const void *w, int bf, size_t i) {
    if (bf) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* One tile: R rows of x (R <= 4) against OT rows of w starting at output o (R * OT <= 8), eight
 * independent FMA chains, so the products run at the FMA units' rate rather than at one
 * chain's latency. Writes y[r * ys + o + t] for t < OT. */
T_AVX2 INL void tile_avx2(const float *x, const int R, int k, int xs, const void *w, const int bf, const float *bias,
                          int o, const int OT, float *y, int ys) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int a = 0; a < 8; a++) acc[a] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= k; i += 8) {
        __m256 xv[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + (size_t)r * xs + i);
#pragma GCC unroll 8
        for (int t = 0; t < OT; t++) {
            __m256 wv = load_w(w, bf, (size_t)(o + t) * k + i);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[t * R + r] = _mm256_fmadd_ps(wv, xv[r], acc[t * R + r]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < OT; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float s = hsum8(acc[t * R + r]);
            for (int j = i; j < k; j++) s += x[(size_t)r * xs + j] * weight_at(w, bf, (size_t)(o + t) * k + j);
            y[(size_t)r * ys + o + t] = bias ? s + bias[o + t] : s;
        }
}

/* R rows (1..4, a constant after inlining) against every output: tiles of 8 / R outputs, then
 * the last outputs one at a time */
T_AVX2 INL void rows_avx2(const float *x, const int R, int k, int xs, const void *w, int bf, const float *bias, int nout,
                          float *y, int ys) {
    const int OT = R == 1 ? 8 : R == 2 ? 4 : 2;
    int o = 0;
    if (bf) {
        for (; o + OT <= nout; o += OT) tile_avx2(x, R, k, xs, w, 1, bias, o, OT, y, ys);
        for (; o < nout; o++) tile_avx2(x, R, k, xs, w, 1, bias, o, 1, y, ys);
    } else {
        for (; o + OT <= nout; o += OT) tile_avx2(x, R, k, xs, w, 0, bias, o, OT, y, ys);
        for (; o < nout; o++) tile_avx2(x, R, k, xs, w, 0, bias, o, 1, y, ys);
    }
}

T_AVX2 static void linear_avx2(const float *x, int m, int k, int xs, const void *w, int bf, const float *bias, int nout,
                               float *y, int ys) {
    for (int r = 0; r < m; r += 4) {
        const float *xr = x + (size_t)r * xs;
        float *yr = y + (size_t)r * ys;
        switch (m - r) {
        case 1: rows_avx2(xr, 1, k, xs, w, bf, bias, nout, yr, ys); break;
        case 2: rows_avx2(xr, 2, k, xs, w, bf, bias, nout, yr, ys); break;
        case 3: rows_avx2(xr, 3, k, xs, w, bf, bias, nout, yr, ys); break;
        default: rows_avx2(xr, 4, k, xs, w, bf, bias, nout, yr, ys); break;
        }
    }
}

T_AVX2 static float dot_avx2(const float *a, const float *b, int n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    float s = hsum8(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

T_AVX2 static void axpy_avx2(float *y, float a, const float *x, int n) {
    __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

static const kernels KERNELS_AVX2 = {linear_avx2, dot_avx2, axpy_avx2};
#endif

/* ---- dispatch: the CPU's level is detected once ----------------------------------------- */
static pthread_once_t detect_once = PTHREAD_ONCE_INIT;
static int detected_level = PF_CPU_LEVEL_SCALAR;

static void detect(void) { detected_level = pf_cpu_detect(); }

/* the kernels for `level`, or NULL (*err set) when it is not valid or not supported */
static const kernels *kernels_for(int level, int *err) {
    pthread_once(&detect_once, detect);
    if (level == PF_CPU_LEVEL_AUTO) level = detected_level;
    if (level < PF_CPU_LEVEL_SCALAR || level > PF_CPU_LEVEL_AMX_BF16) { /* (the levels above AVX2 run its kernels) */
        *err = PF_CPU_EINVAL;
        return NULL;
    }
    if (level > detected_level) {
        *err = PF_CPU_EUNSUPPORTED;
        return NULL;
    }
#if PF_X86
    if (level >= PF_CPU_LEVEL_AVX2) return &KERNELS_AVX2;
#endif
    return &KERNELS_C;
}

/* ---- the pieces of a pass ----------------------------------------------------------- */
static void rms_norm(float *y, const float *x, const float *w, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* x [D] in place: x * cos + rotate_half(x) * sin */
static void rotate(float *x, const float *cos, const float *sin, int d) {
    float t[MAX_HEAD_DIM];
    int half = d / 2;
    for (int i = 0; i < half; i++) t[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int i = half; i < d; i++) t[i] = x[i] * cos[i] + x[i - half] * sin[i];
    memcpy(x, t, (size_t)d * sizeof(float));
}

static int model_ok(const pf_draft_model *m) {
    if (!m || !m->layer || !m->fc || !m->hidden_norm || !m->norm) return 0;
    if (m->hidden < 1 || m->heads < 1 || m->kv_heads < 1 || m->head_dim < 2 || m->inter < 1 || m->layers < 1 ||
        m->features < 1)
        return 0;
    if (m->heads % m->kv_heads || m->head_dim % 2 || m->head_dim > MAX_HEAD_DIM || !(m->eps >= 0.0f)) return 0;
    if (m->matrices_bf16 != 0 && m->matrices_bf16 != 1) return 0;
    for (int l = 0; l < m->layers; l++) {
        const pf_draft_layer *L = &m->layer[l];
        if (!L->input_norm || !L->post_norm || !L->w_qkv || !L->q_norm || !L->k_norm || !L->w_o || !L->w_gate_up ||
            !L->w_down || L->window < 0)
            return 0;
    }
    return 1;
}

int pf_draft_pass(const pf_draft_model *m, float *keys, float *values, int capacity, int length,
                  const float *features, int n, float *x, int b, const float *cos, const float *sin,
                  int table, int level) {
    if (!model_ok(m) || !keys || !values || !cos || !sin) return PF_CPU_EINVAL;
    if (length < 0 || n < 0 || b < 0 || n + b < 1 || capacity < 1) return PF_CPU_EINVAL;
    if ((long long)length + n + b > capacity || (long long)length + n + b > table) return PF_CPU_EINVAL;
    if ((n && !features) || (b && !x)) return PF_CPU_EINVAL;
    int err = PF_CPU_OK;
    const kernels *K = kernels_for(level, &err);
    if (!K) return err;

    const int H = m->hidden, Hq = m->heads, Hkv = m->kv_heads, D = m->head_dim, I = m->inter;
    const int t = n + b, QD = Hq * D, KVD = Hkv * D, end = length + t, group = Hq / Hkv;
    const size_t cache_head = (size_t)capacity * D;
    /* scratch: ctx [n][H], rows [t][H], q [b][QD], kv [t][2 KVD], att [b][QD], tmp / xn [b][H] each,
     * gu [b][2I], h [b][I], scores [end] */
    size_t floats = (size_t)n * H + (size_t)t * H + (size_t)b * QD + (size_t)t * 2 * KVD + (size_t)b * QD +
                    (size_t)2 * b * H + (size_t)b * 2 * I + (size_t)b * I + (size_t)end;
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return PF_CPU_ENOMEM;
    float *ctx = buf, *rows = ctx + (size_t)n * H, *q = rows + (size_t)t * H, *kv = q + (size_t)b * QD;
    float *att = kv + (size_t)t * 2 * KVD, *tmp = att + (size_t)b * QD, *xn = tmp + (size_t)b * H;
    float *gu = xn + (size_t)b * H, *hb = gu + (size_t)b * 2 * I, *scores = hb + (size_t)b * I;
    const float scale = 1.0f / sqrtf((float)D);
    const int bf = m->matrices_bf16;
    const size_t esize = bf ? 2 : 4;

    if (n) {
        K->linear(features, n, m->features, m->features, m->fc, bf, NULL, H, ctx, H);
        for (int i = 0; i < n; i++) rms_norm(ctx + (size_t)i * H, ctx + (size_t)i * H, m->hidden_norm, H, m->eps);
    }
    for (int l = 0; l < m->layers; l++) {
        const pf_draft_layer *L = &m->layer[l];
        memcpy(rows, ctx, (size_t)n * H * sizeof(float));
        for (int j = 0; j < b; j++) rms_norm(rows + (size_t)(n + j) * H, x + (size_t)j * H, L->input_norm, H, m->eps);
        if (b) K->linear(rows + (size_t)n * H, b, H, H, L->w_qkv, bf, L->b_qkv, QD, q, QD);
        K->linear(rows, t, H, H, (const char *)L->w_qkv + (size_t)QD * H * esize, bf, L->b_qkv ? L->b_qkv + QD : NULL, 2 * KVD,
                  kv, 2 * KVD);
        float *lk = keys + (size_t)l * Hkv * cache_head, *lv = values + (size_t)l * Hkv * cache_head;
        for (int i = 0; i < t; i++) {
            int pos = length + i;
            for (int h = 0; h < Hkv; h++) {
                float *kh = kv + (size_t)i * 2 * KVD + (size_t)h * D;
                rms_norm(kh, kh, L->k_norm, D, m->eps);
                rotate(kh, cos + (size_t)pos * D, sin + (size_t)pos * D, D);
                memcpy(lk + h * cache_head + (size_t)pos * D, kh, (size_t)D * sizeof(float));
                memcpy(lv + h * cache_head + (size_t)pos * D, kh + KVD, (size_t)D * sizeof(float));
            }
        }
        if (!b) continue;
        for (int j = 0; j < b; j++) {
            int pos = length + n + j;
            int lo = L->window && pos - L->window + 1 > 0 ? pos - L->window + 1 : 0;
            for (int h = 0; h < Hq; h++) {
                float *qh = q + (size_t)j * QD + (size_t)h * D;
                rms_norm(qh, qh, L->q_norm, D, m->eps);
                rotate(qh, cos + (size_t)pos * D, sin + (size_t)pos * D, D);
                const float *kk = lk + (size_t)(h / group) * cache_head, *vv = lv + (size_t)(h / group) * cache_head;
                float mx = -INFINITY;
                for (int p = lo; p < end; p++) {
                    scores[p] = K->dot(qh, kk + (size_t)p * D, D) * scale;
                    if (scores[p] > mx) mx = scores[p];
                }
                float sum = 0.0f;
                for (int p = lo; p < end; p++) {
                    scores[p] = expf(scores[p] - mx);
                    sum += scores[p];
                }
                float *out = att + (size_t)j * QD + (size_t)h * D;
                memset(out, 0, (size_t)D * sizeof(float));
                for (int p = lo; p < end; p++) K->axpy(out, scores[p] / sum, vv + (size_t)p * D, D);
            }
        }
        K->linear(att, b, QD, QD, L->w_o, bf, L->b_o, H, tmp, H);
        for (size_t i = 0; i < (size_t)b * H; i++) x[i] += tmp[i];
        for (int j = 0; j < b; j++) rms_norm(xn + (size_t)j * H, x + (size_t)j * H, L->post_norm, H, m->eps);
        K->linear(xn, b, H, H, L->w_gate_up, bf, NULL, 2 * I, gu, 2 * I);
        for (int j = 0; j < b; j++)
            for (int i = 0; i < I; i++) {
                float g = gu[(size_t)j * 2 * I + i];
                hb[(size_t)j * I + i] = g / (1.0f + expf(-g)) * gu[(size_t)j * 2 * I + I + i];
            }
        K->linear(hb, b, I, I, L->w_down, bf, NULL, H, tmp, H);
        for (size_t i = 0; i < (size_t)b * H; i++) x[i] += tmp[i];
    }
    for (int j = 0; j < b; j++) rms_norm(x + (size_t)j * H, x + (size_t)j * H, m->norm, H, m->eps);
    free(buf);
    return PF_CPU_OK;
}

/* round to the nearest bf16 (ties to even), kept in a float; inf and NaN unchanged */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u) return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

#define HEAD_BLOCK 256 /* vocabulary rows per product */

int pf_draft_argmax(const float *hidden, int rows, int hidden_size, const void *w, int w_bf16, int vocab,
                    int64_t *out, int level) {
    if (!hidden || !w || !out || rows < 1 || hidden_size < 1 || vocab < 1 || (w_bf16 != 0 && w_bf16 != 1))
        return PF_CPU_EINVAL;
    int err = PF_CPU_OK;
    const kernels *K = kernels_for(level, &err);
    if (!K) return err;
    size_t hk = (size_t)rows * hidden_size;
    float *buf = malloc((hk + (size_t)rows * (HEAD_BLOCK + 1)) * sizeof(float));
    if (!buf) return PF_CPU_ENOMEM;
    float *x = buf, *logit = buf + hk, *best = logit + (size_t)rows * HEAD_BLOCK;
    for (size_t i = 0; i < hk; i++) x[i] = w_bf16 ? round_bf16(hidden[i]) : hidden[i];
    for (int r = 0; r < rows; r++) {
        best[r] = -INFINITY;
        out[r] = 0;
    }
    size_t esize = w_bf16 ? 2 : 4;
    for (int v0 = 0; v0 < vocab; v0 += HEAD_BLOCK) {
        int nv = vocab - v0 < HEAD_BLOCK ? vocab - v0 : HEAD_BLOCK;
        K->linear(x, rows, hidden_size, hidden_size, (const char *)w + (size_t)v0 * hidden_size * esize, w_bf16, NULL, nv,
                  logit, HEAD_BLOCK);
        for (int r = 0; r < rows; r++)
            for (int v = 0; v < nv; v++) {
                float s = logit[(size_t)r * HEAD_BLOCK + v];
                if (w_bf16) s = round_bf16(s);
                if (s > best[r]) {
                    best[r] = s;
                    out[r] = v0 + v;
                }
            }
    }
    free(buf);
    return PF_CPU_OK;
}
