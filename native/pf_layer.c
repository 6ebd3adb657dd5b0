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
    atomic_uint_least64_t begin_ns;  /* last run: CLOCK_MONOTONIC at its start */
    atomic_uint_least64_t kernel_ns; /* last run: its kernel call(s) */
    atomic_uint_least64_t runs;
    /* scratch, owned, sized for rows * K positions (and num_experts + 1 bucket starts) */
    int *start;                  /* [num_experts + 1]: first sorted position of each expert */
    int *sorted;                 /* [positions]: positions grouped by expert, ascending in each */
    const pf_cpu_weights **w;    /* [positions]: one entry per kernel call entry */
    int *counts;                 /* [positions] */
    int *rows;                   /* [positions] */
    int *dest;                   /* [positions] */
    float *scale;                /* [positions] */
    uint8_t *skip;               /* [num_experts]: not computed in this pass */
    int *count;                  /* [num_experts]: positions routed to each expert in this run */
    /* fetching (has_fetch): the description, copied; the chosen experts and their tickets */
    int has_fetch;
    pf_layer_fetch f;
    int *picked;                 /* [stages] */
    uint64_t *tickets;           /* [stages] */
    int *slot;                   /* [stages]: the stage of picked[i] */
    uint8_t *busy;               /* [stages]: holds a task of this run */
    atomic_int fetched, fallback, fetch_off;
    atomic_uint_least64_t wait_ns;
    /* route-ahead: the context this one's runs prefetch for (pf_layer_set_ahead) */
    pf_layer *next;
    const int64_t *predicted;    /* [rows * K]: experts predicted for next */
    int ahead_most;
    /* route-ahead into this context's stages, by the previous context's run (has_fetch): prefetch
     * i went to stage i; resolved (claimed, or cancelled and waited for) by this context's next run */
    int ahead_n;
    int *ahead_e;                /* [stages] */
    uint64_t *ahead_ticket;      /* [stages] */
    int *pcount;                 /* [num_experts]: scratch of the previous context's prefetch */
    atomic_int ahead_sent, ahead_used, ahead_unused;
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
    L->skip = calloc((size_t)d->num_experts, 1);
    L->count = calloc((size_t)d->num_experts, sizeof *L->count);
    if (d->fetch) {
        const pf_layer_fetch *f = d->fetch;
        if (!f->sched || !f->src || !f->stage || f->stages < 1 || !f->plan || !f->stage_of || f->nbytes == 0
            || !(f->timeout_s > 0)) {
            pf_layer_destroy(L);
            return PF_CPU_EINVAL;
        }
        for (int e = 0; e < d->num_experts; e++)
            if (!f->src[e]) { pf_layer_destroy(L); return PF_CPU_EINVAL; }
        for (int i = 0; i < f->stages; i++)
            if (!f->stage[i]) { pf_layer_destroy(L); return PF_CPU_EINVAL; }
        L->has_fetch = 1;
        L->f = *f;
        L->d.fetch = &L->f;
        size_t S = (size_t)f->stages;
        L->picked = calloc(S, sizeof *L->picked);
        L->tickets = calloc(S, sizeof *L->tickets);
        L->slot = calloc(S, sizeof *L->slot);
        L->busy = calloc(S, 1);
        L->ahead_e = calloc(S, sizeof *L->ahead_e);
        L->ahead_ticket = calloc(S, sizeof *L->ahead_ticket);
        L->pcount = calloc((size_t)d->num_experts, sizeof *L->pcount);
        if (!L->picked || !L->tickets || !L->slot || !L->busy || !L->ahead_e || !L->ahead_ticket || !L->pcount) {
            pf_layer_destroy(L);
            return PF_CPU_ENOMEM;
        }
    }
    if (!L->start || !L->sorted || !L->w || !L->counts || !L->rows || !L->dest || !L->scale || !L->skip || !L->count) {
        pf_layer_destroy(L);
        return PF_CPU_ENOMEM;
    }
    atomic_init(&L->tokens, d->rows);
    atomic_init(&L->prewake_us, 0u);
    atomic_init(&L->status, PF_CPU_OK);
    atomic_init(&L->experts_run, 0);
    atomic_init(&L->ns, 0);
    atomic_init(&L->runs, 0);
    atomic_init(&L->fetched, 0);
    atomic_init(&L->fallback, 0);
    atomic_init(&L->fetch_off, 0);
    atomic_init(&L->wait_ns, 0);
    atomic_init(&L->ahead_sent, 0);
    atomic_init(&L->ahead_used, 0);
    atomic_init(&L->ahead_unused, 0);
    *out = L;
    return PF_CPU_OK;
}

static void drop_ahead(pf_layer *L);

void pf_layer_destroy(pf_layer *L) {
    if (!L) return;
    if (L->ahead_n) drop_ahead(L); /* its stages must be quiet before the caller frees them */
    free(L->start);
    free(L->sorted);
    free(L->w);
    free(L->counts);
    free(L->rows);
    free(L->dest);
    free(L->scale);
    free(L->skip);
    free(L->count);
    free(L->picked);
    free(L->tickets);
    free(L->slot);
    free(L->busy);
    free(L->ahead_e);
    free(L->ahead_ticket);
    free(L->pcount);
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

/* Count the first n positions' experts into count[]; -1 for an index out of range. */
static int count_experts(pf_layer *L, int n) {
    const int E = L->d.num_experts;
    memset(L->count, 0, (size_t)E * sizeof *L->count);
    for (int p = 0; p < n; p++) {
        long long e = index_at(L, p);
        if (e < 0 || e >= E) return -1;
        L->count[e]++;
    }
    return 0;
}

/* Group the first n positions by expert, leaving out the experts marked in skip (their out rows
 * are zeroed where zero_skipped), and lay out the kernel's entries (counting sort: stable, so
 * each expert's positions stay ascending); returns the entry count. Indices are in range
 * (count_experts). *distinct: experts grouped. */
static int group(pf_layer *L, int n, const uint8_t *skip, int zero_skipped, int *distinct) {
    const int E = L->d.num_experts, K = L->d.top_k;
    memset(L->start, 0, ((size_t)E + 1) * sizeof *L->start);
    for (int p = 0; p < n; p++) {
        long long e = index_at(L, p);
        if (skip[e]) { /* computed elsewhere: its row is zero here */
            if (zero_skipped)
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
        if (!skip[e]) L->sorted[L->start[e]++] = p;
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

static int call_kernel(pf_layer *L, int entries) {
    return pf_cpu_experts(L->d.cpu, entries, L->w, L->counts, L->rows, L->scale, L->d.x, L->d.x_format,
                          L->d.rows, L->d.hidden, L->d.out, L->dest, L->positions, L->d.hidden);
}

/* Resolve the prefetches a previous context's run made into L's stages without using them:
 * cancel each and wait until it has ended (a chunk in flight lands first), so that the stages
 * are quiet. A wait that times out turns fetching off (its stage may still be written). */
static void drop_ahead(pf_layer *L) {
    const pf_layer_fetch *f = &L->f;
    for (int i = 0; i < L->ahead_n; i++) {
        pf_cancel(f->sched, f->key_base + (uint64_t)L->ahead_e[i]);
        if (pf_wait(f->sched, L->ahead_ticket[i], f->timeout_s) == PF_TIMEOUT) atomic_store(&L->fetch_off, 1);
    }
    L->ahead_n = 0;
}

/* Route-ahead, from the previous context's run: the distinct experts of pred[0..n) that N does
 * not hold resident (most positions first, ties: the lower index), at most `most`, each
 * submitted at band 1 into N's stage i (i counting the submits that succeeded). Returns i. */
static int prefetch_into(pf_layer *N, const int64_t *pred, int n, int most) {
    if (N->ahead_n) drop_ahead(N); /* left by a run that never came: not expected */
    if (atomic_load(&N->fetch_off)) return 0;
    const int E = N->d.num_experts;
    const pf_layer_fetch *f = &N->f;
    memset(N->pcount, 0, (size_t)E * sizeof *N->pcount);
    for (int p = 0; p < n; p++)
        if (pred[p] >= 0 && pred[p] < E && !(N->d.resident && N->d.resident[pred[p]])) N->pcount[pred[p]]++;
    int want = most < f->stages ? most : f->stages, sent = 0;
    while (sent < want) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (N->pcount[e] > 0 && (best < 0 || N->pcount[e] > N->pcount[best])) best = e;
        if (best < 0) break;
        N->pcount[best] = 0;
        uint64_t ticket = 0;
        if (pf_submit(f->sched, f->key_base + (uint64_t)best, f->src[best], f->stage[sent], f->nbytes, PF_ROUTE_AHEAD,
                      &ticket) != PF_OK)
            continue; /* not prefetched: this layer computes or fetches it as usual */
        N->ahead_e[sent] = best;
        N->ahead_ticket[sent++] = ticket;
    }
    N->ahead_n = sent;
    return sent;
}

/* busy[] values: a stage's use in the current run */
enum { STAGE_FREE = 0, STAGE_CLAIMED = 1, STAGE_UNUSED = 2, STAGE_PLANNED = 3 };

/* At a run's start: each prefetch made into L's stages whose expert this run needs (routed, not
 * resident) becomes one of its fetches (promoted to band 0, marked in skip); the others are
 * cancelled (waited for in finish_fetches). Returns the fetches claimed (picked/tickets/slot). */
static int claim_ahead(pf_layer *L) {
    const pf_layer_fetch *f = &L->f;
    int claimed = 0;
    memset(L->busy, STAGE_FREE, (size_t)f->stages);
    for (int i = 0; i < L->ahead_n; i++) {
        int e = L->ahead_e[i];
        uint64_t key = f->key_base + (uint64_t)e;
        if (L->count[e] > 0 && !L->skip[e]) {
            pf_promote(f->sched, key, PF_ON_DEMAND);
            L->skip[e] = 1;
            L->busy[i] = STAGE_CLAIMED;
            L->picked[claimed] = e;
            L->tickets[claimed] = L->ahead_ticket[i];
            L->slot[claimed++] = i;
        } else {
            pf_cancel(f->sched, key);
            L->busy[i] = STAGE_UNUSED;
        }
    }
    atomic_store(&L->ahead_used, claimed);
    atomic_store(&L->ahead_unused, L->ahead_n - claimed);
    return claimed;
}

/* Choose the experts to fetch (the plan's count of the non-resident ones not claimed, most
 * positions first), submit them at band 0 into free stages and mark them in skip; returns the
 * fetches in picked/tickets/slot, the `submitted` claimed ones first. */
static int submit_fetches(pf_layer *L, int n, int submitted) {
    const int E = L->d.num_experts;
    const pf_layer_fetch *f = &L->f;
    int missing = 0, free_stages = 0;
    for (int e = 0; e < E; e++) missing += L->count[e] > 0 && !L->skip[e];
    for (int i = 0; i < f->stages; i++) free_stages += L->busy[i] == STAGE_FREE;
    int want = f->plan[missing < n ? missing : n];
    if (want > free_stages) want = free_stages;
    if (want > missing) want = missing;
    int chosen = 0, first = submitted;
    while (chosen < want) { /* selection: few stages, few experts */
        int best = -1;
        for (int e = 0; e < E; e++)
            if (L->count[e] > 0 && !L->skip[e] && (best < 0 || L->count[e] > L->count[best])) best = e;
        L->skip[best] = 1; /* provisional: unmarked below if the submit fails */
        L->picked[first + chosen++] = best;
    }
    int stage = 0;
    for (int i = 0; i < chosen; i++) {
        int e = L->picked[first + i];
        while (L->busy[stage] != STAGE_FREE) stage++;
        uint64_t ticket = 0;
        int rc = pf_submit(f->sched, f->key_base + (uint64_t)e, f->src[e], f->stage[stage], f->nbytes,
                           PF_ON_DEMAND, &ticket);
        if (rc != PF_OK) {
            L->skip[e] = 0; /* computed here */
            continue;
        }
        L->busy[stage] = STAGE_PLANNED;
        L->picked[submitted] = e;
        L->tickets[submitted] = ticket;
        L->slot[submitted++] = stage;
    }
    atomic_store(&L->fallback, chosen - (submitted - first));
    return submitted;
}

/* Wait for the run's fetches; each that did not land is computed on this thread, so that out
 * covers it. Writes stage_of. Then waits for the unused prefetches (cancelled by claim_ahead):
 * every stage is quiet when the run ends. Returns the kernel status of the fallback call. */
static int finish_fetches(pf_layer *L, int n, int submitted, int *distinct) {
    const int E = L->d.num_experts;
    const pf_layer_fetch *f = &L->f;
    for (int e = 0; e < E; e++) f->stage_of[e] = -1;
    uint64_t t0 = now_ns();
    int landed = 0, failed = 0;
    memset(L->skip, 1, (size_t)E); /* the fallback pass computes only the failed ones */
    for (int i = 0; i < submitted; i++) {
        int st = pf_wait(f->sched, L->tickets[i], f->timeout_s);
        int e = L->picked[i];
        if (st == PF_DONE) {
            f->stage_of[e] = L->slot[i];
            landed++;
            continue;
        }
        if (st == PF_TIMEOUT) {
            pf_cancel(f->sched, f->key_base + (uint64_t)e);
            atomic_store(&L->fetch_off, 1);
        }
        L->skip[e] = 0;
        failed++;
    }
    for (int i = 0; i < L->ahead_n; i++)
        if (L->busy[i] == STAGE_UNUSED && pf_wait(f->sched, L->ahead_ticket[i], f->timeout_s) == PF_TIMEOUT)
            atomic_store(&L->fetch_off, 1);
    L->ahead_n = 0;
    atomic_store(&L->wait_ns, now_ns() - t0);
    atomic_store(&L->fetched, landed);
    atomic_fetch_add(&L->fallback, failed);
    if (!failed) return PF_CPU_OK;
    int more = 0;
    int entries = group(L, n, L->skip, 0, &more);
    *distinct += more;
    uint64_t k0 = now_ns();
    int rc = call_kernel(L, entries);
    atomic_fetch_add(&L->kernel_ns, now_ns() - k0);
    return rc;
}

int pf_layer_run(pf_layer *L) {
    if (!L) return PF_CPU_EINVAL;
    uint64_t t0 = now_ns();
    atomic_store(&L->begin_ns, t0);
    const int H = L->d.hidden, E = L->d.num_experts;
    int tokens = atomic_load(&L->tokens);
    int n = tokens * L->d.top_k, distinct = 0, submitted = 0;
    int rc = count_experts(L, n) == 0 ? PF_CPU_OK : PF_CPU_EINVAL;
    int fetching = L->has_fetch && !atomic_load(&L->fetch_off);
    atomic_store(&L->fetched, 0);
    atomic_store(&L->fallback, 0);
    atomic_store(&L->wait_ns, 0);
    atomic_store(&L->kernel_ns, 0);
    atomic_store(&L->ahead_used, 0);
    atomic_store(&L->ahead_unused, 0);
    /* the next layer's predicted experts first: the link starts on them while this layer computes */
    atomic_store(&L->ahead_sent, L->next ? prefetch_into(L->next, L->predicted, n, L->ahead_most) : 0);
    if (rc == PF_CPU_OK) { /* stage_of: written by finish_fetches, or reset below on failure */
        for (int e = 0; e < E; e++) L->skip[e] = L->d.resident && L->d.resident[e];
        if (L->has_fetch) submitted = claim_ahead(L);
        if (fetching) submitted = submit_fetches(L, n, submitted);
        int entries = group(L, n, L->skip, 1, &distinct);
        uint64_t k0 = now_ns();
        rc = call_kernel(L, entries);
        atomic_store(&L->kernel_ns, now_ns() - k0);
        if (L->has_fetch) { /* always wait: the stages must be quiet before the next run */
            int rc2 = finish_fetches(L, n, submitted, &distinct);
            if (rc == PF_CPU_OK) rc = rc2;
        }
    } else if (L->ahead_n) {
        drop_ahead(L);
    }
    if (rc != PF_CPU_OK) {
        memset(L->d.out, 0, (size_t)L->positions * (size_t)H * sizeof(float));
        if (L->has_fetch)
            for (int e = 0; e < E; e++) L->f.stage_of[e] = -1;
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

int pf_layer_set_ahead(pf_layer *L, pf_layer *next, const int64_t *predicted, int most) {
    if (!L) return PF_CPU_EINVAL;
    if (!next) {
        L->next = NULL;
        L->predicted = NULL;
        L->ahead_most = 0;
        return PF_CPU_OK;
    }
    if (next == L || !next->has_fetch || !predicted || most < 0 || most > next->f.stages
        || next->d.num_experts != L->d.num_experts || next->d.top_k != L->d.top_k || next->d.rows < L->d.rows)
        return PF_CPU_EINVAL;
    L->next = next;
    L->predicted = predicted;
    L->ahead_most = most;
    return PF_CPU_OK;
}

int pf_layer_ahead_result(pf_layer *L, int *sent, int *used, int *unused) {
    if (!L) return PF_CPU_EINVAL;
    if (sent) *sent = atomic_load(&L->ahead_sent);
    if (used) *used = atomic_load(&L->ahead_used);
    if (unused) *unused = atomic_load(&L->ahead_unused);
    return PF_CPU_OK;
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

int pf_layer_fetch_result(pf_layer *L, int *fetched, int *fallback, uint64_t *wait_ns, int *disabled) {
    if (!L) return PF_CPU_EINVAL;
    if (fetched) *fetched = atomic_load(&L->fetched);
    if (fallback) *fallback = atomic_load(&L->fallback);
    if (wait_ns) *wait_ns = atomic_load(&L->wait_ns);
    if (disabled) *disabled = atomic_load(&L->fetch_off);
    return PF_CPU_OK;
}

int pf_layer_clock(pf_layer *L, uint64_t *begin_ns, uint64_t *kernel_ns) {
    if (!L) return PF_CPU_EINVAL;
    if (begin_ns) *begin_ns = atomic_load(&L->begin_ns);
    if (kernel_ns) *kernel_ns = atomic_load(&L->kernel_ns);
    return PF_CPU_OK;
}

int pf_layer_report(pf_layer *const *layers, int n, int64_t *out) {
    if (!layers || !out || n < 1) return PF_CPU_EINVAL;
    for (int i = 0; i < n; i++)
        if (!layers[i]) return PF_CPU_EINVAL;
    for (int i = 0; i < n; i++) {
        pf_layer *L = layers[i];
        int64_t *row = out + (size_t)i * PF_LAYER_REPORT;
        row[0] = (int64_t)atomic_load(&L->status);
        row[1] = (int64_t)atomic_load(&L->experts_run);
        row[2] = (int64_t)atomic_load(&L->ns);
        row[3] = (int64_t)atomic_load(&L->runs);
        row[4] = (int64_t)atomic_load(&L->begin_ns);
        row[5] = (int64_t)atomic_load(&L->kernel_ns);
        row[6] = (int64_t)atomic_load(&L->wait_ns);
        row[7] = (int64_t)atomic_load(&L->ahead_sent);
        row[8] = (int64_t)atomic_load(&L->ahead_used);
        row[9] = (int64_t)atomic_load(&L->ahead_unused);
    }
    return PF_CPU_OK;
}
