/* Fused elementwise ops of a transformer layer (CPU, float32), each one pass over memory:
 *
 *   fairserve_rms_norm:      out = (x * rsqrt(mean(x^2) + eps)) * scale   (per row)
 *   fairserve_act_mul:       out = act(gate) * up, act = GELU (tanh form) or SiLU
 *   fairserve_rope:          rotary embedding of the query and key heads, in place
 *
 * transformers spells these out as 5-10 separate tensor ops, each a full pass over
 * memory with its own dispatch (the norm ~100 us per call on a 512 x 640 prefill chunk,
 * the activation ~2 ms on 512 x 2048). exp is a Cephes-style polynomial written with
 * GCC's vector extensions (within ~2 ulp of expf), so it vectorizes without -ffast-math.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vec8.h"

#define MIN_PARALLEL_ELEMENTS 65536

/* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), with 1 + tanh(y) = 2 / (1 + e^(-2y)):
 * no cancellation in the negative tail. */
static inline v8 gelu_tanh8(v8 x) {
    const v8 inner = splat8(0.7978845608028654f) * (x + splat8(0.044715f) * x * x * x);
    const v8 one_plus_tanh = splat8(2.0f) / (splat8(1.0f) + exp8(-(inner + inner)));
    return splat8(0.5f) * x * one_plus_tanh;
}

static inline v8 silu8(v8 x) { return x / (splat8(1.0f) + exp8(-x)); }

static void rms_norm_row(const float *x, const float *scale, float *out, int64_t dim, float eps) {
    v8 a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0;
    int64_t e = 0;
    for (; e + 32 <= dim; e += 32) {
        const v8 x0 = load8(x + e), x1 = load8(x + e + 8), x2 = load8(x + e + 16), x3 = load8(x + e + 24);
        a0 += x0 * x0;
        a1 += x1 * x1;
        a2 += x2 * x2;
        a3 += x3 * x3;
    }
    const v8 a = (a0 + a1) + (a2 + a3);
    float total = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
    for (; e < dim; e++) total += x[e] * x[e];
    const float inverse = 1.0f / sqrtf(total / (float)dim + eps);
    e = 0;
    if (scale != NULL) {
        for (; e + 8 <= dim; e += 8) store8(out + e, (load8(x + e) * splat8(inverse)) * load8(scale + e));
        for (; e < dim; e++) out[e] = (x[e] * inverse) * scale[e];
    } else {
        for (; e + 8 <= dim; e += 8) store8(out + e, load8(x + e) * splat8(inverse));
        for (; e < dim; e++) out[e] = x[e] * inverse;
    }
}

/* scale may be NULL (no learned scale). */
void fairserve_rms_norm(const float *x, const float *scale, float *out, int64_t rows, int64_t dim, float eps,
                        int64_t num_threads) {
    const int64_t threads = rows * dim >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) rms_norm_row(x + row * dim, scale, out + row * dim, dim, eps);
}

/* kind 0: GELU (tanh form), 1: SiLU. gate, up and out are `rows` rows of `dim`, each with
 * its own row stride (a fused gate/up projection hands in two halves of one tensor). */
void fairserve_act_mul(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
                       int64_t rows, int64_t dim, int64_t kind, int64_t num_threads) {
    const int64_t threads = rows * dim >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t row = 0; row < rows; row++) {
        const float *g = gate + row * gate_stride, *u = up + row * up_stride;
        float *o = out + row * dim;
        int64_t e = 0;
        for (; e + 8 <= dim; e += 8) {
            const v8 x = load8(g + e);
            store8(o + e, (kind == 0 ? gelu_tanh8(x) : silu8(x)) * load8(u + e));
        }
        if (e < dim) {
            float tail_g[8] = {0}, tail_u[8] = {0}, tail_o[8];
            for (int64_t i = e; i < dim; i++) {
                tail_g[i - e] = g[i];
                tail_u[i - e] = u[i];
            }
            const v8 x = load8(tail_g);
            store8(tail_o, (kind == 0 ? gelu_tanh8(x) : silu8(x)) * load8(tail_u));
            for (int64_t i = e; i < dim; i++) o[i] = tail_o[i - e];
        }
    }
}

/* x = x * cos + rotate_half(x) * sin over each head of every row, in place, where
 * rotate_half(x) = (-x[half:], x[:half]): transformers' `apply_rotary_pos_emb` for the
 * query (q_heads heads) and key (k_heads heads) rows of a step at once. Layouts (all
 * contiguous): q [rows, q_heads, dim], k [rows, k_heads, dim], cos and sin [rows, dim];
 * dim is even. */
void fairserve_rope(float *q, int64_t q_heads, float *k, int64_t k_heads, const float *cos, const float *sin,
                    int64_t rows, int64_t dim, int64_t num_threads) {
    const int64_t heads = q_heads + k_heads, half = dim / 2;
    const int64_t threads = rows * heads * dim >= MIN_PARALLEL_ELEMENTS ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t item = 0; item < rows * heads; item++) {
        const int64_t row = item / heads, head = item % heads;
        float *x = head < q_heads ? q + (row * q_heads + head) * dim : k + (row * k_heads + head - q_heads) * dim;
        const float *c = cos + row * dim, *s = sin + row * dim;
        int64_t e = 0;
        for (; e + 8 <= half; e += 8) {
            const v8 a = load8(x + e), b = load8(x + half + e);
            store8(x + e, a * load8(c + e) - b * load8(s + e));
            store8(x + half + e, b * load8(c + half + e) + a * load8(s + half + e));
        }
        for (; e < half; e++) {
            const float a = x[e], b = x[half + e];
            x[e] = a * c[e] - b * s[e];
            x[half + e] = b * c[half + e] + a * s[half + e];
        }
    }
}
