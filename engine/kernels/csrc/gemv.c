/* One row times a dense weight, F.linear at batch-1 decode of an fp32 or bf16 model (engine/linear_fast.py's
 * one-row path). Why: torch's one-row GEMMs stream a weight well below the read bandwidth on the 2-core VM (fp32 MKL
 * ~7-9 GB/s, unpacked bf16 ~5-7). Here each thread takes a contiguous slice of W's rows and reads them one after
 * the other, so its slice is one sequential stream the hardware prefetcher follows, x staying in L1; two
 * accumulators a row. (Sixteen rows a pass sharing each load of x measured slower: 21 vs 29 GB/s on SmolLM2's bf16
 * lm_head, Zen 4: sixteen short interleaved streams.) bf16 weights are widened in registers, or multiplied by the
 * CPU's bf16 dot products (vdpbf16ps) where it has them; products of bf16 values are exact in float32. Float32
 * sums: equal to F.linear up to summation order (bf16: y rounded once, after the bias). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "vec16.h"

#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline v16 load16_bf16(const uint16_t *p) { /* 16 bf16 values as float32: the bits shifted up */
    u16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 wide = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    memcpy(&v, &wide, sizeof v);
    return v;
}

static inline float hsum16(v16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* w_row . x over k_in inputs, float32 x; the row float32 or bf16 (`bf16_w`, constant per caller) */
static inline __attribute__((always_inline)) float row_dot(const float *x, const void *w_row, int bf16_w,
                                                           int64_t k_in) {
    const float *w32 = w_row;
    const uint16_t *w16 = w_row;
    v16 a0 = {0}, a1 = {0};
    int64_t k = 0;
    for (; k + 32 <= k_in; k += 32) {
        a0 += (bf16_w ? load16_bf16(w16 + k) : load16(w32 + k)) * load16(x + k);
        a1 += (bf16_w ? load16_bf16(w16 + k + 16) : load16(w32 + k + 16)) * load16(x + k + 16);
    }
    float sum = hsum16(a0 + a1);
    for (; k < k_in; k++) sum += (bf16_w ? duet_bf16_to_f32(w16[k]) : w32[k]) * x[k];
    return sum;
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bf16 x and w with the CPU's bf16 dot products (vdpbf16ps: 32 products a 64-byte load, summed pairwise into
 * float32): 1 instruction per 32 weights where widening them costs 4; float32 sums as above, in another order */
static inline float row_dot_bf16(const uint16_t *x, const uint16_t *w_row, int64_t k_in) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_in; k += 64) {
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w_row + k)),
                              (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w_row + k + 32)),
                              (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)));
    }
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; k < k_in; k++) sum += duet_bf16_to_f32(w_row[k]) * duet_bf16_to_f32(x[k]);
    return sum;
}
#define GEMV_BF16_DOT 1
#endif

/* y [n_out] = w [n_out, k_in] · x [k_in] + bias (float32 or NULL), all float32 */
void duet_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t n_out, int64_t k_in) {
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) y[o] = row_dot(x, w + o * k_in, 0, k_in) + (bias ? bias[o] : 0.0f);
}

/* y [n_out] = w [n_out, k_in] · x [k_in] + bias, all bf16 (bias may be NULL): float32 sums, y rounded once */
void duet_gemv_bf16(const uint16_t *x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n_out,
                    int64_t k_in) {
#if !defined(GEMV_BF16_DOT)
    float *x = malloc(sizeof(float) * (size_t)(k_in > 0 ? k_in : 1));
    for (int64_t k = 0; k < k_in; k++) x[k] = duet_bf16_to_f32(x_bf16[k]);
#endif
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) {
#if defined(GEMV_BF16_DOT)
        float sum = row_dot_bf16(x_bf16, w + o * k_in, k_in);
#else
        float sum = row_dot(x, w + o * k_in, 1, k_in);
#endif
        y[o] = duet_f32_to_bf16(sum + (bias ? duet_bf16_to_f32(bias[o]) : 0.0f));
    }
#if !defined(GEMV_BF16_DOT)
    free(x);
#endif
}
