/*
 * bench.c: pf_sched microbenchmarks in C (no Python in the timed path).
 *
 * Built and run by benchmarks/bench_scheduler.py:
 *   cc -std=c11 -O2 -pthread -Inative -o bench native/stress/bench.c native/pf_sched.c -ldl
 *
 *   bench tiny     [--n N] [--bytes B] [--workers W] [--window K] [--submitters S] [--reps R]
 *                  [--priority P]
 *       Tasks per second, submit to complete, for tiny copies (memcpy backend, no link).
 *       S threads each submit N/S tasks of B bytes with distinct keys and destinations,
 *       keeping at most K of their own tasks outstanding (K = 0: submit all, then wait
 *       all); the clock runs from the first submit to the last wait. Every destination
 *       is verified afterwards. Prints one JSON object per repetition.
 *   bench overtake [--gbps G] [--chunk C] [--bg-bytes B] [--od-bytes B] [--workers W]
 *                  [--samples N] [--latency-us L]
 *       On-demand overtake under a saturated simulated link: a background queue keeps
 *       the link busy with large tasks; at random moments an on-demand task is submitted
 *       and waited for. Prints a JSON object with every sample's submit -> first chunk
 *       claimed (the level's queue wait) and submit -> done, in ns, the chunk time, the
 *       task's transfer time by the link model and its submit -> done alone on an idle link.
 *   bench link     [--gbps G] [--chunk C] [--bytes B] [--workers W] [--priority P]
 *       Rate the simulated link delivers: one task of B bytes at priority P, submit to done,
 *       against the configured G. Prints a JSON object.
 *   bench wake     [--idle-us U] [--samples N]
 *       Reference floor for the numbers above: how long this machine takes to wake a
 *       thread blocked on a condition variable (signal -> running) after U us idle.
 *       Prints a JSON object with every sample in ns.
 */
#define _GNU_SOURCE
#include "pf_sched.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what, int rc) {
    fprintf(stderr, "bench: %s failed: %d (%s)\n", what, rc, pf_strerror(rc));
    exit(1);
}

static pf_sched *make(int workers, uint64_t chunk, double gbps, double lat_us, uint32_t history) {
    pf_config cfg;
    pf_config_default(&cfg);
    cfg.workers = workers;
    cfg.chunk_bytes = chunk;
    cfg.link_gbps = gbps;
    cfg.latency_us = lat_us;
    cfg.history = history;
    pf_sched *s;
    char err[200];
    int rc = pf_create(&cfg, &s, err, sizeof(err));
    if (rc) {
        fprintf(stderr, "bench: pf_create: %s\n", err);
        exit(1);
    }
    return s;
}

/* ---- tiny ---------------------------------------------------------------------- */
typedef struct tiny_arg {
    pf_sched *s;
    const uint8_t *src;
    uint8_t *dst;
    uint64_t first, n, bytes;
    int window, prio;
    uint64_t *tickets;
    int bad;
} tiny_arg;

static void *tiny_submitter(void *p) {
    tiny_arg *a = p;
    uint64_t waited = 0;
    for (uint64_t i = 0; i < a->n; i++) {
        uint64_t k = a->first + i;
        int rc = pf_submit(a->s, k, a->src, a->dst + k * a->bytes, a->bytes, a->prio, &a->tickets[i]);
        if (rc) die("submit", rc);
        if (a->window && i + 1 - waited >= (uint64_t)a->window) {
            int st = pf_wait(a->s, a->tickets[waited++], -1);
            a->bad += st != PF_DONE;
        }
    }
    while (waited < a->n) {
        int st = pf_wait(a->s, a->tickets[waited++], -1);
        a->bad += st != PF_DONE;
    }
    return NULL;
}

static int run_tiny(int argc, char **argv) {
    uint64_t n = 200000, bytes = 64;
    int workers = 2, window = 0, submitters = 1, reps = 3, prio = PF_ON_DEMAND;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--n")) n = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--bytes")) bytes = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--workers")) workers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--window")) window = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--submitters")) submitters = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--priority")) prio = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench tiny: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (submitters < 1 || submitters > 64) submitters = 1;
    uint8_t *src = malloc(bytes), *dst = malloc(n * bytes);
    uint64_t *tickets = malloc(n * sizeof(uint64_t));
    for (uint64_t i = 0; i < bytes; i++) src[i] = (uint8_t)(i * 7 + 1);
    uint32_t hist = 1;
    while (hist < n) hist <<= 1;
    for (int rep = 0; rep < reps; rep++) {
        memset(dst, 0, n * bytes);
        pf_sched *s = make(workers, 4 << 20, 0, 0, hist);
        tiny_arg args[64];
        pthread_t th[64];
        uint64_t per = n / (uint64_t)submitters;
        uint64_t t0 = now_ns();
        for (int j = 0; j < submitters; j++) {
            uint64_t first = per * (uint64_t)j;
            uint64_t cnt = j == submitters - 1 ? n - first : per;
            args[j] = (tiny_arg){s, src, dst, first, cnt, bytes, window, prio, tickets + first, 0};
            pthread_create(&th[j], NULL, tiny_submitter, &args[j]);
        }
        int bad = 0;
        for (int j = 0; j < submitters; j++) {
            pthread_join(th[j], NULL);
            bad += args[j].bad;
        }
        uint64_t dt = now_ns() - t0;
        pf_stats st;
        pf_get_stats(s, &st);
        pf_shutdown(s);
        pf_destroy(s);
        uint64_t wrong = 0;
        for (uint64_t k = 0; k < n; k++) wrong += memcmp(src, dst + k * bytes, bytes) != 0;
        printf("{\"mode\": \"tiny\", \"n\": %llu, \"bytes\": %llu, \"workers\": %d, \"window\": %d, "
               "\"submitters\": %d, \"priority\": %d, \"seconds\": %.6f, \"tasks_per_s\": %.0f, \"not_done\": %d, "
               "\"wrong\": %llu, \"chunks\": %llu}\n",
               (unsigned long long)n, (unsigned long long)bytes, workers, window, submitters, prio, (double)dt * 1e-9,
               (double)n / ((double)dt * 1e-9), bad, (unsigned long long)wrong, (unsigned long long)st.chunks);
        fflush(stdout);
    }
    free(src);
    free(dst);
    free(tickets);
    return 0;
}

/* ---- overtake -------------------------------------------------------------------- */
typedef struct bg_arg {
    pf_sched *s;
    const uint8_t *src;
    uint8_t *dst;
    uint64_t bytes;
    volatile int *stop; /* written once by main, read here; guarded by the join */
    pthread_mutex_t *mu;
} bg_arg;

/* Keep at least 4 background tasks queued at all times. */
static void *bg_feeder(void *p) {
    bg_arg *a = p;
    uint64_t key = 1ull << 40, ring[8] = {0};
    int head = 0;
    for (;;) {
        pthread_mutex_lock(a->mu);
        int stop = *a->stop;
        pthread_mutex_unlock(a->mu);
        if (stop) break;
        if (ring[head]) pf_wait(a->s, ring[head], -1);
        int rc = pf_submit(a->s, key++, a->src, a->dst + (uint64_t)head * a->bytes, a->bytes, PF_BACKGROUND,
                           &ring[head]);
        if (rc == PF_ECLOSED) break;
        if (rc) die("bg submit", rc);
        head = (head + 1) % 8;
    }
    return NULL;
}

static int run_overtake(int argc, char **argv) {
    double gbps = 1.0, lat = 0;
    uint64_t chunk = 1 << 20, bg_bytes = 32 << 20, od_bytes = 1 << 20;
    int workers = 2, samples = 60;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--gbps")) gbps = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk")) chunk = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--bg-bytes")) bg_bytes = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--od-bytes")) od_bytes = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--workers")) workers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--samples")) samples = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--latency-us")) lat = atof(argv[i + 1]);
        else {
            fprintf(stderr, "bench overtake: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    pf_sched *s = make(workers, chunk, gbps, lat, 1 << 16);
    uint8_t *bg_src = malloc(bg_bytes), *bg_dst = malloc(8 * bg_bytes);
    uint8_t *od_src = malloc(od_bytes), *od_dst = malloc(od_bytes);
    memset(bg_src, 1, bg_bytes);
    memset(bg_dst, 0, 8 * bg_bytes);
    for (uint64_t i = 0; i < od_bytes; i++) od_src[i] = (uint8_t)(i * 13 + 5);
    /* the on-demand task alone on an idle link (median of 5): its own submit -> done */
    uint64_t alone[5];
    for (int i = 0; i < 5; i++) {
        uint64_t t, t0 = now_ns();
        int rc = pf_submit(s, (1ull << 50) + (uint64_t)i, od_src, od_dst, od_bytes, PF_ON_DEMAND, &t);
        if (rc) die("od submit", rc);
        pf_wait(s, t, -1);
        alone[i] = now_ns() - t0;
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (alone[j] < alone[i]) {
                uint64_t x = alone[i];
                alone[i] = alone[j];
                alone[j] = x;
            }
    volatile int stop = 0;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    bg_arg ba = {s, bg_src, bg_dst, bg_bytes, &stop, &mu};
    pthread_t feeder;
    pthread_create(&feeder, NULL, bg_feeder, &ba);
    double chunk_s = (double)chunk / (gbps * 1e9) + lat * 1e-6;
    double od_s = (double)od_bytes / (gbps * 1e9) + lat * 1e-6 * (double)((od_bytes + chunk - 1) / chunk);
    /* let the queue form, then sample at pseudo-random offsets into the background chunks */
    struct timespec ts = {0, 200 * 1000000L};
    nanosleep(&ts, NULL);
    uint64_t *q = malloc(sizeof(uint64_t) * (size_t)samples), *d = malloc(sizeof(uint64_t) * (size_t)samples);
    uint64_t rng = 88172645463325252ull;
    int wrong = 0, saturated = 0;
    for (int i = 0; i < samples; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        uint64_t pause_ns = (uint64_t)(chunk_s * 1e9 * (0.3 + (double)(rng % 1000) / 1000.0));
        ts.tv_sec = (time_t)(pause_ns / 1000000000ull);
        ts.tv_nsec = (long)(pause_ns % 1000000000ull);
        nanosleep(&ts, NULL);
        pf_stats a, b;
        pf_get_stats(s, &a);
        saturated += a.level[PF_BACKGROUND].queue_depth >= 2;
        memset(od_dst, 0, od_bytes);
        uint64_t t;
        uint64_t t0 = now_ns();
        int rc = pf_submit(s, (uint64_t)i, od_src, od_dst, od_bytes, PF_ON_DEMAND, &t);
        if (rc) die("od submit", rc);
        int st = pf_wait(s, t, -1);
        uint64_t t1 = now_ns();
        pf_get_stats(s, &b);
        wrong += st != PF_DONE || memcmp(od_src, od_dst, od_bytes) != 0;
        q[i] = b.level[PF_ON_DEMAND].queue_wait_ns - a.level[PF_ON_DEMAND].queue_wait_ns;
        d[i] = t1 - t0;
    }
    pthread_mutex_lock(&mu);
    stop = 1;
    pthread_mutex_unlock(&mu);
    pf_shutdown(s); /* the feeder's pending wait or submit returns */
    pthread_join(feeder, NULL);
    pf_destroy(s);
    printf("{\"mode\": \"overtake\", \"gbps\": %g, \"chunk\": %llu, \"bg_bytes\": %llu, \"od_bytes\": %llu, "
           "\"workers\": %d, \"latency_us\": %g, \"chunk_s\": %.9f, \"od_transfer_s\": %.9f, \"od_alone_s\": %.9f, "
           "\"samples\": %d, "
           "\"saturated\": %d, \"wrong\": %d, \"queue_wait_ns\": [",
           gbps, (unsigned long long)chunk, (unsigned long long)bg_bytes, (unsigned long long)od_bytes, workers, lat,
           chunk_s, od_s, (double)alone[2] * 1e-9, samples, saturated, wrong);
    for (int i = 0; i < samples; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)q[i]);
    printf("], \"done_ns\": [");
    for (int i = 0; i < samples; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)d[i]);
    printf("]}\n");
    free(q);
    free(d);
    free(bg_src);
    free(bg_dst);
    free(od_src);
    free(od_dst);
    return 0;
}

/* ---- link ----------------------------------------------------------------------- */
static int run_link(int argc, char **argv) {
    double gbps = 1.0;
    uint64_t chunk = 1 << 20, bytes = 64 << 20;
    int workers = 2, prio = PF_BACKGROUND;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--gbps")) gbps = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk")) chunk = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--bytes")) bytes = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--workers")) workers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--priority")) prio = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench link: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    pf_sched *s = make(workers, chunk, gbps, 0, 1024);
    uint8_t *src = malloc(bytes), *dst = malloc(bytes);
    memset(src, 7, bytes);
    memset(dst, 0, bytes);
    uint64_t t, t0 = now_ns();
    int rc = pf_submit(s, 1, src, dst, bytes, prio, &t);
    if (rc) die("submit", rc);
    int st = pf_wait(s, t, -1);
    double dt = (double)(now_ns() - t0) * 1e-9;
    pf_shutdown(s);
    pf_destroy(s);
    int exact = st == PF_DONE && memcmp(src, dst, bytes) == 0;
    printf("{\"mode\": \"link\", \"gbps\": %g, \"chunk\": %llu, \"bytes\": %llu, \"workers\": %d, \"priority\": %d, "
           "\"seconds\": %.6f, \"achieved_gbps\": %.6f, \"exact\": %d}\n",
           gbps, (unsigned long long)chunk, (unsigned long long)bytes, workers, prio, dt, (double)bytes / dt / 1e9,
           exact);
    free(src);
    free(dst);
    return 0;
}

/* ---- wake --------------------------------------------------------------------- */
typedef struct wake_state {
    pthread_mutex_t mu;
    pthread_cond_t go, back;
    int flag; /* 1: signalled, 0: woken and recorded, -1: stop */
    uint64_t t_signal;
    uint64_t *lat;
    int n;
} wake_state;

static void *wake_waiter(void *p) {
    wake_state *w = p;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->flag == 0) pthread_cond_wait(&w->go, &w->mu);
        if (w->flag < 0) break;
        w->lat[w->n++] = now_ns() - w->t_signal;
        w->flag = 0;
        pthread_cond_signal(&w->back);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static int run_wake(int argc, char **argv) {
    int samples = 300;
    double idle_us = 500;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--idle-us")) idle_us = atof(argv[i + 1]);
        else if (!strcmp(argv[i], "--samples")) samples = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench wake: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    wake_state w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, 0};
    w.lat = malloc(sizeof(uint64_t) * (size_t)samples);
    pthread_t th;
    pthread_create(&th, NULL, wake_waiter, &w);
    for (int i = 0; i < samples; i++) {
        uint64_t ns = (uint64_t)(idle_us * 1000.0);
        struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
        nanosleep(&ts, NULL);
        pthread_mutex_lock(&w.mu);
        w.flag = 1;
        w.t_signal = now_ns();
        pthread_cond_signal(&w.go);
        while (w.flag == 1) pthread_cond_wait(&w.back, &w.mu);
        pthread_mutex_unlock(&w.mu);
    }
    pthread_mutex_lock(&w.mu);
    w.flag = -1;
    pthread_cond_signal(&w.go);
    pthread_mutex_unlock(&w.mu);
    pthread_join(th, NULL);
    printf("{\"mode\": \"wake\", \"idle_us\": %g, \"samples\": %d, \"wake_ns\": [", idle_us, w.n);
    for (int i = 0; i < w.n; i++) printf("%s%llu", i ? ", " : "", (unsigned long long)w.lat[i]);
    printf("]}\n");
    free(w.lat);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "tiny")) return run_tiny(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "overtake")) return run_overtake(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "wake")) return run_wake(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "link")) return run_link(argc, argv);
    fprintf(stderr, "usage: bench tiny|overtake|link|wake [options]\n");
    return 2;
}
