/* Quantized linears on int8 activations with AVX-512 VNNI (vpdpbusd: 64 u8 x s8 products summed four by four
 * into 16 int32 lanes, one instruction): quant_kernels.c's `duet_quantized_linear_q8` hands its quantized rows of
 * x here on CPUs that have it. Same arithmetic as that file's int8-activation paths (exact int32 dot products per
 * 32-input block, one float scale per block): its twin, `quantized_linear_int8_activations_reference`, is the test's
 * reference. Why a second file: these loops need x rearranged once per call (below) and share nothing else.
 *
 * int4, four groups (128 inputs, 64 weight bytes) per step: the bytes' low nibbles are inputs 0-15 of each group,
 * the high nibbles inputs 16-31, one group per 128-bit lane:
 *
 *   weight bytes  | g0 bytes 0-15 | g1 bytes 0-15 | g2 ... | g3 ... |   lo = & 0x0F, hi = >> 4 & 0x0F
 *   x, lo half    | g0 x 0-15     | g1 x 0-15     | g2 ... | g3 ... |   (xq4: x rearranged once per call)
 *   x, hi half    | g0 x 16-31    | g1 x 16-31    | g2 ... | g3 ... |
 *   dpbusd(dpbusd(0, lo, x lo), hi, x hi): int32 lanes 4k..4k+3 hold group k's dot product in four parts
 *   y += Σ lanes cvt(dot) * (s[g] * dx[g])  +  Σ_g m[g] * sx[g]          (sx = dx * sum(qx), per group)
 *
 * int8, two blocks (64 inputs) per step: vpdpbusd takes unsigned bytes first, so the weights are offset by 128
 * (w ^ 0x80 = w + 128 as u8) and the offset's share, 128 * Σ qx over each lane's four inputs, is taken out by
 * starting the sum from its negation (xneg: from x alone, once per call). Lanes 0-7 hold block 2p, lanes 8-15
 * block 2p + 1.
 *
 * A step's missing groups or blocks at the end of a row (K / 32 not a multiple of 4, or of 2) are masked loads of
 * zeros: zero weight bytes against zero x bytes and zero scales add nothing. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#define BLOCK 32
#define PARALLEL_MIN_WEIGHTS 65536 /* as quant_kernels.c */

typedef struct { /* rows of x in the layout of one weight kind (see the top of the file) */
    int64_t steps, row_bytes, row_lanes;
    int8_t *xq;    /* [rows][steps * 128] int4: lo | hi halves;  [rows][steps * 64] int8: x as it is, padded */
    int32_t *xneg; /* int8 only: [rows][steps * 16], -128 * Σ of each lane's four qx */
    float *dxe;    /* [rows][steps * 16]: dx of each lane's group / block */
    float *sxc;    /* int4 only: [rows][steps * 4], sx per group, zero past the last */
} vnni_x;

static void prepare_int4(const int8_t *qx, const float *dx, const float *sx, int64_t rows, int64_t k_in, vnni_x *v) {
    int64_t groups = k_in / BLOCK;
    v->steps = (groups + 3) / 4;
    v->row_bytes = v->steps * 128;
    v->row_lanes = v->steps * 16;
    v->xq = calloc((size_t)(rows * v->row_bytes), 1);
    v->dxe = calloc((size_t)(rows * v->row_lanes), sizeof(float));
    v->sxc = calloc((size_t)(rows * v->steps * 4), sizeof(float));
    v->xneg = NULL;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < groups; g++) {
            int64_t step = g / 4, lane = g % 4;
            int8_t *dst = v->xq + r * v->row_bytes + step * 128 + lane * 16;
            const int8_t *src = qx + r * k_in + g * BLOCK;
            for (int j = 0; j < 16; j++) {
                dst[j] = src[j];
                dst[64 + j] = src[16 + j];
            }
            for (int j = 0; j < 4; j++) v->dxe[r * v->row_lanes + step * 16 + lane * 4 + j] = dx[r * groups + g];
            v->sxc[r * v->steps * 4 + g] = sx[r * groups + g];
        }
}

static void prepare_int8(const int8_t *qx, const float *dx, int64_t rows, int64_t k_in, vnni_x *v) {
    int64_t blocks = k_in / BLOCK;
    v->steps = (blocks + 1) / 2;
    v->row_bytes = v->steps * 64;
    v->row_lanes = v->steps * 16;
    v->xq = calloc((size_t)(rows * v->row_bytes), 1);
    v->xneg = calloc((size_t)(rows * v->row_lanes), sizeof(int32_t));
    v->dxe = calloc((size_t)(rows * v->row_lanes), sizeof(float));
    v->sxc = NULL;
    for (int64_t r = 0; r < rows; r++) {
        int8_t *dst = v->xq + r * v->row_bytes;
        for (int64_t k = 0; k < k_in; k++) dst[k] = qx[r * k_in + k];
        for (int64_t lane = 0; lane < k_in / 4; lane++) {
            int sum = dst[4 * lane] + dst[4 * lane + 1] + dst[4 * lane + 2] + dst[4 * lane + 3];
            v->xneg[r * v->row_lanes + lane] = -128 * sum;
            v->dxe[r * v->row_lanes + lane] = dx[r * blocks + lane / 8];
        }
    }
}

static void release(vnni_x *v) {
    free(v->xq);
    free(v->xneg);
    free(v->dxe);
    free(v->sxc);
}

/* which group's scale each lane takes: lanes 4k..4k+3 take element k of a 4-float vector */
static inline __m512 spread4(__m128 s4) {
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(s4));
}

/* One step of four int4 groups of a weight row (64 bytes, masked past the row's end): low and high nibbles */
static inline void int4_unpack(const uint8_t *q, __mmask64 byte_mask, __m512i *lo, __m512i *hi) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i raw = _mm512_maskz_loadu_epi8(byte_mask, q);
    *lo = _mm512_and_si512(raw, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
}

/* ... against the same step of one row of x's int4 layout: group k's dot product in lanes 4k..4k+3 */
static inline __m512i int4_dot(__m512i lo, __m512i hi, const int8_t *xr) {
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr)), hi,
                               _mm512_loadu_si512(xr + 64));
}

/* ---- one row of x (batch-1 decode): four output rows a step, x's vectors loaded once for them, the four sums
 * reduced together (a loop that reduced each output row's 16 lanes alone and reloaded x for each one cost, at
 * K = 576 (4.5 steps a row), as much as the dot products: SmolLM2's int4 gate_up from cache 46 -> 19 us). Each
 * thread reads its slice of W's rows as four runs side by side (step j: rows lo + j, lo + run + j, ...), each run's
 * next row prefetched: four sequential streams keep more reads in flight than adjacent rows (the same layers from
 * DRAM: int4 28 -> 32-40 GB/s, int8 18 -> 33-41; csrc/gemv.c found the same for dense rows). A row's sum is the
 * many-row tiles' arithmetic (below) up to float32 summation order (where the mins' share enters the lanes, and the
 * final reduction's tree). */

#define GEMV_ROWS 4

/* out[i] = sum of acc[i]'s 16 lanes, for i < 4 */
static inline void reduce4(const __m512 acc[GEMV_ROWS], float *out) {
    __m256 h[GEMV_ROWS];
    for (int i = 0; i < GEMV_ROWS; i++)
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(acc[i]), _mm512_extractf32x8_ps(acc[i], 1));
    __m256 a = _mm256_hadd_ps(h[0], h[1]), b = _mm256_hadd_ps(h[2], h[3]);
    __m256 c = _mm256_hadd_ps(a, b); /* lanes: r0 r1 r2 r3 (low 128) | r0 r1 r2 r3 (high 128), partial */
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1)));
}

static inline __attribute__((always_inline)) void int4_gemv_step(const vnni_x *v, int64_t step,
                                                                 const uint8_t *const *q, const float *const *s,
                                                                 const float *const *m, int64_t row_bytes,
                                                                 __mmask64 byte_mask, __mmask8 group_mask,
                                                                 __m512 acc[GEMV_ROWS], __m128 macc[GEMV_ROWS]) {
    const int8_t *xr = v->xq + step * 128;
    const __m512 dx = _mm512_loadu_ps(v->dxe + step * 16);
    const __m128 sx = _mm_maskz_loadu_ps(group_mask, v->sxc + step * 4);
    for (int i = 0; i < GEMV_ROWS; i++) {
        _mm_prefetch((const char *)(q[i] + row_bytes + step * 64), _MM_HINT_T0); /* the run's next row */
        __m512i lo, hi;
        int4_unpack(q[i] + step * 64, byte_mask, &lo, &hi);
        __m512i dot = int4_dot(lo, hi, xr);
        __m512 dscale = _mm512_mul_ps(spread4(_mm_maskz_loadu_ps(group_mask, s[i] + step * 4)), dx);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dscale, acc[i]);
        macc[i] = _mm_fmadd_ps(_mm_maskz_loadu_ps(group_mask, m[i] + step * 4), sx, macc[i]);
    }
}

static inline __attribute__((always_inline)) void int4_gemv(const vnni_x *v, int64_t groups,
                                                            const uint8_t *const *q, const float *const *s,
                                                            const float *const *m, float *out) {
    __m512 acc[GEMV_ROWS];
    __m128 macc[GEMV_ROWS];
    for (int i = 0; i < GEMV_ROWS; i++) {
        acc[i] = _mm512_setzero_ps();
        macc[i] = _mm_setzero_ps();
    }
    int64_t full = groups / 4, row_bytes = groups * BLOCK / 2;
    for (int64_t step = 0; step < full; step++) int4_gemv_step(v, step, q, s, m, row_bytes, ~0ULL, 0x0F, acc, macc);
    if (groups % 4) {
        int left = (int)(groups % 4);
        int4_gemv_step(v, full, q, s, m, row_bytes, (1ULL << (16 * left)) - 1, (__mmask8)((1 << left) - 1), acc,
                       macc);
    }
    for (int i = 0; i < GEMV_ROWS; i++) acc[i] = _mm512_add_ps(acc[i], _mm512_zextps128_ps512(macc[i]));
    reduce4(acc, out);
}

static inline __attribute__((always_inline)) void int8_gemv(const vnni_x *v, int64_t blocks,
                                                            const int8_t *const *q, const float *const *s,
                                                            int64_t group, float *out) {
    __m512 acc[GEMV_ROWS];
    for (int i = 0; i < GEMV_ROWS; i++) acc[i] = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    int64_t steps = (blocks + 1) / 2, row_bytes = blocks * BLOCK;
    for (int64_t step = 0; step < steps; step++) {
        int whole = 2 * step + 1 < blocks; /* else the last block alone: lanes 8-15 masked to zero */
        __mmask64 byte_mask = whole ? ~0ULL : 0xFFFFFFFFULL;
        const __m512i xq = _mm512_loadu_si512(v->xq + step * 64), xneg = _mm512_loadu_si512(v->xneg + step * 16);
        const __m512 dx = _mm512_loadu_ps(v->dxe + step * 16);
        for (int i = 0; i < GEMV_ROWS; i++) {
            _mm_prefetch((const char *)(q[i] + row_bytes + step * 64), _MM_HINT_T0); /* the run's next row */
            __m512i w = _mm512_xor_si512(_mm512_maskz_loadu_epi8(byte_mask, q[i] + step * 64), offset);
            __m512 scale = _mm512_insertf32x8(_mm512_set1_ps(s[i][2 * step * BLOCK / group]),
                                              _mm256_set1_ps(whole ? s[i][(2 * step + 1) * BLOCK / group] : 0.0f), 1);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(xneg, w, xq)), _mm512_mul_ps(scale, dx),
                                     acc[i]);
        }
    }
    reduce4(acc, out);
}

/* the one-row pass over this thread's slice of W's rows; call inside an OpenMP parallel region (or none) */
static void gemv_rows(const vnni_x *v, int kind, int64_t k_in, const void *qweight, const float *scales,
                      const float *mins, int64_t group, float *sums, int64_t n_out) {
    int64_t t = 0, threads = 1;
#if defined(_OPENMP)
    t = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
    int64_t lo = n_out * t / threads, hi = n_out * (t + 1) / threads, groups = k_in / group;
    int64_t row_bytes = kind == 4 ? k_in / 2 : k_in;
    int64_t run = (hi - lo) / GEMV_ROWS, steps = run + (hi - lo) % GEMV_ROWS;
    for (int64_t j = 0; j < steps; j++) {
        int64_t row_of[GEMV_ROWS];
        int n = j < run ? GEMV_ROWS : 1; /* a leftover row goes alone, repeated in the unused places */
        for (int i = 0; i < GEMV_ROWS; i++) row_of[i] = j < run ? lo + i * run + j : lo + GEMV_ROWS * run + (j - run);
        const void *q[GEMV_ROWS];
        const float *s[GEMV_ROWS], *m[GEMV_ROWS];
        for (int i = 0; i < GEMV_ROWS; i++) {
            q[i] = (const uint8_t *)qweight + row_of[i] * row_bytes;
            s[i] = scales + row_of[i] * groups;
            m[i] = kind == 4 ? mins + row_of[i] * groups : NULL;
        }
        float out[GEMV_ROWS];
        if (kind == 4)
            int4_gemv(v, k_in / BLOCK, (const uint8_t *const *)q, s, m, out);
        else
            int8_gemv(v, k_in / BLOCK, (const int8_t *const *)q, s, group, out);
        for (int i = 0; i < n; i++) sums[row_of[i]] = out[i];
    }
}

/* ---- many rows of x (batched decode, verification, prefill chunks): register tiles of TILE_ROWS rows of x against
 * TILE_OUTS output rows, one float32 accumulator a pair. Each weight step is unpacked once for the tile's rows and
 * each x step loaded once for its outputs, so a pair costs only its dot products, the conversion and the scaling;
 * the mins' share (int4) goes into the same lanes at the end, and each pair's 16 lanes are reduced with the others
 * in `reduce4`. A pair's sum is the same arithmetic whichever rows and outputs share its tile (a repeated row or
 * output fills a partial tile, its sums discarded). Before, each output row took x's rows four at a time and
 * reduced each pair's lanes alone: ~60 GMAC/s at 8-32 rows, slower than dense bf16. */

#define TILE_ROWS 4
#define TILE_OUTS GEMV_ROWS /* one reduce4 a tile row (3 x 4 and 4 x 3 tiles measured no faster) */

/* One step of four int4 groups (128 inputs) of the tile's outputs against its rt rows */
static inline __attribute__((always_inline)) void int4_tile_step(const vnni_x *v, int64_t step, const int rt,
                                                                 const uint8_t *const *q, const float *const *s,
                                                                 __mmask64 byte_mask, __mmask8 group_mask,
                                                                 __m512 acc[TILE_ROWS][TILE_OUTS]) {
    __m512i lo[TILE_OUTS], hi[TILE_OUTS];
    __m512 scale[TILE_OUTS];
    for (int i = 0; i < TILE_OUTS; i++) {
        int4_unpack(q[i] + step * 64, byte_mask, &lo[i], &hi[i]);
        scale[i] = spread4(_mm_maskz_loadu_ps(group_mask, s[i] + step * 4));
    }
    for (int r = 0; r < rt; r++) {
        const int8_t *xr = v->xq + r * v->row_bytes + step * 128;
        const __m512 dx = _mm512_loadu_ps(v->dxe + r * v->row_lanes + step * 16);
        for (int i = 0; i < TILE_OUTS; i++)
            acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(int4_dot(lo[i], hi[i], xr)), _mm512_mul_ps(scale[i], dx),
                                        acc[r][i]);
    }
}

/* One step of two int8 blocks (64 inputs) of the tile's outputs against its rt rows (whole: else the last block
 * alone, lanes 8-15 masked to zero) */
static inline __attribute__((always_inline)) void int8_tile_step(const vnni_x *v, int64_t step, const int rt,
                                                                 const int8_t *const *q, const float *const *s,
                                                                 int64_t group, int whole,
                                                                 __m512 acc[TILE_ROWS][TILE_OUTS]) {
    const __mmask64 byte_mask = whole ? ~0ULL : 0xFFFFFFFFULL;
    __m512i w[TILE_OUTS];
    __m512 scale[TILE_OUTS];
    for (int i = 0; i < TILE_OUTS; i++) {
        w[i] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(byte_mask, q[i] + step * 64), _mm512_set1_epi8((char)0x80));
        scale[i] = _mm512_insertf32x8(_mm512_set1_ps(s[i][2 * step * BLOCK / group]),
                                      _mm256_set1_ps(whole ? s[i][(2 * step + 1) * BLOCK / group] : 0.0f), 1);
    }
    for (int r = 0; r < rt; r++) {
        const __m512i xq = _mm512_loadu_si512(v->xq + r * v->row_bytes + step * 64);
        const __m512i xneg = _mm512_loadu_si512(v->xneg + r * v->row_lanes + step * 16);
        const __m512 dx = _mm512_loadu_ps(v->dxe + r * v->row_lanes + step * 16);
        for (int i = 0; i < TILE_OUTS; i++)
            acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(xneg, w[i], xq)),
                                        _mm512_mul_ps(scale[i], dx), acc[r][i]);
    }
}

/* out[r][i] = x row r . W row i of the tile, for r < rt (a compile-time constant in each case of `tile`) */
static inline __attribute__((always_inline)) void tile_rows(const vnni_x *v, int kind, int64_t k_in, const int rt,
                                                            const void *const *q, const float *const *s,
                                                            const float *const *m, int64_t group,
                                                            float out[TILE_ROWS][TILE_OUTS]) {
    __m512 acc[TILE_ROWS][TILE_OUTS];
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < TILE_OUTS; i++) acc[r][i] = _mm512_setzero_ps();
    int64_t groups = k_in / BLOCK;
    if (kind == 4) {
        int64_t full = groups / 4;
        for (int64_t step = 0; step < full; step++)
            int4_tile_step(v, step, rt, (const uint8_t *const *)q, s, ~0ULL, 0x0F, acc);
        if (groups % 4) {
            int left = (int)(groups % 4);
            int4_tile_step(v, full, rt, (const uint8_t *const *)q, s, (1ULL << (16 * left)) - 1,
                           (__mmask8)((1 << left) - 1), acc);
        }
        for (int64_t g = 0; g < groups; g += 16) { /* the mins' share: sum over groups of m * sx, in the same lanes */
            __mmask16 mask = groups - g >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
            for (int r = 0; r < rt; r++) {
                const __m512 sx = _mm512_maskz_loadu_ps(mask, v->sxc + r * v->steps * 4 + g);
                for (int i = 0; i < TILE_OUTS; i++)
                    acc[r][i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, m[i] + g), sx, acc[r][i]);
            }
        }
    } else {
        int64_t steps = (groups + 1) / 2;
        for (int64_t step = 0; step < steps; step++)
            int8_tile_step(v, step, rt, (const int8_t *const *)q, s, group, 2 * step + 1 < groups, acc);
    }
    for (int r = 0; r < rt; r++) reduce4(acc[r], out[r]);
}

static void tile(const vnni_x *v, int kind, int64_t k_in, int rt, const void *const *q, const float *const *s,
                 const float *const *m, int64_t group, float out[TILE_ROWS][TILE_OUTS]) {
    switch (rt) {
    case 1: tile_rows(v, kind, k_in, 1, q, s, m, group, out); break;
    case 2: tile_rows(v, kind, k_in, 2, q, s, m, group, out); break;
    case 3: tile_rows(v, kind, k_in, 3, q, s, m, group, out); break;
    default: tile_rows(v, kind, k_in, TILE_ROWS, q, s, m, group, out); break;
    }
}

/* sums [rows, n_out] (float32, without bias) = x · W ᵀ for x quantized as quantize_activations (qx, dx, sx), W int4
 * (kind 4) or int8 (kind 8, scales per `group`); k_in a multiple of 32. */
void duet_q8_linear_vnni(const int8_t *qx, const float *dx, const float *sx, int64_t rows, int64_t k_in, int kind,
                         const void *qweight, const float *scales, const float *mins, int64_t group, float *sums,
                         int64_t n_out) {
    vnni_x v;
    if (kind == 4)
        prepare_int4(qx, dx, sx, rows, k_in, &v);
    else
        prepare_int8(qx, dx, rows, k_in, &v);
    int64_t row_bytes = kind == 4 ? k_in / 2 : k_in, groups = k_in / group;
    if (rows == 1) {
#pragma omp parallel if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
        gemv_rows(&v, kind, k_in, qweight, scales, mins, group, sums, n_out);
        release(&v);
        return;
    }
#pragma omp parallel for schedule(static) if (n_out * k_in >= PARALLEL_MIN_WEIGHTS)
    for (int64_t t = 0; t < (n_out + TILE_OUTS - 1) / TILE_OUTS; t++) {
        int64_t o0 = t * TILE_OUTS, n = n_out - o0 < TILE_OUTS ? n_out - o0 : TILE_OUTS;
        const void *q[TILE_OUTS];
        const float *s[TILE_OUTS], *m[TILE_OUTS];
        for (int i = 0; i < TILE_OUTS; i++) { /* past the last output: the last one again, its sums dropped */
            int64_t o = o0 + (i < n ? i : n - 1);
            q[i] = (const uint8_t *)qweight + o * row_bytes;
            s[i] = scales + o * groups;
            m[i] = kind == 4 ? mins + o * groups : NULL;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            int rt = rows - r0 < TILE_ROWS ? (int)(rows - r0) : TILE_ROWS;
            float out[TILE_ROWS][TILE_OUTS];
            vnni_x at = v; /* the tile's rows */
            at.xq += r0 * v.row_bytes;
            at.dxe += r0 * v.row_lanes;
            if (at.xneg) at.xneg += r0 * v.row_lanes;
            if (at.sxc) at.sxc += r0 * v.steps * 4;
            tile(&at, kind, k_in, rt, q, s, m, group, out);
            for (int r = 0; r < rt; r++)
                for (int i = 0; i < n; i++) sums[(r0 + r) * n_out + o0 + i] = out[r][i];
        }
    }
    release(&v);
}
#else
typedef int duet_quant_vnni_not_built; /* this CPU has no AVX-512 VNNI: quant_kernels.c's paths serve it */
#endif
