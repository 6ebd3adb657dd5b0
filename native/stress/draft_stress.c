/*
 * draft_stress.c: correctness and concurrency test of pf_draft (C11 + pthreads).
 *
 * Built with pf_draft.c and pf_cpu.c by `make draft-stress-asan` / `make draft-stress-tsan`
 * (or plainly: cc -std=c11 -O2 -pthread -Inative native/stress/draft_stress.c native/pf_draft.c
 * native/pf_cpu.c -lm).
 *
 *   draft_stress [--quick] [--seed N]
 *
 * Phases:
 *   api       caller mistakes give PF_CPU_EINVAL / PF_CPU_EUNSUPPORTED and write nothing.
 *   levels    every level this CPU runs: random draft shapes (sizes that are not multiples of the
 *             vector width, biases or none, sliding windows, float32 or bf16 matrices), a
 *             sequence of passes of random context / block sizes through one cache, each
 *             against a double-precision reference written here from the model's definition;
 *             greedy heads (float32 and bf16 weights) against a reference argmax.
 *   threads   several threads run passes at once on their own caches with shared weights and
 *             must reproduce, bit for bit, what one thread computed alone.
 *
 * Exit 0 only if every check held; the last line is "draft_stress: N passed, M failed".
 */
#define _GNU_SOURCE
#include "pf_cpu.h"
#include "pf_draft.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static _Thread_local unsigned long long rng_state;
static double urand(void) { /* xorshift64*, [0, 1) */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (double)((rng_state * 2685821657736338717ULL) >> 11) / 9007199254740992.0;
}
static int irand(int lo, int hi) { return lo + (int)(urand() * (hi - lo + 1)); } /* [lo, hi] */

static float to_bf16(float f) { /* round to nearest even */
    unsigned u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static unsigned short bf16_bits(float f) {
    unsigned u;
    f = to_bf16(f);
    memcpy(&u, &f, 4);
    return (unsigned short)(u >> 16);
}

/* A random model: float32 matrices (bf16-valued when bf16), and their bf16 copies. */
typedef struct model {
    int H, Hq, Hkv, D, I, L, F, bf16, biased;
    float eps;
    float *fc, *hidden_norm, *norm;
    float *in_norm[4], *post_norm[4], *qkv[4], *bqkv[4], *qn[4], *kn[4], *o[4], *bo[4], *gu[4], *down[4];
    unsigned short *fc16, *qkv16[4], *o16[4], *gu16[4], *down16[4];
    int window[4];
    pf_draft_layer layer[4];
    pf_draft_model m;
} model;

static float *randv(size_t n, double scale, int bf16) {
    float *v = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        v[i] = (float)((urand() * 2 - 1) * scale);
        if (bf16) v[i] = to_bf16(v[i]);
    }
    return v;
}
static float *normw(size_t n) {
    float *v = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = (float)(0.5 + urand());
    return v;
}
static unsigned short *halves(const float *v, size_t n) {
    unsigned short *h = malloc(n * sizeof(unsigned short));
    for (size_t i = 0; i < n; i++) h[i] = bf16_bits(v[i]);
    return h;
}

static void model_init(model *M, int bf16) {
    memset(M, 0, sizeof *M);
    M->Hkv = irand(1, 2);
    M->Hq = M->Hkv * irand(1, 3);
    M->D = 2 * irand(2, 9);
    M->H = irand(5, 40);
    M->I = irand(3, 37);
    M->L = irand(1, 4);
    M->F = M->H * irand(1, 3);
    M->bf16 = bf16;
    M->biased = irand(0, 1);
    M->eps = 1e-5f;
    int QKV = (M->Hq + 2 * M->Hkv) * M->D;
    double s = 0.3;
    M->fc = randv((size_t)M->H * M->F, s, bf16);
    M->hidden_norm = normw(M->H);
    M->norm = normw(M->H);
    for (int l = 0; l < M->L; l++) {
        M->in_norm[l] = normw(M->H);
        M->post_norm[l] = normw(M->H);
        M->qkv[l] = randv((size_t)QKV * M->H, s, bf16);
        M->bqkv[l] = M->biased ? randv(QKV, 0.1, 0) : NULL;
        M->qn[l] = normw(M->D);
        M->kn[l] = normw(M->D);
        M->o[l] = randv((size_t)M->H * M->Hq * M->D, s, bf16);
        M->bo[l] = M->biased ? randv(M->H, 0.1, 0) : NULL;
        M->gu[l] = randv((size_t)2 * M->I * M->H, s, bf16);
        M->down[l] = randv((size_t)M->H * M->I, s, bf16);
        M->window[l] = irand(0, 1) ? irand(1, 12) : 0;
        pf_draft_layer *c = &M->layer[l];
        c->input_norm = M->in_norm[l];
        c->post_norm = M->post_norm[l];
        c->b_qkv = M->bqkv[l];
        c->q_norm = M->qn[l];
        c->k_norm = M->kn[l];
        c->b_o = M->bo[l];
        c->window = M->window[l];
        if (bf16) {
            M->qkv16[l] = halves(M->qkv[l], (size_t)QKV * M->H);
            M->o16[l] = halves(M->o[l], (size_t)M->H * M->Hq * M->D);
            M->gu16[l] = halves(M->gu[l], (size_t)2 * M->I * M->H);
            M->down16[l] = halves(M->down[l], (size_t)M->H * M->I);
            c->w_qkv = M->qkv16[l], c->w_o = M->o16[l], c->w_gate_up = M->gu16[l], c->w_down = M->down16[l];
        } else {
            c->w_qkv = M->qkv[l], c->w_o = M->o[l], c->w_gate_up = M->gu[l], c->w_down = M->down[l];
        }
    }
    if (bf16) M->fc16 = halves(M->fc, (size_t)M->H * M->F);
    pf_draft_model *m = &M->m;
    m->hidden = M->H, m->heads = M->Hq, m->kv_heads = M->Hkv, m->head_dim = M->D, m->inter = M->I;
    m->layers = M->L, m->features = M->F, m->eps = M->eps, m->matrices_bf16 = bf16;
    m->fc = bf16 ? (const void *)M->fc16 : (const void *)M->fc;
    m->hidden_norm = M->hidden_norm, m->norm = M->norm, m->layer = M->layer;
}

static void model_free(model *M) {
    free(M->fc), free(M->hidden_norm), free(M->norm), free(M->fc16);
    for (int l = 0; l < M->L; l++) {
        free(M->in_norm[l]), free(M->post_norm[l]), free(M->qkv[l]), free(M->bqkv[l]), free(M->qn[l]);
        free(M->kn[l]), free(M->o[l]), free(M->bo[l]), free(M->gu[l]), free(M->down[l]);
        free(M->qkv16[l]), free(M->o16[l]), free(M->gu16[l]), free(M->down16[l]);
    }
}

/* ---- the double-precision reference: the whole sequence recomputed from scratch ---------- */
static void ref_norm(double *y, const double *x, const float *w, int n, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}
static void ref_linear(double *y, const double *x, const float *w, const float *b, int k, int n) {
    for (int o = 0; o < n; o++) {
        double s = b ? b[o] : 0;
        for (int i = 0; i < k; i++) s += x[i] * w[(size_t)o * k + i];
        y[o] = s;
    }
}
static void ref_rotate(double *x, const float *c, const float *s, int d) {
    double t[64];
    int h = d / 2;
    for (int i = 0; i < h; i++) t[i] = x[i] * c[i] - x[i + h] * s[i];
    for (int i = h; i < d; i++) t[i] = x[i] * c[i] + x[i - h] * s[i];
    memcpy(x, t, sizeof(double) * d);
}

/* Final hidden rows of a block of b tokens (embeddings emb [b][H]) placed after a context of
 * c rows of features feats [c][F], positions 0 .. c+b-1. */
static void reference(const model *M, const float *feats, int c, const float *emb, int b, const float *cos,
                      const float *sin, double *out) {
    int H = M->H, D = M->D, Hq = M->Hq, Hkv = M->Hkv, I = M->I, t = c + b, QD = Hq * D, KVD = Hkv * D;
    int QKV = QD + 2 * KVD;
    double *ctx = calloc((size_t)t * H, sizeof(double)), *x = calloc((size_t)b * H, sizeof(double));
    double *rows = calloc((size_t)t * H, sizeof(double)), *qkv = calloc((size_t)t * QKV, sizeof(double));
    double *att = calloc((size_t)b * QD, sizeof(double)), *tmp = calloc((size_t)H + 3 * I + QD, sizeof(double));
    double *fx = calloc((size_t)M->F, sizeof(double)), *sc = calloc((size_t)t, sizeof(double));
    for (int i = 0; i < c; i++) {
        for (int f = 0; f < M->F; f++) fx[f] = feats[(size_t)i * M->F + f];
        ref_linear(tmp, fx, M->fc, NULL, M->F, H);
        ref_norm(ctx + (size_t)i * H, tmp, M->hidden_norm, H, M->eps);
    }
    for (int i = 0; i < b * H; i++) x[i] = emb[i];
    for (int l = 0; l < M->L; l++) {
        memcpy(rows, ctx, sizeof(double) * c * H);
        for (int j = 0; j < b; j++) ref_norm(rows + (size_t)(c + j) * H, x + (size_t)j * H, M->in_norm[l], H, M->eps);
        for (int i = 0; i < t; i++) {
            double *r = qkv + (size_t)i * QKV;
            ref_linear(r, rows + (size_t)i * H, M->qkv[l], M->bqkv[l], H, QKV);
            for (int h = 0; h < Hq; h++) {
                ref_norm(r + h * D, r + h * D, M->qn[l], D, M->eps);
                ref_rotate(r + h * D, cos + (size_t)i * D, sin + (size_t)i * D, D);
            }
            for (int h = 0; h < Hkv; h++) {
                ref_norm(r + QD + h * D, r + QD + h * D, M->kn[l], D, M->eps);
                ref_rotate(r + QD + h * D, cos + (size_t)i * D, sin + (size_t)i * D, D);
            }
        }
        for (int j = 0; j < b; j++) {
            int qp = c + j;
            for (int h = 0; h < Hq; h++) {
                int kh = h / (Hq / Hkv);
                const double *q = qkv + (size_t)qp * QKV + h * D;
                double mx = -INFINITY, sum = 0;
                for (int p = 0; p < t; p++) {
                    sc[p] = -INFINITY;
                    if (M->window[l] && !(qp - p < M->window[l])) continue;
                    double s = 0;
                    for (int d = 0; d < D; d++) s += q[d] * qkv[(size_t)p * QKV + QD + kh * D + d];
                    sc[p] = s / sqrt((double)D);
                    if (sc[p] > mx) mx = sc[p];
                }
                for (int p = 0; p < t; p++) sum += sc[p] == -INFINITY ? 0 : exp(sc[p] - mx);
                for (int d = 0; d < D; d++) {
                    double a = 0;
                    for (int p = 0; p < t; p++)
                        if (sc[p] != -INFINITY) a += exp(sc[p] - mx) / sum * qkv[(size_t)p * QKV + QD + KVD + kh * D + d];
                    att[(size_t)j * QD + h * D + d] = a;
                }
            }
        }
        for (int j = 0; j < b; j++) {
            double *xj = x + (size_t)j * H, *h = tmp + H, *g = tmp + H + 2 * I;
            ref_linear(tmp, att + (size_t)j * QD, M->o[l], M->bo[l], QD, H);
            for (int i = 0; i < H; i++) xj[i] += tmp[i];
            double xn[64];
            ref_norm(xn, xj, M->post_norm[l], H, M->eps);
            ref_linear(h, xn, M->gu[l], NULL, H, 2 * I);
            for (int i = 0; i < I; i++) g[i] = h[i] / (1 + exp(-h[i])) * h[I + i];
            ref_linear(tmp, g, M->down[l], NULL, I, H);
            for (int i = 0; i < H; i++) xj[i] += tmp[i];
        }
    }
    for (int j = 0; j < b; j++) ref_norm(out + (size_t)j * H, x + (size_t)j * H, M->norm, H, M->eps);
    free(ctx), free(x), free(rows), free(qkv), free(att), free(tmp), free(fx), free(sc);
}

static void tables(int P, int D, float **cos_out, float **sin_out) {
    float *c = malloc(sizeof(float) * P * D), *s = malloc(sizeof(float) * P * D);
    for (int p = 0; p < P; p++)
        for (int i = 0; i < D; i++) {
            double f = p * pow(10000.0, -2.0 * (i % (D / 2)) / D);
            c[p * D + i] = (float)cos(f);
            s[p * D + i] = (float)sin(f);
        }
    *cos_out = c, *sin_out = s;
}

/* A sequence of passes through one cache: each pass adds n context rows and drafts a block of b
 * (b may be 0: context only); the block is checked against the reference. Returns the final
 * block's hidden rows in *last (malloc'd) when last != NULL. */
static void run_sequence(const model *M, int level, int steps, unsigned seed, int check, float **last, int *last_b) {
    const int cap = 64, H = M->H, D = M->D;
    unsigned long long saved = rng_state;
    rng_state = seed * 0x9E3779B97F4A7C15ULL + 1;
    size_t cache_n = (size_t)M->L * M->Hkv * cap * D;
    float *keys = calloc(cache_n, sizeof(float)), *values = calloc(cache_n, sizeof(float));
    float *cos, *sin;
    tables(cap, D, &cos, &sin);
    float *feats = randv((size_t)cap * M->F, 1.0, 0);
    int length = 0;
    for (int s = 0; s < steps && length < cap - 12; s++) {
        int n = irand(s == 0 ? 1 : 0, 5), b = irand(0, 6);
        if (n + b == 0) b = 1;
        float *x = b ? randv((size_t)b * H, 1.0, 0) : NULL, *emb = b ? malloc(sizeof(float) * b * H) : NULL;
        if (b) memcpy(emb, x, sizeof(float) * b * H);
        int rc = pf_draft_pass(&M->m, keys, values, cap, length, n ? feats + (size_t)length * M->F : NULL, n, x, b,
                               cos, sin, cap, level);
        char what[160];
        snprintf(what, sizeof what, "pass rc (level %d, length %d, n %d, b %d): %d", level, length, n, b, rc);
        if (check) count(rc == PF_CPU_OK, what);
        if (rc == PF_CPU_OK && b && check) {
            double *want = malloc(sizeof(double) * b * H);
            /* the block sits at positions length+n ..: the reference sees every context row so far */
            float *c2 = malloc(sizeof(float) * (length + n + b) * D), *s2 = malloc(sizeof(float) * (length + n + b) * D);
            memcpy(c2, cos, sizeof(float) * (length + n + b) * D);
            memcpy(s2, sin, sizeof(float) * (length + n + b) * D);
            reference(M, feats, length + n, emb, b, c2, s2, want);
            double worst = 0;
            for (int i = 0; i < b * H; i++) {
                double e = fabs(x[i] - want[i]) / (1.0 + fabs(want[i]));
                if (e > worst) worst = e;
            }
            snprintf(what, sizeof what, "pass vs reference (level %d, H %d, D %d, L %d, bf16 %d, length %d, n %d, b %d): %.3g",
                     level, H, D, M->L, M->bf16, length, n, b, worst);
            count(worst < 2e-4, what);
            free(want), free(c2), free(s2);
        }
        length += n;
        if (last && s + 1 == steps) {
            *last = x, *last_b = b;
            x = NULL;
        }
        free(x), free(emb);
    }
    free(keys), free(values), free(cos), free(sin), free(feats);
    rng_state = saved;
}

static void check_api(void) {
    model M;
    model_init(&M, 0);
    const int cap = 16;
    size_t cache_n = (size_t)M.L * M.Hkv * cap * M.D;
    float *keys = calloc(cache_n, sizeof(float)), *values = calloc(cache_n, sizeof(float)), *cos, *sin;
    tables(cap, M.D, &cos, &sin);
    float *x = randv((size_t)4 * M.H, 1.0, 0), *x0 = malloc(sizeof(float) * 4 * M.H);
    memcpy(x0, x, sizeof(float) * 4 * M.H);
    float *feats = randv((size_t)4 * M.F, 1.0, 0);
    count(pf_draft_pass(NULL, keys, values, cap, 0, feats, 2, x, 4, cos, sin, cap, -1) == PF_CPU_EINVAL, "NULL model");
    count(pf_draft_pass(&M.m, keys, values, cap, 0, NULL, 2, x, 4, cos, sin, cap, -1) == PF_CPU_EINVAL, "NULL features");
    count(pf_draft_pass(&M.m, keys, values, cap, 0, feats, 0, NULL, 0, cos, sin, cap, -1) == PF_CPU_EINVAL, "empty pass");
    count(pf_draft_pass(&M.m, keys, values, cap, 14, feats, 2, x, 4, cos, sin, cap, -1) == PF_CPU_EINVAL, "past capacity");
    count(pf_draft_pass(&M.m, keys, values, cap, 0, feats, 2, x, 4, cos, sin, 5, -1) == PF_CPU_EINVAL, "past the table");
    count(pf_draft_pass(&M.m, keys, values, cap, 0, feats, 2, x, 4, cos, sin, cap, 9) == PF_CPU_EINVAL, "bad level");
    pf_draft_model bad = M.m;
    bad.kv_heads = bad.heads + 1;
    count(pf_draft_pass(&bad, keys, values, cap, 0, feats, 2, x, 4, cos, sin, cap, -1) == PF_CPU_EINVAL, "kv heads");
    bad = M.m;
    bad.head_dim = 3;
    count(pf_draft_pass(&bad, keys, values, cap, 0, feats, 2, x, 4, cos, sin, cap, -1) == PF_CPU_EINVAL, "odd head dim");
    if (pf_cpu_detect() < PF_CPU_LEVEL_AVX512_BF16)
        count(pf_draft_pass(&M.m, keys, values, cap, 0, feats, 2, x, 4, cos, sin, cap, PF_CPU_LEVEL_AVX512_BF16) ==
                  PF_CPU_EUNSUPPORTED, "unsupported level");
    int untouched = memcmp(x, x0, sizeof(float) * 4 * M.H) == 0;
    for (size_t i = 0; i < cache_n; i++) untouched = untouched && keys[i] == 0.0f && values[i] == 0.0f;
    count(untouched, "a refused call writes nothing");
    int64_t ids[2];
    count(pf_draft_argmax(x, 0, M.H, M.fc, 0, M.H, ids, -1) == PF_CPU_EINVAL, "argmax of no rows");
    count(pf_draft_argmax(x, 1, M.H, M.fc, 2, M.H, ids, -1) == PF_CPU_EINVAL, "argmax weight format");
    free(keys), free(values), free(cos), free(sin), free(x), free(x0), free(feats);
    model_free(&M);
}

static void check_argmax(int level) {
    for (int trial = 0; trial < 6; trial++) {
        int H = irand(3, 70), V = irand(1, 600), R = irand(1, 9), bf16 = trial % 2;
        float *w = randv((size_t)V * H, 1.0, bf16), *h = randv((size_t)R * H, 1.0, 0);
        unsigned short *w16 = bf16 ? halves(w, (size_t)V * H) : NULL;
        int64_t *ids = malloc(sizeof(int64_t) * R);
        int rc = pf_draft_argmax(h, R, H, bf16 ? (const void *)w16 : (const void *)w, bf16, V, ids, level);
        count(rc == PF_CPU_OK, "argmax rc");
        for (int r = 0; r < R && rc == PF_CPU_OK; r++) {
            /* the reference: logits in double from the rows as the head sees them; the kernel's choice
             * must be a maximum within rounding (bf16 logits tie often) */
            double best = -INFINITY, got = 0;
            for (int v = 0; v < V; v++) {
                double s = 0;
                for (int i = 0; i < H; i++) s += (double)(bf16 ? to_bf16(h[r * H + i]) : h[r * H + i]) * w[(size_t)v * H + i];
                if (s > best) best = s;
                if (v == ids[r]) got = s;
            }
            char what[120];
            snprintf(what, sizeof what, "argmax (level %d, H %d, V %d, bf16 %d): %g vs best %g", level, H, V, bf16, got, best);
            count(ids[r] >= 0 && ids[r] < V && got >= best - (bf16 ? 1e-2 : 1e-4) * (1 + fabs(best)), what);
        }
        free(w), free(h), free(w16), free(ids);
    }
}

typedef struct job {
    const model *M;
    int level, steps;
    unsigned seed;
    const float *want;
    int want_b;
} job;

static void *thread_main(void *arg) {
    job *j = arg;
    for (int rep = 0; rep < 3; rep++) {
        float *got = NULL;
        int b = 0;
        run_sequence(j->M, j->level, j->steps, j->seed, 0, &got, &b);
        count(b == j->want_b && (b == 0 || memcmp(got, j->want, sizeof(float) * b * j->M->H) == 0),
              "a thread reproduces the single-thread result");
        free(got);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int quick = 0;
    unsigned long long seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
    }
    rng_state = seed * 0x2545F4914F6CDD1DULL + 7;
    check_api();
    int top = pf_cpu_detect() >= PF_CPU_LEVEL_AVX2 ? PF_CPU_LEVEL_AVX2 : PF_CPU_LEVEL_SCALAR;
    int models = quick ? 6 : 24;
    for (int level = PF_CPU_LEVEL_SCALAR; level <= top; level++) {
        for (int k = 0; k < models; k++) {
            model M;
            model_init(&M, k % 2);
            run_sequence(&M, level, quick ? 4 : 8, (unsigned)(seed * 131 + k), 1, NULL, NULL);
            model_free(&M);
        }
        check_argmax(level);
    }
    /* threads: shared weights, own caches, the same results as alone */
    model M;
    model_init(&M, 1);
    enum { NT = 4 };
    job jobs[NT];
    pthread_t th[NT];
    float *want[NT];
    for (int i = 0; i < NT; i++) {
        int b = 0;
        want[i] = NULL;
        run_sequence(&M, -1, 6, (unsigned)(seed + i), 0, &want[i], &b);
        jobs[i] = (job){&M, -1, 6, (unsigned)(seed + i), want[i], b};
    }
    for (int i = 0; i < NT; i++) pthread_create(&th[i], NULL, thread_main, &jobs[i]);
    for (int i = 0; i < NT; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < NT; i++) free(want[i]);
    model_free(&M);
    return report("draft_stress");
}
