/*
 * pf_sched: a priority-banded transfer scheduler for expert weights.
 *
 * Every expert byte that pdflash moves goes through one pf_sched. A task
 * copies nbytes from src to dst and is named by a 64-bit key
 * (layer << 32 | expert). Worker threads serve the lowest priority number
 * first and claim work one chunk at a time, so an urgent task submitted while
 * a large background copy is in flight starts at the next chunk boundary and
 * the preempted copy resumes later from where it stopped.
 *
 * Ownership: the scheduler owns its task records, threads and statistics.
 * It never owns src, dst or a task's `after` event: the caller keeps them
 * alive (and src unchanged) until the task's ticket ends (done, cancelled or
 * failed) or until pf_reset or pf_shutdown has returned. A pf_wait that
 * returns PF_CLOSED does not end that duty: a chunk of the task may still be
 * landing until pf_shutdown returns. Statistics are copied into caller memory.
 *
 * Device ordering (cuda backend): each worker copies on its own non-blocking
 * stream and ends a task only after its last chunk has landed on the device
 * (a blocking-sync event), so work the caller launches after pf_wait returned
 * PF_DONE reads the landed bytes. Copies wait for the caller's pending work on
 * dst only through an `after` event (pf_submit_after): without one, the caller
 * must ensure nothing still reads or writes dst when it submits. With link_gbps
 * set, a task still ends only after its last chunk has landed, and in addition
 * no earlier than that chunk's slot on the paced link (see pf_config).
 *
 * Threads: every function except pf_destroy may be called from any thread at
 * any time. pf_shutdown wakes every blocked caller with PF_CLOSED; after it,
 * every call returns PF_ECLOSED. pf_destroy frees the scheduler and must be
 * called exactly once, after pf_shutdown, when no other call is running or
 * can start.
 *
 * Errors: functions return 0 (or a count / status) on success and a negative
 * PF_E* code on a caller mistake; pf_strerror names it.
 */
#ifndef PF_SCHED_H
#define PF_SCHED_H

#include <stdint.h>
#include <stddef.h>

#define PF_NUM_PRIORITY 20
#define PF_ON_DEMAND 0
#define PF_ROUTE_AHEAD 1
#define PF_BACKGROUND 2

/* error codes (negative) */
#define PF_OK 0
#define PF_EINVAL -1    /* bad argument: priority, size, NULL address, config */
#define PF_ENOMEM -2    /* allocation failed */
#define PF_ECLOSED -3   /* the scheduler has been shut down */
#define PF_ECONFLICT -4 /* key already live with another src, dst or size */
#define PF_EBACKEND -5  /* backend could not start (no CUDA runtime, bad device) */
#define PF_ETHREAD -6   /* a worker thread could not be started */
#define PF_ENOTICKET -7 /* ticket was never issued by this scheduler */

/* wait results (non-negative) */
#define PF_DONE 0
#define PF_CANCELLED 1
#define PF_TIMEOUT 2
#define PF_FAILED 3
#define PF_CLOSED 4
#define PF_PENDING 5  /* only from pf_query: still queued or in flight */
#define PF_EXPIRED 6  /* ended so long ago that its record was recycled */

#define PF_BACKEND_MEMCPY 0
#define PF_BACKEND_CUDA 1

typedef struct pf_sched pf_sched;

typedef struct pf_config {
    int backend;            /* PF_BACKEND_MEMCPY or PF_BACKEND_CUDA */
    int workers;            /* worker threads, >= 1 */
    uint64_t chunk_bytes;   /* largest piece a worker copies before re-checking the queues */
    double link_gbps;       /* shared link in GB/s (1e9 B/s) for all workers together; <= 0: none.
                             * Each chunk of n bytes reserves the slot [start, start + n / rate) on
                             * the link's timeline when it is claimed (start: when the link is next
                             * free, or now). memcpy backend: a simulated link; the worker copies
                             * and lands the chunk when its slot ends. cuda backend: the real copies
                             * are paced; cudaMemcpyAsync runs at once, but the chunk is reported
                             * landed (bytes counted, task ended) no earlier than its slot's end, so
                             * a faster real link emulates a slower one. A copy that takes longer
                             * than its slot adds nothing; pf_shutdown cuts the wait short */
    double latency_us;      /* with link_gbps > 0, either backend: a chunk lands this long after its
                             * slot ends (a fixed cost per chunk; it does not occupy the link) */
    int device;             /* cuda backend: device index */
    const char *cudart_path;/* cuda backend: runtime library to open; NULL: search known names */
    uint32_t history;       /* ended tickets remembered for wait (rounded up to a power of 2) */
    uint32_t trace;         /* ended tasks kept for pf_trace_drain (oldest dropped); 0: no trace */
    /* memcpy backend, for tests of failure and in-flight paths that otherwise only a GPU reaches: */
    uint32_t fault_every;   /* every Nth chunk copy fails (after writing half of it); 0: never */
    uint32_t fault_max;     /* at most this many injected failures; 0: no limit */
    int paced;              /* memcpy backend with link_gbps > 0: write each chunk in slices across its
                             * link time, so dst keeps changing until the chunk lands, as an
                             * asynchronous copy does (the cuda backend's copies are asynchronous) */
} pf_config;

/* Counters cover the time since the last pf_reset (or pf_create): a wait or queue wait
 * that began before a reset contributes only its time after it. */
typedef struct pf_level_stats {
    uint64_t submitted;     /* new tasks */
    uint64_t deduplicated;  /* submits answered with a live task's ticket */
    uint64_t promoted;      /* tasks moved to this (more urgent) level */
    uint64_t cancelled;
    uint64_t completed;
    uint64_t failed;
    uint64_t bytes;         /* bytes copied by completed tasks */
    uint64_t queue_depth;   /* tasks at this level not fully claimed by workers, now */
    uint64_t in_flight;     /* tasks at this level with chunks being copied, now */
    uint64_t queue_wait_ns; /* sum over started tasks of submit -> first chunk */
    uint64_t max_queue_wait_ns;
    uint64_t transfer_ns;   /* sum over ended tasks of first chunk -> end */
    uint64_t stall_ns;      /* time callers spent blocked in pf_wait on tasks at this level */
    uint64_t stall_waits;   /* pf_wait calls that blocked (counted in the period they began) */
} pf_level_stats;

typedef struct pf_stats {
    pf_level_stats level[PF_NUM_PRIORITY];
    uint64_t link_busy_ns;  /* without link_gbps: wall time during which at least one chunk was being
                             * copied; with link_gbps (either backend): the sum of the chunks' slots
                             * on the link, counted when each chunk is claimed */
    uint64_t chunks;        /* chunk copies issued */
    uint64_t waiting;       /* callers blocked in pf_wait now */
    uint64_t since_ns;      /* monotonic clock at the last reset (or start) */
    uint64_t now_ns;        /* monotonic clock when these stats were taken */
} pf_stats;

/* Fill cfg with defaults: memcpy backend, 2 workers, 4 MiB chunks, no link model. */
void pf_config_default(pf_config *cfg);

/* Start a scheduler. On success *out owns it (release with pf_shutdown then pf_destroy).
 * On failure returns PF_EINVAL / PF_ENOMEM / PF_EBACKEND / PF_ETHREAD and writes a
 * message into err (if not NULL, at most errlen bytes). */
int pf_create(const pf_config *cfg, pf_sched **out, char *err, size_t errlen);

/* Queue a copy. Returns 0 and the ticket in *ticket. If key is already queued or in
 * flight, returns its ticket instead (counted as deduplicated) and moves it to
 * `priority` if that is more urgent; PF_ECONFLICT if the live task has another
 * src, dst or size. */
int pf_submit(pf_sched *s, uint64_t key, const void *src, void *dst, uint64_t nbytes,
              int priority, uint64_t *ticket);

/* As pf_submit; on the cuda backend every chunk copy of a new task first waits (on the
 * device, through cudaStreamWaitEvent) for the CUDA event `after` (a cudaEvent_t recorded
 * by the caller after its last pending use of dst; NULL: no wait). The caller owns the event
 * and keeps it alive until the ticket ends. A submit answered with a live task's ticket keeps
 * that task's event. The memcpy backend ignores `after`. */
int pf_submit_after(pf_sched *s, uint64_t key, const void *src, void *dst, uint64_t nbytes,
                    int priority, void *after, uint64_t *ticket);

/* Move a live task to a more urgent priority. Returns 1 if moved, 0 if the key is not
 * live or already at least that urgent. */
int pf_promote(pf_sched *s, uint64_t key, int priority);

/* Cancel the live task of key. Chunks already being copied finish; no further chunk
 * starts. Returns 1 if cancelled, 0 if not live (or all its bytes are already claimed:
 * then it completes). A pf_submit of the same key, src, dst and size before those
 * chunks have landed revives the task under its ticket (it then ends done). A chunk that
 * fails ends its task PF_FAILED whatever its state (a cancelled task too) and the task is
 * never revived: until its last chunk has landed a submit of its key, src, dst and size
 * returns its ticket (it ends PF_FAILED); after that a submit starts a new task from byte 0. */
int pf_cancel(pf_sched *s, uint64_t key);

/* Cancel every live task at `priority`. Returns the number cancelled. */
int pf_cancel_band(pf_sched *s, int priority);

/* Cancel every live task whose key's layer (key >> 32) is below `layer` and whose
 * priority number is >= min_priority. Returns the number cancelled. */
int pf_cancel_below_layer(pf_sched *s, uint32_t layer, int min_priority);

/* Block until the ticket ends or timeout_s passes (timeout_s < 0, +inf or >= 1e9: no limit).
 * Returns PF_DONE, PF_CANCELLED, PF_FAILED, PF_TIMEOUT, PF_CLOSED, PF_EXPIRED or a
 * negative error. Time spent blocked is added to the stall of the task's level.
 * PF_CLOSED (pf_shutdown began) says nothing about the task's chunks: src and dst must
 * stay alive until pf_shutdown has returned. */
int pf_wait(pf_sched *s, uint64_t ticket, double timeout_s);

/* Non-blocking: PF_PENDING while live, else as pf_wait (PF_ECLOSED after pf_shutdown). */
int pf_query(pf_sched *s, uint64_t ticket);

/* Error text of a failed ticket (empty if none); copies at most len bytes. */
int pf_ticket_error(pf_sched *s, uint64_t ticket, char *buf, size_t len);

/* Not terminal: cancel every queued task, wait for chunks in flight to land, zero the
 * statistics. Workers keep running; the scheduler is usable at once. */
int pf_reset(pf_sched *s);

/* One ended task, for timelines. Times are CLOCK_MONOTONIC nanoseconds (start_ns is 0
 * for a task cancelled before any chunk started). */
typedef struct pf_trace_rec {
    uint64_t key;
    uint64_t ticket;
    uint64_t nbytes;
    uint64_t submit_ns;
    uint64_t start_ns;
    uint64_t end_ns;
    int priority;           /* level when it ended */
    int status;             /* PF_DONE, PF_CANCELLED, PF_FAILED or PF_CLOSED */
} pf_trace_rec;

/* Move up to max trace records, oldest first, into out (caller memory) and forget them.
 * Returns the number copied; *dropped (if not NULL) gets how many were overwritten
 * unread since the last drain. Returns 0 when tracing is off. */
int pf_trace_drain(pf_sched *s, pf_trace_rec *out, uint32_t max, uint64_t *dropped);

/* Copy the statistics into *out. */
int pf_get_stats(pf_sched *s, pf_stats *out);

/* Terminal and idempotent: refuse new work, cancel queued tasks, wake every waiter
 * with PF_CLOSED, let chunks in flight land, join the workers. Memory stays valid
 * until pf_destroy. */
int pf_shutdown(pf_sched *s);

/* Free everything. Only after pf_shutdown, with no other call running. */
void pf_destroy(pf_sched *s);

const char *pf_strerror(int code);

#endif
