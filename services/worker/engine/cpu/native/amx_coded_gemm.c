/* A float32 GEMM for wide steps on AMX (CPU with AMX-BF16 and AVX512-BF16), straight from a
 * linear's weight codes (weight_codes.py: weight[n, k] = scale[n, b] * code[n, k] + offset[n, b]
 * in every block b of G = `group` inputs, codes 0 .. 255):
 *
 *   y[m, n] = sum_b (scale[n, b] * C[m, n, b] + offset[n, b] * X[m, b]),
 *   C[m, n, b] = sum_{k in b} code[n, k] * x[m, k],   X[m, b] = sum_{k in b} x[m, k].
 *
 * AMX multiplies bfloat16 pairs and adds them into float32. A code (an integer up to 255) is a
 * bfloat16 exactly, and each float32 activation is split into three bfloat16 pieces whose sum
 * is the float32 value exactly (hi = bf16(x), mid = bf16(x - hi), lo = bf16(x - hi - mid): 8
 * significant bits each, 24 in all), so every product code * piece is exact and C is a float32
 * sum of 3 G exact products: the products of a float32 GEMM, added in float32 (each addition
 * rounded to nearest), in another order. AMX treats inputs below 2^-126 as zero: a lo piece of
 * an activation under ~2^-110, far below the float32 rounding of any sum it is in.
 *
 *   block b of one panel (32 outputs, two 16-column tiles), 32 activation rows:
 *
 *          B0 (cols 0-15)  B1 (cols 16-31)    B tiles: the block's codes as bfloat16 pairs,
 *        +---------------+---------------+             [G / 2][16 columns][2], from the codes
 *   A0 s |  C0 += A0s B0 |  C1 += A0s B1 |    A tiles: 16 rows x G inputs of piece s (hi, mid,
 *   A1 s |  C2 += A1s B0 |  C3 += A1s B1 |             lo); the three pieces add into one C
 *        +---------------+---------------+
 *   then acc[m, n] += scale[n, b] * C[m, n] + offset[n, b] * X[m, b]   (AVX-512, in block order)
 *
 * Loops: first the threads turn every panel's codes into B tiles. With many rows (prefill) each
 * thread then takes its share of the rows in chunks whose three pieces fit its L2: it splits a
 * chunk's rows and runs every panel's B tiles against the chunk's 32-row blocks, so the pieces
 * are read back from L2, never from memory (splitting all rows first and then sharing out the
 * panels took 4-54 % longer by shape). With few rows (decode) they split the rows and take
 * the panels in turns.
 *
 * x [rows, in] float32; codes in the coded kernel's panels ([ceil(out / 32)][in][32] bytes, or
 * narrow codes of 4-6 bits, coded_linear.c), scales and offsets [ceil(out / 32)][in / G][32]
 * float32; y [rows, out]. `scratch`: the caller's, of fairserve_amx_scratch_bytes(rows, in, group,
 * out) bytes (the split activations, their block sums, the B tiles).
 */

#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <omp.h>
#include <sys/syscall.h>

#define PANEL 32          /* output columns a panel of the codes' layout (two tiles) */
#define ROW_BLOCK 32      /* activation rows a pass (two tiles) */
#define PIECES 3
#define CHUNK_BYTES (1 << 19)   /* a chunk's split activations: with the B tiles streaming past, a share of L2 */
#define ROW_MODE_BLOCKS 4       /* 32-row blocks a thread from which the threads split the rows */

static inline int64_t narrow_stride(int64_t bits) { return 16 + 4 * (bits - 4); }

static inline int64_t padded_rows(int64_t rows) { return (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK; }

/* Bytes of the scratch for `rows` activation rows of `in` inputs in blocks of `group` and `out`
 * outputs: the three pieces, the block sums and the B tiles of every panel. */
int64_t fairserve_amx_scratch_bytes(int64_t rows, int64_t in, int64_t group, int64_t out) {
    if (rows < 0 || in <= 0 || group <= 0 || out < 0) return 0;
    return PIECES * padded_rows(rows) * in * 2 + padded_rows(rows) * (in / group) * (int64_t)sizeof(float)
           + (out + PANEL - 1) / PANEL * in * PANEL * 2;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* 1 where the kernel runs: built with AMX and the kernel lets this process use its tiles. */
int fairserve_amx_available(void) {
    static int state = -1;
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
}

/* Tiles 0-3: C (16 x 16 float32), 4-5: A (16 rows x G bfloat16), 6-7: B (G / 2 pairs x 16 x 2). */
static void configure_tiles(int64_t group) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 4; t++) config.rows[t] = 16, config.colsb[t] = 64;
    for (int t = 4; t < 6; t++) config.rows[t] = 16, config.colsb[t] = (uint16_t)(group * 2);
    for (int t = 6; t < 8; t++) config.rows[t] = (uint8_t)(group / 2), config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* Rows [lo, hi) of x as three bfloat16 pieces (pieces[s][m][k]) and their block sums. */
static void split_rows(const float *x, int64_t lo, int64_t hi, int64_t rows, int64_t in, int64_t group,
                       uint16_t *pieces, int64_t piece_stride, float *sums) {
    const int64_t blocks = in / group;
    for (int64_t m = lo; m < hi; m++) {
        uint16_t *p0 = pieces + m * in, *p1 = p0 + piece_stride, *p2 = p1 + piece_stride;
        if (m >= rows) {                  /* padding rows: zero pieces, nothing stored from them */
            memset(p0, 0, 2 * in), memset(p1, 0, 2 * in), memset(p2, 0, 2 * in);
            memset(sums + m * blocks, 0, sizeof(float) * blocks);
            continue;
        }
        const float *row = x + m * in;
        __m512 block = _mm512_setzero_ps();
        for (int64_t k = 0; k < in; k += 16) {
            const __m512 v = _mm512_loadu_ps(row + k);
            block = _mm512_add_ps(block, v);
            if ((k + 16) % group == 0) {       /* the block's sum, its halves added in a tree */
                sums[m * blocks + k / group] = _mm512_reduce_add_ps(block);
                block = _mm512_setzero_ps();
            }
            const __m256bh h = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, _mm512_cvtpbh_ps(h));
            const __m256bh d = _mm512_cvtneps_pbh(r1);
            const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, _mm512_cvtpbh_ps(d)));
            _mm256_storeu_si256((__m256i *)(p0 + k), (__m256i)h);
            _mm256_storeu_si256((__m256i *)(p1 + k), (__m256i)d);
            _mm256_storeu_si256((__m256i *)(p2 + k), (__m256i)l);
        }
    }
}

/* Half h (columns 16 h .. 16 h + 15) of a panel's codes at input k, as 16 floats. */
static inline __m512 code_floats(const uint8_t *c, int64_t k, int bits, int h) {
    if (bits == 8)
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + k * PANEL + 16 * h))));
    const uint8_t *p = c + k * narrow_stride(bits);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i code = _mm512_and_si512(h == 0 ? bytes : _mm512_srli_epi32(bytes, 4), _mm512_set1_epi32(15));
    for (int b = 0; b < bits - 4; b++) {
        uint32_t word;
        memcpy(&word, p + 16 + 4 * b, sizeof word);
        code = _mm512_mask_add_epi32(code, (__mmask16)(word >> (16 * h)), code, _mm512_set1_epi32(16 << b));
    }
    return _mm512_cvtepi32_ps(code);
}

/* A panel's codes as B tiles: tiles[h][k / 2][n][k % 2] bfloat16 (exact: codes are at most 255). */
static void panel_tiles(const uint8_t *c, int64_t in, int bits, uint16_t *tiles) {
    static const uint16_t order[32] __attribute__((aligned(64))) = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i pairs = _mm512_load_si512((const void *)order);
    for (int h = 0; h < 2; h++)
        for (int64_t k = 0; k < in; k += 2) {
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(code_floats(c, k + 1, bits, h), code_floats(c, k, bits, h));
            _mm512_storeu_si512((void *)(tiles + (h * (in / 2) + k / 2) * 32), _mm512_permutexvar_epi16(pairs, both));
        }
}

/* y rows m0 .. m0 + 32 (those under `rows`), columns of panel p (those under `out`). */
static void block_pass(const uint16_t *pieces, int64_t piece_stride, const float *sums, const uint16_t *tiles,
                       const float *scales, const float *offsets, int64_t group, int64_t in, int64_t m0, int64_t rows,
                       float *y, int64_t out, int64_t n0) {
    const int64_t blocks = in / group, a_stride = in * 2;
    float acc[ROW_BLOCK][PANEL] __attribute__((aligned(64)));
    float c[ROW_BLOCK][PANEL] __attribute__((aligned(64)));
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < blocks; b++) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(6, tiles + (b * group / 2) * 32, 64);
        _tile_loadd(7, tiles + (in / 2 + b * group / 2) * 32, 64);
        for (int s = 0; s < PIECES; s++) {
            const uint16_t *a = pieces + s * piece_stride + m0 * in + b * group;
            _tile_loadd(4, a, a_stride);
            _tile_loadd(5, a + 16 * in, a_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, &c[0][0], PANEL * 4);
        _tile_stored(1, &c[0][16], PANEL * 4);
        _tile_stored(2, &c[16][0], PANEL * 4);
        _tile_stored(3, &c[16][16], PANEL * 4);
        const __m512 s0 = _mm512_loadu_ps(scales + b * PANEL), s1 = _mm512_loadu_ps(scales + b * PANEL + 16);
        const __m512 o0 = _mm512_loadu_ps(offsets + b * PANEL), o1 = _mm512_loadu_ps(offsets + b * PANEL + 16);
        for (int r = 0; r < ROW_BLOCK; r++) {
            const __m512 sum = _mm512_set1_ps(sums[(m0 + r) * blocks + b]);
            __m512 a0 = _mm512_fmadd_ps(_mm512_load_ps(&c[r][0]), s0, _mm512_load_ps(&acc[r][0]));
            __m512 a1 = _mm512_fmadd_ps(_mm512_load_ps(&c[r][16]), s1, _mm512_load_ps(&acc[r][16]));
            _mm512_store_ps(&acc[r][0], _mm512_fmadd_ps(o0, sum, a0));
            _mm512_store_ps(&acc[r][16], _mm512_fmadd_ps(o1, sum, a1));
        }
    }
    const int64_t valid_rows = rows - m0 < ROW_BLOCK ? rows - m0 : ROW_BLOCK;
    const int64_t valid = out - n0 < PANEL ? out - n0 : PANEL;
    for (int64_t r = 0; r < valid_rows; r++) memcpy(y + (m0 + r) * out + n0, acc[r], sizeof(float) * valid);
}

/* 0; 1 for shapes it does not take (group not 16 or 32, in not a multiple of it, bits not
 * 4-6 or 8); 3 where it cannot run (built without AMX, or the tiles not granted). */
int fairserve_amx_coded_gemm(const float *x, int64_t rows, int64_t in, const uint8_t *codes, const float *scales,
                             const float *offsets, int64_t group, int64_t bits, float *y, int64_t out, void *scratch,
                             int64_t num_threads) {
    if ((group != 16 && group != 32) || in <= 0 || in % group || rows < 0 || out <= 0) return 1;
    if (bits != 8 && (bits < 4 || bits > 6)) return 1;
    if (!fairserve_amx_available()) return 3;
    if (rows == 0) return 0;
    if (num_threads < 1) num_threads = 1;
    const int64_t padded = padded_rows(rows), piece_stride = padded * in, blocks = in / group;
    uint16_t *pieces = scratch;
    float *sums = (float *)(pieces + PIECES * piece_stride);
    const int64_t panels = (out + PANEL - 1) / PANEL;
    const int64_t panel_bytes = in * (bits == 8 ? PANEL : narrow_stride(bits));
    uint16_t *b_tiles = (uint16_t *)(sums + padded * blocks);
#pragma omp parallel num_threads(num_threads)
    {
        /* Each thread's share of the rows (of the team it got), in chunks whose pieces fit L2. */
        const int64_t team = omp_get_num_threads();
        const int64_t share = padded_rows((padded + team - 1) / team);
        const int64_t chunks = (share * PIECES * 2 * in + CHUNK_BYTES - 1) / CHUNK_BYTES;
        const int64_t chunk = padded_rows((share + chunks - 1) / chunks);
        const int by_rows = padded >= ROW_MODE_BLOCKS * ROW_BLOCK * team;
        if (!by_rows) {
#pragma omp for schedule(static) nowait
            for (int64_t m = 0; m < padded; m += ROW_BLOCK)
                split_rows(x, m, m + ROW_BLOCK, rows, in, group, pieces, piece_stride, sums);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) panel_tiles(codes + p * panel_bytes, in, (int)bits, b_tiles + p * in * PANEL);
        configure_tiles(group);
        if (by_rows) {            /* each thread its chunks: split, then every panel against them */
            const int64_t first = omp_get_thread_num() * share;
            const int64_t last = first + share < padded ? first + share : padded;
            for (int64_t m0 = first; m0 < last; m0 += chunk) {
                const int64_t m1 = m0 + chunk < last ? m0 + chunk : last;
                split_rows(x, m0, m1, rows, in, group, pieces, piece_stride, sums);
                for (int64_t p = 0; p < panels; p++)
                    for (int64_t m = m0; m < m1; m += ROW_BLOCK)
                        block_pass(pieces, piece_stride, sums, b_tiles + p * in * PANEL, scales + p * blocks * PANEL,
                                   offsets + p * blocks * PANEL, group, in, m, rows, y, out, p * PANEL);
            }
        } else {                  /* few rows: the threads take the panels in turns */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                for (int64_t m = 0; m < padded; m += ROW_BLOCK)
                    block_pass(pieces, piece_stride, sums, b_tiles + p * in * PANEL, scales + p * blocks * PANEL,
                               offsets + p * blocks * PANEL, group, in, m, rows, y, out, p * PANEL);
        }
        _tile_release();
    }
    return 0;
}
#else
int fairserve_amx_available(void) { return 0; }

int fairserve_amx_coded_gemm(const float *x, int64_t rows, int64_t in, const uint8_t *codes, const float *scales,
                             const float *offsets, int64_t group, int64_t bits, float *y, int64_t out, void *scratch,
                             int64_t num_threads) {
    (void)x, (void)rows, (void)in, (void)codes, (void)scales, (void)offsets, (void)group, (void)bits, (void)y;
    (void)out, (void)scratch, (void)num_threads;
    return 3;
}
#endif
