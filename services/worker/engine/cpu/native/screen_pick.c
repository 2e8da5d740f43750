/* The LM head screen's work around its kernel in two calls, for rows whose draw reads their k
 * best logits and nothing else (greedy: k = 1; no token adjusted by the sampler), over a head
 * kept as 8-bit codes. Built into the int8_matmul library.
 *
 * In torch the same steps were ~25 small operations a step (quantize, norms, top-k, exact
 * logits, thresholds, bounds, candidates, scatter): ~0.85 ms on a 2-core AMD EPYC, and ~1.5 ms
 * right after the kernel's pass, which leaves the caches cold. Here they are two calls.
 *
 * fairserve_screen_quantize: each row of x [rows, in] float32 rounded for the int16 kernel,
 *   scale = max(max |x| / grid, 1e-30) (float32), q = x / scale rounded half to even and
 *   clamped to [-grid, grid], and the bound's norms of the row: norm = |x|, act_err =
 *   |x - q * scale| (1 + 1e-4) + |x| 2^-22 + 1e-30 (both in float64 first, so rounding up by
 *   far more than float32 rounds). Returns 1 if an entry is not finite (the screen then does
 *   not serve the step), else 0.
 *
 * fairserve_screen_pick: given the kernel's approximate logits approx [rows, V] and their
 *   panel maxima, for each row r
 *     best      = the k_r best approximate logits' tokens (top_k_in_panels);
 *     threshold = the least exact logit among them (the k_r-th best exact logit of those);
 *     a token t is a candidate when approx[r, t] + bound(r, t) >= threshold, with
 *     bound(r, t) = norm_r (error_norms[t] + slack) + act_err_r quant_norms[t]
 *     (lm_head_screen.py derives it; here it is computed in float64, not float32: the two
 *     differ by float32's rounding, far below the bound's margins). Only panels whose
 *     maximum reaches threshold - the widest bound are read.
 *   out [rows, V] is -inf except the candidates' and best's exact logits (code_row + dot_row:
 *   the bits of every other exact logit of the screen); their (row, token, logit) are also
 *   listed in cand_* (best tokens after the candidates), so a caller can soft-cap them. Returns
 *   how many are listed, or -1 when more than `capacity` would be (the full head then serves;
 *   nothing else is then guaranteed about the outputs), -2 for a k out of range (below 1,
 *   past MAX_PICK, the panels or V), -3 when it cannot allocate.
 *
 * Every token that can be among row r's k best has its exact logit in out, so a draw of the k
 * best (greedy, top-k) over out picks what it picks over the full logits.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "screen_rows.h"
#include "screen_simd.h"

#define MAX_PICK 256           /* k per row at most (top_k_in_panels' limit) */
/* Exact logits computed in parallel from this many on: each reads its row's codes from a
 * cold cache (~20 KB of lines in the panel layout), tens of microseconds apiece. */
#define PARALLEL_EXACT 32

int fairserve_screen_quantize(const float *x, int64_t rows, int64_t in, int64_t grid, int16_t *q, float *x_scale,
                              float *act_err, float *norm) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * in;
        float largest = 0.0f;
        for (int64_t i = 0; i < in; i++) {
            if (!isfinite(row[i])) return 1;
            largest = fabsf(row[i]) > largest ? fabsf(row[i]) : largest;
        }
        float scale = largest / (float)grid;
        scale = scale > 1e-30f ? scale : 1e-30f;
        double squares = 0.0, residual = 0.0;
        for (int64_t i = 0; i < in; i++) {
            float rounded = nearbyintf(row[i] / scale);
            rounded = rounded > (float)grid ? (float)grid : rounded < -(float)grid ? -(float)grid : rounded;
            q[r * in + i] = (int16_t)rounded;
            const double left = (double)row[i] - (double)rounded * (double)scale;   /* the product exact */
            residual += left * left;
            squares += (double)row[i] * (double)row[i];
        }
        x_scale[r] = scale;
        norm[r] = (float)(sqrt(squares) * (1 + 1e-7));
        act_err[r] = (float)(sqrt(residual) * (1 + 1e-4) + sqrt(squares) * 0x1p-22 + 1e-30);
    }
    return 0;
}

typedef struct {
    const uint8_t *codes;
    const float *scales;
    const float *offsets;
    const uint16_t *half;          /* or half-float scales and byte zeros (half_scales.h) */
    const uint8_t *zeros;
    int64_t group;
    int64_t hidden;
} coded_head_t;

typedef struct {
    const float *error_norms;      /* [V] */
    const float *quant_norms;      /* [V] */
    double slack;                  /* per unit of |x| */
    double max_error_norm, max_quant_norm;
} bound_norms_t;

static float exact_logit(const coded_head_t *head, const float *x, int64_t id) {
    float w[head->hidden];
    code_row(head->codes, head->scales, head->offsets, head->half, head->zeros, head->group, head->hidden, id, w);
    return dot_row(w, x, head->hidden);
}

static double bound(const bound_norms_t *b, double norm, double act_err, int64_t token) {
    return norm * ((double)b->error_norms[token] + b->slack) + act_err * (double)b->quant_norms[token];
}

/* Row r's candidates appended to cand_rows / cand_ids from *count on; -1 past capacity. */
static int collect(const float *approx, const float *maxima, int64_t r, int64_t vocab, float threshold,
                   double norm, double act_err, const bound_norms_t *b, int64_t capacity, int64_t *count,
                   int64_t *cand_rows, int64_t *cand_ids) {
    const int64_t panels = (vocab + PANEL - 1) / PANEL;
    const double widest = norm * (b->max_error_norm + b->slack) + act_err * b->max_quant_norm;
    const double floor = (double)threshold - widest * (1 + 1e-6);
    for (int64_t p = 0; p < panels; p++) {
        if (!((double)maxima[p] >= floor)) continue;
        const int64_t last = (p + 1) * PANEL < vocab ? (p + 1) * PANEL : vocab;
        for (int64_t t = p * PANEL; t < last; t++) {
            if (!((double)approx[t] >= floor)) continue;
            if (!((double)approx[t] + bound(b, norm, act_err, t) >= (double)threshold)) continue;
            if (*count == capacity) return -1;
            cand_rows[*count] = r;
            cand_ids[*count] = t;
            (*count)++;
        }
    }
    return 0;
}

int64_t fairserve_screen_pick(const float *approx, const float *maxima, int64_t rows, int64_t vocab,
                              const int64_t *counts, const float *x, const float *norm, const float *act_err,
                              const float *error_norms, const float *quant_norms, double slack,
                              double max_error_norm, double max_quant_norm, const uint8_t *codes,
                              const float *scales, const float *offsets, const uint16_t *half,
                              const uint8_t *zeros, int64_t group, int64_t hidden, float *out,
                              int64_t capacity, int64_t *cand_rows, int64_t *cand_ids, float *cand_values,
                              int64_t num_threads) {
    const int64_t panels = (vocab + PANEL - 1) / PANEL;
    int64_t offsets_of_best[rows + 1];     /* row r's best at [offsets_of_best[r], offsets_of_best[r + 1]) */
    offsets_of_best[0] = 0;
    for (int64_t r = 0; r < rows; r++) {
        if (counts[r] < 1 || counts[r] > MAX_PICK || counts[r] > panels || counts[r] > vocab) return -2;
        offsets_of_best[r + 1] = offsets_of_best[r] + counts[r];
    }
    const int64_t best_total = offsets_of_best[rows];
    if (best_total > capacity) return -1;
    int64_t *best = malloc(sizeof(int64_t) * best_total);
    float *best_exact = malloc(sizeof(float) * best_total), *thresholds = malloc(sizeof(float) * rows);
    if (best == NULL || best_exact == NULL || thresholds == NULL) {
        free(best), free(best_exact), free(thresholds);
        return -3;
    }
    const coded_head_t head = {codes, scales, offsets, half, zeros, group, hidden};
    const bound_norms_t b = {error_norms, quant_norms, slack, max_error_norm, max_quant_norm};
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t *chosen = best + offsets_of_best[r];
        float *exact = best_exact + offsets_of_best[r];
        top_k_in_panels(approx + r * vocab, vocab, counts[r], maxima + r * panels, chosen);
        float least = INFINITY;
        for (int64_t i = 0; i < counts[r]; i++) {
            exact[i] = exact_logit(&head, x + r * hidden, chosen[i]);
            least = exact[i] < least ? exact[i] : least;
        }
        thresholds[r] = least;
    }
    int64_t count = 0;
    for (int64_t r = 0; r < rows && count >= 0; r++)
        if (collect(approx + r * vocab, maxima + r * panels, r, vocab, thresholds[r], norm[r], act_err[r], &b,
                    capacity - best_total, &count, cand_rows, cand_ids))
            count = -1;
    if (count >= 0) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows > 1)
        for (int64_t i = 0; i < rows * vocab; i++) out[i] = -INFINITY;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count >= PARALLEL_EXACT)
        for (int64_t i = 0; i < count; i++) {
            cand_values[i] = exact_logit(&head, x + cand_rows[i] * hidden, cand_ids[i]);
            out[cand_rows[i] * vocab + cand_ids[i]] = cand_values[i];
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t i = offsets_of_best[r]; i < offsets_of_best[r + 1]; i++) {
                cand_rows[count] = r, cand_ids[count] = best[i], cand_values[count] = best_exact[i];
                out[r * vocab + best[i]] = best_exact[i];
                count++;
            }
    }
    free(best), free(best_exact), free(thresholds);
    return count;
}
