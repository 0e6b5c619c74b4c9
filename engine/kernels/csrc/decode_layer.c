/* One decoder layer of a decode step in one call: engine/model.py's DecoderLayer.forward for `rows` single-token
 * sequences, as the library's kernels compute each part (cpu_kernels.c, quant_kernels.c), with every weight's
 * pointers bound once (engine/fused_decode.py builds the structs). Why: called op by op from Python, a layer pays
 * ~0.2-0.3 ms of wrappers (tensor checks, allocations, ctypes conversions) around ~0.3 ms of kernels at batch 1;
 * here it pays one call. The plain model's forward is the reference (tests/test_fused_decode.py).
 *
 *   x --add_rms_norm(residual)--> xn --qkv--> [q | k | v] --rotary + K/V store--> qk --decode attention--> attn
 *     --o_proj--> o --add_rms_norm(residual')--> xn2 --gate_up--> gu --silu * up--> act --down--> out
 *
 * Activations float32 or bfloat16 (`bf16`), rows contiguous; the linears are quantized (int4 / int8, float or
 * int8 activations, the layout of engine/quant_format.py) or dense weights of the activations' dtype through the
 * few-row GEMVs of gemv.c (engine/linear_fast.py's `gemv`: up to GEMV_MAX_ROWS rows a call). */

#include <stdint.h>
#include <string.h>

#include "bf16.h"

void duet_add_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                       const void *weight, float eps, void *out, void *residual_out, int64_t rows, int64_t hidden,
                       int bf16);
void duet_silu_and_mul(const void *gate_up, int64_t gu_stride, void *out, int64_t rows, int64_t inter, int bf16);
int64_t duet_rotary_store_kv(const void *x, int64_t x_st, int64_t x_sh, const void *cos_t, const void *sin_t,
                             void *out, const void *v, int64_t v_st, void *k_cache, void *v_cache,
                             const int64_t *slots, int64_t num_slots, int64_t tokens, int64_t heads,
                             int64_t kv_heads, int64_t head_dim, int bf16);
void duet_decode_attention(const void *q, int64_t q_sb, int64_t q_sh, const void *k_cache, const void *v_cache,
                           const int64_t *block_ids, const int32_t *context_lens, void *out, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t num_blocks, int64_t block_size,
                           int64_t width, float scale, int bf16);
void duet_int8_linear(const void *x, int64_t ldx, const int8_t *qweight, const float *scales, int64_t group,
                      const float *bias, void *y, int64_t rows, int64_t n_out, int64_t k_in, int bf16);
void duet_int4_linear(const void *x, int64_t ldx, const uint8_t *qweight, const float *scales, const float *mins,
                      const float *bias, void *y, int64_t rows, int64_t n_out, int64_t k_in, int bf16);
int duet_gemv_f32(const float *x, int64_t rows, const float *w, const float *bias, float *y, int64_t n_out,
                  int64_t k_in);
int duet_gemv_bf16(const uint16_t *x_bf16, int64_t rows, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                   int64_t n_out, int64_t k_in);
void duet_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out);
void duet_quantized_linear_q8(const void *x, int64_t ldx, int kind, const void *qweight, const float *scales,
                              const float *mins, int64_t group, const float *bias, void *y, int64_t rows,
                              int64_t n_out, int64_t k_in, int bf16);

typedef struct {
    int32_t kind;             /* 4: int4, 8: int8; DENSE_F32 / DENSE_BF16: a plain [n_out, k_in] weight */
    int32_t int8_activations; /* x rounded per 32 inputs, integer dot products */
    const void *qweight;
    const float *scales, *mins; /* quantized only; mins: int4 only */
    const void *bias;           /* float32 (quantized and DENSE_F32), bf16 (DENSE_BF16), or NULL */
    int64_t group, n_out, k_in;
} duet_qlinear;

typedef struct {
    const void *input_norm, *post_norm; /* RMSNorm weights [hidden], in the activation dtype */
    duet_qlinear qkv, o, gate_up, down;
} duet_layer_weights;

typedef struct { /* the model's shape, the same for every layer */
    int64_t hidden, heads, kv_heads, head_dim, inter, num_blocks, block_size;
    float eps, scale;
    int32_t bf16;
} duet_layer_shape;

enum { DENSE_BF16 = 16, DENSE_F32 = 32 };

static void qlinear(const duet_qlinear *l, const void *x, void *y, int64_t rows, int bf16) {
    if (l->kind == DENSE_F32) /* up to GEMV_MAX_ROWS rows: FusedDecode sends no more */
        duet_gemv_f32(x, rows, l->qweight, l->bias, y, l->n_out, l->k_in);
    else if (l->kind == DENSE_BF16)
        duet_gemv_bf16(x, rows, l->qweight, l->bias, y, l->n_out, l->k_in);
    else if (l->int8_activations)
        duet_quantized_linear_q8(x, l->k_in, l->kind, l->qweight, l->scales, l->mins, l->group, l->bias, y, rows,
                                 l->n_out, l->k_in, bf16);
    else if (l->kind == 4)
        duet_int4_linear(x, l->k_in, l->qweight, l->scales, l->mins, l->bias, y, rows, l->n_out, l->k_in, bf16);
    else
        duet_int8_linear(x, l->k_in, l->qweight, l->scales, l->group, l->bias, y, rows, l->n_out, l->k_in, bf16);
}

/* Scratch bytes duet_decode_layer needs for `rows` tokens. */
int64_t duet_decode_layer_scratch_bytes(const duet_layer_shape *s, int64_t rows) {
    int64_t qkv = (s->heads + 2 * s->kv_heads) * s->head_dim, qk = (s->heads + s->kv_heads) * s->head_dim;
    int64_t elements = rows * (s->hidden /* xn */ + qkv + qk + s->heads * s->head_dim /* attn */ +
                               s->hidden /* o */ + s->hidden /* xn2 */ + s->hidden /* residual' */ +
                               2 * s->inter /* gu */ + s->inter /* act */);
    return elements * (s->bf16 ? 2 : 4);
}

/* x [rows, hidden]: the previous layer's MLP output, or the embeddings when residual is NULL (the first layer);
 * residual [rows, hidden] or NULL. Writes out [rows, hidden] (this layer's MLP output) and residual_out
 * [rows, hidden] (the stream without it: DecoderLayer.forward's pair), and the step's K/V at `slots` of the
 * caches [kv_heads, num_blocks, block_size, head_dim]; out may be x and residual_out residual (both are read only
 * by the first norm, before anything is written). cos/sin [rows, head_dim]; block_ids [rows * width] and
 * context_lens [rows] as decode attention takes them. Returns 0, or 1 + the index of a slot outside the
 * cache (nothing after the K/V store ran). */
static int64_t decode_layer(const duet_layer_shape *s, const duet_layer_weights *w, const void *x,
                            const void *residual, void *out, void *residual_out, const void *cos_t,
                            const void *sin_t, void *k_cache, void *v_cache, const int64_t *slots,
                            const int64_t *block_ids, const int32_t *context_lens, int64_t rows, int64_t width,
                            void *scratch) {
    int bf16 = s->bf16;
    int64_t esize = bf16 ? 2 : 4, hd = s->head_dim;
    int64_t qkv_width = (s->heads + 2 * s->kv_heads) * hd, qk_width = (s->heads + s->kv_heads) * hd;
    char *p = scratch;
    void *xn = p;                p += rows * s->hidden * esize;
    void *qkv = p;               p += rows * qkv_width * esize;
    void *qk = p;                p += rows * qk_width * esize;
    void *attn = p;              p += rows * s->heads * hd * esize;
    void *o = p;                 p += rows * s->hidden * esize;
    void *xn2 = p;               p += rows * s->hidden * esize;
    void *residual_mid = p;      p += rows * s->hidden * esize;
    void *gu = p;                p += rows * 2 * s->inter * esize;
    void *act = p;

    if (residual == NULL) { /* the first layer: norm(x), and x itself is the residual stream */
        duet_add_rms_norm(x, s->hidden, NULL, 0, w->input_norm, s->eps, xn, NULL, rows, s->hidden, bf16);
        memcpy(residual_mid, x, (size_t)(rows * s->hidden * esize));
    } else {
        duet_add_rms_norm(x, s->hidden, residual, s->hidden, w->input_norm, s->eps, xn, residual_mid, rows,
                          s->hidden, bf16);
    }
    qlinear(&w->qkv, xn, qkv, rows, bf16);
    int64_t bad = duet_rotary_store_kv(qkv, qkv_width, hd, cos_t, sin_t, qk, (const char *)qkv + qk_width * esize,
                                       qkv_width, k_cache, v_cache, slots, s->num_blocks * s->block_size, rows,
                                       s->heads + s->kv_heads, s->kv_heads, hd, bf16);
    if (bad) return bad;
    duet_decode_attention(qk, qk_width, hd, k_cache, v_cache, block_ids, context_lens, attn, rows, s->heads,
                          s->kv_heads, hd, s->num_blocks, s->block_size, width, s->scale, bf16);
    qlinear(&w->o, attn, o, rows, bf16);
    duet_add_rms_norm(o, s->hidden, residual_mid, s->hidden, w->post_norm, s->eps, xn2, residual_out, rows,
                      s->hidden, bf16);
    qlinear(&w->gate_up, xn2, gu, rows, bf16);
    duet_silu_and_mul(gu, 2 * s->inter, act, rows, s->inter, bf16);
    qlinear(&w->down, act, out, rows, bf16);
    return 0;
}

/* The step's inputs for duet_decode_layers, gathered by index: x [rows, hidden] the rows of the embedding table
 * embed [vocab, hidden] (the activations' dtype) at token_ids, and cos / sin [rows, head_dim] the rows of the rotary
 * tables cos_table / sin_table [max_positions, head_dim] (float32) at positions, in the activations' dtype (bf16
 * rounded to nearest even, as torch's `.to()`): nn.Embedding and RotaryEmbedding.cos_sin, the same numbers, without
 * their dispatch. Returns 0; or, before anything is written, 1 + the index of a token id outside [0, vocab) or
 * -(1 + the index) of a position outside [0, max_positions). */
int64_t duet_decode_inputs(const duet_layer_shape *s, const int64_t *token_ids, const int64_t *positions,
                           int64_t rows, const void *embed, int64_t vocab, const float *cos_table,
                           const float *sin_table, int64_t max_positions, void *x, void *cos_t, void *sin_t) {
    for (int64_t r = 0; r < rows; r++) {
        if (token_ids[r] < 0 || token_ids[r] >= vocab) return 1 + r;
        if (positions[r] < 0 || positions[r] >= max_positions) return -(1 + r);
    }
    int64_t esize = s->bf16 ? 2 : 4, hd = s->head_dim;
    for (int64_t r = 0; r < rows; r++) {
        memcpy((char *)x + r * s->hidden * esize, (const char *)embed + token_ids[r] * s->hidden * esize,
               (size_t)(s->hidden * esize));
        const float *c = cos_table + positions[r] * hd, *sn = sin_table + positions[r] * hd;
        if (s->bf16) {
            for (int64_t d = 0; d < hd; d++) {
                ((uint16_t *)cos_t)[r * hd + d] = duet_f32_to_bf16(c[d]);
                ((uint16_t *)sin_t)[r * hd + d] = duet_f32_to_bf16(sn[d]);
            }
        } else {
            memcpy((float *)cos_t + r * hd, c, sizeof(float) * (size_t)hd);
            memcpy((float *)sin_t + r * hd, sn, sizeof(float) * (size_t)hd);
        }
    }
    return 0;
}

/* The model's layers in order (w, k_caches and v_caches [n_layers]), in place: x [rows, hidden] holds the
 * embeddings on entry and the last layer's MLP output on return, residual [rows, hidden] (written) the stream
 * without it: the pair the final norm adds. Why one call for all layers: 30 ctypes calls of 16 arguments cost
 * ~0.1 ms a step. Returns decode_layer's code; only the first layer can fail (every layer stores at the same
 * slots), before anything is written. */
int64_t duet_decode_layers(const duet_layer_shape *s, const duet_layer_weights *w, int64_t n_layers,
                           void *const *k_caches, void *const *v_caches, void *x, void *residual, const void *cos_t,
                           const void *sin_t, const int64_t *slots, const int64_t *block_ids,
                           const int32_t *context_lens, int64_t rows, int64_t width, void *scratch) {
    for (int64_t l = 0; l < n_layers; l++) {
        int64_t bad = decode_layer(s, &w[l], x, l ? residual : NULL, x, residual, cos_t, sin_t, k_caches[l],
                                   v_caches[l], slots, block_ids, context_lens, rows, width, scratch);
        if (bad) return bad;
    }
    return 0;
}

/* Scratch bytes duet_decode_logits and duet_decode_argmax need for `rows` tokens and a vocabulary of `vocab`. */
int64_t duet_decode_argmax_scratch_bytes(const duet_layer_shape *s, int64_t vocab, int64_t rows) {
    int64_t esize = s->bf16 ? 2 : 4;
    return rows * (2 * s->hidden * esize /* xn, residual sum */ + (s->bf16 ? vocab * 2 : 0) + vocab * 4);
}

/* Each row's logits after the layers (x and residual as duet_decode_layers leaves them): the final norm of
 * x + residual, then the lm_head, into logits [rows, vocab] float32 (bf16 ones widened as `.float()` does):
 * `compute_logits(norm(...))`, the kernels and inputs of the plain path without its wrappers. */
void duet_decode_logits(const duet_layer_shape *s, const void *norm, const duet_qlinear *lm_head, const void *x,
                        const void *residual, int64_t rows, void *scratch, float *logits) {
    int bf16 = s->bf16;
    int64_t esize = bf16 ? 2 : 4, vocab = lm_head->n_out;
    char *p = scratch;
    void *xn = p;           p += rows * s->hidden * esize;
    void *residual_sum = p; p += rows * s->hidden * esize;
    uint16_t *logits_bf16 = (uint16_t *)p;

    duet_add_rms_norm(x, s->hidden, residual, s->hidden, norm, s->eps, xn, residual_sum, rows, s->hidden, bf16);
    qlinear(lm_head, xn, bf16 ? (void *)logits_bf16 : (void *)logits, rows, bf16);
    if (bf16)
        for (int64_t i = 0; i < rows * vocab; i++) logits[i] = duet_bf16_to_f32(logits_bf16[i]);
}

/* Each row's greedy token (the first maximum of its logits as duet_decode_logits computes them; a NaN counts as
 * the maximum): for rows whose sampling is only that argmax (engine/sampler.py's `reduces_to_argmax`), without the
 * sampler and the logits it keeps. token_ids [rows]. */
void duet_decode_argmax(const duet_layer_shape *s, const void *norm, const duet_qlinear *lm_head, const void *x,
                        const void *residual, int64_t rows, void *scratch, int64_t *token_ids) {
    int64_t vocab = lm_head->n_out;
    float *logits = (float *)((char *)scratch + duet_decode_argmax_scratch_bytes(s, vocab, rows)) - rows * vocab;
    duet_decode_logits(s, norm, lm_head, x, residual, rows, scratch, logits);
    duet_argmax_rows(logits, vocab, rows, vocab, token_ids);
}
