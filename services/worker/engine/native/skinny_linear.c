/* A linear layer for few rows (decode steps), CPU float32:
 *
 *   out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])
 *
 * With a handful of rows a linear layer is a stream over its weight; BLAS kernels tuned
 * for large GEMMs reach a fraction of the memory bandwidth there. This one walks the
 * weight once: for one or two rows, four weight rows at a time against them (eight vector
 * accumulators); for more, each weight row against up to eight activation rows in one
 * pass. Threads split the weight rows.
 *
 * Layouts (all contiguous): x [rows, in], weight [out, in], bias [out] or NULL, out [rows, out].
 */

#include <stddef.h>
#include <stdint.h>

#include "vec8.h"

/* dots[j * 2 + r] = weight row w + j * in (j < 4) . activation row x + r * in (r < live <= 2):
 * eight accumulators, each step loading four weight vectors and two activation vectors. */
static inline __attribute__((always_inline)) void tile(const float *w, const float *x, int64_t in,
                                                       const int live, float *dots) {
    const float *w0 = w, *w1 = w + in, *w2 = w + 2 * in, *w3 = w + 3 * in;
    const float *x0 = x, *x1 = live > 1 ? x + in : x;
    v8 a0 = (v8){0}, a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        const v8 u0 = load8(w0 + k), u1 = load8(w1 + k), u2 = load8(w2 + k), u3 = load8(w3 + k);
        const v8 y0 = load8(x0 + k);
        a0 += u0 * y0; a1 += u1 * y0; a2 += u2 * y0; a3 += u3 * y0;
        if (live > 1) {
            const v8 y1 = load8(x1 + k);
            b0 += u0 * y1; b1 += u1 * y1; b2 += u2 * y1; b3 += u3 * y1;
        }
    }
    float s[8] = {sum8(a0), sum8(b0), sum8(a1), sum8(b1), sum8(a2), sum8(b2), sum8(a3), sum8(b3)};
    for (; k < in; k++) {
        for (int j = 0; j < 4; j++) {
            s[j * 2] += w[j * in + k] * x0[k];
            s[j * 2 + 1] += w[j * in + k] * x1[k];
        }
    }
    for (int i = 0; i < 8; i++) dots[i] = s[i];
}

/* One weight row against `live` (<= 8) activation rows in one pass: the weight row is
 * loaded once per step, and eight accumulators hold the rows. */
static inline __attribute__((always_inline)) void tile8(const float *w, const float *x, int64_t in, const int live,
                                                        float *dots) {
    v8 acc[8];
    for (int r = 0; r < live; r++) acc[r] = (v8){0};
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
        const v8 u = load8(w + k);
        for (int r = 0; r < live; r++) acc[r] += u * load8(x + r * in + k);
    }
    for (int r = 0; r < live; r++) {
        float total = sum8(acc[r]);
        for (int64_t t = k; t < in; t++) total += w[t] * x[r * in + t];
        dots[r] = total;
    }
}

static void row_tile8(const float *w, const float *x, int64_t in, int live, float *dots) {
    switch (live) {
        case 1: tile8(w, x, in, 1, dots); break;
        case 2: tile8(w, x, in, 2, dots); break;
        case 3: tile8(w, x, in, 3, dots); break;
        case 4: tile8(w, x, in, 4, dots); break;
        case 5: tile8(w, x, in, 5, dots); break;
        case 6: tile8(w, x, in, 6, dots); break;
        case 7: tile8(w, x, in, 7, dots); break;
        default: tile8(w, x, in, 8, dots); break;
    }
}

static inline float with_bias(float value, const float *bias, int64_t n) {
    return bias != NULL ? value + bias[n] : value;
}

/* Weight rows n0 .. n0 + 3 (fewer at the end) against every activation row. One or two
 * activation rows: four weight rows per pass (the weight is what streams). More: each
 * weight row passes once per eight activation rows. */
static void block(const float *weight, int64_t n0, int64_t out_features, const float *x, const float *bias,
                  float *out, int64_t rows, int64_t in) {
    const int64_t count = out_features - n0 < 4 ? out_features - n0 : 4;
    const float *w = weight + n0 * in;
    float dots[8];
    if (rows <= 2 && count == 4) {
        if (rows == 2) tile(w, x, in, 2, dots);
        else tile(w, x, in, 1, dots);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) out[r * out_features + n0 + j] = with_bias(dots[j * 2 + r], bias, n0 + j);
        return;
    }
    for (int64_t j = 0; j < count; j++) {
        for (int64_t m0 = 0; m0 < rows; m0 += 8) {
            const int live = rows - m0 < 8 ? (int)(rows - m0) : 8;
            row_tile8(w + j * in, x + m0 * in, in, live, dots);
            for (int r = 0; r < live; r++) out[(m0 + r) * out_features + n0 + j] = with_bias(dots[r], bias, n0 + j);
        }
    }
}

void fairserve_skinny_linear(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                             int64_t in, int64_t out_features, int64_t num_threads) {
    const int64_t blocks = (out_features + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) block(weight, 4 * b, out_features, x, bias, out, rows, in);
}
