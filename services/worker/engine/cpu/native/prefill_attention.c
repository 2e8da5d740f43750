/* Prefill attention over a step's packed chunks (CPU, float32), causal and bottom-right
 * aligned like flash-attn's varlen call: chunk s has nq queries and nk keys (its context,
 * the chunk's own rows last), and query i sees key j when
 *     j <= i + nk - nq           (causal)
 *     j >  i + nk - nq - window  (window > 0: sliding-window layers).
 * A query that sees no key gets zeros.
 *
 * Work items are (chunk, KV head, tile of query positions). A tile's rows are its positions
 * times the query heads sharing that KV head, so each key and value row is read once for all
 * of them, and the scores are a small GEMM (rows x key block x d) with the causal triangle's
 * blocks above the diagonal never computed; a chunk's tiles are as even as they can be
 * (chunk_tile). Each item runs an online softmax over blocks of
 * KEY_BLOCK keys: scores, the rows' running max and sum, then the weighted value rows added
 * into the item's output. Items run largest first over the OpenMP team.
 *
 * K is first written transposed into tiles of KEY_TILE keys ([tile][d][KEY_TILE], zero past
 * the chunk's last key; LANES x LANES blocks through registers), so the score kernel loads
 * KEY_TILE keys' values of one dimension as whole vectors and broadcasts the query's; only the
 * tiles some query of the chunk sees (on sliding layers, from its first query's window on).
 *
 * Layouts:
 *   q    [total_q, H, d]    token stride q_token, head stride q_head (in floats; d contiguous)
 *   k    [total_k, KVH, d]  contiguous
 *   v    [total_k, KVH, dv] contiguous
 *   out  [total_q, H, dv]   contiguous
 *   cu_q, cu_k [chunks + 1] int32, the chunks' first rows in q and k
 *
 * The paged entry (fairserve_prefill_attention_paged) reads K and V where the paged KV pool
 * holds them instead: k and v are the pool's [slots, KVH, d|dv] and key_rows [total_k] (int64)
 * names the slot of each packed key, so a chunk that continues its sequence attends to its
 * context without a gathered copy. Both entries run the same code: the contiguous one indexes
 * its keys through 0, 1, 2, ...
 * d and dv must be multiples of LANES; H a multiple of KVH (a KV head's query heads consecutive).
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#if defined(__AVX512F__)
#define LANES 16
#define MR 6              /* rows a score or value pass holds: 6 x 4 accumulators of AVX-512's 32 */
#define NV 4
#else
#define LANES 8
#define MR 4              /* 4 x 3 of AVX2's 16 */
#define NV 3
#endif
#define KEY_TILE (NV * LANES)          /* keys one score pass covers */
#define KEY_BLOCK (4 * KEY_TILE)       /* keys an online-softmax step covers */
#define TILE_ROWS 24                   /* rows (positions x grouped heads) a work item aims for */

typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

/* PASS(n) for the rows left after whole passes of MR (n a constant in each case). */
#if MR > 4
#define REMAINING_ROWS(PASS)                                                          \
    switch (rows) {                                                                   \
    case 5: PASS(5); break;                                                           \
    case 4: PASS(4); break;                                                           \
    case 3: PASS(3); break;                                                           \
    case 2: PASS(2); break;                                                           \
    case 1: PASS(1); break;                                                           \
    default: break;                                                                   \
    }
#else
#define REMAINING_ROWS(PASS)                                                          \
    switch (rows) {                                                                   \
    case 3: PASS(3); break;                                                           \
    case 2: PASS(2); break;                                                           \
    case 1: PASS(1); break;                                                           \
    default: break;                                                                   \
    }
#endif

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

static inline vf splatv(float x) { return x - (vf){}; }

typedef struct {
    int64_t chunk, kv_head, first, count;   /* positions [first, first + count) of the chunk's queries */
    double cost;
} item_t;

typedef struct {
    const float *q;
    int64_t q_token, q_head;
    const float *v;
    const int64_t *key_rows;   /* packed key -> its row in k and v */
    float *out;
    int64_t heads, kv_heads, group, d, dv, window;
    float scale;
} problem_t;

/* s[r][j] = scale * q_r . key_j for `rows` query rows and the first `vectors` x LANES keys of
 * one tile of KEY_TILE keys (kt: the tile, [d][KEY_TILE]). */
static inline __attribute__((always_inline)) void score_pass(const float *const *qrows, const int rows,
                                                             const int vectors, const float *kt, int64_t d,
                                                             float scale, float *s, int64_t s_stride) {
    vf acc[MR][NV];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < vectors; n++) acc[r][n] = (vf){};
    for (int64_t e = 0; e < d; e++) {
        const float *row = kt + e * KEY_TILE;
        vf keys[NV];
        for (int n = 0; n < vectors; n++) keys[n] = loadv(row + n * LANES);
        for (int r = 0; r < rows; r++) {
            const vf x = splatv(qrows[r][e]);
            for (int n = 0; n < vectors; n++) acc[r][n] += x * keys[n];
        }
    }
    const vf scaled = splatv(scale);
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < vectors; n++) storev(s + r * s_stride + n * LANES, acc[r][n] * scaled);
}

/* score_pass with `vectors` (1 .. NV) known at compile time, so its accumulators stay in registers. */
#define SCORE_VECTORS(ROWS)                                                          \
    do {                                                                             \
        switch (vectors) {                                                           \
        case NV: score_pass(qrows, ROWS, NV, kt, d, scale, s, s_stride); break;      \
        case NV - 1: score_pass(qrows, ROWS, NV - 1, kt, d, scale, s, s_stride); break; \
        case NV - 2: score_pass(qrows, ROWS, NV - 2, kt, d, scale, s, s_stride); break; \
        SCORE_VECTORS_4(ROWS)                                                        \
        default: break;                                                              \
        }                                                                            \
    } while (0)
#if NV > 3
#define SCORE_VECTORS_4(ROWS) case NV - 3: score_pass(qrows, ROWS, NV - 3, kt, d, scale, s, s_stride); break;
#else
#define SCORE_VECTORS_4(ROWS)
#endif

/* Scores of all `rows` rows against the first `vectors` x LANES keys of one key tile. */
static void score_rows(const float *const *qrows, int rows, int vectors, const float *kt, int64_t d, float scale,
                       float *s, int64_t s_stride) {
    for (; rows >= MR; rows -= MR, qrows += MR, s += MR * s_stride) SCORE_VECTORS(MR);
    REMAINING_ROWS(SCORE_VECTORS);
}

/* o[r][e0 .. e0 + vectors * LANES) += sum_j p[r][j] * v_j[...] over keys [j0, j1). */
static inline __attribute__((always_inline)) void value_pass(const float *p, int64_t p_stride, const int rows,
                                                             const int vectors, const float *v,
                                                             const int64_t *key_rows, int64_t v_stride,
                                                             int64_t j0, int64_t j1, float *o, int64_t o_stride) {
    vf acc[MR][NV];
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < vectors; n++) acc[r][n] = loadv(o + r * o_stride + n * LANES);
    for (int64_t j = j0; j < j1; j++) {
        const float *row = v + key_rows[j] * v_stride;
        vf values[NV];
        for (int n = 0; n < vectors; n++) values[n] = loadv(row + n * LANES);
        for (int r = 0; r < rows; r++) {
            const vf w = splatv(p[r * p_stride + j]);
            for (int n = 0; n < vectors; n++) acc[r][n] += w * values[n];
        }
    }
    for (int r = 0; r < rows; r++)
        for (int n = 0; n < vectors; n++) storev(o + r * o_stride + n * LANES, acc[r][n]);
}

#define VALUE_ROWS(ROWS)                                                                                 \
    do {                                                                                                 \
        int64_t e = 0;                                                                                   \
        for (; e + NV * LANES <= dv; e += NV * LANES)                                                    \
            value_pass(p, p_stride, ROWS, NV, v + e, key_rows, v_stride, j0, j1, o + e, o_stride);       \
        for (; e < dv; e += LANES)                                                                       \
            value_pass(p, p_stride, ROWS, 1, v + e, key_rows, v_stride, j0, j1, o + e, o_stride);        \
    } while (0)

static void value_rows(const float *p, int64_t p_stride, int rows, const float *v, const int64_t *key_rows,
                       int64_t v_stride, int64_t dv, int64_t j0, int64_t j1, float *o, int64_t o_stride) {
    for (; rows >= MR; rows -= MR, p += MR * p_stride, o += MR * o_stride) VALUE_ROWS(MR);
    REMAINING_ROWS(VALUE_ROWS);
}

/* Turns one row's scores of keys [b0, b0 + width) into weights for the online softmax: keys
 * outside [lo, hi) weigh 0; the row's running max m and sum l move on, and its output so far
 * is scaled by how far the max moved. */
static void softmax_step(float *s, int64_t width, int64_t b0, int64_t lo, int64_t hi, float *m, float *l, float *o,
                         int64_t dv) {
    const int64_t first = lo > b0 ? lo - b0 : 0, last = hi - b0 < width ? hi - b0 : width;
    if (first >= last) {
        memset(s, 0, (size_t)width * sizeof *s);
        return;
    }
    v8 maxes = splat8(-INFINITY);
    int64_t j = first;
    for (; j + 8 <= last; j += 8) maxes = max8(maxes, load8(s + j));
    float block_max = -INFINITY;
    for (int e = 0; e < 8; e++) block_max = maxes[e] > block_max ? maxes[e] : block_max;
    for (; j < last; j++) block_max = s[j] > block_max ? s[j] : block_max;
    const float new_max = block_max > *m ? block_max : *m;
    const float shrink = expf(*m - new_max);   /* 0 while the row has seen no key */
    memset(s, 0, (size_t)first * sizeof *s);
    v8 sum = splat8(0.0f);
    j = first;
    for (; j + 8 <= last; j += 8) {
        const v8 w = exp8(load8(s + j) - splat8(new_max));
        store8(s + j, w);
        sum += w;
    }
    float tail = 0.0f;
    for (; j < last; j++) {
        s[j] = expf(s[j] - new_max);
        tail += s[j];
    }
    memset(s + last, 0, (size_t)(width - last) * sizeof *s);
    if (shrink != 1.0f)
        for (int64_t e = 0; e < dv; e++) o[e] *= shrink;
    *l = *l * shrink + sum8(sum) + tail;
    *m = new_max;
}

/* Keys the positions' rows see: [lo, hi) of the chunk's keys for query position i. */
static inline int64_t visible_end(int64_t i, int64_t nq, int64_t nk) {
    const int64_t hi = i + nk - nq + 1;
    return hi < 0 ? 0 : (hi > nk ? nk : hi);
}

static inline int64_t visible_start(int64_t hi, int64_t window) {
    return window > 0 && hi > window ? hi - window : 0;
}

typedef struct {
    float *s, *o, *m, *l;
    const float **qrows;
    int64_t *lo, *hi;
} scratch_t;

static void run_item(const problem_t *pb, const item_t *it, const int32_t *cu_q, const int32_t *cu_k,
                     const float *kt, scratch_t *sc) {
    const int64_t nq = cu_q[it->chunk + 1] - cu_q[it->chunk], nk = cu_k[it->chunk + 1] - cu_k[it->chunk];
    const int64_t group = pb->group, rows = it->count * group, dv = pb->dv;
    const int64_t v_stride = pb->kv_heads * dv;
    for (int64_t p = 0; p < it->count; p++) {
        const int64_t i = it->first + p, hi = visible_end(i, nq, nk);
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = p * group + g, head = it->kv_head * group + g;
            sc->qrows[r] = pb->q + (cu_q[it->chunk] + i) * pb->q_token + head * pb->q_head;
            sc->hi[r] = hi;
            sc->lo[r] = visible_start(hi, pb->window);
            sc->m[r] = -INFINITY;
            sc->l[r] = 0.0f;
        }
    }
    memset(sc->o, 0, (size_t)(rows * dv) * sizeof *sc->o);
    const int64_t lo = sc->lo[0], hi = sc->hi[rows - 1];
    const float *v = pb->v + it->kv_head * dv;
    const int64_t *key_rows = pb->key_rows + cu_k[it->chunk];
    for (int64_t b0 = lo / KEY_TILE * KEY_TILE; b0 < hi; b0 += KEY_BLOCK) {
        /* Whole vectors of keys up to the block's last visible one: past it, a score is never used. */
        const int64_t width = hi - b0 < KEY_BLOCK ? (hi - b0 + LANES - 1) / LANES * LANES : KEY_BLOCK;
        for (int64_t t = 0; t < width; t += KEY_TILE) {
            const int vectors = (int)((width - t < KEY_TILE ? width - t : KEY_TILE) / LANES);
            score_rows(sc->qrows, (int)rows, vectors, kt + (b0 + t) * pb->d, pb->d, pb->scale, sc->s + t, KEY_BLOCK);
        }
        for (int64_t r = 0; r < rows; r++)
            softmax_step(sc->s + r * KEY_BLOCK, width, b0, sc->lo[r], sc->hi[r], &sc->m[r], &sc->l[r],
                         sc->o + r * dv, dv);
        const int64_t j0 = lo > b0 ? lo - b0 : 0, j1 = hi - b0 < width ? hi - b0 : width;
        value_rows(sc->s, KEY_BLOCK, (int)rows, v, key_rows + b0, v_stride, dv, j0, j1, sc->o, dv);
    }
    for (int64_t p = 0; p < it->count; p++)
        for (int64_t g = 0; g < group; g++) {
            const int64_t r = p * group + g, head = it->kv_head * group + g;
            float *dst = pb->out + ((cu_q[it->chunk] + it->first + p) * pb->heads + head) * dv;
            const float inv = sc->l[r] > 0.0f ? 1.0f / sc->l[r] : 0.0f;
            for (int64_t e = 0; e < dv; e++) dst[e] = sc->o[r * dv + e] * inv;
        }
}

/* Two-source lane picks for transpose_block: stage `b` swaps the off-diagonal b x b blocks of
 * each 2b x 2b block. Row i (i & b == 0) keeps its lanes l with l & b == 0 and takes row i + b's
 * lanes l - b into the others; row i + b the other halves. */
#define LOW_LANE(b, l) (((l) & (b)) ? LANES + (l) - (b) : (l))
#define HIGH_LANE(b, l) (((l) & (b)) ? LANES + (l) : (l) + (b))
#if LANES == 16
#define EVERY_LANE(F, b)                                                                            \
    F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), F(b, 7), F(b, 8), F(b, 9), F(b, 10), \
        F(b, 11), F(b, 12), F(b, 13), F(b, 14), F(b, 15)
#else
#define EVERY_LANE(F, b) F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), F(b, 7)
#endif
#define TRANSPOSE_STAGE(r, b)                                                                       \
    for (int i = 0; i < LANES; i++)                                                                 \
        if (!(i & (b))) {                                                                           \
            const vf low = __builtin_shufflevector(r[i], r[i + (b)], EVERY_LANE(LOW_LANE, b));      \
            const vf high = __builtin_shufflevector(r[i], r[i + (b)], EVERY_LANE(HIGH_LANE, b));    \
            r[i] = low;                                                                             \
            r[i + (b)] = high;                                                                      \
        }

/* r[i][l] <- r[l][i]: a LANES x LANES block transposed in registers. */
static inline __attribute__((always_inline)) void transpose_block(vf *r) {
#if LANES == 16
    TRANSPOSE_STAGE(r, 8);
#endif
    TRANSPOSE_STAGE(r, 4);
    TRANSPOSE_STAGE(r, 2);
    TRANSPOSE_STAGE(r, 1);
}

/* K of one chunk and KV head (k: its head's first entry; key_rows: the chunk's), transposed
 * into [tiles][d][KEY_TILE], zeros past its nk keys: LANES keys x LANES dimensions at a time,
 * whole vectors in and out (element by element, the transposition took ~30 % of a 10-query
 * chunk's attention over 1.5k cached keys). */
static void transpose_keys(const float *k, const int64_t *key_rows, int64_t k_stride, int64_t nk, int64_t d,
                           float *kt, int64_t tile) {
    float *dst = kt + tile * d * KEY_TILE;
    const int64_t first = tile * KEY_TILE;
    for (int64_t j0 = 0; j0 < KEY_TILE; j0 += LANES) {
        const float *src[LANES];
        for (int i = 0; i < LANES; i++) {
            const int64_t key = first + j0 + i;
            src[i] = key < nk ? k + key_rows[key] * k_stride : NULL;
        }
        for (int64_t e0 = 0; e0 < d; e0 += LANES) {
            vf r[LANES];
            for (int i = 0; i < LANES; i++) r[i] = src[i] != NULL ? loadv(src[i] + e0) : (vf){};
            transpose_block(r);
            for (int i = 0; i < LANES; i++) storev(dst + (e0 + i) * KEY_TILE + j0, r[i]);
        }
    }
}

/* Query positions a work item of a chunk of nq takes: at most `positions`, the chunk's items as
 * even as they can be (10 queries at up to 6: 5 and 5, not 6 and 4, which left one thread
 * waiting on the other for a sixth of the larger item). */
static inline int64_t chunk_tile(int64_t nq, int64_t positions) {
    const int64_t tiles = (nq + positions - 1) / positions;
    return tiles > 0 ? (nq + tiles - 1) / tiles : positions;
}

static int by_cost(const void *a, const void *b) {
    const double x = ((const item_t *)a)->cost, y = ((const item_t *)b)->cost;
    return (x < y) - (x > y);
}

static int attend(const float *q, int64_t q_token, int64_t q_head, const float *k, const float *v,
                  const int64_t *key_rows, float *out, const int32_t *cu_q, const int32_t *cu_k, int64_t chunks,
                  int64_t heads, int64_t kv_heads, int64_t d, int64_t dv, int64_t window, float scale,
                  int64_t threads) {
    const int64_t group = heads / kv_heads;
    const int64_t positions = group >= TILE_ROWS ? 1 : TILE_ROWS / group;
    int64_t items = 0, tiles = 0;
    int64_t *tile_base = malloc((size_t)(chunks + 1) * sizeof *tile_base);
    if (tile_base == NULL) return 1;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t nq = cu_q[c + 1] - cu_q[c], nk = cu_k[c + 1] - cu_k[c];
        const int64_t tile = chunk_tile(nq, positions);
        items += (nq + tile - 1) / tile * kv_heads;
        tile_base[c] = tiles;
        tiles += (nk + KEY_TILE - 1) / KEY_TILE * kv_heads;
    }
    tile_base[chunks] = tiles;
    item_t *list = malloc((size_t)(items ? items : 1) * sizeof *list);
    float *kt = malloc((size_t)(tiles ? tiles : 1) * (size_t)(d * KEY_TILE) * sizeof *kt);
    if (list == NULL || kt == NULL) {
        free(tile_base), free(list), free(kt);
        return 1;
    }
    int64_t n = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t nq = cu_q[c + 1] - cu_q[c], nk = cu_k[c + 1] - cu_k[c];
        const int64_t tile = chunk_tile(nq, positions);
        for (int64_t h = 0; h < kv_heads; h++)
            for (int64_t first = 0; first < nq; first += tile) {
                const int64_t count = nq - first < tile ? nq - first : tile;
                const int64_t hi = visible_end(first + count - 1, nq, nk);
                const int64_t lo = visible_start(visible_end(first, nq, nk), window);
                list[n++] = (item_t){c, h, first, count, (double)count * (double)(hi - lo + KEY_TILE)};
            }
    }
    qsort(list, (size_t)items, sizeof *list, by_cost);
    const problem_t pb = {q, q_token, q_head, v, key_rows, out, heads, kv_heads, group, d, dv, window, scale};
    /* Every thread's scratch is allocated here, on the calling thread: memory a team thread
     * allocates comes from an arena of its own, which keeps what it frees resident. */
    const int64_t rows = positions * group, floats = rows * KEY_BLOCK + rows * dv + 2 * rows;
    float *scratch = malloc((size_t)(threads * floats) * sizeof *scratch);
    const float **qrows = malloc((size_t)(threads * rows) * sizeof *qrows);
    int64_t *bounds = malloc((size_t)(threads * 2 * rows) * sizeof *bounds);
    if (scratch == NULL || qrows == NULL || bounds == NULL) {
        free(tile_base), free(list), free(kt), free(scratch), free((void *)qrows), free(bounds);
        return 1;
    }
#pragma omp parallel num_threads((int)threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tiles; t++) {
            int64_t c = 0;
            while (tile_base[c + 1] <= t) c++;
            const int64_t nk = cu_k[c + 1] - cu_k[c], per_head = (nk + KEY_TILE - 1) / KEY_TILE;
            const int64_t h = (t - tile_base[c]) / per_head, tile = (t - tile_base[c]) % per_head;
            /* Tiles wholly before the chunk's first query's window are never read: a sliding
             * layer's few queries over a long cached context see its last `window` keys only. */
            const int64_t nq = cu_q[c + 1] - cu_q[c];
            if (tile < visible_start(visible_end(0, nq, nk), window) / KEY_TILE) continue;
            transpose_keys(k + h * d, key_rows + cu_k[c], kv_heads * d, nk, d,
                           kt + (tile_base[c] + h * per_head) * d * KEY_TILE, tile);
        }
        const int64_t me = omp_get_thread_num();
        scratch_t sc;
        sc.s = scratch + me * floats;
        sc.o = sc.s + rows * KEY_BLOCK;
        sc.m = sc.o + rows * dv;
        sc.l = sc.m + rows;
        sc.qrows = qrows + me * rows;
        sc.lo = bounds + me * 2 * rows;
        sc.hi = sc.lo + rows;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const item_t *it = &list[i];
            const int64_t nk = cu_k[it->chunk + 1] - cu_k[it->chunk];
            const int64_t per_head = (nk + KEY_TILE - 1) / KEY_TILE;
            run_item(&pb, it, cu_q, cu_k, kt + (tile_base[it->chunk] + it->kv_head * per_head) * d * KEY_TILE, &sc);
        }
    }
    free(scratch), free((void *)qrows), free(bounds);
    free(tile_base), free(list), free(kt);
    return 0;
}

/* Contiguous K and V, [total_k, KVH, d|dv]. Returns 0, or 1 when scratch memory could not be
 * had (nothing written then). */
int fairserve_prefill_attention(const float *q, int64_t q_token, int64_t q_head, const float *k, const float *v,
                                float *out, const int32_t *cu_q, const int32_t *cu_k, int64_t chunks,
                                int64_t heads, int64_t kv_heads, int64_t d, int64_t dv, int64_t window, float scale,
                                int64_t threads) {
    const int64_t total_k = cu_k[chunks];
    int64_t *key_rows = malloc((size_t)(total_k ? total_k : 1) * sizeof *key_rows);
    if (key_rows == NULL) return 1;
    for (int64_t j = 0; j < total_k; j++) key_rows[j] = j;
    const int failed = attend(q, q_token, q_head, k, v, key_rows, out, cu_q, cu_k, chunks, heads, kv_heads, d, dv,
                              window, scale, threads);
    free(key_rows);
    return failed;
}

/* K and V where the paged pool holds them: k [slots, KVH, d], v [slots, KVH, dv], key_rows
 * [total_k] the slot of each packed key. Returns 0, or 1 when scratch memory could not be had. */
int fairserve_prefill_attention_paged(const float *q, int64_t q_token, int64_t q_head, const float *k,
                                      const float *v, const int64_t *key_rows, float *out, const int32_t *cu_q,
                                      const int32_t *cu_k, int64_t chunks, int64_t heads, int64_t kv_heads,
                                      int64_t d, int64_t dv, int64_t window, float scale, int64_t threads) {
    return attend(q, q_token, q_head, k, v, key_rows, out, cu_q, cu_k, chunks, heads, kv_heads, d, dv, window,
                  scale, threads);
}
