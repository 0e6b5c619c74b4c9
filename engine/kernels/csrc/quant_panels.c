/* Quantized linears for many rows of float activations (batched decode, prefill chunks): quant_kernels.c's
 * `duet_int8_linear` / `duet_int4_linear` hand calls of PANEL_MIN_ROWS rows or more here.
 *
 * Why: the per-output-row loops there unpack a weight block for every tile of 4 rows of x, so past a few rows they
 * are bound by unpacking, not by products; and dequantizing the whole weight for a GEMM writes and reads it again
 * as float32 (4-8x its quantized bytes) on every call. Here each thread dequantizes PANEL output rows at a time
 * into its own float32 buffer (the twin's values, q * s (+ m), kept in L2) and runs every 4-row tile of x against
 * every 4 rows of the panel in dot-product form:
 *
 *   panel  [PANEL][K] float32      x tile [4][K]           16 accumulators acc[r][i], 16 lanes each
 *   per 16 inputs: 4 loads of x, 4 of the panel, 16 FMAs; at the end the 16 accumulators are summed across
 *   their lanes in one tree (reduce16): 30 two-vector shuffles and 15 adds give out[r][i] in lane 4r + i.
 *
 * Written with csrc/vec16.h's 16-lane vectors, so every build runs the same code. The products are the twin's
 * (dequantized weight times x) summed in another order, with fused multiply-adds: equal to the twin up to float32
 * summation order. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define BLOCK 32
#define PANEL 16 /* output rows dequantized at once per thread */
#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */

/* out[4r + i] = x[r] . w[i] over k_in inputs: four rows of x (row stride ldx) against four panel rows */
static void tile4x4(const float *const x[4], const float *w, int64_t k_in, float out[16]) {
    v16 acc[16] = {0};
    int64_t k16 = k_in / 16 * 16;
    for (int64_t k = 0; k < k16; k += 16) {
        v16 xv[4], wv[4];
        for (int r = 0; r < 4; r++) xv[r] = load16(x[r] + k);
        for (int i = 0; i < 4; i++) wv[i] = load16(w + i * k_in + k);
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) acc[4 * r + i] += xv[r] * wv[i];
    }
    v16 sums = reduce16(acc);
    memcpy(out, &sums, sizeof sums);
    for (int64_t k = k16; k < k_in; k++) /* widths that are no multiple of 16 (per-channel int8) */
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) out[4 * r + i] += x[r][k] * w[i * k_in + k];
}

/* rows [o0, o0 + n) of the weight as float32 into panel [n][k_in]: q * s (+ m), the twin's two roundings */
static void dequantize_panel(int kind, const void *qweight, const float *scales, const float *mins, int64_t group,
                             int64_t o0, int64_t n, int64_t k_in, float *panel) {
    int64_t groups = k_in / group;
    for (int64_t i = 0; i < n; i++) {
        int64_t o = o0 + i;
        float *dst = panel + i * k_in;
        if (kind == 8) {
            const int8_t *q = (const int8_t *)qweight + o * k_in;
            for (int64_t g = 0; g < groups; g++) {
                float s = scales[o * groups + g];
                for (int64_t j = g * group; j < (g + 1) * group; j++) dst[j] = (float)q[j] * s;
            }
        } else {
            const uint8_t *q = (const uint8_t *)qweight + o * (k_in / 2);
            for (int64_t g = 0; g < k_in / BLOCK; g++) {
                float s = scales[o * groups + g], m = mins[o * groups + g];
                for (int j = 0; j < BLOCK / 2; j++) {
                    uint8_t byte = q[g * (BLOCK / 2) + j];
                    dst[g * BLOCK + j] = (float)(byte & 0x0F) * s + m;
                    dst[g * BLOCK + j + BLOCK / 2] = (float)(byte >> 4) * s + m;
                }
            }
        }
    }
}

/* sums [rows, n_out] = x [rows, k_in] (float32, row stride ldx) · dequantize(W)ᵀ, W int4 (kind 4: groups of 32 with
 * mins) or int8 (kind 8: scales per `group`, k_in or a multiple of 32). */
void duet_quant_panels(const float *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                       const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in) {
    int64_t panels = (n_out + PANEL - 1) / PANEL;
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    {
        float *panel = calloc((size_t)(PANEL * k_in), sizeof(float)); /* a last, partial panel's other rows: discarded */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int64_t o0 = p * PANEL, n = n_out - o0 < PANEL ? n_out - o0 : PANEL;
            dequantize_panel(kind, qweight, scales, mins, group, o0, n, k_in, panel);
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const float *xr[4];
                for (int r = 0; r < 4; r++) xr[r] = x + (r0 + r < rows ? r0 + r : r0) * ldx; /* past the end: again */
                for (int64_t i0 = 0; i0 < n; i0 += 4) {
                    float out[16];
                    tile4x4(xr, panel + i0 * k_in, k_in, out);
                    for (int r = 0; r < 4 && r0 + r < rows; r++)
                        for (int i = 0; i < 4 && i0 + i < n; i++) sums[(r0 + r) * n_out + o0 + i0 + i] = out[4 * r + i];
                }
            }
        }
        free(panel);
    }
}
