/* One float32 row times a dense float32 weight: F.linear at batch-1 decode of an fp32 model (engine/linear_fast.py's
 * one-row path). Why: torch's fp32 GEMV (MKL) streams a weight at ~7-9 GB/s on the 2-core VM, a third of the read
 * bandwidth; here each thread streams its own slice of W, sixteen output rows a pass sharing each load of x, and
 * csrc/vec16.h sums the sixteen accumulators in one tree. Equal to F.linear up to float32 summation order. */

#include <stdint.h>

#include "vec16.h"

#define OUTPUTS 16                 /* output rows per pass */
#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */

/* y [n_out] = w [n_out, k_in] · x [k_in] + bias (float32 or NULL) */
void duet_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t n_out, int64_t k_in) {
    int64_t passes = (n_out + OUTPUTS - 1) / OUTPUTS, k16 = k_in / 16 * 16;
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t p = 0; p < passes; p++) {
        int64_t o0 = p * OUTPUTS, n = n_out - o0 < OUTPUTS ? n_out - o0 : OUTPUTS;
        const float *row[OUTPUTS];
        for (int i = 0; i < OUTPUTS; i++) row[i] = w + (o0 + (i < n ? i : 0)) * k_in; /* past the end: again */
        v16 acc[OUTPUTS] = {0};
        for (int64_t k = 0; k < k16; k += 16) {
            v16 xv = load16(x + k);
            for (int i = 0; i < OUTPUTS; i++) acc[i] += load16(row[i] + k) * xv;
        }
        v16 sums = reduce16(acc);
        for (int i = 0; i < n; i++) {
            float sum = sums[i];
            for (int64_t k = k16; k < k_in; k++) sum += row[i][k] * x[k];
            y[o0 + i] = sum + (bias ? bias[o0 + i] : 0.0f);
        }
    }
}
