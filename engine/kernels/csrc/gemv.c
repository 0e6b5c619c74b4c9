/* A few rows times a dense weight, F.linear at decode of an fp32 or bf16 model (engine/linear_fast.py's `gemv`,
 * up to its GEMV_ROWS rows; this file takes up to GEMV_MAX_ROWS). Why: torch's one-row GEMMs stream a weight well
 * below the read bandwidth on the 2-core VM (fp32 MKL ~7-9 GB/s, unpacked bf16 ~5-7). One row: each thread takes a
 * contiguous slice of W's rows and reads it as STREAMS long runs side by side (rows lo + j, lo + run + j,
 * lo + 2 run + j, ... for j = 0, 1, ...): each run is a sequential stream the hardware prefetcher follows, and
 * several of them keep more reads in flight than one (a plain C read of 256 MiB: 27-28 GB/s as one stream a
 * thread, 31-33 as four; SmolLM2's bf16 shapes 26-30 -> 30-33 GB/s, Zen 4 guest, 2026-11-27). Sixteen adjacent
 * rows a pass sharing each load of x measured slower (21 vs 29 GB/s on SmolLM2's bf16 lm_head): sixteen short
 * interleaved streams. Several rows of x: one weight row at a time against all of them, so the weight is read
 * once. x stays in L1; two accumulators a (x row, weight row) pair, whose sum is the same whichever run, thread
 * or row count computes it. bf16 weights are widened in registers, or multiplied by the CPU's bf16 dot products
 * (vdpbf16ps) where it has them; products of bf16 values are exact in float32. Float32 sums: equal to F.linear up
 * to summation order (bf16: y rounded once, after the bias). */

#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "vec16.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */
#define STREAMS 4                  /* runs of rows a thread reads side by side (one row of x) */
#define GEMV_MAX_ROWS 8            /* rows of x a call takes (engine/linear_fast.py: GEMV_MAX_ROWS) */

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

/* w_rows[r] . x over k_in inputs for `n` (1..STREAMS) rows, float32 x; the rows float32 or bf16 (`bf16_w`,
 * constant per caller). Each row's arithmetic is the same whatever `n`. */
static inline __attribute__((always_inline)) void rows_dot(const float *x, const void *const *w_rows, int n,
                                                           int bf16_w, int64_t k_in, float *out) {
    v16 a0[STREAMS] = {{0}}, a1[STREAMS] = {{0}};
    int64_t k = 0;
    for (; k + 32 <= k_in; k += 32) {
        v16 x0 = load16(x + k), x1 = load16(x + k + 16);
        for (int r = 0; r < n; r++) {
            const float *w32 = w_rows[r];
            const uint16_t *w16 = w_rows[r];
            a0[r] += (bf16_w ? load16_bf16(w16 + k) : load16(w32 + k)) * x0;
            a1[r] += (bf16_w ? load16_bf16(w16 + k + 16) : load16(w32 + k + 16)) * x1;
        }
    }
    for (int r = 0; r < n; r++) {
        const float *w32 = w_rows[r];
        const uint16_t *w16 = w_rows[r];
        float sum = hsum16(a0[r] + a1[r]);
        for (int64_t j = k; j < k_in; j++) sum += (bf16_w ? duet_bf16_to_f32(w16[j]) : w32[j]) * x[j];
        out[r] = sum;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
/* bf16 x and w with the CPU's bf16 dot products (vdpbf16ps: 32 products a 64-byte load, summed pairwise into
 * float32): 1 instruction per 32 weights where widening them costs 4; float32 sums as above, in another order */
static inline __attribute__((always_inline)) void rows_dot_bf16(const uint16_t *x, const uint16_t *const *w_rows,
                                                                int n, int64_t k_in, float *out) {
    __m512 a0[STREAMS], a1[STREAMS];
    for (int r = 0; r < n; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_in; k += 64) {
        __m512bh x0 = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
        __m512bh x1 = (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32));
        for (int r = 0; r < n; r++) {
            a0[r] = _mm512_dpbf16_ps(a0[r], (__m512bh)_mm512_loadu_si512((const void *)(w_rows[r] + k)), x0);
            a1[r] = _mm512_dpbf16_ps(a1[r], (__m512bh)_mm512_loadu_si512((const void *)(w_rows[r] + k + 32)), x1);
        }
    }
    for (int r = 0; r < n; r++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        for (int64_t j = k; j < k_in; j++) sum += duet_bf16_to_f32(w_rows[r][j]) * duet_bf16_to_f32(x[j]);
        out[r] = sum;
    }
}
#define GEMV_BF16_DOT 1
#endif

/* One weight row against R rows of x (x [R, k_in] contiguous), each (x row, weight row) pair summed exactly as
 * rows_dot / rows_dot_bf16 sum it: a few rows read the weight once, and every result is the one-row result. */
static inline __attribute__((always_inline)) void x_rows_dot(const float *x, int R, const void *w_row, int bf16_w,
                                                             int64_t k_in, float *out) {
    const float *w32 = w_row;
    const uint16_t *w16 = w_row;
    v16 a0[GEMV_MAX_ROWS] = {{0}}, a1[GEMV_MAX_ROWS] = {{0}};
    int64_t k = 0;
    for (; k + 32 <= k_in; k += 32) {
        v16 w0 = bf16_w ? load16_bf16(w16 + k) : load16(w32 + k);
        v16 w1 = bf16_w ? load16_bf16(w16 + k + 16) : load16(w32 + k + 16);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            a0[r] += w0 * load16(x + r * k_in + k);
            a1[r] += w1 * load16(x + r * k_in + k + 16);
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = hsum16(a0[r] + a1[r]);
        for (int64_t j = k; j < k_in; j++) sum += (bf16_w ? duet_bf16_to_f32(w16[j]) : w32[j]) * x[r * k_in + j];
        out[r] = sum;
    }
}

#if defined(GEMV_BF16_DOT)
static inline __attribute__((always_inline)) void x_rows_dot_bf16(const uint16_t *x, int R, const uint16_t *w_row,
                                                                  int64_t k_in, float *out) {
    __m512 a0[GEMV_MAX_ROWS], a1[GEMV_MAX_ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_in; k += 64) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(w_row + k));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(w_row + k + 32));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            a0[r] = _mm512_dpbf16_ps(a0[r], w0, (__m512bh)_mm512_loadu_si512((const void *)(x + r * k_in + k)));
            a1[r] = _mm512_dpbf16_ps(a1[r], w1, (__m512bh)_mm512_loadu_si512((const void *)(x + r * k_in + k + 32)));
        }
    }
    for (int r = 0; r < R; r++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        for (int64_t j = k; j < k_in; j++) sum += duet_bf16_to_f32(w_row[j]) * duet_bf16_to_f32(x[r * k_in + j]);
        out[r] = sum;
    }
}
#endif

enum { GEMV_F32, GEMV_BF16_WIDEN, GEMV_BF16_DOT_PRODUCTS };

/* `n` rows of y from the rows at `o` (the kinds above; x float32 for F32 and WIDEN, bf16 for DOT_PRODUCTS) */
static inline __attribute__((always_inline)) void gemv_rows(int kind, const void *x, const void *w,
                                                            const void *bias, void *y, const int64_t *o, int n,
                                                            int64_t k_in) {
    const void *w_rows[STREAMS];
    float sums[STREAMS];
    int bf16 = kind != GEMV_F32;
    for (int r = 0; r < n; r++) w_rows[r] = (const char *)w + o[r] * k_in * (bf16 ? 2 : 4);
#if defined(GEMV_BF16_DOT)
    if (kind == GEMV_BF16_DOT_PRODUCTS)
        rows_dot_bf16(x, (const uint16_t *const *)w_rows, n, k_in, sums);
    else
#endif
        rows_dot(x, w_rows, n, bf16, k_in, sums);
    for (int r = 0; r < n; r++) {
        if (bf16)
            ((uint16_t *)y)[o[r]] =
                duet_f32_to_bf16(sums[r] + (bias ? duet_bf16_to_f32(((const uint16_t *)bias)[o[r]]) : 0.0f));
        else
            ((float *)y)[o[r]] = sums[r] + (bias ? ((const float *)bias)[o[r]] : 0.0f);
    }
}

/* y[r] of `rows` rows of x against weight row o (x, y contiguous; rows <= GEMV_MAX_ROWS) */
static inline __attribute__((always_inline)) void gemv_x_rows(int kind, const void *x, int R, const void *w,
                                                              const void *bias, void *y, int64_t o, int64_t n_out,
                                                              int64_t k_in) {
    float sums[GEMV_MAX_ROWS];
    int bf16 = kind != GEMV_F32;
    const void *w_row = (const char *)w + o * k_in * (bf16 ? 2 : 4);
#if defined(GEMV_BF16_DOT)
    if (kind == GEMV_BF16_DOT_PRODUCTS)
        x_rows_dot_bf16(x, R, w_row, k_in, sums);
    else
#endif
        x_rows_dot(x, R, w_row, bf16, k_in, sums);
    for (int r = 0; r < R; r++) {
        if (bf16)
            ((uint16_t *)y)[r * n_out + o] =
                duet_f32_to_bf16(sums[r] + (bias ? duet_bf16_to_f32(((const uint16_t *)bias)[o]) : 0.0f));
        else
            ((float *)y)[r * n_out + o] = sums[r] + (bias ? ((const float *)bias)[o] : 0.0f);
    }
}

#define GEMV_X_ROWS_CASE(R) \
    case R: \
        for (int64_t o = lo; o < hi; o++) gemv_x_rows(kind, x, R, w, bias, y, o, n_out, k_in); \
        break;

static void gemv(int kind, const void *x, int64_t rows, const void *w, const void *bias, void *y, int64_t n_out,
                 int64_t k_in) {
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    {
        int64_t t = 0, threads = 1;
#if defined(_OPENMP)
        t = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
        int64_t lo = n_out * t / threads, hi = n_out * (t + 1) / threads, run = (hi - lo) / STREAMS;
        switch (rows) {
        case 1:
            for (int64_t j = 0; j < run; j++) {
                int64_t o[STREAMS];
                for (int s = 0; s < STREAMS; s++) o[s] = lo + s * run + j;
                gemv_rows(kind, x, w, bias, y, o, STREAMS, k_in);
            }
            for (int64_t o = lo + STREAMS * run; o < hi; o++) gemv_rows(kind, x, w, bias, y, &o, 1, k_in);
            break;
        GEMV_X_ROWS_CASE(2) GEMV_X_ROWS_CASE(3) GEMV_X_ROWS_CASE(4) GEMV_X_ROWS_CASE(5)
        GEMV_X_ROWS_CASE(6) GEMV_X_ROWS_CASE(7) GEMV_X_ROWS_CASE(8)
        default:
            break;
        }
    }
}

/* y [rows, n_out] = x [rows, k_in] · w [n_out, k_in]ᵀ + bias (float32 or NULL), all float32; rows 1..GEMV_MAX_ROWS
 * (0 otherwise: nothing written), x and y contiguous */
int duet_gemv_f32(const float *x, int64_t rows, const float *w, const float *bias, float *y, int64_t n_out,
                  int64_t k_in) {
    if (rows < 1 || rows > GEMV_MAX_ROWS) return 0;
    gemv(GEMV_F32, x, rows, w, bias, y, n_out, k_in);
    return 1;
}

/* the same, all bf16 (bias may be NULL): float32 sums, y rounded once */
int duet_gemv_bf16(const uint16_t *x_bf16, int64_t rows, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t n_out, int64_t k_in) {
    if (rows < 1 || rows > GEMV_MAX_ROWS) return 0;
#if defined(GEMV_BF16_DOT)
    gemv(GEMV_BF16_DOT_PRODUCTS, x_bf16, rows, w, bias, y, n_out, k_in);
#else
    float *x = malloc(sizeof(float) * (size_t)(rows * k_in > 0 ? rows * k_in : 1));
    for (int64_t k = 0; k < rows * k_in; k++) x[k] = duet_bf16_to_f32(x_bf16[k]);
    gemv(GEMV_BF16_WIDEN, x, rows, w, bias, y, n_out, k_in);
    free(x);
#endif
    return 1;
}
