/* Quantized linears for engine/quant_format.py's layout: y = x · dequantize(W)ᵀ + bias, the weight dequantized
 * in registers (never to memory), products accumulated in float32. Built with cpu_kernels.c into one library
 * (engine/kernels/cpu_native.py); the torch twin, `quantized_linear_reference`, is every test's reference.
 *
 *   int8  q int8  [N, K]        w[o, k] = s[o, k / G] * q[o, k]           G = K (per channel) or a multiple of 32
 *   int4  q uint8 [N, K / 2]    w[o, k] = s[o, k / 32] * q[o, k] + m[o, k / 32]
 *         a group's 16 bytes:   byte j = [ q(32g + j + 16) : high nibble | q(32g + j) : low nibble ]
 *
 *   x [R, K] (row stride ldx, float32, or bfloat16 widened once into a float32 copy), bias float32 [N] or NULL,
 *   y [R, N] contiguous in x's dtype, rounded once (after the bias) as the twin's final `.to(x.dtype)`.
 *
 * Work: OpenMP over output rows (each thread streams its own slice of W once); one row of x takes four output
 * rows a pass (the one-row passes, `thread_row_runs`); a few rows go per output row, x's rows in tiles of up to
 * ROW_TILE, so a weight block is unpacked once per tile and reused from registers by every row of it; from
 * PANEL_MIN_ROWS rows on, csrc/quant_panels.c (dequantized panels in cache). One block is 32 inputs (an int4
 * group, or an int8 block sharing one scale since G is K or a multiple of 32). With int8 activations
 * (duet_quantized_linear_q8) the same split, on integer dot products: csrc/quant_vnni.c where the CPU has AVX-512
 * VNNI.
 *
 * Paths, chosen at compile time by the build's -march: AVX-512F (16 lanes), AVX2 + FMA (8 lanes), or the plain C
 * loops (any CPU; the tests build it with -mno-avx2 -mno-fma). Each vector path computes the plain path's sums
 * in another order: w = fma(q, s, m) rounds once where the twin rounds q * s and + m separately, and partial
 * sums are split over lanes and accumulators; so results agree with the twin to fp32 summation order.
 */

#if defined(DUET_EMULATE_AVX512) /* tests only: the AVX-512 path's lane arithmetic in plain C, on any x86 CPU */
#define QUANT_AVX512 1
#include "avx512_emulation.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define QUANT_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_AVX2 1
#include <immintrin.h>
#endif
#include <math.h>
#if defined(_OPENMP)
#include <omp.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define BLOCK 32          /* inputs per int4 group and per int8 scale step */
#define ROW_TILE 4        /* rows of x sharing one unpacked weight block */
#define RUNS 4            /* output rows a step of the one-row passes (`thread_row_runs`) */
#define PARALLEL_MIN_WEIGHTS 65536 /* below this a thread barrier costs more than the second core gives */


/* Which vector path this build compiled: 512, 256, or 0 for the plain loops (the tests check each build's). */
int duet_quant_vector_bits(void) {
#if defined(QUANT_AVX512)
    return 512;
#elif defined(QUANT_AVX2)
    return 256;
#else
    return 0;
#endif
}

/* ---- the plain loops: one output row against `rt` rows of x ------------------------------------------------ */

static float int8_scale(const float *s, int64_t k, int64_t group) { return s[k / group]; }

static void int8_tile_plain(const float *x, int64_t ldx, int rt, const int8_t *q, const float *s, int64_t group,
                            int64_t k_in, float *sums) {
    for (int r = 0; r < rt; r++) {
        const float *xr = x + r * ldx;
        float acc = 0.0f;
        for (int64_t k = 0; k < k_in; k++) acc += xr[k] * (int8_scale(s, k, group) * (float)q[k]);
        sums[r] = acc;
    }
}

static __attribute__((unused)) void int4_tile_plain(const float *x, int64_t ldx, int rt, const uint8_t *q, const float *s, const float *m,
                            int64_t k_in, float *sums) {
    for (int r = 0; r < rt; r++) {
        const float *xr = x + r * ldx;
        float acc = 0.0f;
        for (int64_t g = 0; g < k_in / BLOCK; g++)
            for (int j = 0; j < BLOCK / 2; j++) {
                uint8_t byte = q[g * (BLOCK / 2) + j];
                acc += xr[g * BLOCK + j] * (s[g] * (float)(byte & 0x0F) + m[g]);
                acc += xr[g * BLOCK + j + BLOCK / 2] * (s[g] * (float)(byte >> 4) + m[g]);
            }
        sums[r] = acc;
    }
}

#if defined(__AVX2__) /* AVX-512 builds too: duet_dequantize_row unpacks with these in every build that has AVX2 */
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* a block's 32 raw q values as 4 vectors of 8 floats: int8 signed; int4 byte j's low nibble is input j, its high
 * nibble input j + 16 */
static inline void unpack_int8_block_avx2(const int8_t *q, __m256 w[4]) {
    __m256i raw = _mm256_loadu_si256((const __m256i *)q);
    __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

/* The 16 bytes in both halves of a vector, one byte shuffle puts bytes 0-7 (then 8-15) one per 32-bit lane: their
 * low nibbles are inputs 0-7 (8-15), their high nibbles inputs 16-23 (24-31). Two shuffles a block instead of
 * six (widening each quarter and moving the high quarters down): on a Zen 3 the int4 GEMV ran 1.4x faster. */
static inline void unpack_int4_block_avx2(const uint8_t *q, __m256 w[4]) {
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    const __m256i bytes0to7 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                               4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i bytes8to15 = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                                12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
    __m256i lo8 = _mm256_shuffle_epi8(raw, bytes0to7), hi8 = _mm256_shuffle_epi8(raw, bytes8to15);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(lo8, nibble));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(hi8, nibble));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(lo8, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(hi8, 4));
}
#endif

/* sums[r] += m · xsum[r] over the groups: the mins' share of the factored int4 form (the vector paths) */
static inline void add_min_terms(int rt, const float *m, const float *xsum, int64_t groups, float *sums) {
    for (int r = 0; r < rt; r++) {
        float acc = 0.0f;
        int64_t g = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* eight groups a step: the scalar loop's chain of dependent adds was ~7 % of the int4 GEMV's time on a
         * Zen 3 */
        __m256 v = _mm256_setzero_ps();
        for (; g + 8 <= groups; g += 8)
            v = _mm256_fmadd_ps(_mm256_loadu_ps(m + g), _mm256_loadu_ps(xsum + r * groups + g), v);
        acc = hsum256(v);
#endif
        for (; g < groups; g++) acc += m[g] * xsum[r * groups + g];
        sums[r] += acc;
    }
}

/* ---- AVX2: a 32-input block is 4 vectors of 8 ----------------------------------------------------------------
 * Factored form: acc[r] += s * (x[r, block] · q) (and, int4, + m * sum(x[r, group]) afterwards): the dot product
 * on the raw q values in two independent chains, scaled once, so dequantizing costs one FMA a block, not four
 * (a GEMV here is bound by these instructions, not by DRAM). One accumulator per row: its chain is one FMA a
 * block, shorter than the block's other work. */
#if defined(QUANT_AVX2)
static inline __attribute__((always_inline)) void block_fma_avx2(const float *x, int64_t ldx, const int rt,
                                                                 const __m256 q[4], __m256 scale,
                                                                 __m256 acc[ROW_TILE]) {
    for (int r = 0; r < rt; r++) {
        const float *xr = x + r * ldx;
        __m256 d01 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q[1], _mm256_mul_ps(_mm256_loadu_ps(xr), q[0]));
        __m256 d23 = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3], _mm256_mul_ps(_mm256_loadu_ps(xr + 16), q[2]));
        acc[r] = _mm256_fmadd_ps(scale, _mm256_add_ps(d01, d23), acc[r]);
    }
}

static inline __attribute__((always_inline)) void int8_tile_avx2(const float *x, int64_t ldx, const int rt,
                                                                 const int8_t *q, const float *s, int64_t group,
                                                                 const float *xsum, int64_t k_in, float *sums) {
    (void)xsum;
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rt; r++) acc[r] = _mm256_setzero_ps();
    int64_t k32 = k_in / BLOCK * BLOCK;
    for (int64_t k = 0; k < k32; k += BLOCK) {
        __m256 w[4];
        unpack_int8_block_avx2(q + k, w);
        block_fma_avx2(x + k, ldx, rt, w, _mm256_broadcast_ss(s + k / group), acc);
    }
    for (int r = 0; r < rt; r++) sums[r] = hsum256(acc[r]);
    if (k32 < k_in) { /* per-channel int8 of a width that is no multiple of 32: the plain loop for the rest */
        float tail[ROW_TILE];
        int8_tile_plain(x + k32, ldx, rt, q + k32, s, group, k_in - k32, tail); /* G == K: one scale, s[0] */
        for (int r = 0; r < rt; r++) sums[r] += tail[r];
    }
}

static inline __attribute__((always_inline)) void int4_tile_avx2(const float *x, int64_t ldx, const int rt,
                                                                 const uint8_t *q, const float *s, const float *m,
                                                                 const float *xsum, int64_t k_in, float *sums) {
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rt; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < k_in / BLOCK; g++) {
        __m256 w[4]; /* inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles) */
        unpack_int4_block_avx2(q + g * (BLOCK / 2), w);
        block_fma_avx2(x + g * BLOCK, ldx, rt, w, _mm256_broadcast_ss(s + g), acc);
    }
    for (int r = 0; r < rt; r++) sums[r] = hsum256(acc[r]);
    add_min_terms(rt, m, xsum, k_in / BLOCK, sums);
}
/* One row of x (batch-1 decode) against n (1..4) output rows at once (which rows: `thread_row_runs`): each load
 * of x serves n weight rows, and the rows' FMA chains are independent (one row's 18-block chain of dependent
 * FMAs would otherwise bound the loop by FMA latency, not by its instructions). A row's sums are the same whatever
 * n. */
static inline __m256 int4_block_avx2(const uint8_t *q, const __m256 xv[4]) { /* x . q over one group */
    __m256 w[4];
    unpack_int4_block_avx2(q, w);
    __m256 d01 = _mm256_fmadd_ps(xv[1], w[1], _mm256_mul_ps(xv[0], w[0]));
    __m256 d23 = _mm256_fmadd_ps(xv[3], w[3], _mm256_mul_ps(xv[2], w[2]));
    return _mm256_add_ps(d01, d23);
}

static inline __attribute__((always_inline)) void int4_gemv4_avx2(const float *x, const uint8_t *const *q,
                                                                  const float *const *s, const float *const *m,
                                                                  const float *xsum, int64_t k_in, int n,
                                                                  float *out) {
    int64_t groups = k_in / BLOCK, row_bytes = k_in / 2;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        const __m256 xv[4] = {_mm256_loadu_ps(x + g * BLOCK), _mm256_loadu_ps(x + g * BLOCK + 8),
                              _mm256_loadu_ps(x + g * BLOCK + 16), _mm256_loadu_ps(x + g * BLOCK + 24)};
        for (int i = 0; i < n; i++) {
            _mm_prefetch((const char *)(q[i] + RUNS * row_bytes + g * 16), _MM_HINT_T0); /* the next step's */
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[i][g]), int4_block_avx2(q[i] + g * 16, xv), acc[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        out[i] = hsum256(acc[i]);
        add_min_terms(1, m[i], xsum, groups, out + i);
    }
}

static inline __m256 int8_block_avx2(const int8_t *q, const __m256 xv[4]) { /* x . q over one block */
    __m256 w[4];
    for (int v = 0; v < 4; v++) w[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * v))));
    __m256 d01 = _mm256_fmadd_ps(xv[1], w[1], _mm256_mul_ps(xv[0], w[0]));
    __m256 d23 = _mm256_fmadd_ps(xv[3], w[3], _mm256_mul_ps(xv[2], w[2]));
    return _mm256_add_ps(d01, d23);
}

static inline __attribute__((always_inline)) void int8_gemv4_avx2(const float *x, const int8_t *const *q,
                                                                  const float *const *s, int64_t group,
                                                                  int64_t k_in, int n, float *out) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t k32 = k_in / BLOCK * BLOCK;
    for (int64_t k = 0; k < k32; k += BLOCK) {
        const __m256 xv[4] = {_mm256_loadu_ps(x + k), _mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(x + k + 16),
                              _mm256_loadu_ps(x + k + 24)};
        for (int i = 0; i < n; i++) {
            /* the run's next row's same block: this pass hops between rows, which the hardware prefetcher did not
             * follow from DRAM (a 28 MB int8 lm_head ran 2x slower without it) */
            _mm_prefetch((const char *)(q[i] + k_in + k), _MM_HINT_T0);
            acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(s[i][k / group]), int8_block_avx2(q[i] + k, xv), acc[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        out[i] = hsum256(acc[i]);
        if (k32 < k_in) { /* per-channel int8 of a width that is no multiple of 32: the plain loop for the rest */
            float tail;
            int8_tile_plain(x + k32, k_in, 1, q[i] + k32, s[i], group, k_in - k32, &tail);
            out[i] += tail;
        }
    }
}
#define QUANT_GEMV4 1
#define INT4_GEMV4 int4_gemv4_avx2
#define INT8_GEMV4 int8_gemv4_avx2
#endif


/* ---- AVX-512: a 32-input block is 2 vectors of 16 ------------------------------------------------------------
 * The AVX2 path's structure and factored form, 16 lanes: q widened with vpmovzxbd / vpmovsxbd straight from 16
 * bytes. Checked natively on AVX-512 CPUs and, everywhere, through csrc/avx512_emulation.h. */
#if defined(QUANT_AVX512)
static inline __attribute__((always_inline)) void block_fma_avx512(const float *x, int64_t ldx, const int rt,
                                                                   const __m512 q[2], __m512 scale,
                                                                   __m512 acc[ROW_TILE]) {
    for (int r = 0; r < rt; r++) {
        const float *xr = x + r * ldx;
        __m512 d = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), q[1], _mm512_mul_ps(_mm512_loadu_ps(xr), q[0]));
        acc[r] = _mm512_fmadd_ps(scale, d, acc[r]);
    }
}

static inline __attribute__((always_inline)) void int8_tile_avx512(const float *x, int64_t ldx, const int rt,
                                                                   const int8_t *q, const float *s, int64_t group,
                                                                   const float *xsum, int64_t k_in, float *sums) {
    (void)xsum;
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rt; r++) acc[r] = _mm512_setzero_ps();
    int64_t k32 = k_in / BLOCK * BLOCK;
    for (int64_t k = 0; k < k32; k += BLOCK) {
        __m512 w[2] = {
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)))),
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k + 16)))),
        };
        block_fma_avx512(x + k, ldx, rt, w, _mm512_set1_ps(s[k / group]), acc);
    }
    for (int r = 0; r < rt; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
    if (k32 < k_in) {
        float tail[ROW_TILE];
        int8_tile_plain(x + k32, ldx, rt, q + k32, s, group, k_in - k32, tail);
        for (int r = 0; r < rt; r++) sums[r] += tail[r];
    }
}

static inline __attribute__((always_inline)) void int4_tile_avx512(const float *x, int64_t ldx, const int rt,
                                                                   const uint8_t *q, const float *s, const float *m,
                                                                   const float *xsum, int64_t k_in, float *sums) {
    __m512 acc[ROW_TILE];
    for (int r = 0; r < rt; r++) acc[r] = _mm512_setzero_ps();
    const __m128i nibble = _mm_set1_epi8(0x0F);
    for (int64_t g = 0; g < k_in / BLOCK; g++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(q + g * (BLOCK / 2)));
        __m128i lo = _mm_and_si128(raw, nibble), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
        __m512 w[2] = { /* inputs 0-15 (low nibbles), 16-31 (high nibbles) */
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)),
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)),
        };
        block_fma_avx512(x + g * BLOCK, ldx, rt, w, _mm512_set1_ps(s[g]), acc);
    }
    for (int r = 0; r < rt; r++) sums[r] = _mm512_reduce_add_ps(acc[r]);
    add_min_terms(rt, m, xsum, k_in / BLOCK, sums);
}
/* One row of x against n (1..4) output rows (batch-1 decode), as int4_gemv4_avx2: x's block loaded once for the
 * rows, independent FMA chains, the next step's rows prefetched (see `thread_row_runs`). */
static inline __m512 int4_block_avx512(const uint8_t *q, const __m512 xv[2]) { /* x . q over one group */
    const __m128i nibble = _mm_set1_epi8(0x0F);
    __m128i raw = _mm_loadu_si128((const __m128i *)q);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, nibble)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble)));
    return _mm512_fmadd_ps(xv[1], hi, _mm512_mul_ps(xv[0], lo));
}

static inline __attribute__((always_inline)) void int4_gemv4_avx512(const float *x, const uint8_t *const *q,
                                                                    const float *const *s, const float *const *m,
                                                                    const float *xsum, int64_t k_in, int n,
                                                                    float *out) {
    int64_t groups = k_in / BLOCK, row_bytes = k_in / 2;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; g++) {
        const __m512 xv[2] = {_mm512_loadu_ps(x + g * BLOCK), _mm512_loadu_ps(x + g * BLOCK + 16)};
        for (int i = 0; i < n; i++) {
            _mm_prefetch((const char *)(q[i] + RUNS * row_bytes + g * 16), _MM_HINT_T0); /* the next step's rows */
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][g]), int4_block_avx512(q[i] + g * 16, xv), acc[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        out[i] = _mm512_reduce_add_ps(acc[i]);
        add_min_terms(1, m[i], xsum, groups, out + i);
    }
}

static inline __m512 int8_block_avx512(const int8_t *q, const __m512 xv[2]) { /* x . q over one block */
    __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16))));
    return _mm512_fmadd_ps(xv[1], w1, _mm512_mul_ps(xv[0], w0));
}

/* int8: the n rows interleaved block by block, two accumulators a row (each row the next of its run, a sequential
 * stream). Rows read one after the other (one stream a thread) took the 28 MB Q8_0 lm_head from 20 to 28 GB/s
 * against four adjacent rows a block (short hops the prefetcher did not follow); four runs side by side take it
 * further (RESULTS.md). */
static inline __attribute__((always_inline)) void int8_gemv4_avx512(const float *x, const int8_t *const *q,
                                                                    const float *const *s, int64_t group,
                                                                    int64_t k_in, int n, float *out) {
    int64_t k32 = k_in / BLOCK * BLOCK;
    __m512 a0[4], a1[4];
    for (int i = 0; i < n; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 2 * BLOCK <= k32; k += 2 * BLOCK) {
        const __m512 x0[2] = {_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)};
        const __m512 x1[2] = {_mm512_loadu_ps(x + k + 32), _mm512_loadu_ps(x + k + 48)};
        for (int i = 0; i < n; i++) {
            a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][k / group]), int8_block_avx512(q[i] + k, x0), a0[i]);
            a1[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][(k + BLOCK) / group]),
                                    int8_block_avx512(q[i] + k + BLOCK, x1), a1[i]);
        }
    }
    if (k < k32) { /* an odd number of blocks */
        const __m512 x0[2] = {_mm512_loadu_ps(x + k), _mm512_loadu_ps(x + k + 16)};
        for (int i = 0; i < n; i++)
            a0[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[i][k / group]), int8_block_avx512(q[i] + k, x0), a0[i]);
    }
    for (int i = 0; i < n; i++) {
        out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a0[i], a1[i]));
        if (k32 < k_in) { /* per-channel int8 of a width that is no multiple of 32: the plain loop for the rest */
            float tail;
            int8_tile_plain(x + k32, k_in, 1, q[i] + k32, s[i], group, k_in - k32, &tail);
            out[i] += tail;
        }
    }
}
#define QUANT_GEMV4 1
#define INT4_GEMV4 int4_gemv4_avx512
#define INT8_GEMV4 int8_gemv4_avx512
#endif

/* ---- one output row against one tile of x's rows: the build's path, with rt a constant in each case --------- */

#if defined(QUANT_AVX512)
#define INT8_TILE(rt) int8_tile_avx512(x, ldx, rt, q, s, group, NULL, k_in, sums)
#define INT4_TILE(rt) int4_tile_avx512(x, ldx, rt, q, s, m, xsum, k_in, sums)
#elif defined(QUANT_AVX2)
#define INT8_TILE(rt) int8_tile_avx2(x, ldx, rt, q, s, group, NULL, k_in, sums)
#define INT4_TILE(rt) int4_tile_avx2(x, ldx, rt, q, s, m, xsum, k_in, sums)
#else
#define INT8_TILE(rt) int8_tile_plain(x, ldx, rt, q, s, group, k_in, sums)
#define INT4_TILE(rt) ((void)xsum, int4_tile_plain(x, ldx, rt, q, s, m, k_in, sums))
#endif

static void int8_tile(const float *x, int64_t ldx, int rt, const int8_t *q, const float *s, int64_t group,
                      int64_t k_in, float *sums) {
    switch (rt) {
    case 1: INT8_TILE(1); break;
    case 2: INT8_TILE(2); break;
    case 3: INT8_TILE(3); break;
    default: INT8_TILE(4); break;
    }
}

/* xsum [rt][k_in / 32]: the tile's rows' group sums (the vector paths' factored form) */
static void int4_tile(const float *x, int64_t ldx, int rt, const uint8_t *q, const float *s, const float *m,
                      const float *xsum, int64_t k_in, float *sums) {
    switch (rt) {
    case 1: INT4_TILE(1); break;
    case 2: INT4_TILE(2); break;
    case 3: INT4_TILE(3); break;
    default: INT4_TILE(4); break;
    }
}

/* ---- entry points -------------------------------------------------------------------------------------------- */

/* x as float32 rows: in place for float32, else widened once into a contiguous copy (*owned, to free) */
static const float *activations_f32(const void *x, int64_t ldx, int64_t rows, int64_t k_in, int bf16,
                                    int64_t *ldx_f32, float **owned) {
    *owned = NULL;
    *ldx_f32 = ldx;
    if (!bf16) return (const float *)x;
    float *wide = malloc(sizeof(float) * (size_t)(rows * k_in > 0 ? rows * k_in : 1));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < k_in; k++) wide[r * k_in + k] = duet_bf16_to_f32(((const uint16_t *)x)[r * ldx + k]);
    *owned = wide;
    *ldx_f32 = k_in;
    return wide;
}

static inline void store(void *y, int64_t at, float sum, const float *bias, int64_t o, int bf16) {
    float v = sum + (bias ? bias[o] : 0.0f);
    if (bf16)
        ((uint16_t *)y)[at] = duet_f32_to_bf16(v);
    else
        ((float *)y)[at] = v;
}

#if defined(QUANT_GEMV4)
/* The one-row passes (batch-1 decode): each thread's slice [lo, hi) of W's rows, RUNS rows a step, the slice's last
 * (hi - lo) % RUNS rows after them one at a time. int8 reads the slice as RUNS runs side by side (step j: rows
 * lo + j, lo + run + j, lo + 2 run + j, lo + 3 run + j): four sequential streams a thread keep more reads in flight
 * than one (csrc/gemv.c; the Q8_0 lm_head 26 -> 30 GB/s). int4, bound by its unpacking instructions rather than
 * by the reads, takes four adjacent rows a step (one stream a thread, the next step's rows prefetched), which
 * measured as fast or faster (the int4 lm_head shape 23-24 GB/s vs 18-21 as runs). A row's sums are the same
 * whichever step or thread computes it. Call inside an OpenMP parallel region (or none). */
typedef struct {
    int64_t lo, hi, run;
    int adjacent; /* step j's rows: lo + RUNS j + i (int4), else lo + i run + j (int8) */
} RowRuns;

static RowRuns thread_row_runs(int64_t n_out, int adjacent) {
    int64_t t = 0, threads = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
    RowRuns r = {n_out * t / threads, n_out * (t + 1) / threads, 0, adjacent};
    r.run = (r.hi - r.lo) / RUNS;
    return r;
}

/* the rows of step j: n == RUNS: as `adjacent` says; n == 1: row lo + j (a leftover, j >= RUNS run) */
static inline __attribute__((always_inline)) void row_indices(RowRuns runs, int64_t j, int n, int64_t *o) {
    for (int i = 0; i < n; i++)
        o[i] = runs.lo + (n == 1 ? j : runs.adjacent ? RUNS * j + i : i * runs.run + j);
}

/* A thread's share of a one-row pass, inside a parallel region: ROWS(args..., runs, j, n) for each step j of its
 * rows, RUNS rows a step, then its leftover rows one at a time */
#define EACH_THREAD_ROW_STEP(n_out, adjacent, ROWS, ...)                                                           \
    do {                                                                                                           \
        RowRuns runs_ = thread_row_runs(n_out, adjacent);                                                           \
        for (int64_t j_ = 0; j_ < runs_.run; j_++) ROWS(__VA_ARGS__, runs_, j_, RUNS);                               \
        for (int64_t j_ = RUNS * runs_.run; j_ < runs_.hi - runs_.lo; j_++) ROWS(__VA_ARGS__, runs_, j_, 1);         \
    } while (0)

/* The n rows of step j of a thread's runs, of an int8 weight: their indices o, values q and scales s */
static inline void int8_row_pointers(RowRuns runs, int64_t j, int n, const int8_t *qweight, const float *scales,
                                     int64_t group, int64_t k_in, int64_t *o, const int8_t **q, const float **s) {
    row_indices(runs, j, n, o);
    for (int i = 0; i < n; i++) q[i] = qweight + o[i] * k_in, s[i] = scales + o[i] * (k_in / group);
}

static inline __attribute__((always_inline)) void int8_rows(const float *x, const int8_t *qweight, const float *scales,
                                                            int64_t group, const float *bias, void *y, int64_t k_in,
                                                            int bf16, RowRuns runs, int64_t j, int n) {
    int64_t o[RUNS];
    const int8_t *q[RUNS];
    const float *s[RUNS];
    float sums[RUNS];
    int8_row_pointers(runs, j, n, qweight, scales, group, k_in, o, q, s);
    INT8_GEMV4(x, q, s, group, k_in, n, sums);
    for (int i = 0; i < n; i++) store(y, o[i], sums[i], bias, o[i], bf16);
}

static inline __attribute__((always_inline)) void int4_rows(const float *x, const uint8_t *qweight,
                                                            const float *scales, const float *mins,
                                                            const float *xsum, const float *bias, void *y,
                                                            int64_t k_in, int bf16, RowRuns runs, int64_t j, int n) {
    int64_t o[RUNS], groups = k_in / BLOCK;
    const uint8_t *q[RUNS];
    const float *s[RUNS], *m[RUNS];
    float sums[RUNS];
    row_indices(runs, j, n, o);
    for (int i = 0; i < n; i++)
        q[i] = qweight + o[i] * (k_in / 2), s[i] = scales + o[i] * groups, m[i] = mins + o[i] * groups;
    INT4_GEMV4(x, q, s, m, xsum, k_in, n, sums);
    for (int i = 0; i < n; i++) store(y, o[i], sums[i], bias, o[i], bf16);
}
#endif

/* Many rows: csrc/quant_panels.c (dequantized panels, 4 x 4 tiles) from this many rows of x on, where it beats the
 * per-output-row loops (benchmarks/quant_kernels_bench.py's crossover table; int8's dequantize pass costs more a
 * weight than int4's, so it pays off later). A -DPANELS_OFF build (that benchmark's peer) never takes it. */
#if defined(PANELS_OFF)
#define PANEL_MIN_ROWS(kind) INT64_MAX
#else
#define PANEL_MIN_ROWS(kind) ((kind) == 4 ? 8 : 16)
#endif
void duet_quant_panels(const float *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                       const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in);
int duet_quant_panels_bf16_available(void);
void duet_quant_panels_bf16(const uint16_t *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                            const float *mins, int64_t group, float *sums, int64_t rows, int64_t n_out, int64_t k_in);

/* y [rows, n_out] = sums + bias, rounded once to y's dtype; frees sums (what a kernel that writes float32 sums
 * leaves for its caller) */
static void store_sums(void *y, float *sums, const float *bias, int64_t rows, int64_t n_out, int bf16) {
    /* in parallel from a few rows on: one thread storing 32 x 3072 sums left the other spinning (~3 % of a batch-32
     * step's samples) */
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n_out >= PARALLEL_MIN_WEIGHTS / 4)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < n_out; o++) store(y, r * n_out + o, sums[r * n_out + o], bias, o, bf16);
    free(sums);
}

/* bfloat16 x through bfloat16 panels (vdpbf16ps) where the CPU has them, else widened to float32 first */
static void linear_by_panels(const void *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                             const float *mins, int64_t group, const float *bias, void *y, int64_t rows,
                             int64_t n_out, int64_t k_in, int bf16) {
    float *sums = malloc(sizeof(float) * (size_t)(rows * n_out > 0 ? rows * n_out : 1));
    if (bf16 && k_in % 32 == 0 && duet_quant_panels_bf16_available()) {
        duet_quant_panels_bf16((const uint16_t *)x, ldx, kind, qweight, scales, mins, group, sums, rows, n_out, k_in);
    } else {
        int64_t ldf;
        float *owned;
        const float *xf = activations_f32(x, ldx, rows, k_in, bf16, &ldf, &owned);
        duet_quant_panels(xf, ldf, kind, qweight, scales, mins, group, sums, rows, n_out, k_in);
        free(owned);
    }
    store_sums(y, sums, bias, rows, n_out, bf16);
}

/* y [rows, n_out] = x [rows, k_in] · int8 W [n_out, k_in]ᵀ + bias; group == k_in or a multiple of 32 */
void duet_int8_linear(const void *x, int64_t ldx, const int8_t *qweight, const float *scales, int64_t group,
                      const float *bias, void *y, int64_t rows, int64_t n_out, int64_t k_in, int bf16) {
    if (rows >= PANEL_MIN_ROWS(8)) {
        linear_by_panels(x, ldx, 8, qweight, scales, NULL, group, bias, y, rows, n_out, k_in, bf16);
        return;
    }
    int64_t ldf, groups = k_in / group;
    float *owned;
    const float *xf = activations_f32(x, ldx, rows, k_in, bf16, &ldf, &owned);
#if defined(QUANT_GEMV4)
    if (rows == 1) {
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
        EACH_THREAD_ROW_STEP(n_out, 0, int8_rows, xf, qweight, scales, group, bias, y, k_in, bf16);
        free(owned);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int rt = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            float sums[ROW_TILE];
            int8_tile(xf + r0 * ldf, ldf, rt, qweight + o * k_in, scales + o * groups, group, k_in, sums);
            for (int r = 0; r < rt; r++) store(y, (r0 + r) * n_out + o, sums[r], bias, o, bf16);
        }
    }
    free(owned);
}

/* y [rows, n_out] = x [rows, k_in] · int4 W [n_out, k_in]ᵀ + bias; k_in a multiple of 32 */
void duet_int4_linear(const void *x, int64_t ldx, const uint8_t *qweight, const float *scales, const float *mins,
                      const float *bias, void *y, int64_t rows, int64_t n_out, int64_t k_in, int bf16) {
    if (rows >= PANEL_MIN_ROWS(4)) {
        linear_by_panels(x, ldx, 4, qweight, scales, mins, BLOCK, bias, y, rows, n_out, k_in, bf16);
        return;
    }
    int64_t ldf, groups = k_in / BLOCK;
    float *owned;
    const float *xf = activations_f32(x, ldx, rows, k_in, bf16, &ldf, &owned);
    float *xsum = malloc(sizeof(float) * (size_t)(rows * groups > 0 ? rows * groups : 1)); /* [rows][groups] */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int j = 0; j < BLOCK; j++) sum += xf[r * ldf + g * BLOCK + j];
            xsum[r * groups + g] = sum;
        }
#if defined(QUANT_GEMV4)
    if (rows == 1) {
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
        EACH_THREAD_ROW_STEP(n_out, 1, int4_rows, xf, qweight, scales, mins, xsum, bias, y, k_in, bf16);
        free(xsum);
        free(owned);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int rt = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            float sums[ROW_TILE];
            int4_tile(xf + r0 * ldf, ldf, rt, qweight + o * (k_in / 2), scales + o * groups, mins + o * groups,
                      xsum + r0 * groups, k_in, sums);
            for (int r = 0; r < rt; r++) store(y, (r0 + r) * n_out + o, sums[r], bias, o, bf16);
        }
    }
    free(xsum);
    free(owned);
}

/* ---- int8 activations: integer dot products (llama.cpp's way: its Q8_0 activations) -------------------------
 * x's rows quantized per 32 inputs: x[r, 32b + j] ~ dx[r, b] * qx[r, 32b + j], qx int8 in [-127, 127],
 * dx = max|x| / 127, rounded to nearest even (`quantize_activations` in engine/quant_format.py is the twin, bit for
 * bit). Then per block, with the integer dot product exact in int32:
 *   int4   y += s[o, b] * dx[r, b] * (q · qx)  +  m[o, b] * (dx[r, b] * sum(qx))
 *   int8   y += s[o, b] * dx[r, b] * (q · qx)
 * Why: a float block costs ~20 instructions (widen 32 weights to floats, 4 FMAs a row); this one ~8 (maddubs pairs
 * u8 x s8 into int16 without overflow: 2 * 15 * 127 or 2 * 128 * 127 < 32767). The price is x's rounding
 * (relative 1/254 of its block's largest value), which the float path does not pay. */

#if defined(__AVX512F__) && !defined(DUET_EMULATE_AVX512)
/* One block as two 16-lane vectors: the plain loop below calls fmaxf and nearbyintf an input (~3 ns each: 5 us for
 * a 1536-wide row, a quarter of the down projection's whole stream at batch 1). Same values: max_ps(|x|, m) keeps m
 * where |x| is NaN as fmaxf does, and the conversion rounds in the current mode as nearbyintf. */
static void quantize_block_avx512(const float *xb, int8_t *qx, float *dx, float *sx) {
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    __m512 m = _mm512_max_ps(_mm512_abs_ps(hi), _mm512_max_ps(_mm512_abs_ps(lo), _mm512_setzero_ps()));
    float amax = _mm512_reduce_max_ps(m);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128((__m128i *)qx, _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128((__m128i *)(qx + 16), _mm512_cvtepi32_epi8(qhi));
    *dx = amax / 127.0f;
    *sx = *dx * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
}
#endif

#if defined(__AVX2__)
/* quantize_block_avx512 at 8 lanes (the plain loop's fmaxf, not inlined, was a tenth of a one-row call) */
static void quantize_block_avx2(const float *xb, int8_t *qx, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xb + 8 * i);
        m = _mm256_max_ps(_mm256_andnot_ps(sign, v[i]), m);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)); /* to nearest even */
    /* the packs work per 128-bit lane: dwords [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, q1 4-7, ...], then in order */
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)qx, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i sum4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(1, 0, 3, 2)));
    sum4 = _mm_add_epi32(sum4, _mm_shuffle_epi32(sum4, _MM_SHUFFLE(2, 3, 0, 1)));
    *dx = amax / 127.0f;
    *sx = *dx * (float)_mm_cvtsi128_si32(sum4);
}
#endif

/* One block of 32 inputs: qx, and its dx and sx (= dx * sum(qx)) */
static __attribute__((unused)) void quantize_block(const float *xb, int8_t *qx, float *dx, float *sx) {
    float amax = 0.0f;
    for (int j = 0; j < BLOCK; j++) amax = fmaxf(amax, fabsf(xb[j]));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < BLOCK; j++) {
        int q = (int)nearbyintf(xb[j] * inv);
        qx[j] = (int8_t)q;
        sum += q;
    }
    *dx = amax / 127.0f;
    *sx = *dx * (float)sum;
}

/* qx [rows, k_in], dx and sx (= dx * sum(qx)) [rows, k_in / 32] from float32 rows x (row stride ldx) */
void duet_quantize_activations(const float *x, int64_t ldx, int64_t rows, int64_t k_in, int8_t *qx, float *dx,
                               float *sx) {
    int64_t blocks = k_in / BLOCK;
#pragma omp parallel for schedule(static) if (rows >= 8)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++)
#if defined(__AVX512F__) && !defined(DUET_EMULATE_AVX512)
            quantize_block_avx512(x + r * ldx + b * BLOCK, qx + r * k_in + b * BLOCK, dx + r * blocks + b,
                                  sx + r * blocks + b);
#elif defined(__AVX2__)
            quantize_block_avx2(x + r * ldx + b * BLOCK, qx + r * k_in + b * BLOCK, dx + r * blocks + b,
                                sx + r * blocks + b);
#else
            quantize_block(x + r * ldx + b * BLOCK, qx + r * k_in + b * BLOCK, dx + r * blocks + b,
                           sx + r * blocks + b);
#endif
}

static __attribute__((unused)) void q8_tile_plain(const int8_t *qx, const float *dx, const float *sx, int64_t k_in, int rt, int kind,
                          const void *qweight, const float *s, const float *m, int64_t group, float *sums) {
    int64_t blocks = k_in / BLOCK;
    for (int r = 0; r < rt; r++) {
        float acc = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            const int8_t *xb = qx + r * k_in + b * BLOCK;
            int dot = 0;
            if (kind == 4) {
                const uint8_t *qb = (const uint8_t *)qweight + b * (BLOCK / 2);
                for (int j = 0; j < BLOCK / 2; j++)
                    dot += (qb[j] & 0x0F) * xb[j] + (qb[j] >> 4) * xb[j + BLOCK / 2];
                acc += s[b] * dx[r * blocks + b] * (float)dot + m[b] * sx[r * blocks + b];
            } else {
                const int8_t *qb = (const int8_t *)qweight + b * BLOCK;
                for (int j = 0; j < BLOCK; j++) dot += qb[j] * xb[j];
                acc += s[b * BLOCK / group] * dx[r * blocks + b] * (float)dot;
            }
        }
        sums[r] = acc;
    }
}

#if defined(__AVX2__) && defined(__FMA__) /* AVX-512 CPUs have AVX2: this path serves their builds too */
#define QUANT_INT8_DOT 1

/* One block against rt rows: u8 weights (int4 nibbles, or |q8|) times s8 activations (sign-adjusted for int8) */
static inline __attribute__((always_inline)) void q8_block_avx2(const int8_t *qx, int64_t k_in, const int rt,
                                                                __m256i w, __m256i wsign, int signed_w,
                                                                const float *dxb, int64_t blocks, float scale,
                                                                __m256 acc[ROW_TILE]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < rt; r++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * k_in));
        if (signed_w) xv = _mm256_sign_epi8(xv, wsign);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(scale * dxb[r * blocks]), acc[r]);
    }
}

static inline __attribute__((always_inline)) void q8_tile_avx2(const int8_t *qx, const float *dx, const float *sx,
                                                               int64_t k_in, const int rt, int kind,
                                                               const void *qweight, const float *s, const float *m,
                                                               int64_t group, float *sums) {
    int64_t blocks = k_in / BLOCK;
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rt; r++) acc[r] = _mm256_setzero_ps();
    if (kind == 4) {
        const __m128i nibble = _mm_set1_epi8(0x0F);
        for (int64_t b = 0; b < blocks; b++) {
            __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)qweight + b * (BLOCK / 2)));
            __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), _mm_and_si128(raw, nibble));
            q8_block_avx2(qx + b * BLOCK, k_in, rt, w, w, 0, dx + b, blocks, s[b], acc);
        }
    } else {
        for (int64_t b = 0; b < blocks; b++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)((const int8_t *)qweight + b * BLOCK));
            q8_block_avx2(qx + b * BLOCK, k_in, rt, _mm256_sign_epi8(w, w), w, 1, dx + b, blocks,
                          s[b * BLOCK / group], acc);
        }
    }
    for (int r = 0; r < rt; r++) sums[r] = hsum256(acc[r]);
    if (kind == 4) add_min_terms(rt, m, sx, blocks, sums);
}
/* One row of x against n (1..4) int8 output rows (batch-1 decode; which rows: `thread_row_runs`, as the float
 * path's), as int8_gemv4_avx2: each x block is loaded once for the n weight rows, and their FMA chains are
 * independent. A row's sum is the same whatever n, and the same as q8_tile_avx2's. */
static inline __attribute__((always_inline)) void q8_int8_gemv4_avx2(const int8_t *qx, const float *dx,
                                                                     int64_t k_in, const int8_t *const *q,
                                                                     const float *const *s, int64_t group, int n,
                                                                     float *out) {
    int64_t blocks = k_in / BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < blocks; b++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + b * BLOCK));
        for (int i = 0; i < n; i++) {
            _mm_prefetch((const char *)(q[i] + k_in + b * BLOCK), _MM_HINT_T0); /* the run's next row */
            __m256i w = _mm256_loadu_si256((const __m256i *)(q[i] + b * BLOCK));
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xv, w)),
                                            ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[i][b * BLOCK / group] * dx[b]),
                                     acc[i]);
        }
    }
    for (int i = 0; i < n; i++) out[i] = hsum256(acc[i]);
}

static inline __attribute__((always_inline)) void q8_int8_rows(const int8_t *qx, const float *dx,
                                                               const int8_t *qweight, const float *scales,
                                                               int64_t group, const float *bias, void *y,
                                                               int64_t k_in, int bf16, RowRuns runs, int64_t j,
                                                               int n) {
    int64_t o[RUNS];
    const int8_t *q[RUNS];
    const float *s[RUNS];
    float sums[RUNS];
    int8_row_pointers(runs, j, n, qweight, scales, group, k_in, o, q, s);
    q8_int8_gemv4_avx2(qx, dx, k_in, q, s, group, n, sums);
    for (int i = 0; i < n; i++) store(y, o[i], sums[i], bias, o[i], bf16);
}

/* One row of x against n (1..4) adjacent int4 output rows (batch-1 decode), two groups a step: a row's 32 bytes at
 * a step hold groups g and g + 1 (16 each), so its low nibbles are one vector of [g's inputs 0-15 | g + 1's] and
 * its high nibbles one of their inputs 16-31, each multiplied by x's matching halves (x's two blocks regrouped once
 * a step for the n rows): a group's unpacking, widening and converting at half the instructions of one group at a
 * time (1.5x faster on a Zen 3). The groups' sums sit in lanes 0-3 and 4-7, scaled by [s dx (g) x4 | s dx (g + 1)
 * x4]; an odd last group goes alone. A row's sum is the same whatever n (every output row of a one-row call comes
 * through here, so a row does not depend on how the rows were split). */
static inline __attribute__((always_inline)) void q8_int4_gemv_avx2(const int8_t *qx, const float *dx,
                                                                    const float *sx, int64_t k_in,
                                                                    const uint8_t *qweight, const float *s,
                                                                    const float *m, int n, float *out) {
    int64_t blocks = k_in / BLOCK, row_bytes = k_in / 2, pairs = blocks / 2;
    const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(0x0F);
    const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t p = 0; p < pairs; p++) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(qx + 2 * BLOCK * p)),
                x1 = _mm256_loadu_si256((const __m256i *)(qx + 2 * BLOCK * p + BLOCK));
        __m256i xlo = _mm256_permute2x128_si256(x0, x1, 0x20), xhi = _mm256_permute2x128_si256(x0, x1, 0x31);
        __m128 dxp = _mm_castpd_ps(_mm_load_sd((const double *)(dx + 2 * p)));
        for (int i = 0; i < n; i++) {
            const uint8_t *wq = qweight + i * row_bytes + BLOCK * p;
            /* 2 KB ahead, and the scales and mins as far ahead in rows (a quarter of the bytes): from DRAM, the
             * hardware prefetcher alone kept too few reads in flight for these three streams (a Zen 3's 30 layers
             * of linears 7.9 -> 9.4 GB/s on one thread, 13.7 -> 15.3 on two) */
            _mm_prefetch((const char *)wq + 2048, _MM_HINT_T0);
            _mm_prefetch((const char *)(s + i * blocks + 2 * p) + 512, _MM_HINT_T0);
            _mm_prefetch((const char *)(m + i * blocks + 2 * p) + 512, _MM_HINT_T0);
            __m256i w = _mm256_loadu_si256((const __m256i *)wq);
            __m256i lo = _mm256_and_si256(w, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble);
            /* int16 sums of 4 products each: at most 4 * 15 * 127 */
            __m256i dot16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
            __m128 sdx = _mm_mul_ps(_mm_castpd_ps(_mm_load_sd((const double *)(s + i * blocks + 2 * p))), dxp);
            __m256 scale = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sdx), spread);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot16, ones)), scale, acc[i]);
        }
    }
    for (int i = 0; i < n; i++) {
        out[i] = hsum256(acc[i]);
        if (blocks % 2) {
            int64_t b = blocks - 1;
            __m128i raw = _mm_loadu_si128((const __m128i *)(qweight + i * row_bytes + b * (BLOCK / 2)));
            __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nibble);
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + b * BLOCK));
            __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
            out[i] += hsum256(_mm256_cvtepi32_ps(dot)) * (s[i * blocks + b] * dx[b]);
        }
        add_min_terms(1, m + i * blocks, sx, blocks, out + i);
    }
}
#define QUANT_Q8_GEMV4 1
#define Q8_TILE(rt) q8_tile_avx2(qx, dx, sx, k_in, rt, kind, qweight, s, m, group, sums)
#else
#define Q8_TILE(rt) q8_tile_plain(qx, dx, sx, k_in, rt, kind, qweight, s, m, group, sums)
#endif

static __attribute__((unused)) void q8_tile(const int8_t *qx, const float *dx, const float *sx, int64_t k_in, int rt, int kind,
                    const void *qweight, const float *s, const float *m, int64_t group, float *sums) {
    switch (rt) {
    case 1: Q8_TILE(1); break;
    case 2: Q8_TILE(2); break;
    case 3: Q8_TILE(3); break;
    default: Q8_TILE(4); break;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QUANT_VNNI 1 /* csrc/quant_vnni.c: vpdpbusd, every row count */
void duet_q8_linear_vnni(const int8_t *qx, const float *dx, const float *sx, int64_t rows, int64_t k_in, int kind,
                         const void *qweight, const float *scales, const float *mins, int64_t group, float *sums,
                         int64_t n_out);
#endif

/* Which int8-activation path this build compiled: 512 (AVX-512 VNNI), 256 (AVX2 integer dot products) or 0 (plain
 * loops). */
int duet_quant_int8_dot_bits(void) {
#if defined(QUANT_VNNI)
    return 512;
#elif defined(QUANT_INT8_DOT)
    return 256;
#else
    return 0;
#endif
}

/* y [rows, n_out] = quantize_activations(x) · W [n_out, k_in]ᵀ + bias, W int4 (kind 4: scales, mins) or int8
 * (kind 8: scales per `group`, a multiple of 32, or k_in); k_in a multiple of 32 */
void duet_quantized_linear_q8(const void *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                              const float *mins, int64_t group, const float *bias, void *y, int64_t rows,
                              int64_t n_out, int64_t k_in, int bf16) {
    int64_t ldf, blocks = k_in / BLOCK, groups = k_in / group;
    float *owned;
    const float *xf = activations_f32(x, ldx, rows, k_in, bf16, &ldf, &owned);
    size_t nb = (size_t)(rows * blocks > 0 ? rows * blocks : 1);
    int8_t *qx = malloc((size_t)(rows * k_in > 0 ? rows * k_in : 1));
    float *dx = malloc(sizeof(float) * nb), *sx = malloc(sizeof(float) * nb);
    duet_quantize_activations(xf, ldf, rows, k_in, qx, dx, sx);
#if defined(QUANT_VNNI)
    float *sums = malloc(sizeof(float) * (size_t)(rows * n_out > 0 ? rows * n_out : 1));
    duet_q8_linear_vnni(qx, dx, sx, rows, k_in, kind, qweight, scales, mins, group, sums, n_out);
    store_sums(y, sums, bias, rows, n_out, bf16);
    (void)blocks;
    (void)groups;
#else
    int64_t row_bytes = kind == 4 ? k_in / 2 : k_in;
    int64_t first = 0; /* output rows before this are done by the one-row path: all of them, or none */
#if defined(QUANT_Q8_GEMV4)
    if (rows == 1) {
        first = n_out;
        if (kind == 8) { /* as runs side by side, as the float path (a 28 MB int8 lm_head 2-3x faster on a Zen 3) */
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
            EACH_THREAD_ROW_STEP(n_out, 0, q8_int8_rows, qx, dx, qweight, scales, group, bias, y, k_in, bf16);
        } else { /* int4: four adjacent rows at a time (the last few one at a time) */
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
            for (int64_t o = 0; o < n_out; o += 4) {
                float sums[4];
                int n = n_out - o < 4 ? (int)(n_out - o) : 4;
                if (n == 4)
                    q8_int4_gemv_avx2(qx, dx, sx, k_in, (const uint8_t *)qweight + o * row_bytes,
                                      scales + o * groups, mins + o * groups, 4, sums);
                else
                    for (int i = 0; i < n; i++)
                        q8_int4_gemv_avx2(qx, dx, sx, k_in, (const uint8_t *)qweight + (o + i) * row_bytes,
                                          scales + (o + i) * groups, mins + (o + i) * groups, 1, sums + i);
                for (int i = 0; i < n; i++) store(y, o + i, sums[i], bias, o + i, bf16);
            }
        }
    }
#endif
#pragma omp parallel for schedule(static) if (first < n_out && n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = first; o < n_out; o++) { /* (no team for the empty loop after a one-row pass) */
        for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
            int rt = rows - r0 < ROW_TILE ? (int)(rows - r0) : ROW_TILE;
            float sums[ROW_TILE];
            q8_tile(qx + r0 * k_in, dx + r0 * blocks, sx + r0 * blocks, k_in, rt, kind,
                    (const uint8_t *)qweight + o * row_bytes, scales + o * groups,
                    kind == 4 ? mins + o * groups : NULL, group, sums);
            for (int r = 0; r < rt; r++) store(y, (r0 + r) * n_out + o, sums[r], bias, o, bf16);
        }
    }
#endif
    free(qx);
    free(dx);
    free(sx);
    free(owned);
}

/* Row o of W as float32 into dst [k_in]: q * s (+ m), the twin's two roundings (this file is built with
 * -ffp-contract=off). The many-row paths take it: the whole-weight pass below (for a GEMM) and, on builds without
 * AVX-512, csrc/quant_panels.c's panels. Any build with AVX2 (AVX-512 ones too) unpacks a block as the AVX2
 * kernels do: GCC 12 turns the plain int4 loop into scalar extracts and inserts (dequantize + GEMV of SmolLM2's
 * gate_up on a Zen 3: 3.1 ms that way, 0.75 ms this way). */
void duet_dequantize_row(int kind, const void *qweight, const float *scales, const float *mins, int64_t group,
                         int64_t o, int64_t k_in, float *dst) {
    int64_t groups = k_in / group;
    if (kind == 8) {
        const int8_t *q = (const int8_t *)qweight + o * k_in;
        for (int64_t g = 0; g < groups; g++) {
            float sc = scales[o * groups + g];
            int64_t j = g * group, end = (g + 1) * group;
#if defined(__AVX2__)
            for (; j + BLOCK <= end; j += BLOCK) {
                __m256 w[4];
                unpack_int8_block_avx2(q + j, w);
                for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + j + 8 * i, _mm256_mul_ps(w[i], _mm256_set1_ps(sc)));
            }
#endif
            for (; j < end; j++) dst[j] = (float)q[j] * sc; /* per-channel widths: no multiple of 32 */
        }
    } else {
        const uint8_t *q = (const uint8_t *)qweight + o * (k_in / 2);
        for (int64_t g = 0; g < groups; g++) {
            float sc = scales[o * groups + g], mn = mins[o * groups + g];
            const uint8_t *qg = q + g * (BLOCK / 2);
            float *d = dst + g * BLOCK;
#if defined(__AVX2__)
            __m256 w[4];
            unpack_int4_block_avx2(qg, w);
            for (int i = 0; i < 4; i++)
                _mm256_storeu_ps(d + 8 * i, _mm256_add_ps(_mm256_mul_ps(w[i], _mm256_set1_ps(sc)), _mm256_set1_ps(mn)));
#else
            for (int j = 0; j < BLOCK / 2; j++) {
                d[j] = (float)(qg[j] & 0x0F) * sc + mn;
                d[j + BLOCK / 2] = (float)(qg[j] >> 4) * sc + mn;
            }
#endif
        }
    }
}

/* The whole weight as float32 [n_out, k_in], one pass (the many-rows path hands it to a GEMM). */
void duet_int8_dequantize(const int8_t *qweight, const float *scales, int64_t group, float *out, int64_t n_out,
                          int64_t k_in) {
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) duet_dequantize_row(8, qweight, scales, NULL, group, o, k_in, out + o * k_in);
}

void duet_int4_dequantize(const uint8_t *qweight, const float *scales, const float *mins, float *out, int64_t n_out,
                          int64_t k_in) {
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t o = 0; o < n_out; o++) duet_dequantize_row(4, qweight, scales, mins, BLOCK, o, k_in, out + o * k_in);
}
