/* The AMX kernel's layout, checked where no AMX runs: pf_cpu.c built with software tiles
 * (PF_AMX_EMULATE: the same decode, fold, transpose, tile loads and stores; the tile multiply
 * in C), its results against the portable kernel on random MXFP4 rows, for 1 .. 16 tokens,
 * row ranges that cut 16-row blocks, partial last chunks, and blocks with scales the fold
 * cannot take. Needs AVX-512 (F, BW, VL) for the decode; elsewhere it reports one skip.
 *
 *   cc -std=c11 -O2 -pthread -Inative -o amx_check native/stress/amx_check.c -lm && ./amx_check --quick
 *
 * Built with -DPF_AMX_HARDWARE the same checks run the real tile instructions (make
 * amx-check-hw); where the CPU or the OS offers no AMX that build reports one skip.
 */
#ifndef PF_AMX_HARDWARE
#define PF_AMX_EMULATE 1
#endif
#include "../pf_cpu.c"

#include <stdio.h>

static int passed, failed;

static void count(int ok, const char *what) {
    if (ok) {
        passed++;
    } else {
        failed++;
        if (failed <= 10) printf("FAILED: %s\n", what);
    }
}

static uint64_t rng_state = 88172645463325252ULL;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static uint16_t to_bf16(float f) { /* truncation: any bf16 value serves as input */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)(u >> 16);
}

/* y (the tiles) against ref (the portable kernel), T tokens x `rows` rows (token-major), rows
 * [r0, r1) computed, the others still -12345: NaN and inf as ref has them, every other result
 * within 1e-5 of the sum of |w x| (mag(ctx, r, t)), which bounds the rounding of any order of
 * summation. Counts the result as `what`. */
static void compare(const float *y, const float *ref, int T, int rows, int r0, int r1,
                    double (*mag)(const void *ctx, int r, int t), const void *ctx, const char *what) {
    int ok = 1, untouched = 1;
    for (int t = 0; t < T; t++)
        for (int r = 0; r < rows; r++) {
            const float a = y[t * rows + r], b = ref[t * rows + r];
            if (r < r0 || r >= r1) untouched = untouched && a == -12345.0f;
            else if (isinf(b) || isnan(b)) ok = ok && (isnan(b) ? isnan(a) : a == b);
            else ok = ok && fabs((double)a - b) <= 1e-5 * mag(ctx, r, t) + 1e-30;
        }
    count(ok, what);
    count(untouched, "rows outside [r0, r1) untouched");
}

typedef struct {
    const uint8_t *blocks, *scales;
    const float *xf;
    int in;
} mx_case;

static double mx_mag(const void *ctx, int r, int t) {
    const mx_case *k = ctx;
    const int G = k->in / 32;
    const uint8_t *bp = k->blocks + (size_t)r * G * 16, *sp = k->scales + (size_t)r * G;
    double mag = 0.0;
    for (int e = 0; e < k->in; e++) {
        uint8_t v = bp[e / 2];
        mag += fabs((double)FP4[(e & 1) ? v >> 4 : v & 15] * SCALE[sp[e / 32]] * k->xf[(size_t)t * k->in + e]);
    }
    return mag;
}

/* one configuration: `rows` rows of `in` elements, tokens T, rows [r0, r1) computed */
static void check(int in, int rows, int T, int r0, int r1, int extreme) {
    const int G = in / 32;
    uint8_t *blocks = malloc((size_t)rows * G * 16), *scales = malloc((size_t)rows * G);
    float *xf = calloc((size_t)T * in, sizeof(float)), *xp = calloc((size_t)T * in, sizeof(float));
    uint16_t *xb = aligned_alloc(64, amx_elems((size_t)in) * sizeof(uint16_t));
    float *y = malloc((size_t)T * rows * sizeof(float)), *ref = malloc((size_t)T * rows * sizeof(float));
    for (int i = 0; i < rows * G * 16; i++) blocks[i] = (uint8_t)rnd();
    for (int i = 0; i < rows * G; i++) scales[i] = (uint8_t)(119 + rnd() % 9); /* 2^-8 .. 2^0, as trained */
    if (extreme) scales[(r0 + (r1 - r0) / 2) * G + G / 2] = extreme == 1 ? 0 : 255;
    for (size_t i = 0; i < amx_elems((size_t)in); i++) xb[i] = 0x7fc0; /* NaN in every unused token column */
    for (int t = 0; t < T; t++)
        for (int e = 0; e < in; e++) {
            uint16_t v = to_bf16(((float)(rnd() % 2001) - 1000.0f) / 250.0f);
            xf[(size_t)t * in + e] = pf_bf16_to_f32(v);
            xp[(size_t)t * in + mx_pos((size_t)e)] = pf_bf16_to_f32(v);
            xb[amx_pos((size_t)t, (size_t)e)] = v;
        }
    for (int t = 0; t < T; t++) amx_zero_pad(xb, (size_t)in, (size_t)t); /* as the kernel's writers do */
    { /* phase 0's vector writer (mx_amx_x) against the element-wise layout, in reversed token order */
        uint16_t *xr = calloc((size_t)T * in, sizeof(uint16_t)), *xv = aligned_alloc(64, amx_elems((size_t)in) * 2);
        int order[16] = {0};
        for (int t = 0; t < T; t++) {
            order[t] = T - 1 - t;
            for (int e = 0; e < in; e++) xr[(size_t)(T - 1 - t) * in + e] = to_bf16(xf[(size_t)t * in + e]);
        }
        mx_amx_x(xr, in, order, in, T, xv);
        int same = 1;
        for (int t = 0; t < T; t++)
            for (int e = 0; e < (in + 127) / 128 * 128; e++) same = same && xv[amx_pos((size_t)t, (size_t)e)] == xb[amx_pos((size_t)t, (size_t)e)];
        for (int t = T; t < 16; t++) same = same && xv[amx_pos((size_t)t, 0)] == 0;
        count(same, "mx_amx_x: the B tiles of amx_pos, zeros past the row and past T");
        free(xr);
        free(xv);
    }
    for (int i = 0; i < T * rows; i++) y[i] = ref[i] = -12345.0f;
    mx_rows_amx(blocks, scales, in, rows, r0, r1, xb, T, y, rows);
    mx_rows_scalar(blocks, scales, in, rows, r0, r1, xp, T, ref, rows);
    char what[160];
    snprintf(what, sizeof what, "in %d rows %d T %d [%d, %d) extreme %d", in, rows, T, r0, r1, extreme);
    const mx_case k = {blocks, scales, xf, in};
    compare(y, ref, T, rows, r0, r1, mx_mag, &k, what);
    free(blocks);
    free(scales);
    free(xf);
    free(xp);
    free(xb);
    free(y);
    free(ref);
}

typedef struct {
    const rows_w *m;
    const float *xf;
} rows_case;

static double rows_mag(const void *ctx, int r, int t) {
    const rows_case *k = ctx;
    double mag = 0.0;
    for (int e = 0; e < k->m->in; e++) mag += fabs((double)rows_weight(k->m, r, e) * k->xf[(size_t)t * k->m->in + e]);
    return mag;
}

/* The row formats' tiles (dense_rows_amx) against the portable row kernel, for a bf16 model's rows:
 * bf16, float32 and FP8 (blocks of 32 and 128, float32 or bf16 scales), `rows` rows of `in`,
 * T tokens, rows [r0, r1) computed (blocks of 16 cut at either end take the scratch tile). Both
 * compute with the same bf16 weights and exact products; the sums differ in order, so the bound
 * is the sum of |w x|. One FP8 NaN code: its row's results are NaN in both. */
static void check_rows(int fmt, int sfmt, int block, int in, int rows, int T, int r0, int r1, int nan_code) {
    const size_t esz = fmt == PF_CPU_F32_ROWS ? 4 : fmt == PF_CPU_BF16_ROWS ? 2 : 1;
    const int nb = fmt == PF_CPU_FP8_ROWS ? ((rows + block - 1) / block) * (in / block) : 0;
    uint8_t *w = malloc((size_t)rows * in * esz);
    void *scales = nb ? malloc((size_t)nb * 4) : NULL;
    float *xf = calloc((size_t)T * in, sizeof(float));
    uint16_t *xb = aligned_alloc(64, amx_elems((size_t)in) * sizeof(uint16_t));
    float *y = malloc((size_t)T * rows * sizeof(float)), *ref = malloc((size_t)T * rows * sizeof(float));
    for (size_t i = 0; i < (size_t)rows * in; i++) {
        const float v = ((float)(rnd() % 2001) - 1000.0f) / 700.0f;
        if (fmt == PF_CPU_BF16_ROWS) ((uint16_t *)w)[i] = to_bf16(v);
        else if (fmt == PF_CPU_F32_ROWS) ((float *)w)[i] = v;
        else w[i] = (uint8_t)(rnd() % 256 == 127 ? 0 : rnd()) & 0xff;
    }
    if (fmt == PF_CPU_FP8_ROWS)
        for (size_t i = 0; i < (size_t)rows * in; i++)
            if ((w[i] & 0x7f) == 0x7f) w[i] ^= 1; /* no NaN codes but the one asked for */
    if (nan_code) w[(size_t)(r0 + (r1 - r0) / 2) * in + in / 2] = 0x7f;
    for (int i = 0; i < nb; i++) {
        const float sc = ldexpf(1.0f + (float)(rnd() % 100) / 100.0f, -(int)(rnd() % 6));
        if (sfmt == PF_CPU_BF16) ((uint16_t *)scales)[i] = to_bf16(sc);
        else ((float *)scales)[i] = sc;
    }
    for (size_t i = 0; i < amx_elems((size_t)in); i++) xb[i] = 0x7fc0; /* NaN in every unused token column */
    for (int t = 0; t < T; t++)
        for (int e = 0; e < in; e++) {
            uint16_t v = to_bf16(((float)(rnd() % 2001) - 1000.0f) / 250.0f);
            xf[(size_t)t * in + e] = pf_bf16_to_f32(v);
            xb[amx_pos_rows((size_t)t, (size_t)e)] = v;
        }
    for (int i = 0; i < T * rows; i++) y[i] = ref[i] = -12345.0f;
    const rows_w m = {.w = w, .scales = scales, .fmt = fmt, .sfmt = sfmt, .block = block, .in = in, .round = 1};
    dense_rows_amx(&m, r0, r1, xb, T, y, rows);
    dense_rows_scalar(&m, r0, r1, xf, T, ref, rows);
    char what[200];
    snprintf(what, sizeof what, "rows format %d scales %d block %d in %d rows %d T %d [%d, %d) nan %d", fmt, sfmt,
             block, in, rows, T, r0, r1, nan_code);
    const rows_case k = {&m, xf};
    compare(y, ref, T, rows, r0, r1, rows_mag, &k, what);
    free(w);
    free(scales);
    free(xf);
    free(xb);
    free(y);
    free(ref);
}

/* The whole call (pf_cpu_expert: token rows, gate_up, SwiGLU, down) on a context whose AMX kernel is
 * the software tiles: with pf_cpu_set_invariant on, each token of a T-token call (T >= AMX_MIN_TOKENS,
 * the tiles' range) gives its one-token call's result bit for bit; off, the tiles take those calls
 * and, where the sums are long enough to round (`must_differ`: gpt-oss's 2880), some result differs
 * in the last bits (the check that the tiles ran at all; short sums of bf16 products are exact in
 * any order). */
static void check_invariant(int H, int I, int must_differ) {
    pf_cpu *c;
    if (pf_cpu_create(2, PF_CPU_LEVEL_AVX512_BF16, &c) != PF_CPU_OK) {
        printf("amx_check: invariance skipped (no avx512_bf16 context here)\n");
        return;
    }
    c->mx_rows_amx = mx_rows_amx; /* what an AMX level sets; the tiles are software ones here */
    const int G1 = H / 32, G2 = I / 32, T = 16;
    uint8_t *gb = malloc((size_t)2 * I * G1 * 16), *gs = malloc((size_t)2 * I * G1);
    uint8_t *db = malloc((size_t)H * G2 * 16), *ds = malloc((size_t)H * G2);
    uint16_t *x = malloc((size_t)T * H * sizeof(uint16_t));
    float *one = malloc((size_t)T * H * sizeof(float)), *all = malloc((size_t)T * H * sizeof(float));
    for (int i = 0; i < 2 * I * G1 * 16; i++) gb[i] = (uint8_t)rnd();
    for (int i = 0; i < 2 * I * G1; i++) gs[i] = (uint8_t)(119 + rnd() % 9);
    for (int i = 0; i < H * G2 * 16; i++) db[i] = (uint8_t)rnd();
    for (int i = 0; i < H * G2; i++) ds[i] = (uint8_t)(119 + rnd() % 9);
    for (int i = 0; i < T * H; i++) x[i] = to_bf16(((float)(rnd() % 2001) - 1000.0f) / 1000.0f);
    pf_cpu_weights w = {.format = PF_CPU_MXFP4, .hidden = H, .inter = I, .gate_up = gb, .gate_up_scales = gs,
                        .down = db, .down_scales = ds, .alpha = 1.702f, .limit = 7.0f, .round_bf16 = 1};
    int ok = pf_cpu_invariant(c) == 0 && pf_cpu_set_invariant(NULL, 1) == PF_CPU_EINVAL
             && pf_cpu_invariant(NULL) == PF_CPU_EINVAL;
    for (int t = 0; t < T; t++)
        ok = ok && pf_cpu_expert(c, &w, x + (size_t)t * H, PF_CPU_BF16, 1, H, one + (size_t)t * H) == PF_CPU_OK;
    int differs = 0;
    for (int inv = 0; inv < 2; inv++) {
        ok = ok && pf_cpu_set_invariant(c, inv ? 7 : 0) == PF_CPU_OK && pf_cpu_invariant(c) == inv;
        for (int n = AMX_MIN_TOKENS; n <= T; n += 3) {
            ok = ok && pf_cpu_expert(c, &w, x, PF_CPU_BF16, n, H, all) == PF_CPU_OK;
            const int same = memcmp(all, one, (size_t)n * H * sizeof(float)) == 0;
            if (inv) ok = ok && same;
            else differs += !same;
        }
    }
    char what[128];
    snprintf(what, sizeof what, "invariance H %d I %d: one-token results in every call (AMX taken off: %d calls differ)",
             H, I, differs);
    count(ok && (differs > 0 || !must_differ), what);
    pf_cpu_destroy(c);
    free(gb);
    free(gs);
    free(db);
    free(ds);
    free(x);
    free(one);
    free(all);
}

int main(int argc, char **argv) {
    int quick = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        if (!strcmp(argv[i], "--seed") && i + 1 < argc) rng_state += strtoull(argv[++i], NULL, 10) * 2654435761ULL;
    }
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl"))) {
        printf("amx_check: skipped (no AVX-512 here for the decode)\n");
        return 0;
    }
#ifdef PF_AMX_HARDWARE
    if (!amx_usable()) {
        printf("amx_check: skipped (no AMX tiles usable here)\n");
        return 0;
    }
    printf("amx_check: real AMX tiles\n");
#endif
    pthread_once(&scale_once, init_scale);
    const int ins[] = {32, 96, 160, 288, 512, 2880};
    const int reps = quick ? 1 : 4;
    for (int rep = 0; rep < reps; rep++)
        for (size_t k = 0; k < sizeof ins / sizeof ins[0]; k++) {
            const int in = ins[k];
            for (int T = 1; T <= 16; T += (in > 512 ? 5 : 1)) {
                check(in, 40, T, 0, 40, 0);
                check(in, 40, T, 3, 37, 0);    /* blocks of 16 cut at both ends */
                check(in, 21, T, 20, 21, 0);   /* one row */
                check(in, 40, T, 4, 36, 1);    /* a scale of 0 (2^-127): the exact fallback */
                check(in, 40, T, 8, 24, 2);    /* a scale of 255 (inf weights) */
            }
        }
    if (__builtin_cpu_supports("avx512bf16")) { /* rows_load32_bf16 rounds with AVX512_BF16 */
        const int rins[] = {32, 96, 256, 768, 2048};
        for (size_t k = 0; k < sizeof rins / sizeof rins[0]; k++) {
            const int in = rins[k];
            for (int T = 1; T <= 16; T += (in > 256 ? 5 : 3)) {
                check_rows(PF_CPU_BF16_ROWS, 0, 0, in, 48, T, 0, 48, 0);
                check_rows(PF_CPU_BF16_ROWS, 0, 0, in, 48, T, 5, 43, 0); /* blocks cut at both ends */
                check_rows(PF_CPU_F32_ROWS, 0, 0, in, 40, T, 3, 37, 0);
                check_rows(PF_CPU_FP8_ROWS, PF_CPU_F32, 32, in, 64, T, 0, 64, 0);
                check_rows(PF_CPU_FP8_ROWS, PF_CPU_BF16, 32, in, 64, T, 7, 50, 1);
                if (in % 128 == 0) check_rows(PF_CPU_FP8_ROWS, PF_CPU_F32, 128, in, 256, T, 16, 240, 1);
            }
        }
    } else {
        printf("amx_check: the row formats' tiles skipped (no avx512_bf16 here)\n");
    }
#ifndef PF_AMX_HARDWARE
    check_invariant(160, 96, 0);
    check_invariant(2880, 2880, 1);
#endif
    printf("amx_check: %d passed, %d failed\n", passed, failed);
    return failed != 0;
}
