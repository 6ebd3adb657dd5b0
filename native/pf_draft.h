/*
 * pf_draft: one pass of a small DFlash draft model on the CPU, computed in float32.
 *
 * A pass takes n new context rows (target features of committed tokens) and a block of b
 * rows (the embedded block tokens) at positions length .. length+n+b-1 and, per layer:
 *   rows = [fc-projected, hidden-normed context (n) ; input-normed block (b)]
 *   q (block rows), k, v (all rows) from one stacked weight; k and q normed per head (RMS over
 *   D) and rotated; every row's k / v written into the layer's cache at its position
 *   block queries attend (non-causal, GQA, optional sliding window) to keys 0 .. end-1
 *   x += o_proj(attention); x += down(silu(gate(post_norm(x))) * up(post_norm(x)))
 * and finally x = norm(x). This is DFlashDraftModel's forward (pdflash/draft/model.py), the
 * reference the tests compare against.
 *
 * pf_draft_argmax gives greedy proposals from final hidden rows through the target's output
 * head (float32 or bf16 weights, rows rounded to bf16 first and logits rounded to bf16, as a
 * bf16 head computes them); ties go to the first index, as torch.argmax.
 *
 * Ownership: every pointer is borrowed for the duration of a call; the caller keeps the
 * weights, features, x and the caches alive and unchanged meanwhile (x and the caches are
 * written). A call allocates its own scratch and frees it before returning; nothing is kept
 * between calls and there is no global state but the CPU level detected once (thread-safe),
 * so calls on distinct caches and outputs may run concurrently with shared weights.
 *
 * Errors: PF_CPU_OK (0) or PF_CPU_EINVAL / PF_CPU_ENOMEM / PF_CPU_EUNSUPPORTED (pf_cpu.h),
 * named by pf_cpu_strerror. A call that fails on its arguments writes nothing.
 *
 * Levels: PF_CPU_LEVEL_AUTO (the best this CPU runs), PF_CPU_LEVEL_SCALAR (portable C) or
 * PF_CPU_LEVEL_AVX2 (AVX2 + FMA; also what the AVX-512 levels use here).
 */
#ifndef PF_DRAFT_H
#define PF_DRAFT_H

#include <stdint.h>
#include <stddef.h>

/* One draft layer's weights, row-major [out][in] as nn.Linear keeps them. The matrices (w_*) are
 * float32 or, with the model's matrices_bf16, bf16 (widened exactly in registers: a draft whose
 * checkpoint is bf16 reads half the bytes for the same products); norms and biases are float32. */
typedef struct pf_draft_layer {
    const float *input_norm;      /* [H] */
    const float *post_norm;       /* [H] */
    const void *w_qkv;            /* [(Hq + 2 Hkv) D][H]: q rows, then k rows, then v rows */
    const float *b_qkv;           /* [(Hq + 2 Hkv) D] or NULL */
    const float *q_norm;          /* [D] */
    const float *k_norm;          /* [D] */
    const void *w_o;              /* [H][Hq D] */
    const float *b_o;             /* [H] or NULL */
    const void *w_gate_up;        /* [2 I][H]: gate rows, then up rows */
    const void *w_down;           /* [H][I] */
    int window;                   /* sliding window (keys with query_pos - key_pos < window); 0: none */
} pf_draft_layer;

typedef struct pf_draft_model {
    int hidden;                   /* H */
    int heads;                    /* Hq */
    int kv_heads;                 /* Hkv (divides Hq) */
    int head_dim;                 /* D (even) */
    int inter;                    /* I */
    int layers;                   /* L */
    int features;                 /* F: width of a context row before fc */
    float eps;                    /* RMS norms' epsilon */
    int matrices_bf16;            /* 1: fc and every layer's w_* are bf16, 0: float32 */
    const void *fc;               /* [H][F] */
    const float *hidden_norm;     /* [H] */
    const float *norm;            /* [H] final norm */
    const pf_draft_layer *layer;  /* [L] */
} pf_draft_model;

/* One pass. keys / values: [L][Hkv][capacity][D] float32 (the caches; positions < length are
 * the committed context, read; positions length .. length+n+b-1 are written). features: [n][F]
 * (NULL when n == 0). x: [b][H] the embedded block on entry, the final-normed hidden rows on
 * return (NULL when b == 0). cos / sin: [table][D] rotary tables by position (cos / sin of
 * position * frequency, times the attention scaling), table >= length + n + b.
 * Needs n + b >= 1 and length + n + b <= capacity. */
int pf_draft_pass(const pf_draft_model *m, float *keys, float *values, int capacity, int length,
                  const float *features, int n, float *x, int b, const float *cos, const float *sin,
                  int table, int level);

/* out[r] = argmax over v < vocab of (hidden[r] . w[v]) for r < rows; hidden [rows][H] float32;
 * w [vocab][H] float32 (w_bf16 == 0) or bf16 (w_bf16 == 1: hidden rounded to bf16 and each
 * logit rounded to bf16 before comparing). */
int pf_draft_argmax(const float *hidden, int rows, int hidden_size, const void *w, int w_bf16, int vocab,
                    int64_t *out, int level);

#endif /* PF_DRAFT_H */
