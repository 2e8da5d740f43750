/* Approximate LM head logits straight from the head's 8-bit weight codes (CPU), built into
 * the int8_matmul library beside the int8 kernel (int8_matmul.c).
 *
 * The head kept as weight codes (weight_codes.py: its float32 weight is scale * code + offset
 * in every block of G = `group` inputs; codes [ceil(V / PANEL)][in][PANEL] uint8, scales and
 * offsets [ceil(V / PANEL)][in / G][PANEL] float, zero past V):
 *
 *   out[m, v] = x_scale[m] * sum_b (scale[v, b] * U[m, v, b] + offset[v, b] * X[m, b]),
 *   U[m, v, b] = sum_{i in b} code[v, i] * x[m, i],   X[m, b] = sum_{i in b} x[m, i].
 *
 * U and X are exact int32 (code <= 255, |x| <= 2^15 and G <= 256 keep |U| < 2^31), X exact
 * as a float too (|X| <= 2^23); the int accumulators restart every block, each block's two
 * float terms are fused multiply-adds into one float32 sum per output, in block order, and
 * that sum times x_scale is the output. The only roundings are U's conversion to float, one
 * per fused multiply-add and the last product (lm_head_screen.py bounds them).
 *
 * A pass holds the int32 and the float accumulators of CODES_TILE activation rows. For each
 * input pair (k, k + 1) of a block, the 32 codes at k and the 32 at k + 1, widened to int16,
 * are interleaved into (row r at k, row r at k + 1) pairs, and each activation row's pair,
 * broadcast, is multiplied into them and added pairwise, as in `tile` above. The interleave
 * works within 128-bit lanes, so one vector holds rows {0-3, 8-11, 16-19, 24-27} ("lo") and
 * the other {4-7, 12-15, 20-23, 28-31} ("hi") (AVX2: the same within each half of 16 rows):
 * the scales and offsets are permuted into that order once a block, and the outputs back
 * into row order when stored. On AVX2 a pass of more than 2 rows takes one half of the panel
 * at a time (`codes_tile`): 1.2-1.3x at 8-32 rows on an AMD EPYC Zen 3.
 *
 * `fairserve_codes_screen_half` takes the scales as IEEE half floats and each offset as -zero *
 * scale with zero a byte (both [ceil(V / PANEL)][in / G][PANEL]): a Q8_0 head's codes are like
 * that, and a one-row pass, bound by the bytes it reads, reads 1 + 3/32 bytes a weight instead
 * of 1 + 1/4. Each block's scales and offsets are widened to floats (exact) before the same
 * operations, so its outputs are the float kernel's bit for bit (codes_screen_half.py).
 *
 * Layouts (all contiguous): codes, scales, offsets as above; x [rows, in] int16, x_scale
 * [rows] float; out [rows, V] float, maxima [rows, ceil(V / PANEL)] float or NULL (as
 * fairserve_int8_matmul writes them). Nothing is written past V.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_scales.h"
#include "screen_simd.h"

#define MAX_GROUP 256


#if defined(__AVX512BW__)
/* 8 rows a pass, as `tile`: their 16 int32 accumulators stay in registers through a block's
 * products, the 16 float ones only meet them at the block's end (and may wait in memory). */
#define CODES_TILE 8
#define HALVES 1          /* code loads per input entry of a panel: 32 rows each */
#define SHARED_HALVES_ROWS CODES_TILE
typedef __m512 fvec_t;

static inline acc_t widen_codes(const uint8_t *p) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}

static inline acc_t pairs_lo(acc_t a, acc_t b) { return _mm512_unpacklo_epi16(a, b); }

static inline acc_t pairs_hi(acc_t a, acc_t b) { return _mm512_unpackhi_epi16(a, b); }

/* *acc = madd_acc(*acc, w, x), updating the accumulator in place. With the intrinsic GCC 12
 * copies each accumulator into another register and back around every vpdpwssd, which
 * doubles the registers a pass needs: past 7 rows it spilled inside the loop. */
static inline void madd_into(acc_t *acc, acc_t w, acc_t x) {
#if defined(__AVX512VNNI__)
    __asm__("vpdpwssd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(x));
#else
    *acc = madd_acc(*acc, w, x);
#endif
}

/* Rows 0 .. 32 held as a (0 .. 16) and b (16 .. 32), in the "lo" and in the "hi" row order. */
static inline fvec_t order_lo(fvec_t a, fvec_t b) {
    const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    return _mm512_permutex2var_ps(a, order, b);
}

static inline fvec_t order_hi(fvec_t a, fvec_t b) {
    const __m512i order = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    return _mm512_permutex2var_ps(a, order, b);
}

#define FLOATS 16         /* floats a vector */
#if defined(__F16C__)
static inline fvec_t widen_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#endif

static inline fvec_t widen_zero(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* out[0 .. 32) = the rows of lo and hi, back in row order, times x_scale. */
static inline void store_rows(float *out, fvec_t lo, fvec_t hi, float x_scale) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512 scale = _mm512_set1_ps(x_scale);
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale));
}

static inline fvec_t fzero(void) { return _mm512_setzero_ps(); }
static inline fvec_t fsplat(float value) { return _mm512_set1_ps(value); }
static inline fvec_t to_float(acc_t acc) { return _mm512_cvtepi32_ps(acc); }
static inline fvec_t fmadd(fvec_t a, fvec_t b, fvec_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline fvec_t fmul(fvec_t a, fvec_t b) { return _mm512_mul_ps(a, b); }
static inline fvec_t fload(const float *p) { return _mm512_loadu_ps(p); }
#elif defined(__AVX2__)
#define CODES_TILE 3      /* a half a pass: 3 x 2 int accumulators, 2 codes, 2 pairs, 1 activation pair */
#define HALVES 2          /* code loads per input entry of a panel: 16 rows each */
#define SHARED_HALVES_ROWS 2  /* rows a pass may take over both halves: 2 x 4 int accumulators */
typedef __m256 fvec_t;

static inline acc_t widen_codes(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }

static inline acc_t pairs_lo(acc_t a, acc_t b) { return _mm256_unpacklo_epi16(a, b); }

static inline acc_t pairs_hi(acc_t a, acc_t b) { return _mm256_unpackhi_epi16(a, b); }

static inline void madd_into(acc_t *acc, acc_t w, acc_t x) { *acc = madd_acc(*acc, w, x); }

/* Rows 0 .. 16 held as a (0 .. 8) and b (8 .. 16), in the "lo" ({0-3, 8-11}) and in the "hi"
 * ({4-7, 12-15}) row order. */
static inline fvec_t order_lo(fvec_t a, fvec_t b) { return _mm256_permute2f128_ps(a, b, 0x20); }

static inline fvec_t order_hi(fvec_t a, fvec_t b) { return _mm256_permute2f128_ps(a, b, 0x31); }

#define FLOATS 8          /* floats a vector */
#if defined(__F16C__)
static inline fvec_t widen_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

static inline fvec_t widen_zero(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* out[0 .. 16) = the rows of lo and hi, back in row order, times x_scale. */
static inline void store_rows(float *out, fvec_t lo, fvec_t hi, float x_scale) {
    const __m256 scale = _mm256_set1_ps(x_scale);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x20), scale));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_permute2f128_ps(lo, hi, 0x31), scale));
}

static inline fvec_t fzero(void) { return _mm256_setzero_ps(); }
static inline fvec_t fsplat(float value) { return _mm256_set1_ps(value); }
static inline fvec_t to_float(acc_t acc) { return _mm256_cvtepi32_ps(acc); }
static inline fvec_t fmul(fvec_t a, fvec_t b) { return _mm256_mul_ps(a, b); }
static inline fvec_t fload(const float *p) { return _mm256_loadu_ps(p); }
#if defined(__FMA__)
static inline fvec_t fmadd(fvec_t a, fvec_t b, fvec_t c) { return _mm256_fmadd_ps(a, b, c); }
#else
static inline fvec_t fmadd(fvec_t a, fvec_t b, fvec_t c) { return _mm256_add_ps(_mm256_mul_ps(a, b), c); }
#endif
#endif

#if defined(LANES)
#define HALF_ROWS (PANEL / HALVES)    /* = 2 * FLOATS */

/* p[0 .. HALF_ROWS) in the "lo" and in the "hi" row order. */
static inline fvec_t rows_lo(const float *p) { return order_lo(fload(p), fload(p + FLOATS)); }

static inline fvec_t rows_hi(const float *p) { return order_hi(fload(p), fload(p + FLOATS)); }

#if !defined(__F16C__)
static inline fvec_t widen_half(const uint16_t *p) {
    float values[FLOATS];
    for (int i = 0; i < FLOATS; i++) values[i] = half_to_float(p[i]);
    return fload(values);
}
#endif

/* The scales (half floats) and offsets (-zero * scale, exact) of rows 0 .. HALF_ROWS of a
 * block, in the "lo" and "hi" row order. */
static inline void half_rows(const uint16_t *half, const uint8_t *zeros, fvec_t *s_lo, fvec_t *s_hi, fvec_t *o_lo,
                             fvec_t *o_hi) {
    const fvec_t s0 = widen_half(half), s1 = widen_half(half + FLOATS);
    const fvec_t o0 = fmul(fmul(widen_zero(zeros), fsplat(-1.0f)), s0);
    const fvec_t o1 = fmul(fmul(widen_zero(zeros + FLOATS), fsplat(-1.0f)), s1);
    *s_lo = order_lo(s0, s1), *s_hi = order_hi(s0, s1), *o_lo = order_lo(o0, o1), *o_hi = order_hi(o0, o1);
}
#define ACCS (2 * HALVES)  /* accumulators per activation row: lo and hi of each half */

/* acc[r][2 j], acc[r][2 j + 1] = the exact sums U of one block (codes c, `group` inputs) over
 * the panel's half h0 + j ("lo" and "hi" rows), j < nh, for activation rows x + r * in. */
static inline __attribute__((always_inline)) void block_products(const uint8_t *c, int h0, const int nh,
                                                                 int64_t group, const int16_t *x, int64_t in,
                                                                 const int nx, acc_t acc[CODES_TILE][ACCS]) {
    for (int r = 0; r < nx; r++)
        for (int j = 0; j < 2 * nh; j++) acc[r][j] = zero_acc();
    for (int64_t k = 0; k < group; k += 2) {
        const uint8_t *p = c + k * PANEL + h0 * HALF_ROWS;
        __builtin_prefetch(p + PREFETCH_AHEAD, 0, 3);
        for (int j = 0; j < nh; j++) {
            const acc_t c0 = widen_codes(p + j * HALF_ROWS), c1 = widen_codes(p + PANEL + j * HALF_ROWS);
            const acc_t lo = pairs_lo(c0, c1), hi = pairs_hi(c0, c1);
            for (int r = 0; r < nx; r++) {
                const acc_t xr = splat_pair(x + r * in + k);
                madd_into(&acc[r][2 * j], lo, xr);
                madd_into(&acc[r][2 * j + 1], hi, xr);
            }
        }
    }
}

/* rows[r][h0 * HALF_ROWS ..) = the outputs of halves h0 .. h0 + nh - 1 of one panel for
 * activation rows x .. x + nx - 1 (sums [nx, blocks]: the rows' block sums X, as floats). */
static inline __attribute__((always_inline)) void codes_halves(const uint8_t *codes, const float *scales,
                                                               const uint16_t *half, const uint8_t *zeros,
                                                               const float *offsets, int64_t group, int64_t in,
                                                               const int16_t *x, const float *x_scale,
                                                               const float *sums, const int nx, int h0,
                                                               const int nh, float rows[CODES_TILE][PANEL]) {
    const int64_t blocks = in / group;
    fvec_t total[CODES_TILE][ACCS];
    for (int r = 0; r < nx; r++)
        for (int j = 0; j < 2 * nh; j++) total[r][j] = fzero();
    for (int64_t b = 0; b < blocks; b++) {
        acc_t acc[CODES_TILE][ACCS];
        block_products(codes + b * group * PANEL, h0, nh, group, x + b * group, in, nx, acc);
        for (int j = 0; j < nh; j++) {
            const int h = h0 + j;
            fvec_t s_lo, s_hi, o_lo, o_hi;
            if (half != NULL) {     /* offset = -zero * scale, exactly */
                half_rows(half + b * PANEL + h * HALF_ROWS, zeros + b * PANEL + h * HALF_ROWS, &s_lo, &s_hi, &o_lo,
                          &o_hi);
            } else {
                const float *s = scales + b * PANEL + h * HALF_ROWS, *o = offsets + b * PANEL + h * HALF_ROWS;
                s_lo = rows_lo(s), s_hi = rows_hi(s), o_lo = rows_lo(o), o_hi = rows_hi(o);
            }
            for (int r = 0; r < nx; r++) {
                const fvec_t block_sum = fsplat(sums[r * blocks + b]);
                total[r][2 * j] = fmadd(o_lo, block_sum, fmadd(to_float(acc[r][2 * j]), s_lo, total[r][2 * j]));
                total[r][2 * j + 1] = fmadd(o_hi, block_sum,
                                            fmadd(to_float(acc[r][2 * j + 1]), s_hi, total[r][2 * j + 1]));
            }
        }
    }
    for (int r = 0; r < nx; r++)
        for (int j = 0; j < nh; j++)
            store_rows(rows[r] + (h0 + j) * HALF_ROWS, total[r][2 * j], total[r][2 * j + 1], x_scale[r]);
}

/* Activation rows x .. x + nx - 1 against one panel of codes (nx a constant at every call site).
 * Up to SHARED_HALVES_ROWS rows take the panel's halves in one pass, reading each input entry's
 * codes once (so few rows stream the codes from memory); more rows take a half a pass, which
 * holds 2 int and 2 float vectors a row: AVX2's 16 registers then hold the int ones of 3 rows.
 * Either way each output gets the same operations in the same order. */
static inline __attribute__((always_inline)) void codes_tile(const uint8_t *codes, const float *scales,
                                                             const uint16_t *half, const uint8_t *zeros,
                                                             const float *offsets, int64_t group, int64_t in,
                                                             const int16_t *x, const float *x_scale,
                                                             const float *sums, const int nx, float *out,
                                                             int64_t vocab, int valid, float *maxima,
                                                             int64_t panels) {
    float rows[CODES_TILE][PANEL];
    if (HALVES == 1 || nx <= SHARED_HALVES_ROWS)
        codes_halves(codes, scales, half, zeros, offsets, group, in, x, x_scale, sums, nx, 0, HALVES, rows);
    else
        for (int h = 0; h < HALVES; h++)
            codes_halves(codes, scales, half, zeros, offsets, group, in, x, x_scale, sums, nx, h, 1, rows);
    for (int r = 0; r < nx; r++) {
        memcpy(out + r * vocab, rows[r], sizeof(float) * valid);
        if (maxima != NULL) maxima[r * panels] = max_of(rows[r], valid);
    }
}

#define CODES_CASE(NX) \
    case NX: \
        if ((NX) <= CODES_TILE) \
            codes_tile(codes, scales, half, zeros, offsets, group, in, x, x_scale, sums, NX, out, vocab, valid, \
                       maxima, panels); \
        break;

static void codes_dispatch(const uint8_t *codes, const float *scales, const uint16_t *half, const uint8_t *zeros,
                           const float *offsets, int64_t group, int64_t in, const int16_t *x, const float *x_scale,
                           const float *sums, int nx,
                           float *out, int64_t vocab, int valid, float *maxima, int64_t panels) {
    switch (nx) {
        CODES_CASE(1) CODES_CASE(2) CODES_CASE(3) CODES_CASE(4) CODES_CASE(5) CODES_CASE(6) CODES_CASE(7)
        CODES_CASE(8)
        default: break;
    }
}
#else
#define CODES_TILE 4
/* One output at a time, the same operations in the same order as the vector paths. */
static void codes_dispatch(const uint8_t *codes, const float *scales, const uint16_t *half, const uint8_t *zeros,
                           const float *offsets, int64_t group, int64_t in, const int16_t *x, const float *x_scale,
                           const float *sums, int nx,
                           float *out, int64_t vocab, int valid, float *maxima, int64_t panels) {
    const int64_t blocks = in / group;
    for (int r = 0; r < nx; r++) {
        for (int n = 0; n < valid; n++) {
            float total = 0.0f;
            for (int64_t b = 0; b < blocks; b++) {
                int32_t sum = 0;
                for (int64_t i = b * group; i < (b + 1) * group; i++)
                    sum += (int32_t)codes[i * PANEL + n] * (int32_t)x[r * in + i];
                const float scale = half != NULL ? half_to_float(half[b * PANEL + n]) : scales[b * PANEL + n];
                const float offset = half != NULL ? -(float)zeros[b * PANEL + n] * scale : offsets[b * PANEL + n];
                total = fmaf((float)sum, scale, total);
                total = fmaf(offset, sums[r * blocks + b], total);
            }
            out[r * vocab + n] = total * x_scale[r];
        }
        if (maxima != NULL) maxima[r * panels] = max_of(out + r * vocab, valid);
    }
}
#endif

/* sums[m, b] = X[m, b] (exact: |X| <= 2^15 * MAX_GROUP = 2^23). */
static void block_sums(const int16_t *x, int64_t rows, int64_t in, int64_t group, float *sums) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t b = 0; b < in / group; b++) {
            int32_t sum = 0;
            for (int64_t i = 0; i < group; i++) sum += x[m * in + b * group + i];
            sums[m * (in / group) + b] = (float)sum;
        }
}

/* The codes kernel over the whole head: scales and offsets as floats, or (half != NULL) the
 * scales as half floats and each offset as -zero * scale, zero a byte. 0, or 1 for shapes it
 * does not take (an empty head, an odd group or one past MAX_GROUP, in not a multiple of it),
 * 2 when it cannot allocate the block sums. */
static int codes_screen_run(const uint8_t *codes, const float *scales, const uint16_t *half, const uint8_t *zeros,
                            const float *offsets, int64_t group, const int16_t *x, const float *x_scale,
                            float *out, float *maxima, int64_t vocab, int64_t in, int64_t rows,
                            const int64_t *listed, int64_t listed_count, int64_t num_threads) {
    if (vocab <= 0 || in <= 0 || group <= 0 || group % 2 || group > MAX_GROUP || in % group || rows < 0) return 1;
    const int64_t count = (vocab + PANEL - 1) / PANEL, blocks = in / group;
    for (int64_t i = 0; listed != NULL && i < listed_count; i++)
        if (listed[i] < 0 || listed[i] >= count) return 1;
    if (rows == 0) return 0;
    float *sums = malloc(sizeof(float) * rows * blocks);
    if (sums == NULL) return 2;
    block_sums(x, rows, in, group, sums);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < (listed != NULL ? listed_count : count); i++) {
        const int64_t p = listed != NULL ? listed[i] : i;
        const int valid = vocab - p * PANEL < PANEL ? (int)(vocab - p * PANEL) : PANEL;
        /* The rows spread evenly over the fewest tiles (9 rows: 4 + 5, not 8 + 1: a pass of one
         * row costs about twice as much a row as a wider one). Each tile takes the rows left
         * over the tiles left, rounded down, so 1 <= nx <= CODES_TILE. */
        const int64_t tiles = (rows + CODES_TILE - 1) / CODES_TILE;
        for (int64_t t = 0, m0 = 0; t < tiles; t++) {
            const int nx = (int)((rows - m0) / (tiles - t));
            codes_dispatch(codes + p * in * PANEL, half != NULL ? NULL : scales + p * blocks * PANEL,
                           half != NULL ? half + p * blocks * PANEL : NULL,
                           half != NULL ? zeros + p * blocks * PANEL : NULL,
                           half != NULL ? NULL : offsets + p * blocks * PANEL, group, in, x + m0 * in,
                           x_scale + m0, sums + m0 * blocks, nx, out + m0 * vocab + p * PANEL, vocab, valid,
                           maxima != NULL ? maxima + m0 * count + p : NULL, count);
            m0 += nx;
        }
    }
    free(sums);
    return 0;
}

int fairserve_codes_screen(const uint8_t *codes, const float *scales, const float *offsets, int64_t group,
                           const int16_t *x, const float *x_scale, float *out, float *maxima, int64_t vocab,
                           int64_t in, int64_t rows, int64_t num_threads) {
    return codes_screen_run(codes, scales, NULL, NULL, offsets, group, x, x_scale, out, maxima, vocab, in, rows,
                            NULL, 0, num_threads);
}

/* The same outputs, bit for bit, for codes whose scales are half floats exactly and whose
 * offsets are -zero * scale (exactly, zero a byte): 1 + 3/32 bytes a weight read where the
 * float scales and offsets make it 1 + 1/4 (one row streams the head: bound by its bytes). */
int fairserve_codes_screen_half(const uint8_t *codes, const uint16_t *half_scales, const uint8_t *zeros,
                                int64_t group, const int16_t *x, const float *x_scale, float *out, float *maxima,
                                int64_t vocab, int64_t in, int64_t rows, int64_t num_threads) {
    return codes_screen_run(codes, NULL, half_scales, zeros, NULL, group, x, x_scale, out, maxima, vocab, in, rows,
                            NULL, 0, num_threads);
}

/* fairserve_codes_screen_half over the panels listed[0 .. count) alone (each once, in range, else
 * 1 and nothing written): their outputs and maxima, bit for bit those of the whole pass; nothing
 * else is written (codes_plane.py: the panels the plane's upper values could not rule out). */
int fairserve_codes_screen_half_panels(const uint8_t *codes, const uint16_t *half_scales, const uint8_t *zeros,
                                       int64_t group, const int16_t *x, const float *x_scale, float *out,
                                       float *maxima, int64_t vocab, int64_t in, int64_t rows, const int64_t *listed,
                                       int64_t count, int64_t num_threads) {
    if (listed == NULL || count < 0) return 1;
    return codes_screen_run(codes, NULL, half_scales, zeros, NULL, group, x, x_scale, out, maxima, vocab, in, rows,
                            listed, count, num_threads);
}
