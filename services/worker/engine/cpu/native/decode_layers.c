/* A decode step's decoder layers in one call (CPU, float32; Gemma 3's layer shape).
 *
 * Written out in Python, each layer of a decode step is ~25 small calls (norms, the seven
 * projections, RoPE, the K/V write, attention, residual adds), and their glue costs a few
 * hundred microseconds a layer, ~10 ms a step on the default model: as much as its matmuls at
 * one sequence. This runs the same kernels in the same order from C, so the hidden states are
 * bitwise those of the Python path (direct_forward.py): the kernels come in as function
 * pointers to the engine's own libraries (coded_linear.c, elementwise.c, paged_decode.c).
 *
 * Every row is one sequence's decoded token. Per layer:
 *   normed = rms_norm(hidden, input_norm)
 *   q, k, v = codes(normed)                     [rows, heads | kv_heads, head_dim]
 *   q, k = rms_norm(q, q_norm), rms_norm(k, k_norm), then RoPE (cos, sin of the layer's type)
 *   k_cache[slots], v_cache[slots] = k, v      (the slots and tables of the layer's cache group)
 *   attention through the block tables (window 0: none) -> o_proj -> post_attention_norm
 *   hidden = hidden + that
 *   mlp = down(act(gate(normed)) * up(normed)) with normed = rms_norm(hidden, pre_mlp_norm)
 *   hidden = hidden + post_mlp_norm(mlp)
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

typedef struct {
    coded_linear_fn coded_linear;
    rms_norm_fn rms_norm;
    act_mul_fn act_mul;
    rope_fn rope;
    attention_fn attention;
} kernels_t;

typedef struct {
    const uint8_t *codes;
    const float *scales;
    const float *offsets;
    int64_t group;
    int64_t bits;                    /* 8: a byte a code; 4, 5, 6: narrow codes (coded_linear.c) */
} coded_t;

typedef struct {
    coded_t q, k, v, o, gate, up, down;
    const float *input_norm, *q_norm, *k_norm, *post_attention_norm, *pre_mlp_norm, *post_mlp_norm;
    float *k_cache, *v_cache;        /* [slots, kv_heads, head_dim] */
    const float *cos, *sin;          /* [rows, head_dim], of the layer's type */
    const int64_t *slots;            /* [rows] cache slot of each row's new K/V, in this cache's blocks */
    const int64_t *block_tables;     /* [rows, table_width], in this cache's blocks */
    int64_t table_width;
    int64_t window;                  /* 0: full attention */
    int64_t splits;                  /* context splits the attention kernel takes */
    float scaling;
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
} step_t;

static int linear(const kernels_t *kernels, const coded_t *weight, const float *x, float *out, int64_t rows,
                  int64_t in, int64_t out_features, int64_t threads) {
    return kernels->coded_linear(x, weight->codes, weight->scales, weight->offsets, weight->group, weight->bits,
                                 NULL, out, rows, in, out_features, threads);
}

static void add_into(float *hidden, const float *other, int64_t count) {
    for (int64_t i = 0; i < count; i++) hidden[i] = hidden[i] + other[i];
}

static int layer(const kernels_t *kn, const layer_t *l, const step_t *s, float *hidden) {
    const int64_t rows = s->rows, h = s->hidden, hd = s->head_dim, threads = s->num_threads;
    const int64_t q_width = s->heads * hd, kv_width = s->kv_heads * hd, inter = s->intermediate;
    int failed = 0;

    kn->rms_norm(hidden, l->input_norm, s->normed, rows, h, s->eps, threads);
    failed |= linear(kn, &l->q, s->normed, s->q, rows, h, q_width, threads);
    failed |= linear(kn, &l->k, s->normed, s->k, rows, h, kv_width, threads);
    failed |= linear(kn, &l->v, s->normed, s->v, rows, h, kv_width, threads);
    kn->rms_norm(s->q, l->q_norm, s->q, rows * s->heads, hd, s->eps, threads);
    kn->rms_norm(s->k, l->k_norm, s->k, rows * s->kv_heads, hd, s->eps, threads);
    kn->rope(s->q, s->heads, s->k, s->kv_heads, l->cos, l->sin, rows, hd, threads);
    for (int64_t r = 0; r < rows; r++) {
        memcpy(l->k_cache + l->slots[r] * kv_width, s->k + r * kv_width, sizeof(float) * kv_width);
        memcpy(l->v_cache + l->slots[r] * kv_width, s->v + r * kv_width, sizeof(float) * kv_width);
    }
    failed |= kn->attention(s->q, l->k_cache, l->v_cache, l->block_tables, s->ctx_lens, s->attn_out, rows, s->heads,
                            s->kv_heads, hd, hd, l->table_width, s->block_size, l->window, l->scaling, l->splits,
                            threads);
    failed |= linear(kn, &l->o, s->attn_out, s->projected, rows, q_width, h, threads);
    kn->rms_norm(s->projected, l->post_attention_norm, s->projected, rows, h, s->eps, threads);
    add_into(hidden, s->projected, rows * h);

    kn->rms_norm(hidden, l->pre_mlp_norm, s->normed, rows, h, s->eps, threads);
    failed |= linear(kn, &l->gate, s->normed, s->gate, rows, h, inter, threads);
    failed |= linear(kn, &l->up, s->normed, s->up, rows, h, inter, threads);
    kn->act_mul(s->gate, inter, s->up, inter, s->act, rows, inter, s->activation, threads);
    failed |= linear(kn, &l->down, s->act, s->projected, rows, inter, h, threads);
    kn->rms_norm(s->projected, l->post_mlp_norm, s->projected, rows, h, s->eps, threads);
    add_into(hidden, s->projected, rows * h);
    return failed;
}

/* hidden [rows, hidden] through `count` layers, in place; nonzero if a kernel failed. */
int fairserve_decode_layers(float *hidden, const layer_t *layers, int64_t count, const step_t *step,
                            const kernels_t *kernels) {
    for (int64_t i = 0; i < count; i++)
        if (layer(kernels, &layers[i], step, hidden)) return 1;
    return 0;
}
