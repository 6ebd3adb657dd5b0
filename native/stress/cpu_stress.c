/*
 * cpu_stress.c: correctness and concurrency test of pf_cpu (C11 + pthreads).
 *
 * Built with pf_cpu.c, pf_layer.c, pf_relay.c and pf_sched.c by `make cpu-stress-asan` /
 * `make cpu-stress-tsan` (or plainly: cc -std=c11 -O2 -pthread -Inative native/stress/cpu_stress.c
 * native/pf_cpu.c native/pf_layer.c native/pf_relay.c native/pf_sched.c -lm -ldl).
 *
 *   cpu_stress [--quick] [--seed N]
 *
 * Phases:
 *   api       caller mistakes give PF_CPU_EINVAL / PF_CPU_EUNSUPPORTED and write nothing;
 *             create / destroy cycles at every thread count (init / close symmetry).
 *   levels    every level this CPU runs, 1..5 threads, random MXFP4 / bf16 / f32 experts and
 *             Qwen3-MoE row experts (f32 / bf16 / FP8 rows with f32 or bf16 block scales, SiLU)
 *             of random sizes (with and without biases, a third rounded like a bf16 model:
 *             every output a bf16 value), 1..16 tokens in f32 or bf16,
 *             against a double-precision reference written here from the format's
 *             definition (E2M1 table, 2^(s-127) scales, clamped SwiGLU; e4m3 codes times
 *             their block's scale, SiLU).
 *   pool      back-to-back jobs on a pool of more threads than cores: stream reads of
 *             random sizes (some without a whole word) between batched calls, while another
 *             thread keeps changing how many of the pool's threads take part
 *             (pf_cpu_set_active) and whether its calls are batch invariant
 *             (pf_cpu_set_invariant); then a fixed count that no phase exceeds.
 *   shared    several threads call one context at once (calls are serialized) and their
 *             own contexts, each checking its results; contexts are created and destroyed
 *             while others run.
 *   layer     pf_layer (pf_layer.h): bad descriptions and token counts refused; each run's clock
 *             (pf_layer_clock: started, kernel time within its wall time) and pf_layer_report's
 *             row (the same figures in one call; bad arrays refused, out untouched); several
 *             threads each run their own layer contexts (random routing, int64 / int32
 *             indices, f32 / bf16 rows, 1..rows tokens) on one shared pool, every output row
 *             checked against a one-token pf_cpu_expert call times its scale, rows past the
 *             tokens and rows of experts marked resident zero; an index out of range fails the
 *             run and zeroes out. Every fourth context also fetches (a memcpy scheduler shared
 *             by the threads, small chunks, every 7th chunk copy failing): the plan's count of
 *             non-resident experts, most positions first, lands in the stages byte for byte with
 *             zero rows, a failed fetch is computed instead, stage_of and the fetch figures agree.
 *             Route-ahead chains (pf_layer_set_ahead): each run prefetches for the next context;
 *             claims and cancels add up to what was sent, staged experts hold their bytes,
 *             the other rows are the reference's; destroying a chain with prefetches still
 *             made leaves nothing live in the scheduler.
 *   relay     pf_relay (pf_relay.h): a thread standing in for the device writes each layer's down
 *             flag after a random delay and waits for its up flag; when it comes, the layer has
 *             run once more and its output is what a direct run gave. Spinning and sleeping waits
 *             both; bad arguments refused, a second arm refused while one is armed; a step whose
 *             down flags never come ends by its timeout, a cancelled one at once, each with every
 *             up flag set; a relay destroyed while armed returns.
 *
 * Exit 0 only if every check held; the last line is "cpu_stress: N passed, M failed".
 */
#define _GNU_SOURCE
#include "pf_cpu.h"
#include "pf_layer.h"
#include "pf_relay.h"

#include <math.h>
#include <stdatomic.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}
static float rng_unit(uint64_t *s) { return (float)((rng_next(s) >> 40) * (1.0 / (1ull << 24))) * 2.0f - 1.0f; }

static uint16_t f32_to_bf16(float f) { /* round to nearest even (finite values) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static const double E2M1[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};

/* one random expert and its weights widened to double, input-major: w1d [H][2I], w2d [I][H] */
typedef struct expert {
    pf_cpu_weights w;
    void *gate_up, *down, *b1, *b2;       /* owned */
    uint8_t *s1, *s2;                     /* owned (MXFP4) */
    double *w1d, *w2d, *b1d, *b2d;        /* owned */
} expert;

static double elem(const void *p, int fmt, size_t i) {
    return fmt == PF_CPU_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static void expert_free(expert *e) {
    free(e->gate_up);
    free(e->down);
    free(e->b1);
    free(e->b2);
    free(e->s1);
    free(e->s2);
    free(e->w1d);
    free(e->w2d);
    free(e->b1d);
    free(e->b2d);
    memset(e, 0, sizeof *e);
}

/* MXFP4 matrix out x in (output-major) -> random blocks/scales and the dense [in][out] doubles */
static void make_mx(uint64_t *rng, int out, int in, uint8_t **blocks, uint8_t **scales, double *dense) {
    int G = in / 32;
    *blocks = malloc((size_t)out * G * 16);
    *scales = malloc((size_t)out * G);
    for (int r = 0; r < out; r++)
        for (int g = 0; g < G; g++) {
            uint8_t s = (uint8_t)(119 + rng_next(rng) % 9);
            (*scales)[(size_t)r * G + g] = s;
            for (int j = 0; j < 16; j++) {
                uint8_t b = (uint8_t)rng_next(rng);
                (*blocks)[((size_t)r * G + g) * 16 + j] = b;
                int k = g * 32 + 2 * j;
                dense[(size_t)k * out + r] = ldexp(E2M1[b & 15], s - 127);
                dense[(size_t)(k + 1) * out + r] = ldexp(E2M1[b >> 4], s - 127);
            }
        }
}

static void *make_dense(uint64_t *rng, int fmt, size_t n, double scale, double *dense) {
    void *p = malloc(n * (fmt == PF_CPU_BF16 ? 2 : 4));
    for (size_t i = 0; i < n; i++) {
        float v = rng_unit(rng) * (float)scale;
        if (fmt == PF_CPU_BF16) {
            ((uint16_t *)p)[i] = f32_to_bf16(v);
            dense[i] = bf16_to_f32(((uint16_t *)p)[i]);
        } else {
            ((float *)p)[i] = v;
            dense[i] = v;
        }
    }
    return p;
}

static int is_rows_fmt(int fmt) { return fmt == PF_CPU_F32_ROWS || fmt == PF_CPU_BF16_ROWS || fmt == PF_CPU_FP8_ROWS; }

/* float8_e4m3fn from its definition: sign, 4 exponent bits (bias 7), 3 mantissa bits, subnormals */
static double e4m3(uint8_t q) {
    int e = (q >> 3) & 15, m = q & 7;
    double v = e == 0 ? ldexp(m, -9) : ldexp(1.0 + m / 8.0, e - 7);
    return q & 0x80 ? -v : v;
}

/* a Qwen3-MoE row-format matrix out x in (output-major), random, and the dense [in][out] doubles
 * (a bf16 model's rounding of FP8 and float32 weights is left to the tolerance) */
static void *make_rows(uint64_t *rng, int fmt, int out, int in, int b, int sfmt, uint8_t **scales, double *dense) {
    const size_t n = (size_t)out * in;
    if (fmt != PF_CPU_FP8_ROWS) {
        void *p = malloc(n * (fmt == PF_CPU_BF16_ROWS ? 2 : 4));
        for (int r = 0; r < out; r++)
            for (int k = 0; k < in; k++) {
                float v = rng_unit(rng) * (float)(1.0 / sqrt(in));
                size_t i = (size_t)r * in + k;
                if (fmt == PF_CPU_BF16_ROWS) {
                    ((uint16_t *)p)[i] = f32_to_bf16(v);
                    v = bf16_to_f32(((uint16_t *)p)[i]);
                } else {
                    ((float *)p)[i] = v;
                }
                dense[(size_t)k * out + r] = v;
            }
        return p;
    }
    uint8_t *q = malloc(n);
    const int sr = out / b, sc = in / b;
    *scales = malloc((size_t)sr * sc * (sfmt == PF_CPU_BF16 ? 2 : 4));
    for (int i = 0; i < sr * sc; i++) {
        float v = (0.5f + 0.5f * (rng_unit(rng) + 1.0f)) / (float)(16.0 * sqrt(in));
        if (sfmt == PF_CPU_BF16) ((uint16_t *)*scales)[i] = f32_to_bf16(v);
        else ((float *)*scales)[i] = v;
    }
    for (int r = 0; r < out; r++)
        for (int k = 0; k < in; k++) {
            uint8_t c = (uint8_t)rng_next(rng);
            if ((c & 0x7f) == 0x7f) c ^= 0x01; /* not a NaN code */
            q[(size_t)r * in + k] = c;
            size_t si = (size_t)(r / b) * sc + k / b;
            double s = sfmt == PF_CPU_BF16 ? bf16_to_f32(((uint16_t *)*scales)[si]) : ((float *)*scales)[si];
            dense[(size_t)k * out + r] = e4m3(c) * s;
        }
    return q;
}

static void expert_make(expert *e, uint64_t *rng, int fmt, int H, int I, int bias_fmt, int with_bias) {
    memset(e, 0, sizeof *e);
    if (is_rows_fmt(fmt)) { /* Qwen3-MoE: no biases; FP8 in the largest of 32 / 16 / 8 dividing H and I */
        e->w1d = malloc(sizeof(double) * H * 2 * I);
        e->w2d = malloc(sizeof(double) * I * H);
        e->b1d = calloc(2 * I, sizeof(double));
        e->b2d = calloc(H, sizeof(double));
        int b = 0, sfmt = rng_next(rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32;
        if (fmt == PF_CPU_FP8_ROWS)
            for (b = 32; H % b || I % b; b /= 2) {}
        e->gate_up = make_rows(rng, fmt, 2 * I, H, b, sfmt, &e->s1, e->w1d);
        e->down = make_rows(rng, fmt, H, I, b, sfmt, &e->s2, e->w2d);
        e->w = (pf_cpu_weights){.format = fmt, .hidden = H, .inter = I, .gate_up = e->gate_up, .gate_up_scales = e->s1,
                                .down = e->down, .down_scales = e->s2, .block = b,
                                .scale_format = fmt == PF_CPU_FP8_ROWS ? sfmt : 0};
        return;
    }
    e->w1d = malloc(sizeof(double) * H * 2 * I);
    e->w2d = malloc(sizeof(double) * I * H);
    e->b1d = calloc(2 * I, sizeof(double));
    e->b2d = calloc(H, sizeof(double));
    if (fmt == PF_CPU_MXFP4) {
        make_mx(rng, 2 * I, H, (uint8_t **)&e->gate_up, &e->s1, e->w1d);
        make_mx(rng, H, I, (uint8_t **)&e->down, &e->s2, e->w2d);
    } else {
        e->gate_up = make_dense(rng, fmt, (size_t)H * 2 * I, 1.0 / sqrt(H), e->w1d);
        e->down = make_dense(rng, fmt, (size_t)I * H, 1.0 / sqrt(I), e->w2d);
    }
    if (with_bias) {
        e->b1 = make_dense(rng, bias_fmt, 2 * (size_t)I, 1.0, e->b1d);
        e->b2 = make_dense(rng, bias_fmt, (size_t)H, 1.0, e->b2d);
    }
    e->w = (pf_cpu_weights){.format = fmt, .bias_format = bias_fmt, .hidden = H, .inter = I, .gate_up = e->gate_up,
                            .gate_up_scales = e->s1, .gate_up_bias = e->b1, .down = e->down, .down_scales = e->s2,
                            .down_bias = e->b2, .alpha = 1.702f, .limit = 7.0f};
}

/* reference in double; returns 1 if out matches within float32 summation-order error */
static int expert_check(const expert *e, const void *x, int x_fmt, int T, int stride, const float *out) {
    const int H = e->w.hidden, I = e->w.inter;
    double *gu = malloc(sizeof(double) * 2 * I), *h = malloc(sizeof(double) * I), *mag = malloc(sizeof(double) * H);
    int ok = 1;
    for (int t = 0; t < T && ok; t++) {
        for (int c = 0; c < 2 * I; c++) {
            double a = e->b1d[c];
            for (int k = 0; k < H; k++) a += elem(x, x_fmt, (size_t)t * stride + k) * e->w1d[(size_t)k * 2 * I + c];
            gu[c] = a;
        }
        double hmax = 0;
        for (int j = 0; j < I; j++) {
            if (is_rows_fmt(e->w.format)) { /* Qwen3-MoE: gate rows then up rows, silu(gate) * up */
                h[j] = gu[j] / (1.0 + exp(-gu[j])) * gu[I + j];
            } else {
                double g = gu[2 * j] > 7.0 ? 7.0 : gu[2 * j];
                double u = gu[2 * j + 1] > 7.0 ? 7.0 : (gu[2 * j + 1] < -7.0 ? -7.0 : gu[2 * j + 1]);
                h[j] = (u + 1.0) * g / (1.0 + exp(-1.702 * g));
            }
            hmax = fabs(h[j]) > hmax ? fabs(h[j]) : hmax;
        }
        double ymax = 0;
        for (int o = 0; o < H; o++) {
            double a = e->b2d[o];
            for (int j = 0; j < I; j++) a += h[j] * e->w2d[(size_t)j * H + o];
            mag[o] = a;
            ymax = fabs(a) > ymax ? fabs(a) : ymax;
        }
        /* float32 accumulation of H then I terms, and the rounding of h through gate_up */
        double tol = 1e-4 * (1.0 + ymax) + 1e-5 * (1.0 + hmax) * I;
        if (e->w.round_bf16) { /* bf16 steps: about 2^-8 relative each, through both projections */
            tol = 3e-2 * (1.0 + ymax) + 4e-3 * (1.0 + hmax) * sqrt((double)I);
            for (int o = 0; o < H; o++) { /* every output is a bf16 value */
                uint32_t u;
                memcpy(&u, &out[(size_t)t * H + o], 4);
                if (u & 0xffffu) {
                    fprintf(stderr, "  round_bf16: token %d out %d = %g is not a bf16 value\n", t, o, out[(size_t)t * H + o]);
                    ok = 0;
                    break;
                }
            }
        }
        for (int o = 0; o < H; o++) {
            double err = fabs(out[(size_t)t * H + o] - mag[o]);
            if (!(err <= tol)) {
                fprintf(stderr, "  fmt %d H %d I %d T %d: token %d out %d = %g, reference %g (tol %g)\n", e->w.format,
                        H, I, T, t, o, out[(size_t)t * H + o], mag[o], tol);
                ok = 0;
                break;
            }
        }
    }
    free(gu);
    free(h);
    free(mag);
    return ok;
}

static void *make_x(uint64_t *rng, int fmt, int T, int stride) {
    void *x = malloc((size_t)T * stride * (fmt == PF_CPU_BF16 ? 2 : 4));
    for (size_t i = 0; i < (size_t)T * stride; i++) {
        float v = rng_unit(rng) * 2.0f;
        if (fmt == PF_CPU_BF16)
            ((uint16_t *)x)[i] = f32_to_bf16(v);
        else
            ((float *)x)[i] = v;
    }
    return x;
}

/* one random call on c, checked; returns 1 if it matched */
static int random_call(pf_cpu *c, uint64_t *rng, int small) {
    static const int fmts[6] = {PF_CPU_MXFP4, PF_CPU_BF16, PF_CPU_F32, PF_CPU_F32_ROWS, PF_CPU_BF16_ROWS, PF_CPU_FP8_ROWS};
    int fmt = fmts[rng_next(rng) % 6];
    int H, I;
    if (fmt == PF_CPU_MXFP4) {
        H = 32 * (1 + (int)(rng_next(rng) % (small ? 6 : 10))); /* 128-element chunks and lone groups */
        I = 32 * (1 + (int)(rng_next(rng) % (small ? 6 : 10)));
    } else if (is_rows_fmt(fmt) && rng_next(rng) % 2) { /* whole 32-weight chunks: the AMX tiles' shapes */
        H = 32 * (1 + (int)(rng_next(rng) % (small ? 4 : 8)));
        I = 32 * (1 + (int)(rng_next(rng) % (small ? 3 : 5)));
    } else if (fmt == PF_CPU_FP8_ROWS) { /* blocks of 8, 16 or 32; vector chunks of 16 whole or not */
        H = 8 * (1 + (int)(rng_next(rng) % (small ? 12 : 24)));
        I = 8 * (1 + (int)(rng_next(rng) % (small ? 8 : 16)));
    } else {
        H = 1 + (int)(rng_next(rng) % (small ? 70 : 130));
        I = 1 + (int)(rng_next(rng) % (small ? 50 : 90));
    }
    expert e;
    expert_make(&e, rng, fmt, H, I, rng_next(rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32, (int)(rng_next(rng) % 4 != 0));
    e.w.round_bf16 = (int)(rng_next(rng) % 3 == 0);
    int T = 1 + (int)(rng_next(rng) % PF_CPU_MAX_TOKENS);
    int xf = rng_next(rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32;
    int stride = H + (int)(rng_next(rng) % 3);
    void *x = make_x(rng, xf, T, stride);
    float *out = malloc(sizeof(float) * T * H);
    int rc = pf_cpu_expert(c, &e.w, x, xf, T, stride, out);
    int ok = rc == PF_CPU_OK && expert_check(&e, x, xf, T, stride, out);
    if (rc != PF_CPU_OK) fprintf(stderr, "  pf_cpu_expert: %s\n", pf_cpu_strerror(rc));
    free(x);
    free(out);
    expert_free(&e);
    return ok;
}

/* one random batched call (pf_cpu_experts) on c: every written row must equal the single-expert
 * call on the same rows times its scale, bit for bit; rows not named in dest keep their sentinel */
static int random_batch(pf_cpu *c, uint64_t *rng) {
    static const int fmts[6] = {PF_CPU_MXFP4, PF_CPU_BF16, PF_CPU_F32, PF_CPU_F32_ROWS, PF_CPU_BF16_ROWS, PF_CPU_FP8_ROWS};
    enum { MAXN = 6 };
    const int H = 32 * (1 + (int)(rng_next(rng) % 5));
    const int n = 1 + (int)(rng_next(rng) % MAXN);
    expert e[MAXN];
    const pf_cpu_weights *ws[MAXN];
    int counts[MAXN], total = 0;
    for (int k = 0; k < n; k++) {
        int fmt = fmts[rng_next(rng) % 6];
        int I = fmt == PF_CPU_MXFP4 || (is_rows_fmt(fmt) && rng_next(rng) % 2) ? 32 * (1 + (int)(rng_next(rng) % 4))
                : fmt == PF_CPU_FP8_ROWS ? 8 * (1 + (int)(rng_next(rng) % 9)) : 1 + (int)(rng_next(rng) % 70);
        expert_make(&e[k], rng, fmt, H, I, rng_next(rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32, (int)(rng_next(rng) % 4 != 0));
        e[k].w.round_bf16 = (int)(rng_next(rng) % 3 == 0);
        ws[k] = &e[k].w;
        counts[k] = 1 + (int)(rng_next(rng) % PF_CPU_MAX_TOKENS);
        total += counts[k];
    }
    const int xf = rng_next(rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32, es = xf == PF_CPU_BF16 ? 2 : 4;
    const int x_rows = 1 + (int)(rng_next(rng) % 20), stride = H + (int)(rng_next(rng) % 3);
    const int out_rows = total + (int)(rng_next(rng) % 5), ostride = H + (int)(rng_next(rng) % 3);
    void *x = make_x(rng, xf, x_rows, stride);
    int *rows = malloc(sizeof(int) * total), *dest = malloc(sizeof(int) * out_rows);
    float *scale = malloc(sizeof(float) * total), *out = malloc(sizeof(float) * out_rows * ostride);
    for (int i = 0; i < out_rows; i++) dest[i] = i; /* a random permutation; the first total entries are used */
    for (int i = out_rows - 1; i > 0; i--) {
        int j = (int)(rng_next(rng) % (uint64_t)(i + 1)), t = dest[i];
        dest[i] = dest[j];
        dest[j] = t;
    }
    for (int i = 0; i < total; i++) {
        rows[i] = (int)(rng_next(rng) % (uint64_t)x_rows);
        scale[i] = rng_unit(rng);
    }
    for (int i = 0; i < out_rows * ostride; i++) out[i] = 12345.0f;
    const int with_scale = (int)(rng_next(rng) % 4 != 0);
    int rc = pf_cpu_experts(c, n, ws, counts, rows, with_scale ? scale : NULL, x, xf, x_rows, stride, out, dest,
                            out_rows, ostride);
    int ok = rc == PF_CPU_OK;
    if (!ok) fprintf(stderr, "  pf_cpu_experts: %s\n", pf_cpu_strerror(rc));
    char *used = calloc((size_t)out_rows, 1);
    for (int k = 0, base = 0; ok && k < n; base += counts[k], k++) {
        char *xs = malloc((size_t)counts[k] * H * es);
        float *single = malloc(sizeof(float) * counts[k] * H);
        for (int t = 0; t < counts[k]; t++)
            memcpy(xs + (size_t)t * H * es, (char *)x + (size_t)rows[base + t] * stride * es, (size_t)H * es);
        ok = pf_cpu_expert(c, ws[k], xs, xf, counts[k], H, single) == PF_CPU_OK;
        for (int t = 0; ok && t < counts[k]; t++) {
            const float *o = out + (size_t)dest[base + t] * ostride;
            used[dest[base + t]] = 1;
            for (int j = 0; j < H && ok; j++) {
                float want = with_scale ? single[(size_t)t * H + j] * scale[base + t] : single[(size_t)t * H + j];
                if (memcmp(&want, &o[j], sizeof want) != 0) {
                    fprintf(stderr, "  batch: expert %d token %d out %d = %g, single call %g\n", k, t, j, o[j], want);
                    ok = 0;
                }
            }
        }
        free(xs);
        free(single);
    }
    for (int r = 0; ok && r < out_rows; r++)
        for (int j = 0; j < ostride && ok; j++)
            if ((!used[r] || j >= H) && out[(size_t)r * ostride + j] != 12345.0f) {
                fprintf(stderr, "  batch: row %d col %d was written\n", r, j);
                ok = 0;
            }
    free(used);
    free(x);
    free(rows);
    free(dest);
    free(scale);
    free(out);
    for (int k = 0; k < n; k++) expert_free(&e[k]);
    return ok;
}

static void phase_batch(int quick, uint64_t seed) {
    uint64_t rng = seed * 977 + 5;
    pf_cpu *c;
    for (int threads = 1; threads <= 4; threads += 3) {
        if (pf_cpu_create(threads, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
            count(0, "create batch context");
            return;
        }
        int good = 0, total = quick ? 6 : 25;
        for (int i = 0; i < total; i++) good += random_batch(c, &rng);
        char what[64];
        snprintf(what, sizeof what, "batch (%d threads): %d/%d match", threads, good, total);
        count(good == total, what);
        /* refusals: duplicate destination, rows out of range, bad counts; n == 0 is a no-op */
        expert e;
        expert_make(&e, &rng, PF_CPU_F32, 64, 32, PF_CPU_F32, 1);
        const pf_cpu_weights *ws[2] = {&e.w, &e.w};
        float x[2 * 64], out[4 * 64];
        for (int i = 0; i < 2 * 64; i++) x[i] = 0.5f;
        int cnt[2] = {1, 1}, rows[2] = {0, 1}, dup[2] = {3, 3}, fine[2] = {0, 3}, far[2] = {0, 4}, big[2] = {0, 2};
        int zero[2] = {0, 1}, many[2] = {1, PF_CPU_MAX_TOKENS + 1};
        CHECK(pf_cpu_experts(c, 2, ws, cnt, rows, NULL, x, PF_CPU_F32, 2, 64, out, dup, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 2, ws, cnt, rows, NULL, x, PF_CPU_F32, 2, 64, out, far, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 2, ws, cnt, big, NULL, x, PF_CPU_F32, 2, 64, out, fine, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 2, ws, zero, rows, NULL, x, PF_CPU_F32, 2, 64, out, fine, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 2, ws, many, rows, NULL, x, PF_CPU_F32, 2, 64, out, fine, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 2, ws, cnt, rows, NULL, x, PF_CPU_F32, 2, 63, out, fine, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, -1, ws, cnt, rows, NULL, x, PF_CPU_F32, 2, 64, out, fine, 4, 64) == PF_CPU_EINVAL);
        CHECK(pf_cpu_experts(c, 0, NULL, NULL, NULL, NULL, NULL, PF_CPU_F32, 0, 0, NULL, NULL, 0, 0) == PF_CPU_OK);
        CHECK(pf_cpu_experts(c, 2, ws, cnt, rows, NULL, x, PF_CPU_F32, 2, 64, out, fine, 4, 64) == PF_CPU_OK);
        expert_free(&e);
        pf_cpu_destroy(c);
    }
}

static void phase_api(void) {
    pf_cpu *c = (pf_cpu *)1;
    CHECK(pf_cpu_create(0, PF_CPU_LEVEL_AUTO, &c) == PF_CPU_EINVAL && c == NULL);
    CHECK(pf_cpu_create(PF_CPU_MAX_THREADS + 1, PF_CPU_LEVEL_AUTO, &c) == PF_CPU_EINVAL);
    CHECK(pf_cpu_create(1, 17, &c) == PF_CPU_EINVAL);
    CHECK(pf_cpu_create(1, PF_CPU_LEVEL_AUTO, NULL) == PF_CPU_EINVAL);
    if (pf_cpu_detect() < PF_CPU_LEVEL_AMX_BF16)
        CHECK(pf_cpu_create(1, pf_cpu_detect() + 1, &c) == PF_CPU_EUNSUPPORTED && c == NULL);
    for (int n = 1; n <= 6; n++) { /* init / close symmetry, with and without calls */
        CHECK(pf_cpu_create(n, PF_CPU_LEVEL_AUTO, &c) == PF_CPU_OK && c != NULL);
        CHECK(pf_cpu_threads(c) == n && pf_cpu_level(c) == pf_cpu_detect() && pf_cpu_active(c) == n);
        CHECK(pf_cpu_set_active(c, 0) == PF_CPU_EINVAL && pf_cpu_set_active(c, n + 1) == PF_CPU_EINVAL
              && pf_cpu_active(c) == n);
        if (n % 2) {
            uint64_t rng = 77 + n;
            CHECK(random_call(c, &rng, 1));
        }
        if (n >= 3) /* destroyed while its workers poll after a prewake: they must see stop */
            CHECK(pf_cpu_prewake(c, 100000) == PF_CPU_OK);
        pf_cpu_destroy(c);
    }
    pf_cpu_destroy(NULL);
    CHECK(pf_cpu_prewake(NULL, 10) == PF_CPU_EINVAL);
    CHECK(pf_cpu_set_active(NULL, 1) == PF_CPU_EINVAL && pf_cpu_active(NULL) == PF_CPU_EINVAL);
    CHECK(pf_cpu_set_invariant(NULL, 1) == PF_CPU_EINVAL && pf_cpu_invariant(NULL) == PF_CPU_EINVAL);

    CHECK(pf_cpu_create(2, PF_CPU_LEVEL_SCALAR, &c) == PF_CPU_OK);
    uint64_t rng = 5;
    expert e;
    expert_make(&e, &rng, PF_CPU_MXFP4, 64, 32, PF_CPU_BF16, 1);
    float x[64 * 2] = {0}, out[64 * 2];
    for (int i = 0; i < 128; i++) out[i] = 3.0f;
    CHECK(pf_cpu_prewake(c, 100001) == PF_CPU_EINVAL && pf_cpu_prewake(c, 0) == PF_CPU_OK);
    CHECK(pf_cpu_expert(NULL, &e.w, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, NULL, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_F32, 0, 64, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_F32, PF_CPU_MAX_TOKENS + 1, 64, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_F32, 1, 63, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_MXFP4, 1, 64, out) == PF_CPU_EINVAL);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_F32, 1, 64, NULL) == PF_CPU_EINVAL);
    pf_cpu_weights bad = e.w;
    bad.inter = 48; /* not a multiple of 32 */
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = e.w;
    bad.gate_up_scales = NULL;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = e.w;
    bad.round_bf16 = 2;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = e.w;
    bad.format = 9;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = e.w;
    bad.bias_format = PF_CPU_MXFP4;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    expert r; /* Qwen3-MoE's FP8 rows: no biases, a block dividing H and I, scales and their format */
    expert_make(&r, &rng, PF_CPU_FP8_ROWS, 64, 32, PF_CPU_F32, 0);
    CHECK(r.w.block == 32 && pf_cpu_expert(c, &r.w, x, PF_CPU_F32, 1, 64, out) == PF_CPU_OK);
    for (int i = 0; i < 128; i++) out[i] = 3.0f;
    bad = r.w;
    bad.down_bias = e.b2;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = r.w;
    bad.block = 24; /* divides neither */
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = r.w;
    bad.block = 0;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = r.w;
    bad.down_scales = NULL;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    bad = r.w;
    bad.scale_format = PF_CPU_MXFP4;
    CHECK(pf_cpu_expert(c, &bad, x, PF_CPU_F32, 1, 64, out) == PF_CPU_EINVAL);
    expert_free(&r);
    int untouched = 1;
    for (int i = 0; i < 128; i++) untouched &= out[i] == 3.0f;
    CHECK(untouched);
    CHECK(pf_cpu_expert(c, &e.w, x, PF_CPU_F32, 2, 64, out) == PF_CPU_OK && expert_check(&e, x, PF_CPU_F32, 2, 64, out));
    CHECK(strcmp(pf_cpu_strerror(PF_CPU_ETHREAD), "unknown error") != 0);
    CHECK(strcmp(pf_cpu_level_name(PF_CPU_LEVEL_AVX2), "avx2") == 0);
    expert_free(&e);
    pf_cpu_destroy(c);
}

static void phase_levels(int quick, uint64_t seed) {
    for (int level = PF_CPU_LEVEL_SCALAR; level <= pf_cpu_detect(); level++) {
        for (int n = 1; n <= 5; n += quick ? 2 : 1) {
            pf_cpu *c;
            if (pf_cpu_create(n, level, &c) != PF_CPU_OK) {
                count(0, "create at a supported level");
                continue;
            }
            uint64_t rng = seed * 1000 + level * 10 + n;
            int calls = quick ? 6 : 20, good = 0;
            for (int i = 0; i < calls; i++) good += random_call(c, &rng, quick);
            char what[96];
            snprintf(what, sizeof what, "level %s, %d threads: %d/%d calls match", pf_cpu_level_name(level), n, good,
                     calls);
            count(good == calls, what);
            pf_cpu_destroy(c);
        }
    }
}

/* what each worker thread of a phase counts: its checked calls, and how many matched */
struct tally {
    int good, total;
};

/* run fn on nt threads (fn's argument: element i of args, `size` bytes each, a struct tally
 * first), join them, and count one check: every call of every thread matched */
static void run_threads(void *(*fn)(void *), void *args, size_t size, int nt, const char *what) {
    pthread_t tid[16];
    for (int i = 0; i < nt; i++) pthread_create(&tid[i], NULL, fn, (char *)args + (size_t)i * size);
    int good = 0, total = 0;
    for (int i = 0; i < nt; i++) {
        pthread_join(tid[i], NULL);
        const struct tally *t = (const struct tally *)((char *)args + (size_t)i * size);
        good += t->good;
        total += t->total;
    }
    char msg[96];
    snprintf(msg, sizeof msg, "%s: %d/%d match", what, good, total);
    count(good == total && total > 0, msg);
}

/* one worker thread of a concurrent phase: its tally first (run_threads reads it), the shared
 * pool, its seed and how many calls (or layer runs) it makes */
struct worker_arg {
    struct tally t;
    pf_cpu *shared;
    uint64_t seed;
    int calls;
    pf_sched *sched; /* layer phase: fetching contexts' scheduler */
    int id;
};

static void *shared_worker(void *p) {
    struct worker_arg *a = p;
    uint64_t rng = a->seed;
    for (int i = 0; i < a->calls; i++) {
        if (i % 2) /* from another thread while calls run */
            pf_cpu_prewake(a->shared, (unsigned)(rng_next(&rng) % 200));
        a->t.good += random_call(a->shared, &rng, 1);
        a->t.total++;
        if (i % 3 == 0) { /* an own context, created and destroyed while the others run */
            pf_cpu *own;
            if (pf_cpu_create(1 + (int)(rng_next(&rng) % 3), PF_CPU_LEVEL_AUTO, &own) == PF_CPU_OK) {
                a->t.good += random_call(own, &rng, 1);
                a->t.total++;
                pf_cpu_destroy(own);
            }
        }
    }
    return NULL;
}

static void phase_shared(int quick, uint64_t seed) {
    pf_cpu *c;
    if (pf_cpu_create(3, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
        count(0, "create shared context");
        return;
    }
    enum { NT = 4 };
    struct worker_arg args[NT];
    for (int i = 0; i < NT; i++)
        args[i] = (struct worker_arg){.shared = c, .seed = seed * 31 + i + 1, .calls = quick ? 4 : 12};
    run_threads(shared_worker, args, sizeof args[0], NT, "shared: concurrent calls");
    pf_cpu_destroy(c);
}

/* back-to-back jobs on a pool with more threads than this machine has cores, so workers
 * wake late, find a phase already finished or a newer one published: stream reads of random
 * sizes (under 8 bytes: a job without units) between batched calls, each checked */
struct toggler {
    pf_cpu *c;
    uint64_t rng;
    _Atomic int stop;
    int sets;
    /* held across both calls of a batched check and around each invariance change: a batch and the
     * single calls it is compared with must round alike (AMX tiles or not) to match bit for bit */
    pthread_mutex_t invariance;
};

/* Changes the pool's active thread count (1 .. 8) and its batch invariance every few microseconds
 * while jobs run (an invariance change waits for a batched check in progress, see above). */
static void *toggler_main(void *p) {
    struct toggler *t = p;
    while (!atomic_load(&t->stop)) {
        t->sets += pf_cpu_set_active(t->c, 1 + (int)(rng_next(&t->rng) % 8)) == PF_CPU_OK;
        pthread_mutex_lock(&t->invariance);
        t->sets += pf_cpu_set_invariant(t->c, (int)(rng_next(&t->rng) % 2)) == PF_CPU_OK;
        pthread_mutex_unlock(&t->invariance);
        struct timespec ts = {0, 20000 + (long)(rng_next(&t->rng) % 60000)};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void phase_pool(int quick, uint64_t seed) {
    uint64_t rng = seed * 7919 + 3;
    pf_cpu *c;
    if (pf_cpu_create(8, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
        count(0, "create pool context");
        return;
    }
    /* the active thread count changes under the jobs (pf_cpu_set_active): every job still completes, exactly */
    struct toggler tog = {.c = c, .rng = seed + 11};
    pthread_mutex_init(&tog.invariance, NULL);
    pthread_t tt;
    int toggling = pthread_create(&tt, NULL, toggler_main, &tog) == 0;
    const size_t cap = (size_t)3 << 20;
    uint8_t *buf = malloc(cap);
    for (size_t i = 0; i < cap; i++) buf[i] = (uint8_t)rng_next(&rng);
    int good = 0, total = quick ? 40 : 160;
    for (int i = 0; i < total; i++) {
        if (i % 3 == 0) /* workers polling after a prewake must take the next job as sleepers do */
            CHECK(pf_cpu_prewake(c, (unsigned)(rng_next(&rng) % 400)) == PF_CPU_OK);
        if (i % 2) {
            pthread_mutex_lock(&tog.invariance);
            good += random_batch(c, &rng);
            pthread_mutex_unlock(&tog.invariance);
            continue;
        }
        size_t n = (size_t)(rng_next(&rng) % 4 == 0 ? rng_next(&rng) % 8 : rng_next(&rng) % cap);
        uint64_t want = 0, got = 1, word;
        for (size_t k = 0; k < n; k += 8) {
            word = 0;
            memcpy(&word, buf + k, n - k < 8 ? n - k : 8);
            want += word;
        }
        good += pf_cpu_stream_read(c, buf, n, &got) == PF_CPU_OK && got == want;
    }
    if (toggling) {
        atomic_store(&tog.stop, 1);
        pthread_join(tt, NULL);
    }
    pthread_mutex_destroy(&tog.invariance);
    char what[96];
    snprintf(what, sizeof what, "pool: %d/%d back-to-back jobs match (active count set %d times meanwhile)", good, total,
             tog.sets);
    count(good == total && toggling && tog.sets > 0, what);
    /* with 3 active threads a job's phases are joined by at most 3; then all 8 again */
    pf_cpu_timing tm;
    CHECK(pf_cpu_set_active(c, 3) == PF_CPU_OK && pf_cpu_active(c) == 3);
    CHECK(pf_cpu_prewake(c, 300) == PF_CPU_OK); /* wakes (and spins) only the active ones */
    int ok = 1;
    for (int i = 0; i < 6; i++) {
        ok &= random_batch(c, &rng);
        ok &= pf_cpu_last_timing(c, &tm) == PF_CPU_OK && tm.joined[1] <= 3 && tm.joined[2] <= 3;
    }
    CHECK(ok);
    CHECK(pf_cpu_set_active(c, 8) == PF_CPU_OK);
    CHECK(random_batch(c, &rng));
    /* destroyed right after a job: its workers may still poll for a next phase */
    free(buf);
    pf_cpu_destroy(c);
}

enum { LE = 5, LR = 6, LH = 64, NBYTES = 3000, STAGES = 2 };
static _Atomic int fetched_total, fallback_total; /* over every fetching run: the paths were taken */

/* A fetching context's run: stage_of, the stages' bytes and the fetch figures agree, the plan's
 * count was taken (most positions first) unless a fetch failed; *fetched_rows gets, per expert,
 * whether its rows are zero for being fetched. */
static int check_fetch(pf_layer *L, const pf_layer_fetch *f, const int *count, const uint8_t *res, int use_res,
                       uint8_t *const *src, uint8_t *const *stage, uint8_t *fetched_e) {
    int fetched = -1, fallback = -1, off = -1, ok = 1, nf = 0, missing = 0;
    uint64_t wait_ns;
    pf_layer_fetch_result(L, &fetched, &fallback, &wait_ns, &off);
    fetched_total += fetched;
    fallback_total += fallback;
    for (int e = 0; e < LE; e++) {
        int s = f->stage_of[e];
        fetched_e[e] = s >= 0;
        missing += count[e] > 0 && !(use_res && res[e]);
        if (s < 0) continue;
        nf++;
        ok &= s < STAGES && count[e] > 0 && !(use_res && res[e]) && !memcmp(stage[s], src[e], NBYTES);
    }
    int want = f->plan[missing] < STAGES ? f->plan[missing] : STAGES;
    if (want > missing) want = missing;
    ok &= fetched == nf && off == 0 && nf + fallback == want;
    if (!fallback) /* the experts fetched have at least as many positions as any computed here */
        for (int e = 0; e < LE; e++)
            for (int g = 0; g < LE; g++)
                if (fetched_e[e] && !fetched_e[g] && count[g] > 0 && !(use_res && res[g])) ok &= count[e] >= count[g];
    return ok;
}

/* one thread's layer contexts on the shared pool (see the header comment) */
static void *layer_worker(void *p) {
    struct worker_arg *a = p;
    uint64_t rng = a->seed;
    enum { E = LE, R = LR, H = LH };
    expert ex[E];
    const pf_cpu_weights *w[E];
    uint8_t *src[E], *stage[STAGES], plan[R * 4 + 1];
    int32_t stage_of[E];
    for (int e = 0; e < E; e++) {
        expert_make(&ex[e], &rng, PF_CPU_MXFP4, H, 32 * (1 + e % 2), PF_CPU_BF16, 1);
        w[e] = &ex[e].w;
        src[e] = malloc(NBYTES);
        for (int j = 0; j < NBYTES; j++) src[e][j] = (uint8_t)rng_next(&rng);
    }
    for (int s = 0; s < STAGES; s++) stage[s] = malloc(NBYTES);
    pf_cpu *own;
    if (pf_cpu_create(1, PF_CPU_LEVEL_AUTO, &own) != PF_CPU_OK) own = NULL; /* the references */
    for (int i = 0; i < a->calls && own; i++) {
        int K = 1 + (int)(rng_next(&rng) % 4), idx_bytes = rng_next(&rng) % 2 ? 8 : 4;
        int xf = rng_next(&rng) % 2 ? PF_CPU_BF16 : PF_CPU_F32, n = R * K;
        void *idx = malloc((size_t)n * idx_bytes);
        float *scale = malloc(sizeof(float) * n), *out = malloc(sizeof(float) * n * H), ref[H];
        void *x = malloc((size_t)R * H * 4);
        for (int j = 0; j < R * H; j++) {
            float v = rng_unit(&rng);
            if (xf == PF_CPU_BF16) ((uint16_t *)x)[j] = f32_to_bf16(v);
            else ((float *)x)[j] = v;
        }
        uint8_t res[E], fetched_e[E] = {0};
        int count[E];
        pf_layer_fetch f = {.sched = a->sched, .src = (const void *const *)src, .nbytes = NBYTES,
                            .stage = (void *const *)stage, .stages = STAGES,
                            .key_base = ((uint64_t)(a->id + 1) << 32) | ((uint64_t)i << 8), .plan = plan,
                            .stage_of = stage_of, .timeout_s = 30.0};
        int fetching = a->sched && i % 4 == 3;
        pf_layer_desc d = {.cpu = a->shared, .experts = w, .num_experts = E, .top_k = K, .rows = R, .hidden = H,
                           .idx_bytes = idx_bytes, .idx = idx, .scale = scale, .x = x, .x_format = xf, .out = out,
                           .resident = i % 2 ? res : NULL, .fetch = fetching ? &f : NULL};
        pf_layer *L;
        if (pf_layer_create(&d, &L) != PF_CPU_OK) {
            a->t.total++;
            free(idx), free(scale), free(out), free(x);
            continue;
        }
        for (int r = 0; r < 3; r++) {
            int T = 1 + (int)(rng_next(&rng) % R), bad = r == 2 && i % 3 == 0;
            for (int p = 0; p < n; p++) {
                long long e = (long long)(rng_next(&rng) % E);
                if (bad && p == (T * K) / 2) e = E;
                if (idx_bytes == 8) ((int64_t *)idx)[p] = e;
                else ((int32_t *)idx)[p] = (int32_t)e;
                scale[p] = rng_unit(&rng);
            }
            for (int e = 0; e < E; e++) res[e] = rng_next(&rng) % 3 == 0;
            for (int m = 0; m <= n; m++) plan[m] = (uint8_t)(rng_next(&rng) % (m + 2));
            for (int j = 0; j < n * H; j++) out[j] = 3.0f;
            for (int s = 0; s < STAGES; s++) memset(stage[s], 0xA5, NBYTES);
            memset(count, 0, sizeof count);
            for (int p = 0; p < T * K && !bad; p++) count[idx_bytes == 8 ? ((int64_t *)idx)[p] : ((int32_t *)idx)[p]]++;
            pf_layer_set_tokens(L, T);
            int rc = pf_layer_run(L), st = 1, routed = -1, ok = 1;
            uint64_t ns, runs;
            pf_layer_result(L, &st, &routed, &ns, &runs);
            ok = rc == st && runs == (uint64_t)r + 1 && (bad ? rc == PF_CPU_EINVAL : rc == PF_CPU_OK);
            uint64_t begin = 0, kernel_ns = 0; /* the run's clock: it started, its kernel took part of it */
            ok &= pf_layer_clock(L, &begin, &kernel_ns) == PF_CPU_OK && begin > 0 && kernel_ns <= ns;
            int64_t rep[PF_LAYER_REPORT]; /* the same figures in one call */
            pf_layer *const one[1] = {L};
            ok &= pf_layer_report(one, 1, rep) == PF_CPU_OK && rep[0] == st && rep[1] == routed
                  && rep[2] == (int64_t)ns && rep[3] == (int64_t)runs && rep[4] == (int64_t)begin
                  && rep[5] == (int64_t)kernel_ns;
            if (fetching && ok && !bad) ok &= check_fetch(L, &f, count, res, d.resident != NULL, src, stage, fetched_e);
            if (fetching && bad)
                for (int e = 0; e < E; e++) ok &= stage_of[e] == -1;
            for (int p = 0; p < n && ok; p++) {
                long long e = idx_bytes == 8 ? ((int64_t *)idx)[p] : ((int32_t *)idx)[p];
                if (bad || p >= T * K || (d.resident && res[e]) || (fetching && fetched_e[e])) {
                    for (int j = 0; j < H; j++) ok &= out[(size_t)p * H + j] == 0.0f;
                    continue;
                }
                const char *row = (const char *)x + (size_t)(p / K) * H * (xf == PF_CPU_BF16 ? 2 : 4);
                ok &= pf_cpu_expert(own, w[e], row, xf, 1, H, ref) == PF_CPU_OK;
                for (int j = 0; j < H; j++) {
                    double want = (double)ref[j] * scale[p], got = out[(size_t)p * H + j];
                    ok &= fabs(got - want) <= 1e-5 * (1.0 + fabs(want));
                }
            }
            a->t.good += ok;
            a->t.total++;
        }
        pf_layer_destroy(L);
        free(idx), free(scale), free(out), free(x);
    }
    if (own) pf_cpu_destroy(own);
    for (int e = 0; e < E; e++) expert_free(&ex[e]), free(src[e]);
    for (int s = 0; s < STAGES; s++) free(stage[s]);
    return NULL;
}

/* Route-ahead: a chain of fetching contexts, each run prefetching for the next (pf_layer_set_ahead)
 * from a prediction that is the next layer's real routing half the time. Each run's claims and
 * cancels add up to what the previous run sent; every staged expert is routed, not resident, and
 * its stage holds its bytes; every other row is the reference's or zero; a chain destroyed with
 * prefetches still in its last context's stages leaves the scheduler with nothing live. */
enum { AL = 3, AS = 4, AK = 2 };
static _Atomic int ahead_sent_total, ahead_used_total;

static void *ahead_worker(void *p) {
    struct worker_arg *a = p;
    uint64_t rng = a->seed;
    enum { E = LE, R = LR, H = LH, N = LR * AK };
    expert ex[E];
    const pf_cpu_weights *w[E];
    uint8_t *src[E], *stage[AL][AS], plan[AL][N + 1], res[AL][E];
    int32_t stage_of[AL][E];
    int64_t idx[AL][N], pred[AL][N];
    float scale[N], x[R * H], *out[AL], ref[H];
    for (int e = 0; e < E; e++) {
        expert_make(&ex[e], &rng, PF_CPU_MXFP4, H, 32, PF_CPU_BF16, 1);
        w[e] = &ex[e].w;
        src[e] = malloc(NBYTES);
        for (int j = 0; j < NBYTES; j++) src[e][j] = (uint8_t)rng_next(&rng);
    }
    for (int j = 0; j < R * H; j++) x[j] = rng_unit(&rng);
    for (int j = 0; j < N; j++) scale[j] = rng_unit(&rng);
    pf_cpu *own;
    if (pf_cpu_create(1, PF_CPU_LEVEL_AUTO, &own) != PF_CPU_OK) own = NULL;
    pf_layer *L[AL] = {0};
    pf_layer_fetch f[AL];
    int made = 1;
    for (int l = 0; l < AL; l++) {
        out[l] = malloc(sizeof(float) * N * H);
        for (int s2 = 0; s2 < AS; s2++) stage[l][s2] = malloc(NBYTES);
        f[l] = (pf_layer_fetch){.sched = a->sched, .src = (const void *const *)src, .nbytes = NBYTES,
                                .stage = (void *const *)stage[l], .stages = AS,
                                .key_base = ((uint64_t)(a->id + 101) << 32) | ((uint64_t)l << 8), .plan = plan[l],
                                .stage_of = stage_of[l], .timeout_s = 30.0};
        pf_layer_desc d = {.cpu = a->shared, .experts = w, .num_experts = E, .top_k = AK, .rows = R, .hidden = H,
                           .idx_bytes = 8, .idx = idx[l], .scale = scale, .x = x, .x_format = PF_CPU_F32,
                           .out = out[l], .resident = res[l], .fetch = &f[l]};
        made &= pf_layer_create(&d, &L[l]) == PF_CPU_OK;
    }
    for (int l = 0; l + 1 < AL && made; l++) made &= pf_layer_set_ahead(L[l], L[l + 1], pred[l], 1 + l) == PF_CPU_OK;
    if (made) /* refused: itself, too many, no prediction */
        made &= pf_layer_set_ahead(L[0], L[0], pred[0], 1) == PF_CPU_EINVAL
                && pf_layer_set_ahead(L[0], L[1], pred[0], AS + 1) == PF_CPU_EINVAL
                && pf_layer_set_ahead(L[0], L[1], NULL, 1) == PF_CPU_EINVAL;
    a->t.good += made;
    a->t.total++;
    for (int r = 0; r < a->calls && made && own; r++) {
        int T = 1 + (int)(rng_next(&rng) % R), sent_before = 0;
        for (int l = 0; l < AL; l++) {
            for (int q = 0; q < N; q++) idx[l][q] = (int64_t)(rng_next(&rng) % E);
            for (int e = 0; e < E; e++) res[l][e] = rng_next(&rng) % 4 == 0;
            for (int m = 0; m <= N; m++) plan[l][m] = (uint8_t)(rng_next(&rng) % (m + 2));
            pf_layer_set_tokens(L[l], T);
        }
        for (int l = 0; l + 1 < AL; l++)
            for (int q = 0; q < N; q++) pred[l][q] = rng_next(&rng) % 2 ? idx[l + 1][q] : (int64_t)(rng_next(&rng) % (E + 1));
        for (int l = 0; l < AL; l++) {
            for (int j = 0; j < N * H; j++) out[l][j] = 3.0f;
            int ok = pf_layer_run(L[l]) == PF_CPU_OK, sent = 0, used = 0, unused = 0, fetched = 0, fallback = 0, off = 0;
            uint64_t wait_ns;
            pf_layer_ahead_result(L[l], &sent, &used, &unused);
            pf_layer_fetch_result(L[l], &fetched, &fallback, &wait_ns, &off);
            ok &= used + unused == sent_before && fetched + fallback >= used && off == 0;
            if (l + 1 < AL) { /* what it sent: the distinct non-resident predictions, at most 1 + l */
                uint8_t seen[E] = {0};
                int distinct = 0;
                for (int q = 0; q < T * AK; q++)
                    if (pred[l][q] < E && !res[l + 1][pred[l][q]] && !seen[pred[l][q]]) seen[pred[l][q]] = 1, distinct++;
                ok &= sent == (distinct < 1 + l ? distinct : 1 + l);
            }
            ahead_sent_total += sent;
            ahead_used_total += used;
            sent_before = sent;
            int routed[E] = {0};
            for (int q = 0; q < T * AK; q++) routed[idx[l][q]]++;
            for (int e = 0; e < E; e++) {
                int st = stage_of[l][e];
                if (st >= 0) ok &= st < AS && routed[e] && !res[l][e] && !memcmp(stage[l][st], src[e], NBYTES);
            }
            for (int q = 0; q < N && ok; q++) {
                int e = (int)idx[l][q];
                if (q >= T * AK || res[l][e] || stage_of[l][e] >= 0) {
                    for (int j = 0; j < H; j++) ok &= out[l][(size_t)q * H + j] == 0.0f;
                    continue;
                }
                ok &= pf_cpu_expert(own, w[e], x + (size_t)(q / AK) * H, PF_CPU_F32, 1, H, ref) == PF_CPU_OK;
                for (int j = 0; j < H; j++) {
                    double want = (double)ref[j] * scale[q], got = out[l][(size_t)q * H + j];
                    ok &= fabs(got - want) <= 1e-5 * (1.0 + fabs(want));
                }
            }
            a->t.good += ok;
            a->t.total++;
        }
    }
    if (made) { /* the last context holds prefetches when the chain is destroyed */
        for (int q = 0; q < N; q++) pred[AL - 2][q] = q % E;
        memset(res[AL - 1], 0, E);
        for (int l = 0; l + 1 < AL; l++) pf_layer_run(L[l]);
    }
    for (int l = 0; l < AL; l++) pf_layer_destroy(L[l]);
    for (int l = 0; l < AL; l++) {
        free(out[l]);
        for (int s2 = 0; s2 < AS; s2++) free(stage[l][s2]);
    }
    if (own) pf_cpu_destroy(own);
    for (int e = 0; e < E; e++) expert_free(&ex[e]), free(src[e]);
    return NULL;
}

/* three threads running fn on the shared pool and scheduler, each with its seed and id */
static void layer_threads(void *(*fn)(void *), pf_cpu *c, pf_sched *sched, uint64_t seed, int calls, const char *what) {
    enum { NT = 3 };
    struct worker_arg args[NT];
    for (int i = 0; i < NT; i++)
        args[i] = (struct worker_arg){.shared = c, .seed = seed + i + 1, .calls = calls, .sched = sched, .id = i};
    run_threads(fn, args, sizeof args[0], NT, what);
}

static void phase_layer(int quick, uint64_t seed) {
    pf_cpu *c;
    if (pf_cpu_create(3, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
        count(0, "create layer context");
        return;
    }
    { /* refused descriptions and token counts */
        uint64_t rng = seed;
        expert e0;
        expert_make(&e0, &rng, PF_CPU_MXFP4, 64, 32, PF_CPU_BF16, 1);
        const pf_cpu_weights *w[2] = {&e0.w, &e0.w};
        int64_t idx[4] = {0};
        float scale[4] = {0}, x[2 * 64] = {0}, out[4 * 64];
        pf_layer_desc d = {.cpu = c, .experts = w, .num_experts = 2, .top_k = 2, .rows = 2, .hidden = 64,
                           .idx_bytes = 8, .idx = idx, .scale = scale, .x = x, .x_format = PF_CPU_F32, .out = out};
        pf_layer *L = (pf_layer *)&d;
        pf_layer_desc bad = d;
        bad.idx_bytes = 2;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL && L == NULL);
        bad = d;
        bad.hidden = 32;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL);
        bad = d;
        bad.out = NULL;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL);
        CHECK(pf_layer_create(NULL, &L) == PF_CPU_EINVAL);
        CHECK(pf_layer_create(&d, &L) == PF_CPU_OK && L != NULL);
        CHECK(pf_layer_set_tokens(L, 0) == PF_CPU_EINVAL && pf_layer_set_tokens(L, 3) == PF_CPU_EINVAL);
        CHECK(pf_layer_set_prewake(L, 100001) == PF_CPU_EINVAL && pf_layer_set_prewake(L, 50) == PF_CPU_OK);
        CHECK(pf_layer_run(L) == PF_CPU_OK);
        pf_layer_host_fn(L);
        uint64_t runs = 0;
        CHECK(pf_layer_result(L, NULL, NULL, NULL, &runs) == PF_CPU_OK && runs == 2);
        CHECK(pf_layer_clock(L, NULL, NULL) == PF_CPU_OK);
        int64_t rep[2 * PF_LAYER_REPORT];
        pf_layer *const two[2] = {L, L}, *const gap[2] = {L, NULL};
        CHECK(pf_layer_report(two, 2, rep) == PF_CPU_OK && rep[3] == 2 && rep[PF_LAYER_REPORT + 3] == 2);
        rep[0] = 77;
        CHECK(pf_layer_report(gap, 2, rep) == PF_CPU_EINVAL && rep[0] == 77); /* out untouched */
        CHECK(pf_layer_report(two, 0, rep) == PF_CPU_EINVAL && pf_layer_report(NULL, 1, rep) == PF_CPU_EINVAL
              && pf_layer_report(two, 1, NULL) == PF_CPU_EINVAL);
        pf_layer_destroy(L);
        pf_layer_destroy(NULL);
        CHECK(pf_layer_run(NULL) == PF_CPU_EINVAL);
        CHECK(pf_layer_clock(NULL, NULL, NULL) == PF_CPU_EINVAL);
        /* fetch descriptions refused */
        int32_t stage_of[2];
        uint8_t plan[5] = {0}, b0[8], b1[8];
        const void *srcs[2] = {b0, b1};
        void *stages[1] = {b0};
        pf_layer_fetch f = {.sched = (pf_sched *)&d, .src = srcs, .nbytes = 8, .stage = stages, .stages = 1,
                            .plan = plan, .stage_of = stage_of, .timeout_s = 1.0};
        bad = d;
        bad.fetch = &f;
        f.stages = 0;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL && L == NULL);
        f.stages = 1, f.timeout_s = 0;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL);
        f.timeout_s = 1.0, f.nbytes = 0;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL);
        f.nbytes = 8, srcs[1] = NULL;
        CHECK(pf_layer_create(&bad, &L) == PF_CPU_EINVAL);
        expert_free(&e0);
    }
    pf_config cfg;
    pf_config_default(&cfg);
    cfg.workers = 2;
    cfg.chunk_bytes = 1024;
    cfg.fault_every = 7;
    pf_sched *sched = NULL;
    char err[128];
    CHECK(pf_create(&cfg, &sched, err, sizeof err) == PF_OK);
    layer_threads(layer_worker, c, sched, seed * 131, quick ? 8 : 20, "layer: runs on a shared pool, some fetching");
    printf("layer: %d experts fetched, %d failed fetches computed instead\n", fetched_total, fallback_total);
    count(fetched_total > 0 && fallback_total > 0, "layer: fetches landed and failed fetches were computed");
    layer_threads(ahead_worker, c, sched, seed * 173, quick ? 6 : 16, "layer: route-ahead chains on a shared pool");
    printf("layer: route-ahead %d prefetches sent, %d claimed\n", ahead_sent_total, ahead_used_total);
    count(ahead_sent_total > 0 && ahead_used_total > 0, "layer: route-ahead prefetches were sent and claimed");
    if (sched) {
        pf_stats st;
        int quiet = pf_get_stats(sched, &st) == PF_OK;
        for (int p = 0; p < PF_NUM_PRIORITY; p++) quiet &= st.level[p].queue_depth == 0 && st.level[p].in_flight == 0;
        count(quiet, "layer: nothing live in the scheduler after every context was destroyed");
        pf_shutdown(sched);
        pf_destroy(sched);
    }
    pf_cpu_destroy(c);
}

/* ---- relay --------------------------------------------------------------------------- */
enum { RL = 4, RE = 3, RH = 64, RR = 2, RK = 2 };

struct fake_device { /* stands in for a graph: down flag, then wait for the up flag, per layer */
    _Atomic uint32_t *flags;
    pf_layer **ctx;
    float **out, **want;
    uint64_t seed;
    int n, good;
};

static void sleep_us(unsigned us) {
    struct timespec ts = {0, (long)us * 1000};
    nanosleep(&ts, NULL);
}

static void *fake_device_main(void *p) {
    struct fake_device *d = p;
    uint64_t rng = d->seed;
    d->good = 1;
    for (int i = 0; i < d->n; i++) {
        uint64_t before = 0;
        pf_layer_result(d->ctx[i], NULL, NULL, NULL, &before);
        sleep_us((unsigned)(rng_next(&rng) % 300));
        atomic_store_explicit(&d->flags[i], 1u, memory_order_release);
        int waited = 0;
        while (!atomic_load_explicit(&d->flags[RL + i], memory_order_acquire)) {
            if (++waited > 2000000) { /* 10 s */
                d->good = 0;
                return NULL;
            }
            sleep_us(5);
        }
        uint64_t after = 0;
        pf_layer_result(d->ctx[i], NULL, NULL, NULL, &after);
        d->good &= after == before + 1;
        for (int j = 0; j < RR * RK * RH; j++) d->good &= d->out[i][j] == d->want[i][j];
    }
    return NULL;
}

static void phase_relay(int quick, uint64_t seed) {
    uint64_t rng = seed * 977 + 5;
    pf_cpu *c;
    if (pf_cpu_create(2, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
        count(0, "relay: create the kernel context");
        return;
    }
    expert ex[RE];
    const pf_cpu_weights *w[RE];
    for (int e = 0; e < RE; e++) {
        expert_make(&ex[e], &rng, PF_CPU_MXFP4, RH, 32, PF_CPU_BF16, 1);
        w[e] = &ex[e].w;
    }
    int64_t idx[RL][RR * RK];
    float scale[RL][RR * RK], x[RL][RR * RH], *out[RL], *want[RL];
    pf_layer *ctx[RL];
    int made = 1;
    for (int l = 0; l < RL; l++) {
        out[l] = malloc(sizeof(float) * RR * RK * RH);
        want[l] = malloc(sizeof(float) * RR * RK * RH);
        for (int p = 0; p < RR * RK; p++) idx[l][p] = (int64_t)(rng_next(&rng) % RE), scale[l][p] = rng_unit(&rng);
        for (int j = 0; j < RR * RH; j++) x[l][j] = rng_unit(&rng);
        pf_layer_desc d = {.cpu = c, .experts = w, .num_experts = RE, .top_k = RK, .rows = RR, .hidden = RH,
                           .idx_bytes = 8, .idx = idx[l], .scale = scale[l], .x = x[l], .x_format = PF_CPU_F32,
                           .out = out[l]};
        made &= pf_layer_create(&d, &ctx[l]) == PF_CPU_OK;
        made &= made && pf_layer_run(ctx[l]) == PF_CPU_OK; /* the direct run: the reference */
        if (made) memcpy(want[l], out[l], sizeof(float) * RR * RK * RH);
    }
    CHECK(made);
    static uint32_t flags[2 * RL];
    _Atomic uint32_t *af = (_Atomic uint32_t *)flags;
    pf_relay *r = NULL;
    int st = 0, answered = -1;
    CHECK(pf_relay_create(NULL, RL, 0, &r) == PF_CPU_EINVAL && r == NULL);
    CHECK(pf_relay_create(flags, 0, 0, &r) == PF_CPU_EINVAL);
    CHECK(pf_relay_create(flags, RL, 1000001, &r) == PF_CPU_EINVAL);
    CHECK(pf_relay_create(flags, RL, 0, NULL) == PF_CPU_EINVAL);
    pf_relay_destroy(NULL);
    int good = 0, steps = quick ? 12 : 60;
    for (int k = 0; k < steps && made; k++) { /* spin_us 0 (sleeping waits), 30, 2000 (spinning) */
        unsigned spin = k % 3 == 0 ? 0 : k % 3 == 1 ? 30 : 2000;
        if (k % 6 < 3 && pf_relay_create(flags, RL, spin, &r) != PF_CPU_OK) break;
        int n = 1 + (int)(rng_next(&rng) % RL);
        for (int l = 0; l < RL; l++)
            for (int j = 0; j < RR * RK * RH; j++) out[l][j] = 3.0f;
        flags[RL] = 7u; /* stale: the arm zeroes every flag */
        int ok = pf_relay_arm(r, ctx, n, 10.0) == PF_CPU_OK;
        ok &= pf_relay_arm(r, ctx, n, 10.0) == PF_RELAY_EBUSY;
        struct fake_device dev = {.flags = af, .ctx = ctx, .out = out, .want = want, .seed = rng_next(&rng), .n = n};
        pthread_t t;
        pthread_create(&t, NULL, fake_device_main, &dev);
        pthread_join(t, NULL);
        ok &= pf_relay_wait(r, 10.0, &st, &answered) == PF_CPU_OK && st == PF_CPU_OK && answered == n && dev.good;
        for (int l = n; l < RL; l++) /* layers the step did not name: not run, flags untouched */
            for (int j = 0; j < RR * RK * RH; j++) ok &= out[l][j] == 3.0f;
        ok &= pf_relay_wait(r, 0.0, &st, &answered) == PF_CPU_EINVAL; /* collected already */
        good += ok;
        if (k % 6 == 5) pf_relay_destroy(r), r = NULL;
    }
    char msg[96];
    snprintf(msg, sizeof msg, "relay: %d/%d steps answered layer by layer, outputs the direct runs'", good, steps);
    count(good == steps, msg);
    if (r == NULL) CHECK(pf_relay_create(flags, RL, 100, &r) == PF_CPU_OK);
    if (r) {
        pf_layer *none[RL] = {ctx[0], NULL, ctx[2], ctx[3]};
        CHECK(pf_relay_arm(r, ctx, 0, 1.0) == PF_CPU_EINVAL && pf_relay_arm(r, ctx, RL + 1, 1.0) == PF_CPU_EINVAL);
        CHECK(pf_relay_arm(r, none, RL, 1.0) == PF_CPU_EINVAL && pf_relay_arm(r, ctx, RL, 0.0) == PF_CPU_EINVAL);
        CHECK(pf_relay_wait(r, 0.0, &st, &answered) == PF_CPU_EINVAL); /* nothing armed */
        /* no down flag ever comes: the step ends by its timeout, every up flag set */
        CHECK(pf_relay_arm(r, ctx, RL, 0.02) == PF_CPU_OK);
        CHECK(pf_relay_wait(r, 10.0, &st, &answered) == PF_CPU_OK && st == PF_RELAY_ETIMEDOUT && answered == 0);
        int up = 1;
        for (int l = 0; l < RL; l++) up &= atomic_load(&af[RL + l]) == 1u;
        CHECK(up);
        /* the first layer's flag only: one layer answered, then the timeout */
        CHECK(pf_relay_arm(r, ctx, RL, 0.05) == PF_CPU_OK);
        atomic_store(&af[0], 1u);
        CHECK(pf_relay_wait(r, 10.0, &st, &answered) == PF_CPU_OK && st == PF_RELAY_ETIMEDOUT && answered == 1);
        /* still armed past pf_relay_wait's own timeout; then cancelled: it ends at once */
        CHECK(pf_relay_arm(r, ctx, RL, 30.0) == PF_CPU_OK);
        CHECK(pf_relay_wait(r, 0.01, &st, &answered) == PF_RELAY_ETIMEDOUT);
        CHECK(pf_relay_cancel(r) == PF_CPU_OK && pf_relay_cancel(NULL) == PF_CPU_EINVAL);
        CHECK(pf_relay_wait(r, 10.0, &st, &answered) == PF_CPU_OK && st == PF_RELAY_ECANCELED && answered == 0);
        up = 1;
        for (int l = 0; l < RL; l++) up &= atomic_load(&af[RL + l]) == 1u;
        CHECK(up);
        CHECK(pf_relay_cancel(r) == PF_CPU_OK); /* nothing armed: a no-op */
        /* destroyed while armed: returns */
        CHECK(pf_relay_arm(r, ctx, RL, 30.0) == PF_CPU_OK);
        pf_relay_destroy(r);
        count(1, "relay: destroyed while armed");
    }
    for (int l = 0; l < RL; l++) {
        if (ctx[l]) pf_layer_destroy(ctx[l]);
        free(out[l]), free(want[l]);
    }
    for (int e = 0; e < RE; e++) expert_free(&ex[e]);
    pf_cpu_destroy(c);
}

int main(int argc, char **argv) {
    int quick = 0;
    uint64_t seed = 1;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc)
            seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [--quick] [--seed N]\n", argv[0]);
            return 2;
        }
    }
    if (seed == 0) seed = 1;
    printf("cpu_stress: best level %s\n", pf_cpu_level_name(pf_cpu_detect()));
    phase_api();
    printf("api: %d passed, %d failed\n", passed, failed);
    phase_levels(quick, seed);
    printf("levels: %d passed, %d failed\n", passed, failed);
    phase_batch(quick, seed);
    printf("batch: %d passed, %d failed\n", passed, failed);
    phase_pool(quick, seed);
    printf("pool: %d passed, %d failed\n", passed, failed);
    phase_shared(quick, seed);
    printf("shared: %d passed, %d failed\n", passed, failed);
    phase_layer(quick, seed);
    printf("layer: %d passed, %d failed\n", passed, failed);
    phase_relay(quick, seed);
    return report("cpu_stress");
}
