/* A decode step's decoder layers in one call (CPU, float32; Gemma 3's layer shape).
 *
 * Written out in Python, each layer of a decode step is ~25 small calls (norms, the seven
 * projections, RoPE, the K/V write, attention, residual adds), and their glue costs a few
 * hundred microseconds a layer, ~10 ms a step on the default model: as much as its matmuls at
 * one sequence. This runs the same kernels in the same order from C, so the hidden states are
 * bitwise those of the Python path (direct_forward.py): the kernels come in as function
 * pointers to the engine's own libraries (coded_linear.c, elementwise.c, paged_decode.c).
 *
 * Every row is one sequence's decoded token; or (step_t.chunks > 0) the first step_t.decodes
 * rows are and the rest are prefill chunks, packed as the Python path packs them (a cached
 * prompt's few new tokens, a short last chunk): their attention is prefill_attention.c's paged
 * entry over each chunk's keys where the pool holds them (layer_t.key_rows, cu_q, cu_k: the
 * layer's cache group and window, as attention.py hands them to it), the K/V written first.
 * Per layer:
 *   normed = rms_norm(hidden, input_norm)
 *   q, k, v = codes(normed)                     [rows, heads | kv_heads, head_dim]
 *     (one call where their codes are joined, layer_t.qkv; gate and up likewise)
 *   q, k = rms_norm(q, q_norm), rms_norm(k, k_norm), then RoPE (cos, sin of the layer's type)
 *   k_cache[slots], v_cache[slots] = k, v      (the slots and tables of the layer's cache group)
 *   attention through the block tables (window 0: none) -> o_proj -> post_attention_norm
 *   hidden = hidden + that
 *   mlp = down(act(gate(normed)) * up(normed)) with normed = rms_norm(hidden, pre_mlp_norm)
 *   hidden = hidden + post_mlp_norm(mlp)
 * With step_t.keep (no adapter rows), the last layer runs past its attention for the rows
 * `keep` names alone, moved to the front of `hidden` (direct_forward.py: only the rows that
 * sample read the last layer's output; every row's K/V is written all the same).
 *
 * LoRA (services/worker/engine/lora/): with `lora_slots` set, each projection's output then gets
 * its row's adapter update, scale * (x . A^T) . B^T, row by row from that adapter's own A and B
 * (a gathered BGMV: rank * (in + out) multiply-adds a row), for the projections it targets.
 */

#include <stdint.h>
#include <string.h>

typedef int (*coded_linear_fn)(const float *x, const uint8_t *codes, const float *scales, const float *offsets,
                               int64_t group, int64_t bits, const float *bias, float *out, int64_t rows,
                               int64_t in, int64_t out_features, int64_t num_threads);
typedef void (*rms_norm_fn)(const float *x, const float *scale, float *out, int64_t rows, int64_t dim, float eps,
                            int64_t num_threads);
typedef void (*act_mul_fn)(const float *gate, int64_t gate_stride, const float *up, int64_t up_stride, float *out,
                           int64_t rows, int64_t dim, int64_t activation, int64_t num_threads);
typedef void (*rope_fn)(float *q, int64_t q_heads, float *k, int64_t k_heads, const float *cos, const float *sin,
                        int64_t rows, int64_t dim, int64_t num_threads);
typedef int (*attention_fn)(const float *q, const float *k_cache, const float *v_cache, const int64_t *block_tables,
                            const int64_t *ctx_lens, float *out, int64_t num_seqs, int64_t num_heads,
                            int64_t kv_heads, int64_t d, int64_t dv, int64_t max_blocks, int64_t block_size,
                            int64_t window, float scale, int64_t splits, int64_t num_threads);
typedef int (*prefill_attention_fn)(const float *q, int64_t q_token, int64_t q_head, const float *k,
                                    const float *v, const int64_t *key_rows, float *out, const int32_t *cu_q,
                                    const int32_t *cu_k, int64_t chunks, int64_t heads, int64_t kv_heads, int64_t d,
                                    int64_t dv, int64_t window, float scale, int64_t threads);

typedef struct {
    coded_linear_fn coded_linear;
    rms_norm_fn rms_norm;
    act_mul_fn act_mul;
    rope_fn rope;
    attention_fn attention;
    prefill_attention_fn prefill_attention;   /* for steps of prefill chunks (NULL: decodes only) */
} kernels_t;

typedef struct {
    const uint8_t *codes;
    const float *scales;
    const float *offsets;
    int64_t group;
    int64_t bits;                    /* 8: a byte a code; 4, 5, 6: narrow codes (coded_linear.c) */
} coded_t;

typedef struct {
    const float *const *a;           /* [adapters]: [rank, in] each; NULL: the adapter leaves it alone */
    const float *const *b_t;         /* [adapters]: [rank, out] each */
    const int64_t *ranks;            /* [adapters] */
    const float *scales;             /* [adapters] */
} lora_t;

enum { Q, K, V, O, GATE, UP, DOWN, PROJECTIONS };
#define LORA_ACCUMULATORS 8

typedef struct {
    coded_t q, k, v, o, gate, up, down;
    /* q, k and v's codes as one weight (their panels side by side, coded_groups.py), and gate
     * and up's; codes NULL where they are not */
    coded_t qkv, gate_up;
    const float *input_norm, *q_norm, *k_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm;
    float *k_cache, *v_cache;        /* [slots, kv_heads, head_dim] */
    const float *cos, *sin;          /* [rows, head_dim], of the layer's type */
    const int64_t *slots;            /* [rows] cache slot of each row's new K/V, in this cache's blocks */
    const int64_t *block_tables;     /* [rows, table_width], in this cache's blocks */
    int64_t table_width;
    int64_t window;                  /* 0: full attention */
    int64_t splits;                  /* context splits the attention kernel takes */
    float scaling;
    const lora_t *lora;              /* [PROJECTIONS] for a step with adapter rows, else NULL */
    const int64_t *key_rows;         /* prefill chunks: the pool slot of each chunk's keys, packed */
    const int32_t *cu_q, *cu_k;      /* prefill chunks: [chunks + 1], their first query row and key */
} layer_t;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
    const int64_t *ctx_lens;         /* [rows] */
    int64_t block_size, activation, num_threads;
    /* scratch, each [rows, width]: normed and attn_out [.., max(hidden, heads * head_dim)],
     * q [.., heads * head_dim], k and v [.., kv_heads * head_dim], gate, up, act [.., intermediate],
     * projected [.., hidden] */
    float *normed, *q, *k, *v, *attn_out, *gate, *up, *act, *projected;
    const int64_t *lora_slots;       /* [rows]: each row's adapter (an index into lora_t's arrays), -1 the
                                      * base model; NULL: no adapter rows */
    float *lora_low;                 /* scratch [max rank] */
    int64_t chunks;                  /* 0: every row a decode; else rows past `decodes` are this many chunks */
    int64_t decodes;                 /* with chunks: the decode rows first (0: none) */
    const int64_t *keep;             /* [kept] ascending rows the last layer finishes (NULL: every row) */
    int64_t kept;
} step_t;

static int linear(const kernels_t *kernels, const coded_t *weight, const float *x, float *out, int64_t rows,
                  int64_t in, int64_t out_features, int64_t threads) {
    return kernels->coded_linear(x, weight->codes, weight->scales, weight->offsets, weight->group, weight->bits,
                                 NULL, out, rows, in, out_features, threads);
}

static float dot(const float *x, const float *y, int64_t n) {
    float part[LORA_ACCUMULATORS] = {0};
    int64_t i = 0;
    for (; i + LORA_ACCUMULATORS <= n; i += LORA_ACCUMULATORS)
        for (int j = 0; j < LORA_ACCUMULATORS; j++) part[j] += x[i + j] * y[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LORA_ACCUMULATORS; j++) sum += part[j];
    for (; i < n; i++) sum += x[i] * y[i];
    return sum;
}

/* out[r] += scale * (x[r] . A^T) . B^T for each row r with an adapter that targets this projection. */
static void lora_add(const step_t *s, const lora_t *lora, const float *x, float *out, int64_t in,
                     int64_t out_features) {
    if (s->lora_slots == NULL || lora == NULL) return;
    for (int64_t r = 0; r < s->rows; r++) {
        const int64_t slot = s->lora_slots[r];
        if (slot < 0 || lora->a[slot] == NULL) continue;
        const float *a = lora->a[slot], *b_t = lora->b_t[slot], *row = x + r * in;
        const int64_t rank = lora->ranks[slot];
        float *low = s->lora_low, *target = out + r * out_features;
        for (int64_t k = 0; k < rank; k++) low[k] = dot(row, a + k * in, in) * lora->scales[slot];
        for (int64_t k = 0; k < rank; k++) {
            const float c = low[k], *b = b_t + k * out_features;
            for (int64_t j = 0; j < out_features; j++) target[j] += c * b[j];
        }
    }
}

static int projection(const kernels_t *kn, const layer_t *l, const step_t *s, int which, const coded_t *weight,
                      const float *x, float *out, int64_t rows, int64_t in, int64_t out_features) {
    int failed = linear(kn, weight, x, out, rows, in, out_features, s->num_threads);
    if (l->lora != NULL) lora_add(s, &l->lora[which], x, out, in, out_features);
    return failed;
}

static int lora_rows(const layer_t *l, const step_t *s) { return l->lora != NULL && s->lora_slots != NULL; }

/* Whether gate's and up's scratch rows lie side by side, [rows, 2 * intermediate] of room, as
 * native_layers.py lays the scratch out (the joined calls write there). */
static int gate_up_room(const step_t *s, int64_t rows) { return s->up == s->gate + rows * s->intermediate; }

/* q, k and v of the normed rows: one call over their joined codes where the layer has them
 * (into q's, k's and v's room when one row's q, k and v are side by side there, as the scratch
 * lays them out; else into gate's and up's room, free until the MLP, and copied out), each
 * projection's adapter rows added after; three calls otherwise. The same bits either way. */
static int project_qkv(const kernels_t *kn, const layer_t *l, const step_t *s, int64_t rows) {
    const int64_t h = s->hidden, q_width = s->heads * s->head_dim, kv_width = s->kv_heads * s->head_dim;
    const int64_t width = q_width + 2 * kv_width;
    const int in_place = rows == 1 && s->k == s->q + q_width && s->v == s->k + kv_width;
    if (l->qkv.codes == NULL || (!in_place && (width > 2 * s->intermediate || !gate_up_room(s, rows)))) {
        int failed = projection(kn, l, s, Q, &l->q, s->normed, s->q, rows, h, q_width);
        failed |= projection(kn, l, s, K, &l->k, s->normed, s->k, rows, h, kv_width);
        return failed | projection(kn, l, s, V, &l->v, s->normed, s->v, rows, h, kv_width);
    }
    float *to = in_place ? s->q : s->gate;
    const int failed = linear(kn, &l->qkv, s->normed, to, rows, h, width, s->num_threads);
    if (!in_place)
        for (int64_t r = 0; r < rows; r++) {
            memcpy(s->q + r * q_width, to + r * width, sizeof(float) * q_width);
            memcpy(s->k + r * kv_width, to + r * width + q_width, sizeof(float) * kv_width);
            memcpy(s->v + r * kv_width, to + r * width + q_width + kv_width, sizeof(float) * kv_width);
        }
    if (l->lora != NULL) {
        lora_add(s, &l->lora[Q], s->normed, s->q, h, q_width);
        lora_add(s, &l->lora[K], s->normed, s->k, h, kv_width);
        lora_add(s, &l->lora[V], s->normed, s->v, h, kv_width);
    }
    return failed;
}

static void add_into(float *hidden, const float *other, int64_t count) {
    for (int64_t i = 0; i < count; i++) hidden[i] = hidden[i] + other[i];
}

/* Rows keep[0 .. kept) of x [.., width] moved to its first `kept` rows (keep ascending, so no
 * row is overwritten before it moves). */
static void keep_rows(float *x, int64_t width, const int64_t *keep, int64_t kept) {
    for (int64_t i = 0; i < kept; i++)
        if (keep[i] != i) memmove(x + i * width, x + keep[i] * width, sizeof(float) * width);
}

/* One layer over the step's rows; past the attention over the rows `keep` names (NULL: all). */
static int layer(const kernels_t *kn, const layer_t *l, const step_t *s, float *hidden, const int64_t *keep,
                 int64_t kept) {
    const int64_t h = s->hidden, hd = s->head_dim, threads = s->num_threads;
    int64_t rows = s->rows;
    const int64_t q_width = s->heads * hd, kv_width = s->kv_heads * hd, inter = s->intermediate;
    int failed = 0;

    kn->rms_norm(hidden, l->input_norm, s->normed, rows, h, s->eps, threads);
    failed |= project_qkv(kn, l, s, rows);
    kn->rms_norm(s->q, l->q_norm, s->q, rows * s->heads, hd, s->eps, threads);
    kn->rms_norm(s->k, l->k_norm, s->k, rows * s->kv_heads, hd, s->eps, threads);
    kn->rope(s->q, s->heads, s->k, s->kv_heads, l->cos, l->sin, rows, hd, threads);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(l->k_cache + l->slots[r] * kv_width, s->k + r * kv_width, sizeof(float) * kv_width);
        memcpy(l->v_cache + l->slots[r] * kv_width, s->v + r * kv_width, sizeof(float) * kv_width);
    }
    const int64_t decodes = s->chunks > 0 ? s->decodes : rows;
    if (decodes > 0)
        failed |= kn->attention(s->q, l->k_cache, l->v_cache, l->block_tables, s->ctx_lens, s->attn_out, decodes,
                                s->heads, s->kv_heads, hd, hd, l->table_width, s->block_size, l->window, l->scaling,
                                l->splits, threads);
    if (s->chunks > 0)
        failed |= kn->prefill_attention(s->q + decodes * q_width, q_width, hd, l->k_cache, l->v_cache, l->key_rows,
                                        s->attn_out + decodes * q_width, l->cu_q, l->cu_k, s->chunks, s->heads,
                                        s->kv_heads, hd, hd, l->window, l->scaling, threads);
    if (keep != NULL) {
        keep_rows(s->attn_out, q_width, keep, kept);
        keep_rows(hidden, h, keep, kept);
        rows = kept;
    }
    failed |= projection(kn, l, s, O, &l->o, s->attn_out, s->projected, rows, q_width, h);
    kn->rms_norm(s->projected, l->post_attention_norm, s->projected, rows, h, s->eps, threads);
    add_into(hidden, s->projected, rows * h);

    kn->rms_norm(hidden, l->pre_mlp_norm, s->normed, rows, h, s->eps, threads);
    if (l->gate_up.codes != NULL && gate_up_room(s, rows) && (rows == 1 || !lora_rows(l, s))) {
        /* [rows, gate | up] in gate's and up's room (side by side: one row is their own layout) */
        failed |= linear(kn, &l->gate_up, s->normed, s->gate, rows, h, 2 * inter, threads);
        if (rows == 1 && l->lora != NULL) {
            lora_add(s, &l->lora[GATE], s->normed, s->gate, h, inter);
            lora_add(s, &l->lora[UP], s->normed, s->gate + inter, h, inter);
        }
        kn->act_mul(s->gate, 2 * inter, s->gate + inter, 2 * inter, s->act, rows, inter, s->activation, threads);
    } else {
        failed |= projection(kn, l, s, GATE, &l->gate, s->normed, s->gate, rows, h, inter);
        failed |= projection(kn, l, s, UP, &l->up, s->normed, s->up, rows, h, inter);
        kn->act_mul(s->gate, inter, s->up, inter, s->act, rows, inter, s->activation, threads);
    }
    failed |= projection(kn, l, s, DOWN, &l->down, s->act, s->projected, rows, inter, h);
    kn->rms_norm(s->projected, l->post_mlp_norm, s->projected, rows, h, s->eps, threads);
    add_into(hidden, s->projected, rows * h);
    return failed;
}

/* hidden [rows, hidden] through `count` layers, in place (with step->keep, the kept rows' first);
 * nonzero if a kernel failed. */
int fairserve_decode_layers(float *hidden, const layer_t *layers, int64_t count, const step_t *step,
                            const kernels_t *kernels) {
    const int64_t *keep = step->lora_slots == NULL ? step->keep : NULL;
    for (int64_t i = 0; i < count; i++)
        if (layer(kernels, &layers[i], step, hidden, i == count - 1 ? keep : NULL, step->kept)) return 1;
    return 0;
}
