/* A few rows times a dense weight, F.linear at decode of an fp32 or bf16 model (engine/linear_fast.py's `gemv`, up
 * to its GEMV_ROWS rows; the fused decode layer up to GEMV_MAX_ROWS). Why: torch's one-row GEMMs stream a weight well
 * below the read bandwidth on the 2-core VM (fp32 MKL ~7-9 GB/s, unpacked bf16 ~5-7), and oneDNN's few-row GEMMs
 * pay a fixed cost a call. Each thread takes a contiguous slice of W's rows and reads it as RUNS long runs side by
 * side (rows lo + j, lo + run + j, lo + 2 run + j, ... for j = 0, 1, ...): each run is a sequential stream the
 * hardware prefetcher follows, and several keep more reads in flight than one (a plain C read of 256 MiB: 27-28 GB/s
 * as one stream a thread, 31-33 as four, Zen 4 guest, 2026-11-27). Those RUNS weight rows meet the rows of x in
 * register tiles of up to X_TILE rows (4 x 6 accumulators, the weight read from memory once for all tiles): at
 * 6 rows the bf16 tiles run ~100 GMAC/s on two cores, which is the vdpbf16ps rate of the Zen 4 guest (one every
 * other cycle), so from ~6 rows the step is compute- rather than bandwidth-bound. Each (x row, weight row) pair
 * has one accumulator, summed in the same tree whatever tile, run or thread holds it: its result does not depend
 * on the row count (speculation's verification rows equal the one-row decode's). bf16 weights are widened in
 * registers, or multiplied by the CPU's bf16 dot products (vdpbf16ps) where it has them; products of bf16 values
 * are exact in float32. Float32 sums: equal to F.linear up to summation order (bf16: y rounded once, after the
 * bias). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "vec16.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */
#define RUNS 4                     /* runs of rows a thread reads side by side: the weight rows of one tile */
#define X_TILE 6                   /* the most rows of x a tile multiplies by them: 6 x 4 accumulators + 4 + 1 */
#define GEMV_MAX_ROWS 32           /* rows of x a call takes (engine/kernels/cpu_native.py: GEMV_MAX_ROWS) */

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

/* the sum of v's lanes in reduce16's tree (vec16.h): lane i + lane i + 8, then i + 4, i + 2, i + 1 */
static inline float hsum16(v16 v) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* sums[i] = the lanes of acc[i] summed, for i < n: sixteen at a time through reduce16 (one tree for all sixteen,
 * ~3 instructions a sum where hsum16 takes 8), the rest one by one; the same tree either way */
static inline __attribute__((always_inline)) void hsums(const v16 *acc, int n, float *sums) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        v16 s = reduce16(acc + i);
        memcpy(sums + i, &s, sizeof s);
    }
    if (n - i >= 8) {
        v16 padded[16] = {{0}};
        for (int j = 0; j < n - i; j++) padded[j] = acc[i + j];
        v16 s = reduce16(padded);
        for (int j = 0; j < n - i; j++) sums[i + j] = s[j];
    } else {
        for (int j = i; j < n; j++) sums[j] = hsum16(acc[j]);
    }
}

/* x's vector loaded once for its wr multiplications: left alone, GCC folds the load into each FMA (one load an FMA
 * where there are wr + 1 loads per wr FMAs: fp32 tiles ran load-bound at half the FMA rate) */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) (void)(v)
#endif

#if !defined(__AVX512F__)
typedef float v8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* 16 bf16 weights as float32 without widening them lane by lane: as 8 32-bit words, each holding an even input's
 * bf16 in its low half and the next (odd) input's in its high half, shifted up and masked: two instructions where
 * widening took five. They meet x deinterleaved to match (`widen_x`). */
static inline void load16_bf16_pairs(const uint16_t *p, v8 *even, v8 *odd) {
    u32x8 pairs;
    memcpy(&pairs, p, sizeof pairs);
    *even = (v8)(pairs << 16);
    *odd = (v8)(pairs & 0xFFFF0000u);
}

/* tile_dot's sums without AVX-512: each pair's 16-lane accumulator kept as two 8-lane halves, each lane summed as
 * one lane of the 16 would be (fp32: lanes 0-7 and 8-15; bf16: even inputs in the first half, odd in the second,
 * against x deinterleaved). Why: GCC 12 keeps 64-byte vectors in memory where the CPU has no 64-byte registers,
 * every `acc +=` a round trip through the stack in 64-bit pieces (the bf16 GEMV ran ~10 GB/s and the fp32 one
 * compute-bound on a Zen 3). A weight row's halves are loaded once for the xr rows of x: 2 xr wr accumulators, in
 * registers up to wr = 4 at one or two rows. */
static inline __attribute__((always_inline)) void tile_dot_halves(const float *x, int xr, const void *const *w_rows,
                                                                  int wr, int bf16_w, int64_t k_in, v16 *acc) {
    v8 lo[X_TILE * RUNS], hi[X_TILE * RUNS];
    for (int i = 0; i < xr * wr; i++) lo[i] = hi[i] = (v8){0};
    for (int64_t k = 0; k + 16 <= k_in; k += 16) {
        for (int c = 0; c < wr; c++) {
            const float *w32 = (const float *)w_rows[c] + k;
            const uint16_t *w16 = (const uint16_t *)w_rows[c] + k;
            v8 wl, wh;
            if (bf16_w)
                load16_bf16_pairs(w16, &wl, &wh);
            else
                wl = load8(w32), wh = load8(w32 + 8);
            for (int r = 0; r < xr; r++) {
                lo[r * wr + c] += wl * load8(x + r * k_in + k);
                hi[r * wr + c] += wh * load8(x + r * k_in + k + 8);
            }
        }
    }
    for (int i = 0; i < xr * wr; i++) {
        memcpy(&acc[i], &lo[i], sizeof lo[i]);
        memcpy((char *)&acc[i] + sizeof lo[i], &hi[i], sizeof hi[i]);
    }
}
#endif

/* The tiles: sums[r * wr + c] = x row r . weight row c for r < xr, c < wr (both compile-time in every caller, so
 * the loops unroll into xr * wr accumulators), x rows contiguous [xr, k_in]. Each pair has one accumulator over k,
 * reduced in one tree, then the tail in scalars: the same arithmetic whatever tile, run, thread or row count
 * computes it. */
static inline __attribute__((always_inline)) void tile_dot(const float *x, int xr, const void *const *w_rows, int wr,
                                                           int bf16_w, int64_t k_in, float *sums) {
    v16 acc[X_TILE * RUNS];
    int64_t k = k_in / 16 * 16;
#if defined(__AVX512F__)
    for (int i = 0; i < xr * wr; i++) acc[i] = (v16){0};
    for (int64_t j = 0; j < k; j += 16) {
        v16 w[RUNS];
        for (int c = 0; c < wr; c++)
            w[c] = bf16_w ? load16_bf16((const uint16_t *)w_rows[c] + j) : load16((const float *)w_rows[c] + j);
        for (int r = 0; r < xr; r++) {
            v16 xv = load16(x + r * k_in + j);
            IN_REGISTER(xv);
            for (int c = 0; c < wr; c++) acc[r * wr + c] += w[c] * xv;
        }
    }
#else
    tile_dot_halves(x, xr, w_rows, wr, bf16_w, k_in, acc);
#endif
    hsums(acc, xr * wr, sums);
    for (int r = 0; r < xr; r++)
        for (int c = 0; c < wr; c++) {
            const float *w32 = w_rows[c];
            const uint16_t *w16 = w_rows[c];
            for (int64_t j = k; j < k_in; j++)
                sums[r * wr + c] += (bf16_w ? duet_bf16_to_f32(w16[j]) : w32[j]) * x[r * k_in + j];
        }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bf16 x and w with the CPU's bf16 dot products (vdpbf16ps: 32 products a 64-byte load, summed pairwise into
 * float32): 1 instruction per 32 weights where widening them costs 4; float32 sums as above, in another order */
static inline __attribute__((always_inline)) void tile_dot_bf16(const uint16_t *x, int xr,
                                                                const void *const *w_rows, int wr, int64_t k_in,
                                                                float *sums) {
    __m512 acc[X_TILE * RUNS];
    for (int i = 0; i < xr * wr; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= k_in; k += 32) {
        __m512bh w[RUNS];
        for (int c = 0; c < wr; c++)
            w[c] = (__m512bh)_mm512_loadu_si512((const void *)((const uint16_t *)w_rows[c] + k));
        for (int r = 0; r < xr; r++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + r * k_in + k));
            for (int c = 0; c < wr; c++) acc[r * wr + c] = _mm512_dpbf16_ps(acc[r * wr + c], w[c], xv);
        }
    }
    hsums((const v16 *)acc, xr * wr, sums);
    for (int r = 0; r < xr; r++)
        for (int c = 0; c < wr; c++) {
            const uint16_t *w16 = w_rows[c];
            for (int64_t j = k; j < k_in; j++)
                sums[r * wr + c] += duet_bf16_to_f32(w16[j]) * duet_bf16_to_f32(x[r * k_in + j]);
        }
}
#define GEMV_BF16_DOT 1
#endif

enum { GEMV_F32, GEMV_BF16_WIDEN, GEMV_BF16_DOT_PRODUCTS };

/* one tile of compile-time shape (xr rows of x from x_row on, the wr weight rows at `o`) into y */
static inline __attribute__((always_inline)) void tile(int kind, const void *x, int64_t x_row, int xr,
                                                       const void *w, const void *bias, void *y, const int64_t *o,
                                                       int wr, int64_t n_out, int64_t k_in) {
    const void *w_rows[RUNS];
    float sums[X_TILE * RUNS];
    int bf16 = kind != GEMV_F32;
    for (int c = 0; c < wr; c++) w_rows[c] = (const char *)w + o[c] * k_in * (bf16 ? 2 : 4);
#if defined(GEMV_BF16_DOT)
    if (kind == GEMV_BF16_DOT_PRODUCTS)
        tile_dot_bf16((const uint16_t *)x + x_row * k_in, xr, w_rows, wr, k_in, sums);
    else
#endif
        tile_dot((const float *)x + x_row * k_in, xr, w_rows, wr, bf16, k_in, sums);
    for (int r = 0; r < xr; r++)
        for (int c = 0; c < wr; c++) {
            int64_t at = (x_row + r) * n_out + o[c];
            if (bf16)
                ((uint16_t *)y)[at] = duet_f32_to_bf16(
                    sums[r * wr + c] + (bias ? duet_bf16_to_f32(((const uint16_t *)bias)[o[c]]) : 0.0f));
            else
                ((float *)y)[at] = sums[r * wr + c] + (bias ? ((const float *)bias)[o[c]] : 0.0f);
        }
}

#define TILE_CASE(XR) \
    case XR: tile(kind, x, r, XR, w, bias, y, o, wr, n_out, k_in); break;

/* all rows of x against the wr weight rows at `o`, in tiles of at most X_TILE rows as even as they go */
static inline __attribute__((always_inline)) void tiles(int kind, const void *x, int64_t rows, const void *w,
                                                        const void *bias, void *y, const int64_t *o, int wr,
                                                        int64_t n_out, int64_t k_in) {
    int64_t n_tiles = (rows + X_TILE - 1) / X_TILE;
    for (int64_t t = 0, r = 0; t < n_tiles; t++) {
        int64_t xr = rows * (t + 1) / n_tiles - r;
        switch (xr) {
            TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6)
        default: break;
        }
        r += xr;
    }
}

/* this thread's share of the weight rows (contiguous), read as RUNS runs side by side */
static inline __attribute__((always_inline)) void thread_rows(int kind, const void *x, int64_t rows, const void *w,
                                                              const void *bias, void *y, int64_t n_out,
                                                              int64_t k_in) {
    int64_t t = 0, threads = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
    int64_t lo = n_out * t / threads, hi = n_out * (t + 1) / threads, run = (hi - lo) / RUNS;
    for (int64_t j = 0; j < run; j++) {
        int64_t o[RUNS];
        for (int c = 0; c < RUNS; c++) o[c] = lo + c * run + j;
        tiles(kind, x, rows, w, bias, y, o, RUNS, n_out, k_in);
    }
    for (int64_t o = lo + RUNS * run; o < hi; o++) tiles(kind, x, rows, w, bias, y, &o, 1, n_out, k_in);
}

/* one parallel function per kind, so that each thread's loops are compiled for that kind alone */
#define GEMV_KIND(name, KIND) \
    static void name(const void *x, int64_t rows, const void *w, const void *bias, void *y, int64_t n_out, \
                     int64_t k_in) { \
        _Pragma("omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)") \
        thread_rows(KIND, x, rows, w, bias, y, n_out, k_in); \
    }
GEMV_KIND(gemv_f32, GEMV_F32)
#if defined(GEMV_BF16_DOT)
GEMV_KIND(gemv_bf16_dot, GEMV_BF16_DOT_PRODUCTS)
#else
GEMV_KIND(gemv_bf16_widen, GEMV_BF16_WIDEN)
#endif

#if !defined(GEMV_BF16_DOT)
/* x as float32 for the widening tiles; without AVX-512 each full 16 inputs deinterleaved, its 8 even inputs then
 * its 8 odd ones (load16_bf16_pairs' order), the tail after the last 16 as it is */
static void widen_x(const uint16_t *x_bf16, int64_t rows, int64_t k_in, float *x) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *src = x_bf16 + r * k_in;
        float *dst = x + r * k_in;
        int64_t k = 0;
#if !defined(__AVX512F__)
        for (; k + 16 <= k_in; k += 16)
            for (int i = 0; i < 8; i++)
                dst[k + i] = duet_bf16_to_f32(src[k + 2 * i]), dst[k + 8 + i] = duet_bf16_to_f32(src[k + 2 * i + 1]);
#endif
        for (; k < k_in; k++) dst[k] = duet_bf16_to_f32(src[k]);
    }
}
#endif

/* y [rows, n_out] = x [rows, k_in] · w [n_out, k_in]ᵀ + bias (float32 or NULL), all float32; rows 1..GEMV_MAX_ROWS
 * (0 otherwise: nothing written), x and y contiguous */
int duet_gemv_f32(const float *x, int64_t rows, const float *w, const float *bias, float *y, int64_t n_out,
                  int64_t k_in) {
    if (rows < 1 || rows > GEMV_MAX_ROWS) return 0;
    gemv_f32(x, rows, w, bias, y, n_out, k_in);
    return 1;
}

/* the same, all bf16 (bias may be NULL): float32 sums, y rounded once */
int duet_gemv_bf16(const uint16_t *x_bf16, int64_t rows, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t n_out, int64_t k_in) {
    if (rows < 1 || rows > GEMV_MAX_ROWS) return 0;
#if defined(GEMV_BF16_DOT)
    gemv_bf16_dot(x_bf16, rows, w, bias, y, n_out, k_in);
#else
    float *x = malloc(sizeof(float) * (size_t)(rows * k_in > 0 ? rows * k_in : 1));
    widen_x(x_bf16, rows, k_in, x);
    gemv_bf16_widen(x, rows, w, bias, y, n_out, k_in);
    free(x);
#endif
    return 1;
}
