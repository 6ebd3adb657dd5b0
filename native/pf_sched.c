/*
 * pf_sched.c: the priority-banded transfer scheduler (see pf_sched.h).
 *
 * One mutex (s->mu) guards all scheduler state. Workers sleep on s->work_cv
 * while nothing is claimable; callers of pf_wait sleep on one of NBUCKET
 * condition variables chosen by ticket; pf_reset sleeps on s->drain_cv until
 * every chunk in flight has landed. A cuda worker whose copy has landed before
 * its slot on a paced link ends also sleeps on s->drain_cv (until the slot's end
 * or pf_shutdown, which broadcasts it). Nothing polls.
 *
 * Task life: submit -> queued (in its level's FIFO while bytes remain
 * unclaimed) -> workers claim chunks from the head of the most urgent
 * non-empty level -> when the last chunk lands the task ends (done, or
 * cancelled / failed) and its status moves to the history ring, where
 * pf_wait finds it later. A task record is freed only when it has ended and
 * no chunk of it is out, so a worker may use its pointer without the lock
 * while it copies a chunk.
 */
#define _GNU_SOURCE
#include "pf_sched.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#define NBUCKET 64   /* waiter condition variables, chosen by ticket */
#define NERR 64      /* remembered error messages of failed tickets */
#define ERRLEN 160
#define MAX_TIMEOUT_S 1e9 /* about 31 years: pf_wait treats longer limits as none */
#define MAX_LINK_NS 1e15  /* simulated link: longest time one chunk may occupy it */

/* task states */
enum { T_LIVE = 0, T_CANCELLING, T_FAILING };

typedef struct task {
    uint64_t key, ticket;
    const char *src;
    char *dst;
    void *after;                /* cuda backend: event each chunk copy waits for (caller's) */
    uint64_t nbytes, claimed, landed;
    uint64_t t_submit, t_start;
    int prio;
    int state;
    int chunks_out;
    int in_queue;
    int in_keymap;
    struct task *qprev, *qnext; /* level FIFO */
    struct task *knext;         /* key map chain */
    struct task *tnext;         /* ticket map chain */
} task;

typedef struct chain_map {
    task **b;
    uint64_t mask; /* buckets - 1 */
    uint64_t n;
} chain_map;

typedef struct hist_entry {
    uint64_t ticket;
    int status;
} hist_entry;

typedef struct err_entry {
    uint64_t ticket;
    char msg[ERRLEN];
} err_entry;

/* ---- CUDA runtime, opened at run time ------------------------------------ */
typedef int (*cuda_set_device_fn)(int);
typedef int (*cuda_get_device_fn)(int *);
typedef int (*cuda_get_device_count_fn)(int *);
typedef int (*cuda_stream_create_fn)(void **, unsigned int);
typedef int (*cuda_stream_destroy_fn)(void *);
typedef int (*cuda_memcpy_async_fn)(void *, const void *, size_t, int, void *);
typedef int (*cuda_event_create_fn)(void **, unsigned int);
typedef int (*cuda_event_destroy_fn)(void *);
typedef int (*cuda_event_record_fn)(void *, void *);
typedef int (*cuda_event_sync_fn)(void *);
typedef int (*cuda_stream_wait_event_fn)(void *, void *, unsigned int);
typedef const char *(*cuda_error_string_fn)(int);

typedef struct cuda_api {
    void *handle;
    cuda_set_device_fn set_device;
    cuda_get_device_fn get_device;
    cuda_get_device_count_fn get_device_count;
    cuda_stream_create_fn stream_create;
    cuda_stream_destroy_fn stream_destroy;
    cuda_memcpy_async_fn memcpy_async;
    cuda_event_create_fn event_create;
    cuda_event_destroy_fn event_destroy;
    cuda_event_record_fn event_record;
    cuda_event_sync_fn event_sync;
    cuda_stream_wait_event_fn stream_wait_event;
    cuda_error_string_fn error_string;
} cuda_api;

#define CUDA_MEMCPY_DEFAULT 4
#define CUDA_STREAM_NON_BLOCKING 1
#define CUDA_EVENT_BLOCKING_SYNC 1 /* a waiting worker sleeps instead of spinning a core */
#define CUDA_EVENT_DISABLE_TIMING 2

typedef struct worker {
    struct pf_sched *s;
    pthread_t thread;
    int started;
    void *stream; /* cuda backend */
    void *event;
} worker;

struct pf_sched {
    pf_config cfg;
    pthread_mutex_t mu;
    pthread_cond_t work_cv;
    pthread_cond_t drain_cv;
    pthread_cond_t wait_cv[NBUCKET];
    int waiters[NBUCKET];

    task *qhead[PF_NUM_PRIORITY], *qtail[PF_NUM_PRIORITY];
    uint32_t nonempty;   /* bit p set: level p has claimable tasks */
    chain_map by_key, by_ticket;
    task *free_tasks;

    uint64_t next_ticket;
    hist_entry *hist;
    uint64_t hist_mask;
    err_entry errs[NERR];

    int idle_workers;
    int busy_prefetch;   /* workers copying a chunk of priority > 0 */
    int prefetch_limit;  /* at most this many workers copy priority > 0 at once */
    int chunks_out;      /* chunks being copied, all tasks */
    int paused;          /* pf_reset in progress: no new claims */
    int waiting;         /* callers blocked in pf_wait */
    uint64_t chunk_seq;  /* chunk copies ever issued (fault injection counts these) */
    uint32_t faults;     /* failures injected so far */
    pthread_cond_t ready_cv; /* pf_create waits here until every worker has started */
    int workers_ready;
    int worker_rc;       /* first worker start-up failure (cuda: cudaSetDevice) */
    char worker_err[ERRLEN];
    int stopping;
    int shut_done;
    pthread_mutex_t shut_mu;

    uint64_t link_free_ns;  /* simulated link: when it is next free */
    uint64_t busy_since_ns;
    pf_stats st;

    pf_trace_rec *trace;    /* ring of ended tasks (cfg.trace entries), NULL when off */
    uint64_t trace_head;    /* records ever written */
    uint64_t trace_tail;    /* records ever drained or dropped */
    uint64_t trace_dropped;

    cuda_api cuda;
    worker *w;
};

/* ---- small helpers -------------------------------------------------------- */
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void ns_to_timespec(uint64_t ns, struct timespec *ts) {
    ts->tv_sec = (time_t)(ns / 1000000000ull);
    ts->tv_nsec = (long)(ns % 1000000000ull);
}

static void errf(char *buf, size_t len, const char *fmt, ...) {
    if (!buf || len == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
}

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int valid_prio(int p) { return p >= 0 && p < PF_NUM_PRIORITY; }

/* ---- chained maps (key -> task, ticket -> task) ----------------------------- */
static int map_init(chain_map *m, uint64_t buckets) {
    m->b = calloc(buckets, sizeof(task *));
    m->mask = buckets - 1;
    m->n = 0;
    return m->b ? 0 : PF_ENOMEM;
}

#define MAP_NEXT(t, by_key) ((by_key) ? &(t)->knext : &(t)->tnext)
#define MAP_ID(t, by_key) ((by_key) ? (t)->key : (t)->ticket)

static void map_grow(chain_map *m, int by_key) {
    uint64_t nb = (m->mask + 1) * 2;
    task **b = calloc(nb, sizeof(task *));
    if (!b) return; /* keep the old table: slower chains, still correct */
    for (uint64_t i = 0; i <= m->mask; i++) {
        task *t = m->b[i];
        while (t) {
            task *next = *MAP_NEXT(t, by_key);
            uint64_t h = mix64(MAP_ID(t, by_key)) & (nb - 1);
            *MAP_NEXT(t, by_key) = b[h];
            b[h] = t;
            t = next;
        }
    }
    free(m->b);
    m->b = b;
    m->mask = nb - 1;
}

static void map_put(chain_map *m, task *t, int by_key) {
    if (m->n >= m->mask + 1) map_grow(m, by_key);
    uint64_t h = mix64(MAP_ID(t, by_key)) & m->mask;
    *MAP_NEXT(t, by_key) = m->b[h];
    m->b[h] = t;
    m->n++;
}

static task *map_get(chain_map *m, uint64_t id, int by_key) {
    task *t = m->b[mix64(id) & m->mask];
    while (t && MAP_ID(t, by_key) != id) t = *MAP_NEXT(t, by_key);
    return t;
}

static void map_del(chain_map *m, task *t, int by_key) {
    task **pp = &m->b[mix64(MAP_ID(t, by_key)) & m->mask];
    while (*pp && *pp != t) pp = MAP_NEXT(*pp, by_key);
    if (*pp) {
        *pp = *MAP_NEXT(t, by_key);
        m->n--;
    }
}

/* ---- level FIFOs ----------------------------------------------------------- */
static void q_push(pf_sched *s, task *t) {
    int p = t->prio;
    t->qnext = NULL;
    t->qprev = s->qtail[p];
    if (s->qtail[p]) s->qtail[p]->qnext = t;
    else s->qhead[p] = t;
    s->qtail[p] = t;
    s->nonempty |= 1u << p;
    t->in_queue = 1;
    s->st.level[p].queue_depth++;
}

static void q_remove(pf_sched *s, task *t) {
    int p = t->prio;
    if (t->qprev) t->qprev->qnext = t->qnext;
    else s->qhead[p] = t->qnext;
    if (t->qnext) t->qnext->qprev = t->qprev;
    else s->qtail[p] = t->qprev;
    if (!s->qhead[p]) s->nonempty &= ~(1u << p);
    t->qprev = t->qnext = NULL;
    t->in_queue = 0;
    s->st.level[p].queue_depth--;
}

/* ---- task end -------------------------------------------------------------- */
static void wake_ticket(pf_sched *s, uint64_t ticket) {
    int b = (int)(ticket % NBUCKET);
    if (s->waiters[b]) pthread_cond_broadcast(&s->wait_cv[b]);
}

/* End a task whose chunks have all come back. Caller holds s->mu. */
static void task_end(pf_sched *s, task *t, int status) {
    pf_level_stats *lv = &s->st.level[t->prio];
    uint64_t now = now_ns();
    if (status == PF_DONE) {
        lv->completed++;
        lv->bytes += t->nbytes;
    } else if (status == PF_CANCELLED) {
        lv->cancelled++;
    } else {
        lv->failed++;
    }
    if (t->t_start) lv->transfer_ns += now - t->t_start;
    if (t->in_queue) q_remove(s, t);
    if (t->in_keymap) map_del(&s->by_key, t, 1);
    map_del(&s->by_ticket, t, 0);
    hist_entry *h = &s->hist[t->ticket & s->hist_mask];
    h->ticket = t->ticket;
    h->status = (status == PF_CANCELLED && s->stopping) ? PF_CLOSED : status; /* cancelled by shutdown */
    if (s->trace) {
        if (s->trace_head - s->trace_tail == s->cfg.trace) { /* full: drop the oldest */
            s->trace_tail++;
            s->trace_dropped++;
        }
        pf_trace_rec *r = &s->trace[s->trace_head++ % s->cfg.trace];
        r->key = t->key;
        r->ticket = t->ticket;
        r->nbytes = t->nbytes;
        r->submit_ns = t->t_submit;
        r->start_ns = t->t_start;
        r->end_ns = now;
        r->priority = t->prio;
        r->status = h->status;
    }
    wake_ticket(s, t->ticket);
    t->tnext = s->free_tasks; /* reuse the chain link for the free list */
    s->free_tasks = t;
}

/* Stop a live task from claiming more chunks. Caller holds s->mu. Returns 1 if the
 * task was still claimable (and is now cancelled), 0 otherwise. A task cancelled
 * with chunks still out stays in the key map until they land, so a submit of the
 * same key in that window revives it instead of starting a second copy into the
 * same destination (see pf_submit). */
static int task_cancel(pf_sched *s, task *t) {
    if (!t->in_queue || t->state != T_LIVE) return 0;
    q_remove(s, t);
    t->state = T_CANCELLING;
    if (t->chunks_out == 0) task_end(s, t, PF_CANCELLED);
    return 1;
}

/* Move a live task to the more urgent level `priority`. Caller holds s->mu. */
static void task_promote(pf_sched *s, task *t, int priority) {
    int inq = t->in_queue;
    if (inq) q_remove(s, t);
    if (t->chunks_out) {
        s->st.level[t->prio].in_flight--;
        s->st.level[priority].in_flight++;
    }
    t->prio = priority;
    if (inq) q_push(s, t);
    s->st.level[priority].promoted++;
    if (inq && s->idle_workers) pthread_cond_signal(&s->work_cv);
}

static int cancel_where(pf_sched *s, int prio_lo, int prio_hi, int by_layer, uint32_t layer) {
    int n = 0;
    for (int p = prio_lo; p <= prio_hi; p++) {
        task *t = s->qhead[p];
        while (t) {
            task *next = t->qnext;
            if (!by_layer || (uint32_t)(t->key >> 32) < layer) n += task_cancel(s, t);
            t = next;
        }
    }
    return n;
}

/* ---- backends -------------------------------------------------------------- */
static int cuda_open(pf_sched *s, char *err, size_t errlen) {
    const char *names[] = {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so", NULL};
    void *h = NULL;
    if (s->cfg.cudart_path) {
        h = dlopen(s->cfg.cudart_path, RTLD_NOW | RTLD_NOLOAD);
        if (!h) h = dlopen(s->cfg.cudart_path, RTLD_NOW);
    }
    for (int i = 0; !h && names[i]; i++) h = dlopen(names[i], RTLD_NOW | RTLD_NOLOAD);
    for (int i = 0; !h && names[i]; i++) h = dlopen(names[i], RTLD_NOW);
    if (!h) {
        errf(err, errlen, "no CUDA runtime (libcudart) could be opened; is a CUDA build of PyTorch installed?");
        return PF_EBACKEND;
    }
    cuda_api *c = &s->cuda;
    c->handle = h;
#define LOAD(field, name)                                                      \
    do {                                                                       \
        *(void **)(&c->field) = dlsym(h, name);                                \
        if (!c->field) {                                                       \
            errf(err, errlen, "the CUDA runtime lacks %s", name);              \
            return PF_EBACKEND;                                                \
        }                                                                      \
    } while (0)
    LOAD(set_device, "cudaSetDevice");
    LOAD(get_device, "cudaGetDevice");
    LOAD(get_device_count, "cudaGetDeviceCount");
    LOAD(stream_create, "cudaStreamCreateWithFlags");
    LOAD(stream_destroy, "cudaStreamDestroy");
    LOAD(memcpy_async, "cudaMemcpyAsync");
    LOAD(event_create, "cudaEventCreateWithFlags");
    LOAD(event_destroy, "cudaEventDestroy");
    LOAD(event_record, "cudaEventRecord");
    LOAD(event_sync, "cudaEventSynchronize");
    LOAD(stream_wait_event, "cudaStreamWaitEvent");
    LOAD(error_string, "cudaGetErrorString");
#undef LOAD
    int count = 0;
    int rc = c->get_device_count(&count);
    if (rc != 0 || s->cfg.device < 0 || s->cfg.device >= count) {
        errf(err, errlen, "CUDA device %d is not available (%d device(s) visible%s%s)", s->cfg.device, count,
             rc ? ": " : "", rc ? c->error_string(rc) : "");
        return PF_EBACKEND;
    }
    int prev = 0;
    c->get_device(&prev);
    rc = c->set_device(s->cfg.device);
    for (int i = 0; rc == 0 && i < s->cfg.workers; i++) {
        rc = c->stream_create(&s->w[i].stream, CUDA_STREAM_NON_BLOCKING);
        if (rc == 0) rc = c->event_create(&s->w[i].event, CUDA_EVENT_BLOCKING_SYNC | CUDA_EVENT_DISABLE_TIMING);
    }
    int rc_prev = c->set_device(prev);
    if (rc == 0 && rc_prev != 0) rc = rc_prev;
    if (rc != 0) {
        errf(err, errlen, "CUDA stream setup failed: %s", c->error_string(rc));
        return PF_EBACKEND;
    }
    return 0;
}

static void cuda_close(pf_sched *s) {
    cuda_api *c = &s->cuda;
    if (!c->handle) return;
    for (int i = 0; i < s->cfg.workers; i++) {
        if (s->w[i].event) c->event_destroy(s->w[i].event);
        if (s->w[i].stream) c->stream_destroy(s->w[i].stream);
    }
    /* the runtime stays loaded: it belongs to the process (PyTorch), not to us */
}

/* Sleep until the monotonic time `until` (ns). */
static void sleep_until(uint64_t until) {
    struct timespec ts;
    ns_to_timespec(until, &ts);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

/* latency_us in ns: with a link rate, each chunk lands this long after its slot on the link ends */
static uint64_t chunk_latency_ns(const pf_sched *s) {
    double l = s->cfg.latency_us * 1000.0;
    return (uint64_t)(l < MAX_LINK_NS ? l : MAX_LINK_NS);
}

/* cuda backend with a link rate: keep a chunk whose copy has already landed from being
 * reported until the monotonic time `until` (ns), the end of its slot on the shared link.
 * Caller holds s->mu; the wait releases it. Sleeps on drain_cv, which pf_shutdown
 * broadcasts, so a closing scheduler is not held up by the rest of the slot. */
static void pace_until(pf_sched *s, uint64_t until) {
    struct timespec ts;
    ns_to_timespec(until, &ts);
    while (!s->stopping && now_ns() < until) pthread_cond_timedwait(&s->drain_cv, &s->mu, &ts);
}

#define PACED_SLICES 8

/* Copy one chunk. Returns 0 or writes a message into msg and returns -1. Called
 * without the lock. `link_end` is the simulated link's finish time (0: none) and
 * `link_dur` the chunk's share of it; `fault` injects a failure (memcpy backend).
 * The cuda backend copies at once and ignores both: worker_main paces its landing. */
static int copy_chunk(worker *w, const task *t, uint64_t off, uint64_t n, uint64_t link_end, uint64_t link_dur,
                      int fault, char *msg) {
    pf_sched *s = w->s;
    char *dst = t->dst + off;
    const char *src = t->src + off;
    if (s->cfg.backend == PF_BACKEND_CUDA) {
        cuda_api *c = &s->cuda;
        int rc = 0;
        const char *what = "cudaStreamWaitEvent";
        if (t->after) rc = c->stream_wait_event(w->stream, t->after, 0);
        if (rc == 0) {
            what = "cudaMemcpyAsync";
            rc = c->memcpy_async(dst, src, (size_t)n, CUDA_MEMCPY_DEFAULT, w->stream);
        }
        if (rc == 0) {
            what = "cudaEventRecord";
            rc = c->event_record(w->event, w->stream);
        }
        if (rc == 0) {
            what = "cudaEventSynchronize";
            rc = c->event_sync(w->event);
        }
        if (rc != 0) {
            snprintf(msg, ERRLEN, "%s for a chunk of %llu bytes failed: %s", what, (unsigned long long)n,
                     c->error_string(rc));
            return -1;
        }
        return 0;
    }
    uint64_t lat = link_end ? chunk_latency_ns(s) : 0;
    uint64_t todo = fault ? n / 2 : n; /* an injected failure lands half the chunk */
    if (s->cfg.paced && link_end) {
        /* slice i lands at its share of the link time: dst changes until the chunk's end */
        uint64_t start = link_end - link_dur, step = (todo + PACED_SLICES - 1) / PACED_SLICES;
        for (uint64_t done = 0, i = 1; done < todo; done += step, i++) {
            uint64_t m = todo - done < step ? todo - done : step;
            memcpy(dst + done, src + done, (size_t)m);
            sleep_until(start + link_dur * i / PACED_SLICES);
        }
    } else {
        memcpy(dst, src, (size_t)todo);
    }
    if (link_end) sleep_until(link_end + lat);
    if (fault) {
        snprintf(msg, ERRLEN, "injected copy failure (fault_every=%u) after %llu of %llu bytes",
                 s->cfg.fault_every, (unsigned long long)todo, (unsigned long long)n);
        return -1;
    }
    return 0;
}

/* ---- workers --------------------------------------------------------------- */
/* Most urgent claimable task this worker may take, or NULL. Caller holds s->mu. */
static task *pick(pf_sched *s) {
    if (s->paused || !s->nonempty) return NULL;
    int p = __builtin_ctz(s->nonempty);
    if (p > 0 && s->busy_prefetch >= s->prefetch_limit) return NULL;
    return s->qhead[p];
}

static void *worker_main(void *arg) {
    worker *w = arg;
    pf_sched *s = w->s;
    char msg[ERRLEN];
    int rc0 = 0;
    if (s->cfg.backend == PF_BACKEND_CUDA) rc0 = s->cuda.set_device(s->cfg.device);
    pthread_mutex_lock(&s->mu);
    if (rc0 != 0 && s->worker_rc == 0) {
        s->worker_rc = PF_EBACKEND;
        snprintf(s->worker_err, ERRLEN, "a worker could not select CUDA device %d: %s", s->cfg.device,
                 s->cuda.error_string(rc0));
    }
    s->workers_ready++;
    pthread_cond_broadcast(&s->ready_cv);
    pthread_mutex_unlock(&s->mu);
    if (rc0 != 0) return NULL; /* pf_create sees worker_rc and shuts down */
#ifdef __linux__
    /* the link model (simulated, or pacing real copies) sleeps to absolute deadlines; the
     * default 50 us timer slack would stretch every chunk and leave the link idle between them */
    else if (s->cfg.link_gbps > 0) prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
    pthread_mutex_lock(&s->mu);
    for (;;) {
        task *t = pick(s);
        if (!t) {
            if (s->stopping) break;
            s->idle_workers++;
            pthread_cond_wait(&s->work_cv, &s->mu);
            s->idle_workers--;
            continue;
        }
        /* claim one chunk */
        uint64_t now = now_ns();
        uint64_t off = t->claimed;
        uint64_t n = t->nbytes - off;
        if (n > s->cfg.chunk_bytes) n = s->cfg.chunk_bytes;
        t->claimed += n;
        if (off == 0) {
            t->t_start = now;
            pf_level_stats *lv = &s->st.level[t->prio];
            /* a task submitted while a reset drained waits from the reset on */
            uint64_t qw = now - (t->t_submit > s->st.since_ns ? t->t_submit : s->st.since_ns);
            lv->queue_wait_ns += qw;
            if (qw > lv->max_queue_wait_ns) lv->max_queue_wait_ns = qw;
        }
        if (t->claimed == t->nbytes) q_remove(s, t);
        if (t->chunks_out++ == 0) s->st.level[t->prio].in_flight++;
        int prefetch = t->prio > 0;
        s->busy_prefetch += prefetch;
        uint64_t link_end = 0, dur = 0;
        int fault = 0;
        s->chunk_seq++;
        if (s->cfg.backend == PF_BACKEND_MEMCPY && s->cfg.fault_every && s->chunk_seq % s->cfg.fault_every == 0 &&
            (!s->cfg.fault_max || s->faults < s->cfg.fault_max)) {
            fault = 1;
            s->faults++;
        }
        if (s->cfg.link_gbps > 0) {
            /* the shared link, either backend: this chunk occupies [start, link_end) of it. The
             * memcpy backend copies within that slot; the cuda backend copies at once and the
             * chunk lands no earlier than link_end (see pace_until below) */
            double d = (double)n / s->cfg.link_gbps; /* GB/s == B/ns */
            dur = (uint64_t)(d < MAX_LINK_NS ? d : MAX_LINK_NS);
            uint64_t start = s->link_free_ns > now ? s->link_free_ns : now;
            link_end = start + dur;
            s->link_free_ns = link_end;
            s->st.link_busy_ns += dur;
        } else if (s->chunks_out == 0) {
            s->busy_since_ns = now;
        }
        s->chunks_out++;
        s->st.chunks++;
        /* more claimable work (the rest of this task, say): hand it to an idle worker now */
        if (s->idle_workers && pick(s)) pthread_cond_signal(&s->work_cv);
        pthread_mutex_unlock(&s->mu);

        int rc = copy_chunk(w, t, off, n, link_end, dur, fault, msg);

        pthread_mutex_lock(&s->mu);
        /* cuda backend, paced link: the copy has landed; report it when its slot (and latency_us)
         * has passed. A copy slower than its slot waits for nothing more; a failed one is not held */
        if (link_end && rc == 0 && s->cfg.backend == PF_BACKEND_CUDA) pace_until(s, link_end + chunk_latency_ns(s));
        s->busy_prefetch -= prefetch;
        if (--s->chunks_out == 0) {
            if (!link_end) s->st.link_busy_ns += now_ns() - s->busy_since_ns;
            if (s->paused) pthread_cond_broadcast(&s->drain_cv);
        }
        if (prefetch && s->idle_workers && s->nonempty) pthread_cond_signal(&s->work_cv);
        t->landed += n;
        /* a failure is never lost: a cancelled task fails too. A failing task is never revived;
         * it stays in the key map until its last chunk lands, so a submit of its key meanwhile
         * gets its ticket (which ends FAILED) and no second copy writes the same dst */
        if (rc != 0 && t->state != T_FAILING) {
            err_entry *e = &s->errs[t->ticket % NERR];
            e->ticket = t->ticket;
            memcpy(e->msg, msg, ERRLEN);
            t->state = T_FAILING;
            if (t->in_queue) q_remove(s, t);
        }
        if (--t->chunks_out == 0) {
            s->st.level[t->prio].in_flight--;
            if (t->state == T_FAILING) task_end(s, t, PF_FAILED);
            else if (t->state == T_CANCELLING) task_end(s, t, PF_CANCELLED);
            else if (t->landed == t->nbytes) task_end(s, t, PF_DONE);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- public API ------------------------------------------------------------- */
void pf_config_default(pf_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->backend = PF_BACKEND_MEMCPY;
    cfg->workers = 2;
    cfg->chunk_bytes = 4ull << 20;
    cfg->history = 1u << 16;
}

const char *pf_strerror(int code) {
    switch (code) {
    case PF_OK: return "ok";
    case PF_EINVAL: return "invalid argument";
    case PF_ENOMEM: return "out of memory";
    case PF_ECLOSED: return "scheduler is closed";
    case PF_ECONFLICT: return "key is already queued or in flight with another source, destination or size";
    case PF_EBACKEND: return "backend could not start";
    case PF_ETHREAD: return "worker thread could not start";
    case PF_ENOTICKET: return "unknown ticket";
    default: return "unknown error";
    }
}

static int cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc;
}

int pf_create(const pf_config *cfg, pf_sched **out, char *err, size_t errlen) {
    if (!cfg || !out) return PF_EINVAL;
    *out = NULL;
    if (cfg->workers < 1 || cfg->workers > 256 || cfg->chunk_bytes < 1 ||
        (cfg->backend != PF_BACKEND_MEMCPY && cfg->backend != PF_BACKEND_CUDA) || !(cfg->link_gbps >= 0) ||
        !(cfg->latency_us >= 0)) { /* written so that NaN is refused too */
        errf(err, errlen, "invalid configuration (workers 1..256, chunk_bytes > 0, known backend, "
             "link_gbps and latency_us >= 0)");
        return PF_EINVAL;
    }
    pf_sched *s = calloc(1, sizeof(*s));
    if (!s) return PF_ENOMEM;
    s->cfg = *cfg; /* cudart_path is used during pf_create only, then dropped */
    uint64_t hist = 1;
    while (hist < (cfg->history ? cfg->history : 1)) hist <<= 1;
    s->hist_mask = hist - 1;
    s->next_ticket = 1;
    s->prefetch_limit = cfg->workers > 1 ? cfg->workers - 1 : 1; /* one worker stays free for on-demand */
    int rc = PF_ENOMEM;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->shut_mu, NULL);
    cond_init_monotonic(&s->work_cv);
    cond_init_monotonic(&s->drain_cv);
    pthread_cond_init(&s->ready_cv, NULL);
    for (int i = 0; i < NBUCKET; i++) cond_init_monotonic(&s->wait_cv[i]);
    s->hist = calloc(hist, sizeof(hist_entry));
    s->w = calloc((size_t)cfg->workers, sizeof(worker));
    if (cfg->trace && !(s->trace = calloc(cfg->trace, sizeof(pf_trace_rec)))) goto fail;
    if (!s->hist || !s->w || map_init(&s->by_key, 1024) || map_init(&s->by_ticket, 1024)) goto fail;
    s->st.since_ns = now_ns();
    if (cfg->backend == PF_BACKEND_CUDA) {
        rc = cuda_open(s, err, errlen);
        if (rc) goto fail;
    }
    s->cfg.cudart_path = NULL;
    for (int i = 0; i < cfg->workers; i++) {
        s->w[i].s = s;
        if (pthread_create(&s->w[i].thread, NULL, worker_main, &s->w[i]) != 0) {
            errf(err, errlen, "could not start worker thread %d", i);
            rc = PF_ETHREAD;
            pf_shutdown(s); /* joins the workers already started */
            pf_destroy(s);
            return rc;
        }
        s->w[i].started = 1;
    }
    pthread_mutex_lock(&s->mu);
    while (s->workers_ready < cfg->workers) pthread_cond_wait(&s->ready_cv, &s->mu);
    rc = s->worker_rc;
    if (rc) errf(err, errlen, "%s", s->worker_err);
    pthread_mutex_unlock(&s->mu);
    if (rc) {
        pf_shutdown(s);
        pf_destroy(s);
        return rc;
    }
    *out = s;
    return 0;
fail:
    if (rc == PF_ENOMEM) errf(err, errlen, "out of memory");
    pf_destroy(s);
    return rc;
}

int pf_submit(pf_sched *s, uint64_t key, const void *src, void *dst, uint64_t nbytes, int priority,
              uint64_t *ticket) {
    return pf_submit_after(s, key, src, dst, nbytes, priority, NULL, ticket);
}

int pf_submit_after(pf_sched *s, uint64_t key, const void *src, void *dst, uint64_t nbytes, int priority,
                    void *after, uint64_t *ticket) {
    if (!s || !ticket) return PF_EINVAL;
    if (!src || !dst || nbytes == 0 || !valid_prio(priority)) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    task *t = map_get(&s->by_key, key, 1);
    int same = t && t->src == src && t->dst == dst && t->nbytes == nbytes;
    if (t && t->state != T_LIVE && !same) {
        /* cancelled or failed, last chunks landing elsewhere: the key is free for a new task */
        map_del(&s->by_key, t, 1);
        t->in_keymap = 0;
        t = NULL;
    }
    if (t) {
        if (!same) {
            pthread_mutex_unlock(&s->mu);
            return PF_ECONFLICT;
        }
        s->st.level[priority].deduplicated++;
        if (t->state == T_CANCELLING) {
            /* cancelled but chunks still out: revive it; the unclaimed rest is queued
             * again and the landed prefix is not copied a second time */
            t->state = T_LIVE;
            if (priority < t->prio) task_promote(s, t, priority);
            if (t->claimed < t->nbytes) {
                q_push(s, t);
                if (s->idle_workers) pthread_cond_signal(&s->work_cv);
            }
        } else if (t->state == T_LIVE && priority < t->prio) {
            /* promote in place: same task, same ticket, nothing copied twice */
            task_promote(s, t, priority);
        }
        *ticket = t->ticket;
        pthread_mutex_unlock(&s->mu);
        return 0;
    }
    t = s->free_tasks;
    if (t) s->free_tasks = t->tnext;
    else t = malloc(sizeof(*t));
    if (!t) {
        pthread_mutex_unlock(&s->mu);
        return PF_ENOMEM;
    }
    memset(t, 0, sizeof(*t));
    t->key = key;
    t->ticket = s->next_ticket++;
    t->src = src;
    t->dst = dst;
    t->after = s->cfg.backend == PF_BACKEND_CUDA ? after : NULL;
    t->nbytes = nbytes;
    t->prio = priority;
    t->t_submit = now_ns();
    t->in_keymap = 1;
    map_put(&s->by_key, t, 1);
    map_put(&s->by_ticket, t, 0);
    q_push(s, t);
    s->st.level[priority].submitted++;
    if (s->idle_workers) pthread_cond_signal(&s->work_cv);
    *ticket = t->ticket;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int pf_promote(pf_sched *s, uint64_t key, int priority) {
    if (!s || !valid_prio(priority)) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    int moved = 0;
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    task *t = map_get(&s->by_key, key, 1);
    if (t && t->state == T_LIVE && priority < t->prio) {
        task_promote(s, t, priority);
        moved = 1;
    }
    pthread_mutex_unlock(&s->mu);
    return moved;
}

int pf_cancel(pf_sched *s, uint64_t key) {
    if (!s) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    task *t = map_get(&s->by_key, key, 1);
    int n = t ? task_cancel(s, t) : 0;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int pf_cancel_band(pf_sched *s, int priority) {
    if (!s || !valid_prio(priority)) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    int n = cancel_where(s, priority, priority, 0, 0);
    pthread_mutex_unlock(&s->mu);
    return n;
}

int pf_cancel_below_layer(pf_sched *s, uint32_t layer, int min_priority) {
    if (!s || !valid_prio(min_priority)) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    int n = cancel_where(s, min_priority, PF_NUM_PRIORITY - 1, 1, layer);
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* Status of an ended or unknown ticket. Caller holds s->mu. */
static int ended_status(pf_sched *s, uint64_t ticket) {
    if (ticket == 0 || ticket >= s->next_ticket) return PF_ENOTICKET;
    hist_entry *h = &s->hist[ticket & s->hist_mask];
    return h->ticket == ticket ? h->status : PF_EXPIRED;
}

int pf_wait(pf_sched *s, uint64_t ticket, double timeout_s) {
    if (!s || timeout_s != timeout_s) return PF_EINVAL; /* NaN is no time limit anyone meant */
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    task *t = map_get(&s->by_ticket, ticket, 0);
    if (!t) {
        int st = ended_status(s, ticket);
        pthread_mutex_unlock(&s->mu);
        return st;
    }
    if (timeout_s == 0) {
        pthread_mutex_unlock(&s->mu);
        return PF_TIMEOUT;
    }
    int prio = t->prio; /* stall is charged to the level the awaited task is at */
    int b = (int)(ticket % NBUCKET);
    uint64_t start = now_ns();
    /* a limit beyond MAX_TIMEOUT_S (or +inf) is no limit; the conversion below stays in range */
    uint64_t deadline = timeout_s > 0 && timeout_s < MAX_TIMEOUT_S ? start + (uint64_t)(timeout_s * 1e9) : 0;
    int result = PF_TIMEOUT;
    s->waiters[b]++;
    s->waiting++;
    for (;;) {
        if (deadline) {
            struct timespec ts;
            ns_to_timespec(deadline, &ts);
            int rc = pthread_cond_timedwait(&s->wait_cv[b], &s->mu, &ts);
            (void)rc;
        } else {
            pthread_cond_wait(&s->wait_cv[b], &s->mu);
        }
        /* shutdown answers every blocked waiter with PF_CLOSED, also when it ended the
         * awaited task itself (cancelled as queued work) */
        if (s->stopping) {
            result = PF_CLOSED;
            break;
        }
        t = map_get(&s->by_ticket, ticket, 0);
        if (!t) {
            result = ended_status(s, ticket);
            break;
        }
        if (deadline && now_ns() >= deadline) {
            result = PF_TIMEOUT;
            break;
        }
    }
    s->waiters[b]--;
    s->waiting--;
    /* statistics cover the time since the last reset: a wait that began before it adds
     * only its blocked time after it, and is counted in the period where it began */
    pf_level_stats *lv = &s->st.level[prio];
    lv->stall_ns += now_ns() - (start > s->st.since_ns ? start : s->st.since_ns);
    if (start >= s->st.since_ns) lv->stall_waits++;
    pthread_mutex_unlock(&s->mu);
    return result;
}

int pf_query(pf_sched *s, uint64_t ticket) {
    if (!s) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    int st = s->stopping ? PF_ECLOSED : map_get(&s->by_ticket, ticket, 0) ? PF_PENDING : ended_status(s, ticket);
    pthread_mutex_unlock(&s->mu);
    return st;
}

int pf_ticket_error(pf_sched *s, uint64_t ticket, char *buf, size_t len) {
    if (!s || !buf || len == 0) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        buf[0] = '\0';
        return PF_ECLOSED;
    }
    err_entry *e = &s->errs[ticket % NERR];
    if (e->ticket == ticket) snprintf(buf, len, "%s", e->msg);
    else buf[0] = '\0';
    pthread_mutex_unlock(&s->mu);
    return 0;
}

static void zero_counters(pf_sched *s) {
    for (int p = 0; p < PF_NUM_PRIORITY; p++) {
        pf_level_stats *lv = &s->st.level[p];
        uint64_t depth = lv->queue_depth, inflight = lv->in_flight;
        memset(lv, 0, sizeof(*lv));
        lv->queue_depth = depth;
        lv->in_flight = inflight;
    }
    s->st.link_busy_ns = 0;
    s->st.chunks = 0;
    s->st.since_ns = now_ns();
    s->busy_since_ns = s->st.since_ns;
}

int pf_reset(pf_sched *s) {
    if (!s) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    s->paused++;
    cancel_where(s, 0, PF_NUM_PRIORITY - 1, 0, 0);
    while (s->chunks_out > 0 && !s->stopping) pthread_cond_wait(&s->drain_cv, &s->mu);
    zero_counters(s);
    s->link_free_ns = 0;
    s->paused--;
    if (!s->paused && s->idle_workers && s->nonempty) pthread_cond_broadcast(&s->work_cv);
    int closed = s->stopping;
    pthread_mutex_unlock(&s->mu);
    return closed ? PF_ECLOSED : 0;
}

int pf_trace_drain(pf_sched *s, pf_trace_rec *out, uint32_t max, uint64_t *dropped) {
    if (!s || (!out && max)) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    uint32_t n = 0;
    while (s->trace && n < max && s->trace_tail < s->trace_head) out[n++] = s->trace[s->trace_tail++ % s->cfg.trace];
    if (dropped) *dropped = s->trace_dropped;
    s->trace_dropped = 0;
    pthread_mutex_unlock(&s->mu);
    return (int)n;
}

int pf_get_stats(pf_sched *s, pf_stats *out) {
    if (!s || !out) return PF_EINVAL;
    pthread_mutex_lock(&s->mu);
    if (s->stopping) {
        pthread_mutex_unlock(&s->mu);
        return PF_ECLOSED;
    }
    *out = s->st;
    uint64_t now = now_ns();
    if (s->cfg.link_gbps <= 0 && s->chunks_out > 0) out->link_busy_ns += now - s->busy_since_ns;
    out->now_ns = now;
    out->waiting = (uint64_t)s->waiting;
    pthread_mutex_unlock(&s->mu);
    return 0;
}

int pf_shutdown(pf_sched *s) {
    if (!s) return PF_EINVAL;
    pthread_mutex_lock(&s->shut_mu);
    if (s->shut_done) {
        pthread_mutex_unlock(&s->shut_mu);
        return 0;
    }
    pthread_mutex_lock(&s->mu);
    s->stopping = 1;
    cancel_where(s, 0, PF_NUM_PRIORITY - 1, 0, 0);
    pthread_cond_broadcast(&s->work_cv);
    pthread_cond_broadcast(&s->drain_cv);
    for (int i = 0; i < NBUCKET; i++) pthread_cond_broadcast(&s->wait_cv[i]);
    pthread_mutex_unlock(&s->mu);
    for (int i = 0; i < s->cfg.workers; i++) {
        if (s->w[i].started) {
            pthread_join(s->w[i].thread, NULL);
            s->w[i].started = 0;
        }
    }
    /* wake anyone who began waiting on a task whose last chunk landed during the joins */
    pthread_mutex_lock(&s->mu);
    for (int i = 0; i < NBUCKET; i++) pthread_cond_broadcast(&s->wait_cv[i]);
    pthread_mutex_unlock(&s->mu);
    s->shut_done = 1;
    pthread_mutex_unlock(&s->shut_mu);
    return 0;
}

void pf_destroy(pf_sched *s) {
    if (!s) return;
    if (s->w) cuda_close(s);
    /* live tasks can remain only if workers never ran; free them through the ticket map */
    if (s->by_ticket.b) {
        for (uint64_t i = 0; i <= s->by_ticket.mask; i++) {
            task *t = s->by_ticket.b[i];
            while (t) {
                task *next = t->tnext;
                free(t);
                t = next;
            }
        }
    }
    while (s->free_tasks) {
        task *t = s->free_tasks;
        s->free_tasks = t->tnext;
        free(t);
    }
    free(s->by_key.b);
    free(s->by_ticket.b);
    free(s->hist);
    free(s->trace);
    free(s->w);
    for (int i = 0; i < NBUCKET; i++) pthread_cond_destroy(&s->wait_cv[i]);
    pthread_cond_destroy(&s->work_cv);
    pthread_cond_destroy(&s->drain_cv);
    pthread_cond_destroy(&s->ready_cv);
    pthread_mutex_destroy(&s->mu);
    pthread_mutex_destroy(&s->shut_mu);
    free(s);
}
