/*
 * fake_cudart.c: a stand-in for the CUDA runtime, so the stress test can drive pf_sched's
 * cuda backend (streams, events, the paced link) on a machine without a GPU.
 *
 * Built as a shared library by `make stress-asan` / `make stress-tsan` and handed to
 * pf_create through pf_config.cudart_path. It exports the twelve runtime functions that
 * pf_sched.c looks up. "Device memory" is host memory: cudaMemcpyAsync copies at once
 * (so a chunk's bytes are in dst when the call returns) and records on its stream when
 * the copy would finish on a link of fake_cudart_configure's copy rate;
 * cudaEventSynchronize sleeps until then. One device, index 0.
 *
 * Ownership: streams and events are malloc'd by their create calls and freed by their
 * destroy calls; fake_cudart_live() counts those not yet destroyed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define FAKE_INVALID_VALUE 1
#define FAKE_INVALID_DEVICE 101

typedef struct fake_stream {
    uint64_t busy_until; /* when the last copy queued on it finishes (monotonic ns) */
} fake_stream;

typedef struct fake_event {
    uint64_t until;      /* the recorded stream's busy_until at record time */
} fake_event;

static _Atomic double copy_gbps;      /* 0: copies take no time */
static atomic_uint fail_every;        /* every Nth cudaMemcpyAsync fails; 0: never */
static atomic_uint copies;
static atomic_long live;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Test control: the rate at which copies "cross the link" (GB/s; 0: instantly) and how
 * often a copy fails (every Nth; 0: never). Resets the copy counter. */
void fake_cudart_configure(double gbps, unsigned every) {
    atomic_store(&copy_gbps, gbps);
    atomic_store(&fail_every, every);
    atomic_store(&copies, 0);
}

long fake_cudart_live(void) { return atomic_load(&live); }

int cudaGetDeviceCount(int *n) {
    *n = 1;
    return 0;
}

int cudaGetDevice(int *d) {
    *d = 0;
    return 0;
}

int cudaSetDevice(int d) { return d == 0 ? 0 : FAKE_INVALID_DEVICE; }

int cudaStreamCreateWithFlags(void **s, unsigned int flags) {
    (void)flags;
    fake_stream *st = calloc(1, sizeof(*st));
    if (!st) return FAKE_INVALID_VALUE;
    atomic_fetch_add(&live, 1);
    *s = st;
    return 0;
}

int cudaStreamDestroy(void *s) {
    if (!s) return FAKE_INVALID_VALUE;
    free(s);
    atomic_fetch_sub(&live, 1);
    return 0;
}

int cudaEventCreateWithFlags(void **e, unsigned int flags) {
    (void)flags;
    fake_event *ev = calloc(1, sizeof(*ev));
    if (!ev) return FAKE_INVALID_VALUE;
    atomic_fetch_add(&live, 1);
    *e = ev;
    return 0;
}

int cudaEventDestroy(void *e) {
    if (!e) return FAKE_INVALID_VALUE;
    free(e);
    atomic_fetch_sub(&live, 1);
    return 0;
}

int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    (void)kind;
    unsigned every = atomic_load(&fail_every);
    unsigned k = atomic_fetch_add(&copies, 1) + 1;
    if (every && k % every == 0) return FAKE_INVALID_VALUE;
    memcpy(dst, src, n);
    fake_stream *st = stream;
    double gbps = atomic_load(&copy_gbps);
    uint64_t start = now_ns();
    if (st->busy_until > start) start = st->busy_until;
    st->busy_until = start + (gbps > 0 ? (uint64_t)((double)n / gbps) : 0); /* GB/s == B/ns */
    return 0;
}

int cudaEventRecord(void *e, void *stream) {
    ((fake_event *)e)->until = ((fake_stream *)stream)->busy_until;
    return 0;
}

int cudaEventSynchronize(void *e) {
    struct timespec ts;
    uint64_t until = ((fake_event *)e)->until;
    ts.tv_sec = (time_t)(until / 1000000000ull);
    ts.tv_nsec = (long)(until % 1000000000ull);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
    return 0;
}

int cudaStreamWaitEvent(void *stream, void *e, unsigned int flags) {
    (void)stream;
    (void)e;
    (void)flags;
    return 0;
}

const char *cudaGetErrorString(int code) {
    switch (code) {
    case 0: return "no error";
    case FAKE_INVALID_VALUE: return "fake runtime: injected failure";
    case FAKE_INVALID_DEVICE: return "fake runtime: invalid device";
    default: return "fake runtime: unknown error";
    }
}
