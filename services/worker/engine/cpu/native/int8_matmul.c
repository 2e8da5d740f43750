/* Approximate LM head logits: int8 weight rows times int16 activation rows (CPU).
 *
 *   out[m, v] = (sum_e x[m, e] * w[v, e]) * x_scale[m] * w_scale[v]
 *
 * The sums are exact int32 (the caller keeps |x| * 127 * hidden below 2^31), so the only
 * rounding is the final float conversion and two multiplications, in that order.
 *
 * The weight is kept in panels of PANEL vocabulary rows, each entry pair (e, e + 1) of a
 * row next to each other: panels [ceil(V / PANEL)][pairs][PANEL][2] int8 (zero padding past
 * V and past hidden). One load then holds one entry pair of 16 rows, widened to int16, and
 * each activation row's pair, broadcast, is multiplied into it and added pairwise into the
 * rows' int32 lanes (vpdpwssd with AVX512-VNNI, vpmaddwd + add otherwise): every output of
 * a panel accumulates in its own lane, so there are no horizontal sums, and each weight
 * load serves up to X_TILE activation rows. On a 2-core Xeon (AVX-512, VNNI) the 262k x 640
 * head took 9.0 ms at 8 rows, 17.9 at 16 and 38.6 at 32 this way, against 11.1, 22.0 and
 * 51.9 ms with the weight row-major and a horizontal sum per weight row and activation row
 * (the same outputs bit for bit; at one row both stream the 168 MB in ~8 ms). At 8 rows it
 * is bound by the multiply-adds: one 512-bit vpdpwssd a cycle per core.
 *
 * Layouts (all contiguous):
 *   panels  as above; w_scale [ceil(V / PANEL) * PANEL] float (zero padding)
 *   x       [rows, 2 * pairs] int16, x_scale [rows] float
 *   out     [rows, V] float, maxima [rows, ceil(V / PANEL)] float or NULL
 *
 * codes_screen.c, built into the same library, computes the same logits from the head's
 * 8-bit weight codes instead of an int8 copy of it; screen_simd.h holds what both share.
 * screen_pick.c picks a step's candidates in one call, with the row helpers of screen_rows.h.
 */


#include <stdint.h>
#include <string.h>

#include "half_scales.h"
#include "screen_rows.h"
#include "screen_simd.h"
#include "vec8.h"

#if defined(LANES)
/* Activation rows x .. x + nx - 1 against one panel (nx a constant at every call site). */
static inline __attribute__((always_inline)) void tile(const int8_t *panel, const float *w_scale, const int16_t *x,
                                                       const float *x_scale, int64_t pairs, const int nx,
                                                       float *out, int64_t vocab, int valid, float *maxima,
                                                       int64_t panels) {
    acc_t acc[X_TILE][VECTORS];
    for (int r = 0; r < nx; r++)
        for (int v = 0; v < VECTORS; v++) acc[r][v] = zero_acc();
    for (int64_t k = 0; k < pairs; k++) {
        const int8_t *p = panel + k * PANEL * 2;
        __builtin_prefetch(p + PREFETCH_AHEAD, 0, 3);
        acc_t w[VECTORS];
        for (int v = 0; v < VECTORS; v++) w[v] = load_pairs(p, v);
        for (int r = 0; r < nx; r++) {
            const acc_t xr = splat_pair(x + r * 2 * pairs + 2 * k);
            for (int v = 0; v < VECTORS; v++) acc[r][v] = madd_acc(acc[r][v], w[v], xr);
        }
    }
    for (int r = 0; r < nx; r++) {
        float row[PANEL];
        float *to = valid == PANEL ? out + r * vocab : row;
        for (int v = 0; v < VECTORS; v++) store_scaled(to + v * LANES, acc[r][v], x_scale[r], w_scale + v * LANES);
        if (valid < PANEL) memcpy(out + r * vocab, row, sizeof(float) * valid);
        if (maxima != NULL) maxima[r * panels] = max_of(to, valid);
    }
}

#define TILE_CASE(NX) \
    case NX: \
        if ((NX) <= X_TILE) tile(panel, w_scale, x, x_scale, pairs, NX, out, vocab, valid, maxima, panels); \
        break;

static void dispatch(const int8_t *panel, const float *w_scale, const int16_t *x, const float *x_scale,
                     int64_t pairs, int nx, float *out, int64_t vocab, int valid, float *maxima, int64_t panels) {
    switch (nx) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
        default: break;
    }
}
#else
#define X_TILE 1
static void dispatch(const int8_t *panel, const float *w_scale, const int16_t *x, const float *x_scale,
                     int64_t pairs, int nx, float *out, int64_t vocab, int valid, float *maxima, int64_t panels) {
    (void)nx;
    (void)vocab;
    (void)panels;
    for (int n = 0; n < valid; n++) {
        int32_t total = 0;
        for (int64_t k = 0; k < pairs; k++)
            for (int h = 0; h < 2; h++) total += (int32_t)panel[(k * PANEL + n) * 2 + h] * (int32_t)x[2 * k + h];
        out[n] = (float)total * x_scale[0] * w_scale[n];
    }
    if (maxima != NULL) maxima[0] = max_of(out, valid);
}
#endif

/* maxima [rows, ceil(V / PANEL)] (or NULL): each row's largest output in each panel, for the
 * selections below to skip the panels that cannot hold what they look for. */
int fairserve_int8_matmul(const int8_t *panels, const float *w_scale, const int16_t *x, const float *x_scale,
                          float *out, float *maxima, int64_t vocab, int64_t pairs, int64_t rows,
                          int64_t num_threads) {
    if (vocab <= 0 || pairs <= 0) return 1;
    const int64_t count = (vocab + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < count; p++) {
        const int valid = vocab - p * PANEL < PANEL ? (int)(vocab - p * PANEL) : PANEL;
        for (int64_t m0 = 0; m0 < rows; m0 += X_TILE) {
            const int nx = rows - m0 < X_TILE ? (int)(rows - m0) : X_TILE;
            dispatch(panels + p * pairs * PANEL * 2, w_scale + p * PANEL, x + m0 * 2 * pairs, x_scale + m0, pairs,
                     nx, out + m0 * vocab + p * PANEL, vocab, valid, maxima != NULL ? maxima + m0 * count + p : NULL,
                     count);
        }
    }
    return 0;
}

/* The screen's selections over its approximate logits [rows, cols], each one pass:
 *
 *   fairserve_row_top_k:    per row, the indices of k largest entries (in no order), into
 *                           top[rows, k];
 *   fairserve_select_above: every (row, col) with x[row, col] >= threshold[row], in row-major
 *                           order; returns how many, or -1 past `capacity` (nothing else
 *                           is then guaranteed about the outputs).
 *
 * With `maxima` (the matmul's [rows, ceil(cols / PANEL)] panel maxima; else NULL) they look
 * only into the panels that can hold an answer: the k best entries lie in the k panels with
 * the largest maxima (each of those holds an entry at least as large as the k-th of them, so
 * no entry elsewhere beats the k-th best), and an entry at or above a threshold lies in a
 * panel whose maximum is. Ties at the k-th value may then go to another entry of equal value.
 */

/* The indices of the k largest of values[0 .. n) (k <= n) into chosen[0 .. k); ties go to the
 * earlier entry. Replace-the-weakest: one pass, k compares for each entry that gets in. */
static void top_k_of(const float *values, int64_t n, int64_t k, int64_t *chosen) {
    for (int64_t i = 0; i < k; i++) chosen[i] = i;
    int64_t weakest = 0;
    for (int64_t i = 1; i < k; i++)
        if (values[chosen[i]] < values[chosen[weakest]]) weakest = i;
    for (int64_t col = k; col < n; col++) {
        if (!(values[col] > values[chosen[weakest]])) continue;
        chosen[weakest] = col;
        for (int64_t i = 0; i < k; i++)
            if (values[chosen[i]] < values[chosen[weakest]]) weakest = i;
    }
}

/* The k largest entries of one row, looking only into the k panels with the largest maxima. */
void top_k_in_panels(const float *values, int64_t cols, int64_t k, const float *maxima, int64_t *chosen) {
    const int64_t panels = (cols + PANEL - 1) / PANEL;
    int64_t best_panels[k];
    top_k_of(maxima, panels, k, best_panels);
    float gathered[k * PANEL];
    int64_t origin[k * PANEL];
    int64_t count = 0;
    for (int64_t i = 0; i < k; i++) {
        const int64_t first = best_panels[i] * PANEL;
        const int64_t last = first + PANEL < cols ? first + PANEL : cols;
        for (int64_t col = first; col < last; col++) {
            gathered[count] = values[col];
            origin[count++] = col;
        }
    }
    int64_t picked[k];
    top_k_of(gathered, count, k, picked);
    for (int64_t i = 0; i < k; i++) chosen[i] = origin[picked[i]];
}

void fairserve_row_top_k(const float *x, int64_t rows, int64_t cols, int64_t k, int64_t *top,
                         const float *maxima, int64_t num_threads) {
    const int64_t panels = (cols + PANEL - 1) / PANEL;
    const int k_fits = k <= panels && k <= 256;    /* the gathered panels stay on the stack */
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t row = 0; row < rows; row++) {
        const int64_t first = k < cols ? k : cols;
        if (maxima != NULL && k_fits)
            top_k_in_panels(x + row * cols, cols, first, maxima + row * panels, top + row * k);
        else
            top_k_of(x + row * cols, cols, first, top + row * k);
    }
}

int64_t fairserve_select_above(const float *x, int64_t rows, int64_t cols, const float *thresholds,
                               int64_t *out_rows, int64_t *out_cols, int64_t capacity, const float *maxima) {
    const int64_t panels = (cols + PANEL - 1) / PANEL;
    int64_t count = 0;
    for (int64_t row = 0; row < rows; row++) {
        const float *values = x + row * cols;
        const float threshold = thresholds[row];
        for (int64_t p = 0; p < panels; p++) {
            const int64_t first = p * PANEL, last = first + PANEL < cols ? first + PANEL : cols;
            const float top = maxima != NULL ? maxima[row * panels + p] : max_of(values + first, (int)(last - first));
            if (!(top >= threshold)) continue;     /* most panels hold nothing to take */
            for (int64_t col = first; col < last; col++) {
                if (values[col] >= threshold) {
                    if (count == capacity) return -1;
                    out_rows[count] = row;
                    out_cols[count] = col;
                    count++;
                }
            }
        }
    }
    return count;
}

/* w . a over `hidden` float32 entries: two 8-wide accumulators, then the tail in order. */
float dot_row(const float *w, const float *a, int64_t hidden) {
    v8 acc0 = (v8){0}, acc1 = acc0;
    int64_t e = 0;
    for (; e + 16 <= hidden; e += 16) {
        acc0 += load8(w + e) * load8(a + e);
        acc1 += load8(w + e + 8) * load8(a + e + 8);
    }
    float total = sum8(acc0 + acc1);
    for (; e < hidden; e++) total += w[e] * a[e];
    return total;
}

/* The screen's exact logits: out[i] = weight[ids[i]] . x[rows[i]] over `hidden` float32
 * entries, each weight row read once, straight from the head (no gathered copy). */
void fairserve_gather_dot(const float *weight, const float *x, const int64_t *rows, const int64_t *ids,
                          float *out, int64_t count, int64_t hidden, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count >= 256)
    for (int64_t i = 0; i < count; i++) out[i] = dot_row(weight + ids[i] * hidden, x + rows[i] * hidden, hidden);
}

/* w[0 .. hidden) = the float32 row `id` of a weight kept as 8-bit codes ([P][hidden][PANEL]
 * uint8, scales and offsets [P][hidden / group][PANEL] float): scale * code rounded, then plus
 * offset rounded, the two roundings weight_codes.py's `find` checked give the weight back (the
 * product goes through memory so that it is never fused with the sum). */
void code_row(const uint8_t *codes, const float *scales, const float *offsets, const uint16_t *half,
              const uint8_t *zeros, int64_t group, int64_t hidden, int64_t id, float *w) {
    const int64_t blocks = hidden / group, at = (id / PANEL) * blocks * PANEL + id % PANEL;
    const uint8_t *c = codes + (id / PANEL) * hidden * PANEL + id % PANEL;
    for (int64_t b = 0; b < blocks; b++) {
        float scale, offset;
        if (half != NULL) {
            scale = half_to_float(half[at + b * PANEL]);
            offset = -(float)zeros[at + b * PANEL] * scale;
        } else {
            scale = scales[at + b * PANEL];
            offset = offsets[at + b * PANEL];
        }
        for (int64_t e = b * group; e < (b + 1) * group; e++) {
            volatile float product = scale * (float)c[e * PANEL];
            w[e] = product + offset;
        }
    }
}

/* The same exact logits for a head kept as 8-bit codes: each row expanded as CodedWeight.rows
 * expands it, then the same dot product as fairserve_gather_dot (the same bits as gathering
 * the rows first). 0, or 1 for a group that does not divide hidden. */
int fairserve_codes_gather_dot(const uint8_t *codes, const float *scales, const float *offsets,
                               const uint16_t *half, const uint8_t *zeros, int64_t group, const float *x,
                               const int64_t *rows, const int64_t *ids, float *out, int64_t count, int64_t hidden,
                               int64_t num_threads) {
    if (group <= 0 || hidden <= 0 || hidden % group) return 1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count >= 256)
    for (int64_t i = 0; i < count; i++) {
        float w[hidden];
        code_row(codes, scales, offsets, half, zeros, group, hidden, ids[i], w);
        out[i] = dot_row(w, x + rows[i] * hidden, hidden);
    }
    return 0;
}
