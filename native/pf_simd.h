/*
 * pf_simd.h: what the two CPU compute files (pf_cpu.c, pf_draft.c) share: the switch for their
 * x86 vector variants and bf16 -> float32. Internal to native/: not part of the cffi API.
 */
#ifndef PF_SIMD_H
#define PF_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define PF_X86 1
#include <immintrin.h>
#else
#define PF_X86 0
#endif

/* bf16 is the upper half of a float32: widening is exact */
static inline float pf_bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#endif /* PF_SIMD_H */
