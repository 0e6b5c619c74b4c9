/* CPU kernels for the model's hot path, one pass over memory each (engine/kernels/cpu_native.py builds
 * this file with the system C compiler and calls it through ctypes; each function's torch twin in
 * engine/kernels/ is its reference).
 *
 * Element types: every tensor argument is float32 or bfloat16 (`bf16` != 0), as the model's dtype.
 * bf16 values are widened to float32 exactly and rounded back (to nearest even, NaN -> 0x7FC0, as torch)
 * where the twin rounds, so elementwise kernels match the twin bit for bit where the twin's arithmetic
 * is plain IEEE (add, mul, div; the build disables FMA contraction). exp and 1/sqrt are computed here
 * and differ from torch's by an ulp or so; reductions (RMS, attention) sum in another order.
 *
 * Loops are written so the compiler vectorizes them (plain typed loops, branch-free helpers, type
 * punning through a union). Where the compiler cannot find the fast form, an AVX-512 version sits inside
 * `#ifdef DUET_AVX512` next to the plain loop it replaces (the SiLU's exp, decode attention's dot products
 * and weighted sum, greedy argmax), and for decode attention and argmax an AVX2 one too (`DUET_AVX2`); the tests run
 * the native, the -mno-avx512f and the no-vector builds against the twins. float32 rows are read
 * and written in place, never staged through copies. Threads: OpenMP, which binds to the libgomp torch
 * already loaded (same soname), so torch.set_num_threads applies; a kernel parallelizes only with enough
 * work for a barrier.
 */

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define DUET_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define DUET_AVX2 1 /* decode attention's tiles and argmax in 8 lanes (the plain loops: a token's dot product alone) */
#endif
#if defined(__AVX512F__) || defined(DUET_AVX2)
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

#define PARALLEL_MIN_ELEMENTS 32768 /* as torch's grain size for elementwise ops */
#define MAX_HIDDEN_ON_STACK 8192

typedef union {
    uint32_t u;
    int32_t i;
    float f;
} bits32;

static inline float round_bf16(float v) { return duet_bf16_to_f32(duet_f32_to_bf16(v)); }

/* exp(x) in float32 within ~2 ulp (Cephes' expf: Cody-Waite reduction by ln 2, degree-6 polynomial),
 * branch-free; overflows to inf, underflows to 0 and passes NaN through, as expf. */
static inline float exp_f32(float x) {
    const float hi = 88.3762626647949f, lo = -87.3365447504f;
    float xc = x > hi ? hi : (x < lo ? lo : x);
    float n = floorf(xc * 1.44269504088896341f + 0.5f);
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    bits32 scale = {.i = ((int32_t)n + 127) << 23};
    y = y * scale.f;
    y = x > hi ? INFINITY : y;
    y = x < -103.972076f ? 0.0f : y;
    return x != x ? x : y;
}

#ifdef DUET_AVX512
/* The vector twins of the helpers above, 16 lanes; `keep` masks a row's tail. */
static inline __m512 load_bf16x16(const uint16_t *p, __mmask16 keep) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, p)), 16));
}

static inline __m256i f32x16_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc0)));
}

static inline __m512 round_bf16x16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f32x16_to_bf16(v)), 16));
}

/* exp_f32's 16-lane twin: the same reduction and polynomial. The clamp maps ±inf into range (max/min return
 * their second operand for NaN, so NaN passes) and vscalefps applies 2^n, saturating to inf above and 0 below. */
static inline __m512 exp_f32x16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

static inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u); }
#endif

#ifdef DUET_AVX2
/* exp_f32's 8-lane twin for CPUs without AVX-512: the same reduction and polynomial; 2^n applied as two exponent
 * multiplies (n in [-150, 128] after the clamp: each half a normal float), the inputs expf takes to 0 set to 0. */
static inline __m256 exp_f32x8(__m256 x) {
    __m256 xc = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 s2 = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    y = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-103.972076f), _CMP_LT_OQ), y);
}

/* lanes i < left set (all bits), as a mask for maskload / maskstore */
static inline __m256i tail_mask8(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left >= 8 ? 8 : (int)left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif

static void widen(const void *src, int64_t offset, float *dst, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = duet_bf16_to_f32(s[i]);
    } else {
        const float *s = (const float *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i];
    }
}

static void narrow(const float *src, void *dst, int64_t offset, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < n; i++) d[i] = duet_f32_to_bf16(src[i]);
    } else {
        float *d = (float *)dst + offset;
        for (int64_t i = 0; i < n; i++) d[i] = src[i];
    }
}

/* ---- RMSNorm, optionally after a residual add -------------------------------------------------------
 * x [T, H] (row stride x_stride, unit column stride), residual likewise or NULL, weight [H], out and
 * residual_out [T, H] contiguous.
 * fp32:  r = x + residual;  out = r * (1 / sqrt(mean(r²) + eps)) * weight
 * bf16:  r = bf16(x + residual);  out = bf16(weight * bf16(r * (1 / sqrt(mean(r²) + eps))))   (HF's order)
 * residual_out receives r when residual is given. */
void duet_add_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                       const void *weight, float eps, void *out, void *residual_out, int64_t rows,
                       int64_t hidden, int bf16) {
    if (!bf16) { /* float32 in place: no staging copies */
        const float *w = (const float *)weight;
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS / 2 && rows > 1)
        for (int64_t t = 0; t < rows; t++) {
            const float *restrict xr = (const float *)x + t * x_stride;
            float *restrict o = (float *)out + t * hidden;
            const float *src = xr;
            float sum = 0.0f;
            if (residual) {
                const float *restrict rr = (const float *)residual + t * residual_stride;
                float *restrict ro = (float *)residual_out + t * hidden;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < hidden; i++) {
                    float v = xr[i] + rr[i];
                    ro[i] = v;
                    sum += v * v;
                }
                src = ro;
            } else {
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < hidden; i++) sum += xr[i] * xr[i];
            }
            float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
            for (int64_t i = 0; i < hidden; i++) o[i] = src[i] * inv * w[i];
        }
        return;
    }
    float *w = malloc(sizeof(float) * hidden); /* the weight widened once, not per row */
    widen(weight, 0, w, hidden, 1);
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS / 2 && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        float stack_r[MAX_HIDDEN_ON_STACK], stack_y[MAX_HIDDEN_ON_STACK];
        int heap = hidden > MAX_HIDDEN_ON_STACK;
        float *r = heap ? malloc(sizeof(float) * 2 * hidden) : stack_r;
        float *y = heap ? r + hidden : stack_y;
        widen(x, t * x_stride, r, hidden, 1);
        if (residual) {
            widen(residual, t * residual_stride, y, hidden, 1);
            for (int64_t i = 0; i < hidden; i++) r[i] = round_bf16(r[i] + y[i]);
            narrow(r, residual_out, t * hidden, hidden, 1);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) sum += r[i] * r[i];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        for (int64_t i = 0; i < hidden; i++) y[i] = w[i] * round_bf16(r[i] * inv);
        narrow(y, out, t * hidden, hidden, 1);
        if (heap) free(r);
    }
    free(w);
}

/* ---- SwiGLU: out = silu(gate) * up, gate_up [T, 2I] (row stride gu_stride) -> out [T, I] -------------
 * silu(g) = g / (1 + exp(-g)) as torch; bf16 rounds silu's result, then the product, as the twin. */
void duet_silu_and_mul(const void *gate_up, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
#ifdef DUET_AVX512
        const __m512 one = _mm512_set1_ps(1.0f);
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + t * gu_stride, *u = g + inter;
            uint16_t *o = (uint16_t *)out + t * inter;
            for (int64_t i = 0; i < inter; i += 16) {
                __mmask16 keep = tail_mask(inter - i);
                __m512 gv = load_bf16x16(g + i, keep);
                __m512 sv = round_bf16x16(_mm512_div_ps(gv, _mm512_add_ps(one, exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), gv)))));
                _mm256_mask_storeu_epi16(o + i, keep, f32x16_to_bf16(_mm512_mul_ps(sv, load_bf16x16(u + i, keep))));
            }
        } else {
            const float *g = (const float *)gate_up + t * gu_stride, *u = g + inter;
            float *o = (float *)out + t * inter;
            for (int64_t i = 0; i < inter; i += 16) {
                __mmask16 keep = tail_mask(inter - i);
                __m512 gv = _mm512_maskz_loadu_ps(keep, g + i);
                __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
                _mm512_mask_storeu_ps(o + i, keep, _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(keep, u + i)));
            }
        }
#else
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + t * gu_stride, *u = g + inter;
            uint16_t *o = (uint16_t *)out + t * inter;
            for (int64_t i = 0; i < inter; i++) {
                float gv = duet_bf16_to_f32(g[i]);
                float s = round_bf16(gv / (1.0f + exp_f32(-gv)));
                o[i] = duet_f32_to_bf16(s * duet_bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + t * gu_stride, *u = g + inter;
            float *o = (float *)out + t * inter;
            for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        }
#endif
    }
}

/* ---- Rotary (rotate-half): out = x·cos + rotate_half(x)·sin, rotate_half(x) = [-x[half:], x[:half]] --
 * x [T, heads, D] (strides x_st, x_sh; unit last), cos/sin [T, D] contiguous in x's dtype, out
 * [T, heads, D] contiguous. bf16 rounds each product and the sum, as the twin. */
void duet_rotary(const void *x, int64_t x_st, int64_t x_sh, const void *cos_t, const void *sin_t, void *out,
                 int64_t tokens, int64_t heads, int64_t head_dim, int bf16) {
    int64_t half = head_dim / 2;
    if (!bf16) { /* float32 in place: no staging copies */
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS && tokens > 1)
        for (int64_t t = 0; t < tokens; t++) {
            const float *restrict c = (const float *)cos_t + t * head_dim, *restrict s = (const float *)sin_t + t * head_dim;
            for (int64_t h = 0; h < heads; h++) {
                const float *restrict v = (const float *)x + t * x_st + h * x_sh;
                float *restrict o = (float *)out + (t * heads + h) * head_dim;
                for (int64_t i = 0; i < half; i++) o[i] = v[i] * c[i] + -v[i + half] * s[i];
                for (int64_t i = half; i < head_dim; i++) o[i] = v[i] * c[i] + v[i - half] * s[i];
            }
        }
        return;
    }
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float c[512], s[512], v[512], o[512];
        if (head_dim > 512) abort(); /* the wrapper checks */
        widen(cos_t, t * head_dim, c, head_dim, 1);
        widen(sin_t, t * head_dim, s, head_dim, 1);
        for (int64_t h = 0; h < heads; h++) {
            widen(x, t * x_st + h * x_sh, v, head_dim, 1);
            for (int64_t i = 0; i < half; i++)
                o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]));
            for (int64_t i = half; i < head_dim; i++)
                o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(v[i - half] * s[i]));
            narrow(o, out, (t * heads + h) * head_dim, head_dim, 1);
        }
    }
}

/* ---- Rotary, then the step's K and V stored in the paged cache: the two in one call --------------------
 * x [T, heads, D] as duet_rotary, whose last kv_heads heads are K; v [T, kv_heads, D] (row stride v_st,
 * head stride D); out as duet_rotary; k_cache/v_cache [kv_heads, num_slots, D] contiguous (slot =
 * block * block_size + offset, the cache's head-major layout) receive each token's rotated K and its V at
 * slots[t]. Returns 0, or 1 + the index of the first slot outside [0, num_slots) (nothing is stored then). */
int64_t duet_rotary_store_kv(const void *x, int64_t x_st, int64_t x_sh, const void *cos_t, const void *sin_t,
                             void *out, const void *v, int64_t v_st, void *k_cache, void *v_cache,
                             const int64_t *slots, int64_t num_slots, int64_t tokens, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return 1 + t;
    duet_rotary(x, x_st, x_sh, cos_t, sin_t, out, tokens, heads, head_dim, bf16);
    size_t elem = bf16 ? 2 : 4, row_bytes = (size_t)head_dim * elem;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < kv_heads; h++) {
            size_t at = ((size_t)h * num_slots + slots[t]) * row_bytes;
            memcpy((char *)k_cache + at, (const char *)out + ((t * heads + heads - kv_heads + h) * head_dim) * elem,
                   row_bytes);
            memcpy((char *)v_cache + at, (const char *)v + (t * v_st + h * head_dim) * elem, row_bytes);
        }
    return 0;
}

/* ---- Paged decode attention: one query token per sequence over its cached context -------------------
 * q [B, heads, D] (strides q_sb, q_sh; unit last); k_cache/v_cache [kv_heads, num_blocks, block_size, D]
 * contiguous; block_ids [B * width] int64 (each sequence's table, padded); context_lens [B] int32 (read within
 * [0, width * block_size]: no length reads past its table); out [B, heads, D] contiguous. Query head j reads kv
 * head j / (heads / kv_heads).
 *
 * One task per (sequence, kv head): its `group` query heads share each K/V row read. The context is
 * walked in tiles of at most ATTN_TILE tokens, each within one cache block (rows contiguous in memory):
 *
 *     scores[j][i] = (scale · q_j) · k_i             group x n   (AVX-512: 4 heads share each K load)
 *     online softmax per head j: m_j = running max, l_j = running Σ exp(s - m_j), acc_j rescaled
 *     acc_j += Σ_i exp(scores[j][i] - m_j) · v_i     (AVX-512: 4 heads share each V load)
 *
 * and out_j = acc_j / l_j. float32 throughout (FMA); bf16 caches are widened a tile at a time and only
 * the output is rounded. */
#define MAX_GROUP 64
#define MAX_HEAD_DIM 512
#define ATTN_TILE 32

#ifdef DUET_AVX512
/* r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: a transposing tree of 15 add + 30 shuffle ops,
 * where 16 separate horizontal sums would take ~130. */
static inline __m512 sum_lanes_x16(const __m512 v[16]) {
    __m512 pairs[8], quads[4], octs[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [v2i, v2i+1, v2i, v2i+1] partials */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [v4i .. v4i+3] partials */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++) /* lanes [A0+A1, A2+A3, B0+B1, B2+B3] for quads A, B */
        octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88), _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}

/* scores[i] = q · k_i for i < n <= 16, one query head: 16 accumulators, no horizontal sum per token. Rows
 * past n repeat row n - 1 (never past the tile) and their lanes are not stored. */
static inline void tile_scores_x16(const float *q, const float *k, int64_t n, int64_t head_dim, float *scores) {
    __m512 acc[16];
    const float *rows[16];
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_setzero_ps();
        rows[i] = k + (i < n ? i : n - 1) * head_dim;
    }
    for (int64_t d = 0; d < head_dim; d += 16) {
        __m512 qv = _mm512_loadu_ps(q + d);
        for (int i = 0; i < 16; i++) acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(rows[i] + d), acc[i]);
    }
    _mm512_mask_storeu_ps(scores, tail_mask(n), sum_lanes_x16(acc));
}

/* acc[h] += Σ_i probs[h][i] · v_i for `nh` (1..4, a constant after inlining) heads over 64 dims at d: 16
 * independent FMA chains, each V load feeding nh of them. */
static inline __attribute__((always_inline)) void tile_accumulate_x64(const float *probs, int nh, const float *v,
                                                                      int64_t n, int64_t head_dim, float *acc) {
    __m512 a[4][4];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm512_loadu_ps(acc + h * head_dim + 16 * c);
    for (int64_t i = 0; i < n; i++) {
        const float *vr = v + i * head_dim;
        __m512 vv[4] = {_mm512_loadu_ps(vr), _mm512_loadu_ps(vr + 16), _mm512_loadu_ps(vr + 32),
                        _mm512_loadu_ps(vr + 48)};
        for (int h = 0; h < nh; h++) {
            __m512 p = _mm512_set1_ps(probs[h * ATTN_TILE + i]);
            for (int c = 0; c < 4; c++) a[h][c] = _mm512_fmadd_ps(p, vv[c], a[h][c]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + h * head_dim + 16 * c, a[h][c]);
}
#endif

#ifdef DUET_AVX2
/* The AVX2 forms of the two tiles above, for CPUs without AVX-512: 8 tokens' scores at once (8 accumulators, one
 * transposing tree of 6 hadd + 2 permute + 1 add for their sums), and the weighted sum over 32 dims of 1-2 heads
 * (8 accumulators: 4 V loads feed 2 heads). The plain loops below sum each token's dot product alone (a horizontal
 * sum through the stack a token) and add each V row into acc in memory: decode attention was ~14 % of a Zen 3's
 * batch-1 step at a ~300-token context. */
static inline __m256 sum_lanes_x8(const __m256 v[8]) {
    __m256 p0 = _mm256_hadd_ps(v[0], v[1]), p1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 p2 = _mm256_hadd_ps(v[4], v[5]), p3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 q0 = _mm256_hadd_ps(p0, p1), q1 = _mm256_hadd_ps(p2, p3); /* per 128-bit lane: v0..v3 | v4..v7 partials */
    return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

/* scores[i] = q · k_i for i < n <= 8, one query head; rows past n repeat row n - 1 and are not stored */
static inline void tile_scores_x8(const float *q, const float *k, int64_t n, int64_t head_dim, float *scores) {
    __m256 acc[8];
    const float *rows[8];
    for (int i = 0; i < 8; i++) {
        acc[i] = _mm256_setzero_ps();
        rows[i] = k + (i < n ? i : n - 1) * head_dim;
    }
    for (int64_t d = 0; d < head_dim; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(rows[i] + d), acc[i]);
    }
    _mm256_storeu_ps(scores, sum_lanes_x8(acc)); /* lanes past n too: a tile's scores have ATTN_TILE places */
}

/* acc[h] += Σ_i probs[h][i] · v_i for `nh` (1 or 2, a constant after inlining) heads over 32 dims at d */
static inline __attribute__((always_inline)) void tile_accumulate_x32(const float *probs, int nh, const float *v,
                                                                      int64_t n, int64_t head_dim, float *acc) {
    __m256 a[2][4];
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 4; c++) a[h][c] = _mm256_loadu_ps(acc + h * head_dim + 8 * c);
    for (int64_t i = 0; i < n; i++) {
        const float *vr = v + i * head_dim;
        __m256 vv[4] = {_mm256_loadu_ps(vr), _mm256_loadu_ps(vr + 8), _mm256_loadu_ps(vr + 16),
                        _mm256_loadu_ps(vr + 24)};
        for (int h = 0; h < nh; h++) {
            __m256 p = _mm256_set1_ps(probs[h * ATTN_TILE + i]);
            for (int c = 0; c < 4; c++) a[h][c] = _mm256_fmadd_ps(p, vv[c], a[h][c]);
        }
    }
    for (int h = 0; h < nh; h++)
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(acc + h * head_dim + 8 * c, a[h][c]);
}
#endif

static void attention_tile_scores(const float *q, int64_t group, const float *k, int64_t n, int64_t head_dim,
                                  float *scores) {
#ifdef DUET_AVX512
    if (head_dim % 16 == 0) {
        for (int64_t j = 0; j < group; j++)
            for (int64_t i = 0; i < n; i += 16)
                tile_scores_x16(q + j * head_dim, k + i * head_dim, n - i < 16 ? n - i : 16, head_dim,
                                scores + j * ATTN_TILE + i);
        return;
    }
#endif
#ifdef DUET_AVX2
    if (head_dim % 8 == 0) {
        for (int64_t j = 0; j < group; j++)
            for (int64_t i = 0; i < n; i += 8)
                tile_scores_x8(q + j * head_dim, k + i * head_dim, n - i < 8 ? n - i : 8, head_dim,
                               scores + j * ATTN_TILE + i);
        return;
    }
#endif
    for (int64_t j = 0; j < group; j++) {
        const float *qj = q + j * head_dim;
        for (int64_t i = 0; i < n; i++) {
            const float *kr = k + i * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++) dot = fmaf(qj[d], kr[d], dot);
            scores[j * ATTN_TILE + i] = dot;
        }
    }
}

static void attention_tile_accumulate(const float *probs, int64_t group, const float *v, int64_t n,
                                      int64_t head_dim, float *acc) {
#ifdef DUET_AVX512
    if (head_dim % 64 == 0) {
        for (int64_t j = 0; j < group; j += 4)
            for (int64_t d = 0; d < head_dim; d += 64) {
                const float *pj = probs + j * ATTN_TILE;
                float *aj = acc + j * head_dim + d;
                switch (group - j) {
                case 1: tile_accumulate_x64(pj, 1, v + d, n, head_dim, aj); break;
                case 2: tile_accumulate_x64(pj, 2, v + d, n, head_dim, aj); break;
                case 3: tile_accumulate_x64(pj, 3, v + d, n, head_dim, aj); break;
                default: tile_accumulate_x64(pj, 4, v + d, n, head_dim, aj); break;
                }
            }
        return;
    }
#endif
#ifdef DUET_AVX2
    if (head_dim % 32 == 0) {
        for (int64_t j = 0; j < group; j += 2)
            for (int64_t d = 0; d < head_dim; d += 32) {
                if (group - j == 1)
                    tile_accumulate_x32(probs + j * ATTN_TILE, 1, v + d, n, head_dim, acc + j * head_dim + d);
                else
                    tile_accumulate_x32(probs + j * ATTN_TILE, 2, v + d, n, head_dim, acc + j * head_dim + d);
            }
        return;
    }
#endif
    for (int64_t j = 0; j < group; j++) {
        float *a = acc + j * head_dim;
        for (int64_t i = 0; i < n; i++) {
            float p = probs[j * ATTN_TILE + i];
            const float *vr = v + i * head_dim;
            for (int64_t d = 0; d < head_dim; d++) a[d] = fmaf(p, vr[d], a[d]);
        }
    }
}

/* One tile's online-softmax update for head j: scores s[0..n) become exp(s - m_new) in place; returns
 * alpha = exp(m_old - m_new), the factor for what was accumulated before (0 on the first tile). */
static inline float softmax_tile(float *s, int64_t n, float *m, float *l) {
    float tile_max = -INFINITY, total = 0.0f;
#ifdef DUET_AVX512
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 keep = tail_mask(n - i);
        float part = _mm512_mask_reduce_max_ps(keep, _mm512_maskz_loadu_ps(keep, s + i));
        tile_max = part > tile_max ? part : tile_max;
    }
#elif defined(DUET_AVX2)
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 8) { /* max_ps(v, vmax) keeps vmax where v is NaN, as the plain loop skips it */
        __m256i keep = tail_mask8(n - i);
        __m256 v = _mm256_maskload_ps(s + i, keep);
        vmax = _mm256_max_ps(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, _mm256_castsi256_ps(keep)), vmax);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    tile_max = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
    for (int64_t i = 0; i < n; i++) tile_max = s[i] > tile_max ? s[i] : tile_max;
#endif
    float m_new = tile_max > *m ? tile_max : *m;
#ifdef DUET_AVX512
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 keep = tail_mask(n - i);
        __m512 e = exp_f32x16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s + i), _mm512_set1_ps(m_new)));
        _mm512_mask_storeu_ps(s + i, keep, e);
        total += _mm512_mask_reduce_add_ps(keep, e);
    }
#elif defined(DUET_AVX2)
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) {
        __m256i keep = tail_mask8(n - i);
        __m256 e = exp_f32x8(_mm256_sub_ps(_mm256_maskload_ps(s + i, keep), _mm256_set1_ps(m_new)));
        _mm256_maskstore_ps(s + i, keep, e);
        sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_castsi256_ps(keep)));
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    total = _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
#else
    for (int64_t i = 0; i < n; i++) s[i] = exp_f32(s[i] - m_new);
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; i++) total += s[i];
#endif
    float alpha = exp_f32(*m - m_new);
    *l = *l * alpha + total;
    *m = m_new;
    return alpha;
}

/* The tile that starts at context token `start`: returns its token count (within one cache block, at most
 * ATTN_TILE, not past len) and sets *row to the cache offset, in elements, of its first token's K (and V). */
static inline int64_t attention_tile(const int64_t *table, int64_t start, int64_t len, int64_t kvh, int64_t num_blocks,
                                     int64_t block_size, int64_t head_dim, int64_t *row) {
    int64_t offset = start % block_size, n = block_size - offset;
    n = n < ATTN_TILE ? n : ATTN_TILE;
    n = n < len - start ? n : len - start;
    *row = ((kvh * num_blocks + table[start / block_size]) * block_size + offset) * head_dim;
    return n;
}

/* Why: a decode step's K/V rows come from DRAM (the layer's weights streamed through the caches since they were
 * last read), a cache block at a time, and the tile walk depends on each load: at short contexts the walk waits on
 * memory latency (a 48-token context took 21 us cold, 4.5 us from cache). Prefetching the rows of the tokens in
 * [from, to) lets those loads overlap; the walk keeps ATTN_PREFETCH_TOKENS ahead of itself. */
#define ATTN_PREFETCH_TOKENS 128

static void prefetch_kv_rows(const int64_t *table, int64_t from, int64_t to, int64_t kvh, int64_t num_blocks,
                             int64_t block_size, int64_t head_dim, const void *k_cache, const void *v_cache,
                             int64_t esize) {
    for (int64_t start = from, n, row; start < to; start += n) {
        n = attention_tile(table, start, to, kvh, num_blocks, block_size, head_dim, &row);
        const char *k = (const char *)k_cache + row * esize, *v = (const char *)v_cache + row * esize;
        for (int64_t byte = 0; byte < n * head_dim * esize; byte += 64) {
            __builtin_prefetch(k + byte);
            __builtin_prefetch(v + byte);
        }
    }
}

/* Per thread: scaled queries, accumulators, one tile's scores, and (bf16) the widened K and V tile */
typedef struct {
    float *qf, *acc, *scores, *k_wide, *v_wide;
    float m[MAX_GROUP], l[MAX_GROUP]; /* each query head's running max and sum of exp */
} attention_work;

/* One (sequence b, kv head) task over context tokens [from, to): work->acc holds Σ exp(s - m) v (not yet divided
 * by l), work->m and work->l the online softmax state; m = -inf and l = 0 for an empty range. */
static void attend_range(const void *q, int64_t q_sb, int64_t q_sh, const void *k_cache, const void *v_cache,
                         const int64_t *table, int64_t b, int64_t kvh, int64_t from, int64_t to, int64_t group,
                         int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int bf16,
                         attention_work *work) {
    float *qf = work->qf, *acc = work->acc, *scores = work->scores;
    for (int64_t j = 0; j < group; j++) {
        widen(q, b * q_sb + (kvh * group + j) * q_sh, qf + j * head_dim, head_dim, bf16);
        for (int64_t d = 0; d < head_dim; d++) qf[j * head_dim + d] *= scale;
        work->m[j] = -INFINITY;
        work->l[j] = 0.0f;
    }
    for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
    int64_t row, esize = bf16 ? 2 : 4, ahead = to - from < ATTN_PREFETCH_TOKENS ? to : from + ATTN_PREFETCH_TOKENS;
    prefetch_kv_rows(table, from, ahead, kvh, num_blocks, block_size, head_dim, k_cache, v_cache, esize);
    for (int64_t start = from, n; start < to; start += n) {
        n = attention_tile(table, start, to, kvh, num_blocks, block_size, head_dim, &row);
        int64_t next = start + n + ATTN_PREFETCH_TOKENS < to ? start + n + ATTN_PREFETCH_TOKENS : to;
        if (next > ahead) { /* keep ATTN_PREFETCH_TOKENS ahead */
            prefetch_kv_rows(table, ahead, next, kvh, num_blocks, block_size, head_dim, k_cache, v_cache, esize);
            ahead = next;
        }
        const float *k, *v;
        if (bf16) {
            widen(k_cache, row, work->k_wide, n * head_dim, 1);
            widen(v_cache, row, work->v_wide, n * head_dim, 1);
            k = work->k_wide;
            v = work->v_wide;
        } else {
            k = (const float *)k_cache + row;
            v = (const float *)v_cache + row;
        }
        attention_tile_scores(qf, group, k, n, head_dim, scores);
        for (int64_t j = 0; j < group; j++) {
            float alpha = softmax_tile(scores + j * ATTN_TILE, n, &work->m[j], &work->l[j]);
            if (alpha != 1.0f)
                for (int64_t d = 0; d < head_dim; d++) acc[j * head_dim + d] *= alpha;
        }
        attention_tile_accumulate(scores, group, v, n, head_dim, acc);
    }
}

/* Splitting a context (flash-decoding): when there are fewer (sequence, kv head) tasks than twice the threads, as at
 * batch 1 (three kv heads on two threads: one thread idle a third of the time), each context of at least
 * 2 x SPLIT_MIN_TOKENS is cut into ranges whose softmax states are merged after: out = Σ_s e^(m_s - M) acc_s / Σ_s
 * e^(m_s - M) l_s, M = max_s m_s. */
#define SPLIT_MIN_TOKENS 64

static int64_t context_splits(int64_t tasks, int64_t max_len) {
    int64_t threads = 1;
#if defined(_OPENMP)
    threads = omp_get_max_threads();
#endif
    if (tasks >= 2 * threads || max_len < 2 * SPLIT_MIN_TOKENS) return 1;
    int64_t splits = (2 * threads + tasks - 1) / tasks;
    return splits < max_len / SPLIT_MIN_TOKENS ? splits : max_len / SPLIT_MIN_TOKENS;
}

void duet_decode_attention(const void *q, int64_t q_sb, int64_t q_sh, const void *k_cache, const void *v_cache,
                           const int64_t *block_ids, const int32_t *context_lens, void *out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t width, float scale, int bf16) {
    int64_t group = heads / kv_heads;
    int64_t max_len = width * block_size, tasks = batch * kv_heads, splits = context_splits(tasks, max_len);
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) abort(); /* the wrapper checks */
    /* split contexts: each range's m [group], l [group] and acc [group * head_dim] */
    int64_t part_floats = group * (2 + head_dim);
    float *parts = splits > 1 ? malloc(sizeof(float) * (size_t)(tasks * splits * part_floats)) : NULL;
#pragma omp parallel if (tasks * splits > 1)
    {
        attention_work work;
        work.qf = malloc(sizeof(float) * (2 * group * head_dim + group * ATTN_TILE +
                                          (bf16 ? 2 * ATTN_TILE * head_dim : 0)));
        work.acc = work.qf + group * head_dim, work.scores = work.acc + group * head_dim;
        work.k_wide = work.scores + group * ATTN_TILE, work.v_wide = work.k_wide + ATTN_TILE * head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks * splits; task++) {
            int64_t b = task / splits / kv_heads, kvh = task / splits % kv_heads, split = task % splits;
            int64_t len = context_lens[b] < 0 ? 0 : context_lens[b] < max_len ? context_lens[b] : max_len;
            int64_t from = len * split / splits, to = len * (split + 1) / splits;
            attend_range(q, q_sb, q_sh, k_cache, v_cache, block_ids + b * width, b, kvh, from, to, group, head_dim,
                         num_blocks, block_size, scale, bf16, &work);
            if (splits > 1) {
                float *part = parts + task * part_floats;
                memcpy(part, work.m, sizeof(float) * group);
                memcpy(part + group, work.l, sizeof(float) * group);
                memcpy(part + 2 * group, work.acc, sizeof(float) * group * head_dim);
                continue;
            }
            for (int64_t j = 0; j < group; j++) {
                float norm = work.l[j] > 0.0f ? 1.0f / work.l[j] : 0.0f; /* an empty context writes zeros */
                float *a = work.acc + j * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] *= norm;
                narrow(a, out, (b * heads + kvh * group + j) * head_dim, head_dim, bf16);
            }
        }
        if (splits > 1) { /* after the loop's barrier: every range is done */
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < tasks * group; bh++) { /* one query head of one sequence: its ranges merged */
                int64_t t = bh / group, j = bh % group;
                const float *first = parts + t * splits * part_floats;
                float top = -INFINITY, total = 0.0f, *a = work.acc;
                for (int64_t s = 0; s < splits; s++) top = fmaxf(top, first[s * part_floats + j]);
                for (int64_t d = 0; d < head_dim; d++) a[d] = 0.0f;
                for (int64_t s = 0; s < splits && top > -INFINITY; s++) {
                    const float *part = first + s * part_floats;
                    float weight = part[j] > -INFINITY ? exp_f32(part[j] - top) : 0.0f;
                    total += weight * part[group + j];
                    for (int64_t d = 0; d < head_dim; d++) a[d] += weight * part[2 * group + j * head_dim + d];
                }
                float norm = total > 0.0f ? 1.0f / total : 0.0f; /* an empty context writes zeros */
                for (int64_t d = 0; d < head_dim; d++) a[d] *= norm;
                narrow(a, out, ((t / kv_heads) * heads + (t % kv_heads) * group + j) * head_dim, head_dim, bf16);
            }
        }
        free(work.qf);
    }
    free(parts);
}

/* ---- greedy sampling ----
 * out[r] = the index of row r's first maximum of x [rows, n] (row stride ldx), a NaN counting as the maximum (the
 * first NaN wins): torch.argmax's answer. Why in C: torch's CPU argmax runs at ~1 ns an element and the sampler's
 * two-level torch version costs ~0.15 ms a decode step of a 49152-token vocabulary in its five small ops; one
 * pass here reads the row once at cache speed. */
static int64_t argmax_plain(const float *x, int64_t start, int64_t n, int64_t best) {
    for (int64_t i = start; i < n; i++) {
        if (x[i] != x[i]) return i;
        if (x[i] > x[best]) best = i;
    }
    return best;
}

#ifdef DUET_AVX512
/* Per lane of two vectors: the largest value seen and its first index (a strictly greater value moves it) */
typedef struct { __m512 best[2]; __m512i index[2]; } argmax_lanes;
#endif

static int64_t argmax_row(const float *x, int64_t n) {
    if (x[0] != x[0]) return 0;
#ifdef DUET_AVX512
    if (n >= 64 && n <= INT32_MAX) {
        __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i next[2] = {index, _mm512_add_epi32(index, _mm512_set1_epi32(16))}, step = _mm512_set1_epi32(32);
        argmax_lanes a = {{_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)}, {next[0], next[1]}};
        int64_t i = 32;
        __mmask16 nan = _mm512_cmp_ps_mask(a.best[0], a.best[0], _CMP_UNORD_Q) |
                        _mm512_cmp_ps_mask(a.best[1], a.best[1], _CMP_UNORD_Q);
        for (; !nan && i + 32 <= n; i += 32) {
            __m512 v[2] = {_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i + 16)};
            nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q);
            if (nan) break; /* the plain scan below finds the first NaN */
            for (int h = 0; h < 2; h++) {
                next[h] = _mm512_add_epi32(next[h], step);
                __mmask16 greater = _mm512_cmp_ps_mask(v[h], a.best[h], _CMP_GT_OQ);
                a.best[h] = _mm512_mask_mov_ps(a.best[h], greater, v[h]);
                a.index[h] = _mm512_mask_mov_epi32(a.index[h], greater, next[h]);
            }
        }
        if (i > 32 || !nan) { /* [0, i) holds no NaN: its first maximum, then the plain scan from i */
            __mmask16 second = _mm512_cmp_ps_mask(a.best[1], a.best[0], _CMP_GT_OQ) |
                               (_mm512_cmp_ps_mask(a.best[1], a.best[0], _CMP_EQ_OQ) &
                                _mm512_cmp_epi32_mask(a.index[1], a.index[0], _MM_CMPINT_LT));
            __m512 best = _mm512_mask_mov_ps(a.best[0], second, a.best[1]);
            __m512i best_index = _mm512_mask_mov_epi32(a.index[0], second, a.index[1]);
            float top = _mm512_reduce_max_ps(best);
            __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
            return argmax_plain(x, i, n, _mm512_mask_reduce_min_epi32(at_top, best_index));
        }
    }
#elif defined(DUET_AVX2)
    if (n >= 32 && n <= INT32_MAX) { /* the AVX-512 loop at 8 lanes: four vectors a step (the plain scan: 65 us for
                                        a 49152-token vocabulary on a Zen 3, 10 here) */
        __m256i next[4], step = _mm256_set1_epi32(32);
        __m256 best[4];
        __m256i index[4];
        __m256 nan = _mm256_setzero_ps();
        for (int h = 0; h < 4; h++) {
            next[h] = index[h] = _mm256_setr_epi32(8 * h, 8 * h + 1, 8 * h + 2, 8 * h + 3, 8 * h + 4, 8 * h + 5,
                                                   8 * h + 6, 8 * h + 7);
            best[h] = _mm256_loadu_ps(x + 8 * h);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[h], best[h], _CMP_UNORD_Q));
        }
        int64_t i = 32;
        for (; _mm256_testz_ps(nan, nan) && i + 32 <= n; i += 32) {
            __m256 v[4];
            for (int h = 0; h < 4; h++) {
                v[h] = _mm256_loadu_ps(x + i + 8 * h);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q));
            }
            if (!_mm256_testz_ps(nan, nan)) break; /* the plain scan below finds the first NaN */
            for (int h = 0; h < 4; h++) {
                next[h] = _mm256_add_epi32(next[h], step);
                __m256 greater = _mm256_cmp_ps(v[h], best[h], _CMP_GT_OQ);
                best[h] = _mm256_blendv_ps(best[h], v[h], greater);
                index[h] = _mm256_castps_si256(
                    _mm256_blendv_ps(_mm256_castsi256_ps(index[h]), _mm256_castsi256_ps(next[h]), greater));
            }
        }
        if (i > 32 || _mm256_testz_ps(nan, nan)) { /* [0, i) holds no NaN: its first maximum, then the plain scan */
            float lanes[32];
            int32_t at[32];
            for (int h = 0; h < 4; h++) {
                _mm256_storeu_ps(lanes + 8 * h, best[h]);
                _mm256_storeu_si256((__m256i *)(at + 8 * h), index[h]);
            }
            int64_t first = at[0];
            for (int l = 1; l < 32; l++)
                if (lanes[l] > x[first] || (lanes[l] == x[first] && at[l] < first)) first = at[l];
            return argmax_plain(x, i, n, first);
        }
    }
#endif
    return argmax_plain(x, 1, n, 0);
}

void duet_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n >= 16 * PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; r++) out[r] = n > 0 ? argmax_row(x + r * ldx, n) : 0;
}
