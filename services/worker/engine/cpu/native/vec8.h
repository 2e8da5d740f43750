/* Eight floats through GCC's vector extensions (one AVX register on x86, two NEON ones on
 * ARM), and the helpers the kernels share. */

#ifndef FAIRSERVE_VEC8_H
#define FAIRSERVE_VEC8_H

#include <stdint.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

/* Lanes of a where mask is set, else of b (vector casts reinterpret the bits). */
static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

static inline v8 min8(v8 a, v8 b) { return select8(a < b, a, b); }

static inline v8 max8(v8 a, v8 b) { return select8(a > b, a, b); }

/* e^x for x in [-87.3, 88.7] (clamped outside): 2^n * e^r with r = x - n ln2, |r| <= ln2/2. */
static inline v8 exp8(v8 x) {
    x = max8(min8(x, splat8(88.3762626647949f)), splat8(-87.3365478515625f));
    v8 fx = x * splat8(1.44269504088896341f);
    const v8i n = __builtin_convertvector(fx + select8(fx >= 0, splat8(0.5f), splat8(-0.5f)), v8i);
    fx = __builtin_convertvector(n, v8);
    v8 r = x - fx * splat8(0.693359375f);
    r = r - fx * splat8(-2.12194440e-4f);
    v8 p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    const v8i bits = (n + 127) << 23;
    v8 scale;
    __builtin_memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float sum8(v8 v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

#endif
