/* One row times a dense weight, F.linear at batch-1 decode of an fp32 or bf16 model (engine/linear_fast.py's
 * one-row path). Why: torch's one-row GEMMs stream a weight well below the read bandwidth on the 2-core VM (fp32 MKL
 * ~7-9 GB/s, unpacked bf16 ~5-7), and so did this file's predecessor for bf16 (~12-14, 8 rows a pass, intrinsics
 * on AVX-512 only). Here each thread streams its own slice of W, sixteen output rows a pass sharing each load of x,
 * and csrc/vec16.h sums the sixteen accumulators in one tree; bf16 weights are widened in registers (products of
 * bf16 values are exact in float32). Float32 sums: equal to F.linear up to summation order (bf16: y rounded once,
 * after the bias). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "vec16.h"

#define OUTPUTS 16                 /* output rows per pass */
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

/* sums[i] = w[o0 + i] . x for i < n (n <= OUTPUTS): the weight float32 or bf16 (`bf16_w`, constant per caller) */
static inline __attribute__((always_inline)) void pass(const float *x, const void *w, int bf16_w, int64_t o0,
                                                       int64_t n, int64_t k_in, float sums[OUTPUTS]) {
    const float *row32[OUTPUTS];
    const uint16_t *row16[OUTPUTS];
    for (int i = 0; i < OUTPUTS; i++) { /* past the end: the first row again, its sums unused */
        int64_t o = o0 + (i < n ? i : 0);
        row32[i] = (const float *)w + o * k_in;
        row16[i] = (const uint16_t *)w + o * k_in;
    }
    v16 acc[OUTPUTS] = {0};
    int64_t k16 = k_in / 16 * 16;
    for (int64_t k = 0; k < k16; k += 16) {
        v16 xv = load16(x + k);
        for (int i = 0; i < OUTPUTS; i++) acc[i] += (bf16_w ? load16_bf16(row16[i] + k) : load16(row32[i] + k)) * xv;
    }
    v16 total = reduce16(acc);
    for (int i = 0; i < n; i++) {
        float sum = total[i];
        for (int64_t k = k16; k < k_in; k++) sum += (bf16_w ? duet_bf16_to_f32(row16[i][k]) : row32[i][k]) * x[k];
        sums[i] = sum;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bf16 x and w with the CPU's bf16 dot products (vdpbf16ps: 32 products a 64-byte load, summed pairwise into
 * float32): 1 instruction per 32 weights where widening them costs 4; the sums are float32 as above, in another
 * order (the pair within a lane first). */
static void pass_bf16_dot(const uint16_t *x, const uint16_t *w, int64_t o0, int64_t n, int64_t k_in,
                          float sums[OUTPUTS]) {
    const uint16_t *row[OUTPUTS];
    for (int i = 0; i < OUTPUTS; i++) row[i] = w + (o0 + (i < n ? i : 0)) * k_in;
    __m512 acc[OUTPUTS];
    for (int i = 0; i < OUTPUTS; i++) acc[i] = _mm512_setzero_ps();
    int64_t k32 = k_in / 32 * 32;
    for (int64_t k = 0; k < k32; k += 32) {
        __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
        for (int i = 0; i < OUTPUTS; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512((const void *)(row[i] + k)), xv);
    }
    v16 lanes[OUTPUTS];
    memcpy(lanes, acc, sizeof lanes);
    v16 total = reduce16(lanes);
    for (int i = 0; i < n; i++) {
        float sum = total[i];
        for (int64_t k = k32; k < k_in; k++) sum += duet_bf16_to_f32(row[i][k]) * duet_bf16_to_f32(x[k]);
        sums[i] = sum;
    }
}
#define GEMV_BF16_DOT 1
#endif

/* y [n_out] = w [n_out, k_in] · x [k_in] + bias (float32 or NULL), all float32 */
void duet_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t n_out, int64_t k_in) {
    int64_t passes = (n_out + OUTPUTS - 1) / OUTPUTS;
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t p = 0; p < passes; p++) {
        int64_t o0 = p * OUTPUTS, n = n_out - o0 < OUTPUTS ? n_out - o0 : OUTPUTS;
        float sums[OUTPUTS];
        pass(x, w, 0, o0, n, k_in, sums);
        for (int i = 0; i < n; i++) y[o0 + i] = sums[i] + (bias ? bias[o0 + i] : 0.0f);
    }
}

/* y [n_out] = w [n_out, k_in] · x [k_in] + bias, all bf16 (bias may be NULL): float32 sums, y rounded once */
void duet_gemv_bf16(const uint16_t *x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n_out,
                    int64_t k_in) {
    float *x = malloc(sizeof(float) * (size_t)(k_in > 0 ? k_in : 1));
    for (int64_t k = 0; k < k_in; k++) x[k] = duet_bf16_to_f32(x_bf16[k]);
    int64_t passes = (n_out + OUTPUTS - 1) / OUTPUTS;
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t p = 0; p < passes; p++) {
        int64_t o0 = p * OUTPUTS, n = n_out - o0 < OUTPUTS ? n_out - o0 : OUTPUTS;
        float sums[OUTPUTS];
#if defined(GEMV_BF16_DOT)
        pass_bf16_dot(x_bf16, w, o0, n, k_in, sums);
#else
        pass(x, w, 1, o0, n, k_in, sums);
#endif
        for (int i = 0; i < n; i++) y[o0 + i] = duet_f32_to_bf16(sums[i] + (bias ? duet_bf16_to_f32(bias[o0 + i]) : 0.0f));
    }
    free(x);
}
