/*
 * pf_relay: a captured graph's layers handed to the CPU through flags in page-locked memory
 * instead of host nodes.
 *
 * A host node (cudaLaunchHostFunc) runs on the driver's callback thread: on an H100 machine one
 * device -> CPU -> device round trip cost 40-55 us of a layer (benchmarks/handoff_gpu.py). A
 * graph can instead write a flag and wait for another with stream memory operations
 * (cuStreamWriteValue32 / cuStreamWaitValue32, each about 0.6 us in a graph): the relay's own
 * thread watches the first flag, runs the layer (pf_layer_run) and sets the second.
 *
 * Flags: uint32 [2 * layers], page-locked and mapped for the device. Layer i's down flag is
 * flags[i] (the device writes nonzero once the layer's routing has landed in host memory), its
 * up flag flags[layers + i] (the relay writes 1 once the layer's run has written its output; the
 * device waits for it before copying the output up).
 *
 * A step: pf_relay_arm(r, ctx, n, timeout_s) zeroes every flag and hands the thread the n
 * contexts of the step's layers 0 .. n-1 (n <= layers); the caller then launches the work
 * (a graph) that writes the down flags in order and waits for the up flags. For each layer in
 * turn the thread waits for its down flag, runs ctx[i] and sets its up flag. pf_relay_wait
 * blocks until the step has ended and returns how: PF_CPU_OK (every layer ran; each run's own
 * status is pf_layer_result's), PF_RELAY_ETIMEDOUT (a down flag did not come within timeout_s
 * of the previous layer's end, or of the arm for layer 0) or PF_RELAY_ECANCELED
 * (pf_relay_cancel). A step that ends early sets every up flag it did not answer, so the device
 * never waits for ever; those layers' outputs are not written.
 *
 * Waiting: while a step is armed the thread polls the down flag it waits for, spinning for
 * spin_us and then sleeping 50 us between reads (the device cannot signal a condition
 * variable); with no step armed it sleeps on a condition variable.
 *
 * Ownership: the relay owns its thread and a copy of the context array of the armed step; the
 * flags and the contexts are borrowed and must outlive the relay (a context must also stay alive
 * until the step that names it has ended). One step at a time: pf_relay_arm returns
 * PF_RELAY_EBUSY while a step is armed and not yet collected by pf_relay_wait. pf_relay_destroy
 * cancels an armed step, joins the thread and frees the relay: exactly once, after which no
 * device work may still wait on its flags.
 */
#ifndef PF_RELAY_H
#define PF_RELAY_H

#include <stdint.h>

#include "pf_layer.h"

#define PF_RELAY_EBUSY -30     /* a step is armed and not yet collected */
#define PF_RELAY_ETIMEDOUT -31 /* a down flag did not come in time (or pf_relay_wait's own timeout) */
#define PF_RELAY_ECANCELED -32 /* the step was cancelled */

typedef struct pf_relay pf_relay;

/* Start the relay's thread over flags [2 * layers] (layers >= 1). spin_us: how long a wait
 * spins before it sleeps between reads (<= 1000000). *out is NULL on failure. */
int pf_relay_create(uint32_t *flags, int layers, unsigned spin_us, pf_relay **out);

/* Cancel an armed step, stop and join the thread, free the relay. NULL is a no-op. */
void pf_relay_destroy(pf_relay *r);

/* Arm one step of ctx[0 .. n) (1 <= n <= layers, none NULL; copied), zeroing every flag first.
 * timeout_s > 0: the longest wait for one down flag. */
int pf_relay_arm(pf_relay *r, pf_layer *const *ctx, int n, double timeout_s);

/* End the armed step early: the thread stops after the run in progress (if any) and answers
 * the up flags it has not set. A no-op without an armed step. */
int pf_relay_cancel(pf_relay *r);

/* Wait up to timeout_s for the armed step to end, then collect it: *status is how it ended and
 * *answered the layers that ran. PF_RELAY_ETIMEDOUT if it is still running (still armed),
 * PF_CPU_EINVAL if no step was armed. */
int pf_relay_wait(pf_relay *r, double timeout_s, int *status, int *answered);

#endif /* PF_RELAY_H */
