/* A linear layer for few rows (decode steps), CPU float32:
 *
 *   out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])
 *
 * With a handful of rows a linear layer is a stream over its weight; BLAS kernels tuned
 * for large GEMMs reach a fraction of the memory bandwidth there. This one walks the
 * weight once, four weight rows at a time: each pass holds a tile of four weight rows by
 * up to X_TILE activation rows in vector accumulators, so one vector load of a weight row
 * feeds X_TILE multiply-adds and one of an activation row feeds four. With more rows than
 * X_TILE the same four weight rows pass again against the next activation rows, from L1.
 * Vectors are as wide as the CPU's (16 floats with AVX-512, else 8), and X_TILE is what
 * its register file holds without spilling (4 with AVX-512's 32 registers, else 3). On a
 * 2-core Xeon (AVX-512) the default model's 126 linears at 8 rows took 23.6 ms this way
 * against 31.0 ms for one weight row against eight activation rows per pass.
 * Threads split the weight rows.
 *
 * Layouts (all contiguous): x [rows, in], weight [out, in], bias [out] or NULL, out [rows, out].
 */

#include <stddef.h>
#include <stdint.h>

#include "vec8.h"

#if defined(__AVX512F__)
#define LANES 16
#define X_TILE 4
#else
#define LANES 8
#define X_TILE 3
#endif
#define W_TILE 4
/* Software prefetch distance, in floats of the weight stream (8 KB): the hardware prefetcher
 * alone let the multiply-adds and the loads take turns (126 default-model linears at 8 rows:
 * 23.0 ms without, 18.6 ms with, on a 2-core Xeon; a non-temporal prefetch was slower). */
#define PREFETCH_AHEAD 2048

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum(vf v) {
#if LANES == 16
    const v8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const v8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return sum8(lo + hi);
#else
    return sum8(v);
#endif
}

/* dots[j * X_TILE + r] = weight row w + j * in (j < nw) . activation row x + r * in (r < nx).
 * nw and nx are constants at every call site, so the nw * nx accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *w, const float *x, int64_t in, const int nw,
                                                       const int nx, float *dots) {
    vf acc[W_TILE][X_TILE];
    for (int j = 0; j < nw; j++)
        for (int r = 0; r < nx; r++) acc[j][r] = (vf){0};
    int64_t k = 0;
    for (; k + LANES <= in; k += LANES) {
        vf xv[X_TILE];
        for (int r = 0; r < nx; r++) xv[r] = loadv(x + r * in + k);
        for (int j = 0; j < nw; j++) {
            __builtin_prefetch(w + j * in + k + PREFETCH_AHEAD, 0, 3);
            const vf u = loadv(w + j * in + k);
            for (int r = 0; r < nx; r++) acc[j][r] += u * xv[r];
        }
    }
    for (int j = 0; j < nw; j++) {
        for (int r = 0; r < nx; r++) {
            float total = hsum(acc[j][r]);
            for (int64_t t = k; t < in; t++) total += w[j * in + t] * x[r * in + t];
            dots[j * X_TILE + r] = total;
        }
    }
}

/* Tiles wider than X_TILE are never asked for; the guard keeps their dead calls in bounds. */
#define TILE_CASE(NW, NX) \
    case (NW) * 8 + (NX): if ((NX) <= X_TILE) tile(w, x, in, NW, NX, dots); break;
#define TILE_CASES(NW) TILE_CASE(NW, 1) TILE_CASE(NW, 2) TILE_CASE(NW, 3) TILE_CASE(NW, 4)

static void dispatch(const float *w, const float *x, int64_t in, int nw, int nx, float *dots) {
    switch (nw * 8 + nx) {
        TILE_CASES(1) TILE_CASES(2) TILE_CASES(3) TILE_CASES(4)
        default: break;
    }
}

static inline float with_bias(float value, const float *bias, int64_t n) {
    return bias != NULL ? value + bias[n] : value;
}

/* Weight rows n0 .. n0 + 3 (fewer at the end) against every activation row. */
static void block(const float *weight, int64_t n0, int64_t out_features, const float *x, const float *bias,
                  float *out, int64_t rows, int64_t in) {
    const int nw = out_features - n0 < W_TILE ? (int)(out_features - n0) : W_TILE;
    const float *w = weight + n0 * in;
    float dots[W_TILE * X_TILE];
    for (int64_t m0 = 0; m0 < rows; m0 += X_TILE) {
        const int nx = rows - m0 < X_TILE ? (int)(rows - m0) : X_TILE;
        dispatch(w, x + m0 * in, in, nw, nx, dots);
        for (int r = 0; r < nx; r++)
            for (int j = 0; j < nw; j++)
                out[(m0 + r) * out_features + n0 + j] = with_bias(dots[j * X_TILE + r], bias, n0 + j);
    }
}

void fairserve_skinny_linear(const float *x, const float *weight, const float *bias, float *out, int64_t rows,
                             int64_t in, int64_t out_features, int64_t num_threads) {
    const int64_t blocks = (out_features + W_TILE - 1) / W_TILE;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) block(weight, W_TILE * b, out_features, x, bias, out, rows, in);
}
