/* A float32 GEMM for wide steps (prefill chunks), CPU, AVX2 and FMA:
 *
 *   y[m, n] = sum_k x[m, k] * weight[n, k]
 *
 * The weight comes in panels of 16 output columns, [out / 16][in][16]: entry (n, k) at
 * ((n / 16) * in + k) * 16 + n % 16 (fairserve_codes_expand_blocked writes it straight from
 * a linear's codes). A micro-kernel holds 6 rows by 16 columns of y in 12 vector accumulators
 * (AVX2's 16 registers: 12 sums, 2 weight vectors, 1 broadcast activation) and walks k: each
 * step loads the panel's 16 weights once for 6 rows and broadcasts 6 activations from their
 * rows, so 12 fused multiply-adds cost 8 loads. Loops, outermost first: a thread's rows in
 * blocks of ROW_BLOCK (their activations stay in L2), k in blocks of K_BLOCK, the panels, the
 * block's 6-row tiles (a panel's K_BLOCK x 16 weights stay in L1 across them).
 *
 * Each output is one chain of multiply-adds over k in increasing order per K_BLOCK, the block
 * sums added to y in order: the order oneDNN's AVX2 GEMM uses on the CPUs measured, so the
 * outputs are its outputs bit for bit there (coded_wide.py checks it per shape at start and
 * keeps oneDNN's GEMM wherever they differ). The weight's panels are 16 columns, not oneDNN's
 * 64: a 16-column slice of a 64-column block strides 256 bytes a k step, which maps every
 * weight row of a panel onto a quarter of L1's sets (measured ~10 % slower at 1,785 rows).
 *
 * Threads split the rows, in multiples of 6. Returns nonzero (nothing written) where it
 * cannot run: no AVX2/FMA in this build, or `out` not a multiple of 16.
 */

#include <stdint.h>

#define PANEL 16
#define TILE_ROWS 6
#define ROW_BLOCK 96
#define K_BLOCK 1024

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* y tile [rows <= 6][16] (= or += when !first) of rows x (stride in) against a panel's
 * weights w (stride 16 floats a k), k from 0 to kc. Rows past `rows` read row 0 again and
 * are not stored. */
static inline void tile(const float *x, int64_t in, const float *w, int64_t kc, float *y, int64_t ldy, int rows,
                        int first) {
    const float *x0 = x, *x1 = x + (rows > 1 ? in : 0), *x2 = x + (rows > 2 ? 2 * in : 0);
    const float *x3 = x + (rows > 3 ? 3 * in : 0), *x4 = x + (rows > 4 ? 4 * in : 0);
    const float *x5 = x + (rows > 5 ? 5 * in : 0);
    for (int r = 0; r < rows; r++) {
        _mm_prefetch((const char *)(y + r * ldy), _MM_HINT_T0);
        _mm_prefetch((const char *)(y + r * ldy + PANEL - 1), _MM_HINT_T0);
    }
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
    for (int64_t k = 0; k < kc; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * PANEL), w1 = _mm256_loadu_ps(w + k * PANEL + 8);
        __m256 v = _mm256_broadcast_ss(x0 + k);
        a00 = _mm256_fmadd_ps(v, w0, a00); a01 = _mm256_fmadd_ps(v, w1, a01);
        v = _mm256_broadcast_ss(x1 + k);
        a10 = _mm256_fmadd_ps(v, w0, a10); a11 = _mm256_fmadd_ps(v, w1, a11);
        v = _mm256_broadcast_ss(x2 + k);
        a20 = _mm256_fmadd_ps(v, w0, a20); a21 = _mm256_fmadd_ps(v, w1, a21);
        v = _mm256_broadcast_ss(x3 + k);
        a30 = _mm256_fmadd_ps(v, w0, a30); a31 = _mm256_fmadd_ps(v, w1, a31);
        v = _mm256_broadcast_ss(x4 + k);
        a40 = _mm256_fmadd_ps(v, w0, a40); a41 = _mm256_fmadd_ps(v, w1, a41);
        v = _mm256_broadcast_ss(x5 + k);
        a50 = _mm256_fmadd_ps(v, w0, a50); a51 = _mm256_fmadd_ps(v, w1, a51);
    }
    const __m256 sums[TILE_ROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
    for (int r = 0; r < rows; r++) {
        float *to = y + r * ldy;
        for (int h = 0; h < 2; h++) {
            const __m256 sum = first ? sums[r][h] : _mm256_add_ps(_mm256_loadu_ps(to + 8 * h), sums[r][h]);
            _mm256_storeu_ps(to + 8 * h, sum);
        }
    }
}

static void rows_of(const float *x, int64_t lo, int64_t hi, int64_t in, const float *weight, int64_t out,
                    float *y) {
    for (int64_t m0 = lo; m0 < hi; m0 += ROW_BLOCK) {
        const int64_t mc = hi - m0 < ROW_BLOCK ? hi - m0 : ROW_BLOCK;
        for (int64_t k0 = 0; k0 < in; k0 += K_BLOCK) {
            const int64_t kc = in - k0 < K_BLOCK ? in - k0 : K_BLOCK;
            for (int64_t n0 = 0; n0 < out; n0 += PANEL) {
                const float *w = weight + n0 * in + k0 * PANEL;
                for (int64_t i = 0; i < mc; i += TILE_ROWS) {
                    const int rows = mc - i < TILE_ROWS ? (int)(mc - i) : TILE_ROWS;
                    tile(x + (m0 + i) * in + k0, in, w, kc, y + (m0 + i) * out + n0, out, rows, k0 == 0);
                }
            }
        }
    }
}

int fairserve_prefill_gemm(const float *x, int64_t rows, int64_t in, const float *weight, int64_t out, float *y,
                           int64_t num_threads) {
    if (out % PANEL || in <= 0 || rows < 0) return 1;
    if (num_threads < 1) num_threads = 1;
    const int64_t share = ((rows + num_threads - 1) / num_threads + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int64_t t = 0; t < num_threads; t++) {
        const int64_t lo = t * share, hi = lo + share < rows ? lo + share : rows;
        if (lo < hi) rows_of(x, lo, hi, in, weight, out, y);
    }
    return 0;
}

#else

int fairserve_prefill_gemm(const float *x, int64_t rows, int64_t in, const float *weight, int64_t out, float *y,
                           int64_t num_threads) {
    (void)x; (void)rows; (void)in; (void)weight; (void)out; (void)y; (void)num_threads;
    return 1;
}

#endif
