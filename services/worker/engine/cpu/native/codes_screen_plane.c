/* A one-row LM head screen from the high 4 bits of the head's 8-bit codes (CPU), built into the
 * int8_matmul library beside the full codes kernel (codes_screen.c).
 *
 * A one-row pass of the codes kernel streams the whole head, 1 + 3/32 bytes a weight in the half
 * form (a Q8_0 head's), and is bound by those bytes. The plane keeps each code's high nibble
 * h = code >> 4 (code = 16 h + l, l in 0 .. 15), half a byte a weight, and this kernel gives every
 * token an upper bound on what the full kernel would give it, from the plane and the scales alone
 * (5/8 of the bytes). With the head's half form (weight = scale * (code - zero)) and the int16
 * row q of the full kernel (x ~ x_scale * q):
 *
 *   full[v]  = x_scale * sum_b scale[v, b] * (U[v, b] - zero[v, b] * X[b]),
 *              U = sum_{i in b} code[v, i] q[i],  X = sum_{i in b} q[i]
 *   plane[v] = x_scale * sum_b scale[v, b] * (16 H[v, b] + (7.5 - zero[v, b]) X[b]),
 *              H = sum_{i in b} h[v, i] q[i]
 *   |full[v] - plane[v]| <= x_scale * sum_b |scale[v, b]| * 7.5 * A[b],  A = sum_{i in b} |q[i]|
 *
 * since U - 16 H - 7.5 X = sum (l - 7.5) q and |l - 7.5| <= 7.5. The kernel writes
 *
 *   upper[v] = x_scale * (sum_b scale (16 H + (7.5 - zero) X)
 *                         + (1 + 2^-12) sum_b |scale| (7.5 A + 2^-14 (16 |H| + 263 A)))
 *
 * whose second term also covers, with room to spare, the float32 roundings of both kernels'
 * sums (each ~20 blocks of fused multiply-adds: within ~2^-19 of sum |scale| (16 |H| + 263 A),
 * as |U| <= 16 |H| + 15 A and |zero X| <= 255 A) and its own. So upper[v] >= full[v] - (the full
 * kernel's rounding), and a token whose upper value plus the screen's bound falls short of a
 * threshold falls short with the full kernel's value too (lm_head_screen.py, codes_plane.py).
 * H, X and A are exact int32 sums (|q| <= 2^15 - 1, h <= 15, blocks of at most 256).
 *
 * Plane layout [ceil(V / PANEL)][in / 2][32] bytes: for each panel and input pair (2 j, 2 j + 1),
 * byte w holds, in its low nibble, h of row w / 2 at input 2 j + w % 2 and, in its high nibble,
 * h of row 16 + w / 2 at the same input. Widened to 16-bit words and split by nibble, the bytes
 * are the pairs a pairwise multiply-add takes against (q[2 j], q[2 j + 1]), rows 0-15 and 16-31
 * in row order (codes_plane.py builds it from the codes).
 *
 * Layouts: half [panels][in / group][PANEL] IEEE half scales, zeros the same in bytes (the half
 * form); x [in] int16; upper [V] float, maxima [ceil(V / PANEL)] float (each panel's largest).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half_scales.h"
#include "screen_rows.h"

#define PANEL 32
#define MAX_GROUP 256
#define PREFETCH_AHEAD 8192      /* bytes ahead in the plane's stream, a prefetch a cache line */
#define ROUNDING 0x1p-14f        /* per unit of sum |scale| (16 |H| + 263 A): the roundings' room */
#define CARRY 263.0f             /* 15 (the low nibbles) + 255 (a zero) - 7 */
#define WIDEN (1.0f + 0x1p-12f)  /* the bound's own roundings */

/* Whether a vector kernel serves here (AVX-512BW, or AVX2 with F16C; else the scalar one: the
 * same bound, slower). */
int fairserve_codes_plane_fast(void) {
#if (defined(__AVX512BW__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
    return 1;
#else
    return 0;
#endif
}

/* X[b] and A[b] of the row, as floats (exact). */
static void block_sums(const int16_t *x, int64_t in, int64_t group, float *sums, float *abs_sums) {
    for (int64_t b = 0; b < in / group; b++) {
        int32_t sum = 0, abs_sum = 0;
        for (int64_t i = b * group; i < (b + 1) * group; i++) {
            sum += x[i];
            abs_sum += x[i] < 0 ? -x[i] : x[i];
        }
        sums[b] = (float)sum;
        abs_sums[b] = (float)abs_sum;
    }
}

#if defined(__AVX512BW__) && defined(__AVX512F__)
static inline void dpwssd(__m512i *acc, __m512i w, __m512i x) {
#if defined(__AVX512VNNI__)
    __asm__("vpdpwssd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(x));
#else
    *acc = _mm512_add_epi32(*acc, _mm512_madd_epi16(w, x));
#endif
}

static inline __m512i pair_of(const int16_t *x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
}

/* One panel: out[0 .. 32) its rows' upper values (before x_scale). */
static void plane_panel(const uint8_t *plane, const uint16_t *half, const uint8_t *zeros, int64_t group,
                        int64_t in, const int16_t *x, const float *sums, const float *abs_sums, float *out) {
    const __m512i nibble = _mm512_set1_epi16(15);
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m512 room[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < in / group; b++) {
        /* Two chains a half of the panel (even and odd input pairs), for the multiply-adds' latency. */
        __m512i acc[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()},
                             {_mm512_setzero_si512(), _mm512_setzero_si512()}};
        const uint8_t *p = plane + b * group * 16;
        for (int64_t j = 0; j < group / 2; j += 2) {
            __builtin_prefetch(p + j * 32 + PREFETCH_AHEAD, 0, 3);
            for (int e = 0; e < 2; e++) {
                const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(p + (j + e) * 32)));
                const __m512i xr = pair_of(x + b * group + 2 * (j + e));
                dpwssd(&acc[e][0], _mm512_and_si512(words, nibble), xr);
                dpwssd(&acc[e][1], _mm512_srli_epi16(words, 4), xr);
            }
        }
        const __m512 sum = _mm512_set1_ps(sums[b]), abs_sum = _mm512_set1_ps(abs_sums[b]);
        for (int v = 0; v < 2; v++) {
            const int64_t at = b * PANEL + v * 16;
            const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(half + at)));
            const __m512 zero = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(zeros + at))));
            const __m512 h = _mm512_cvtepi32_ps(_mm512_add_epi32(acc[0][v], acc[1][v]));
            const __m512 mid = _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(7.5f), zero), sum);
            total[v] = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(h, _mm512_set1_ps(16.0f), mid), total[v]);
            const __m512 magnitude = _mm512_fmadd_ps(_mm512_and_ps(h, abs_mask), _mm512_set1_ps(16.0f),
                                                     _mm512_mul_ps(abs_sum, _mm512_set1_ps(CARRY)));
            const __m512 err = _mm512_fmadd_ps(magnitude, _mm512_set1_ps(ROUNDING),
                                               _mm512_mul_ps(abs_sum, _mm512_set1_ps(7.5f)));
            room[v] = _mm512_fmadd_ps(_mm512_and_ps(scale, abs_mask), err, room[v]);
        }
    }
    for (int v = 0; v < 2; v++)
        _mm512_storeu_ps(out + v * 16, _mm512_fmadd_ps(room[v], _mm512_set1_ps(WIDEN), total[v]));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* The same with 8 rows a vector: bytes 0-15 of an input pair are rows 0-7 (low nibbles) and 16-23
 * (high), bytes 16-31 rows 8-15 and 24-31; v below indexes rows 8 v .. 8 v + 7. */
static void plane_panel(const uint8_t *plane, const uint16_t *half, const uint8_t *zeros, int64_t group,
                        int64_t in, const int16_t *x, const float *sums, const float *abs_sums, float *out) {
    const __m256i nibble = _mm256_set1_epi16(15);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 total[4], room[4];
    for (int v = 0; v < 4; v++) total[v] = room[v] = _mm256_setzero_ps();
    for (int64_t b = 0; b < in / group; b++) {
        __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                          _mm256_setzero_si256()};
        const uint8_t *p = plane + b * group * 16;
        for (int64_t j = 0; j < group / 2; j++) {
            __builtin_prefetch(p + j * 32 + PREFETCH_AHEAD, 0, 3);
            int32_t pair;
            memcpy(&pair, x + b * group + 2 * j, sizeof pair);
            const __m256i xr = _mm256_set1_epi32(pair);
            for (int half_bytes = 0; half_bytes < 2; half_bytes++) {     /* rows 0-7 / 16-23, then 8-15 / 24-31 */
                const __m256i words =
                    _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + j * 32 + 16 * half_bytes)));
                acc[half_bytes] = _mm256_add_epi32(acc[half_bytes],
                                                   _mm256_madd_epi16(_mm256_and_si256(words, nibble), xr));
                acc[2 + half_bytes] = _mm256_add_epi32(acc[2 + half_bytes],
                                                       _mm256_madd_epi16(_mm256_srli_epi16(words, 4), xr));
            }
        }
        const __m256 sum = _mm256_set1_ps(sums[b]), abs_sum = _mm256_set1_ps(abs_sums[b]);
        for (int v = 0; v < 4; v++) {
            const int64_t at = b * PANEL + v * 8;
            const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(half + at)));
            const __m256 zero = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(zeros + at))));
            const __m256 h = _mm256_cvtepi32_ps(acc[v]);
            const __m256 mid = _mm256_mul_ps(_mm256_sub_ps(_mm256_set1_ps(7.5f), zero), sum);
            total[v] = _mm256_fmadd_ps(scale, _mm256_fmadd_ps(h, _mm256_set1_ps(16.0f), mid), total[v]);
            const __m256 magnitude = _mm256_fmadd_ps(_mm256_and_ps(h, abs_mask), _mm256_set1_ps(16.0f),
                                                     _mm256_mul_ps(abs_sum, _mm256_set1_ps(CARRY)));
            const __m256 err = _mm256_fmadd_ps(magnitude, _mm256_set1_ps(ROUNDING),
                                               _mm256_mul_ps(abs_sum, _mm256_set1_ps(7.5f)));
            room[v] = _mm256_fmadd_ps(_mm256_and_ps(scale, abs_mask), err, room[v]);
        }
    }
    for (int v = 0; v < 4; v++)
        _mm256_storeu_ps(out + v * 8, _mm256_fmadd_ps(room[v], _mm256_set1_ps(WIDEN), total[v]));
}
#else
static void plane_panel(const uint8_t *plane, const uint16_t *half, const uint8_t *zeros, int64_t group,
                        int64_t in, const int16_t *x, const float *sums, const float *abs_sums, float *out) {
    for (int row = 0; row < PANEL; row++) {
        const int w0 = 2 * (row % 16), shift = row < 16 ? 0 : 4;
        float total = 0.0f, room = 0.0f;
        for (int64_t b = 0; b < in / group; b++) {
            int32_t h = 0;
            for (int64_t i = b * group; i < (b + 1) * group; i++)
                h += ((plane[(i / 2) * 32 + w0 + i % 2] >> shift) & 15) * (int32_t)x[i];
            const float scale = half_to_float(half[b * PANEL + row]), zero = (float)zeros[b * PANEL + row];
            total = fmaf(scale, fmaf((float)h, 16.0f, (7.5f - zero) * sums[b]), total);
            const float magnitude = fmaf(fabsf((float)h), 16.0f, abs_sums[b] * CARRY);
            room = fmaf(fabsf(scale), fmaf(magnitude, ROUNDING, abs_sums[b] * 7.5f), room);
        }
        out[row] = fmaf(room, WIDEN, total);
    }
}
#endif

/* upper[V] and maxima[ceil(V / PANEL)] (or NULL) of one int16 row x [in] times x_scale, from the
 * plane and the half form's scales and zeros. 0, or 1 for shapes it does not take (an empty head,
 * a group that is odd, not a multiple of 4, or past MAX_GROUP, in not a multiple of it). */
int fairserve_codes_plane_screen(const uint8_t *plane, const uint16_t *half, const uint8_t *zeros, int64_t group,
                                 const int16_t *x, float x_scale, float *upper, float *maxima, int64_t vocab,
                                 int64_t in, int64_t num_threads) {
    if (vocab <= 0 || in <= 0 || group <= 0 || group % 4 || group > MAX_GROUP || in % group) return 1;
    const int64_t panels = (vocab + PANEL - 1) / PANEL, blocks = in / group;
    float sums[blocks], abs_sums[blocks];
    block_sums(x, in, group, sums, abs_sums);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float rows[PANEL];
        plane_panel(plane + p * (in / 2) * 32, half + p * blocks * PANEL, zeros + p * blocks * PANEL, group, in, x,
                    sums, abs_sums, rows);
        const int valid = vocab - p * PANEL < PANEL ? (int)(vocab - p * PANEL) : PANEL;
        float largest = -INFINITY;
        for (int n = 0; n < valid; n++) {
            upper[p * PANEL + n] = rows[n] * x_scale;
            largest = upper[p * PANEL + n] > largest ? upper[p * PANEL + n] : largest;
        }
        if (maxima != NULL) maxima[p] = largest;
    }
    return 0;
}

int fairserve_codes_screen_half_panels(const uint8_t *codes, const uint16_t *half_scales, const uint8_t *zeros,
                                       int64_t group, const int16_t *x, const float *x_scale, float *out,
                                       float *maxima, int64_t vocab, int64_t in, int64_t rows, const int64_t *listed,
                                       int64_t count, int64_t num_threads);

/* One row's pass (codes_plane.py, steps 1-3) in one call: the upper values into approx [V] and
 * maxima [P]; the k best of them and their exact logits (code_row, dot_row: the screen's own),
 * whose least is the threshold; then the full codes kernel over the panels whose maximum reaches
 * threshold - widest (1 + 1e-6), the screen's widest bound for this row, into approx and maxima,
 * and -inf as every other panel's maximum. x [in] float32 is the row itself, q its int16
 * rounding. Returns the panels read, -1 for shapes the kernels do not take, -2 for a k out of
 * range (below 1, past 256, the panels or V), -3 when it cannot allocate. */
int64_t fairserve_codes_plane_pass(const uint8_t *plane, const uint8_t *codes, const uint16_t *half,
                                   const uint8_t *zeros, int64_t group, const int16_t *q, const float *x_scale,
                                   const float *x, int64_t k, double widest, float *approx, float *maxima,
                                   int64_t vocab, int64_t in, int64_t num_threads) {
    const int64_t panels = (vocab + PANEL - 1) / PANEL;
    if (k < 1 || k > 256 || k > panels || k > vocab) return -2;
    if (fairserve_codes_plane_screen(plane, half, zeros, group, q, *x_scale, approx, maxima, vocab, in, num_threads))
        return -1;
    int64_t best[k];
    top_k_in_panels(approx, vocab, k, maxima, best);
    float threshold = INFINITY, w[in];
    for (int64_t i = 0; i < k; i++) {
        code_row(codes, NULL, NULL, half, zeros, group, in, best[i], w);
        const float exact = dot_row(w, x, in);
        threshold = exact < threshold ? exact : threshold;
    }
    const double floor = (double)threshold - widest * (1 + 1e-6);
    int64_t *listed = malloc(sizeof(int64_t) * panels), count = 0;
    if (listed == NULL) return -3;
    for (int64_t p = 0; p < panels; p++) {
        if ((double)maxima[p] >= floor) listed[count++] = p;
        else maxima[p] = -INFINITY;
    }
    const int status = fairserve_codes_screen_half_panels(codes, half, zeros, group, q, x_scale, approx, maxima, vocab,
                                                          in, 1, listed, count, num_threads);
    free(listed);
    return status == 0 ? count : status == 2 ? -3 : -1;
}
