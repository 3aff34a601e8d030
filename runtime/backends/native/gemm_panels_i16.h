/* Panels of q4 weight rows times groups of int16 activation rows (AVX-512 VNNI): the fused
 * decode stack's many-row product for q4 blocks with int16 activations (`fused_decode_layers.c`).
 *
 * Why: from about 9 rows a product is bound by arithmetic. The float32 panels of
 * `gemm_panels.h` run at the FMA units' rate, 16 multiply-adds an instruction; one
 * `vpdpwssd` does 32 (16 lanes x a pair of int16 products), and measured on Zen 5 (one
 * thread, a 6-row panel times 32 rows, 1536 values) the loop below ran 214 G multiply-adds/s
 * against the float panel's 134. The streaming int16 kernel (`quant_blocks_i16.h`) spends
 * about 5 instructions per 64 products on widening and scaling each pair of blocks for
 * every row, so past a few rows the panels win.
 *
 * Numbers: the activations are rounded by the streaming form's own `qb_i16_round_block` (steps
 * of max|x_b| / 32767 per row and 32-value block b), and a block's 32 integer products are
 * summed exactly (q4: |sum| <= 32 * 15 * 32767 < 2^24, so even its float32 conversion is
 * exact; q8, in blocks of 32 here only: < 2^31, converted with float32 rounding); only the
 * float32 order of the blocks' scaled sums differs from the streaming kernel.
 *
 * Layouts. A q4 block's byte j holds value j (low nibble) and value j + 16 (high nibble), so
 * the pair a `vpdpwssd` lane multiplies is (j, j + 16): a panel row's word j of block b is
 * `low | high << 16` of that byte, which is one widening and two shifts per block, and an
 * activation group's word j of block b pairs the rounded x[b*32 + j] and x[b*32 + j + 16].
 *   group of W = V * 16 rows (V = qg_vectors(rows)): int32 words [nb * 16][W], then float
 *   steps [nb][W], then the exact block sums [nb][W] (for the q4 `min * sum(x_b)` term);
 *   rows past the last are zeros.
 *   panel of NR = qi_panel_rows(V) weight rows: int32 words [NR][nb * 16], then scales and
 *   mins float [NR][nb].
 */
#ifndef LLM_RUNTIME_GEMM_PANELS_I16_H
#define LLM_RUNTIME_GEMM_PANELS_I16_H

#include "gemm_panels.h"
#include "quant_blocks.h"

/* Rows from which int16 products run on these panels rather than streamed
 * (`quant_blocks_i16.h`): measured on Zen 5 in SmolLM2 Q4_1 decode steps (see
 * `fused_decode_layers.c`), the two tie at 10-11 rows. Python reads it from the library
 * (`quant_i16_panel_from_rows`). */
#define QI_PANEL_FROM_ROWS 11

/* Weight rows per panel: NR x V integer and as many float accumulators stay in registers,
 * 12 x 1 for groups of 16 rows, 6 x 2 for groups of 32. With one activation vector, each
 * broadcast weight word feeds one `vpdpwssd`, so the loop is bound by loads: from L1 on Zen 5,
 * 12-row panels ran 243 G multiply-adds/s where 6-row ones ran 193 (6 x 2: 264). */
#define QI_NR 6
#define QI_NR_MAX 12

#if QB_Q4_I16

static inline int qi_panel_rows(int V) { return V == 1 ? QI_NR_MAX : QI_NR; }

/* Floats (4-byte words) of one prepared group of W rows of `cols` values. */
static inline int64_t qi_group_floats(int64_t cols, int64_t width) {
    const int64_t nb = cols / 32;
    return width * (nb * 16 + 2 * nb);
}

/* Floats of `qi_prepare`'s output for `rows` rows of `cols` values. */
static inline int64_t qi_prepared_floats(int64_t rows, int64_t cols) {
    const int64_t width = (int64_t)qg_vectors(rows) * QG_LANES;
    return (rows + width - 1) / width * qi_group_floats(cols, width);
}

/* Floats of a panel (words, scales, mins) for `cols` values, rounded up to a cache line so
 * that the output tile after it, and the next thread's scratch, start on their own lines
 * (two threads writing one line ran the 2-thread product at 1.2x one thread's rate). */
static inline int64_t qi_panel_floats(int64_t cols) {
    const int64_t nb = cols / 32;
    return (QI_NR_MAX * (nb * 16 + 2 * nb) + 15) / 16 * 16;
}

/* Floats of one thread's scratch (a panel and its output tile) for `cols` values. */
static inline int64_t qi_scratch_floats(int64_t cols) {
    return qi_panel_floats(cols) + QI_NR_MAX * 2 * QG_LANES;
}

/* Rows [0, rows) of x (`ldx` apart) as the groups above; cols a multiple of 32. */
static inline void qi_prepare(const float *x, int64_t ldx, int64_t rows, int64_t cols,
                              float *out) {
    const int64_t nb = cols / 32, width = (int64_t)qg_vectors(rows) * QG_LANES;
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    for (int64_t g = 0; g * width < rows; ++g) {
        float *group = out + g * qi_group_floats(cols, width);
        int32_t *words = (int32_t *)group;
        float *steps = group + nb * 16 * width, *sums = steps + nb * width;
        const int64_t n = rows - g * width < width ? rows - g * width : width;
        if (n < width) memset(group, 0, sizeof(float) * qi_group_floats(cols, width));
        /* block by block, every row into the block's words: they stay in L1 (see
         * `qg_transpose`) */
        for (int64_t b = 0; b < nb; ++b) {
            for (int64_t r = 0; r < n; ++r) {
                const float *row = x + (g * width + r) * ldx;
                __m256i lo, hi;
                steps[b * width + r] = qb_i16_round_block(row + b * 32, &lo, &hi, &sums[b * width + r]);
                int32_t pairs[16];
                _mm512_storeu_si512((void *)pairs,
                                    _mm512_or_si512(_mm512_and_si512(_mm512_cvtepi16_epi32(lo), low16),
                                                    _mm512_slli_epi32(_mm512_cvtepi16_epi32(hi), 16)));
                for (int j = 0; j < 16; ++j) words[(b * 16 + j) * width + r] = pairs[j];
            }
        }
    }
}

/* Rows [o0, o1) (at most NR) of m (q4, or q8 in blocks of 32) into an NR-row panel: words,
 * then scales and mins (q8: zeros; rows past o1 zero, so they add nothing). A q8 block's word
 * j pairs its values j and j + 16, as a q4 block's does. */
static inline void qi_unpack(const qb_matrix *m, int64_t o0, int64_t o1, int NR, float *panel) {
    const int64_t nb = m->cols / 32, kps = nb * 16;
    int32_t *words = (int32_t *)panel;
    float *scales = panel + NR * kps, *mins = scales + NR * nb;
    float sbuf[NR * nb], mbuf[NR * nb];
    const float *ts, *tm;
    qb_tile_floats(m, nb, o0, o1, sbuf, mbuf, &ts, &tm);
    memcpy(scales, ts, sizeof(float) * (o1 - o0) * nb);
    if (tm != NULL)
        memcpy(mins, tm, sizeof(float) * (o1 - o0) * nb);
    else
        memset(mins, 0, sizeof(float) * (o1 - o0) * nb);
    const __m512i low4 = _mm512_set1_epi32(0x0F), low16 = _mm512_set1_epi32(0xFFFF);
    for (int64_t o = o0; o < o1; ++o) {
        int32_t *row = words + (o - o0) * kps;
        if (m->kind == QB_Q4) {
            const uint8_t *q = (const uint8_t *)m->qs + o * (m->cols / 2);
            for (int64_t b = 0; b < nb; ++b) {
                const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 16)));
                _mm512_storeu_si512((void *)(row + b * 16),
                                    _mm512_or_si512(_mm512_and_si512(v, low4),
                                                    _mm512_slli_epi32(_mm512_srli_epi32(v, 4), 16)));
            }
        } else {
            const int8_t *q = (const int8_t *)m->qs + o * m->cols;
            for (int64_t b = 0; b < nb; ++b) {
                const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32)));
                const __m512i hi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32 + 16)));
                _mm512_storeu_si512((void *)(row + b * 16),
                                    _mm512_or_si512(_mm512_and_si512(lo, low16), _mm512_slli_epi32(hi, 16)));
            }
        }
    }
    const int64_t count = o1 - o0;
    if (count < NR) {
        memset(words + count * kps, 0, sizeof(int32_t) * (NR - count) * kps);
        memset(scales + count * nb, 0, sizeof(float) * (NR - count) * nb);
        memset(mins + count * nb, 0, sizeof(float) * (NR - count) * nb);
    }
}

/* acc += a pair-wise int16 product of x and w (one `vpdpwssd`). Written as inline assembly:
 * GCC 12 copies the accumulator of `_mm512_dpwssd_epi32` through a second register at every
 * use, which took a quarter of the loop's time. */
static inline __attribute__((always_inline)) void qi_dot(__m512i *acc, __m512i x, __m512i w) {
    __asm__("vpdpwssd %2, %1, %0" : "+v"(*acc) : "v"(x), "v"(w));
}

/* tmp[o, l] = sum over blocks b of scale[o, b] * step[b, l] * (int sum of block b) +
 * min[o, b] * sums[b, l], for o < NR and l < V * 16 lanes; meanwhile the `ahead` bytes
 * at `next` (the next panel's blocks) are fetched, a line per word column. */
static inline __attribute__((always_inline)) void qi_micro(const int V, const int NR,
                                                           const float *panel,
                                                           int64_t nb, const float *group,
                                                           float *tmp, const char *next,
                                                           int64_t ahead) {
    const int64_t kps = nb * 16, width = (int64_t)V * QG_LANES;
    const int32_t *words = (const int32_t *)panel;
    const float *scales = panel + NR * kps, *mins = scales + NR * nb;
    const int32_t *xw = (const int32_t *)group;
    const float *steps = group + kps * width, *sums = steps + nb * width;
    __m512 acc[QI_NR_MAX][2];
#pragma GCC unroll 12
    for (int o = 0; o < NR; ++o)
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[o][v] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i dots[QI_NR_MAX][2];
#pragma GCC unroll 12
        for (int o = 0; o < NR; ++o)
#pragma GCC unroll 2
            for (int v = 0; v < V; ++v) dots[o][v] = _mm512_setzero_si512();
        for (int64_t kp = b * 16; kp < b * 16 + 16; ++kp) {
            if (kp * 64 < ahead) __builtin_prefetch(next + kp * 64, 0, 3);
            __m512i x[2];
#pragma GCC unroll 2
            for (int v = 0; v < V; ++v)
                x[v] = _mm512_loadu_si512((const void *)(xw + kp * width + v * QG_LANES));
#pragma GCC unroll 12
            for (int o = 0; o < NR; ++o) {
                const __m512i w = _mm512_set1_epi32(words[o * kps + kp]);
#pragma GCC unroll 2
                for (int v = 0; v < V; ++v) qi_dot(&dots[o][v], x[v], w);
            }
        }
        __m512 step[2], sum[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) {
            step[v] = _mm512_loadu_ps(steps + b * width + v * QG_LANES);
            sum[v] = _mm512_loadu_ps(sums + b * width + v * QG_LANES);
        }
#pragma GCC unroll 12
        for (int o = 0; o < NR; ++o) {
            const __m512 s = _mm512_set1_ps(scales[o * nb + b]), m = _mm512_set1_ps(mins[o * nb + b]);
#pragma GCC unroll 2
            for (int v = 0; v < V; ++v) {
                acc[o][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[o][v]),
                                            _mm512_mul_ps(s, step[v]), acc[o][v]);
                acc[o][v] = _mm512_fmadd_ps(m, sum[v], acc[o][v]);
            }
        }
    }
#pragma GCC unroll 12
    for (int o = 0; o < NR; ++o)
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) _mm512_storeu_ps(tmp + o * width + v * QG_LANES, acc[o][v]);
}

/* y[r, o] (= or += where `accumulate`) sum_i W[o, i] x[r, i] for o in [o0, o1), r < rows,
 * W the blocks m (q4, or q8 in blocks of 32), x as `qi_prepare` wrote it; `scratch`: this thread's
 * `qi_scratch_floats(m->cols)`. */
static inline void qi_stripe(const qb_matrix *m, const float *prepared, int64_t rows, float *y,
                             int64_t ldy, int64_t o0, int64_t o1, int accumulate,
                             float *scratch) {
    const int64_t cols = m->cols, nb = cols / 32;
    const int V = qg_vectors(rows);
    const int64_t width = (int64_t)V * QG_LANES, groups = (rows + width - 1) / width;
    float *panel = scratch, *tmp = scratch + qi_panel_floats(cols);
    const int64_t row_bytes = m->kind == QB_Q4 ? cols / 2 : cols;
    const int NR = qi_panel_rows(V);
    for (int64_t o = o0; o < o1; o += NR) {
        const int64_t e = o + NR < o1 ? o + NR : o1, count = e - o;
        const int64_t next_rows = e + NR < o1 ? NR : o1 - e;
        qi_unpack(m, o, e, NR, panel);
        const char *next = (const char *)m->qs + e * row_bytes;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t ahead = g ? 0 : next_rows * row_bytes;
            const float *group = prepared + g * qi_group_floats(cols, width);
            if (V == 2)
                qi_micro(2, QI_NR, panel, nb, group, tmp, next, ahead);
            else
                qi_micro(1, QI_NR_MAX, panel, nb, group, tmp, next, ahead);
            const int64_t rg = g * width, nr = rows - rg < width ? rows - rg : width;
            qg_store_tile(tmp, width, nr, count, y + rg * ldy + o, ldy, accumulate);
        }
    }
}

#endif /* QB_Q4_I16 */
#endif
