/* Linear layers over weights that are exact 8-bit codes, for few rows (decode steps), CPU;
 * codes that fit in 4-6 bits may be kept narrow (below), with the same outputs bit for bit.
 *
 * Weights dequantized from a quantized checkpoint (GGUF's Q4_K, Q5_0, Q6_K, Q8_0 ...) hold,
 * in float32, only a few distinct values per block of the input dimension: within each
 * group of G consecutive entries of a weight row,
 *
 *   weight[n, k] == scale[n, g] * code[n, k] + offset[n, g]     exactly, code in 0..255,
 *
 * whether that expression is rounded once (a fused multiply-add) or twice. Such a matrix
 * is kept as its codes (1 byte an entry) and two floats a group, about a third of the
 * float32 bytes, and every step expands the codes back into the same float32 weights in
 * registers: the products and sums are the float32 linear's, in the order of the few-row
 * float32 kernel (skinny_linear.c), on a third of the memory traffic that bounds decode.
 *
 * fairserve_codes_find checks a float32 matrix and writes its codes; it reports a matrix
 * that does not fit (any group with more than 256 levels, levels not on one grid, values
 * that the expression does not give back bit for bit), so the caller keeps the float32
 * weight for it. fairserve_coded_linear is the linear:
 *
 *   out[m, n] = sum_k x[m, k] * weight[n, k] (+ bias[n])
 *
 * from codes of `bits` 8, or 4, 5 or 6 (narrow codes: fairserve_codes_narrow packs a panel's
 * bytes, fairserve_codes_widen unpacks them).
 *
 * Layouts (all contiguous): weight [out, in] float; for fairserve_codes_find codes [out, in]
 * uint8, scales and offsets [out, in / G] float; for the linear the same in panels (below);
 * x [rows, in], bias [out] or NULL, out [rows, out]. in is a multiple of G, and G of 16.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "half_scales.h"
#include "vec8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define PANEL 32          /* output rows a vector group holds */
#if defined(__AVX512F__)
#define LANES 16
/* Activation rows a pass: up to 12 x 2 accumulators, the panel's 2 weight vectors and their 2
 * scales and 2 offsets in AVX-512's 32 registers. A step of 9-12 rows in one pass instead of
 * 8 here and the rest in the chunked passes below ran the default model's 126 projections
 * 20 % faster (10 rows: 14.5 -> 11.6 ms on a 2-core AMD EPYC Zen 4, a one-off harness). */
#define X_TILE 12
/* Up to this many rows, passes of tile() as even as they can be (16 rows: 8 + 8, each pass
 * expanding the codes again) beat the chunked passes by 3-7 % on the same machine; from ~26
 * rows on the chunked passes win (one expansion into L1 for them all). */
#define TILE_ROWS 24
#define CHUNK_TILE 8      /* chunk_pass: rows a pass, over CHUNK_VECTORS vectors of the panel */
#define CHUNK_VECTORS 2
#else
#define LANES 8
#define X_TILE 2          /* 2 x 4 accumulators of AVX2's 16 */
#define TILE_ROWS X_TILE
/* Half a panel for 4 rows: its 2 weight vectors stay in registers for 8 accumulators (on a
 * 2-core AMD EPYC Zen 3, 5-10 % faster at 8-30 rows than 2 rows over the whole panel, whose
 * multiply-adds each reload their weight vector from the buffer). */
#define CHUNK_TILE 4
#define CHUNK_VECTORS 2
#endif
#define VECTORS (PANEL / LANES)
#define MAX_CODE 255
/* Prefetch distance into the code stream, in bytes (as skinny_linear.c's 8 KB of floats). */
#define PREFETCH_AHEAD 2048

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

/* ---- finding the codes -------------------------------------------------------------- */

/* The remainder of x / y as fmodf gives it, from the quotient's estimate (exact when it is
 * the quotient; one off is put right, anything worse only ends in a grid the codes refuse). */
static inline float quick_remainder(float x, float y) {
    float r = fmaf(-truncf(x / y), y, x);
    if (r < 0.0f) r += y;
    else if (r >= y) r -= y;
    return r;
}

/* The largest float that both nonnegative x and y are integer multiples of (Euclid), or 0 once
 * it falls below `floor` (the group then needs too many levels). `quick`: quick_remainder
 * instead of the exact fmodf (the codes check the grid afterwards). */
static float grid_gcd(float x, float y, float floor, int quick) {
    if (x < y) {
        const float t = x;
        x = y;
        y = t;
    }
    while (y > 0.0f) {
        if (y < floor) return 0.0f;
        const float r = quick ? quick_remainder(x, y) : fmodf(x, y);
        x = y;
        y = r;
    }
    return x;
}

/* The codes of one group on `grid` from `lo`; 0 if one of them is out of range or does not
 * give its weight back bit for bit. */
#if defined(__AVX512F__)
#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* `exact` and the range test for 16 codes: the explicitly rounded multiply and add are never
 * contracted into one multiply-add, as `exact`'s volatile product is not. */
static inline int codes_exact(__m512 code, __m512 value, __m512 low, __m512 step) {
    __mmask16 ok = _mm512_cmp_ps_mask(code, _mm512_setzero_ps(), _CMP_GE_OQ)
                   & _mm512_cmp_ps_mask(code, _mm512_set1_ps((float)MAX_CODE), _CMP_LE_OQ);
    ok &= _mm512_cmp_ps_mask(_mm512_fmadd_ps(step, code, low), value, _CMP_EQ_OQ);
    const __m512 product = _mm512_mul_round_ps(step, code, NEAREST);
    ok &= _mm512_cmp_ps_mask(_mm512_add_round_ps(product, low, NEAREST), value, _CMP_EQ_OQ);
    return ok == 0xFFFF;
}

/* 16 weights at a time, the same tests as below. */
static int write_codes(const float *w, int64_t group, float lo, float grid, uint8_t *codes) {
    const __m512 low = _mm512_set1_ps(lo), step = _mm512_set1_ps(grid);
    const __m512 inverse = _mm512_set1_ps(1.0f / grid);
    for (int64_t k = 0; k < group; k += 16) {
        const __m512 value = _mm512_loadu_ps(w + k), above = _mm512_sub_ps(value, low);
        /* By the reciprocal first (a division costs as much as the rest); a quotient it
         * rounds to another code is taken again by the division itself. */
        __m512 code = _mm512_roundscale_ps(_mm512_mul_ps(above, inverse), NEAREST);
        if (!codes_exact(code, value, low, step)) {
            code = _mm512_roundscale_ps(_mm512_div_ps(above, step), NEAREST);
            if (!codes_exact(code, value, low, step)) return 0;
        }
        _mm_storeu_si128((__m128i *)(codes + k), _mm512_cvtusepi32_epi8(_mm512_cvttps_epu32(code)));
    }
    return 1;
}
#else
/* Whether scale * code + offset gives `value` back whether rounded once or twice. */
static int exact(float scale, float code, float offset, float value) {
    volatile float product = scale * code;     /* kept apart: the twice-rounded form */
    return fmaf(scale, code, offset) == value && product + offset == value;
}

static int write_codes(const float *w, int64_t group, float lo, float grid, uint8_t *codes) {
    for (int64_t k = 0; k < group; k++) {
        const float code = rintf((w[k] - lo) / grid);
        if (!(code >= 0.0f && code <= (float)MAX_CODE) || !exact(grid, code, lo, w[k])) return 0;
        codes[k] = (uint8_t)code;
    }
    return 1;
}
#endif

/* A group's lowest and highest weights and its smallest step above the lowest (hi - lo when
 * there is none); 0 when they are not finite (a NaN weight fails its code later). */
#if defined(__AVX512F__)
static int group_range(const float *w, int64_t group, float *lo, float *hi, float *smallest) {
    __m512 low = _mm512_loadu_ps(w), high = low;
    for (int64_t k = 16; k < group; k += 16) {
        const __m512 value = _mm512_loadu_ps(w + k);
        low = _mm512_min_ps(low, value);
        high = _mm512_max_ps(high, value);
    }
    *lo = _mm512_reduce_min_ps(low);
    *hi = _mm512_reduce_max_ps(high);
    if (!isfinite(*lo) || !isfinite(*hi)) return 0;
    const __m512 floor = _mm512_set1_ps(*lo);
    __m512 least = _mm512_set1_ps(*hi - *lo);
    for (int64_t k = 0; k < group; k += 16) {
        const __m512 step = _mm512_sub_ps(_mm512_loadu_ps(w + k), floor);
        const __mmask16 above = _mm512_cmp_ps_mask(step, _mm512_setzero_ps(), _CMP_GT_OQ);
        least = _mm512_mask_min_ps(least, above, least, step);
    }
    *smallest = _mm512_reduce_min_ps(least);
    return 1;
}
#else
static int group_range(const float *w, int64_t group, float *lo, float *hi, float *smallest) {
    *lo = *hi = w[0];
    for (int64_t k = 1; k < group; k++) {
        *lo = w[k] < *lo ? w[k] : *lo;
        *hi = w[k] > *hi ? w[k] : *hi;
    }
    if (!isfinite(*lo) || !isfinite(*hi)) return 0;
    *smallest = *hi - *lo;
    for (int64_t k = 0; k < group; k++) {
        const float step = w[k] - *lo;
        *smallest = step > 0.0f && step < *smallest ? step : *smallest;
    }
    return 1;
}
#endif

#if defined(__AVX512F__)
/* gcd_grid's quick form 16 steps at a time: from the smallest step, the grid and the first
 * step off it, until none is; 0 when it finds none (the caller then searches exactly). */
static float vector_gcd_grid(const float *w, int64_t group, float lo, float hi, float smallest) {
    const float floor = (hi - lo) / (float)MAX_CODE * (1.0f - 1e-6f);
    const __m512 low = _mm512_set1_ps(lo), zero = _mm512_setzero_ps();
    float grid = smallest;
    for (int64_t k = 0; k < group;) {
        const __m512 step = _mm512_sub_ps(_mm512_loadu_ps(w + k), low), spacing = _mm512_set1_ps(grid);
        const __m512 levels = _mm512_roundscale_ps(_mm512_mul_ps(step, _mm512_set1_ps(1.0f / grid)), NEAREST);
        const __mmask16 off = _mm512_cmp_ps_mask(step, zero, _CMP_GT_OQ)
                              & _mm512_cmp_ps_mask(_mm512_mul_round_ps(levels, spacing, NEAREST), step, _CMP_NEQ_UQ);
        if (!off) {
            k += 16;
            continue;
        }
        /* A step off the grid makes it smaller; one that does not (rounding) is left to the
         * exact search rather than tried again. */
        const float next = grid_gcd(grid, w[k + __builtin_ctz(off)] - lo, floor, 1);
        if (!(next > 0.0f && next < grid)) return 0.0f;
        grid = next;
    }
    return grid;
}
#endif

/* The grid of a group's steps above `lo` by Euclid over them (when the smallest step is not
 * the grid). `quick`: remainders and the on-the-grid test without libm's fmodf or a division
 * per weight, checked by the codes afterwards; else exact ones (the caller's second try). */
static float gcd_grid(const float *w, int64_t group, float lo, float hi, int quick) {
    const float floor = (hi - lo) / (float)MAX_CODE * (1.0f - 1e-6f);
    float grid = 0.0f, inverse = 0.0f;
    for (int64_t k = 0; k < group; k++) {
        const float step = w[k] - lo;
        if (step <= 0.0f) continue;
        if (grid > 0.0f && rintf(quick ? step * inverse : step / grid) * grid == step) continue;  /* on the grid */
        if (grid == 0.0f) {
            grid = step;
        } else {
            grid = grid_gcd(grid, step, floor, quick);
        }
        if (grid == 0.0f) return 0.0f;
        inverse = 1.0f / grid;
    }
    return grid;
}

/* One group of `group` entries: its codes, scale and offset; 0 if it does not fit.
 * A quantized checkpoint's group nearly always holds a weight one level above its lowest,
 * so the smallest step is tried as the grid first: if every code it gives is exact, it is
 * the steps' greatest common divisor (each step is a multiple of it, and it is a step).
 * Euclid over the steps (fmodf per weight off the grid: most of the start-up time of this
 * search before) runs only for the groups where it is not. */
static int find_group(const float *w, int64_t group, uint8_t *codes, float *scale, float *offset) {
    float lo, hi, smallest;
    if (!group_range(w, group, &lo, &hi, &smallest)) return 0;
    float grid = smallest > 0.0f ? smallest : 1.0f;    /* a constant group: every code 0 */
    if (!write_codes(w, group, lo, grid, codes)) {
#if defined(__AVX512F__)
        grid = vector_gcd_grid(w, group, lo, hi, smallest);
#else
        grid = gcd_grid(w, group, lo, hi, 1);
#endif
        if (grid == 0.0f || !write_codes(w, group, lo, grid, codes)) {
            grid = gcd_grid(w, group, lo, hi, 0);
            if (grid == 0.0f || !write_codes(w, group, lo, grid, codes)) return 0;
        }
    }
    *scale = grid;
    *offset = lo;
    return 1;
}

/* Codes of weight [rows, in] in groups of `group`; returns 0 when every group fits, else 1
 * (the outputs are then partial and unused). */
int fairserve_codes_find(const float *weight, int64_t rows, int64_t in, int64_t group, uint8_t *codes,
                         float *scales, float *offsets, int64_t num_threads) {
    if (group <= 0 || group % LANES || in % group) return 1;
    const int64_t groups_per_row = in / group;
    const int64_t groups = rows * groups_per_row;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < groups; g++) {
        int stop;
#pragma omp atomic read
        stop = failed;
        if (stop) continue;
        const int64_t row = g / groups_per_row, start = row * in + (g % groups_per_row) * group;
        if (!find_group(weight + start, group, codes + start, scales + g, offsets + g)) {
#pragma omp atomic write
            failed = 1;
        }
    }
    return failed;
}

/* ---- the linear ------------------------------------------------------------------------ */

/* The codes are kept in panels of PANEL output rows: codes [out / PANEL][in][PANEL], scales
 * and offsets [out / PANEL][in / G][PANEL]. A vector then holds one input entry's weights
 * for LANES output rows, so each activation entry is broadcast and multiplied into whole
 * vectors of outputs: no horizontal sums, and each code expanded once for every activation
 * row of a pass. Each output is one chain of multiply-adds over k in order. */

/* A broadcast straight from memory (`(vf){0} + value` costs an add and a shuffle per call). */
static inline vf splat(const float *value) {
#if LANES == 16
    return (vf)_mm512_set1_ps(*value);
#elif defined(__AVX2__)
    return (vf)_mm256_set1_ps(*value);
#else
    return (vf){0} + *value;
#endif
}

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* LANES codes as floats (a widening load and a conversion). */
static inline vf code_floats(const uint8_t *codes) {
#if LANES == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
#else
    vf v;
    for (int i = 0; i < LANES; i++) v[i] = (float)codes[i];
    return v;
#endif
}

/* LANES weights from their codes: scale * code + offset (one multiply-add a vector). */
static inline vf expand(const uint8_t *codes, vf scale, vf offset) {
    return code_floats(codes) * scale + offset;
}

/* ---- narrow codes ----------------------------------------------------------------------
 * Codes of at most 4 + H bits (H = 0, 1, 2) are kept in 16 + 4 H bytes per input entry of a
 * panel instead of PANEL: 16 bytes of nibbles (byte j: row j's low 4 bits in its low nibble,
 * row j + 16's in its high one), then H little-endian 32-bit words, word h holding bit 4 + h
 * of row i's code at bit i. Unpacked, a code is the same integer as its byte in the 8-bit
 * layout, so its float and the weight expanded from it are the same bit for bit. */

static inline int64_t narrow_stride(int64_t bits) { return 16 + 4 * (bits - 4); }

#if LANES == 16
/* Vector v's (rows 16 v .. 16 v + 15) codes as floats. The low 4 bits pick their float from a
 * table of 0 .. 15 (a permute reads only an index's low 4 bits, so neither a mask nor a
 * conversion is needed), and each higher bit adds its power of two, exactly: the same floats
 * as converting the assembled code, in fewer instructions (one-row linears over the default
 * model's 4-bit codes ~11 % faster, 5-bit ones ~7 %, on a 2-core AMD EPYC Zen 4). */
static inline vf narrow_code_floats(const uint8_t *p, int high_bits, int v) {
    const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 code = _mm512_permutexvar_ps(v == 0 ? bytes : _mm512_srli_epi32(bytes, 4), low);
    for (int h = 0; h < high_bits; h++) {
        uint32_t word;
        __builtin_memcpy(&word, p + 16 + 4 * h, sizeof word);
        code = _mm512_mask_add_ps(code, (__mmask16)(word >> (16 * v)), code, _mm512_set1_ps((float)(16 << h)));
    }
    return (vf)code;
}
#elif defined(__AVX2__)
static inline vf narrow_code_floats(const uint8_t *p, int high_bits, int v) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * (v & 1))));
    __m256i code = _mm256_and_si256(v < 2 ? bytes : _mm256_srli_epi32(bytes, 4), _mm256_set1_epi32(15));
    const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int h = 0; h < high_bits; h++) {
        uint32_t word;
        __builtin_memcpy(&word, p + 16 + 4 * h, sizeof word);
        const __m256i mine = _mm256_and_si256(_mm256_set1_epi32((int)((word >> (8 * v)) & 255)), lane_bits);
        const __m256i set = _mm256_cmpeq_epi32(mine, lane_bits);
        code = _mm256_add_epi32(code, _mm256_and_si256(set, _mm256_set1_epi32(16 << h)));
    }
    return (vf)_mm256_cvtepi32_ps(code);
}
#else
static inline vf narrow_code_floats(const uint8_t *p, int high_bits, int v) {
    vf out;
    for (int i = 0; i < LANES; i++) {
        const int row = v * LANES + i;
        int code = (p[row & 15] >> (row & 16 ? 4 : 0)) & 15;
        for (int h = 0; h < high_bits; h++) {
            uint32_t word;
            __builtin_memcpy(&word, p + 16 + 4 * h, sizeof word);
            code += (int)((word >> row) & 1) << (4 + h);
        }
        out[i] = (float)code;
    }
    return out;
}
#endif

/* The PANEL weights of one input entry: bits 8 reads a byte a code, else narrow codes. */
static inline __attribute__((always_inline)) void expand_entry(const uint8_t *codes, const int bits,
                                                              const vf *scale, const vf *offset, vf *w) {
    for (int v = 0; v < VECTORS; v++)
        w[v] = bits == 8 ? expand(codes + v * LANES, scale[v], offset[v])
                         : narrow_code_floats(codes, bits - 4, v) * scale[v] + offset[v];
}

/* codes [rows][PANEL] bytes as narrow codes of `bits` (4, 5 or 6: 4 + H), [rows][16 + 4 H];
 * returns 1 if a code needs more bits. */
int fairserve_codes_narrow(const uint8_t *codes, int64_t rows, int64_t bits, uint8_t *narrow) {
    if (bits < 4 || bits > 6) return 1;
    const int64_t stride = narrow_stride(bits);
    for (int64_t k = 0; k < rows; k++) {
        const uint8_t *c = codes + k * PANEL;
        uint8_t *n = narrow + k * stride;
        uint32_t words[2] = {0, 0};
        for (int i = 0; i < PANEL; i++) {
            if (c[i] >> bits) return 1;
            if (i < 16) n[i] = (uint8_t)((c[i] & 15) | ((c[i + 16] & 15) << 4));
            for (int h = 0; h < bits - 4; h++) words[h] |= (uint32_t)((c[i] >> (4 + h)) & 1) << i;
        }
        __builtin_memcpy(n + 16, words, 4 * (size_t)(bits - 4));
    }
    return 0;
}

/* The inverse: narrow codes [rows][16 + 4 H] back to [rows][PANEL] bytes (the start-up check,
 * and rows looked up from the codes). */
void fairserve_codes_widen(const uint8_t *narrow, int64_t rows, int64_t bits, uint8_t *codes) {
    const int64_t stride = narrow_stride(bits);
    for (int64_t k = 0; k < rows; k++) {
        const uint8_t *n = narrow + k * stride;
        uint32_t words[2] = {0, 0};
        __builtin_memcpy(words, n + 16, 4 * (size_t)(bits - 4));
        for (int i = 0; i < PANEL; i++) {
            int code = (n[i & 15] >> (i & 16 ? 4 : 0)) & 15;
            for (int h = 0; h < bits - 4; h++) code |= (int)((words[h] >> i) & 1) << (4 + h);
            codes[k * PANEL + i] = (uint8_t)code;
        }
    }
}

/* out[r, 0 .. PANEL) = activation row r (r < nx) times one panel; nx is a constant at every
 * call site, so the nx * VECTORS accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const uint8_t *c, const float *scales, const float *offsets,
                                                       int64_t group, const int bits, const float *x, int64_t in,
                                                       const int nx, const float *bias, float *out,
                                                       int64_t out_stride, int valid) {
    const int64_t stride = bits == 8 ? PANEL : narrow_stride(bits);
    vf acc[X_TILE][VECTORS];
    for (int r = 0; r < nx; r++)
        for (int v = 0; v < VECTORS; v++) acc[r][v] = (vf){0};
    for (int64_t g = 0; g < in / group; g++) {
        vf scale[VECTORS], offset[VECTORS];
        for (int v = 0; v < VECTORS; v++) {
            scale[v] = loadv(scales + g * PANEL + v * LANES);
            offset[v] = loadv(offsets + g * PANEL + v * LANES);
        }
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            const uint8_t *codes = c + k * stride;
            if ((k & 1) == 0) __builtin_prefetch(codes + PREFETCH_AHEAD, 0, 3);
            vf w[VECTORS];
            expand_entry(codes, bits, scale, offset, w);
            for (int r = 0; r < nx; r++) {
                const vf xr = splat(x + r * in + k);
                for (int v = 0; v < VECTORS; v++) acc[r][v] += w[v] * xr;
            }
        }
    }
    for (int r = 0; r < nx; r++) {
        float row[PANEL];
        float *to = valid == PANEL ? out + r * out_stride : row;
        for (int v = 0; v < VECTORS; v++) storev(to + v * LANES, acc[r][v]);
        for (int n = 0; n < valid; n++) out[r * out_stride + n] = to[n] + (bias != NULL ? bias[n] : 0.0f);
    }
}

#define TILE_CASE(NX, BITS) \
    case NX: if ((NX) <= X_TILE) tile(c, scales, offsets, group, BITS, x, in, NX, bias, out, out_stride, valid); break;
#define TILE_CASES(BITS) \
    switch (nx) { \
        TILE_CASE(1, BITS) TILE_CASE(2, BITS) TILE_CASE(3, BITS) TILE_CASE(4, BITS) \
        TILE_CASE(5, BITS) TILE_CASE(6, BITS) TILE_CASE(7, BITS) TILE_CASE(8, BITS) \
        TILE_CASE(9, BITS) TILE_CASE(10, BITS) TILE_CASE(11, BITS) TILE_CASE(12, BITS) \
        default: break; \
    }

static void dispatch(const uint8_t *c, const float *scales, const float *offsets, int64_t group, int64_t bits,
                     const float *x, int64_t in, int nx, const float *bias, float *out, int64_t out_stride,
                     int valid) {
    switch (bits) {
        case 4: TILE_CASES(4) break;
        case 5: TILE_CASES(5) break;
        case 6: TILE_CASES(6) break;
        default: TILE_CASES(8) break;
    }
}

/* ---- steps of more rows than one pass holds ------------------------------------------------
 * tile() expands every code again for each pass of X_TILE rows. For more than TILE_ROWS rows,
 * each chunk of CHUNK_ENTRIES input entries is expanded once into a buffer that stays in L1 and
 * every pass multiplies that, keeping its accumulators in memory between chunks. Each output is
 * still one chain of multiply-adds over k in order from the same expanded weights: tile()'s bits. */
#define CHUNK_ENTRIES 64

/* w[k][v] for the entries [k0, k0 + entries) of one panel. */
static inline __attribute__((always_inline)) void expand_chunk_bits(const uint8_t *c, const int bits,
                                                                    const float *scales, const float *offsets,
                                                                    int64_t group, int64_t k0, int64_t entries,
                                                                    vf *w) {
    const int64_t stride = bits == 8 ? PANEL : narrow_stride(bits);
    for (int64_t k = k0; k < k0 + entries; k++) {
        const int64_t g = k / group;
        vf scale[VECTORS], offset[VECTORS];
        for (int v = 0; v < VECTORS; v++) {
            scale[v] = loadv(scales + g * PANEL + v * LANES);
            offset[v] = loadv(offsets + g * PANEL + v * LANES);
        }
        if ((k & 1) == 0) __builtin_prefetch(c + k * stride + PREFETCH_AHEAD, 0, 3);
        expand_entry(c + k * stride, bits, scale, offset, w + (k - k0) * VECTORS);
    }
}

static void expand_chunk(const uint8_t *c, int64_t bits, const float *scales, const float *offsets, int64_t group,
                         int64_t k0, int64_t entries, vf *w) {
    switch (bits) {
        case 4: expand_chunk_bits(c, 4, scales, offsets, group, k0, entries, w); break;
        case 5: expand_chunk_bits(c, 5, scales, offsets, group, k0, entries, w); break;
        case 6: expand_chunk_bits(c, 6, scales, offsets, group, k0, entries, w); break;
        default: expand_chunk_bits(c, 8, scales, offsets, group, k0, entries, w); break;
    }
}

/* acc[r][v] += sum over the chunk's entries of w[k][v] * x[r, k], for nx (a constant) rows and
 * the panel's vectors v0 .. v0 + CHUNK_VECTORS - 1, whose weights are loaded once an entry. */
static inline __attribute__((always_inline)) void chunk_pass(const vf *w, int64_t entries, const float *x,
                                                             int64_t in, const int nx, int v0, vf *acc) {
    vf a[CHUNK_TILE][CHUNK_VECTORS];
    for (int r = 0; r < nx; r++)
        for (int v = 0; v < CHUNK_VECTORS; v++) a[r][v] = acc[r * VECTORS + v0 + v];
    for (int64_t k = 0; k < entries; k++) {
        vf wk[CHUNK_VECTORS];
        for (int v = 0; v < CHUNK_VECTORS; v++) wk[v] = w[k * VECTORS + v0 + v];
        for (int r = 0; r < nx; r++) {
            const vf xr = splat(x + r * in + k);
            for (int v = 0; v < CHUNK_VECTORS; v++) a[r][v] += wk[v] * xr;
        }
    }
    for (int r = 0; r < nx; r++)
        for (int v = 0; v < CHUNK_VECTORS; v++) acc[r * VECTORS + v0 + v] = a[r][v];
}

#define PASS_CASE(NX) case NX: if ((NX) <= CHUNK_TILE) \
    for (int v0 = 0; v0 < VECTORS; v0 += CHUNK_VECTORS) chunk_pass(w, entries, x, in, NX, v0, acc); break;

static void pass_of(const vf *w, int64_t entries, const float *x, int64_t in, int nx, vf *acc) {
    switch (nx) {
        PASS_CASE(1) PASS_CASE(2) PASS_CASE(3) PASS_CASE(4) PASS_CASE(5) PASS_CASE(6) PASS_CASE(7) PASS_CASE(8)
        default: break;
    }
}

/* tile() for any number of rows (up to MAX_CHUNKED_ROWS) against one panel. */
#define MAX_CHUNKED_ROWS 64

static void panel_rows(const uint8_t *c, const float *scales, const float *offsets, int64_t group, int64_t bits,
                       const float *x, int64_t in, int64_t rows, const float *bias, float *out, int64_t out_stride,
                       int valid) {
    vf w[CHUNK_ENTRIES * VECTORS], acc[MAX_CHUNKED_ROWS * VECTORS];
    for (int64_t i = 0; i < rows * VECTORS; i++) acc[i] = (vf){0};
    for (int64_t k0 = 0; k0 < in; k0 += CHUNK_ENTRIES) {
        const int64_t entries = in - k0 < CHUNK_ENTRIES ? in - k0 : CHUNK_ENTRIES;
        expand_chunk(c, bits, scales, offsets, group, k0, entries, w);
        for (int64_t m0 = 0; m0 < rows; m0 += CHUNK_TILE) {
            const int nx = rows - m0 < CHUNK_TILE ? (int)(rows - m0) : CHUNK_TILE;
            pass_of(w, entries, x + m0 * in + k0, in, nx, acc + m0 * VECTORS);
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        float row[PANEL];
        for (int v = 0; v < VECTORS; v++) storev(row + v * LANES, acc[r * VECTORS + v]);
        for (int n = 0; n < valid; n++) out[r * out_stride + n] = row[n] + (bias != NULL ? bias[n] : 0.0f);
    }
}

/* out = x @ weight.T (+ bias) from the panelled codes (the last panel padded with zero rows
 * when out_features is not a multiple of PANEL), of `bits` 8 (a byte a code) or 4, 5, 6
 * (narrow codes); returns nonzero on shapes it does not take (in not a multiple of group,
 * group not of LANES, other bits). The narrow codes give the same outputs bit for bit. */
static int coded_linear_run(const float *x, const uint8_t *codes, const float *scales, const float *offsets,
                            const uint16_t *half, const uint8_t *zeros, int64_t group, int64_t bits,
                            const float *bias, float *out, int64_t rows, int64_t in, int64_t out_features,
                            int64_t num_threads) {
    if (group <= 0 || group % LANES || in % group || (bits != 8 && (bits < 4 || bits > 6))) return 1;
    const int64_t panels = (out_features + PANEL - 1) / PANEL, groups_per_row = in / group;
    const int64_t panel_bytes = in * (bits == 8 ? PANEL : narrow_stride(bits)), count = groups_per_row * PANEL;
    if (half != NULL && count > MAX_PANEL_SCALES) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *c = codes + p * panel_bytes;
        float converted[half != NULL ? 2 * count : 1];
        const float *s = half != NULL ? NULL : scales + p * count, *o = half != NULL ? NULL : offsets + p * count;
        panel_scales(half != NULL ? half + p * count : NULL, half != NULL ? zeros + p * count : NULL, count,
                     converted, &s, &o);
        const float *b = bias != NULL ? bias + p * PANEL : NULL;
        const int valid = out_features - p * PANEL < PANEL ? (int)(out_features - p * PANEL) : PANEL;
        if (rows > TILE_ROWS && rows <= MAX_CHUNKED_ROWS) {
            panel_rows(c, s, o, group, bits, x, in, rows, b, out + p * PANEL, out_features, valid);
            continue;
        }
        /* ceil(rows / X_TILE) passes, as even as they can be (16 rows at up to 12 a pass: 8 + 8). */
        const int64_t passes = (rows + X_TILE - 1) / X_TILE;
        for (int64_t m0 = 0, pass = 0; m0 < rows; pass++) {
            const int nx = (int)((rows - m0) / (passes - pass));
            dispatch(c, s, o, group, bits, x + m0 * in, in, nx, b, out + m0 * out_features + p * PANEL,
                     out_features, valid);
            m0 += nx;
        }
    }
    return 0;
}

int fairserve_coded_linear(const float *x, const uint8_t *codes, const float *scales, const float *offsets,
                           int64_t group, int64_t bits, const float *bias, float *out, int64_t rows, int64_t in,
                           int64_t out_features, int64_t num_threads) {
    return coded_linear_run(x, codes, scales, offsets, NULL, NULL, group, bits, bias, out, rows, in, out_features,
                            num_threads);
}

/* The same outputs, bit for bit, from half-float scales and byte zeros (half_scales.h) instead
 * of float scales and offsets (8-bit or narrow codes alike); 1 also for a panel of more than
 * MAX_PANEL_SCALES scales. */
int fairserve_coded_linear_half(const float *x, const uint8_t *codes, const uint16_t *half, const uint8_t *zeros,
                                int64_t group, int64_t bits, const float *bias, float *out, int64_t rows,
                                int64_t in, int64_t out_features, int64_t num_threads) {
    return coded_linear_run(x, codes, NULL, NULL, half, zeros, group, bits, bias, out, rows, in, out_features,
                            num_threads);
}

/* expand_entry with `bits` known only at run time (one switch an entry, each case inlined). */
static inline void expand_entry_of(const uint8_t *codes, int64_t bits, const vf *scale, const vf *offset, vf *w) {
    switch (bits) {
        case 4: expand_entry(codes, 4, scale, offset, w); break;
        case 5: expand_entry(codes, 5, scale, offset, w); break;
        case 6: expand_entry(codes, 6, scale, offset, w); break;
        default: expand_entry(codes, 8, scale, offset, w); break;
    }
}

/* The weight back from its panelled codes: weight [out_features][in], row-major, for steps
 * wider than the linear above serves, which multiply it as a plain float32 matrix. A panel's
 * LANES input entries at a time are expanded as the linear expands them (so every value is
 * the one it uses, the float32 weight bit for bit: `find` checked it), into a small block
 * that is then written out row by row. With `half` (and `zeros`), from half-float scales and
 * byte zeros instead of `scales` and `offsets` (half_scales.h), the same values. */
int fairserve_codes_expand_rows(const uint8_t *codes, const float *scales, const float *offsets,
                                const uint16_t *half, const uint8_t *zeros, int64_t group, int64_t bits,
                                float *weight, int64_t in, int64_t out_features, int64_t num_threads) {
    if (group <= 0 || group % LANES || in % group || (bits != 8 && (bits < 4 || bits > 6))) return 1;
    const int64_t panels = (out_features + PANEL - 1) / PANEL, groups_per_row = in / group;
    const int64_t stride = bits == 8 ? PANEL : narrow_stride(bits), panel_bytes = in * stride;
    const int64_t count = groups_per_row * PANEL;
    if (half != NULL && count > MAX_PANEL_SCALES) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *c = codes + p * panel_bytes;
        float converted[half != NULL ? 2 * count : 1];
        const float *s = half != NULL ? NULL : scales + p * count, *o = half != NULL ? NULL : offsets + p * count;
        panel_scales(half != NULL ? half + p * count : NULL, half != NULL ? zeros + p * count : NULL, count,
                     converted, &s, &o);
        const int valid = out_features - p * PANEL < PANEL ? (int)(out_features - p * PANEL) : PANEL;
        for (int64_t k0 = 0; k0 < in; k0 += LANES) {
            const int64_t g = k0 / group;     /* LANES divides group: one group a block */
            vf scale[VECTORS], offset[VECTORS];
            for (int v = 0; v < VECTORS; v++) {
                scale[v] = loadv(s + g * PANEL + v * LANES);
                offset[v] = loadv(o + g * PANEL + v * LANES);
            }
            float block[LANES][PANEL];
            for (int j = 0; j < LANES; j++) {
                vf w[VECTORS];
                expand_entry_of(c + (k0 + j) * stride, bits, scale, offset, w);
                for (int v = 0; v < VECTORS; v++) storev(block[j] + v * LANES, w[v]);
            }
            for (int n = 0; n < valid; n++) {
                float *to = weight + (p * PANEL + n) * in + k0;
                for (int j = 0; j < LANES; j++) to[j] = block[j][n];
            }
        }
    }
    return 0;
}

/* The weight back from its panelled codes into a blocked layout [out_features / block][in]
 * [block]: entry (n, k) at ((n / block) * in + k) * block + n % block. That is how oneDNN
 * packs a float32 linear weight for its GEMM on the CPUs measured (block 64 with AVX-512),
 * so wide steps can multiply a pack written straight from the codes, without oneDNN
 * reordering a plain weight on every call. The values are the ones fairserve_codes_expand_rows
 * writes (the float32 weight bit for bit); only their places differ. `block` a multiple of
 * LANES, `out_features` a multiple of `block`. */
int fairserve_codes_expand_blocked(const uint8_t *codes, const float *scales, const float *offsets, int64_t group,
                                   int64_t bits, float *weight, int64_t in, int64_t out_features, int64_t block,
                                   int64_t num_threads) {
    if (group <= 0 || group % LANES || in % group || (bits != 8 && (bits < 4 || bits > 6))) return 1;
    if (block <= 0 || block % LANES || out_features % block) return 1;
    const int64_t panels = (out_features + PANEL - 1) / PANEL, groups_per_row = in / group;
    const int64_t stride = bits == 8 ? PANEL : narrow_stride(bits), panel_bytes = in * stride;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *c = codes + p * panel_bytes;
        const float *s = scales + p * groups_per_row * PANEL, *o = offsets + p * groups_per_row * PANEL;
        for (int64_t k = 0; k < in; k++) {
            const int64_t g = k / group;
            vf scale[VECTORS], offset[VECTORS], w[VECTORS];
            for (int v = 0; v < VECTORS; v++) {
                scale[v] = loadv(s + g * PANEL + v * LANES);
                offset[v] = loadv(o + g * PANEL + v * LANES);
            }
            expand_entry_of(c + k * stride, bits, scale, offset, w);
            for (int v = 0; v < VECTORS; v++) {
                const int64_t n = p * PANEL + v * LANES;     /* LANES divides block: one block a vector */
                if (n < out_features) storev(weight + ((n / block) * in + k) * block + n % block, w[v]);
            }
        }
    }
    return 0;
}
