/* pf_relay: a graph's layers handed to the CPU through flags (see pf_relay.h). */
#define _POSIX_C_SOURCE 200809L
#include "pf_relay.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

enum { IDLE = 0, ARMED = 1, ENDED = 2 };

struct pf_relay {
    _Atomic uint32_t *flags;  /* [2 * layers], borrowed: down flags, then up flags */
    int layers;
    unsigned spin_us;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* state or closing changed */
    /* under mu */
    int state;
    int closing;
    int n;                    /* the armed step's layers */
    double timeout_s;
    int status, answered;     /* the ended step's */
    pf_layer **ctx;           /* [layers], owned: the armed step's contexts */
    atomic_int cancel;        /* read by the thread while it polls */
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Poll down flag i until it is nonzero: PF_CPU_OK, or the step's timeout / cancellation. */
static int wait_down(pf_relay *r, int i, double timeout_s) {
    _Atomic uint32_t *flag = &r->flags[i];
    uint64_t t0 = now_ns(), spin = (uint64_t)r->spin_us * 1000u, limit = (uint64_t)(timeout_s * 1e9);
    for (unsigned k = 0;; k++) {
        if (atomic_load_explicit(flag, memory_order_acquire)) return PF_CPU_OK;
        if ((k & 63) == 0) { /* the clock and the cancel flag every 64 reads */
            if (atomic_load(&r->cancel)) return PF_RELAY_ECANCELED;
            uint64_t waited = now_ns() - t0;
            if (waited > limit) return PF_RELAY_ETIMEDOUT;
            if (waited > spin) {
                struct timespec ts = {0, 50000};
                nanosleep(&ts, NULL);
                continue;
            }
        }
        cpu_relax();
    }
}

static void *relay_main(void *p) {
    pf_relay *r = p;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        while (r->state != ARMED && !r->closing) pthread_cond_wait(&r->cv, &r->mu);
        if (r->state != ARMED) break; /* closing, nothing armed */
        int n = r->n;
        double timeout_s = r->timeout_s;
        pthread_mutex_unlock(&r->mu);
        int st = PF_CPU_OK, i = 0;
        for (; i < n; i++) {
            st = wait_down(r, i, timeout_s);
            if (st != PF_CPU_OK) break;
            pf_layer_run(r->ctx[i]);
            atomic_store_explicit(&r->flags[r->layers + i], 1u, memory_order_release);
        }
        for (int j = i; j < n; j++) /* never leave the device waiting */
            atomic_store_explicit(&r->flags[r->layers + j], 1u, memory_order_release);
        pthread_mutex_lock(&r->mu);
        r->status = st;
        r->answered = i;
        r->state = ENDED;
        pthread_cond_broadcast(&r->cv);
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

int pf_relay_create(uint32_t *flags, int layers, unsigned spin_us, pf_relay **out) {
    if (!out) return PF_CPU_EINVAL;
    *out = NULL;
    if (!flags || layers < 1 || spin_us > 1000000u) return PF_CPU_EINVAL;
    pf_relay *r = calloc(1, sizeof *r);
    if (!r) return PF_CPU_ENOMEM;
    r->ctx = calloc((size_t)layers, sizeof *r->ctx);
    if (!r->ctx) {
        free(r);
        return PF_CPU_ENOMEM;
    }
    r->flags = (_Atomic uint32_t *)flags;
    r->layers = layers;
    r->spin_us = spin_us;
    atomic_init(&r->cancel, 0);
    if (pthread_mutex_init(&r->mu, NULL) != 0) {
        free(r->ctx);
        free(r);
        return PF_CPU_ETHREAD;
    }
    pthread_condattr_t ca;
    int ok = pthread_condattr_init(&ca) == 0;
    ok = ok && pthread_condattr_setclock(&ca, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&r->cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!ok) {
        pthread_mutex_destroy(&r->mu);
        free(r->ctx);
        free(r);
        return PF_CPU_ETHREAD;
    }
    if (pthread_create(&r->thread, NULL, relay_main, r) != 0) {
        pthread_cond_destroy(&r->cv);
        pthread_mutex_destroy(&r->mu);
        free(r->ctx);
        free(r);
        return PF_CPU_ETHREAD;
    }
    *out = r;
    return PF_CPU_OK;
}

void pf_relay_destroy(pf_relay *r) {
    if (!r) return;
    pthread_mutex_lock(&r->mu);
    r->closing = 1;
    atomic_store(&r->cancel, 1); /* an armed step ends at once */
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    pthread_join(r->thread, NULL);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r->ctx);
    free(r);
}

int pf_relay_arm(pf_relay *r, pf_layer *const *ctx, int n, double timeout_s) {
    if (!r || !ctx || n < 1 || n > r->layers || !(timeout_s > 0)) return PF_CPU_EINVAL;
    for (int i = 0; i < n; i++)
        if (!ctx[i]) return PF_CPU_EINVAL;
    pthread_mutex_lock(&r->mu);
    if (r->state != IDLE || r->closing) {
        pthread_mutex_unlock(&r->mu);
        return r->closing ? PF_CPU_EINVAL : PF_RELAY_EBUSY;
    }
    for (int i = 0; i < 2 * r->layers; i++) atomic_store_explicit(&r->flags[i], 0u, memory_order_relaxed);
    for (int i = 0; i < n; i++) r->ctx[i] = ctx[i];
    r->n = n;
    r->timeout_s = timeout_s;
    atomic_store(&r->cancel, 0);
    r->state = ARMED;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return PF_CPU_OK;
}

int pf_relay_cancel(pf_relay *r) {
    if (!r) return PF_CPU_EINVAL;
    pthread_mutex_lock(&r->mu);
    if (r->state == ARMED) atomic_store(&r->cancel, 1);
    pthread_mutex_unlock(&r->mu);
    return PF_CPU_OK;
}

int pf_relay_wait(pf_relay *r, double timeout_s, int *status, int *answered) {
    if (!r || !(timeout_s >= 0)) return PF_CPU_EINVAL;
    if (timeout_s > 1e6) timeout_s = 1e6;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    long long ns = (long long)until.tv_nsec + (long long)((timeout_s - (double)(long long)timeout_s) * 1e9);
    until.tv_sec += (time_t)timeout_s + (time_t)(ns / 1000000000LL);
    until.tv_nsec = (long)(ns % 1000000000LL);
    pthread_mutex_lock(&r->mu);
    int rc = PF_CPU_OK;
    while (r->state == ARMED && rc == PF_CPU_OK)
        if (pthread_cond_timedwait(&r->cv, &r->mu, &until) != 0 && r->state == ARMED) rc = PF_RELAY_ETIMEDOUT;
    if (rc == PF_CPU_OK && r->state != ENDED) rc = PF_CPU_EINVAL;
    if (rc == PF_CPU_OK) {
        if (status) *status = r->status;
        if (answered) *answered = r->answered;
        r->state = IDLE;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}
