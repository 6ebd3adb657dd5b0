/*
 * pf_cpu: MoE expert maths on the CPU, straight from the stored weights.
 *
 * For one expert and 1..PF_CPU_MAX_TOKENS tokens routed to it, gpt-oss (formats F32, BF16, MXFP4):
 *   gate_up = x @ W1 + b1            W1: 2I outputs; gate = even outputs, up = odd ones
 *   gate = min(gate, limit); up = clamp(up, -limit, limit)
 *   h = (up + 1) * gate * sigmoid(alpha * gate)       [T, I]
 *   out = h @ W2 + b2                 W2: H outputs        [T, H]
 * Qwen3-MoE (the row formats F32_ROWS, BF16_ROWS, FP8_ROWS; no biases):
 *   gate_up = x @ W1^T                W1 [2I][H]: gate = outputs 0..I-1, up = outputs I..2I-1
 *   h = silu(gate) * up;  out = h @ W2^T    W2 [H][I]
 * An FP8 weight is the float8_e4m3fn code times its block's scale (scale_inv, one per block x
 * block tile), as transformers dequantizes it; a bfloat16 model rounds that product to bf16.
 * The weights are read where they are stored (the packed host store rows): MXFP4 blocks
 * and E8M0 scales are decoded in registers, never into a dequantized copy; bf16 and
 * float32 dense weights are widened in registers. Everything accumulates in float32.
 * The routing weight of each token is not applied here (the caller scales the rows).
 * With round_bf16 the intermediate results are rounded to bfloat16 where a bfloat16 model
 * (transformers' GptOssExperts / Qwen3MoeExperts in bf16) rounds them: each projection's float32
 * sum, the bias additions, every SwiGLU step (SiLU and its product with up), and an FP8 or float32
 * row weight; the output rows are then bf16 values held in float32.
 *
 * Work split: the output features of gate_up, then those of down, are divided into
 * units (4 rows of MXFP4 or row weights, 32 columns of dense ones) that the threads claim in
 * grabs from one atomic counter; each grab is computed for all tokens at once, so a call
 * reads each weight byte once whatever the token count, and a thread that starts late
 * takes fewer grabs instead of holding the others up. The two phases are separated by
 * one hand-off (the down projection needs all of h).
 *
 * Threads: a pf_cpu owns a pool of (threads - 1) worker threads; the calling thread is
 * the pool's thread 0. Between the phases of a call a thread that has run out of grabs
 * polls for the next phase for at most PF_CPU_POLL_NS (100 us), then sleeps on a condition
 * variable; between calls the workers sleep (an idle pool never spins).
 * pf_cpu_expert calls on the same pf_cpu are serialized by a mutex; use one pf_cpu per
 * concurrent caller to run experts in parallel.
 *
 * Ownership: the pf_cpu owns its threads and its scratch buffers (the token rows in
 * kernel order, gate_up and h: T * (H + 3I) floats, grown on demand, freed by
 * pf_cpu_destroy). It never owns the weights, x or out: the caller keeps them alive and
 * unchanged for the duration of the call; out is written, never read, and must not
 * overlap x or the weights. Nothing is kept after a call returns.
 *
 * Errors: functions return PF_CPU_OK (0) or a negative PF_CPU_E* code;
 * pf_cpu_strerror names it. A failed call writes nothing to out.
 *
 * CPU dispatch: the kernels of every level are compiled into the one library; the level
 * is chosen at pf_cpu_create (PF_CPU_LEVEL_AUTO: the best this CPU runs) and may be
 * forced lower for testing. Levels: portable C; AVX2 + FMA + F16C; AVX-512 (F, BW, VL); AVX512_BF16
 * (the AVX-512 kernels, plus bf16 dot products for MXFP4 weights whenever both factors are
 * bf16 values: x given in bf16, and h of a round_bf16 expert; the products are exact);
 * AMX_BF16 (those, plus AMX tiles for the same bf16 products where an expert has at least 4
 * tokens: 16 weight rows x 16 tokens per tile multiply, each group's scale folded into its
 * weights' exponents). The row formats run on the AVX2 and AVX-512 kernels at every level above
 * the portable one (FP8 through float16: F16C / AVX-512's conversion), the portable kernel
 * where a row or an FP8 block is not whole vector chunks (AVX2: 8 weights; AVX-512 blocks: 16);
 * from AVX512_BF16 on, a bf16 model's FP8 (blocks of whole 32-weight chunks) and float32 rows
 * take bf16 dot products (each weight rounded to bf16 as that model's is; x a bf16 value). At
 * AMX_BF16, a bf16 model's rows of every format take the AMX tiles where an expert has at least
 * AMX_MIN_TOKENS (4) tokens and H, I (and an FP8 block) are whole 32-weight chunks: bf16 rows
 * loaded into the tiles as stored, FP8 and float32 rows rounded to bf16 on the way.
 */
#ifndef PF_CPU_H
#define PF_CPU_H

#include <stdint.h>
#include <stddef.h>

#define PF_CPU_MAX_TOKENS 16
#define PF_CPU_MAX_THREADS 256

/* dispatch levels */
#define PF_CPU_LEVEL_AUTO -1
#define PF_CPU_LEVEL_SCALAR 0
#define PF_CPU_LEVEL_AVX2 1
#define PF_CPU_LEVEL_AVX512 2
#define PF_CPU_LEVEL_AVX512_BF16 3
#define PF_CPU_LEVEL_AMX_BF16 4

/* element formats */
#define PF_CPU_F32 0
#define PF_CPU_BF16 1
#define PF_CPU_MXFP4 2
#define PF_CPU_F32_ROWS 3  /* Qwen3-MoE: output-major rows, SiLU (below) */
#define PF_CPU_BF16_ROWS 4
#define PF_CPU_FP8_ROWS 5

/* error codes (negative) */
#define PF_CPU_OK 0
#define PF_CPU_EINVAL -1       /* bad argument: NULL pointer, size, format, token count */
#define PF_CPU_ENOMEM -2       /* a scratch buffer could not be allocated */
#define PF_CPU_ETHREAD -3      /* a worker thread could not be started */
#define PF_CPU_EUNSUPPORTED -4 /* the level asked for is not supported by this CPU */

typedef struct pf_cpu pf_cpu;

/* One expert's weights, as stored. Pointers are borrowed for the duration of a call.
 * MXFP4 (format PF_CPU_MXFP4), output-major as in the checkpoint:
 *   gate_up: blocks uint8 [2I][H/32][16] (two E2M1 codes a byte, low nibble first),
 *   gate_up_scales: uint8 [2I][H/32] (E8M0: 2^(s-127)); down: [H][I/32][16], down_scales
 *   [H][I/32]. H and I must be multiples of 32.
 * Dense (PF_CPU_BF16 or PF_CPU_F32), input-major as transformers keeps them:
 *   gate_up [H][2I], down [I][H]; the scale pointers are NULL. Any H, I >= 1.
 * Biases: [2I] and [H] in bias_format (PF_CPU_F32 or PF_CPU_BF16), or NULL for none.
 * Rows (PF_CPU_F32_ROWS, PF_CPU_BF16_ROWS, PF_CPU_FP8_ROWS: Qwen3-MoE), output-major as stored:
 *   gate_up [2I][H] (gate rows, then up rows), down [H][I], elements float32, bf16 or
 *   float8_e4m3fn; no biases (NULL); alpha and limit unused. FP8: gate_up_scales [2I/b][H/b] and
 *   down_scales [H/b][I/b] hold scale_format values (PF_CPU_F32 or PF_CPU_BF16) of the b x b
 *   tiles (b = block, >= 1, dividing H and I); the other row formats take NULL scales. */
typedef struct pf_cpu_weights {
    int format;
    int bias_format;
    int hidden;                    /* H */
    int inter;                     /* I */
    const void *gate_up;
    const uint8_t *gate_up_scales;
    const void *gate_up_bias;
    const void *down;
    const uint8_t *down_scales;
    const void *down_bias;
    float alpha;                   /* gpt-oss: 1.702 */
    float limit;                   /* gpt-oss: 7.0 */
    int round_bf16;                /* 1: round like a bfloat16 model (below); 0: float32 throughout */
    int block;                     /* PF_CPU_FP8_ROWS: the scales' tile edge b; otherwise 0 */
    int scale_format;              /* PF_CPU_FP8_ROWS: PF_CPU_F32 or PF_CPU_BF16 scales; otherwise 0 */
} pf_cpu_weights;

/* Best level this CPU (and OS) runs. */
int pf_cpu_detect(void);

/* Start a context with `threads` threads in all (1..PF_CPU_MAX_THREADS; the caller counts
 * as one) at `level` (PF_CPU_LEVEL_AUTO or a level <= pf_cpu_detect()). On success *out
 * owns the pool; release it with pf_cpu_destroy. On failure *out is NULL. */
int pf_cpu_create(int threads, int level, pf_cpu **out);

/* Stop and join the workers and free everything. Exactly once, when no call is running. */
void pf_cpu_destroy(pf_cpu *c);

int pf_cpu_level(const pf_cpu *c);
int pf_cpu_threads(const pf_cpu *c);

/* How many of the pool's threads take part in its calls from the next phase on: threads 0 .. n-1
 * (the caller and n - 1 workers); the others sleep, and prewakes leave them asleep. 1 .. the
 * pool's threads (the default: all of them), else PF_CPU_EINVAL. For a caller whose other threads
 * need some of the cores for a while (a copy scheduler's workers during fetches). Callable from
 * any thread, also while a call runs (its later phases see it; every phase completes either way). */
int pf_cpu_set_active(pf_cpu *c, int n);
int pf_cpu_active(pf_cpu *c); /* the count set last, or PF_CPU_EINVAL for NULL */

/* Batch invariance. With on != 0, every (token, expert) pair of a call is computed by the same
 * kernel whatever the number of tokens routed to its expert, so a token's result does not
 * depend on the other tokens of its call (speculative decoding's batch-invariant verify: a
 * position's logits the same in any verify block). Off (0, the default), an expert with
 * AMX_MIN_TOKENS or more tokens takes the AMX tiles where they run, which sum in another order
 * than the vector kernels, so its tokens' results differ in the last bits from one-token calls.
 * Calls that start after it see it; callable from any thread. PF_CPU_EINVAL for NULL. */
int pf_cpu_set_invariant(pf_cpu *c, int on);
int pf_cpu_invariant(pf_cpu *c); /* 1 or 0 as set last, or PF_CPU_EINVAL for NULL */

/* out[T][H] (float32, row-major) = the expert applied to x[T][H] (x_format PF_CPU_F32
 * or PF_CPU_BF16, row-major, rows x_stride elements apart, x_stride >= H), 1 <= T <=
 * PF_CPU_MAX_TOKENS. Blocks (GIL released by the Python binding) until done. */
int pf_cpu_expert(pf_cpu *c, const pf_cpu_weights *w, const void *x, int x_format, int tokens,
                  int x_stride, float *out);

/* Many experts in one call (one hand-off of the pool per phase, however many experts).
 * Expert k (0 <= k < n) has weights w[k] (all with the same hidden size H) and counts[k]
 * tokens (1..PF_CPU_MAX_TOKENS). The token entries of all experts are laid end to end
 * (sum(counts) entries in rows, scale and dest): entry i is row rows[i] of x (x_rows rows,
 * x_stride elements apart, format x_format), and its result goes to row dest[i] of out
 * (float32, out_rows rows, out_stride elements apart), multiplied by scale[i] (the routing
 * weight; scale NULL: by nothing). Every dest entry must be distinct (each output row is
 * written once); other rows of out are not touched. The threads split the experts' gate_up
 * rows laid end to end, then their down rows, so a call reads each weight byte once.
 * n == 0 is a no-op. */
int pf_cpu_experts(pf_cpu *c, int n, const pf_cpu_weights *const *w, const int *counts, const int *rows,
                   const float *scale, const void *x, int x_format, int x_rows, int x_stride, float *out,
                   const int *dest, int out_rows, int out_stride);

/* Read nbytes at buf once with the pool's threads (64 KiB grabs claimed as the kernel's, the
 * widest loads of the context's level) and store a checksum of the bytes in *sum: the
 * streaming read bandwidth of the same threads, for comparing the kernel against. Serialized
 * with pf_cpu_expert. */
int pf_cpu_stream_read(pf_cpu *c, const void *buf, size_t nbytes, uint64_t *sum);

/* Wake the pool's sleeping workers now and let them poll for the next call for up to `us`
 * microseconds (at most 100000) before they sleep again, so that a call the caller knows is
 * coming (a layer whose routing is on its way) finds every thread awake: a sleeping thread
 * takes 30-300 us to wake. Returns at once. A deadline already set is only ever extended;
 * us == 0 is a no-op. Callable from any thread, also while a call runs. */
int pf_cpu_prewake(pf_cpu *c, unsigned us);

/* Where the time of the context's last call went (pf_cpu_expert, pf_cpu_experts or
 * pf_cpu_stream_read), in nanoseconds from the call's start, for phases 0 (token rows),
 * 1 (gate_up) and 2 (down); phase 3 is the stream read. A phase that did not run has
 * joined 0 and zero times. published: when its grabs became claimable; first_join / last_join:
 * the first and the last claim of a thread that took part (joined: how many threads did);
 * completed: its last grab finished. end: the pool handed the call back to its caller.
 * Serialized with the calls; PF_CPU_EINVAL before the first call. */
typedef struct pf_cpu_timing {
    uint64_t published[4], first_join[4], last_join[4], completed[4];
    int joined[4];
    uint64_t end;
} pf_cpu_timing;
int pf_cpu_last_timing(pf_cpu *c, pf_cpu_timing *out);

const char *pf_cpu_strerror(int code);
const char *pf_cpu_level_name(int level);

#endif /* PF_CPU_H */
