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
 * Written with csrc/vec16.h's 16-lane vectors for AVX-512; builds without it (AVX2: 16 registers of 8 lanes) run
 * the tile as two 2 x 4 halves of 8-lane vectors and dequantize with quant_kernels.c's row dequantizer. The
 * products are the twin's (dequantized weight times x) summed in another order, with fused multiply-adds (on
 * AVX-512 the int4 dequantization too: q * s + m rounded once where the twin rounds twice): equal to the twin up
 * to float32 rounding.
 *
 * bfloat16 activations on a CPU with AVX512-BF16 take `duet_quant_panels_bf16`: the panel is dequantized to
 * float32 and rounded to bfloat16 (what a bf16 model's dense weight is), and the tiles run vdpbf16ps, two products
 * per lane and instruction, on x as it is (no widening copy): twice the float32 tiles' products per instruction,
 * at the precision of the bf16 model it serves (each weight within half a bfloat16 ulp of the twin's). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "vec16.h"

#define BLOCK 32
#define PANEL 16 /* output rows dequantized at once per thread */
#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* out[4r + i] = x[r] . w[i] over k_in inputs: four rows of x (row stride ldx) against four panel rows; the 16
 * accumulators take 16 of AVX-512's 32 registers */
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

#else
/* Without AVX-512 a 16-lane vector is two of AVX2's 16 registers, so the 4 x 4 tile above would keep 32 registers
 * of accumulators and spill on every FMA (4-6x slower than the per-output-row loops on a Zen 3). Here the tile runs
 * as two 2 x 4 halves of 8-lane vectors: 8 accumulators, 2 of x and 4 of w, 14 registers. */
typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out lane j = the sum of acc[j]'s 8 lanes (reduce16's tree, one level fewer) */
static inline v8 reduce8(const v8 acc[8]) {
    v8 c[4], e[2];
    for (int j = 0; j < 4; j++) /* lanes 0-3: acc[2j]'s 4 partials, 4-7: acc[2j + 1]'s */
        c[j] = FOLD(acc[2 * j], acc[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               FOLD(acc[2 * j], acc[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 2; j++) /* four sums of 2 partials each */
        e[j] = FOLD(c[2 * j], c[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               FOLD(c[2 * j], c[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return FOLD(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14) + FOLD(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15);
}

/* out[4r + i] = x[r] . w[i] for two rows of x against four panel rows */
static void tile2x4(const float *x0, const float *x1, const float *w, int64_t k_in, float out[8]) {
    v8 acc[8] = {0};
    int64_t k8 = k_in / 8 * 8;
    for (int64_t k = 0; k < k8; k += 8) {
        v8 x0v = load8(x0 + k), x1v = load8(x1 + k);
#if defined(__x86_64__)
        /* in registers: GCC 12 otherwise reloads x as each FMA's memory operand, 12 loads to 8 FMAs (load-bound) */
        __asm__("" : "+x"(x0v), "+x"(x1v));
#endif
        for (int i = 0; i < 4; i++) {
            v8 wv = load8(w + i * k_in + k);
            acc[i] += x0v * wv;
            acc[4 + i] += x1v * wv;
        }
    }
    v8 sums = reduce8(acc);
    memcpy(out, &sums, sizeof sums);
    for (int64_t k = k8; k < k_in; k++) /* widths that are no multiple of 8 (per-channel int8) */
        for (int i = 0; i < 4; i++) out[i] += x0[k] * w[i * k_in + k], out[4 + i] += x1[k] * w[i * k_in + k];
}

static void tile4x4(const float *const x[4], const float *w, int64_t k_in, float out[16]) {
    tile2x4(x[0], x[1], w, k_in, out);
    tile2x4(x[2], x[3], w, k_in, out + 8);
}
#endif

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

/* unsigned bytes to float lanes through int32 lanes: GCC 12 turns a direct conversion into 16 scalar ones, and any
 * conversion of signed bytes too, so those go as (q + 128) - 128 (exact: small integers) */
#define TO_FLOATS(bytes) __builtin_convertvector(__builtin_convertvector(bytes, i32x16), v16)
#define SIGNED_TO_FLOATS(bytes) (TO_FLOATS((u8x16)(bytes) ^ 0x80) - 128.0f)

/* lanes [j, j + 16) of a dequantized row: float32, or bfloat16 (to_bf16: the bf16 panels, AVX512-BF16 builds) */
static inline void put16(void *dst, int64_t j, v16 v, int to_bf16) {
#if defined(__AVX512BF16__)
    if (to_bf16) {
        __m512 f;
        memcpy(&f, &v, sizeof f);
        _mm256_storeu_si256((__m256i *)((uint16_t *)dst + j), (__m256i)_mm512_cvtneps_pbh(f));
        return;
    }
#endif
    memcpy((float *)dst + j, &v, sizeof v);
}

static inline void put1(void *dst, int64_t j, float v, int to_bf16) {
    if (to_bf16)
        ((uint16_t *)dst)[j] = duet_f32_to_bf16(v);
    else
        ((float *)dst)[j] = v;
}

#if defined(__AVX512F__)
/* row o of the weight into dst [k_in] (float32, or bfloat16 with to_bf16): q * s (+ m), sixteen inputs at a time */
static void dequantize_row(int kind, const void *qweight, const float *scales, const float *mins, int64_t group,
                           int64_t o, int64_t k_in, void *dst, int to_bf16) {
    int64_t groups = k_in / group;
    if (kind == 8) {
        const int8_t *q = (const int8_t *)qweight + o * k_in;
        for (int64_t g = 0; g < groups; g++) {
            float s = scales[o * groups + g];
            int64_t j = g * group, end = (g + 1) * group;
            for (; j + 16 <= end; j += 16) {
                i8x16 b;
                memcpy(&b, q + j, sizeof b);
                put16(dst, j, SIGNED_TO_FLOATS(b) * s, to_bf16);
            }
            for (; j < end; j++) put1(dst, j, (float)q[j] * s, to_bf16); /* per-channel widths: no multiple of 16 */
        }
    } else { /* byte j of a block: input j in its low nibble, input j + 16 in its high one */
        const uint8_t *q = (const uint8_t *)qweight + o * (k_in / 2);
        for (int64_t g = 0; g < k_in / BLOCK; g++) {
            float s = scales[o * groups + g], m = mins[o * groups + g];
            u8x16 b;
            memcpy(&b, q + g * (BLOCK / 2), sizeof b);
            put16(dst, g * BLOCK, TO_FLOATS(b & 0x0F) * s + m, to_bf16);
            put16(dst, g * BLOCK + BLOCK / 2, TO_FLOATS(b >> 4) * s + m, to_bf16);
        }
    }
}

#else
/* Without AVX-512, GCC 12 lowers the 16-lane byte conversions above to scalar extracts and inserts (int4's took
 * two thirds of an 8-row call on a Zen 3): quant_kernels.c's row dequantizer unpacks with AVX2 instead. No
 * bfloat16 panels here: they need AVX512-BF16. */
void duet_dequantize_row(int kind, const void *qweight, const float *scales, const float *mins, int64_t group,
                         int64_t o, int64_t k_in, float *dst);

static void dequantize_row(int kind, const void *qweight, const float *scales, const float *mins, int64_t group,
                           int64_t o, int64_t k_in, void *dst, int to_bf16) {
    if (to_bf16) abort(); /* by_panels takes bf16 only where duet_quant_panels_bf16_available() */
    duet_dequantize_row(kind, qweight, scales, mins, group, o, k_in, dst);
}
#endif


#if defined(__AVX512BF16__)
int duet_quant_panels_bf16_available(void) { return 1; }

/* out[4r + i] = x[r] . w[i] over k_in (a multiple of 32) bfloat16 inputs, accumulated in float32 */
static void tile4x4_bf16(const uint16_t *const x[4], const uint16_t *w, int64_t k_in, float out[16]) {
    __m512 acc[16];
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; k += 32) {
        __m512bh xv[4], wv[4];
        for (int r = 0; r < 4; r++) xv[r] = (__m512bh)_mm512_loadu_si512(x[r] + k);
        for (int i = 0; i < 4; i++) wv[i] = (__m512bh)_mm512_loadu_si512(w + i * k_in + k);
        for (int r = 0; r < 4; r++)
            for (int i = 0; i < 4; i++) acc[4 * r + i] = _mm512_dpbf16_ps(acc[4 * r + i], xv[r], wv[i]);
    }
    v16 lanes[16];
    memcpy(lanes, acc, sizeof lanes);
    v16 sums = reduce16(lanes);
    memcpy(out, &sums, sizeof sums);
}

#else
int duet_quant_panels_bf16_available(void) { return 0; }
#endif

/* one 4 x 4 tile: float32 x against a float32 panel, or (bf16, AVX512-BF16 builds only) bfloat16 against bfloat16 */
static void tile(const void *const x[4], const void *w, int64_t k_in, int bf16, float out[16]) {
#if defined(__AVX512BF16__)
    if (bf16) {
        tile4x4_bf16((const uint16_t *const *)x, w, k_in, out);
        return;
    }
#endif
    tile4x4((const float *const *)x, w, k_in, out);
}

/* sums [rows, n_out] = x [rows, k_in] (row stride ldx; float32, or bfloat16 with bf16) · dequantize(W)ᵀ: each thread
 * dequantizes PANEL output rows at a time into its own buffer, in x's dtype, and runs the 4 x 4 tiles over it */
static void by_panels(const void *x, int64_t ldx, int bf16, int kind, const void *qweight, const float *scales,
                      const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in) {
    int64_t panels = (n_out + PANEL - 1) / PANEL;
    size_t esize = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    {
        char *panel = calloc((size_t)(PANEL * k_in), esize); /* a last, partial panel's other rows: discarded */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            int64_t o0 = p * PANEL, n = n_out - o0 < PANEL ? n_out - o0 : PANEL;
            for (int64_t i = 0; i < n; i++)
                dequantize_row(kind, qweight, scales, mins, group, o0 + i, k_in, panel + i * k_in * esize, bf16);
            for (int64_t r0 = 0; r0 < rows; r0 += 4) {
                const void *xr[4];
                for (int r = 0; r < 4; r++) /* past the end: the first row again */
                    xr[r] = (const char *)x + (r0 + r < rows ? r0 + r : r0) * ldx * (int64_t)esize;
                for (int64_t i0 = 0; i0 < n; i0 += 4) {
                    float out[16];
                    tile(xr, panel + i0 * k_in * esize, k_in, bf16, out);
                    for (int r = 0; r < 4 && r0 + r < rows; r++)
                        for (int i = 0; i < 4 && i0 + i < n; i++) sums[(r0 + r) * n_out + o0 + i0 + i] = out[4 * r + i];
                }
            }
        }
        free(panel);
    }
}

/* sums [rows, n_out] = x [rows, k_in] (float32, row stride ldx) · dequantize(W)ᵀ, W int4 (kind 4: groups of 32 with
 * mins) or int8 (kind 8: scales per `group`, k_in or a multiple of 32). */
void duet_quant_panels(const float *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                       const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in) {
    by_panels(x, ldx, 0, kind, qweight, scales, mins, group, sums, rows, n_out, k_in);
}

/* the same for bfloat16 x, k_in a multiple of 32; only where duet_quant_panels_bf16_available() */
void duet_quant_panels_bf16(const uint16_t *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                            const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in) {
    if (!duet_quant_panels_bf16_available()) abort(); /* callers ask first */
    by_panels(x, ldx, 1, kind, qweight, scales, mins, group, sums, rows, n_out, k_in);
}
