/* Approximate LM head logits from the head's 8-bit weight codes and int8 activations (CPU,
 * AVX-512 with VNNI and VBMI), built into the int8_matmul library beside the int16 codes
 * kernel (codes_screen.c), whose layouts it shares: codes [ceil(V / PANEL)][in][PANEL] uint8,
 * scales and offsets [ceil(V / PANEL)][in / G][PANEL] float, zero past V (or half-float scales
 * and byte zeros in that layout, converted a panel at a time: half_scales.h).
 *
 * Each activation row carries one scale per block of G inputs (xs[m, b]: a few of Gemma's
 * hidden dimensions are 50x the rest, and only their blocks need a coarse step):
 *
 *   out[m, v] = sum_b (fl(U[m, v, b] * xs[m, b]) * scale[v, b] + offset[v, b] * XS[m, b]),
 *   U[m, v, b] = sum_{i in b} code[v, i] * x[m, i],   XS[m, b] = fl(xs[m, b] * X[m, b]),
 *   X[m, b] = sum_{i in b} x[m, i].
 *
 * |x| <= 127, code <= 255 and G <= 256 keep |U| < 2^23: U is an exact int32 and an exact
 * float. Each block adds its two terms to one float32 sum per output by fused multiply-adds,
 * in block order; the roundings are the product by xs, the block sums' scaling and one per
 * fused multiply-add (lm_head_screen.py bounds them: 2B + 4 roundings of float32 at most).
 *
 * vpdpbusd multiplies four unsigned bytes by four signed ones and adds the four products to an
 * int32 lane, twice the multiply-adds of the int16 kernel's vpdpwssd an instruction. A lane
 * must hold one token's codes at four consecutive inputs: the codes at k .. k + 3 are 128
 * contiguous bytes (PANEL each), and one two-source byte permute a vector gathers rows 0-15
 * and rows 16-31 into that order. Each activation row's four entries are broadcast.
 *
 * x [rows, in] int8, xs [rows, in / G] float; out [rows, V] float, maxima [rows, ceil(V /
 * PANEL)] float or NULL. Nothing is written past V.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_scales.h"
#include "screen_simd.h"

#define QUADS_MAX_GROUP 256

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define QUADS_TILE 8      /* rows a pass: 16 int32 accumulators in registers through a block */

/* Byte j of "lo" takes byte QUAD_ORDER[0][j] of the 128 bytes at k .. k + 3: token t = j / 4
 * at input k + j % 4. "hi" the same for tokens 16-31. */
static const uint8_t QUAD_ORDER[2][64] __attribute__((aligned(64))) = {
#define QUAD_BYTES(t) t, 32 + t, 64 + t, 96 + t
#define QUAD_ROW(first) \
    {QUAD_BYTES(first + 0), QUAD_BYTES(first + 1), QUAD_BYTES(first + 2), QUAD_BYTES(first + 3), \
     QUAD_BYTES(first + 4), QUAD_BYTES(first + 5), QUAD_BYTES(first + 6), QUAD_BYTES(first + 7), \
     QUAD_BYTES(first + 8), QUAD_BYTES(first + 9), QUAD_BYTES(first + 10), QUAD_BYTES(first + 11), \
     QUAD_BYTES(first + 12), QUAD_BYTES(first + 13), QUAD_BYTES(first + 14), QUAD_BYTES(first + 15)}
    QUAD_ROW(0), QUAD_ROW(16)
#undef QUAD_ROW
#undef QUAD_BYTES
};

/* *acc += four-way byte products of codes (unsigned) and x (signed), in place (as codes_screen.c's
 * madd_into: the intrinsic made GCC copy every accumulator around each instruction). */
static inline void dot_into(__m512i *acc, __m512i codes, __m512i x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(codes), "v"(x));
}

static inline __m512i splat_quad(const int8_t *x) {
    int32_t quad;
    memcpy(&quad, x, sizeof quad);
    return _mm512_set1_epi32(quad);
}

/* acc[r] = the exact sums U of one block (codes c, `group` inputs) for activation rows x + r * in. */
static inline __attribute__((always_inline)) void quad_products(const uint8_t *c, int64_t group, const int8_t *x,
                                                                int64_t in, const int nx, __m512i acc[QUADS_TILE][2]) {
    const __m512i order_lo = _mm512_load_si512((const void *)QUAD_ORDER[0]);
    const __m512i order_hi = _mm512_load_si512((const void *)QUAD_ORDER[1]);
    for (int r = 0; r < nx; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t k = 0; k < group; k += 4) {
        const uint8_t *p = c + k * PANEL;
        __builtin_prefetch(p + PREFETCH_AHEAD, 0, 3);
        __builtin_prefetch(p + PREFETCH_AHEAD + 64, 0, 3);
        const __m512i first = _mm512_loadu_si512((const void *)p), second = _mm512_loadu_si512((const void *)(p + 64));
        const __m512i lo = _mm512_permutex2var_epi8(first, order_lo, second);
        const __m512i hi = _mm512_permutex2var_epi8(first, order_hi, second);
        for (int r = 0; r < nx; r++) {
            const __m512i xr = splat_quad(x + r * in + k);
            dot_into(&acc[r][0], lo, xr);
            dot_into(&acc[r][1], hi, xr);
        }
    }
}

/* Activation rows x .. x + nx - 1 against one panel of codes (nx a constant at every call site). */
static inline __attribute__((always_inline)) void quads_tile(const uint8_t *codes, const float *scales,
                                                             const float *offsets, int64_t group, int64_t in,
                                                             const int8_t *x, const float *xs, const float *xsums,
                                                             const int nx, float *out, int64_t vocab, int valid,
                                                             float *maxima, int64_t panels) {
    const int64_t blocks = in / group;
    __m512 total[QUADS_TILE][2];
    for (int r = 0; r < nx; r++) total[r][0] = total[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i acc[QUADS_TILE][2];
        quad_products(codes + b * group * PANEL, group, x + b * group, in, nx, acc);
        const __m512 s_lo = _mm512_loadu_ps(scales + b * PANEL), s_hi = _mm512_loadu_ps(scales + b * PANEL + 16);
        const __m512 o_lo = _mm512_loadu_ps(offsets + b * PANEL), o_hi = _mm512_loadu_ps(offsets + b * PANEL + 16);
        for (int r = 0; r < nx; r++) {
            const __m512 step = _mm512_set1_ps(xs[r * blocks + b]), block_sum = _mm512_set1_ps(xsums[r * blocks + b]);
            const __m512 u_lo = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][0]), step);
            const __m512 u_hi = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][1]), step);
            total[r][0] = _mm512_fmadd_ps(o_lo, block_sum, _mm512_fmadd_ps(u_lo, s_lo, total[r][0]));
            total[r][1] = _mm512_fmadd_ps(o_hi, block_sum, _mm512_fmadd_ps(u_hi, s_hi, total[r][1]));
        }
    }
    for (int r = 0; r < nx; r++) {
        float row[PANEL];
        float *to = valid == PANEL ? out + r * vocab : row;
        _mm512_storeu_ps(to, total[r][0]);
        _mm512_storeu_ps(to + 16, total[r][1]);
        if (valid < PANEL) memcpy(out + r * vocab, row, sizeof(float) * valid);
        if (maxima != NULL) maxima[r * panels] = max_of(to, valid);
    }
}

#define QUADS_CASE(NX) \
    case NX: \
        quads_tile(codes, scales, offsets, group, in, x, xs, xsums, NX, out, vocab, valid, maxima, panels); \
        break;

static void quads_dispatch(const uint8_t *codes, const float *scales, const float *offsets, int64_t group,
                           int64_t in, const int8_t *x, const float *xs, const float *xsums, int nx, float *out,
                           int64_t vocab, int valid, float *maxima, int64_t panels) {
    switch (nx) {
        QUADS_CASE(1) QUADS_CASE(2) QUADS_CASE(3) QUADS_CASE(4) QUADS_CASE(5) QUADS_CASE(6) QUADS_CASE(7)
        QUADS_CASE(8)
        default: break;
    }
}

/* xsums[m, b] = fl(xs[m, b] * X[m, b]) (X exact: |X| <= 127 * QUADS_MAX_GROUP). */
static void scaled_block_sums(const int8_t *x, const float *xs, int64_t rows, int64_t in, int64_t group,
                              float *xsums) {
    const int64_t blocks = in / group;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < blocks; b++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < group; i++) sum += x[m * in + b * group + i];
            xsums[m * blocks + b] = xs[m * blocks + b] * (float)sum;
        }
}

int fairserve_codes_screen_quads_available(void) { return 1; }

/* 0, 1 for shapes it does not take (an empty head, a group not a multiple of 4 or past
 * QUADS_MAX_GROUP, in not a multiple of it), 2 when it cannot allocate the block sums, 3 where
 * it was built without AVX-512 VNNI and VBMI. */
int fairserve_codes_screen_quads(const uint8_t *codes, const float *scales, const float *offsets,
                                 const uint16_t *half, const uint8_t *zeros, int64_t group, const int8_t *x,
                                 const float *xs, float *out, float *maxima, int64_t vocab, int64_t in, int64_t rows,
                                 int64_t num_threads) {
    if (vocab <= 0 || in <= 0 || group <= 0 || group % 4 || group > QUADS_MAX_GROUP || in % group || rows < 0)
        return 1;
    if (rows == 0) return 0;
    const int64_t count = (vocab + PANEL - 1) / PANEL, blocks = in / group, per_panel = blocks * PANEL;
    if (half != NULL && per_panel > MAX_PANEL_SCALES) return 1;
    float *xsums = malloc(sizeof(float) * rows * blocks);
    if (xsums == NULL) return 2;
    scaled_block_sums(x, xs, rows, in, group, xsums);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < count; p++) {
        const int valid = vocab - p * PANEL < PANEL ? (int)(vocab - p * PANEL) : PANEL;
        float converted[half != NULL ? 2 * per_panel : 1];
        const float *s = half != NULL ? NULL : scales + p * per_panel, *o = half != NULL ? NULL : offsets + p * per_panel;
        panel_scales(half != NULL ? half + p * per_panel : NULL, half != NULL ? zeros + p * per_panel : NULL,
                     per_panel, converted, &s, &o);
        /* The rows spread evenly over the fewest tiles, as in codes_screen.c. */
        const int64_t tiles = (rows + QUADS_TILE - 1) / QUADS_TILE;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            const int nx = (int)((rows - m0) / (tiles - t));
            quads_dispatch(codes + p * in * PANEL, s, o, group,
                           in, x + m0 * in, xs + m0 * blocks, xsums + m0 * blocks, nx, out + m0 * vocab + p * PANEL,
                           vocab, valid, maxima != NULL ? maxima + m0 * count + p : NULL, count);
            m0 += nx;
        }
    }
    free(xsums);
    return 0;
}
#else
int fairserve_codes_screen_quads_available(void) { return 0; }

int fairserve_codes_screen_quads(const uint8_t *codes, const float *scales, const float *offsets,
                                 const uint16_t *half, const uint8_t *zeros, int64_t group, const int8_t *x,
                                 const float *xs, float *out, float *maxima, int64_t vocab, int64_t in, int64_t rows,
                                 int64_t num_threads) {
    (void)codes, (void)scales, (void)offsets, (void)half, (void)zeros, (void)group, (void)x, (void)xs, (void)out;
    (void)maxima;
    (void)vocab, (void)in, (void)rows, (void)num_threads;
    return 3;
}
#endif
