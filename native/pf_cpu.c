/*
 * pf_cpu.c: the CPU expert kernel (see pf_cpu.h for the API and its rules).
 *
 * Layout of the work:
 *   phase 0   (all threads; the calling thread alone for up to PREPARE_INLINE_ROWS rows)
 *             x -> the token rows in the order the gate_up kernel reads them: float32 (the
 *             MXFP4 float32 kernels: nibble-major within 32- or 128-element groups, so no
 *             shuffle is needed per group) or bf16 (the bf16 kernel, mx_pos_bf16).
 *   phase 1   (all threads) the threads claim grabs of gate_up outputs, compute them for all
 *             tokens into gu, add the bias and apply the clamped SwiGLU to their pairs,
 *             writing h (in the kernel order of the down weights). Row formats (Qwen3-MoE):
 *             a grab of outputs [lo, hi) of 2I is the pairs [lo/2, hi/2): gate rows and the up
 *             rows I further on, then SiLU(gate) * up.
 *   phase 2   (all threads) the same over out's features.
 * Grabs are whole "units" (4 rows for MXFP4 and row formats, 32 columns for dense weights), so
 * gate / up pairs never straddle two threads.
 *
 * Kernels per level are selected once at create time through function pointers; the
 * vector variants are compiled with per-function target attributes, so one build runs on
 * every x86-64 CPU and the level is chosen at run time. Other architectures get the
 * portable kernels only.
 */
#define _GNU_SOURCE
#include "pf_cpu.h"
#include "pf_simd.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#if PF_X86
#include <cpuid.h>
#endif
#if PF_X86 && !defined(PF_AMX_EMULATE)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define ALIGN 64
#define MX_UNIT 4   /* rows per MXFP4 unit */
#ifndef MX_SUPER
#define MX_SUPER 8  /* AVX-512: rows per block that all token pairs pass over before the next */
#endif
#define DN_UNIT 32  /* columns per dense unit */
#define AMX_MIN_TOKENS 4 /* fewer tokens per expert: the AVX-512 bf16 kernel (measured, one thread, 2880 x 5760:
                          * AMX 1.44-1.52 ms for any T, AVX-512 1.18 / 1.45 / 1.74 ms at T = 2 / 3 / 4) */
#define PREPARE_INLINE_ROWS 16 /* calls with at most this many token rows prepare them on the calling thread */
#ifndef POOL_LINES
#define POOL_LINES 0 /* 1: the pool's shared words (and each thread's join times) on cache lines of their own;
                      * a compile-time variant of benchmarks/kernel_sweep.sh, not yet measured on a many-core host */
#endif
#if POOL_LINES
#define POOL_LINE _Alignas(ALIGN)
#else
#define POOL_LINE
#endif
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8 /* MXFP4 kernels: prefetch the rows this many rows ahead (measured best of 4, 8, 16) */
#endif
#ifndef GRAB_SHARE
#define GRAB_SHARE 1 /* a grab takes 1 / (GRAB_SHARE x threads) of a phase's unclaimed units (grab_size); with
                      * GRAB_STREAM 1, one 13 MB expert at 16 threads took 0.155 / 0.177 ms against 2's 0.180 /
                      * 0.210 in two runs (H100 hosts, benchmarks/kernel_sweep.sh), 4 experts 0.53 / 0.60 ms
                      * against 0.53 / 0.63 */
#endif
#ifndef GRAB_MAX
#define GRAB_MAX 64 /* units a guided grab takes at most */
#endif
#ifndef GRAB_FIRST
#define GRAB_FIRST 0 /* percent of a phase's units handed out first in equal grabs, one a thread (0: every grab guided) */
#endif
#ifndef GRAB_STREAM
#define GRAB_STREAM 1 /* 1: each grab of MXFP4 rows is a prefetch stream of its own: its first PREFETCH_ROWS rows
                       * are prefetched as it starts, and the bf16 kernel prefetches nothing past its last row
                       * (0: a grab's first rows come on demand, its prefetches run on into the rows other threads
                       * grab) */
#endif

static const float FP4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* FP4 as bf16 bit patterns, written twice (vpermw indexes 32 entries) */
static const uint16_t FP4_BF16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0, 0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

/* E8M0 scale s -> 2^(s-127). 2^128 (s = 255) is not a float: its table entry is 2^127 and
 * the kernels multiply by 2 once more, so w = value * 2^128 as the reference computes it. */
static float SCALE[256];
static float FP8_E4M3[256]; /* float8_e4m3fn code -> its value (the two NaN codes: NaN) */
static pthread_once_t scale_once = PTHREAD_ONCE_INIT;
static void init_scale(void) {
    for (int s = 0; s < 256; s++) SCALE[s] = ldexpf(1.0f, (s == 255 ? 254 : s) - 127);
    for (int q = 0; q < 256; q++) {
        const int e = (q >> 3) & 15, m = q & 7;
        float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        FP8_E4M3[q] = q & 0x80 ? -v : v;
    }
}

/* float32 -> the nearest bfloat16 (ties to even), returned as float32; NaN stays NaN */
static inline float round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline int is_rows(int fmt) { return fmt >= PF_CPU_F32_ROWS && fmt <= PF_CPU_FP8_ROWS; }

/* One matrix of a row format (pf_cpu_weights' gate_up or down, with its scales): nrows rows of
 * `in` elements, output-major. */
typedef struct rows_w {
    const void *w;
    const uint8_t *scales; /* FP8: [nrows / block][in / block] of sfmt */
    int fmt, sfmt, block, in, round; /* round: round each weight to bf16 (a bf16 model's weights) */
} rows_w;

/* scale j of the scale row serving weight row r (FP8) */
static inline float rows_scale_at(const rows_w *m, int r, int j) {
    const size_t i = (size_t)(r / m->block) * (size_t)(m->in / m->block) + (size_t)j;
    return m->sfmt == PF_CPU_BF16 ? pf_bf16_to_f32(((const uint16_t *)m->scales)[i]) : ((const float *)m->scales)[i];
}

static inline float rows_scale(const rows_w *m, int r, int k) { return rows_scale_at(m, r, k / m->block); }

static inline size_t rows_esize(const rows_w *m) { return m->fmt == PF_CPU_F32_ROWS ? 4 : m->fmt == PF_CPU_BF16_ROWS ? 2 : 1; }

/* rows r .. r + n - 1 of m (those past r_end - 1 clamped to it): their indices and first bytes */
static inline void rows_at(const rows_w *m, int r, int r_end, int n, int *rr, const uint8_t **rp) {
    const size_t esize = rows_esize(m);
    for (int k = 0; k < n; k++) {
        rr[k] = r + k < r_end ? r + k : r_end - 1;
        rp[k] = (const uint8_t *)m->w + (size_t)rr[k] * (size_t)m->in * esize;
    }
}

/* How far ahead rows r .. r + n - 1 ask for their next lines (prefetch_ahead): PREFETCH_ROWS rows
 * on, while the range has rows there (0: the lines being read). */
static inline size_t rows_ahead(const rows_w *m, int r, int r_end, int n) {
    return r + n + PREFETCH_ROWS <= r_end ? (size_t)PREFETCH_ROWS * (size_t)m->in * rows_esize(m) : 0;
}

/* the columns that share one scale (FP8: a block; other formats: the whole row) */
static inline int rows_span(const rows_w *m) { return m->fmt == PF_CPU_FP8_ROWS ? m->block : m->in; }

/* FP8: the scales of column span j of rows rr[0 .. n), times 2^8 (the float16 route's factor);
 * other formats: zeros (unused) */
static inline void rows_span_scales(const rows_w *m, const int *rr, int n, int j, float *sc) {
    for (int k = 0; k < n; k++) sc[k] = m->fmt == PF_CPU_FP8_ROWS ? rows_scale_at(m, rr[k], j) * 256.0f : 0.0f;
}

/* weight (r, k) as the model computes with it */
static inline float rows_weight(const rows_w *m, int r, int k) {
    const size_t i = (size_t)r * (size_t)m->in + (size_t)k;
    float v;
    if (m->fmt == PF_CPU_BF16_ROWS) return pf_bf16_to_f32(((const uint16_t *)m->w)[i]);
    if (m->fmt == PF_CPU_FP8_ROWS) v = FP8_E4M3[((const uint8_t *)m->w)[i]] * rows_scale(m, r, k);
    else v = ((const float *)m->w)[i];
    return m->round ? round_bf16(v) : v;
}

static inline float load_elem(const void *p, int fmt, size_t i) {
    return fmt == PF_CPU_BF16 ? pf_bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* position of element j of an MXFP4-ordered row: [even | odd] within each group of 32 */
static inline size_t mx_pos(size_t j) {
    return (j & ~(size_t)31) + ((j & 1) ? 16 : 0) + ((j & 31) >> 1);
}

/* The AVX-512 kernels read four groups (128 elements, 64 bytes) at once as 16 dwords: nibble
 * k of dword i is element 8i + k, so the first in/128*128 elements of a row are kept in
 * chunks of 128 as [k][i] (element 8i + k at 16k + i); the rest per group as mx_pos. */
static inline size_t mx_pos_chunked(size_t j, size_t in) {
    if (j < in / 128 * 128) {
        size_t e = j & 127;
        return (j & ~(size_t)127) + (e & 7) * 16 + (e >> 3);
    }
    return mx_pos(j);
}

/* The bf16 kernel's order: per chunk of 128 elements, element 4j + k at 32k + j (rows zero
 * padded to whole chunks, pad128). */
static inline size_t mx_pos_bf16(size_t j) { return (j & ~(size_t)127) + (j & 3) * 32 + ((j & 127) >> 2); }
static inline size_t pad128(size_t n) { return (n + 127) / 128 * 128; }

/* ---- kernel signatures ---------------------------------------------------------------
 * mx_rows: y[t*ys + r] = sum_k W[r][k] x[t][k] for rows r in [r0, r1), tokens 0..T-1.
 *   blocks/scales: the MXFP4 rows of W (nrows rows of `in` elements, in % 32 == 0);
 *   xp: T rows of `in` floats in MXFP4 order.
 * dense_cols: y[t*ys + c] = sum_k x[t][k] W[k][c] for columns c in [c0, c1);
 *   W [in][ncols] in fmt (PF_CPU_F32 / PF_CPU_BF16); x: T rows of `in` floats.
 * mx_rows_bf16 (optional): as mx_rows, xp given as T rows of pad128(in) bf16 in the order of
 *   mx_pos_bf16, the padding zero. */
typedef void (*mx_rows_fn)(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                           const float *xp, int T, float *y, int ys);
typedef void (*mx_rows_bf16_fn)(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                                const uint16_t *xp, int T, float *y, int ys);
typedef void (*dense_cols_fn)(const void *w, int fmt, int in, int ncols, int c0, int c1, const float *x, int T,
                              float *y, int ys);
/* dense_rows: y[t*ys + r] = sum_k W[r][k] x[t][k] for rows r in [r0, r1) of a row-format matrix
 *   (rows_w); x: T rows of m->in floats. */
typedef void (*dense_rows_fn)(const rows_w *m, int r0, int r1, const float *x, int T, float *y, int ys);
/* the row formats on AMX tiles: x as bf16 B tiles (amx_pos_rows) */
typedef void (*dense_rows_amx_fn)(const rows_w *m, int r0, int r1, const uint16_t *xb, int T, float *y, int ys);

/* ---- portable kernels ---------------------------------------------------------------- */
static void mx_rows_scalar(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                           const float *xp, int T, float *y, int ys) {
    const int G = in / 32;
    (void)nrows;
    for (int r = r0; r < r1; r++) {
        float acc[PF_CPU_MAX_TOKENS] = {0};
        const uint8_t *b = blocks + (size_t)r * G * 16;
        const uint8_t *s = scales + (size_t)r * G;
        for (int g = 0; g < G; g++) {
            float sc = SCALE[s[g]];
            float two = s[g] == 255 ? 2.0f : 1.0f;
            float wl[16], wh[16];
            for (int j = 0; j < 16; j++) {
                uint8_t v = b[g * 16 + j];
                wl[j] = FP4[v & 15] * sc * two;
                wh[j] = FP4[v >> 4] * sc * two;
            }
            for (int t = 0; t < T; t++) {
                const float *xg = xp + (size_t)t * in + (size_t)g * 32;
                float a = 0.0f;
                for (int j = 0; j < 16; j++) a += wl[j] * xg[j] + wh[j] * xg[16 + j];
                acc[t] += a;
            }
        }
        for (int t = 0; t < T; t++) y[(size_t)t * ys + r] = acc[t];
    }
}

static void dense_cols_scalar(const void *w, int fmt, int in, int ncols, int c0, int c1, const float *x, int T,
                              float *y, int ys) {
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)t * ys;
        for (int c = c0; c < c1; c++) yt[c] = 0.0f;
        for (int k = 0; k < in; k++) {
            float xk = x[(size_t)t * in + k];
            size_t base = (size_t)k * ncols;
            if (fmt == PF_CPU_BF16) {
                const uint16_t *wr = (const uint16_t *)w + base;
                for (int c = c0; c < c1; c++) yt[c] += xk * pf_bf16_to_f32(wr[c]);
            } else {
                const float *wr = (const float *)w + base;
                for (int c = c0; c < c1; c++) yt[c] += xk * wr[c];
            }
        }
    }
}

static void dense_rows_scalar(const rows_w *m, int r0, int r1, const float *x, int T, float *y, int ys) {
    const int in = m->in;
    float wb[64];
    for (int r = r0; r < r1; r++) {
        float acc[PF_CPU_MAX_TOKENS] = {0};
        for (int k0 = 0; k0 < in; k0 += 64) {
            const int n = in - k0 < 64 ? in - k0 : 64;
            for (int j = 0; j < n; j++) wb[j] = rows_weight(m, r, k0 + j);
            for (int t = 0; t < T; t++) {
                const float *xt = x + (size_t)t * in + k0;
                float a = 0.0f;
                for (int j = 0; j < n; j++) a += wb[j] * xt[j];
                acc[t] += a;
            }
        }
        for (int t = 0; t < T; t++) y[(size_t)t * ys + r] = acc[t];
    }
}

/* sum of the 64-bit words of [p, p + n) (n a multiple of 8) */
typedef uint64_t (*read_fn)(const uint8_t *p, size_t n);

static uint64_t read_scalar(const uint8_t *p, size_t n) {
    uint64_t a = 0, b = 0;
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        uint64_t x, y;
        memcpy(&x, p + i, 8);
        memcpy(&y, p + i + 8, 8);
        a += x;
        b += y;
    }
    for (; i + 8 <= n; i += 8) {
        uint64_t x;
        memcpy(&x, p + i, 8);
        a += x;
    }
    return a + b;
}

/* A kernel reads R rows side by side, each a short stream (1440 bytes for gpt-oss) that
 * ends before the hardware prefetchers have followed it, so the kernels ask for the rows
 * they read next themselves: `ahead` bytes past p (the same chunk PREFETCH_ROWS rows on; rows
 * are contiguous in the store). A prefetch never faults, also past the end of the weights.
 * Into L2, not L1 (locality 2: prefetcht1): on the H200 host's Xeon, in two passes, a 4-expert
 * 1-token call read 66 % of the DRAM rate against 58-59 % with prefetcht0, and one thread 7.2-8.4
 * GB/s against 6.0-6.8; t2 was in between, nta 2-4x slower (benchmarks/bench_cpu_experts.py). */
static inline void prefetch_ahead(const uint8_t *p, size_t ahead) {
    __builtin_prefetch((const void *)((uintptr_t)p + ahead), 0, 2);
}

#if PF_X86
/* ---- AVX2 + FMA ---------------------------------------------------------------------- */
#define T_AVX2 __attribute__((target("avx2,fma")))
#define INL static inline __attribute__((always_inline))

/* 8 codes (int32 lanes, 0..15) -> their E2M1 values: magnitude from the low 3 bits, sign bit 3 */
T_AVX2 INL __m256 fp4_avx2(__m256i code, __m256 mag_lut) {
    __m256 mag = _mm256_permutevar8x32_ps(mag_lut, code);
    __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(mag, _mm256_castsi256_ps(sign));
}

/* 2 rows (the second clamped to the last row) x TG tokens; results for rows < r_end */
T_AVX2 INL void mx_block_avx2(const uint8_t *blocks, const uint8_t *scales, int in, int r, int r_end,
                              const float *xp, int t0, const int TG, float *y, int ys) {
    const int G = in / 32;
    const __m256 lut = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    const __m256i m4 = _mm256_set1_epi32(15);
    const uint8_t *bp[2], *sp[2];
    for (int k = 0; k < 2; k++) {
        int rr = r + k < r_end ? r + k : r_end - 1;
        bp[k] = blocks + (size_t)rr * G * 16;
        sp[k] = scales + (size_t)rr * G;
    }
    __m256 acc[2][4];
#pragma GCC unroll 8
    for (int k = 0; k < 2; k++)
#pragma GCC unroll 8
        for (int t = 0; t < TG; t++) acc[k][t] = _mm256_setzero_ps();
    const float *x0 = xp + (size_t)t0 * in;
    for (int g = 0; g < G; g++) {
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m256 wl[2], wh[2];
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {
                uint8_t s = sp[k][g];
                __m256 sc = _mm256_set1_ps(SCALE[s] * (s == 255 ? 2.0f : 1.0f));
                __m256i code = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bp[k] + g * 16 + half * 8)));
                wl[k] = _mm256_mul_ps(fp4_avx2(_mm256_and_si256(code, m4), lut), sc);
                wh[k] = _mm256_mul_ps(fp4_avx2(_mm256_srli_epi32(code, 4), lut), sc);
            }
#pragma GCC unroll 8
            for (int t = 0; t < TG; t++) {
                const float *xg = x0 + (size_t)t * in + (size_t)g * 32 + half * 8;
                __m256 xe = _mm256_loadu_ps(xg), xo = _mm256_loadu_ps(xg + 16);
#pragma GCC unroll 2
                for (int k = 0; k < 2; k++) {
                    acc[k][t] = _mm256_fmadd_ps(wl[k], xe, acc[k][t]);
                    acc[k][t] = _mm256_fmadd_ps(wh[k], xo, acc[k][t]);
                }
            }
        }
    }
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        if (r + k >= r_end) break;
#pragma GCC unroll 8
        for (int t = 0; t < TG; t++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[k][t]), _mm256_extractf128_ps(acc[k][t], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
            y[(size_t)(t0 + t) * ys + r + k] = _mm_cvtss_f32(v);
        }
    }
}

T_AVX2 static void mx_rows_avx2(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                                const float *xp, int T, float *y, int ys) {
    (void)nrows;
    for (int r = r0; r < r1; r += 2) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: mx_block_avx2(blocks, scales, in, r, r1, xp, t0, 4, y, ys); break;
            case 3: mx_block_avx2(blocks, scales, in, r, r1, xp, t0, 3, y, ys); break;
            case 2: mx_block_avx2(blocks, scales, in, r, r1, xp, t0, 2, y, ys); break;
            default: mx_block_avx2(blocks, scales, in, r, r1, xp, t0, 1, y, ys); break;
            }
        }
    }
}

T_AVX2 INL __m256 load8_avx2(const void *w, int fmt, size_t i) {
    if (fmt == PF_CPU_BF16) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* 16 columns [c, c+16) x TG tokens */
T_AVX2 INL void dense_block_avx2(const void *w, int fmt, int in, int ncols, int c, const float *x, int t0,
                                 const int TG, float *y, int ys) {
    __m256 acc[4][2];
#pragma GCC unroll 8
    for (int t = 0; t < TG; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int k = 0; k < in; k++) {
        size_t base = (size_t)k * ncols + c;
        __m256 w0 = load8_avx2(w, fmt, base), w1 = load8_avx2(w, fmt, base + 8);
#pragma GCC unroll 8
        for (int t = 0; t < TG; t++) {
            __m256 xb = _mm256_broadcast_ss(x + (size_t)(t0 + t) * in + k);
            acc[t][0] = _mm256_fmadd_ps(w0, xb, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, xb, acc[t][1]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TG; t++) {
        _mm256_storeu_ps(y + (size_t)(t0 + t) * ys + c, acc[t][0]);
        _mm256_storeu_ps(y + (size_t)(t0 + t) * ys + c + 8, acc[t][1]);
    }
}

T_AVX2 static void dense_cols_avx2(const void *w, int fmt, int in, int ncols, int c0, int c1, const float *x, int T,
                                   float *y, int ys) {
    int c = c0;
    for (; c + 16 <= c1; c += 16) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: dense_block_avx2(w, fmt, in, ncols, c, x, t0, 4, y, ys); break;
            case 3: dense_block_avx2(w, fmt, in, ncols, c, x, t0, 3, y, ys); break;
            case 2: dense_block_avx2(w, fmt, in, ncols, c, x, t0, 2, y, ys); break;
            default: dense_block_avx2(w, fmt, in, ncols, c, x, t0, 1, y, ys); break;
            }
        }
    }
    if (c < c1) dense_cols_scalar(w, fmt, in, ncols, c, c1, x, T, y, ys);
}

T_AVX2 static uint64_t read_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        a0 = _mm256_add_epi64(a0, _mm256_loadu_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, a);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3] + read_scalar(p + i, n - i);
}

/* Row formats (see rows_load512): 8 weights of one row, columns [k, k + 8), all present */
#define T_AVX2H __attribute__((target("avx2,fma,f16c")))
T_AVX2H INL __m256 rows_load_avx2(const rows_w *m, const uint8_t *row, int k, float sc) {
    __m256 v;
    if (m->fmt == PF_CPU_BF16_ROWS) {
        __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
    } else if (m->fmt == PF_CPU_FP8_ROWS) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(row + k));
        __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16((short)0xbfff));
        v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(sc));
        __m128i nan8 = _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
        __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(nan8));
        v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
    } else {
        v = _mm256_loadu_ps((const float *)row + k);
    }
    if (m->round) {
        __m256i u = _mm256_castps_si256(v);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
        r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
        v = _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    return v;
}

/* 2 rows (the second clamped to r_end - 1) x TG tokens, over whole 8-weight chunks; `in` % 8 == 0 */
T_AVX2H INL void rows_block_avx2(const rows_w *m, int r, int r_end, const float *x, int t0, const int TG, float *y,
                                 int ys) {
    const int in = m->in;
    const uint8_t *rp[2];
    int rr[2];
    rows_at(m, r, r_end, 2, rr, rp);
    const size_t esz = rows_esize(m), ahead = rows_ahead(m, r, r_end, 2);
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++)
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) acc[k][t] = _mm256_setzero_ps();
    const int span = rows_span(m);
    for (int c0 = 0, j = 0; c0 < in; c0 += span, j++) {
        float sc[2];
        rows_span_scales(m, rr, 2, j, sc);
        for (int c = c0; c < c0 + span; c += 8) {
            __m256 wv[2];
#pragma GCC unroll 2
            for (int k = 0; k < 2; k++) {
                if (((c * (int)esz) & 63) == 0) prefetch_ahead(rp[k] + (size_t)c * esz, ahead);
                wv[k] = rows_load_avx2(m, rp[k], c, sc[k]);
            }
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) {
                const __m256 xv = _mm256_loadu_ps(x + (size_t)(t0 + t) * in + c);
#pragma GCC unroll 2
                for (int k = 0; k < 2; k++) acc[k][t] = _mm256_fmadd_ps(wv[k], xv, acc[k][t]);
            }
        }
    }
#pragma GCC unroll 2
    for (int k = 0; k < 2; k++) {
        if (r + k >= r_end) break;
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[k][t]), _mm256_extractf128_ps(acc[k][t], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
            y[(size_t)(t0 + t) * ys + r + k] = _mm_cvtss_f32(v);
        }
    }
}

/* rows of a length that is not whole 8-weight chunks, and FP8 blocks that are not, take the portable kernel */
T_AVX2H static void dense_rows_avx2(const rows_w *m, int r0, int r1, const float *x, int T, float *y, int ys) {
    if (m->in % 8 || (m->fmt == PF_CPU_FP8_ROWS && m->block % 8)) {
        dense_rows_scalar(m, r0, r1, x, T, y, ys);
        return;
    }
    for (int r = r0; r < r1; r += 2) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: rows_block_avx2(m, r, r1, x, t0, 4, y, ys); break;
            case 3: rows_block_avx2(m, r, r1, x, t0, 3, y, ys); break;
            case 2: rows_block_avx2(m, r, r1, x, t0, 2, y, ys); break;
            default: rows_block_avx2(m, r, r1, x, t0, 1, y, ys); break;
            }
        }
    }
}


/* ---- AVX-512 ------------------------------------------------------------------------- */
#define T_512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define T_BF16 __attribute__((target("avx512f,avx512bf16,avx512vl,avx512bw,avx2,fma")))

/* one group (16 bytes = 32 codes) of one row -> w_lo (even elements), w_hi (odd elements) */
T_512 INL void mx_decode512(const uint8_t *b, uint8_t s, __m512 lut, __m512 *wl, __m512 *wh) {
    __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    __m512 sc = _mm512_set1_ps(SCALE[s]);
    __m512 lo = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_and_si512(code, _mm512_set1_epi32(15)), lut), sc);
    __m512 hi = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(code, 4), lut), sc);
    if (__builtin_expect(s == 255, 0)) {
        lo = _mm512_mul_ps(lo, _mm512_set1_ps(2.0f));
        hi = _mm512_mul_ps(hi, _mm512_set1_ps(2.0f));
    }
    *wl = lo;
    *wh = hi;
}

/* The four E8M0 scales of a chunk (s4: their bytes, group 0 lowest) as 16 float lanes (lane i: group i / 4). Scales 1..254 are
 * float exponents as they are; 0 (2^-127, subnormal) and 255 (2^128, past float) are taken
 * from the table with a second factor of 2 for 255, as the reference computes them. */
T_512 INL __m512 chunk_scales512(uint32_t s4) {
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    __m512i s = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)s4), shift), _mm512_set1_epi32(255));
    uint32_t n = ~s4;
    uint32_t has0 = (s4 - 0x01010101u) & ~s4 & 0x80808080u;
    uint32_t has255 = (n - 0x01010101u) & ~n & 0x80808080u;
    if (__builtin_expect((has0 | has255) == 0, 1)) return _mm512_castsi512_ps(_mm512_slli_epi32(s, 23));
    __m512 v = _mm512_i32gather_ps(s, SCALE, 4);
    __mmask16 m255 = _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255));
    return _mm512_mask_mul_ps(v, m255, v, _mm512_set1_ps(2.0f));
}

/* every scale byte of rows [r, r + rows) in lo .. hi (64 bytes a compare: s - lo wraps the bytes
 * below lo past hi - lo) */
T_512 static int scales_within(const uint8_t *scales, int G, int r, int rows, int lo, int hi) {
    const uint8_t *s = scales + (size_t)r * G;
    const size_t n = (size_t)rows * G;
    const __m512i low = _mm512_set1_epi8((char)lo), span = _mm512_set1_epi8((char)(hi - lo));
    for (size_t i = 0; i < n; i += 64) {
        const __mmask64 m = n - i >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (n - i)) - 1;
        const __m512i v = _mm512_sub_epi8(_mm512_maskz_loadu_epi8(m, s + i), low);
        if (_mm512_mask_cmpgt_epu8_mask(m, v, span)) return 0;
    }
    return 1;
}

/* chunk_scales512 for scales 1 .. 254 (each the float exponent as it is), read from p: a
 * broadcast load, a byte shuffle (byte g into 128-bit lane g's dwords) and a shift; no scalar
 * work, which chunk_scales512 spends on the two scales outside that range */
T_512 INL __m512 chunk_scales_plain(const uint8_t *p) {
    int32_t s4;
    memcpy(&s4, p, 4);
    const int g0 = (int)0x80808000, g1 = (int)0x80808001, g2 = (int)0x80808002, g3 = (int)0x80808003;
    const __m512i pick = _mm512_set_epi32(g3, g3, g3, g3, g2, g2, g2, g2, g1, g1, g1, g1, g0, g0, g0, g0);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(s4), pick), 23));
}

/* R rows (clamped to the last) x TG tokens over rows in the chunked order: per chunk, each
 * lane's unscaled products are summed over its 8 nibbles, then scaled once (an exact power
 * of two) into the accumulator; the last in % 128 elements go group by group. */
T_512 INL void mx_block512c(const uint8_t *blocks, const uint8_t *scales, int in, int r, int r_end,
                            const float *xp, int t0, const int R, const int TG, float *y, int ys) {
    const int G = in / 32, C = in / 128;
    const __m512 lut = _mm512_loadu_ps(FP4);
    const uint8_t *bp[4], *sp[4];
    for (int k = 0; k < R; k++) {
        int rr = r + k < r_end ? r + k : r_end - 1;
        bp[k] = blocks + (size_t)rr * G * 16;
        sp[k] = scales + (size_t)rr * G;
    }
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int k = 0; k < R; k++)
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) acc[k][t] = _mm512_setzero_ps();
    const float *x0 = xp + (size_t)t0 * in;
    const size_t ahead = (size_t)PREFETCH_ROWS * G * 16;
    for (int c = 0; c < C; c++) {
        __m512i v[4];
        __m512 p[4][4];
#pragma GCC unroll 4
        for (int k = 0; k < R; k++) v[k] = _mm512_loadu_si512((const void *)(bp[k] + (size_t)c * 64));
#pragma GCC unroll 4
        for (int k = 0; k < R; k++) prefetch_ahead(bp[k] + (size_t)c * 64, ahead);
#pragma GCC unroll 8
        for (int n = 0; n < 8; n++) {
            __m512 xv[4];
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) xv[t] = _mm512_loadu_ps(x0 + (size_t)t * in + (size_t)c * 128 + n * 16);
#pragma GCC unroll 4
            for (int k = 0; k < R; k++) {
                __m512 w = _mm512_permutexvar_ps(n ? _mm512_srli_epi32(v[k], 4 * n) : v[k], lut);
#pragma GCC unroll 4
                for (int t = 0; t < TG; t++) p[k][t] = n ? _mm512_fmadd_ps(w, xv[t], p[k][t]) : _mm512_mul_ps(w, xv[t]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < R; k++) {
            uint32_t s4;
            memcpy(&s4, sp[k] + (size_t)c * 4, 4);
            __m512 sc = chunk_scales512(s4);
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) acc[k][t] = _mm512_fmadd_ps(p[k][t], sc, acc[k][t]);
        }
    }
    for (int g = C * 4; g < G; g++) {
#pragma GCC unroll 4
        for (int k = 0; k < R; k++) {
            __m512 wl, wh;
            mx_decode512(bp[k] + g * 16, sp[k][g], lut, &wl, &wh);
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) {
                const float *xg = x0 + (size_t)t * in + (size_t)g * 32;
                acc[k][t] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xg), acc[k][t]);
                acc[k][t] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xg + 16), acc[k][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int k = 0; k < R; k++) {
        if (r + k >= r_end) break;
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) y[(size_t)(t0 + t) * ys + r + k] = _mm512_reduce_add_ps(acc[k][t]);
    }
}

/* xp in the chunked order (mx_pos_chunked). Tokens go in pairs with 4 rows sharing each
 * token load (measured faster than 2 rows x 4 tokens, which needs more live registers). */
T_512 static void mx_rows_512(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                              const float *xp, int T, float *y, int ys) {
    (void)nrows;
    const int RB = MX_SUPER; /* rows whose weights stay in L1 while every token pair passes over them */
    for (int rb = r0; rb < r1; rb += RB) {
        int re = rb + RB < r1 ? rb + RB : r1;
        for (int t0 = 0; t0 < T; t0 += 2) {
            for (int r = rb; r < re; r += 4) {
                if (T - t0 >= 2)
                    mx_block512c(blocks, scales, in, r, re, xp, t0, 4, 2, y, ys);
                else
                    mx_block512c(blocks, scales, in, r, re, xp, t0, 4, 1, y, ys);
            }
        }
    }
}

/* One chunk (64 bytes, 128 weights) of 4 rows: vv their bytes, sc their scales, x0 the tokens. */
T_BF16 INL void bf16_chunk(__m512 acc[4][4], const __m512i vv[4], const __m512 sc[4], __m512i tab, const uint16_t *x0,
                           int xs, int c, const int TG) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __m512i v = vv[k];
        __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(v, tab);
        __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
        __m512bh w2 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab);
        __m512bh w3 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab);
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) {
            const uint16_t *xc = x0 + (size_t)t * xs + (size_t)c * 128;
            __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), w0, (__m512bh)_mm512_loadu_si512((const void *)xc));
            p = _mm512_dpbf16_ps(p, w1, (__m512bh)_mm512_loadu_si512((const void *)(xc + 32)));
            p = _mm512_dpbf16_ps(p, w2, (__m512bh)_mm512_loadu_si512((const void *)(xc + 64)));
            p = _mm512_dpbf16_ps(p, w3, (__m512bh)_mm512_loadu_si512((const void *)(xc + 96)));
            acc[k][t] = _mm512_fmadd_ps(p, sc[k], acc[k][t]);
        }
    }
}

/* bf16 dot products over whole 64-byte chunks (4 groups, 128 elements) of a row. The 16-bit
 * lane j of a chunk holds bytes 2j and 2j + 1, i.e. elements 4j .. 4j + 3, one nibble each;
 * vpermw looks a nibble up in a table of the 16 E2M1 values as bf16 (exact: at most 2
 * significant bits) using the lane's low 5 bits, so with the table written twice no mask is
 * needed: lane j of w_k = element 4j + k. x is kept in the same order (mx_pos_bf16), zero
 * padded to whole chunks. Every 128-bit lane of a chunk is one group, so each float32 lane
 * of the dot products sums one group's unscaled products and is then scaled once (an exact
 * power of two) into the accumulator. R = 4 rows (clamped to the last) x TG tokens. The whole
 * chunks run in one of two loops, chosen once per block of rows: scales 1 .. 254 as float
 * exponents (chunk_scales_plain), or any scale (chunk_scales512); then a last chunk of 1 .. 3
 * groups, if the row has one. */
T_BF16 INL void mx_block_bf16(const uint8_t *blocks, const uint8_t *scales, int in, int r, int r_end,
                              const uint16_t *xp, int t0, const int TG, float *y, int ys) {
    const int G = in / 32, C = (in + 127) / 128, xs = C * 128;
    const int tail = G - 4 * (C - 1); /* groups in the last chunk, 1..4 */
    const int full = tail == 4 ? C : C - 1;
    const __m512i tab = _mm512_loadu_si512((const void *)FP4_BF16);
    const uint8_t *bp[4], *sp[4];
    for (int k = 0; k < 4; k++) {
        int rr = r + k < r_end ? r + k : r_end - 1;
        bp[k] = blocks + (size_t)rr * G * 16;
        sp[k] = scales + (size_t)rr * G;
    }
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) acc[k][t] = _mm512_setzero_ps();
    const uint16_t *x0 = xp + (size_t)t0 * xs;
    const size_t ahead = !GRAB_STREAM || r + 4 + PREFETCH_ROWS <= r_end ? (size_t)PREFETCH_ROWS * G * 16 : 0;
    __m512i vv[4];
    __m512 sc[4];
    if (scales_within(scales, G, r, r_end - r < 4 ? r_end - r : 4, 1, 254)) {
        for (int c = 0; c < full; c++) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) vv[k] = _mm512_loadu_si512((const void *)(bp[k] + (size_t)c * 64));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) prefetch_ahead(bp[k] + (size_t)c * 64, ahead);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) sc[k] = chunk_scales_plain(sp[k] + (size_t)c * 4);
            bf16_chunk(acc, vv, sc, tab, x0, xs, c, TG);
        }
    } else {
        for (int c = 0; c < full; c++) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) vv[k] = _mm512_loadu_si512((const void *)(bp[k] + (size_t)c * 64));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) prefetch_ahead(bp[k] + (size_t)c * 64, ahead);
            for (int k = 0; k < 4; k++) {
                uint32_t s4;
                memcpy(&s4, sp[k] + (size_t)c * 4, 4);
                sc[k] = chunk_scales512(s4);
            }
            bf16_chunk(acc, vv, sc, tab, x0, xs, c, TG);
        }
    }
    if (full < C) { /* groups past the row's end: zero weights, scale 1 */
        const __mmask64 m = ((__mmask64)1 << (16 * tail)) - 1;
        for (int k = 0; k < 4; k++) {
            vv[k] = _mm512_maskz_loadu_epi8(m, bp[k] + (size_t)full * 64);
            uint32_t s4 = 0x7f7f7f7fu;
            for (int g = 0; g < tail; g++) s4 = (s4 & ~(0xffu << (8 * g))) | ((uint32_t)sp[k][full * 4 + g] << (8 * g));
            sc[k] = chunk_scales512(s4);
        }
        bf16_chunk(acc, vv, sc, tab, x0, xs, full, TG);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (r + k >= r_end) break;
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) y[(size_t)(t0 + t) * ys + r + k] = _mm512_reduce_add_ps(acc[k][t]);
    }
}

/* xp: T rows of pad128(in) bf16 in the order of mx_pos_bf16 */
T_BF16 static void mx_rows_bf16(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                                const uint16_t *xp, int T, float *y, int ys) {
    (void)nrows;
    for (int r = r0; r < r1; r += 4) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: mx_block_bf16(blocks, scales, in, r, r1, xp, t0, 4, y, ys); break;
            case 3: mx_block_bf16(blocks, scales, in, r, r1, xp, t0, 3, y, ys); break;
            case 2: mx_block_bf16(blocks, scales, in, r, r1, xp, t0, 2, y, ys); break;
            default: mx_block_bf16(blocks, scales, in, r, r1, xp, t0, 1, y, ys); break;
            }
        }
    }
}

/* ---- AMX: bf16 tiles, 16 weight rows x 16 tokens per tile of results ---------------------
 * Verify blocks and prefills pass several tokens over the same weights; the AVX-512 kernels
 * above pay every token's dot products (4 x vdpbf16ps per 128 weights), an AMX tile multiply
 * does 16 rows x 16 tokens x 32 weights in one instruction, so a call costs about what
 * decoding its weights costs, for 2 .. 16 tokens alike.
 *
 * A tiles: a chunk of 128 weights (4 groups) gives 4 tiles, tile k holding for 16 weight rows
 * the vpermw decode's register w_k as it comes: column 8j + m = element 4m + k of the chunk's
 * group j (a tile row mixes the 4 groups; the sum over columns does not care). Each weight
 * carries its group's E8M0 scale, added to the exponent of nonzero weights (exact for scales
 * 2 .. 252; a block of rows with another scale is computed by amx_rows_exact instead). Groups
 * past a row's end (the last chunk of 2880 = 22.5 chunks) decode to zero weights.
 * B tiles (the token rows, amx_pos): per chunk and k 16 rows of 64 bytes, row kp holding for
 * each token n the elements of columns 2kp and 2kp + 1 (the pair layout of tdpbf16ps). The
 * writers put zeros where the last chunk has no group (amx_zero_pad: 0 x NaN would poison the
 * sum); token columns past T are not written and their results not read. */
#ifdef PF_AMX_EMULATE
/* software tiles (native/stress/amx_check.c: the layout checked where no AMX runs) */
#define T_AMX T_512
static _Thread_local uint8_t amx_emu[8][16][64];
static inline void amx_emu_load(int t, const void *p, size_t stride) {
    for (int r = 0; r < 16; r++) memcpy(amx_emu[t][r], (const uint8_t *)p + r * stride, 64);
}
static inline void amx_emu_dp(int c, int a, int b) {
    float *acc = (float *)amx_emu[c];
    const uint16_t *A = (const uint16_t *)amx_emu[a], *B = (const uint16_t *)amx_emu[b];
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++)
            for (int kp = 0; kp < 16; kp++)
                for (int e = 0; e < 2; e++)
                    acc[m * 16 + n] += pf_bf16_to_f32(A[m * 32 + 2 * kp + e]) * pf_bf16_to_f32(B[kp * 32 + 2 * n + e]);
}
#define AMX_CONFIG(cfg) ((void)(cfg))
#define AMX_RELEASE() ((void)0)
#define AMX_ZERO(t) memset(amx_emu[t], 0, sizeof amx_emu[t])
#define AMX_LOAD(t, p, s) amx_emu_load(t, p, s)
#define AMX_DP(c, a, b) amx_emu_dp(c, a, b)
#define AMX_STORE(t, p, s) (memcpy((p), amx_emu[t], sizeof amx_emu[t]), (void)(s))
#else
#define T_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")))
#define AMX_CONFIG(cfg) _tile_loadconfig(cfg)
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#endif

/* the B-tile position of element e of token t (see above) */
static inline size_t amx_pos(size_t t, size_t e) {
    const size_t g = e / 32, q = e % 32, col = 8 * (g % 4) + q / 4;
    return (((g / 4) * 4 + q % 4) * 16 + col / 2) * 32 + 2 * t + (col & 1);
}
/* uint16 elements of a B-tile buffer for rows of `in` elements (whole chunks, 16 token columns) */
static inline size_t amx_elems(size_t in) { return (in + 127) / 128 * 2048; }
/* zeros at token t's positions of the last chunk's missing groups */
static inline void amx_zero_pad(uint16_t *xb, size_t in, size_t t) {
    for (size_t e = in; e < (in + 127) / 128 * 128; e++) xb[amx_pos(t, e)] = 0;
}

/* every scale byte of rows [r, r + rows) in 2 .. 252: a nonzero E2M1 value (bf16 exponent 126 ..
 * 129) times 2^(s - 127) keeps a normal exponent, so adding (s - 127) << 7 to its bits is the product */
T_512 static int rows_foldable(const uint8_t *scales, int G, int r, int rows) { return scales_within(scales, G, r, rows, 2, 252); }

/* (s_g - 127) << 7 in every 16-bit lane of 128-bit lane g (s4: the scale bytes, group 0 lowest) */
T_512 INL __m512i chunk_exponents(uint32_t s4) {
    const long long l0 = (long long)0x8000800080008000ULL, l1 = (long long)0x8001800180018001ULL;
    const long long l2 = (long long)0x8002800280028002ULL, l3 = (long long)0x8003800380038003ULL;
    const __m512i pick = _mm512_set_epi64(l3, l3, l2, l2, l1, l1, l0, l0);
    __m512i s = _mm512_shuffle_epi8(_mm512_set1_epi32((int)s4), pick); /* byte g of the lane, zero-extended */
    return _mm512_slli_epi16(_mm512_sub_epi16(s, _mm512_set1_epi16(127)), 7);
}

/* w's nonzero lanes times their group's scale by exponent addition (zeros of either sign stay) */
T_512 INL __m512i fold_scale(__m512i w, __m512i add) {
    return _mm512_mask_add_epi16(w, _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7fff)), w, add);
}

/* rows [r, r + rows) the portable way, x read from the B tiles: per group the products of the
 * scaled weights, then summed (what mx_rows_scalar computes, for scales the fold cannot take) */
static void amx_rows_exact(const uint8_t *blocks, const uint8_t *scales, int in, int r, int rows,
                           const uint16_t *xb, int T, float *y, int ys) {
    const int G = in / 32;
    for (int i = r; i < r + rows; i++) {
        const uint8_t *b = blocks + (size_t)i * G * 16, *s = scales + (size_t)i * G;
        for (int t = 0; t < T; t++) {
            float acc = 0.0f;
            for (int g = 0; g < G; g++) {
                const float sc = SCALE[s[g]] * (s[g] == 255 ? 2.0f : 1.0f);
                float a = 0.0f;
                for (int e = 0; e < 32; e++) {
                    const uint8_t v = b[g * 16 + e / 2];
                    a += FP4[(e & 1) ? v >> 4 : v & 15] * sc * pf_bf16_to_f32(xb[amx_pos((size_t)t, (size_t)g * 32 + e)]);
                }
                acc += a;
            }
            y[(size_t)t * ys + i] = acc;
        }
    }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* every tile 16 rows of 64 bytes (palette 1), the kernels' one shape; AMX_RELEASE() after */
T_AMX INL void amx_config_16x64(void) {
    amx_tilecfg cfg = {.palette = 1};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    AMX_CONFIG(&cfg);
}

/* xb: the B tiles of the T token rows (amx_pos), T <= 16 */
T_AMX static void mx_rows_amx(const uint8_t *blocks, const uint8_t *scales, int in, int nrows, int r0, int r1,
                              const uint16_t *xb, int T, float *y, int ys) {
    (void)nrows;
    const int G = in / 32, C = (in + 127) / 128, tail = G - 4 * (C - 1);
    const __m512i tab = _mm512_loadu_si512((const void *)FP4_BF16);
    const size_t ahead = (size_t)16 * G * 16; /* the same chunk of the next block of rows */
    _Alignas(64) uint16_t a[4][16 * 32];     /* the chunk's A tiles, w_0 .. w_3 of 16 rows */
    _Alignas(64) float cb[4][16 * 16];
    /* tiles 0-3: one accumulator per k (a single one would chain every multiply on the one
     * before: latency, not throughput, would bound the loop); 4, 5: A; 6, 7: B */
    amx_config_16x64();
    for (int rb = r0; rb < r1; rb += 16) {
        const int rows = r1 - rb < 16 ? r1 - rb : 16;
        if (!rows_foldable(scales, G, rb, rows)) {
            amx_rows_exact(blocks, scales, in, rb, rows, xb, T, y, ys);
            continue;
        }
        AMX_ZERO(0);
        AMX_ZERO(1);
        AMX_ZERO(2);
        AMX_ZERO(3);
        for (int c = 0; c < C; c++) {
            const int ng = c == C - 1 ? tail : 4;
            const __mmask64 m = ng == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * ng)) - 1;
            for (int i = 0; i < rows; i++) { /* A rows past `rows` keep stale values: their results are not read */
                const int rr = rb + i;
                const uint8_t *bp = blocks + (size_t)rr * G * 16 + (size_t)c * 64;
                const __m512i v = _mm512_maskz_loadu_epi8(m, bp);
                prefetch_ahead(bp, ahead);
                uint32_t s4 = 0x7f7f7f7fu; /* groups past the row's end: scale 1 against zero weights */
                memcpy(&s4, scales + (size_t)rr * G + (size_t)c * 4, (size_t)ng);
                const __m512i add = chunk_exponents(s4);
                _mm512_store_si512((void *)(a[0] + i * 32), fold_scale(_mm512_permutexvar_epi16(v, tab), add));
                _mm512_store_si512((void *)(a[1] + i * 32),
                                   fold_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab), add));
                _mm512_store_si512((void *)(a[2] + i * 32),
                                   fold_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab), add));
                _mm512_store_si512((void *)(a[3] + i * 32),
                                   fold_scale(_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab), add));
            }
            const uint16_t *bt = xb + (size_t)c * 4 * 512;
            AMX_LOAD(4, a[0], 64);
            AMX_LOAD(6, bt, 64);
            AMX_DP(0, 4, 6);
            AMX_LOAD(5, a[1], 64);
            AMX_LOAD(7, bt + 512, 64);
            AMX_DP(1, 5, 7);
            AMX_LOAD(4, a[2], 64);
            AMX_LOAD(6, bt + 1024, 64);
            AMX_DP(2, 4, 6);
            AMX_LOAD(5, a[3], 64);
            AMX_LOAD(7, bt + 1536, 64);
            AMX_DP(3, 5, 7);
        }
        AMX_STORE(0, cb[0], 64);
        AMX_STORE(1, cb[1], 64);
        AMX_STORE(2, cb[2], 64);
        AMX_STORE(3, cb[3], 64);
        for (int i = 0; i < rows; i++)
            for (int n = 0; n < T; n++) {
                const int q = i * 16 + n;
                y[(size_t)n * ys + rb + i] = (cb[0][q] + cb[1][q]) + (cb[2][q] + cb[3][q]);
            }
    }
    AMX_RELEASE();
}

T_512 INL __m512 load16_512(const void *w, int fmt, size_t i, __mmask16 m) {
    if (fmt == PF_CPU_BF16) {
        __m256i v = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

/* 32 columns [c, c + 32) (masked past c_end) x TG tokens */
T_512 INL void dense_block512(const void *w, int fmt, int in, int ncols, int c, int c_end, const float *x, int t0,
                              const int TG, float *y, int ys) {
    int n0 = c_end - c >= 16 ? 16 : c_end - c;
    int n1 = c_end - c - 16 >= 16 ? 16 : (c_end - c - 16 > 0 ? c_end - c - 16 : 0);
    __mmask16 m0 = (__mmask16)((1u << n0) - 1u), m1 = (__mmask16)((1u << n1) - 1u);
    __m512 acc[8][2];
#pragma GCC unroll 8
    for (int t = 0; t < TG; t++) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    for (int k = 0; k < in; k++) {
        size_t base = (size_t)k * ncols + c;
        __m512 w0 = load16_512(w, fmt, base, m0), w1 = load16_512(w, fmt, base + 16, m1);
#pragma GCC unroll 8
        for (int t = 0; t < TG; t++) {
            __m512 xb = _mm512_set1_ps(x[(size_t)(t0 + t) * in + k]);
            acc[t][0] = _mm512_fmadd_ps(w0, xb, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(w1, xb, acc[t][1]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < TG; t++) {
        _mm512_mask_storeu_ps(y + (size_t)(t0 + t) * ys + c, m0, acc[t][0]);
        _mm512_mask_storeu_ps(y + (size_t)(t0 + t) * ys + c + 16, m1, acc[t][1]);
    }
}

T_512 static void dense_cols_512(const void *w, int fmt, int in, int ncols, int c0, int c1, const float *x, int T,
                                 float *y, int ys) {
    for (int c = c0; c < c1; c += 32) {
        for (int t0 = 0; t0 < T; t0 += 8) {
            switch (T - t0 >= 8 ? 8 : T - t0) {
            case 8: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 8, y, ys); break;
            case 7: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 7, y, ys); break;
            case 6: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 6, y, ys); break;
            case 5: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 5, y, ys); break;
            case 4: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 4, y, ys); break;
            case 3: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 3, y, ys); break;
            case 2: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 2, y, ys); break;
            default: dense_block512(w, fmt, in, ncols, c, c1, x, t0, 1, y, ys); break;
            }
        }
    }
}
/* Row formats: 16 weights of one row, columns [k, k + 16) (`lanes` of them; the others zero), as
 * the model computes with them. FP8 through float16: the sign-extended code shifted left by 7 with
 * bit 14 cleared is a float16 worth 2^-8 of the code's value (subnormals included), so `sc` is the
 * block's scale times 2^8; the NaN codes (0x7F, 0xFF) are put back as NaN. */
/* float32 -> nearest bfloat16 (ties to even); a quiet NaN stays NaN, a signalling one (only ever
 * read from memory, never computed) would not: `unord` keeps NaNs as they are */
T_512 INL __m512 round512(__m512 v, int unord) {
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                    _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
    return unord ? _mm512_mask_mov_ps(_mm512_castsi512_ps(r), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v)
                 : _mm512_castsi512_ps(r);
}

T_512 INL __m512 rows_load512(const rows_w *m, const uint8_t *row, int k, __mmask16 lanes, float sc) {
    if (m->fmt == PF_CPU_BF16_ROWS) {
        __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)row + k);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (m->fmt == PF_CPU_FP8_ROWS) {
        __m128i b = _mm_maskz_loadu_epi8(lanes, row + k);
        __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16((short)0xbfff));
        __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(sc));
        if (m->round) v = round512(v, 0);
        __mmask16 nan = _mm_mask_cmpeq_epi8_mask(lanes, _mm_or_si128(b, _mm_set1_epi8((char)0x80)), _mm_set1_epi8((char)0xff));
        return nan ? _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(NAN)) : v;
    }
    __m512 v = _mm512_maskz_loadu_ps(lanes, (const float *)row + k);
    return m->round ? round512(v, 1) : v;
}

/* the row sums of acc (4 rows x TG tokens) into y, for the rows before r_end */
T_512 INL void rows_store512(__m512 acc[4][4], int r, int r_end, int t0, const int TG, float *y, int ys) {
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        if (r + k >= r_end) break;
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) y[(size_t)(t0 + t) * ys + r + k] = _mm512_reduce_add_ps(acc[k][t]);
    }
}

/* 4 rows (the last ones clamped to r_end - 1) x TG tokens */
T_512 INL void rows_block512(const rows_w *m, int r, int r_end, const float *x, int t0, const int TG, float *y,
                             int ys) {
    const int in = m->in;
    const uint8_t *rp[4];
    int rr[4];
    rows_at(m, r, r_end, 4, rr, rp);
    const size_t esz = rows_esize(m), ahead = rows_ahead(m, r, r_end, 4);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) acc[k][t] = _mm512_setzero_ps();
    const int span = rows_span(m);
    for (int c0 = 0, j = 0; c0 < in; c0 += span, j++) {
        float sc[4];
        rows_span_scales(m, rr, 4, j, sc);
        const int c1 = c0 + span < in ? c0 + span : in;
        for (int c = c0; c < c1; c += 16) {
            const __mmask16 lanes = c1 - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c1 - c)) - 1);
            __m512 wv[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                if (((c * (int)esz) & 63) == 0) prefetch_ahead(rp[k] + (size_t)c * esz, ahead);
                wv[k] = rows_load512(m, rp[k], c, lanes, sc[k]);
            }
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) {
                const __m512 xv = _mm512_maskz_loadu_ps(lanes, x + (size_t)(t0 + t) * in + c);
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) acc[k][t] = _mm512_fmadd_ps(wv[k], xv, acc[k][t]);
            }
        }
    }
    rows_store512(acc, r, r_end, t0, TG, y, ys);
}

/* FP8 blocks that are not whole 16-weight chunks take the portable kernel (one scale a chunk here) */
T_512 static void dense_rows_512(const rows_w *m, int r0, int r1, const float *x, int T, float *y, int ys) {
    if (m->fmt == PF_CPU_FP8_ROWS && m->block % 16) {
        dense_rows_scalar(m, r0, r1, x, T, y, ys);
        return;
    }
    for (int r = r0; r < r1; r += 4) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: rows_block512(m, r, r1, x, t0, 4, y, ys); break;
            case 3: rows_block512(m, r, r1, x, t0, 3, y, ys); break;
            case 2: rows_block512(m, r, r1, x, t0, 2, y, ys); break;
            default: rows_block512(m, r, r1, x, t0, 1, y, ys); break;
            }
        }
    }
}

/* FP8 and float32 rows of a bf16 model (round_bf16) on AVX512_BF16: every weight is rounded to a
 * bf16 value, and x is one (a bf16 model's inputs and h), so 32 weights a step go into vdpbf16ps,
 * whose products are exact: one vcvtne2ps2bf16 rounds 32 widened weights where rows_load512 needs
 * five integer operations per 16. The products are summed in pairs, so the float32 sums differ
 * from rows_block512's in order only. FP8 blocks must be whole 32-weight chunks. Measured on a
 * Qwen3-30B-A3B-shaped FP8 expert (2 threads of a Sapphire Rapids VM): 0.44 ms against 0.59-0.62
 * at T = 1, 0.66 against 0.70-0.73 at T = 4; bf16 rows, which need no rounding, gained nothing
 * (0.47-0.48 against 0.49-0.50 ms at T = 1, slower at T = 4) and stay on rows_block512. */
T_BF16 INL __m512bh rows_load32_bf16(const rows_w *m, const uint8_t *row, int k, __mmask32 lanes, float sc) {
    __m512 lo, hi;
    if (m->fmt == PF_CPU_FP8_ROWS) {
        __m256i b = _mm256_maskz_loadu_epi8(lanes, row + k);
        __m512i h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(b), 7), _mm512_set1_epi16((short)0xbfff));
        const __m512 s = _mm512_set1_ps(sc);
        lo = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s);
        hi = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), s);
        __mmask32 nan = _mm256_mask_cmpeq_epi8_mask(lanes, _mm256_or_si256(b, _mm256_set1_epi8((char)0x80)),
                                                    _mm256_set1_epi8((char)0xff));
        if (nan) {
            lo = _mm512_mask_mov_ps(lo, (__mmask16)nan, _mm512_set1_ps(NAN));
            hi = _mm512_mask_mov_ps(hi, (__mmask16)(nan >> 16), _mm512_set1_ps(NAN));
        }
    } else {
        lo = _mm512_maskz_loadu_ps((__mmask16)lanes, (const float *)row + k);
        hi = _mm512_maskz_loadu_ps((__mmask16)(lanes >> 16), (const float *)row + k + 16);
    }
    return _mm512_cvtne2ps_pbh(hi, lo); /* lanes 0..15 from lo, 16..31 from hi: columns k .. k + 31 in order */
}

/* 4 rows (the last ones clamped to r_end - 1) x TG tokens, 32 weights a step */
T_BF16 INL void rows_block_bf16(const rows_w *m, int r, int r_end, const float *x, int t0, const int TG, float *y,
                                int ys) {
    const int in = m->in;
    const uint8_t *rp[4];
    int rr[4];
    rows_at(m, r, r_end, 4, rr, rp);
    const size_t esz = rows_esize(m), ahead = rows_ahead(m, r, r_end, 4);
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
        for (int t = 0; t < TG; t++) acc[k][t] = _mm512_setzero_ps();
    const int span = rows_span(m);
    for (int c0 = 0, j = 0; c0 < in; c0 += span, j++) {
        float sc[4];
        rows_span_scales(m, rr, 4, j, sc);
        const int c1 = c0 + span < in ? c0 + span : in;
        for (int c = c0; c < c1; c += 32) {
            const __mmask32 lanes = c1 - c >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (c1 - c)) - 1);
            __m512bh wv[4];
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                for (size_t o = 0; o < 32 * esz; o += 64)
                    if ((((size_t)c * esz + o) & 63) == 0) prefetch_ahead(rp[k] + (size_t)c * esz + o, ahead);
                wv[k] = rows_load32_bf16(m, rp[k], c, lanes, sc[k]);
            }
#pragma GCC unroll 4
            for (int t = 0; t < TG; t++) {
                const float *xt = x + (size_t)(t0 + t) * in + c;
                const __m512bh xv = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps((__mmask16)(lanes >> 16), xt + 16),
                                                        _mm512_maskz_loadu_ps((__mmask16)lanes, xt));
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) acc[k][t] = _mm512_dpbf16_ps(acc[k][t], wv[k], xv);
            }
        }
    }
    rows_store512(acc, r, r_end, t0, TG, y, ys);
}

/* a bf16 model's FP8 rows (blocks of whole 32-weight chunks) and float32 rows; the others: dense_rows_512 */
T_BF16 static void dense_rows_bf16(const rows_w *m, int r0, int r1, const float *x, int T, float *y, int ys) {
    if (!m->round || m->fmt == PF_CPU_BF16_ROWS || (m->fmt == PF_CPU_FP8_ROWS && m->block % 32)) {
        dense_rows_512(m, r0, r1, x, T, y, ys);
        return;
    }
    for (int r = r0; r < r1; r += 4) {
        for (int t0 = 0; t0 < T; t0 += 4) {
            switch (T - t0 >= 4 ? 4 : T - t0) {
            case 4: rows_block_bf16(m, r, r1, x, t0, 4, y, ys); break;
            case 3: rows_block_bf16(m, r, r1, x, t0, 3, y, ys); break;
            case 2: rows_block_bf16(m, r, r1, x, t0, 2, y, ys); break;
            default: rows_block_bf16(m, r, r1, x, t0, 1, y, ys); break;
            }
        }
    }
}

/* ---- AMX for the row formats: a bf16 model's rows, AMX_MIN_TOKENS .. 16 tokens ------------
 * The row kernels above pay every token's dot products, so an expert of a prefill or a verify
 * block costs T times a token's (a Qwen3-30B-A3B-shaped bf16 expert on 2 threads: 0.45 ms at
 * T = 1, 1.37 ms at T = 16, where PyTorch's matmul takes 0.64). Here an A tile holds 16 weight
 * rows' 32 weights of a chunk as bf16: bf16 rows are loaded from the store as they are (the row
 * is the stride) when the block has all 16 rows; FP8 and float32 rows go through a scratch tile,
 * rounded to bf16 with their scale by rows_load32_bf16 (the weights the model computes with), as
 * do a short last block's rows (clamped to the last row: nothing past the matrix is read). B
 * tiles hold the token rows in natural order (amx_pos_rows). Products are exact, as in
 * rows_block_bf16; the sums run in another order. Rows and FP8 blocks must be whole 32-weight
 * chunks (run_experts checks). Each block prefetches the same chunk of the next block's rows. */
static inline size_t amx_pos_rows(size_t t, size_t e) { return (e / 32) * 512 + (e % 32 / 2) * 32 + 2 * t + (e & 1); }

/* r[i] <- column i of the 16 x 16 matrix whose rows were r[0 .. 16) */
T_512 INL void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 4; i++) {
            t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
            t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
        r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    }
}

/* v[0 .. 16): 16 tokens' registers of 16 bf16 pairs -> the B tile at b (row kp: every token's pair kp) */
T_512 INL void store_b_tile(__m512 v[16], uint16_t *b) {
    transpose16(v); /* bit moves only */
    for (int kp = 0; kp < 16; kp++) _mm512_storeu_ps((void *)(b + kp * 32), v[kp]);
}

/* MXFP4 on the tiles, phase 0 for a whole task: its T bf16 token rows of x (x's rows xrow[0 ..
 * T), x_stride elements apart) as B tiles in amx_pos order: per 128-element chunk and tile k,
 * each token's elements 4j + k (j = 0 .. 31: group j / 8, element (j % 8) * 4 + k of it) in
 * one register, the 16 tokens' registers transposed into the tile's 16 rows. Groups past H and
 * token columns past T come out zero (amx_zero_pad's zeros). */
T_512 static void mx_amx_x(const uint16_t *x, int x_stride, const int *xrow, int H, int T, uint16_t *xb) {
    const uint16_t *xs[16];
    for (int t = 0; t < T; t++) xs[t] = x + (size_t)xrow[t] * x_stride;
    __m512i idx[4]; /* lanes 0 .. 15: 4j + k of a register pair (elements 0 .. 63) */
    for (int k = 0; k < 4; k++) {
        _Alignas(64) uint16_t l[32] = {0};
        for (int j = 0; j < 16; j++) l[j] = (uint16_t)(4 * j + k);
        idx[k] = _mm512_load_si512((const void *)l);
    }
    for (int c = 0; c < (H + 127) / 128; c++) {
        __m512 v[4][16];
        for (int t = 0; t < 16; t++) {
            if (t >= T) {
                for (int k = 0; k < 4; k++) v[k][t] = _mm512_setzero_ps();
                continue;
            }
            __m512i a[4];
            for (int i = 0; i < 4; i++) /* H is whole groups: a register is all in or all out */
                a[i] = 128 * c + 32 * i < H ? _mm512_loadu_si512((const void *)(xs[t] + 128 * c + 32 * i))
                                            : _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const __m512i lo = _mm512_permutex2var_epi16(a[0], idx[k], a[1]);
                const __m512i hi = _mm512_permutex2var_epi16(a[2], idx[k], a[3]);
                v[k][t] = _mm512_castsi512_ps(_mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1));
            }
        }
        for (int k = 0; k < 4; k++) store_b_tile(v[k], xb + ((size_t)c * 4 + k) * 512);
    }
}

#ifdef PF_AMX_EMULATE
#define T_AMXR T_BF16
#else
#define T_AMXR __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16,avx512vl,avx512bw,avx2,fma")))
#endif

/* rows rp[0 .. 16) at column c as one A tile in a (16 rows of 32 bf16) */
T_AMXR INL void rows_fill_a(const rows_w *m, const uint8_t *const *rp, int c, const float *sc, uint16_t *a) {
#pragma GCC unroll 4
    for (int i = 0; i < 16; i++) {
        __m512i v;
        if (m->fmt == PF_CPU_BF16_ROWS) v = _mm512_loadu_si512((const void *)((const uint16_t *)rp[i] + c));
        else v = (__m512i)rows_load32_bf16(m, rp[i], c, 0xffffffffu, sc[i]);
        _mm512_store_si512((void *)(a + i * 32), v);
    }
}

/* chunk Q of the block into accumulator ACC, its A tile in TA (4 or 5), its B tile in TB */
#define ROWS_AMX_STEP(ACC, TA, TB, Q)                                                              \
    do {                                                                                           \
        const int c_ = (Q) * 32;                                                                   \
        if (((size_t)c_ * esz & 63) == 0)                                                          \
            for (int i_ = 0; i_ < 16; i_++) prefetch_ahead(rp[i_] + (size_t)c_ * esz, ahead);       \
        if (direct) {                                                                              \
            AMX_LOAD(TA, (const uint16_t *)rp[0] + c_, row_bytes);                                 \
        } else {                                                                                   \
            if (m->fmt == PF_CPU_FP8_ROWS && c_ % span == 0) rows_span_scales(m, rr, 16, c_ / span, sc); \
            rows_fill_a(m, rp, c_, sc, a[(TA) - 4]);                                               \
            AMX_LOAD(TA, a[(TA) - 4], 64);                                                         \
        }                                                                                          \
        AMX_LOAD(TB, xb + (size_t)(Q) * 512, 64);                                                  \
        AMX_DP(ACC, TA, TB);                                                                       \
    } while (0)

/* rows [r0, r1) of m for the T token rows in xb (amx_pos_rows order) -> y[t * ys + r] */
T_AMXR static void dense_rows_amx(const rows_w *m, int r0, int r1, const uint16_t *xb, int T, float *y, int ys) {
    const int C = m->in / 32, span = rows_span(m);
    const size_t esz = rows_esize(m), row_bytes = (size_t)m->in * esz;
    _Alignas(64) uint16_t a[2][16 * 32];
    _Alignas(64) float cb[4][16 * 16];
    float sc[16] = {0};
    /* tiles 0-3: one accumulator per chunk of four (see mx_rows_amx); 4, 5: A; 6, 7: B */
    amx_config_16x64();
    for (int rb = r0; rb < r1; rb += 16) {
        const int rows = r1 - rb < 16 ? r1 - rb : 16;
        const int direct = m->fmt == PF_CPU_BF16_ROWS && rows == 16;
        const size_t ahead = rb + 32 <= r1 ? 16 * row_bytes : 0;
        const uint8_t *rp[16];
        int rr[16];
        rows_at(m, rb, r1, 16, rr, rp);
        AMX_ZERO(0);
        AMX_ZERO(1);
        AMX_ZERO(2);
        AMX_ZERO(3);
        int q = 0;
        for (; q + 4 <= C; q += 4) {
            ROWS_AMX_STEP(0, 4, 6, q);
            ROWS_AMX_STEP(1, 5, 7, q + 1);
            ROWS_AMX_STEP(2, 4, 6, q + 2);
            ROWS_AMX_STEP(3, 5, 7, q + 3);
        }
        if (q < C) ROWS_AMX_STEP(0, 4, 6, q);
        if (q + 1 < C) ROWS_AMX_STEP(1, 5, 7, q + 1);
        if (q + 2 < C) ROWS_AMX_STEP(2, 4, 6, q + 2);
        AMX_STORE(0, cb[0], 64);
        AMX_STORE(1, cb[1], 64);
        AMX_STORE(2, cb[2], 64);
        AMX_STORE(3, cb[3], 64);
        __m512 v[16]; /* row i's 16 token results, then (transposed) token n's 16 rows */
        for (int i = 0; i < 16; i++)
            v[i] = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(cb[0] + i * 16), _mm512_load_ps(cb[1] + i * 16)),
                                 _mm512_add_ps(_mm512_load_ps(cb[2] + i * 16), _mm512_load_ps(cb[3] + i * 16)));
        transpose16(v);
        const __mmask16 live = (__mmask16)((1u << rows) - 1);
        for (int n = 0; n < T; n++) _mm512_mask_storeu_ps(y + (size_t)n * ys + rb, live, v[n]);
    }
    AMX_RELEASE();
}
#undef ROWS_AMX_STEP

/* e^v in every lane, to about 2 float ulps: 2^n (scalef) times 2^f, |f| <= 1/2, by its Taylor
 * polynomial in f ln 2 (degree 7); overflow gives inf, underflow 0, NaN stays NaN */
T_BF16 INL __m512 exp512(__m512 v) {
    const __m512 t = _mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* AMX rows, phase 0 for a whole task: its T token rows of x (x's rows xrow[0 .. T), x_size bytes
 * an element, x_stride elements apart) as bf16 B tiles (amx_pos_rows): per 32-element chunk, the 16 tokens' pairs transposed in registers
 * into the tile's 16 rows (token columns past T zeros). float32 x is rounded as rows_block_bf16
 * rounds it. */
T_BF16 static void rows_amx_x(const void *x, int x_format, int x_size, int x_stride, const int *xrow, int H, int T,
                              uint16_t *xb) {
    const char *xs[16];
    for (int t = 0; t < T; t++) xs[t] = (const char *)x + (size_t)xrow[t] * x_stride * x_size;
    for (int q = 0; q < H / 32; q++) {
        __m512 v[16];
        for (int t = 0; t < 16; t++) {
            if (t >= T) {
                v[t] = _mm512_setzero_ps();
            } else if (x_format == PF_CPU_BF16) {
                v[t] = _mm512_loadu_ps((const void *)((const uint16_t *)xs[t] + 32 * q));
            } else {
                const float *f = (const float *)xs[t] + 32 * q;
                v[t] = (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(f + 16), _mm512_loadu_ps(f));
            }
        }
        store_b_tile(v, xb + (size_t)q * 512);
    }
}

/* AMX rows, phase 1's tail: pairs [k0, k1) of each token's gate_up results gu (gate k, up I + k)
 * -> h = silu_h(gate, up, rounded), as bf16 in the down tiles' B order (amx_pos_rows). k0, k1:
 * multiples of 16 (grabs of whole tiles). */
T_BF16 static void rows_amx_h(const float *gu, int I, int T, int k0, int k1, uint16_t *hb) {
    const __m256i pairs = _mm256_set_epi32(7 * 16, 6 * 16, 5 * 16, 4 * 16, 3 * 16, 2 * 16, 16, 0); /* dwords: 64 bytes apart */
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I;
        for (int k = k0; k < k1; k += 16) {
            const __m512 gate = round512(_mm512_loadu_ps(g + k), 1), up = round512(_mm512_loadu_ps(g + I + k), 1);
            const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate));
            const __m512 sg = round512(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), 1);
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(sg, up)); /* the product's rounding */
            _mm256_i32scatter_epi32((int *)(hb + amx_pos_rows((size_t)t, (size_t)k)), pairs, (__m256i)h, 4);
        }
    }
}

/* lanes m of a bias (bias_format) from element i on, as float32 */
T_512 INL __m512 bias16(const void *bias, int bias_format, size_t i, __mmask16 m) {
    if (bias_format == PF_CPU_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)bias + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)bias + i);
}

/* The tiles' phase 2 tail for a bf16 model (down_part's): outputs [lo, hi) of each token (y
 * rounded to bf16; plus the rounded bias, rounded again) times its scale into out's rows */
T_BF16 static void amx_out(const float *y, int H, int T, int lo, int hi, const void *bias, int bias_format,
                           const float *scale, const int *dest, float *out, int out_stride) {
    for (int t = 0; t < T; t++) {
        const float *yt = y + (size_t)t * H;
        float *ot = out + (size_t)dest[t] * out_stride;
        const __m512 s = _mm512_set1_ps(scale ? scale[t] : 1.0f);
        for (int o = lo; o < hi; o += 16) {
            const __mmask16 m = hi - o >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hi - o)) - 1);
            __m512 v = round512(_mm512_maskz_loadu_ps(m, yt + o), 1);
            if (bias) v = round512(_mm512_add_ps(v, round512(bias16(bias, bias_format, (size_t)o, m), 1)), 1);
            _mm512_mask_storeu_ps(ot + o, m, _mm512_mul_ps(v, s));
        }
    }
}

/* MXFP4 on the tiles, phase 1's tail for a bf16 model (gate_up_part's): pairs [k0, k1) of each
 * token's interleaved gate_up results gu (gate 2k, up 2k + 1; the bias added, every step rounded
 * to bf16 as swiglu_bf16 rounds) -> h as bf16 at its amx_pos place in hb */
T_BF16 static void mx_amx_h(const float *gu, int I, int T, int k0, int k1, const pf_cpu_weights *w, uint16_t *hb) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 one = _mm512_set1_ps(1.0f), lim = _mm512_set1_ps(w->limit), alpha = _mm512_set1_ps(w->alpha);
    for (int k = k0; k < k1; k += 16) {
        const int n = k1 - k < 16 ? k1 - k : 16;
        const __mmask16 lo = (__mmask16)(n >= 8 ? 0xffff : (1u << (2 * n)) - 1);
        const __mmask16 hi = (__mmask16)(n >= 16 ? 0xffff : n > 8 ? (1u << (2 * (n - 8))) - 1 : 0);
        __m512 bg = _mm512_setzero_ps(), bu = bg;
        if (w->gate_up_bias) {
            const __m512 b0 = bias16(w->gate_up_bias, w->bias_format, (size_t)2 * k, lo);
            const __m512 b1 = bias16(w->gate_up_bias, w->bias_format, (size_t)2 * k + 16, hi);
            bg = round512(_mm512_permutex2var_ps(b0, even, b1), 1);
            bu = round512(_mm512_permutex2var_ps(b0, odd, b1), 1);
        }
        size_t pos[16];
        for (int i = 0; i < n; i++) pos[i] = amx_pos(0, (size_t)(k + i));
        for (int t = 0; t < T; t++) {
            const float *g = gu + (size_t)t * 2 * I + 2 * (size_t)k;
            const __m512 a0 = _mm512_maskz_loadu_ps(lo, g), a1 = _mm512_maskz_loadu_ps(hi, g + 16);
            __m512 gate = round512(_mm512_permutex2var_ps(a0, even, a1), 1);
            __m512 up = round512(_mm512_permutex2var_ps(a0, odd, a1), 1);
            if (w->gate_up_bias) {
                gate = round512(_mm512_add_ps(gate, bg), 1);
                up = round512(_mm512_add_ps(up, bu), 1);
            }
            gate = _mm512_min_ps(lim, gate); /* NaN stays NaN (the second operand), as in swiglu_bf16 */
            up = _mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), lim), _mm512_min_ps(lim, up));
            const __m512 ga = round512(_mm512_mul_ps(gate, alpha), 1);
            const __m512 sg = round512(_mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), ga)))), 1);
            const __m512 glu = round512(_mm512_mul_ps(gate, sg), 1);
            _Alignas(32) uint16_t h[16];
            _mm256_store_si256((__m256i *)h, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(round512(_mm512_add_ps(up, one), 1), glu)));
            for (int i = 0; i < n; i++) hb[pos[i] + 2 * (size_t)t] = h[i];
        }
    }
}

T_512 static uint64_t read_512(const uint8_t *p, size_t n) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    __m512i a = _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3));
    /* reduced in registers, wrapping (_mm512_reduce_add_epi64 adds signed; a store of the lanes to
     * the stack faulted under ASan with gcc 13 on the H200 host) */
    __m256i h = _mm256_add_epi64(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
    __m128i q = _mm_add_epi64(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    uint64_t sum = (uint64_t)_mm_cvtsi128_si64(q) + (uint64_t)_mm_extract_epi64(q, 1);
    return sum + read_scalar(p + i, n - i);
}
#endif /* PF_X86 */

/* ---- dispatch ------------------------------------------------------------------------ */
/* AMX-TILE and AMX-BF16 (CPUID leaf 7), and the kernel's permission for this process to use
 * tile data (Linux: arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; asked once, the
 * answer kept) */
static int amx_usable(void) {
#if PF_X86 && !defined(PF_AMX_EMULATE)
    static int answer = -1;
    if (answer < 0) {
        unsigned a, b, c, d;
        int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1);
        answer = cpu && syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    }
    return answer;
#else
    return 0;
#endif
}

int pf_cpu_detect(void) {
#if PF_X86
    __builtin_cpu_init();
    unsigned a, b, c, d; /* F16C (CPUID.1:ECX bit 29): every AVX2 CPU has it; the row formats' FP8 path uses it */
    int f16c = __get_cpuid(1, &a, &b, &c, &d) && (c >> 29 & 1);
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
    int a512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl");
    if (a512 && __builtin_cpu_supports("avx512bf16")) return amx_usable() ? PF_CPU_LEVEL_AMX_BF16 : PF_CPU_LEVEL_AVX512_BF16;
    if (a512) return PF_CPU_LEVEL_AVX512;
    if (avx2) return PF_CPU_LEVEL_AVX2;
#endif
    return PF_CPU_LEVEL_SCALAR;
}

const char *pf_cpu_level_name(int level) {
    switch (level) {
    case PF_CPU_LEVEL_SCALAR: return "scalar";
    case PF_CPU_LEVEL_AVX2: return "avx2";
    case PF_CPU_LEVEL_AVX512: return "avx512";
    case PF_CPU_LEVEL_AVX512_BF16: return "avx512_bf16";
    case PF_CPU_LEVEL_AMX_BF16: return "amx_bf16";
    default: return "unknown";
    }
}

const char *pf_cpu_strerror(int code) {
    switch (code) {
    case PF_CPU_OK: return "ok";
    case PF_CPU_EINVAL: return "invalid argument";
    case PF_CPU_ENOMEM: return "out of memory";
    case PF_CPU_ETHREAD: return "could not start a worker thread";
    case PF_CPU_EUNSUPPORTED: return "this CPU does not support the requested kernel level";
    default: return "unknown error";
    }
}

/* ---- the context and its pool --------------------------------------------------------- */
/* One expert of a call, with its share of the scratch buffers (offsets in elements) and its
 * first unit in each phase's index space. */
typedef struct task {
    const pf_cpu_weights *w;
    int T;
    int bf16_x;          /* phase 1 uses the bf16 MXFP4 kernel (x in xb) */
    int bf16_h;          /* phase 2 uses it too (h, bf16 values when round_bf16, in hb) */
    int amx_x, amx_h;    /* ... as AMX tiles (at least AMX_MIN_TOKENS tokens): xb / hb in amx_pos order */
    int amx_rows;        /* a row format on AMX tiles (amx_x and amx_h set too): xb / hb in amx_pos_rows order */
    const float *scale;  /* [T] factor of each output row, or NULL */
    const int *dest;     /* [T] rows of out */
    size_t xo, guo, ho, yo; /* ho: into h, or into hb when bf16_h */
    int u1, u2;          /* first unit of this task in phase 1 / phase 2 */
    int unit1, unit2;    /* its unit in phase 1 / phase 2 (unit_of; AMX rows: a tile's 16 rows) */
} task;

typedef struct job {
    const task *tasks;
    int ntasks;
    int units1, units2;  /* units of phase 1 / phase 2 over all tasks */
    const uint8_t *rbuf; /* phase 3: the buffer, its size (a multiple of 8), per-thread sums */
    size_t rbytes;
    uint64_t *rsum;
    const void *x;       /* phase 0: the token rows, their format, element size and stride */
    int x_format, x_size, x_stride;
    const int *xrow;     /* [nrows] row of x of each task's tokens, tasks laid end to end */
    int nrows;
    float *out;
    int out_stride;
} job;

struct pf_cpu {
    int level;
    int threads;
    mx_rows_fn mx_rows;
    mx_rows_bf16_fn mx_rows_bf16; /* NULL below PF_CPU_LEVEL_AVX512_BF16 */
    mx_rows_bf16_fn mx_rows_amx;  /* NULL below PF_CPU_LEVEL_AMX_BF16; x in B tiles (amx_pos) */
    dense_rows_amx_fn rows_amx;   /* NULL below PF_CPU_LEVEL_AMX_BF16; x in B tiles (amx_pos_rows) */
    dense_cols_fn dense_cols;
    dense_rows_fn dense_rows;
    read_fn read;
    int chunked;                  /* mx_rows reads rows in the chunked order (mx_pos_chunked) */

    pthread_mutex_t call_mu;      /* serializes calls; guards the scratch buffers */

    /* The pool. One phase of a job runs at a time; its units are claimed by the threads in
     * grabs (an atomic counter), so a thread that wakes late finds less work, never delays
     * the phase. The state word packs the running phase (see ST_*); it and the claim word
     * are reset together, under mu, each time a phase is published. */
    pthread_mutex_t mu;           /* guards seq, last_phase, the condition variables' waits and wakes */
    pthread_cond_t work_cv;       /* workers: a phase was published, or stop */
    pthread_cond_t done_cv;       /* caller: a phase was published, or the job has ended */
    /* With POOL_LINES, cache lines apart (the context is allocated 64-byte aligned): what polling
     * threads read (written once a phase or less), the claim counter every grab updates, the
     * completion counter, and the caller's job data, so that a poller's reads do not slow the
     * grabs of a phase's last threads, nor the caller's writes while it sets up a job. */
    POOL_LINE _Atomic uint64_t state; /* the published phase: seq | last | phase | units (ST_*) */
    _Atomic int done;             /* the job's last phase has been completed */
    _Atomic int stop;
    _Atomic uint64_t linger_until; /* pf_cpu_prewake: idle workers poll until then (monotonic ns; written under mu) */
    _Atomic int active;           /* pf_cpu_set_active: threads 0 .. active-1 take part in jobs and prewakes */
    _Atomic int invariant;        /* pf_cpu_set_invariant: no AMX tiles, whatever an expert's token count */
    POOL_LINE _Atomic uint64_t claim; /* (seq << 32) | the next unit to claim of that phase */
    POOL_LINE _Atomic uint32_t completed; /* units of the published phase finished */
    POOL_LINE uint32_t seq; /* the last phase published (under mu) */
    int last_phase;               /* the job ends after this phase (under mu) */
    job cur;                      /* written by the caller before the job's first phase is published */

    /* the last job's timing (pf_cpu_last_timing), monotonic ns: the caller resets it before
     * the first phase; publish / end_phase write under mu, each thread its own join slots, a
     * line of its own */
    uint64_t t_start, t_end, t_pub[4], t_done[4];
    struct {
        POOL_LINE uint64_t at[4]; /* the thread's first claim in each phase (0: none) */
    } t_join[PF_CPU_MAX_THREADS];
    int timed;                    /* a job has run */

    pthread_t *tids;              /* owned; tids[i] runs as thread i + 1 */
    int started;

    /* scratch, owned, 64-byte aligned, grown under call_mu; sizes in elements, summed over a call's tasks */
    float *xp;   size_t xp_cap;   /* T * H: x in kernel order (float32) */
    uint16_t *xb; size_t xb_cap;  /* T * pad128(H): x as bf16 in mx_pos_bf16 order (bf16 kernel only) */
    uint16_t *hb; size_t hb_cap;  /* T * pad128(I): h as bf16 in mx_pos_bf16 order (bf16 kernel only) */
    float *gu;   size_t gu_cap;   /* T * 2I */
    float *h;    size_t h_cap;    /* T * I: SwiGLU output in the down weights' kernel order */
    float *y;    size_t y_cap;    /* T * H: the down projection before scaling into out */
    task *tasks; size_t tasks_cap;
};

struct worker_arg {
    pf_cpu *c;
    int idx;
};

/* the SwiGLU of a bfloat16 model: every operation's result rounded to bfloat16 */
static inline float swiglu_bf16(float gate, float up, float alpha, float limit) {
    gate = gate > limit ? limit : gate;
    up = up > limit ? limit : (up < -limit ? -limit : up);
    float ga = round_bf16(gate * alpha);
    float sg = round_bf16(1.0f / (1.0f + expf(-ga)));
    float glu = round_bf16(gate * sg);
    return round_bf16(round_bf16(up + 1.0f) * glu);
}

static inline float swiglu(float gate, float up, float alpha, float limit) {
    gate = gate > limit ? limit : gate;                            /* NaN stays NaN, as torch.clamp */
    up = up > limit ? limit : (up < -limit ? -limit : up);
    float glu = gate * (1.0f / (1.0f + expf(-(gate * alpha))));
    return (up + 1.0f) * glu;
}

static inline int unit_of(const pf_cpu_weights *w) {
    return w->format == PF_CPU_MXFP4 || is_rows(w->format) ? MX_UNIT : DN_UNIT;
}

static inline rows_w rows_of(const pf_cpu_weights *w, int gate_up) {
    return (rows_w){.w = gate_up ? w->gate_up : w->down, .scales = gate_up ? w->gate_up_scales : w->down_scales,
                    .fmt = w->format, .sfmt = w->scale_format, .block = w->block,
                    .in = gate_up ? w->hidden : w->inter, .round = w->round_bf16};
}

/* Qwen3-MoE's SiLU-gated h (rows formats); a bf16 model rounds the SiLU and the product */
static inline float silu_h(float gate, float up, int round) {
    if (!round) return gate / (1.0f + expf(-gate)) * up;
    gate = round_bf16(gate);
    return round_bf16(round_bf16(gate / (1.0f + expf(-gate))) * round_bf16(up));
}

/* phase 0: token rows rows[r0 .. r1) of the call (over all tasks, in task order) -> kernel order */
static void prepare_rows(pf_cpu *c, const job *j, int r0, int r1) {
    int base = 0;
    for (int k = 0; k < j->ntasks && base < r1; k++) {
        const task *tk = &j->tasks[k];
        if (tk->amx_x) { /* B tiles: the whole task, by the range holding its first row */
#if PF_X86
            if (base >= r0 && tk->amx_rows) {
                rows_amx_x(j->x, j->x_format, j->x_size, j->x_stride, j->xrow + base, tk->w->hidden, tk->T, c->xb + tk->xo);
            } else if (base >= r0) { /* MXFP4 (x in bf16), and hb's padding where the down tiles run */
                mx_amx_x((const uint16_t *)j->x, j->x_stride, j->xrow + base, tk->w->hidden, tk->T, c->xb + tk->xo);
                for (int t = 0; tk->amx_h && t < tk->T; t++) amx_zero_pad(c->hb + tk->ho, (size_t)tk->w->inter, (size_t)t);
            }
#endif
            base += tk->T;
            continue;
        }
        const pf_cpu_weights *w = tk->w;
        const int H = w->hidden, mx = w->format == PF_CPU_MXFP4;
        for (int t = r0 > base ? r0 - base : 0; t < tk->T && base + t < r1; t++) {
            const char *xt = (const char *)j->x + (size_t)j->xrow[base + t] * j->x_stride * j->x_size;
            if (tk->bf16_h && !tk->amx_h) { /* the padding of this row of hb (phase 1 writes the rest) */
                const size_t I = (size_t)w->inter;
                uint16_t *ht = c->hb + tk->ho + (size_t)t * pad128(I);
                for (size_t e = I; e < pad128(I); e++) ht[mx_pos_bf16(e)] = 0;
            }
            if (tk->amx_h) amx_zero_pad(c->hb + tk->ho, (size_t)w->inter, (size_t)t); /* phase 1 writes the rest */
            if (tk->bf16_x) {
                uint16_t *dt = c->xb + tk->xo + (size_t)t * pad128((size_t)H);
                for (int e = 0; e < H; e++) dt[mx_pos_bf16((size_t)e)] = ((const uint16_t *)xt)[e];
                for (size_t e = (size_t)H; e < pad128((size_t)H); e++) dt[mx_pos_bf16(e)] = 0;
                continue;
            }
            float *dt = c->xp + tk->xo + (size_t)t * H;
            for (int e = 0; e < H; e++) {
                float v = load_elem(xt, j->x_format, (size_t)e);
                dt[!mx ? (size_t)e : c->chunked ? mx_pos_chunked((size_t)e, (size_t)H) : mx_pos((size_t)e)] = v;
            }
        }
        base += tk->T;
    }
}

/* GRAB_STREAM: the first PREFETCH_ROWS rows of MXFP4 rows [lo, hi) (rows of `in` elements),
 * asked for as a grab starts */
static void prefetch_grab(const void *blocks, int in, int lo, int hi) {
    if (!GRAB_STREAM) return;
    const size_t row = (size_t)in / 32 * 16, end = (size_t)(hi - lo < PREFETCH_ROWS ? hi - lo : PREFETCH_ROWS) * row;
    const uint8_t *p = (const uint8_t *)blocks + (size_t)lo * row;
    for (size_t o = 0; o < end; o += 64) prefetch_ahead(p, o);
}

/* phase 1 for a task of a row format: units [lo, hi) of 2I (lo, hi even) are the pairs k in
 * [lo/2, hi/2): gate row k and up row I + k -> h[t][k] (natural order) */
static void gate_up_rows(pf_cpu *c, const task *tk, int lo, int hi) {
    const pf_cpu_weights *w = tk->w;
    const int I = w->inter, T = tk->T, k0 = lo / 2, k1 = hi / 2;
    const rows_w m = rows_of(w, 1);
    float *gu = c->gu + tk->guo;
    if (tk->amx_rows) { /* h into hb, the down tiles' B order (a round_bf16 h is a bf16 value) */
        c->rows_amx(&m, k0, k1, c->xb + tk->xo, T, gu, 2 * I);
        c->rows_amx(&m, I + k0, I + k1, c->xb + tk->xo, T, gu, 2 * I);
#if PF_X86
        rows_amx_h(gu, I, T, k0, k1, c->hb + tk->ho);
#endif
        return;
    }
    float *h = c->h + tk->ho;
    c->dense_rows(&m, k0, k1, c->xp + tk->xo, T, gu, 2 * I);
    c->dense_rows(&m, I + k0, I + k1, c->xp + tk->xo, T, gu, 2 * I);
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I;
        for (int k = k0; k < k1; k++) h[(size_t)t * I + k] = silu_h(g[k], g[I + k], w->round_bf16);
    }
}

/* phase 1 for one task: gate_up rows [lo, hi), bias, SwiGLU -> h */
static void gate_up_part(pf_cpu *c, const task *tk, int lo, int hi) {
    const pf_cpu_weights *w = tk->w;
    if (is_rows(w->format)) {
        gate_up_rows(c, tk, lo, hi);
        return;
    }
    const int H = w->hidden, I = w->inter, T = tk->T, mx = w->format == PF_CPU_MXFP4;
    float *gu = c->gu + tk->guo, *h = tk->bf16_h ? NULL : c->h + tk->ho;
    uint16_t *hb = tk->bf16_h ? c->hb + tk->ho : NULL;
    if (mx) prefetch_grab(w->gate_up, H, lo, hi);
    if (tk->amx_x)
        c->mx_rows_amx((const uint8_t *)w->gate_up, w->gate_up_scales, H, 2 * I, lo, hi, c->xb + tk->xo, T, gu, 2 * I);
    else if (mx && tk->bf16_x)
        c->mx_rows_bf16((const uint8_t *)w->gate_up, w->gate_up_scales, H, 2 * I, lo, hi, c->xb + tk->xo, T, gu, 2 * I);
    else if (mx)
        c->mx_rows((const uint8_t *)w->gate_up, w->gate_up_scales, H, 2 * I, lo, hi, c->xp + tk->xo, T, gu, 2 * I);
    else
        c->dense_cols(w->gate_up, w->format, H, 2 * I, lo, hi, c->xp + tk->xo, T, gu, 2 * I);
#if PF_X86
    if (tk->amx_h) { /* a bf16 model's h for the down tiles: the tail 16 lanes at a time */
        mx_amx_h(gu, I, T, lo / 2, hi / 2, w, hb);
        return;
    }
#endif
    for (int t = 0; t < T; t++) {
        const float *g = gu + (size_t)t * 2 * I;
        float *ht = h ? h + (size_t)t * I : NULL;
        for (int k = lo / 2; k < hi / 2; k++) {
            float gate = g[2 * k], up = g[2 * k + 1], hv;
            if (w->round_bf16) {
                gate = round_bf16(gate);
                up = round_bf16(up);
                if (w->gate_up_bias) {
                    gate = round_bf16(gate + round_bf16(load_elem(w->gate_up_bias, w->bias_format, (size_t)2 * k)));
                    up = round_bf16(up + round_bf16(load_elem(w->gate_up_bias, w->bias_format, (size_t)2 * k + 1)));
                }
                hv = swiglu_bf16(gate, up, w->alpha, w->limit);
            } else {
                if (w->gate_up_bias) {
                    gate += load_elem(w->gate_up_bias, w->bias_format, (size_t)2 * k);
                    up += load_elem(w->gate_up_bias, w->bias_format, (size_t)2 * k + 1);
                }
                hv = swiglu(gate, up, w->alpha, w->limit);
            }
            if (tk->bf16_h) { /* hv is a bf16 value (round_bf16): its top half is exact */
                uint32_t u;
                memcpy(&u, &hv, sizeof u);
                hb[tk->amx_h ? amx_pos((size_t)t, (size_t)k) : (size_t)t * pad128((size_t)I) + mx_pos_bf16((size_t)k)] =
                    (uint16_t)(u >> 16);
                continue;
            }
            ht[!mx ? (size_t)k : c->chunked ? mx_pos_chunked((size_t)k, (size_t)I) : mx_pos((size_t)k)] = hv;
        }
    }
}

/* phase 2 for one task: out features [lo, hi) of every token, bias, then scaled into out's rows */
static void down_part(pf_cpu *c, const job *j, const task *tk, int lo, int hi) {
    const pf_cpu_weights *w = tk->w;
    const int H = w->hidden, I = w->inter, T = tk->T;
    float *y = c->y + tk->yo;
    if (w->format == PF_CPU_MXFP4) prefetch_grab(w->down, I, lo, hi);
    if (tk->amx_rows) {
        const rows_w m = rows_of(w, 0);
        c->rows_amx(&m, lo, hi, c->hb + tk->ho, T, y, H);
    } else if (tk->amx_h)
        c->mx_rows_amx((const uint8_t *)w->down, w->down_scales, I, H, lo, hi, c->hb + tk->ho, T, y, H);
    else if (tk->bf16_h)
        c->mx_rows_bf16((const uint8_t *)w->down, w->down_scales, I, H, lo, hi, c->hb + tk->ho, T, y, H);
    else if (w->format == PF_CPU_MXFP4)
        c->mx_rows((const uint8_t *)w->down, w->down_scales, I, H, lo, hi, c->h + tk->ho, T, y, H);
    else if (is_rows(w->format)) {
        const rows_w m = rows_of(w, 0);
        c->dense_rows(&m, lo, hi, c->h + tk->ho, T, y, H);
    } else
        c->dense_cols(w->down, w->format, I, H, lo, hi, c->h + tk->ho, T, y, H);
#if PF_X86
    if (tk->amx_h) { /* a bf16 model on the tiles (rows or MXFP4): the tail 16 lanes at a time */
        amx_out(y, H, T, lo, hi, w->down_bias, w->bias_format, tk->scale, tk->dest, j->out, j->out_stride);
        return;
    }
#endif
    for (int t = 0; t < T; t++) {
        const float *yt = y + (size_t)t * H;
        float *ot = j->out + (size_t)tk->dest[t] * j->out_stride;
        const float s = tk->scale ? tk->scale[t] : 1.0f;
        for (int o = lo; o < hi; o++) {
            float v = yt[o];
            if (w->round_bf16) {
                v = round_bf16(v);
                if (w->down_bias) v = round_bf16(v + round_bf16(load_elem(w->down_bias, w->bias_format, (size_t)o)));
            } else if (w->down_bias) {
                v += load_elem(w->down_bias, w->bias_format, (size_t)o);
            }
            ot[o] = tk->scale ? v * s : v;
        }
    }
}

/* Units [a, b) of a phase whose index space is every task's units laid end to end. */
static void tasks_part(pf_cpu *c, const job *j, int a, int b, int phase) {
    for (int k = 0; k < j->ntasks; k++) {
        const task *tk = &j->tasks[k];
        const int unit = phase == 1 ? tk->unit1 : tk->unit2, first = phase == 1 ? tk->u1 : tk->u2;
        const int n = phase == 1 ? 2 * tk->w->inter : tk->w->hidden, nu = (n + unit - 1) / unit;
        if (first >= b) break;
        if (first + nu <= a) continue;
        int lo = (a > first ? a - first : 0) * unit, hi = (b < first + nu ? b - first : nu) * unit;
        if (hi > n) hi = n;
        if (phase == 1) gate_up_part(c, tk, lo, hi);
        else down_part(c, j, tk, lo, hi);
    }
}

#define READ_UNIT_WORDS 8192 /* phase 3: 64 KiB of the buffer per unit */

/* the number of units of a phase of c->cur */
static uint32_t phase_units(const job *j, int phase) {
    switch (phase) {
    case 0: return (uint32_t)j->nrows;
    case 1: return (uint32_t)j->units1;
    case 2: return (uint32_t)j->units2;
    default: return (uint32_t)((j->rbytes / 8 + READ_UNIT_WORDS - 1) / READ_UNIT_WORDS);
    }
}

/* Thread idx runs units [a, b) of a phase of c->cur. */
static void run_units(pf_cpu *c, int idx, int phase, int a, int b) {
    const job *j = &c->cur;
    if (phase == 3) {
        size_t words = j->rbytes / 8, lo = (size_t)a * READ_UNIT_WORDS, hi = (size_t)b * READ_UNIT_WORDS;
        if (hi > words) hi = words;
        j->rsum[idx] += c->read(j->rbuf + lo * 8, (hi - lo) * 8);
    } else if (phase == 0) {
        prepare_rows(c, j, a, b);
    } else {
        tasks_part(c, j, a, b, phase);
    }
}

/* The state word: bits 0-31 the phase's units, 32-33 the phase, 34 set if the job ends with
 * it, 35-63 the phase's sequence number (29 bits, wrapping; 0 is "nothing published yet"). */
#define SEQ_MASK ((1u << 29) - 1)
#define ST_UNITS(s) ((uint32_t)(s))
#define ST_PHASE(s) ((int)(((s) >> 32) & 3u))
#define ST_LAST(s) ((int)(((s) >> 34) & 1u))
#define ST_SEQ(s) ((uint32_t)((s) >> 35))

/* Between two phases of a job (and while the caller waits for the job's end) a thread
 * polls the state for at most this long before it sleeps on its condition variable; the
 * next phase usually starts within microseconds, far sooner than a sleeping thread wakes.
 * An idle pool (no job) never polls. */
#ifndef PF_CPU_POLL_NS
#define PF_CPU_POLL_NS 100000
#endif

static inline void cpu_relax(void) {
#if PF_X86
    _mm_pause();
#endif
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Publish phase `phase` of c->cur (under mu), skipping phases without units; after the
 * job's last phase, end the job. Wakes the sleeping workers and the caller. */
static void publish(pf_cpu *c, int phase) {
    uint32_t units = phase_units(&c->cur, phase);
    while (units == 0 && phase < c->last_phase) units = phase_units(&c->cur, ++phase);
    if (units == 0) {
        atomic_store_explicit(&c->done, 1, memory_order_release);
        pthread_cond_signal(&c->done_cv);
        return;
    }
    c->seq = (c->seq + 1) & SEQ_MASK;
    if (c->seq == 0) c->seq = 1;
    atomic_store_explicit(&c->completed, 0, memory_order_relaxed);
    atomic_store_explicit(&c->claim, (uint64_t)c->seq << 32, memory_order_relaxed);
    c->t_pub[phase] = now_ns();
    const uint64_t st = (uint64_t)c->seq << 35 | (uint64_t)(phase == c->last_phase) << 34 | (uint64_t)phase << 32 | units;
    atomic_store_explicit(&c->state, st, memory_order_release);
    pthread_cond_broadcast(&c->work_cv);
    pthread_cond_signal(&c->done_cv);
}

/* The last unit of the phase `st` has been completed: publish the next phase or end the job. */
static void end_phase(pf_cpu *c, uint64_t st) {
    pthread_mutex_lock(&c->mu);
    c->t_done[ST_PHASE(st)] = now_ns();
    if (ST_LAST(st)) {
        atomic_store_explicit(&c->done, 1, memory_order_release);
        pthread_cond_signal(&c->done_cv);
    } else {
        publish(c, ST_PHASE(st) + 1);
    }
    pthread_mutex_unlock(&c->mu);
}

/* Units in the next grab when `left` of the phase's `units` are unclaimed: guided, a share of
 * what is left (large grabs first, so claims are few; small ones last, so threads finish
 * together), 1..GRAB_MAX units; with GRAB_FIRST, the phase's first GRAB_FIRST percent goes in
 * `threads` equal grabs before that (one contiguous stream a thread). */
static uint32_t grab_size(uint32_t left, uint32_t units, uint32_t threads) {
    uint32_t g;
    const uint64_t first = (uint64_t)units * GRAB_FIRST / 100;
    if (GRAB_FIRST && (uint64_t)(units - left) < first) {
        g = (uint32_t)((first + threads - 1) / threads);
    } else {
        g = left / ((uint32_t)GRAB_SHARE * threads);
        if (g < 1) g = 1;
        if (g > GRAB_MAX) g = GRAB_MAX;
    }
    return g < left ? g : left;
}

/* Claim and run grabs of the phase `st` until none is left (or a newer phase has replaced
 * it: the claim word then carries another sequence number and no claim succeeds). Job data
 * is read only after a successful claim, which implies `st` is still the published phase. */
static void work_phase(pf_cpu *c, int idx, uint64_t st) {
    const uint32_t seq = ST_SEQ(st), units = ST_UNITS(st);
    const int phase = ST_PHASE(st);
    uint64_t cl = atomic_load_explicit(&c->claim, memory_order_relaxed);
    for (;;) {
        if ((uint32_t)(cl >> 32) != seq || (uint32_t)cl >= units) return;
        const uint32_t a = (uint32_t)cl, n = grab_size(units - a, units, (uint32_t)atomic_load_explicit(&c->active, memory_order_relaxed));
        if (!atomic_compare_exchange_weak_explicit(&c->claim, &cl, cl + n, memory_order_acquire, memory_order_relaxed))
            continue;
        if (!c->t_join[idx].at[phase]) c->t_join[idx].at[phase] = now_ns();
        run_units(c, idx, phase, (int)a, (int)(a + n));
        if (atomic_fetch_add_explicit(&c->completed, n, memory_order_acq_rel) + n == units) {
            end_phase(c, st);
            return;
        }
        cl = atomic_load_explicit(&c->claim, memory_order_relaxed);
    }
}

/* Something for this thread to act on: a phase newer than `seen`, or stop (a worker) / the
 * job's end (the caller). */
static int ready(pf_cpu *c, uint32_t seen, int caller) {
    if (ST_SEQ(atomic_load_explicit(&c->state, memory_order_acquire)) != seen) return 1;
    return caller ? atomic_load_explicit(&c->done, memory_order_acquire)
                  : atomic_load_explicit(&c->stop, memory_order_relaxed);
}

/* Poll ready() for at most ns; 1 if it came. */
static int poll_ready(pf_cpu *c, uint32_t seen, int caller, uint64_t ns) {
    const uint64_t until = now_ns() + ns;
    for (int i = 1;; i++) {
        if (ready(c, seen, caller)) return 1;
        cpu_relax();
        if (i % 64 == 0 && now_ns() > until) return 0;
    }
}

/* Whether thread idx takes part in jobs now (pf_cpu_set_active). */
static int is_active(pf_cpu *c, int idx) { return idx < atomic_load_explicit(&c->active, memory_order_relaxed); }

/* A worker: wait for a phase newer than `seen` (or stop); poll first for PF_CPU_POLL_NS if
 * `poll`, and, while it is active, for as long as a prewake deadline lasts (pf_cpu_prewake wakes
 * sleepers to poll); an inactive worker sleeps until something happens. */
static uint64_t wait_phase(pf_cpu *c, int idx, uint32_t seen, int poll) {
    uint64_t ns = poll ? PF_CPU_POLL_NS : 0;
    for (;;) {
        const int lingers = is_active(c, idx);
        const uint64_t now = now_ns(), until = lingers ? atomic_load_explicit(&c->linger_until, memory_order_relaxed) : 0;
        if (until > now && until - now > ns) ns = until - now;
        if (ns && poll_ready(c, seen, 0, ns)) break;
        pthread_mutex_lock(&c->mu);
        while (!ready(c, seen, 0)
               && (!is_active(c, idx) || atomic_load_explicit(&c->linger_until, memory_order_relaxed) <= now_ns()))
            pthread_cond_wait(&c->work_cv, &c->mu);
        const int r = ready(c, seen, 0);
        pthread_mutex_unlock(&c->mu);
        if (r) break;
        ns = 0; /* woken by a prewake: poll until its deadline */
    }
    return atomic_load_explicit(&c->state, memory_order_acquire);
}

static void *worker_main(void *p) {
    struct worker_arg a = *(struct worker_arg *)p;
    free(p);
    pf_cpu *c = a.c;
    uint32_t seen = 0;
    int poll = 0; /* only between phases of a job: an idle pool sleeps */
    for (;;) {
        uint64_t st = wait_phase(c, a.idx, seen, poll);
        if (atomic_load_explicit(&c->stop, memory_order_relaxed)) break;
        seen = ST_SEQ(st);
        if (!is_active(c, a.idx)) { /* sits this phase out: the active threads claim every unit */
            poll = 0;
            continue;
        }
        work_phase(c, a.idx, st);
        poll = !ST_LAST(st);
    }
    return NULL;
}

/* Run phases first..last of c->cur on every thread (the caller is thread 0); return when the
 * last phase has been completed. */
static void run_job(pf_cpu *c, int first, int last) {
    memset(c->t_pub, 0, sizeof c->t_pub);
    memset(c->t_done, 0, sizeof c->t_done);
    memset(c->t_join, 0, (size_t)c->threads * sizeof c->t_join[0]);
    c->t_start = now_ns();
    c->timed = 1;
    pthread_mutex_lock(&c->mu);
    atomic_store_explicit(&c->done, 0, memory_order_relaxed);
    c->last_phase = last;
    publish(c, first);
    pthread_mutex_unlock(&c->mu);
    uint32_t seen = 0;
    for (;;) {
        uint64_t st = atomic_load_explicit(&c->state, memory_order_acquire);
        if (atomic_load_explicit(&c->done, memory_order_acquire)) break;
        if (ST_SEQ(st) != seen) {
            seen = ST_SEQ(st);
            work_phase(c, 0, st);
            continue;
        }
        /* its grabs are done; the others are finishing theirs: poll, then sleep */
        if (poll_ready(c, seen, 1, PF_CPU_POLL_NS)) continue;
        pthread_mutex_lock(&c->mu);
        while (!ready(c, seen, 1)) pthread_cond_wait(&c->done_cv, &c->mu);
        pthread_mutex_unlock(&c->mu);
    }
    c->t_end = now_ns();
}

static void stop_workers(pf_cpu *c) {
    pthread_mutex_lock(&c->mu);
    atomic_store_explicit(&c->stop, 1, memory_order_relaxed);
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->started; i++) pthread_join(c->tids[i], NULL);
    c->started = 0;
}

int pf_cpu_create(int threads, int level, pf_cpu **out) {
    if (!out) return PF_CPU_EINVAL;
    *out = NULL;
    if (threads < 1 || threads > PF_CPU_MAX_THREADS) return PF_CPU_EINVAL;
    int best = pf_cpu_detect();
    if (level == PF_CPU_LEVEL_AUTO) level = best;
    if (level < PF_CPU_LEVEL_SCALAR || level > PF_CPU_LEVEL_AMX_BF16) return PF_CPU_EINVAL;
    if (level > best) return PF_CPU_EUNSUPPORTED;
    pthread_once(&scale_once, init_scale);

    /* 64-byte aligned (C11: a size that is a multiple of it), for POOL_LINES (see struct pf_cpu) */
    pf_cpu *c = aligned_alloc(ALIGN, (sizeof *c + ALIGN - 1) / ALIGN * ALIGN);
    if (!c) return PF_CPU_ENOMEM;
    memset(c, 0, sizeof *c);
    c->level = level;
    c->threads = threads;
    atomic_init(&c->active, threads);
    atomic_init(&c->invariant, 0);
    c->mx_rows = mx_rows_scalar;
    c->dense_cols = dense_cols_scalar;
    c->dense_rows = dense_rows_scalar;
    c->read = read_scalar;
#if PF_X86
    if (level >= PF_CPU_LEVEL_AVX2) {
        c->mx_rows = mx_rows_avx2;
        c->dense_cols = dense_cols_avx2;
        c->dense_rows = dense_rows_avx2;
        c->read = read_avx2;
    }
    if (level >= PF_CPU_LEVEL_AVX512) {
        c->mx_rows = mx_rows_512;
        c->dense_cols = dense_cols_512;
        c->dense_rows = dense_rows_512;
        c->read = read_512;
        c->chunked = 1;
    }
    if (level >= PF_CPU_LEVEL_AVX512_BF16) {
        c->mx_rows_bf16 = mx_rows_bf16;
        c->dense_rows = dense_rows_bf16;
    }
#if defined(PF_AMX_EMULATE) && defined(PF_AMX_EMULATE_CONTEXTS)
    /* a test build (tests/test_cpu_experts.py): the software tiles stand in for AMX wherever the bf16 kernels run */
    if (level >= PF_CPU_LEVEL_AVX512_BF16) {
        c->mx_rows_amx = mx_rows_amx;
        c->rows_amx = dense_rows_amx;
    }
#else
    if (level >= PF_CPU_LEVEL_AMX_BF16) {
        c->mx_rows_amx = mx_rows_amx;
        c->rows_amx = dense_rows_amx;
    }
#endif
#endif
    if (threads > 1) {
        c->tids = calloc((size_t)threads - 1, sizeof *c->tids);
        if (!c->tids) {
            free(c);
            return PF_CPU_ENOMEM;
        }
    }
    pthread_mutex_init(&c->call_mu, NULL);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->done_cv, NULL);
    atomic_init(&c->state, 0);
    atomic_init(&c->claim, 0);
    atomic_init(&c->completed, 0);
    atomic_init(&c->done, 0);
    atomic_init(&c->stop, 0);
    atomic_init(&c->linger_until, 0);
    for (int i = 1; i < threads; i++) {
        struct worker_arg *a = malloc(sizeof *a); /* owned by the worker once it has started */
        int rc = ENOMEM;
        if (a) {
            a->c = c;
            a->idx = i;
            rc = pthread_create(&c->tids[i - 1], NULL, worker_main, a);
        }
        if (rc != 0) {
            free(a);
            pf_cpu_destroy(c);
            return rc == ENOMEM ? PF_CPU_ENOMEM : PF_CPU_ETHREAD;
        }
        c->started++;
    }
    *out = c;
    return PF_CPU_OK;
}

void pf_cpu_destroy(pf_cpu *c) {
    if (!c) return;
    stop_workers(c);
    pthread_cond_destroy(&c->done_cv);
    pthread_cond_destroy(&c->work_cv);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->call_mu);
    free(c->tids);
    free(c->xp);
    free(c->xb);
    free(c->gu);
    free(c->h);
    free(c->hb);
    free(c->y);
    free(c->tasks);
    free(c);
}

int pf_cpu_prewake(pf_cpu *c, unsigned us) {
    if (!c || us > 100000u) return PF_CPU_EINVAL;
    if (us == 0 || atomic_load_explicit(&c->active, memory_order_relaxed) < 2) return PF_CPU_OK;
    const uint64_t until = now_ns() + (uint64_t)us * 1000u;
    pthread_mutex_lock(&c->mu);
    if (until > atomic_load_explicit(&c->linger_until, memory_order_relaxed)) {
        atomic_store_explicit(&c->linger_until, until, memory_order_relaxed);
        pthread_cond_broadcast(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return PF_CPU_OK;
}

int pf_cpu_last_timing(pf_cpu *c, pf_cpu_timing *out) {
    if (!c || !out) return PF_CPU_EINVAL;
    pthread_mutex_lock(&c->call_mu);
    int rc = c->timed ? PF_CPU_OK : PF_CPU_EINVAL;
    if (c->timed) {
        memset(out, 0, sizeof *out);
        const uint64_t t0 = c->t_start;
        for (int p = 0; p < 4; p++) {
            if (!c->t_pub[p]) continue;
            out->published[p] = c->t_pub[p] - t0;
            out->completed[p] = c->t_done[p] ? c->t_done[p] - t0 : 0;
            for (int i = 0; i < c->threads; i++) {
                uint64_t j = c->t_join[i].at[p];
                if (!j) continue;
                j -= t0;
                if (!out->joined[p]++ || j < out->first_join[p]) out->first_join[p] = j;
                if (j > out->last_join[p]) out->last_join[p] = j;
            }
        }
        out->end = c->t_end - t0;
    }
    pthread_mutex_unlock(&c->call_mu);
    return rc;
}

int pf_cpu_level(const pf_cpu *c) { return c ? c->level : PF_CPU_EINVAL; }
int pf_cpu_threads(const pf_cpu *c) { return c ? c->threads : PF_CPU_EINVAL; }

int pf_cpu_set_active(pf_cpu *c, int n) {
    if (!c || n < 1 || n > c->threads) return PF_CPU_EINVAL;
    pthread_mutex_lock(&c->mu); /* under mu: a worker deciding to sleep sees it, or is woken */
    atomic_store_explicit(&c->active, n, memory_order_relaxed);
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    return PF_CPU_OK;
}

int pf_cpu_active(pf_cpu *c) { return c ? atomic_load_explicit(&c->active, memory_order_relaxed) : PF_CPU_EINVAL; }

int pf_cpu_set_invariant(pf_cpu *c, int on) {
    if (!c) return PF_CPU_EINVAL;
    atomic_store_explicit(&c->invariant, on != 0, memory_order_relaxed);
    return PF_CPU_OK;
}

int pf_cpu_invariant(pf_cpu *c) { return c ? atomic_load_explicit(&c->invariant, memory_order_relaxed) : PF_CPU_EINVAL; }

/* grow *buf to at least n elements of `size` bytes (contents not kept) */
static int reserve(void **buf, size_t *cap, size_t n, size_t size) {
    if (*cap >= n) return 0;
    if (n == 0) return 0;
    size_t bytes = (n * size + ALIGN - 1) / ALIGN * ALIGN;
    void *p = aligned_alloc(ALIGN, bytes);
    if (!p) return -1;
    free(*buf);
    *buf = p;
    *cap = n;
    return 0;
}

static int check_weights(const pf_cpu_weights *w) {
    if (!w || w->hidden < 1 || w->inter < 1 || !w->gate_up || !w->down) return 0;
    if (w->hidden > (1 << 24) || w->inter > (1 << 24)) return 0;
    if (w->bias_format != PF_CPU_F32 && w->bias_format != PF_CPU_BF16) return 0;
    if (w->round_bf16 != 0 && w->round_bf16 != 1) return 0;
    if (w->format == PF_CPU_MXFP4)
        return w->hidden % 32 == 0 && w->inter % 32 == 0 && w->gate_up_scales && w->down_scales;
    if (is_rows(w->format)) {
        if (w->gate_up_bias || w->down_bias) return 0;
        if (w->format != PF_CPU_FP8_ROWS) return 1;
        return w->block >= 1 && w->hidden % w->block == 0 && w->inter % w->block == 0 && w->gate_up_scales &&
               w->down_scales && (w->scale_format == PF_CPU_F32 || w->scale_format == PF_CPU_BF16);
    }
    return w->format == PF_CPU_F32 || w->format == PF_CPU_BF16;
}

/* Check a call, lay out its tasks and scratch (under call_mu), run phases 0-2. */
static int run_experts(pf_cpu *c, int n, const pf_cpu_weights *const *w, const int *counts, const int *rows,
                       const float *scale, const void *x, int x_format, int x_rows, int x_stride, float *out,
                       const int *dest, int out_rows, int out_stride) {
    if (x_format != PF_CPU_F32 && x_format != PF_CPU_BF16) return PF_CPU_EINVAL;
    if (x_rows < 1 || out_rows < 1 || x_stride < 1 || out_stride < 1) return PF_CPU_EINVAL;
    const int H = w[0] ? w[0]->hidden : 0;
    if (x_stride < H || out_stride < H) return PF_CPU_EINVAL;
    size_t nx = 0, ngu = 0, nh = 0, nb = 0, nhb = 0;
    long long total = 0, u1 = 0, u2 = 0;
    for (int k = 0; k < n; k++) {
        if (!check_weights(w[k]) || w[k]->hidden != H) return PF_CPU_EINVAL;
        if (counts[k] < 1 || counts[k] > PF_CPU_MAX_TOKENS) return PF_CPU_EINVAL;
        total += counts[k];
        u1 += (2 * w[k]->inter + unit_of(w[k]) - 1) / unit_of(w[k]);
        u2 += (H + unit_of(w[k]) - 1) / unit_of(w[k]);
    }
    if (total > (1 << 24) || u1 > (1 << 30) || u2 > (1 << 30)) return PF_CPU_EINVAL;
    for (long long i = 0; i < total; i++)
        if (rows[i] < 0 || rows[i] >= x_rows || dest[i] < 0 || dest[i] >= out_rows) return PF_CPU_EINVAL;
    uint8_t *seen = calloc((size_t)out_rows, 1); /* owned here: every output row written at most once */
    if (!seen) return PF_CPU_ENOMEM;
    int dup = 0;
    for (long long i = 0; i < total && !dup; i++) dup = seen[dest[i]]++ != 0;
    free(seen);
    if (dup) return PF_CPU_EINVAL;

    pthread_mutex_lock(&c->call_mu);
    if (reserve((void **)&c->tasks, &c->tasks_cap, (size_t)n, sizeof(task))) {
        pthread_mutex_unlock(&c->call_mu);
        return PF_CPU_ENOMEM;
    }
    int first1 = 0, first2 = 0, base = 0;
    /* AMX tiles for experts of AMX_MIN_TOKENS tokens or more, unless the calls are batch invariant */
    const int amx = !atomic_load_explicit(&c->invariant, memory_order_relaxed);
    for (int k = 0; k < n; k++) {
        const int T = counts[k], I = w[k]->inter, unit = unit_of(w[k]);
        const int mx = w[k]->format == PF_CPU_MXFP4;
        task *tk = &c->tasks[k];
        /* bf16 dot products where both factors are bf16 values: bf16 inputs; h of a bf16 model */
        tk->w = w[k];
        tk->T = T;
        tk->bf16_x = mx && x_format == PF_CPU_BF16 && c->mx_rows_bf16 != NULL;
        tk->bf16_h = mx && w[k]->round_bf16 && c->mx_rows_bf16 != NULL;
        tk->amx_x = tk->bf16_x && amx && c->mx_rows_amx != NULL && T >= AMX_MIN_TOKENS;
        tk->amx_h = tk->bf16_h && amx && c->mx_rows_amx != NULL && T >= AMX_MIN_TOKENS;
        /* a bf16 model's rows (bf16 values in, exact products) on the tiles: whole 32-weight chunks */
        tk->amx_rows = amx && c->rows_amx != NULL && T >= AMX_MIN_TOKENS && is_rows(w[k]->format) &&
                       w[k]->round_bf16 && H % 32 == 0 && I % 32 == 0 &&
                       (w[k]->format != PF_CPU_FP8_ROWS || w[k]->block % 32 == 0);
        if (tk->amx_rows) tk->bf16_x = tk->bf16_h = tk->amx_x = tk->amx_h = 1;
        tk->scale = scale ? scale + base : NULL;
        tk->dest = dest + base;
        tk->xo = tk->bf16_x ? nb : nx;
        if (tk->bf16_x) nb += tk->amx_x ? amx_elems((size_t)H) : (size_t)T * pad128((size_t)H);
        else nx += (size_t)T * H;
        tk->guo = ngu;
        ngu += (size_t)T * 2 * I;
        tk->ho = tk->bf16_h ? nhb : nh;
        if (tk->bf16_h) nhb += tk->amx_h ? amx_elems((size_t)I) : (size_t)T * pad128((size_t)I);
        else nh += (size_t)T * I;
        tk->yo = (size_t)base * H;
        /* AMX rows: grabs of whole tiles (16 gate and 16 up rows; 16 down rows), not of 4 rows */
        tk->unit1 = tk->amx_rows ? 32 : tk->amx_x ? 16 : unit;
        tk->unit2 = tk->amx_rows || tk->amx_h ? 16 : unit;
        tk->u1 = first1;
        tk->u2 = first2;
        first1 += (2 * I + tk->unit1 - 1) / tk->unit1;
        first2 += (H + tk->unit2 - 1) / tk->unit2;
        base += T;
    }
    int bad = reserve((void **)&c->xp, &c->xp_cap, nx, sizeof(float)) ||
              reserve((void **)&c->xb, &c->xb_cap, nb, sizeof(uint16_t)) ||
              reserve((void **)&c->gu, &c->gu_cap, ngu, sizeof(float)) ||
              reserve((void **)&c->h, &c->h_cap, nh, sizeof(float)) ||
              reserve((void **)&c->hb, &c->hb_cap, nhb, sizeof(uint16_t)) ||
              reserve((void **)&c->y, &c->y_cap, (size_t)total * H, sizeof(float));
    if (bad) {
        pthread_mutex_unlock(&c->call_mu);
        return PF_CPU_ENOMEM;
    }
    c->cur = (job){.tasks = c->tasks, .ntasks = n, .units1 = first1, .units2 = first2, .x = x, .x_format = x_format,
                   .x_size = x_format == PF_CPU_BF16 ? 2 : 4, .x_stride = x_stride, .xrow = rows, .nrows = (int)total,
                   .out = out, .out_stride = out_stride};
    if (total <= PREPARE_INLINE_ROWS) { /* a few rows: cheaper here than one more hand-off of the pool */
        prepare_rows(c, &c->cur, 0, (int)total);
        run_job(c, 1, 2);
    } else {
        run_job(c, 0, 2);
    }
    c->cur = (job){0};
    pthread_mutex_unlock(&c->call_mu);
    return PF_CPU_OK;
}

int pf_cpu_experts(pf_cpu *c, int n, const pf_cpu_weights *const *w, const int *counts, const int *rows,
                   const float *scale, const void *x, int x_format, int x_rows, int x_stride, float *out,
                   const int *dest, int out_rows, int out_stride) {
    if (!c || n < 0) return PF_CPU_EINVAL;
    if (n == 0) return PF_CPU_OK;
    if (!w || !counts || !rows || !x || !out || !dest) return PF_CPU_EINVAL;
    return run_experts(c, n, w, counts, rows, scale, x, x_format, x_rows, x_stride, out, dest, out_rows, out_stride);
}

int pf_cpu_expert(pf_cpu *c, const pf_cpu_weights *w, const void *x, int x_format, int tokens, int x_stride,
                  float *out) {
    if (!c || !x || !out || !check_weights(w)) return PF_CPU_EINVAL;
    if (tokens < 1 || tokens > PF_CPU_MAX_TOKENS) return PF_CPU_EINVAL;
    static const int ident[PF_CPU_MAX_TOKENS] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return run_experts(c, 1, &w, &tokens, ident, NULL, x, x_format, tokens, x_stride, out, ident, tokens, w->hidden);
}

int pf_cpu_stream_read(pf_cpu *c, const void *buf, size_t nbytes, uint64_t *sum) {
    if (!c || !buf || !sum) return PF_CPU_EINVAL;
    uint64_t *parts = calloc((size_t)c->threads, sizeof *parts); /* owned here, one slot per thread */
    if (!parts) return PF_CPU_ENOMEM;
    pthread_mutex_lock(&c->call_mu);
    size_t whole = nbytes / 8 * 8;
    c->cur = (job){.rbuf = (const uint8_t *)buf, .rbytes = whole, .rsum = parts};
    run_job(c, 3, 3);
    c->cur = (job){0};
    pthread_mutex_unlock(&c->call_mu);
    uint64_t total = 0;
    for (int i = 0; i < c->threads; i++) total += parts[i];
    if (whole < nbytes) { /* the last few bytes, as one zero-padded word */
        uint64_t tail = 0;
        memcpy(&tail, (const uint8_t *)buf + whole, nbytes - whole);
        total += tail;
    }
    free(parts);
    *sum = total;
    return PF_CPU_OK;
}
