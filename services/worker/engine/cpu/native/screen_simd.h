/* The SIMD primitives both LM head screen kernels share (int8_matmul.c, codes_screen.c):
 * int16 pairs multiplied and added pairwise into int32 lanes (vpdpwssd with AVX512-VNNI,
 * vpmaddwd + add otherwise), broadcasts, and the int8 kernel's loads and stores. */

#ifndef FAIRSERVE_SCREEN_SIMD_H
#define FAIRSERVE_SCREEN_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PANEL 32
/* Software prefetch distance into the weight stream, in bytes, one prefetch per cache line. */
#define PREFETCH_AHEAD 8192

#if defined(__AVX512BW__)
#define X_TILE 8          /* activation rows a pass: 8 x 2 accumulators */
#define VECTORS 2         /* 16 rows' int32 lanes each */
typedef __m512i acc_t;

static inline acc_t madd_acc(acc_t acc, acc_t w, acc_t x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

static inline acc_t load_pairs(const int8_t *p, int v) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p + v * 32)));
}

static inline acc_t splat_pair(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}

static inline acc_t zero_acc(void) { return _mm512_setzero_si512(); }

/* out[0 .. 16) = (float)acc * x_scale * w_scale[0 .. 16) */
static inline void store_scaled(float *out, acc_t acc, float x_scale, const float *w_scale) {
    const __m512 value = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(x_scale)),
                                       _mm512_loadu_ps(w_scale));
    _mm512_storeu_ps(out, value);
}
#define LANES 16
#elif defined(__AVX2__)
#define X_TILE 2          /* 2 x 4 accumulators of AVX2's 16 registers */
#define VECTORS 4         /* 8 rows' int32 lanes each */
typedef __m256i acc_t;

static inline acc_t madd_acc(acc_t acc, acc_t w, acc_t x) { return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x)); }

static inline acc_t load_pairs(const int8_t *p, int v) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + v * 16)));
}

static inline acc_t splat_pair(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm256_set1_epi32(pair);
}

static inline acc_t zero_acc(void) { return _mm256_setzero_si256(); }

static inline void store_scaled(float *out, acc_t acc, float x_scale, const float *w_scale) {
    const __m256 value = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(x_scale)),
                                       _mm256_loadu_ps(w_scale));
    _mm256_storeu_ps(out, value);
}
#define LANES 8
#endif

static inline float max_of(const float *values, int count) {
    float top = values[0];
    for (int i = 1; i < count; i++) top = values[i] > top ? values[i] : top;
    return top;
}

#endif
