/* A coded weight's scales kept as IEEE half floats and its offsets as byte zeros (offset =
 * -zero * scale), for the kernels that read them (weight_codes.py's `half` form: a Q8_0 head's
 * blocks are exactly that, 3 bytes a block of 32 instead of 8). Both convert back to the float32
 * scale and offset exactly, so a kernel gives the same bits from either form. */

#ifndef FAIRSERVE_HALF_SCALES_H
#define FAIRSERVE_HALF_SCALES_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Most scales of one panel the kernels convert on their stack ([in / group][PANEL] of them). */
#define MAX_PANEL_SCALES 8192

/* An IEEE half float as a float (exact). */
static inline float half_to_float(uint16_t h) {
    const uint32_t exponent = (h >> 10) & 31, mantissa = h & 1023;
    float value;
    if (exponent == 0) value = ldexpf((float)mantissa, -24);
    else if (exponent == 31) value = mantissa ? NAN : INFINITY;
    else value = ldexpf((float)(mantissa | 1024), (int)exponent - 25);
    return (h >> 15) ? -value : value;
}

/* One panel's `count` scales and offsets as floats: `*scales` and `*offsets` as they are, or,
 * with `half` (and `zeros`), converted into buf[0 .. 2 * count) and pointed there. */
static inline void panel_scales(const uint16_t *half, const uint8_t *zeros, int64_t count, float *buf,
                                const float **scales, const float **offsets) {
    if (half == NULL) return;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= count; i += 16) {
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + i)));
        const __m512 zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + i))));
        _mm512_storeu_ps(buf + i, scale);
        _mm512_storeu_ps(buf + count + i, _mm512_mul_ps(_mm512_mul_ps(zero, _mm512_set1_ps(-1.0f)), scale));
    }
#elif defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= count; i += 8) {
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + i)));
        const __m256 zero = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zeros + i))));
        _mm256_storeu_ps(buf + i, scale);
        _mm256_storeu_ps(buf + count + i, _mm256_mul_ps(_mm256_mul_ps(zero, _mm256_set1_ps(-1.0f)), scale));
    }
#endif
    for (; i < count; i++) {
        const float scale = half_to_float(half[i]);
        buf[i] = scale;
        buf[count + i] = -(float)zeros[i] * scale;
    }
    *scales = buf;
    *offsets = buf + count;
}

#endif
