/* Decode attention straight from the paged K/V cache (CPU, float32).
 *
 * Each decoding sequence has one query row per head and reads its context through its
 * block table: no gathered copy of K/V is made. Query heads that share a KV head are
 * served together, so every K and V row is read once per KV head.
 *
 * Work items are (sequence, KV head, split). A split is a contiguous range of the
 * context; with fewer (sequence, KV head) pairs than threads, long contexts are split
 * so that every thread has work, and the splits' partial softmax states are merged.
 *
 * Layouts (all contiguous):
 *   q            [D, H, d]
 *   k_cache      [slots, KVH, d]      slot = block * block_size + offset
 *   v_cache      [slots, KVH, dv]
 *   block_tables [D, max_blocks]      int64
 *   ctx_lens     [D]                  int64, the context including the decoded token
 *   out          [D, H, dv]
 * window > 0 keeps the last `window` positions of each context (sliding-window layers).
 * d and dv must be multiples of 8.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vec8.h"

/* Software prefetch: the key row KEYS_AHEAD rows ahead while scoring, the next block's value
 * rows while one block is weighted. Rows sit wherever their blocks are in the pool, so the
 * hardware prefetcher loses the stream at every block edge (8 sequences of 300 tokens over 18
 * layers of the default model's shape: 6.0 ms without, 4.3 ms with, on a 2-core Xeon). The key
 * row KEYS_FAR_AHEAD rows ahead goes to L2 first: each row is 16 cache lines, and four rows'
 * worth of L1 prefetches alone left the stream waiting on memory (2-core AMD EPYC Zen 4, 18
 * layers, one-off harness, alternating: 30 sequences of 290 tokens 14.65 -> 13.21 ms, 16 of
 * 400 12.08 -> 9.64, 8 of 290 4.03 -> 3.66; one sequence even). */
#define KEYS_AHEAD 4
#define KEYS_FAR_AHEAD 8

typedef struct {
    int64_t lo, hi;     /* context positions [lo, hi) */
} span_t;

static span_t context_span(int64_t ctx, int64_t window) {
    span_t span = {0, ctx};
    if (window > 0 && ctx > window) span.lo = ctx - window;
    return span;
}

/* A value row's dv floats into L2, a prefetch a cache line. */
static inline void prefetch_row_l2(const float *row, int64_t dv) {
    for (int64_t e = 0; e < dv; e += 16) __builtin_prefetch(row + e, 0, 1);
}

/* scores[h * n + i] = scale * q_h . key_i for 4 heads at once (each key row loaded once). The
 * value rows are prefetched into L2 alongside, for the weighting after: one stream at a time left
 * memory half idle (the key pass alone read ~13 GB/s, where key and value rows read together
 * reach ~27; 30 sequences of 300 tokens over 18 layers, 2-core Zen 5: 24.9 -> 20.3 ms). */
static void scores4(const float *q, int64_t d, const float *const *keys, const float *const *values, int64_t dv,
                    int64_t n, float scale, float *scores) {
    const float *q0 = q, *q1 = q + d, *q2 = q + 2 * d, *q3 = q + 3 * d;
    for (int64_t i = 0; i < n; i++) {
        const float *key = keys[i];
        const float *ahead = i + KEYS_AHEAD < n ? keys[i + KEYS_AHEAD] : NULL;
        if (ahead != NULL) prefetch_row_l2(values[i + KEYS_AHEAD], dv);
        if (i + KEYS_FAR_AHEAD < n) prefetch_row_l2(keys[i + KEYS_FAR_AHEAD], d);
        v8 a0 = splat8(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t e = 0; e < d; e += 8) {
            if (ahead != NULL && (e & 15) == 0) __builtin_prefetch(ahead + e, 0, 3);
            const v8 k = load8(key + e);
            a0 += load8(q0 + e) * k;
            a1 += load8(q1 + e) * k;
            a2 += load8(q2 + e) * k;
            a3 += load8(q3 + e) * k;
        }
        scores[i] = sum8(a0) * scale;
        scores[n + i] = sum8(a1) * scale;
        scores[2 * n + i] = sum8(a2) * scale;
        scores[3 * n + i] = sum8(a3) * scale;
    }
}

static void scores1(const float *q, int64_t d, const float *const *keys, const float *const *values, int64_t dv,
                    int64_t n, float scale, float *scores) {
    for (int64_t i = 0; i < n; i++) {
        const float *key = keys[i];
        if (i + KEYS_AHEAD < n) prefetch_row_l2(values[i + KEYS_AHEAD], dv);   /* as in scores4 */
        v8 a0 = splat8(0.0f), a1 = a0;
        int64_t e = 0;
        for (; e + 16 <= d; e += 16) {
            a0 += load8(q + e) * load8(key + e);
            a1 += load8(q + e + 8) * load8(key + e + 8);
        }
        for (; e < d; e += 8) a0 += load8(q + e) * load8(key + e);
        scores[i] = sum8(a0 + a1) * scale;
    }
}

/* acc[h * stride + e] = sum_i weights[h * n + i] * value_i[e], 4 heads at once: 16 columns
 * at a time held in registers, over blocks of KEY_BLOCK keys whose value rows stay in L1
 * while every column chunk passes over them. */
#define KEY_BLOCK 16

static void weighted4(const float *weights, int64_t n, const float *const *values, int64_t dv,
                      float *acc, int64_t stride) {
    const float *w0 = weights, *w1 = weights + n, *w2 = weights + 2 * n, *w3 = weights + 3 * n;
    for (int64_t h = 0; h < 4; h++)
        for (int64_t e = 0; e < dv; e++) acc[h * stride + e] = 0.0f;
    for (int64_t first = 0; first < n; first += KEY_BLOCK) {
        const int64_t last = first + KEY_BLOCK < n ? first + KEY_BLOCK : n;
        /* The next block's value rows into L1, the one after into L2: the rows the score pass
         * prefetched into L2 were not all still there (30 sequences of 300 tokens over 18
         * layers, 2-core Zen 4: 23.2 -> 17.6 ms; 8 sequences 6.2 -> 4.1). */
        const int64_t next_last = last + KEY_BLOCK < n ? last + KEY_BLOCK : n;
        const int64_t after_last = next_last + KEY_BLOCK < n ? next_last + KEY_BLOCK : n;
        for (int64_t i = last; i < next_last; i++)
            for (int64_t e = 0; e < dv; e += 16) __builtin_prefetch(values[i] + e, 0, 3);
        for (int64_t i = next_last; i < after_last; i++)
            for (int64_t e = 0; e < dv; e += 16) __builtin_prefetch(values[i] + e, 0, 1);
        for (int64_t e = 0; e < dv; e += 16) {
            const int two = e + 16 <= dv;
            float *c0 = acc + e, *c1 = acc + stride + e, *c2 = acc + 2 * stride + e, *c3 = acc + 3 * stride + e;
            v8 a0 = load8(c0), a1 = load8(c1), a2 = load8(c2), a3 = load8(c3);
            v8 b0 = two ? load8(c0 + 8) : splat8(0.0f), b1 = two ? load8(c1 + 8) : splat8(0.0f);
            v8 b2 = two ? load8(c2 + 8) : splat8(0.0f), b3 = two ? load8(c3 + 8) : splat8(0.0f);
            for (int64_t i = first; i < last; i++) {
                const float *value = values[i] + e;
                const v8 x = load8(value);
                const v8 y = two ? load8(value + 8) : splat8(0.0f);
                const v8 s0 = splat8(w0[i]), s1 = splat8(w1[i]), s2 = splat8(w2[i]), s3 = splat8(w3[i]);
                a0 += s0 * x; b0 += s0 * y;
                a1 += s1 * x; b1 += s1 * y;
                a2 += s2 * x; b2 += s2 * y;
                a3 += s3 * x; b3 += s3 * y;
            }
            store8(c0, a0); store8(c1, a1); store8(c2, a2); store8(c3, a3);
            if (two) {
                store8(c0 + 8, b0); store8(c1 + 8, b1); store8(c2 + 8, b2); store8(c3 + 8, b3);
            }
        }
    }
}

static void weighted1(const float *weights, int64_t n, const float *const *values, int64_t dv, float *acc) {
    for (int64_t e = 0; e < dv; e++) acc[e] = 0.0f;
    for (int64_t first = 0; first < n; first += KEY_BLOCK) {
        const int64_t last = first + KEY_BLOCK < n ? first + KEY_BLOCK : n;
        for (int64_t e = 0; e < dv; e += 8) {
            v8 a = load8(acc + e);
            for (int64_t i = first; i < last; i++) a += splat8(weights[i]) * load8(values[i] + e);
            store8(acc + e, a);
        }
    }
}

/* One work item: positions [lo, hi) of one sequence for the `group` query heads sharing KV
 * head `kv`. Writes, per head, dv unnormalized weighted values, then the max score and the
 * sum of exponentials, to `state`. `rows` has room for 2 * (hi - lo) pointers and `scores`
 * for group * (hi - lo) floats. */
static void attend_range(const float *q_group, const float *k_cache, const float *v_cache,
                         const int64_t *table, int64_t block_size, int64_t kv_heads, int64_t kv,
                         int64_t group, int64_t d, int64_t dv, float scale, int64_t lo, int64_t hi,
                         const float **rows, float *scores, float *state) {
    const int64_t n = hi - lo;
    const int64_t stride = dv + 2;
    if (n <= 0) {
        for (int64_t j = 0; j < group; j++) {
            for (int64_t e = 0; e < dv; e++) state[j * stride + e] = 0.0f;
            state[j * stride + dv] = -INFINITY;
            state[j * stride + dv + 1] = 0.0f;
        }
        return;
    }
    const float **keys = rows, **values = rows + n;
    for (int64_t i = 0; i < n; i++) {
        const int64_t pos = lo + i;
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        keys[i] = k_cache + (slot * kv_heads + kv) * d;
        values[i] = v_cache + (slot * kv_heads + kv) * dv;
    }
    int64_t j = 0;
    for (; j + 4 <= group; j += 4) scores4(q_group + j * d, d, keys, values, dv, n, scale, scores + j * n);
    for (; j < group; j++) scores1(q_group + j * d, d, keys, values, dv, n, scale, scores + j * n);

    for (j = 0; j < group; j++) {
        float *row = scores + j * n;
        float best = -INFINITY;
        for (int64_t i = 0; i < n; i++) best = row[i] > best ? row[i] : best;
        v8 lanes = splat8(0.0f);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            const v8 weights = exp8(load8(row + i) - splat8(best));
            store8(row + i, weights);
            lanes += weights;
        }
        float total = sum8(lanes);
        for (; i < n; i++) {
            row[i] = expf(row[i] - best);
            total += row[i];
        }
        state[j * stride + dv] = best;
        state[j * stride + dv + 1] = total;
    }

    for (j = 0; j + 4 <= group; j += 4) weighted4(scores + j * n, n, values, dv, state + j * stride, stride);
    for (; j < group; j++) weighted1(scores + j * n, n, values, dv, state + j * stride);
}

int fairserve_paged_decode_attention(const float *q, const float *k_cache, const float *v_cache,
                                     const int64_t *block_tables, const int64_t *ctx_lens, float *out,
                                     int64_t num_seqs, int64_t num_heads, int64_t kv_heads, int64_t d,
                                     int64_t dv, int64_t max_blocks, int64_t block_size, int64_t window,
                                     float scale, int64_t splits, int64_t num_threads) {
    const int64_t group = num_heads / kv_heads;
    const int64_t stride = dv + 2;
    const int64_t items = num_seqs * kv_heads * splits;
    float *states = (float *)malloc(sizeof(float) * items * group * stride);
    if (states == NULL) return 1;
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < items; item++) {
        const int64_t split = item % splits;
        const int64_t kv = (item / splits) % kv_heads;
        const int64_t seq = item / (splits * kv_heads);
        const span_t span = context_span(ctx_lens[seq], window);
        const int64_t per_split = (span.hi - span.lo + splits - 1) / splits;
        const int64_t lo = span.lo + split * per_split;
        const int64_t hi = lo + per_split < span.hi ? lo + per_split : span.hi;
        const int64_t n = hi > lo ? hi - lo : 0;
        const int64_t room = n > 0 ? n : 1;
        float *scores = (float *)malloc(sizeof(float) * room * group);
        const float **rows = (const float **)malloc(sizeof(float *) * room * 2);
        if (scores == NULL || rows == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            attend_range(q + (seq * num_heads + kv * group) * d, k_cache, v_cache,
                         block_tables + seq * max_blocks, block_size, kv_heads, kv, group, d, dv, scale,
                         lo, hi, rows, scores, states + item * group * stride);
        }
        free(scores);
        free((void *)rows);
    }

    /* Merge each (sequence, KV head)'s splits and normalize. */
    for (int64_t pair = 0; pair < num_seqs * kv_heads; pair++) {
        const int64_t seq = pair / kv_heads;
        const int64_t kv = pair % kv_heads;
        for (int64_t j = 0; j < group; j++) {
            float best = -INFINITY;
            for (int64_t split = 0; split < splits; split++) {
                const float m = states[((pair * splits + split) * group + j) * stride + dv];
                best = m > best ? m : best;
            }
            float *dst = out + (seq * num_heads + kv * group + j) * dv;
            for (int64_t e = 0; e < dv; e++) dst[e] = 0.0f;
            float total = 0.0f;
            for (int64_t split = 0; split < splits; split++) {
                const float *state = states + ((pair * splits + split) * group + j) * stride;
                if (state[dv + 1] == 0.0f) continue;
                const float factor = expf(state[dv] - best);
                total += state[dv + 1] * factor;
#pragma omp simd
                for (int64_t e = 0; e < dv; e++) dst[e] += state[e] * factor;
            }
            const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
#pragma omp simd
            for (int64_t e = 0; e < dv; e++) dst[e] *= inverse;
        }
    }
    free(states);
    return failed;
}
