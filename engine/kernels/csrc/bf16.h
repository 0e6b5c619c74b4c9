/* bfloat16 <-> float32 for the C kernels that read or write bf16 (round to nearest even, NaN -> 0x7FC0, as torch). */
#ifndef DUET_BF16_H
#define DUET_BF16_H

#include <stdint.h>

typedef union {
    uint32_t u;
    float f;
} duet_bits32;

static inline float duet_bf16_to_f32(uint16_t h) {
    duet_bits32 b = {.u = (uint32_t)h << 16};
    return b.f;
}

static inline uint16_t duet_f32_to_bf16(float f) {
    duet_bits32 b = {.f = f};
    uint32_t rounded = (b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16;
    return (b.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;
}

#endif
