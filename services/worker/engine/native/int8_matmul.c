/* Approximate LM head logits: int8 weight rows times int16 activation rows (CPU).
 *
 *   out[m, v] = (sum_e x[m, e] * w[v, e]) * x_scale[m] * w_scale[v]
 *
 * The sums are exact int32 (the caller keeps |x| * 127 * hidden below 2^31), so the only
 * rounding is the final float conversion and two multiplications. The weight (the bulk of
 * the bytes) is streamed once: each weight row is multiplied with every activation row
 * while it is in cache, up to eight activation rows at a time held in registers (tiles
 * of 1, 2, 4 or 8 rows: a tile of 3 computes a zero padding row).
 *
 * Layouts (all contiguous):
 *   weight  [V, H] int8, w_scale [V] float
 *   x       [R, H] int16 with R a multiple of 8 (rows past `rows` are zero padding)
 *   x_scale [R] float
 *   out     [rows, V] float
 */

#include <stdint.h>
#include <string.h>

#include "vec8.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 8           /* activation rows per pass */
#define BLOCK_ROWS 64    /* weight rows per block: re-read from cache by every tile after the first */
/* Software prefetch distance into the weight stream, in bytes, one prefetch per cache line:
 * without it the loads waited on the multiply-adds (on a 2-core Xeon the 262k x 640 head at
 * 8 rows took 14.3 ms without, 10.6 ms with; at 1 row 8.1 and 6.2 ms). */
#define PREFETCH_AHEAD 8192

static void scalar_row(const int8_t *w, const int16_t *x, int64_t hidden, int64_t from, int live,
                       int32_t *sums) {
    for (int r = 0; r < live; r++) {
        int32_t total = 0;
        for (int64_t e = from; e < hidden; e++) total += (int32_t)w[e] * (int32_t)x[r * hidden + e];
        sums[r] += total;
    }
}

#if defined(__AVX2__)
static inline int32_t sum_one(__m256i v) {
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i quarter = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
    return _mm_cvtsi128_si32(_mm_add_epi32(quarter, _mm_shuffle_epi32(quarter, 0xb1)));
}

/* sums[r] = the lanes of acc[r] added up, for r < live. */
static inline __attribute__((always_inline)) void reduce(const __m256i *acc, const int live, int32_t *sums) {
    if (live == TILE) {
        const __m256i s0 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[0], acc[1]), _mm256_hadd_epi32(acc[2], acc[3]));
        const __m256i s1 = _mm256_hadd_epi32(_mm256_hadd_epi32(acc[4], acc[5]), _mm256_hadd_epi32(acc[6], acc[7]));
        _mm256_storeu_si256((__m256i *)sums, _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20),
                                                              _mm256_permute2x128_si256(s0, s1, 0x31)));
    } else {
        for (int r = 0; r < live; r++) sums[r] = sum_one(acc[r]);
    }
}

/* acc[r] += the products of weight entries [e, e + 16k) with row r's, 16 entries a step
 * from `e` on while 16 are left (AVX2's vpmaddwd); returns where it stopped. */
static inline __attribute__((always_inline)) int64_t madd16(const int8_t *w, const int16_t *x, int64_t hidden,
                                                            const int live, int64_t e, __m256i *acc) {
    for (; e + 16 <= hidden; e += 16) {
        if ((e & 63) == 0) __builtin_prefetch(w + e + PREFETCH_AHEAD, 0, 3);
        const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + e)));
        for (int r = 0; r < live; r++)
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(wv, _mm256_loadu_si256((const __m256i *)(x + r * hidden + e))));
    }
    return e;
}

/* Sums of `live` (1, 2, 4 or 8) activation rows against one weight row; with `live`
 * a constant at each call site, the accumulators stay in registers. */
#if defined(__AVX512BW__)
/* 32 weight entries per step in one 512-bit register; with AVX512-VNNI the multiply and the
 * pairwise add into the int32 accumulator are one instruction (vpdpwssd). On a 2-core Xeon
 * the 262k x 640 head at 8 rows took 13.9 ms this way against 15.4 ms through the AVX2 path
 * (before the prefetch). */
static inline __m512i madd_acc(__m512i acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, w, x);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}

static inline __m256i fold(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

static inline __attribute__((always_inline)) void tile_rows(const int8_t *w, const int16_t *x, int64_t hidden,
                                                            const int live, int32_t *sums) {
    __m512i acc[TILE];
    for (int r = 0; r < live; r++) acc[r] = _mm512_setzero_si512();
    int64_t e = 0;
    for (; e + 32 <= hidden; e += 32) {
        if ((e & 63) == 0) __builtin_prefetch(w + e + PREFETCH_AHEAD, 0, 3);
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(w + e)));
        for (int r = 0; r < live; r++)
            acc[r] = madd_acc(acc[r], wv, _mm512_loadu_si512((const void *)(x + r * hidden + e)));
    }
    __m256i half[TILE];
    for (int r = 0; r < live; r++) half[r] = fold(acc[r]);
    e = madd16(w, x, hidden, live, e, half);
    reduce(half, live, sums);
    if (e < hidden) scalar_row(w, x, hidden, e, live, sums);
}
#else
static inline __attribute__((always_inline)) void tile_rows(const int8_t *w, const int16_t *x, int64_t hidden,
                                                            const int live, int32_t *sums) {
    __m256i acc[TILE];
    for (int r = 0; r < live; r++) acc[r] = _mm256_setzero_si256();
    const int64_t e = madd16(w, x, hidden, live, 0, acc);
    reduce(acc, live, sums);
    if (e < hidden) scalar_row(w, x, hidden, e, live, sums);
}
#endif

static void tile_row(const int8_t *w, const int16_t *x, int64_t hidden, int live, int32_t *sums) {
    switch (live) {
        case 1: tile_rows(w, x, hidden, 1, sums); break;
        case 2: tile_rows(w, x, hidden, 2, sums); break;
        case 3: case 4: tile_rows(w, x, hidden, 4, sums); break;
        default: tile_rows(w, x, hidden, TILE, sums); break;
    }
}
#else
static void tile_row(const int8_t *w, const int16_t *x, int64_t hidden, int live, int32_t *sums) {
    memset(sums, 0, sizeof(int32_t) * TILE);
    scalar_row(w, x, hidden, 0, live, sums);
}
#endif

int fairserve_int8_matmul(const int8_t *weight, const float *w_scale, const int16_t *x, const float *x_scale,
                          float *out, int64_t vocab, int64_t hidden, int64_t rows, int64_t padded_rows,
                          int64_t num_threads) {
    if (padded_rows % TILE || padded_rows < rows) return 1;
    const int64_t blocks = (vocab + BLOCK_ROWS - 1) / BLOCK_ROWS;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t block = 0; block < blocks; block++) {
        const int64_t first = block * BLOCK_ROWS;
        const int64_t last = first + BLOCK_ROWS < vocab ? first + BLOCK_ROWS : vocab;
        for (int64_t tile = 0; tile < padded_rows; tile += TILE) {
            const int64_t live = rows - tile < TILE ? rows - tile : TILE;
            if (live <= 0) break;
            for (int64_t v = first; v < last; v++) {
                int32_t sums[TILE];
                tile_row(weight + v * hidden, x + tile * hidden, hidden, (int)live, sums);
                for (int64_t r = 0; r < live; r++)
                    out[(tile + r) * vocab + v] = (float)sums[r] * x_scale[tile + r] * w_scale[v];
            }
        }
    }
    return 0;
}

/* The screen's selections over its approximate logits [rows, cols], each one pass:
 *
 *   fairserve_row_top_k:    per row, the indices of k largest entries (in no order; ties
 *                           go to the earlier entry), into top[rows, k];
 *   fairserve_select_above: every (row, col) with x[row, col] >= threshold[row], in row-major
 *                           order; returns how many, or -1 past `capacity` (nothing else
 *                           is then guaranteed about the outputs).
 */
void fairserve_row_top_k(const float *x, int64_t rows, int64_t cols, int64_t k, int64_t *top,
                         int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t row = 0; row < rows; row++) {
        const float *values = x + row * cols;
        int64_t *chosen = top + row * k;
        const int64_t first = k < cols ? k : cols;
        for (int64_t i = 0; i < first; i++) chosen[i] = i;
        int64_t weakest = 0;
        for (int64_t i = 1; i < first; i++)
            if (values[chosen[i]] < values[chosen[weakest]]) weakest = i;
        for (int64_t col = first; col < cols; col++) {
            if (!(values[col] > values[chosen[weakest]])) continue;
            chosen[weakest] = col;
            for (int64_t i = 0; i < first; i++)
                if (values[chosen[i]] < values[chosen[weakest]]) weakest = i;
        }
    }
}

int64_t fairserve_select_above(const float *x, int64_t rows, int64_t cols, const float *thresholds,
                               int64_t *out_rows, int64_t *out_cols, int64_t capacity) {
    int64_t count = 0;
    for (int64_t row = 0; row < rows; row++) {
        const float *values = x + row * cols;
        const float threshold = thresholds[row];
        int64_t col = 0;
        for (; col < cols; col++) {
            if ((col & 31) == 0 && col + 32 <= cols) {
                /* Most blocks of 32 hold nothing to take: skip them on their maximum. */
                float top = values[col];
                for (int i = 1; i < 32; i++) top = values[col + i] > top ? values[col + i] : top;
                if (!(top >= threshold)) {
                    col += 31;
                    continue;
                }
            }
            if (values[col] >= threshold) {
                if (count == capacity) return -1;
                out_rows[count] = row;
                out_cols[count] = col;
                count++;
            }
        }
    }
    return count;
}

/* The screen's exact logits: out[i] = weight[ids[i]] . x[rows[i]] over `hidden` float32
 * entries, each weight row read once, straight from the head (no gathered copy). */
void fairserve_gather_dot(const float *weight, const float *x, const int64_t *rows, const int64_t *ids,
                          float *out, int64_t count, int64_t hidden, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count >= 256)
    for (int64_t i = 0; i < count; i++) {
        const float *w = weight + ids[i] * hidden, *a = x + rows[i] * hidden;
        v8 acc0 = (v8){0}, acc1 = acc0;
        int64_t e = 0;
        for (; e + 16 <= hidden; e += 16) {
            acc0 += load8(w + e) * load8(a + e);
            acc1 += load8(w + e + 8) * load8(a + e + 8);
        }
        float total = sum8(acc0 + acc1);
        for (; e < hidden; e++) total += w[e] * a[e];
        out[i] = total;
    }
}
