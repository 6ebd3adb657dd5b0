/*
 * pf_layer: one MoE layer's routed experts on the CPU, described once, run from its routing.
 *
 * A layer context names, at creation, everything a run reads and writes: the kernel context
 * (pf_cpu), the weights of the layer's num_experts experts (an array of pointers, one per
 * expert), top_k (K), the most token rows a run holds (rows), and three buffers:
 *   route: for each position p = t*K + k of a token row t < rows, the expert index (int64 or
 *          int32, idx_bytes 8 or 4) at idx + p, and its routing weight (float32) at scale + p;
 *   x:     the token rows, [rows][H], in x_format (PF_CPU_F32 or PF_CPU_BF16);
 *   out:   float32 [rows * K][H].
 * A run (pf_layer_run, or pf_layer_host_fn: the same with the signature of a CUDA host
 * function, so that a captured CUDA graph runs it as a host node between a device->host copy
 * of the routing and a host->device copy of out) takes the first `tokens` rows (set by
 * pf_layer_set_tokens, 1..rows), groups their positions by expert (experts ascending, each
 * expert's positions ascending, at most PF_CPU_MAX_TOKENS positions per kernel entry: the
 * grouping of pdflash's Python path, so the kernel makes the same choices and the outputs are
 * the same bits), makes one pf_cpu_experts call, so that out[p] = scale[p] * expert(x[p / K])
 * for every p < tokens * K, and zeroes the rows tokens * K .. rows * K - 1 of out.
 * With a resident map (uint8 [num_experts], nonzero: the expert is computed elsewhere, e.g. on
 * the device from its cache), positions routed to a resident expert are not computed: their out
 * rows are zeroed. The map is read at every run (the caller updates it between runs).
 * With prewake_us > 0, a run that succeeded then wakes the pool for the next call
 * (pf_cpu_prewake): the next layer's run, a GPU segment later.
 *
 * Fetching (optional, desc.fetch): a run may also move some of the non-resident experts to the
 * device through the scheduler instead of computing them, so that the link and the CPU serve
 * one layer side by side. With M distinct non-resident experts routed in the run, it fetches
 * f = min(plan[M], stages, M) of them: those with the most positions (ties: the lower index).
 * Each goes to its own stage (stage[i], i < f, in the order chosen) as one band-0 task (key
 * key_base + expert, src[expert], nbytes) submitted before the CPU computes the other experts;
 * their positions' out rows are zeroed, as for resident experts. After its kernel call the run
 * waits for those tasks (pf_wait, at most timeout_s each) and writes stage_of: for every
 * expert, the stage holding it or -1. An expert whose submit or task failed is computed here
 * after all (its stage_of -1), so out and stage_of together always cover every position. A
 * task that times out is cancelled, and the context fetches nothing from then on (a cancelled
 * task's last chunk may still land in its stage). The plan is read at every run (the caller
 * updates it between runs); pf_layer_fetch_result reads the last run's fetch figures.
 *
 * Route-ahead (optional, pf_layer_set_ahead(L, next, predicted, most)): a run of L first
 * prefetches for the context that runs after it (next, which fetches): of the experts predicted
 * for next at predicted[0 .. tokens*K) (int64; entries out of range ignored), the distinct ones
 * next does not hold resident, most positions first (ties: the lower index), at most `most`, each
 * one band-1 task (PF_ROUTE_AHEAD, key next's key_base + expert) into next's stage i. next's
 * following run claims each such prefetch whose expert it needs (routed, not resident): promoted
 * to band 0, it is one of that run's fetches (waited for after the kernel call, stage_of names
 * its stage), and the plan's fetches take the stages left free; it cancels the others and waits
 * until they have ended, so every stage is quiet when a run ends. Destroying a context resolves
 * prefetches still made into it the same way. pf_layer_ahead_result reads the last run's figures.
 * A host node that waits for the scheduler makes no CUDA call itself: the scheduler's worker
 * threads copy on their own streams and the run blocks on a condition variable.
 *
 * Errors: a run never returns a value to its caller (a host node cannot); it records its
 * status (PF_CPU_OK, PF_CPU_EINVAL for an expert index out of range, or the kernel's error),
 * and on an error zeroes all of out (having waited for any task it submitted). pf_layer_result reads the last run's status, the number
 * of distinct experts it ran, its wall time and the count of runs.
 *
 * Ownership: the context owns its scratch arrays (sized for rows * K positions at creation)
 * and a copy of the fetch description, nothing else: pf_cpu, the weights array and what it
 * points to, route, x, out and, with fetching, the scheduler, src, stage, plan and stage_of
 * arrays (and the memory they point to) are borrowed and must outlive the context, unchanged while a run may be in progress. Runs of one
 * context must not overlap (a CUDA stream runs its host nodes one at a time); runs of different
 * contexts on one pf_cpu are serialized by the kernel. set_tokens, set_prewake and result may
 * be called from another thread than the runs (atomics), but a run started before the call
 * may not see it: set before launching the work that runs it, read after that work finished.
 */
#ifndef PF_LAYER_H
#define PF_LAYER_H

#include <stdint.h>

#include "pf_cpu.h"
#include "pf_sched.h"

typedef struct pf_layer pf_layer;

typedef struct pf_layer_fetch {
    pf_sched *sched;
    const void *const *src;               /* [num_experts]: each expert's bytes (page-locked host) */
    uint64_t nbytes;                      /* every expert's size */
    void *const *stage;                   /* [stages]: destinations of nbytes each (device memory) */
    int stages;                           /* >= 1 */
    uint64_t key_base;                    /* task key of expert e: key_base + e (unique to this use) */
    const uint8_t *plan;                  /* [rows * K + 1]: experts to fetch when M are not resident */
    int32_t *stage_of;                    /* [num_experts], written by each run */
    double timeout_s;                     /* > 0: the longest wait for one task */
} pf_layer_fetch;

typedef struct pf_layer_desc {
    pf_cpu *cpu;
    const pf_cpu_weights *const *experts; /* [num_experts], none NULL */
    int num_experts;
    int top_k;                            /* K >= 1 */
    int rows;                             /* most token rows per run, >= 1 */
    int hidden;                           /* H: every expert's hidden size */
    int idx_bytes;                        /* 8 (int64) or 4 (int32) */
    const void *idx;                      /* [rows * K] */
    const float *scale;                   /* [rows * K] */
    const void *x;                        /* [rows][H] */
    int x_format;                         /* PF_CPU_F32 or PF_CPU_BF16 */
    float *out;                           /* [rows * K][H] */
    const uint8_t *resident;              /* [num_experts] or NULL (every routed expert computed) */
    const pf_layer_fetch *fetch;          /* NULL: nothing fetched (copied at creation) */
} pf_layer_desc;

/* Check the description and build a context (tokens = rows, prewake_us = 0). On success *out
 * owns the scratch; release it with pf_layer_destroy. On failure *out is NULL. */
int pf_layer_create(const pf_layer_desc *d, pf_layer **out);

/* Free the context's scratch. Exactly once, when no run is in progress. */
void pf_layer_destroy(pf_layer *L);

int pf_layer_set_tokens(pf_layer *L, int tokens); /* 1..rows, else PF_CPU_EINVAL */
int pf_layer_set_prewake(pf_layer *L, unsigned us);

/* Run now on this thread; returns the run's status (also kept for pf_layer_result). */
int pf_layer_run(pf_layer *L);

/* pf_layer_run for cudaLaunchHostFunc / a graph's host node: layer is a pf_layer *. */
void pf_layer_host_fn(void *layer);

/* The last run's status, distinct experts run and wall nanoseconds, and how many runs there
 * have been (0s before any run): a caller that launched one run checks that it happened. */
int pf_layer_result(pf_layer *L, int *status, int *experts, uint64_t *ns, uint64_t *runs);

/* The last run's fetching: experts fetched into stages, experts whose fetch failed (computed
 * here instead), nanoseconds it blocked waiting for its tasks after its own kernel call, and
 * whether fetching is off for good (a task timed out). Zeros without fetching. */
int pf_layer_fetch_result(pf_layer *L, int *fetched, int *fallback, uint64_t *wait_ns, int *disabled);

/* Route-ahead: each run of L also prefetches the experts `predicted` for next at band 1 (see
 * above); most in 0 .. next's stages. next must fetch, have L's experts, top_k and at least its
 * rows, and differ from L. next NULL: L prefetches nothing. Call only while neither context
 * runs; predicted is borrowed like the other buffers. */
int pf_layer_set_ahead(pf_layer *L, pf_layer *next, const int64_t *predicted, int most);

/* The last run's route-ahead: prefetches it submitted for its next context (sent), and of those
 * a previous run made into its own stages, how many it claimed (used) and cancelled (unused). */
int pf_layer_ahead_result(pf_layer *L, int *sent, int *used, int *unused);

/* The last run's clock: when it started (CLOCK_MONOTONIC nanoseconds, the clock of
 * Python's time.monotonic_ns on Linux) and the nanoseconds of its kernel calls (the CPU's
 * share of its wall time; the rest is grouping, submits and the fetch wait). Zeros before any
 * run. With the wall time of pf_layer_result, a caller places each run on a timeline: what ran
 * between two host nodes (the device's work) is the gap between one run's end and the next
 * one's start. */
int pf_layer_clock(pf_layer *L, uint64_t *begin_ns, uint64_t *kernel_ns);

/* Every figure above of n contexts at once, for a caller that reads a whole step's layers after
 * it (one call instead of several per layer): row i of out (PF_LAYER_REPORT int64 values) holds
 * layers[i]'s status, experts, wall ns and runs (pf_layer_result), begin and kernel ns
 * (pf_layer_clock), fetch wait ns (pf_layer_fetch_result) and route-ahead sent, used and unused
 * (pf_layer_ahead_result), in that order. PF_CPU_EINVAL (out untouched) for a NULL array, out
 * or context, or n < 1. */
#define PF_LAYER_REPORT 10
int pf_layer_report(pf_layer *const *layers, int n, int64_t *out);

#endif /* PF_LAYER_H */
