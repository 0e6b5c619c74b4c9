/* Sampling a row's token from its logits, for engine/sampler.py's rows with temperature > 0: the same pipeline as
 * its torch twins (`Sampler._shape`, `draw_exponential_race`, `draw_inverse_cdf`), in a few passes over the row.
 * Why: at batch 1 the twins are ~30 small torch ops a row (topk, logsumexp, cumsum, masks, log of V uniforms),
 * 1-3 ms a token on a 2-core CPU against ~6-10 ms for the whole decode step; here a row costs ~0.1 ms.
 *
 *   logits --/ temperature, NaN -> -inf, +inf -> FLT_MAX--> x --top-k, top-p (on the best few, widening), min-p-->
 *   cutoff;  seeded: argmax over x >= cutoff of x + Gumbel(u_i);  unseeded: inverse CDF of exp(x - max) at u
 *
 * Sums run in double (the twins' cumsums run in float32): a cutoff or a draw can differ from the twin's only where
 * the twin's rounding decides it (a top-p mass or a uniform within ~1e-6 of a boundary). */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { FEW_CANDIDATES = 64, MORE_CANDIDATES = 1024 }; /* engine/sampler.py's CANDIDATES */

void duet_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out); /* cpu_kernels.c */

/* exp(x) for x <= 0 (Cody-Waite reduction, Cephes' degree-6 polynomial, ~1 ulp), 0 below -87 (where expf nears the
 * subnormals) and for -inf. Written without calls or branches so the loops below vectorize: glibc's expf is a call
 * per element (~4x slower over a row). */
static inline float exp_nonpositive(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = __builtin_rintf(c * 1.44269504088896341f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = p * r * r + r + 1.0f;
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* log(x) for a positive normal x (Cephes' logf polynomial, ~1 ulp), without calls or branches (see above). */
static inline float log_positive(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    float e = (float)((int32_t)(bits >> 23) - 127);
    bits = (bits & 0x007fffffu) | 0x3f800000u; /* the mantissa m in [1, 2) */
    float m;
    memcpy(&m, &bits, sizeof m);
    int high = m > 1.41421356f; /* m in [sqrt(1/2), sqrt(2)) */
    m = high ? 0.5f * m : m;
    e = high ? e + 1.0f : e;
    float f = m - 1.0f, z = f * f;
    float y = 7.0376836292e-2f;
    y = fmaf(y, f, -1.1514610310e-1f);
    y = fmaf(y, f, 1.1676998740e-1f);
    y = fmaf(y, f, -1.2420140846e-1f);
    y = fmaf(y, f, 1.4249322787e-1f);
    y = fmaf(y, f, -1.6668057665e-1f);
    y = fmaf(y, f, 2.0000714765e-1f);
    y = fmaf(y, f, -2.4999993993e-1f);
    y = fmaf(y, f, 3.3333331174e-1f);
    y = y * f * z;
    y += -2.12194440e-4f * e;
    y += -0.5f * z;
    return f + y + 0.693359375f * e;
}

/* Gumbel noise -log(-log(u)) of a uniform u in [0, 1): -inf at u = 0 (never the argmax), as the twin's. */
static inline float gumbel(float u) {
    float t = -log_positive(u > FLT_MIN ? u : 1.0f); /* -log(u) > 0 */
    float g = -log_positive(t > FLT_MIN ? t : 1.0f);
    return u > FLT_MIN ? (t > FLT_MIN ? g : INFINITY) : -INFINITY;
}

enum { LANES = 8 }; /* independent accumulators: the loops below vectorize (no float reassociation needed) */

/* max(x[0..n)), -inf for an empty or all -inf x; x holds no NaN */
static float max_of(const float *x, int64_t n) {
    float lane[LANES], m = -INFINITY;
    for (int j = 0; j < LANES; j++) lane[j] = -INFINITY;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] = x[i + j] > lane[j] ? x[i + j] : lane[j];
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    for (int j = 0; j < LANES; j++) m = lane[j] > m ? lane[j] : m;
    return m;
}

/* sum of exp(x - max) over x[0..n) (every x <= max) */
static double sum_exp(const float *x, int64_t n, float max) {
    float lane[LANES] = {0};
    double sum = 0.0;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) lane[j] += exp_nonpositive(x[i + j] - max);
    for (; i < n; i++) sum += exp_nonpositive(x[i] - max);
    for (int j = 0; j < LANES; j++) sum += lane[j];
    return sum;
}

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11; the constants and rounds of
 * Random123's reference, whose known answers tests/test_sampler.py checks): four 32-bit words from a 128-bit counter
 * and a 64-bit key, each counter's independent of every other's. Why it: a seeded row's uniform for token i is word
 * i % 4 of counter i / 4 under the row's (seed, step) key, so the draw needs no generator state and computes only the
 * words it reads (torch's CPU generator: 0.2-0.35 ms for a row of 49k uniforms, more than all the rest of the draw). */
static inline void philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1,
                                 uint32_t out[4]) {
    for (int round = 0; round < 10; round++) {
        if (round) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        uint64_t p0 = (uint64_t)0xD2511F53u * c0, p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

/* For the known-answer test: out[4] = Philox4x32-10(ctr[4], key[2]). */
void duet_philox4x32_10(const uint32_t *ctr, const uint32_t *key, uint32_t *out) {
    philox4x32_10(ctr[0], ctr[1], ctr[2], ctr[3], key[0], key[1], out);
}

/* A 32-bit word as a float32 uniform in [0, 1): its top 24 bits times 2^-24 (torch.rand's float32 resolution). */
static inline float uniform24(uint32_t w) { return (float)(w >> 8) * 0x1p-24f; }

/* The uniform of token i under `key`. */
static inline float token_uniform(uint64_t key, int64_t i) {
    uint32_t w[4];
    philox4x32_10((uint32_t)(i >> 2), (uint32_t)((uint64_t)i >> 34), 0, 0, (uint32_t)key, (uint32_t)(key >> 32), w);
    return uniform24(w[i & 3]);
}

/* out [n] = the uniforms of tokens 0..n-1 under `key`: a seeded row's randomness at one step (tests/test_sampler.py
 * feeds them to the torch twin of the draw). */
void duet_seeded_uniforms(uint64_t key, int64_t n, float *out) {
    int64_t b = 0;
    for (; 4 * b + 4 <= n; b++) { /* whole counters: no bounds inside, so the loop vectorizes */
        uint32_t w[4];
        philox4x32_10((uint32_t)b, (uint32_t)((uint64_t)b >> 32), 0, 0, (uint32_t)key, (uint32_t)(key >> 32), w);
        for (int j = 0; j < 4; j++) out[4 * b + j] = uniform24(w[j]);
    }
    for (int64_t i = 4 * b; i < n; i++) out[i] = token_uniform(key, i);
}

static int descending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Pushes v into the min-heap best [num] of the largest values so far, where v beats its least. */
static inline void heap_push(float *best, int64_t num, float v) {
    if (!(v > best[0])) return;
    int64_t j = 0;
    for (;;) { /* sift v down from the root */
        int64_t c = 2 * j + 1;
        if (c >= num) break;
        if (c + 1 < num && best[c + 1] < best[c]) c++;
        if (!(best[c] < v)) break;
        best[j] = best[c];
        j = c;
    }
    best[j] = v;
}

/* The `num` largest values of x [n] into best, sorted descending (num <= n): a min-heap of the best so far (it
 * changes ~num * ln(n / num) times), x read 16 values at a time against its least (a vectorized compare: most
 * blocks hold none that beat it). */
static void best_values(const float *x, int64_t n, int64_t num, float *best) {
    for (int64_t i = 0; i < num; i++) { /* heapify as we go: sift up */
        int64_t j = i;
        best[j] = x[i];
        while (j > 0 && best[(j - 1) / 2] > best[j]) {
            float t = best[j];
            best[j] = best[(j - 1) / 2];
            best[(j - 1) / 2] = t;
            j = (j - 1) / 2;
        }
    }
    int64_t i = num;
    for (; i + 16 <= n; i += 16) {
        float least = best[0];
        int beats = 0;
        for (int j = 0; j < 16; j++) beats |= x[i + j] > least;
        if (beats)
            for (int j = 0; j < 16; j++) heap_push(best, num, x[i + j]);
    }
    for (; i < n; i++) heap_push(best, num, x[i]);
    qsort(best, (size_t)num, sizeof(float), descending);
}

/* engine/sampler.py's `_cutoffs_in` for one row: the cutoff value among its best `num` values (sorted descending),
 * and whether it lies within them. log_norm: logsumexp of the whole row (top-p's normalizer without a top-k). */
static int cutoff_in(const float *best, int64_t num, int64_t top_k, float top_p, double log_norm, int64_t vocab,
                     float *cutoff) {
    int has_k = top_k < vocab && top_k <= num;
    int64_t kept = num;
    if (has_k) {
        float kth = best[top_k - 1];
        for (kept = top_k; kept < num && best[kept] >= kth;) kept++; /* ties with the k-th stay */
    }
    double norm = log_norm;
    if (has_k) {
        double sum = 0.0;
        for (int64_t j = 0; j < kept; j++) sum += exp((double)best[j] - (double)best[0]);
        norm = (double)best[0] + log(sum);
    }
    /* a token stays while the mass strictly before it is < top_p; top_p == 1 keeps all */
    int64_t stays = 0;
    double mass = 0.0;
    while (stays < kept && best[stays] > -INFINITY && (top_p >= 1.0f || mass < (double)top_p)) {
        mass += exp((double)best[stays] - norm);
        stays++;
    }
    int64_t num_kept = stays > 1 ? stays : 1; /* the best token always stays */
    *cutoff = best[num_kept - 1];
    return has_k || num_kept < num;
}

enum { CHUNKS = 8 };

/* The first i whose cumulative weight w[0] + ... + w[i] exceeds u * total (u in [0, 1), total > 0), or -1 for a
 * total of 0. The sums run over CHUNKS contiguous ranges side by side (independent additions), and the cumulative
 * weight at i is (the chunks before i's, chained) + (i's chunk up to i): the same additions as the total, so the
 * last token's cumulative weight is the total itself and some token's exceeds any target below it. */
static int64_t inverse_cdf(const float *w, int64_t n, double u) {
    int64_t size = (n + CHUNKS - 1) / CHUNKS;
    double chunk[CHUNKS] = {0};
    for (int64_t i = 0; i < size; i++)
        for (int q = 0; q < CHUNKS; q++)
            if (q * size + i < n) chunk[q] += w[q * size + i];
    double before[CHUNKS], total = 0.0;
    for (int q = 0; q < CHUNKS; q++) {
        before[q] = total;
        total += chunk[q];
    }
    if (!(total > 0.0)) return -1;
    double target = fmin(u * total, nextafter(total, 0.0));
    for (int q = 0; q < CHUNKS; q++) {
        if (!(before[q] + chunk[q] > target)) continue;
        double partial = 0.0;
        for (int64_t i = q * size; i < n && i < (q + 1) * size; i++) {
            partial += w[i];
            if (before[q] + partial > target) return i;
        }
    }
    return -1; /* not reached */
}

/* x [rows, vocab] (ldx) = each row of logits [rows, vocab] (ld) over its temperature, NaN at -inf and +inf at
 * FLT_MAX (a row with nothing finite: all 0, uniform), and cutoff [rows]: the value below which the row's top-k
 * (top_k < vocab), top-p (< 1) and min-p (> 0) drop a token (-inf: none). params [rows, 4] float32: temperature
 * (> 0), top_p, min_p, top_k (vocab for none): `Sampler._shape`'s table. Rows in parallel. */
void duet_sample_shape(const float *logits, int64_t ld, int64_t rows, int64_t vocab, const float *params, float *x,
                       int64_t ldx, float *cutoff) {
#pragma omp parallel if (rows > 1)
    {
    float *best = malloc(sizeof(float) * (size_t)(vocab > MORE_CANDIDATES ? vocab : MORE_CANDIDATES));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = logits + r * ld;
        float *xr = x + r * ldx, temperature = params[4 * r], top_p = params[4 * r + 1], min_p = params[4 * r + 2];
        int64_t top_k = (int64_t)params[4 * r + 3];
        for (int64_t i = 0; i < vocab; i++) {
            float v = in[i] / temperature;
            v = v != v ? -INFINITY : v;
            xr[i] = v == INFINITY ? FLT_MAX : v;
        }
        float row_max = max_of(xr, vocab);
        if (row_max == -INFINITY) {
            memset(xr, 0, sizeof(float) * (size_t)vocab);
            row_max = 0.0f;
        }
        float c = -INFINITY;
        if (top_k < vocab || top_p < 1.0f) {
            /* top-p's normalizer without a top-k (with one, every search holds its k best: unused) */
            double log_norm = top_p < 1.0f && top_k >= vocab ? (double)row_max + log(sum_exp(xr, vocab, row_max))
                                                              : 0.0;
            int64_t enabled_k = top_k < vocab ? top_k : 0, num = 0;
            int found = 0;
            for (int level = 0; level < 2 && !found; level++) {
                int64_t size = level ? MORE_CANDIDATES : FEW_CANDIDATES;
                int64_t next = size > enabled_k ? size : enabled_k;
                if (next <= num) continue;
                num = next;
                if (num >= vocab) break;
                best_values(xr, vocab, num, best);
                found = cutoff_in(best, num, top_k, top_p, log_norm, vocab, &c);
            }
            if (!found) { /* a flat row: sort it whole */
                memcpy(best, xr, sizeof(float) * (size_t)vocab);
                qsort(best, (size_t)vocab, sizeof(float), descending);
                cutoff_in(best, vocab, top_k, top_p, log_norm, vocab, &c);
            }
        }
        if (min_p > 0.0f) { /* p_i / p_max = exp(x_i - max) >= min_p */
            float m = row_max + logf(min_p);
            c = m > c ? m : c;
        }
        cutoff[r] = c;
    }
    free(best);
    }
}

/* Each row's token from x [rows, vocab] (ldx) restricted to x >= cutoff[r]: for a seeded row (seeded[r]), the argmax
 * of x + Gumbel noise (the first maximum), token i's noise from its uniform under the key seeds[r]
 * (duet_seeded_uniforms); for any other, the inverse CDF of exp(x - max) in token-id order at u[r] in [0, 1): the
 * first token whose cumulative weight exceeds u * total. Rows in parallel. */
void duet_sample_draw(const float *x, int64_t ldx, const float *cutoff, int64_t rows, int64_t vocab,
                      const uint8_t *seeded, const uint64_t *seeds, const double *u, int64_t *token_ids) {
#pragma omp parallel if (rows > 1)
    {
    float *work = malloc(sizeof(float) * (size_t)(vocab + 4));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx, c = cutoff[r];
        int64_t pick = -1;
        if (seeded[r]) {
            int64_t kept = 0;
            for (int64_t i = 0; i < vocab; i++) kept += xr[i] >= c;
            if (kept * 16 < vocab) { /* a few kept tokens (top-k, top-p): their noise alone */
                float best = -INFINITY;
                for (int64_t i = 0; i < vocab; i++)
                    if (xr[i] >= c) {
                        float score = xr[i] + gumbel(token_uniform(seeds[r], i));
                        if (score > best) best = score, pick = i;
                    }
            } else { /* every token's, in vectors */
                duet_seeded_uniforms(seeds[r], vocab, work);
                for (int64_t i = 0; i < vocab; i++) work[i] = xr[i] >= c ? xr[i] + gumbel(work[i]) : -INFINITY;
                duet_argmax_rows(work, vocab, 1, vocab, &pick);
                if (work[pick] == -INFINITY) pick = -1;
            }
        } else {
            float row_max = max_of(xr, vocab);
            for (int64_t i = 0; i < vocab; i++) work[i] = xr[i] >= c ? exp_nonpositive(xr[i] - row_max) : 0.0f;
            pick = inverse_cdf(work, vocab, u[r]);
        }
        if (pick < 0) /* every kept token scored -inf (a zero uniform each): the first kept token */
            for (int64_t i = 0; i < vocab && pick < 0; i++)
                if (xr[i] >= c) pick = i;
        token_ids[r] = pick;
    }
    free(work);
    }
}

/* Whether (v, id) ranks below (w, jd) among logprobs' top: a smaller value, or the same and a higher id. */
static inline int ranks_below(float v, int64_t id, float w, int64_t jd) { return v < w || (v == w && id > jd); }

/* (v, id) into the min-heap [0, size) of (best, best_id) in place of its root, sifted down. */
static void sift_down(float *best, int64_t *best_id, int64_t size, float v, int64_t id) {
    int64_t j = 0;
    for (;;) {
        int64_t c = 2 * j + 1;
        if (c >= size) break;
        if (c + 1 < size && ranks_below(best[c + 1], best_id[c + 1], best[c], best_id[c])) c++;
        if (!ranks_below(best[c], best_id[c], v, id)) break;
        best[j] = best[c], best_id[j] = best_id[c];
        j = c;
    }
    best[j] = v, best_id[j] = id;
}

/* engine/sampler.py's `compute_logprobs` for rows of logits [rows, vocab] (ld): under log_softmax of each row, the
 * logprob of token_ids[r] (chosen[r]), its rank (1 + the tokens with a strictly greater logprob) and the n_top best
 * (top_ids / top_logprobs [rows, n_top], best first, ties by lower id). log_softmax as torch computes it: (x - max) -
 * log(sum exp(x - max)), in float32. Returns 0, or 1 where a row holds a NaN or +inf (nothing written for it: the twin
 * decides what such rows give). Rows in parallel. */
int64_t duet_logprobs(const float *logits, int64_t ld, int64_t rows, int64_t vocab, const int64_t *token_ids,
                      int64_t n_top, float *chosen, int64_t *ranks, int64_t *top_ids, float *top_logprobs) {
    int64_t unusual = 0;
#pragma omp parallel if (rows > 1) reduction(| : unusual)
    {
    float *best = malloc(sizeof(float) * (size_t)(n_top > 0 ? n_top : 1));
    int64_t *best_id = malloc(sizeof(int64_t) * (size_t)(n_top > 0 ? n_top : 1));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = logits + r * ld;
        int bad = 0;
        for (int64_t i = 0; i < vocab; i++) bad |= (x[i] != x[i]) | (x[i] == INFINITY);
        if (bad) {
            unusual = 1;
            continue;
        }
        float m = max_of(x, vocab);
        float log_sum = m == -INFINITY ? NAN : (float)log(sum_exp(x, vocab, m));
        float lp_chosen = (x[token_ids[r]] - m) - log_sum;
        int64_t better = 0;
        for (int64_t i = 0; i < vocab; i++) better += ((x[i] - m) - log_sum) > lp_chosen;
        chosen[r] = lp_chosen;
        ranks[r] = 1 + better;
        /* the n_top best (value, id): a min-heap whose least is the worst kept (`ranks_below`) */
        int64_t size = 0;
        for (int64_t i = 0; i < vocab && n_top > 0; i++) {
            if (size < n_top) { /* sift up */
                int64_t j = size++;
                for (; j > 0 && ranks_below(x[i], i, best[(j - 1) / 2], best_id[(j - 1) / 2]); j = (j - 1) / 2)
                    best[j] = best[(j - 1) / 2], best_id[j] = best_id[(j - 1) / 2];
                best[j] = x[i], best_id[j] = i;
            } else if (x[i] > best[0]) { /* beats the least (a tie does not: the lower id stays) */
                sift_down(best, best_id, n_top, x[i], i);
            }
        }
        for (int64_t k = size - 1; k >= 0; k--) { /* pop the least into the last free place: best first */
            top_ids[r * n_top + k] = best_id[0];
            top_logprobs[r * n_top + k] = (best[0] - m) - log_sum;
            if (k > 0) sift_down(best, best_id, k, best[k], best_id[k]); /* the heap [0, k) without it */
        }
    }
    free(best);
    free(best_id);
    }
    return unusual;
}
