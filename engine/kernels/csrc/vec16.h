/* Sixteen float32 lanes as a GCC vector extension (quant_panels.c, gemv.c), and the sums of sixteen such
 * accumulators in one tree (quant_panels.c's 4x4 tiles). Every build runs the same code: AVX-512 as it is,
 * AVX2 in pairs of 8 lanes, the plain build in scalars. Including this file lets the compiler fuse acc += x * w
 * into one FMA in the including file: the tiles' sums have no fixed order to keep (the library is otherwise built
 * with -ffp-contract=off, which other kernels' bit-for-bit twins need). */
#ifndef DUET_VEC16_H
#define DUET_VEC16_H

#include <string.h>

#pragma GCC optimize("fp-contract=fast") /* acc += x * w as one FMA: these sums have no fixed order to keep */
#pragma GCC diagnostic ignored "-Wpsabi"  /* static functions passing v16 by value: no ABI crosses a library edge */

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* lanes of a and b folded pairwise: a's 16 partial sums of each of its n sums to 8 partials, likewise b's */
#define FOLD(a, b, ...) (__builtin_shufflevector(a, b, __VA_ARGS__))

/* out lane j = the sum of acc[j]'s 16 lanes */
static inline v16 reduce16(const v16 acc[16]) {
    v16 c[8], e[4], g[2];
    for (int j = 0; j < 8; j++) /* lanes 0-7: acc[2j]'s 8 partials, 8-15: acc[2j + 1]'s */
        c[j] = FOLD(acc[2 * j], acc[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               FOLD(acc[2 * j], acc[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; j++) /* four sums of 4 partials each */
        e[j] = FOLD(c[2 * j], c[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               FOLD(c[2 * j], c[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int j = 0; j < 2; j++) /* eight sums of 2 partials each */
        g[j] = FOLD(e[2 * j], e[2 * j + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               FOLD(e[2 * j], e[2 * j + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return FOLD(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           FOLD(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

#endif
