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
 * punning through a union). Threads: OpenMP, which binds to the libgomp torch already loaded (same
 * soname), so torch.set_num_threads applies; a kernel parallelizes only with enough work for a barrier.
 */

#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define PARALLEL_MIN_ELEMENTS 32768 /* as torch's grain size for elementwise ops */
#define MAX_HIDDEN_ON_STACK 8192

typedef union {
    uint32_t u;
    int32_t i;
    float f;
} bits32;

static inline float bf16_to_f32(uint16_t h) {
    bits32 b = {.u = (uint32_t)h << 16};
    return b.f;
}

static inline uint16_t f32_to_bf16(float f) {
    bits32 b = {.f = f};
    uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16;
    return (b.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

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

static void widen(const void *src, int64_t offset, float *dst, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        const float *s = (const float *)src + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i];
    }
}

static void narrow(const float *src, void *dst, int64_t offset, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + offset;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
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
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_ELEMENTS && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        float stack_r[MAX_HIDDEN_ON_STACK], stack_w[MAX_HIDDEN_ON_STACK], stack_y[MAX_HIDDEN_ON_STACK];
        int heap = hidden > MAX_HIDDEN_ON_STACK;
        float *r = heap ? malloc(sizeof(float) * 3 * hidden) : stack_r;
        float *w = heap ? r + hidden : stack_w, *y = heap ? r + 2 * hidden : stack_y;
        widen(x, t * x_stride, r, hidden, bf16);
        widen(weight, 0, w, hidden, bf16);
        if (residual) {
            widen(residual, t * residual_stride, y, hidden, bf16);
            if (bf16)
                for (int64_t i = 0; i < hidden; i++) r[i] = round_bf16(r[i] + y[i]);
            else
                for (int64_t i = 0; i < hidden; i++) r[i] = r[i] + y[i];
            narrow(r, residual_out, t * hidden, hidden, bf16);
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < hidden; i++) sum += r[i] * r[i];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        if (bf16)
            for (int64_t i = 0; i < hidden; i++) y[i] = w[i] * round_bf16(r[i] * inv);
        else
            for (int64_t i = 0; i < hidden; i++) y[i] = r[i] * inv * w[i];
        narrow(y, out, t * hidden, hidden, bf16);
        if (heap) free(r);
    }
}

/* ---- SwiGLU: out = silu(gate) * up, gate_up [T, 2I] (row stride gu_stride) -> out [T, I] -------------
 * silu(g) = g / (1 + exp(-g)) as torch; bf16 rounds silu's result, then the product, as the twin. */
void duet_silu_and_mul(const void *gate_up, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16) {
#pragma omp parallel for schedule(static) if (rows * inter >= PARALLEL_MIN_ELEMENTS && rows > 1)
    for (int64_t t = 0; t < rows; t++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + t * gu_stride, *u = g + inter;
            uint16_t *o = (uint16_t *)out + t * inter;
            for (int64_t i = 0; i < inter; i++) {
                float gv = bf16_to_f32(g[i]);
                float s = round_bf16(gv / (1.0f + exp_f32(-gv)));
                o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + t * gu_stride, *u = g + inter;
            float *o = (float *)out + t * inter;
            for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_f32(-g[i])) * u[i];
        }
    }
}

/* ---- Rotary (rotate-half): out = x·cos + rotate_half(x)·sin, rotate_half(x) = [-x[half:], x[:half]] --
 * x [T, heads, D] (strides x_st, x_sh; unit last), cos/sin [T, D] contiguous in x's dtype, out
 * [T, heads, D] contiguous. bf16 rounds each product and the sum, as the twin. */
void duet_rotary(const void *x, int64_t x_st, int64_t x_sh, const void *cos_t, const void *sin_t, void *out,
                 int64_t tokens, int64_t heads, int64_t head_dim, int bf16) {
    int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMENTS && tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        float c[512], s[512], v[512], o[512];
        if (head_dim > 512) abort(); /* the wrapper checks */
        widen(cos_t, t * head_dim, c, head_dim, bf16);
        widen(sin_t, t * head_dim, s, head_dim, bf16);
        for (int64_t h = 0; h < heads; h++) {
            widen(x, t * x_st + h * x_sh, v, head_dim, bf16);
            if (bf16) {
                for (int64_t i = 0; i < half; i++)
                    o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(-v[i + half] * s[i]));
                for (int64_t i = half; i < head_dim; i++)
                    o[i] = round_bf16(round_bf16(v[i] * c[i]) + round_bf16(v[i - half] * s[i]));
            } else {
                for (int64_t i = 0; i < half; i++) o[i] = v[i] * c[i] + -v[i + half] * s[i];
                for (int64_t i = half; i < head_dim; i++) o[i] = v[i] * c[i] + v[i - half] * s[i];
            }
            narrow(o, out, (t * heads + h) * head_dim, head_dim, bf16);
        }
    }
}

/* ---- Paged decode attention: one query token per sequence over its cached context -------------------
 * q [B, heads, D] (strides q_sb, q_sh; unit last); k_cache/v_cache [kv_heads, num_blocks, block_size, D]
 * contiguous; block_ids [B * width] int64 (each sequence's table, padded); mask [B, width * block_size]
 * float32, 0 over the context and -inf past it (a row's context length is its count of zeros);
 * out [B, heads, D] contiguous. Query head j reads kv head j / (heads / kv_heads). Scores, softmax and the
 * weighted sum are float32 throughout (FMA); bf16 rounds only the output. One task per (sequence, kv
 * head): its query heads share each K/V row read. */
#define MAX_GROUP 64
#define MAX_HEAD_DIM 512

void duet_decode_attention(const void *q, int64_t q_sb, int64_t q_sh, const void *k_cache, const void *v_cache,
                           const int64_t *block_ids, const float *mask, void *out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t width, float scale, int bf16) {
    int64_t group = heads / kv_heads;
    int64_t max_len = width * block_size;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM) abort(); /* the wrapper checks */
#pragma omp parallel for schedule(dynamic, 1) if (batch * kv_heads > 1)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        int64_t b = task / kv_heads, kvh = task % kv_heads;
        int64_t len = 0;
        for (int64_t t = 0; t < max_len; t++) len += mask[b * max_len + t] == 0.0f;
        float row[MAX_HEAD_DIM];
        float *qf = malloc(sizeof(float) * (2 * group * head_dim + group * (len > 0 ? len : 1)));
        float *acc = qf + group * head_dim, *scores = acc + group * head_dim;
        for (int64_t j = 0; j < group; j++) {
            widen(q, b * q_sb + (kvh * group + j) * q_sh, qf + j * head_dim, head_dim, bf16);
            for (int64_t d = 0; d < head_dim; d++) qf[j * head_dim + d] *= scale;
        }
        for (int64_t t = 0; t < len; t++) {
            int64_t at = ((kvh * num_blocks + block_ids[b * width + t / block_size]) * block_size + t % block_size) *
                         head_dim;
            widen(k_cache, at, row, head_dim, bf16);
            for (int64_t j = 0; j < group; j++) {
                const float *qj = qf + j * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot = fmaf(qj[d], row[d], dot);
                scores[j * len + t] = dot;
            }
        }
        for (int64_t j = 0; j < group; j++) {
            float *s = scores + j * len;
            float m = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
            for (int64_t t = 0; t < len; t++) s[t] = exp_f32(s[t] - m);
            for (int64_t t = 0; t < len; t++) total += s[t];
            float norm = len > 0 ? 1.0f / total : 0.0f;
            for (int64_t t = 0; t < len; t++) s[t] *= norm;
        }
        for (int64_t i = 0; i < group * head_dim; i++) acc[i] = 0.0f;
        for (int64_t t = 0; t < len; t++) {
            int64_t at = ((kvh * num_blocks + block_ids[b * width + t / block_size]) * block_size + t % block_size) *
                         head_dim;
            widen(v_cache, at, row, head_dim, bf16);
            for (int64_t j = 0; j < group; j++) {
                float p = scores[j * len + t];
                float *a = acc + j * head_dim;
                for (int64_t d = 0; d < head_dim; d++) a[d] = fmaf(p, row[d], a[d]);
            }
        }
        for (int64_t j = 0; j < group; j++)
            narrow(acc + j * head_dim, out, (b * heads + kvh * group + j) * head_dim, head_dim, bf16);
        free(qf);
    }
}

/* ---- bf16 GEMV: y = x · wᵀ + bias for one row x [K], w [N, K] bf16 row-major, bias [N] or NULL -------
 * Accumulates in float32 (products of bf16 values are exact in float32), adds the bias, rounds y to bf16
 * once. One stream over w: each thread takes whole groups of GEMV_ROWS rows and prefetches the group
 * after next, which keeps DRAM busy (torch's bf16 GEMV runs at ~11 GB/s here, oneDNN's ~14, this ~17).
 * With AVX-512 a 64-byte load holds 32 bf16 values; shifting and masking its 32-bit lanes gives the even
 * and the odd elements as float32, which multiply x's even and odd elements (deinterleaved once). */
#define GEMV_ROWS 8

static float gemv_row_scalar(const float *x, const uint16_t *w, int64_t from, int64_t to) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = from; k < to; k++) s += x[k] * bf16_to_f32(w[k]);
    return s;
}

void duet_gemv_bf16(const uint16_t *x_bf16, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t n_out,
                    int64_t k_in) {
    float *x = malloc(sizeof(float) * 2 * (k_in + 32));
    for (int64_t k = 0; k < k_in; k++) x[k] = bf16_to_f32(x_bf16[k]);
    int64_t groups = (n_out + GEMV_ROWS - 1) / GEMV_ROWS;
#ifdef __AVX512F__
    int64_t k32 = k_in / 32 * 32;
    float *xs = (float *)(((uintptr_t)(x + k_in) + 63) & ~(uintptr_t)63); /* deinterleaved, 64-byte aligned */
    for (int64_t k = 0; k < k32; k += 32)
        for (int i = 0; i < 16; i++) {
            xs[k + i] = x[k + 2 * i];
            xs[k + 16 + i] = x[k + 2 * i + 1];
        }
#endif
#pragma omp parallel for schedule(static) if (n_out * k_in >= 4 * PARALLEL_MIN_ELEMENTS)
    for (int64_t g = 0; g < groups; g++) {
        int64_t n0 = g * GEMV_ROWS, rows = n_out - n0 < GEMV_ROWS ? n_out - n0 : GEMV_ROWS;
        float sums[GEMV_ROWS];
#ifdef __AVX512F__
        if (rows == GEMV_ROWS) {
            __m512 acc[GEMV_ROWS];
            const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
            for (int r = 0; r < GEMV_ROWS; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t k = 0; k < k32; k += 32) {
                __m512 x_even = _mm512_load_ps(xs + k), x_odd = _mm512_load_ps(xs + k + 16);
                for (int r = 0; r < GEMV_ROWS; r++) {
                    const uint16_t *row = w + (n0 + r) * k_in + k;
                    __m512i v = _mm512_loadu_si512((const void *)row);
                    _mm_prefetch((const char *)(row + 2 * GEMV_ROWS * k_in), _MM_HINT_T0);
                    acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), x_even, acc[r]);
                    acc[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, odd)), x_odd, acc[r]);
                }
            }
            for (int r = 0; r < GEMV_ROWS; r++)
                sums[r] = _mm512_reduce_add_ps(acc[r]) + gemv_row_scalar(x, w + (n0 + r) * k_in, k32, k_in);
        } else
#endif
            for (int r = 0; r < rows; r++) sums[r] = gemv_row_scalar(x, w + (n0 + r) * k_in, 0, k_in);
        for (int r = 0; r < rows; r++) y[n0 + r] = f32_to_bf16(sums[r] + (bias ? bf16_to_f32(bias[n0 + r]) : 0.0f));
    }
    free(x);
}
