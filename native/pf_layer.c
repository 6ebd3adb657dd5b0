/* pf_layer: one MoE layer's routed experts on the CPU, run from its routing (see pf_layer.h). */
#define _POSIX_C_SOURCE 200809L
#include "pf_layer.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct pf_layer {
    pf_layer_desc d;
    int positions;               /* rows * K */
    atomic_int tokens;           /* rows of the next run */
    atomic_uint prewake_us;
    atomic_int status;           /* last run */
    atomic_int experts_run;
    atomic_uint_least64_t ns;
    atomic_uint_least64_t runs;
    /* scratch, owned, sized for rows * K positions (and num_experts + 1 bucket starts) */
    int *start;                  /* [num_experts + 1]: first sorted position of each expert */
    int *sorted;                 /* [positions]: positions grouped by expert, ascending in each */
    const pf_cpu_weights **w;    /* [positions]: one entry per kernel call entry */
    int *counts;                 /* [positions] */
    int *rows;                   /* [positions] */
    int *dest;                   /* [positions] */
    float *scale;                /* [positions] */
};

int pf_layer_create(const pf_layer_desc *d, pf_layer **out) {
    if (!out) return PF_CPU_EINVAL;
    *out = NULL;
    if (!d || !d->cpu || !d->experts || !d->idx || !d->scale || !d->x || !d->out) return PF_CPU_EINVAL;
    if (d->num_experts < 1 || d->top_k < 1 || d->rows < 1 || d->hidden < 1) return PF_CPU_EINVAL;
    if (d->idx_bytes != 8 && d->idx_bytes != 4) return PF_CPU_EINVAL;
    if (d->x_format != PF_CPU_F32 && d->x_format != PF_CPU_BF16) return PF_CPU_EINVAL;
    if ((long long)d->rows * d->top_k > (1 << 24)) return PF_CPU_EINVAL;
    for (int e = 0; e < d->num_experts; e++)
        if (!d->experts[e] || d->experts[e]->hidden != d->hidden) return PF_CPU_EINVAL;
    pf_layer *L = calloc(1, sizeof *L);
    if (!L) return PF_CPU_ENOMEM;
    L->d = *d;
    L->positions = d->rows * d->top_k;
    size_t n = (size_t)L->positions;
    L->start = calloc((size_t)d->num_experts + 1, sizeof *L->start);
    L->sorted = calloc(n, sizeof *L->sorted);
    L->w = calloc(n, sizeof *L->w);
    L->counts = calloc(n, sizeof *L->counts);
    L->rows = calloc(n, sizeof *L->rows);
    L->dest = calloc(n, sizeof *L->dest);
    L->scale = calloc(n, sizeof *L->scale);
    if (!L->start || !L->sorted || !L->w || !L->counts || !L->rows || !L->dest || !L->scale) {
        pf_layer_destroy(L);
        return PF_CPU_ENOMEM;
    }
    atomic_init(&L->tokens, d->rows);
    atomic_init(&L->prewake_us, 0u);
    atomic_init(&L->status, PF_CPU_OK);
    atomic_init(&L->experts_run, 0);
    atomic_init(&L->ns, 0);
    atomic_init(&L->runs, 0);
    *out = L;
    return PF_CPU_OK;
}

void pf_layer_destroy(pf_layer *L) {
    if (!L) return;
    free(L->start);
    free(L->sorted);
    free(L->w);
    free(L->counts);
    free(L->rows);
    free(L->dest);
    free(L->scale);
    free(L);
}

int pf_layer_set_tokens(pf_layer *L, int tokens) {
    if (!L || tokens < 1 || tokens > L->d.rows) return PF_CPU_EINVAL;
    atomic_store(&L->tokens, tokens);
    return PF_CPU_OK;
}

int pf_layer_set_prewake(pf_layer *L, unsigned us) {
    if (!L || us > 100000) return PF_CPU_EINVAL;
    atomic_store(&L->prewake_us, us);
    return PF_CPU_OK;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static long long index_at(const pf_layer *L, int p) {
    if (L->d.idx_bytes == 8) return ((const int64_t *)L->d.idx)[p];
    return ((const int32_t *)L->d.idx)[p];
}

/* Group the first n positions by expert (counting sort: stable, so each expert's positions stay
 * ascending) and lay out the kernel's entries; returns the entry count, or -1 for an index out
 * of range. *distinct: experts routed. */
static int group(pf_layer *L, int n, int *distinct) {
    const int E = L->d.num_experts, K = L->d.top_k;
    const uint8_t *resident = L->d.resident;
    memset(L->start, 0, ((size_t)E + 1) * sizeof *L->start);
    for (int p = 0; p < n; p++) {
        long long e = index_at(L, p);
        if (e < 0 || e >= E) return -1;
        if (resident && resident[e]) { /* computed elsewhere: its row is zero here */
            memset(L->d.out + (size_t)p * (size_t)L->d.hidden, 0, (size_t)L->d.hidden * sizeof(float));
            continue;
        }
        L->start[e + 1]++;
    }
    int routed = 0;
    for (int e = 0; e < E; e++) {
        routed += L->start[e + 1] > 0;
        L->start[e + 1] += L->start[e];
    }
    /* fill: start[e] walks up to the end of expert e's run, then is restored below */
    for (int p = 0; p < n; p++) {
        long long e = index_at(L, p);
        if (!(resident && resident[e])) L->sorted[L->start[e]++] = p;
    }
    for (int e = E; e > 0; e--) L->start[e] = L->start[e - 1];
    L->start[0] = 0;
    int entries = 0, i = 0;
    for (int e = 0; e < E; e++) {
        for (int left = L->start[e + 1] - L->start[e]; left > 0;) {
            int c = left < PF_CPU_MAX_TOKENS ? left : PF_CPU_MAX_TOKENS;
            L->w[entries] = L->d.experts[e];
            L->counts[entries++] = c;
            for (int j = 0; j < c; j++, i++) {
                int p = L->sorted[i];
                L->rows[i] = p / K;
                L->dest[i] = p;
                L->scale[i] = L->d.scale[p];
            }
            left -= c;
        }
    }
    *distinct = routed;
    return entries;
}

int pf_layer_run(pf_layer *L) {
    if (!L) return PF_CPU_EINVAL;
    uint64_t t0 = now_ns();
    const int K = L->d.top_k, H = L->d.hidden;
    int tokens = atomic_load(&L->tokens);
    int n = tokens * K, distinct = 0;
    int entries = group(L, n, &distinct);
    int rc;
    if (entries < 0) {
        rc = PF_CPU_EINVAL;
    } else {
        rc = pf_cpu_experts(L->d.cpu, entries, L->w, L->counts, L->rows, L->scale, L->d.x, L->d.x_format,
                            L->d.rows, H, L->d.out, L->dest, L->positions, H);
    }
    if (rc != PF_CPU_OK) {
        memset(L->d.out, 0, (size_t)L->positions * (size_t)H * sizeof(float));
        distinct = 0;
    } else if (n < L->positions) {
        memset(L->d.out + (size_t)n * (size_t)H, 0, (size_t)(L->positions - n) * (size_t)H * sizeof(float));
    }
    unsigned us = atomic_load(&L->prewake_us);
    if (rc == PF_CPU_OK && us) pf_cpu_prewake(L->d.cpu, us);
    atomic_store(&L->status, rc);
    atomic_store(&L->experts_run, distinct);
    atomic_store(&L->ns, now_ns() - t0);
    atomic_fetch_add(&L->runs, 1);
    return rc;
}

void pf_layer_host_fn(void *layer) { (void)pf_layer_run((pf_layer *)layer); }

int pf_layer_result(pf_layer *L, int *status, int *experts, uint64_t *ns, uint64_t *runs) {
    if (!L) return PF_CPU_EINVAL;
    if (runs) *runs = atomic_load(&L->runs);
    if (status) *status = atomic_load(&L->status);
    if (experts) *experts = atomic_load(&L->experts_run);
    if (ns) *ns = atomic_load(&L->ns);
    return PF_CPU_OK;
}
