/* The few AVX-512F intrinsics quant_kernels.c uses, in plain C with the same lane semantics, so its AVX-512 path
 * can be built and checked against the torch twin on a CPU without AVX-512 (tests/test_quant_kernels.py builds it
 * with -DDUET_EMULATE_AVX512). Never used in a real build: speed is not the point, lane arithmetic is.
 * Why by hand: SIMDe (the library for this) lacks these conversions and reductions in Debian's 0.7.4. */
#ifndef DUET_AVX512_EMULATION_H
#define DUET_AVX512_EMULATION_H

#include <immintrin.h> /* the SSE2 intrinsics the AVX-512 path also uses are native on every x86-64 CPU */
#include <math.h>
#include <stdint.h>

typedef struct { float f[16]; } emu_m512;

static inline emu_m512 emu_mm512_setzero_ps(void) { emu_m512 v = {{0}}; return v; }

static inline emu_m512 emu_mm512_set1_ps(float a) {
    emu_m512 v;
    for (int i = 0; i < 16; i++) v.f[i] = a;
    return v;
}

static inline emu_m512 emu_mm512_loadu_ps(const float *p) {
    emu_m512 v;
    for (int i = 0; i < 16; i++) v.f[i] = p[i];
    return v;
}

static inline emu_m512 emu_mm512_mul_ps(emu_m512 a, emu_m512 b) {
    for (int i = 0; i < 16; i++) a.f[i] *= b.f[i];
    return a;
}

static inline emu_m512 emu_mm512_add_ps(emu_m512 a, emu_m512 b) {
    for (int i = 0; i < 16; i++) a.f[i] += b.f[i];
    return a;
}

static inline emu_m512 emu_mm512_fmadd_ps(emu_m512 a, emu_m512 b, emu_m512 c) {
    for (int i = 0; i < 16; i++) a.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); /* one rounding, as vfmadd */
    return a;
}

static inline float emu_mm512_reduce_add_ps(emu_m512 a) {
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) sum += a.f[i];
    return sum;
}

/* The integer conversions carry their 16 lanes as floats already: every int8 / uint8 value is exact in float, and
 * the only consumer is _mm512_cvtepi32_ps (made the identity). */
static inline emu_m512 emu_mm512_cvtepi8_epi32(__m128i bytes) {
    int8_t b[16];
    emu_m512 v;
    _mm_storeu_si128((__m128i *)b, bytes);
    for (int i = 0; i < 16; i++) v.f[i] = (float)b[i];
    return v;
}

static inline emu_m512 emu_mm512_cvtepu8_epi32(__m128i bytes) {
    uint8_t b[16];
    emu_m512 v;
    _mm_storeu_si128((__m128i *)b, bytes);
    for (int i = 0; i < 16; i++) v.f[i] = (float)b[i];
    return v;
}

static inline emu_m512 emu_mm512_cvtepi32_ps(emu_m512 a) { return a; }

#define __m512 emu_m512
#define _mm512_setzero_ps emu_mm512_setzero_ps
#define _mm512_set1_ps emu_mm512_set1_ps
#define _mm512_loadu_ps emu_mm512_loadu_ps
#define _mm512_mul_ps emu_mm512_mul_ps
#define _mm512_add_ps emu_mm512_add_ps
#define _mm512_fmadd_ps emu_mm512_fmadd_ps
#define _mm512_reduce_add_ps emu_mm512_reduce_add_ps
#define _mm512_cvtepi8_epi32 emu_mm512_cvtepi8_epi32
#define _mm512_cvtepu8_epi32 emu_mm512_cvtepu8_epi32
#define _mm512_cvtepi32_ps emu_mm512_cvtepi32_ps

#endif
