/*
 * The CPU expert kernel (native/pf_cpu.c) built with other values of its compile-time knobs,
 * timed on the machine it runs on: what benchmarks/kernel_sweep.sh builds once per variant.
 *
 *   cc -std=c11 -O2 -pthread -Inative [-DPREFETCH_ROWS=N] [-DMX_SUPER=M] [-DGRAB_SHARE=S] [-DGRAB_MAX=M] [-DGRAB_FIRST=P] [-DGRAB_STREAM=1] -o ks benchmarks/kernel_sweep.c -lm
 *   ./ks [--threads 12,14,16] [--experts 40] [--hidden 2880] [--inter 2880] [--calls 100] [--lead-us 200]
 *
 * Workload: --experts distinct MXFP4 experts (gpt-oss's layout: gate_up [2I][H/32][16] blocks and
 * [2I][H/32] E8M0 scales, down [H][I/32][16] and [H][I/32]; random values, scales 2^-8 .. 2^0) one
 * after another in one buffer, as the host store holds them, cycled so that every call reads its
 * weights from DRAM when the buffer is larger than the last-level cache. One bf16 token row, a
 * model rounding like bf16 (round_bf16), the runtime's bf16 decode. Per thread count, medians over
 * --calls calls:
 *   dram    pf_cpu_stream_read of the whole buffer by the same pool (best of 5): the read rate
 *           those threads have;
 *   one     pf_cpu_expert, one expert, 1 token;
 *   layer4 / layer8   pf_cpu_experts over 4 / 8 experts, 1 token each (a layer's CPU share).
 * Before each timed call the pool is woken (pf_cpu_prewake) --lead-us microseconds ahead, as the
 * runtime wakes it when a layer's routing is on its way, so the figures leave out a sleeping
 * pool's wake-up. Every variant's results are first checked against the portable kernel (level
 * scalar) in float32 (round_bf16 off): a knob that broke the maths fails the run (exit 1).
 * One JSON object per thread count on stdout.
 */
#include "../native/pf_cpu.c"

#include <stdio.h>
#if HUGE_PAGES
#include <sys/mman.h>
#endif

#ifndef HUGE_PAGES
#define HUGE_PAGES 0 /* 1: the weights on transparent huge pages (2 MiB), asked for before they are first written */
#endif

/* The weights' buffer (free_weights). HUGE_PAGES 0: malloc, so 4 KiB
 * pages where the kernel's transparent huge pages are "madvise" or "never", as for the host store
 * (torch.empty); 1: an anonymous mapping advised MADV_HUGEPAGE before its first write. */
#if HUGE_PAGES
static void *huge_map; /* the mapping alloc_weights made, and its length (free_weights unmaps it) */
static size_t huge_len;
#endif

static uint8_t *alloc_weights(size_t n) {
#if HUGE_PAGES
    const size_t huge = (size_t)2 << 20, len = (n + huge - 1) / huge * huge + huge;
    uint8_t *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    huge_map = m;
    huge_len = len;
    uint8_t *p = (uint8_t *)(((uintptr_t)m + huge - 1) & ~(uintptr_t)(huge - 1));
    if (madvise(p, (n + huge - 1) / huge * huge, MADV_HUGEPAGE) != 0) fprintf(stderr, "kernel_sweep: madvise(MADV_HUGEPAGE) failed\n");
    return p;
#else
    return malloc(n);
#endif
}

/* The process's anonymous memory on transparent huge pages, MiB (AnonHugePages of
 * /proc/self/smaps_rollup): whether HUGE_PAGES took effect; -1 where the file is not there. */
static double anon_huge_mib(void) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1.0;
    char line[256];
    double kb = -1024.0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %lf kB", &kb) == 1) break;
    fclose(f);
    return kb / 1024.0;
}

static void free_weights(uint8_t *p) {
#if HUGE_PAGES
    (void)p; /* inside huge_map */
    munmap(huge_map, huge_len);
#else
    free(p);
#endif
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 32);
}

static double seconds(void) { return 1e-9 * (double)now_ns(); } /* pf_cpu.c's monotonic clock */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void spin_us(double us) {
    const double until = seconds() + 1e-6 * us;
    while (seconds() < until) {
    }
}

/* Where a one-expert call's time goes, microseconds (medians over the calls): before its first
 * phase is published (checks, buffers, the token's row), gate_up (phase 1), the hand-off to down
 * (phase 1 completed -> phase 2 published), down (phase 2), after it (the caller seeing the end
 * and returning); the last thread to join each phase after its publication. */
#define NPARTS 7
static const char *const PART_NAMES[NPARTS] = {"setup", "gate_up", "handoff", "down", "finish", "last_join_gate_up",
                                               "last_join_down"};

/* median seconds of `calls` calls of n experts (k0, k0 + 1, ... cycling), the pool woken ahead;
 * `parts` (n = 1, else NULL): the medians of PART_NAMES */
static double time_calls(pf_cpu *c, pf_cpu_weights *w, int nexp, int n, int calls, const uint16_t *x, float *out,
                         int H, double lead_us, int *failed, double *parts) {
    double *t = malloc((size_t)calls * sizeof *t), *pt = malloc((size_t)calls * NPARTS * sizeof *pt);
    const pf_cpu_weights *ws[8];
    int counts[8], rows[8], dest[8];
    for (int i = 0; i < calls; i++) {
        for (int j = 0; j < n; j++) {
            ws[j] = &w[(i * n + j) % nexp];
            counts[j] = 1;
            rows[j] = 0;
            dest[j] = j;
        }
        pf_cpu_prewake(c, (unsigned)(lead_us + 1000));
        spin_us(lead_us);
        const uint64_t t0 = now_ns();
        const int rc = n == 1 ? pf_cpu_expert(c, ws[0], x, PF_CPU_BF16, 1, H, out)
                              : pf_cpu_experts(c, n, ws, counts, rows, NULL, x, PF_CPU_BF16, 1, H, out, dest, n, H);
        const uint64_t t1 = now_ns();
        t[i] = 1e-9 * (double)(t1 - t0);
        *failed |= rc != PF_CPU_OK;
        pf_cpu_timing tm;
        if (parts && pf_cpu_last_timing(c, &tm) == PF_CPU_OK) { /* times from the job's start, c->t_start */
            const double start = 1e-3 * (double)(c->t_start - t0);
            const double v[NPARTS] = {start + 1e-3 * tm.published[1], 1e-3 * (tm.completed[1] - tm.published[1]),
                                      1e-3 * (tm.published[2] - tm.completed[1]), 1e-3 * (tm.completed[2] - tm.published[2]),
                                      1e-3 * (double)(t1 - c->t_start) - 1e-3 * tm.completed[2],
                                      1e-3 * (tm.last_join[1] - tm.published[1]), 1e-3 * (tm.last_join[2] - tm.published[2])};
            for (int k = 0; k < NPARTS; k++) pt[(size_t)k * calls + i] = v[k];
        }
    }
    const double m = median(t, calls);
    for (int k = 0; parts && k < NPARTS; k++) parts[k] = median(pt + (size_t)k * calls, calls);
    free(t);
    free(pt);
    return m;
}

static int parse_list(const char *s, int *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 1 || v > PF_CPU_MAX_THREADS) return -1;
        out[n++] = (int)v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

int main(int argc, char **argv) {
    int threads[16] = {12, 14, 16}, nthreads = 3, nexp = 40, H = 2880, I = 2880, calls = 100;
    double lead_us = 200.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kernel_sweep: %s needs a value\n", a);
            return 2;
        }
        if (!strcmp(a, "--threads")) nthreads = parse_list(v, threads, 16);
        else if (!strcmp(a, "--experts")) nexp = atoi(v);
        else if (!strcmp(a, "--hidden")) H = atoi(v);
        else if (!strcmp(a, "--inter")) I = atoi(v);
        else if (!strcmp(a, "--calls")) calls = atoi(v);
        else if (!strcmp(a, "--lead-us")) lead_us = atof(v);
        else {
            fprintf(stderr, "kernel_sweep: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (nthreads < 1 || nexp < 8 || H < 32 || H % 32 || I < 32 || I % 32 || calls < 1 || lead_us < 0 || lead_us > 50000) {
        fprintf(stderr, "kernel_sweep: --threads N[,N...] (1..%d), --experts >= 8, --hidden and --inter multiples of "
                        "32, --calls >= 1, --lead-us 0..50000\n", PF_CPU_MAX_THREADS);
        return 2;
    }
    const size_t gb = (size_t)2 * I * (H / 32) * 16, gs = (size_t)2 * I * (H / 32);
    const size_t db = (size_t)H * (I / 32) * 16, ds = (size_t)H * (I / 32), per = gb + gs + db + ds;
    uint8_t *buf = alloc_weights(per * (size_t)nexp); /* owned here: every expert's bytes, one after another */
    pf_cpu_weights *w = calloc((size_t)nexp, sizeof *w);
    uint16_t *x = malloc((size_t)H * sizeof *x);
    float *out = malloc((size_t)8 * H * sizeof *out), *ref = malloc((size_t)H * sizeof *ref);
    if (!buf || !w || !x || !out || !ref) {
        fprintf(stderr, "kernel_sweep: out of memory\n");
        return 1;
    }
    for (size_t k = 0; k < (size_t)nexp; k++) {
        uint8_t *p = buf + k * per;
        for (size_t i = 0; i < gb; i++) p[i] = (uint8_t)rnd();
        for (size_t i = 0; i < gs; i++) p[gb + i] = (uint8_t)(119 + rnd() % 9);
        for (size_t i = 0; i < db; i++) p[gb + gs + i] = (uint8_t)rnd();
        for (size_t i = 0; i < ds; i++) p[gb + gs + db + i] = (uint8_t)(119 + rnd() % 9);
        w[k] = (pf_cpu_weights){.format = PF_CPU_MXFP4, .bias_format = PF_CPU_BF16, .hidden = H, .inter = I,
                                .gate_up = p, .gate_up_scales = p + gb, .down = p + gb + gs,
                                .down_scales = p + gb + gs + db, .alpha = 1.702f, .limit = 7.0f, .round_bf16 = 0};
    }
    for (int i = 0; i < H; i++) {
        const float f = ((float)(rnd() % 2001) - 1000.0f) / 1000.0f;
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        x[i] = (uint16_t)(u >> 16);
    }

    /* the variant's maths against the portable kernel (float32 throughout) */
    pf_cpu *c, *scalar;
    if (pf_cpu_create(2, PF_CPU_LEVEL_SCALAR, &scalar) != PF_CPU_OK || pf_cpu_create(2, PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
        fprintf(stderr, "kernel_sweep: cannot create a kernel context\n");
        return 1;
    }
    int ok = pf_cpu_expert(scalar, &w[1], x, PF_CPU_BF16, 1, H, ref) == PF_CPU_OK
             && pf_cpu_expert(c, &w[1], x, PF_CPU_BF16, 1, H, out) == PF_CPU_OK;
    double worst = 0.0, scale = 1e-30;
    for (int i = 0; i < H; i++) scale = fmax(scale, fabs((double)ref[i]));
    for (int i = 0; ok && i < H; i++) worst = fmax(worst, fabs((double)out[i] - ref[i]) / scale);
    const int level = pf_cpu_level(c);
    pf_cpu_destroy(c);
    pf_cpu_destroy(scalar);
    if (!ok || worst > 1e-3) {
        fprintf(stderr, "kernel_sweep: this variant's results are not the portable kernel's (max error %.3g of the "
                        "largest output)\n", worst);
        return 1;
    }
    for (int k = 0; k < nexp; k++) w[k].round_bf16 = 1;

    int failed = 0;
    for (int ti = 0; ti < nthreads; ti++) {
        if (pf_cpu_create(threads[ti], PF_CPU_LEVEL_AUTO, &c) != PF_CPU_OK) {
            fprintf(stderr, "kernel_sweep: cannot create a pool of %d threads\n", threads[ti]);
            return 1;
        }
        double best = 1e30;
        uint64_t sum;
        for (int r = 0; r < 5; r++) {
            const double t0 = seconds();
            failed |= pf_cpu_stream_read(c, buf, per * (size_t)nexp, &sum) != PF_CPU_OK;
            best = fmin(best, seconds() - t0);
        }
        const double dram = (double)(per * (size_t)nexp) / best / 1e9;
        double parts[NPARTS];
        const double one = time_calls(c, w, nexp, 1, calls, x, out, H, lead_us, &failed, parts);
        const double l4 = time_calls(c, w, nexp, 4, calls, x, out, H, lead_us, &failed, NULL);
        const double l8 = time_calls(c, w, nexp, 8, calls, x, out, H, lead_us, &failed, NULL);
        pf_cpu_destroy(c);
        printf("{\"prefetch_rows\": %d, \"mx_super\": %d, \"pool_lines\": %d, \"huge_pages\": %d, \"grab_share\": %d, "
               "\"grab_max\": %d, \"grab_first\": %d, \"grab_stream\": %d, \"anon_huge_mib\": %.0f, "
               "\"level\": \"%s\", \"threads\": %d, \"expert_bytes\": %zu, "
               "\"dram_gbps\": %.2f, \"one_ms\": %.4f, \"one_gbps\": %.2f, \"one_of_dram\": %.3f, "
               "\"layer4_ms\": %.4f, \"layer4_gbps\": %.2f, \"layer8_ms\": %.4f, \"layer8_gbps\": %.2f, "
               "\"layer8_of_dram\": %.3f, \"max_error\": %.3g, \"one_us\": {",
               PREFETCH_ROWS, MX_SUPER, POOL_LINES, HUGE_PAGES, GRAB_SHARE, GRAB_MAX, GRAB_FIRST, GRAB_STREAM, anon_huge_mib(), pf_cpu_level_name(level), threads[ti], per, dram, 1e3 * one,
               (double)per / one / 1e9, (double)per / one / 1e9 / dram, 1e3 * l4, 4.0 * per / l4 / 1e9, 1e3 * l8,
               8.0 * per / l8 / 1e9, 8.0 * per / l8 / 1e9 / dram, worst);
        for (int k = 0; k < NPARTS; k++) printf("%s\"%s\": %.2f", k ? ", " : "", PART_NAMES[k], parts[k]);
        printf("}}\n");
        fflush(stdout);
    }
    free_weights(buf);
    free(w);
    free(x);
    free(out);
    free(ref);
    if (failed) fprintf(stderr, "kernel_sweep: a kernel call failed\n");
    return failed;
}
