/* What the screen's selections (int8_matmul.c) and its one-call pick (screen_pick.c) share:
 * the k best entries of a row through its panel maxima, and exact logits of single rows of
 * the head kept as 8-bit codes. Hidden: not exported from the library. */

#ifndef FAIRSERVE_SCREEN_ROWS_H
#define FAIRSERVE_SCREEN_ROWS_H

#include <stdint.h>

#define SCREEN_SHARED __attribute__((visibility("hidden")))

/* The indices of the k largest of values[0 .. cols) into chosen[0 .. k), looking only into
 * the k panels (of PANEL entries) with the largest maxima; k <= the panels and <= 256. */
SCREEN_SHARED void top_k_in_panels(const float *values, int64_t cols, int64_t k, const float *maxima,
                                   int64_t *chosen);

/* w . a over `hidden` float32 entries, in the order every exact logit of the screen takes. */
SCREEN_SHARED float dot_row(const float *w, const float *a, int64_t hidden);

/* w[0 .. hidden) = the float32 row `id` of a weight kept as 8-bit codes, bit for bit, from its
 * float scales and offsets or (half != NULL) its half-float scales and byte zeros (half_scales.h). */
SCREEN_SHARED void code_row(const uint8_t *codes, const float *scales, const float *offsets, const uint16_t *half,
                            const uint8_t *zeros, int64_t group, int64_t hidden, int64_t id, float *w);

#endif
