/* Panels of weight rows times groups of transposed activation rows: the many-row product of
 * `quant_gemm.c` (block weights) and of the fused decode stack past a few rows (block or
 * float32 weights), as static inline routines each inlines into its own threads.
 *
 * Why this shape: a product of 8-64 rows or more is bound by arithmetic, not by reading the
 * weight, and a dot-product kernel spends its time on loads and horizontal sums. Here
 * - a panel of QG_NR weight rows is used as scalars: float32 weights in place, block weights
 *   dequantized into a per-thread buffer `[QG_NR, cols]` (bit-equal to
 *   `QuantizedMatrix.dequantize`, `qb_dequantize_rows`) that stays in L1/L2;
 * - the activations are transposed once per stage into groups of 16 or 32 rows, `[cols,
 *   lanes]` with zero padding, so a group's value at column i is one or two vector loads;
 * - the micro-kernel keeps QG_NR x (lanes / QG_LANES) accumulator vectors in registers: per
 *   column it loads the group's values once, broadcasts each panel row's weight and
 *   multiplies (2 loads and 12 broadcasts per 24 FMAs for 32 rows), at the FMA units' rate,
 *   while it prefetches the next panel's weight bytes a line per column.
 * Float32 activations and accumulators; only the summation order differs from the other
 * forms. GCC/clang vector extensions keep it portable (16 lanes with AVX-512, else 8).
 */
#ifndef LLM_RUNTIME_GEMM_PANELS_H
#define LLM_RUNTIME_GEMM_PANELS_H

#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX512F__)
#define QG_LANES 16
#else
#define QG_LANES 8
#endif
/* Weight rows per panel (accumulators: QG_NR x vectors per row group). */
#define QG_NR 12

typedef float qg_vec __attribute__((vector_size(QG_LANES * sizeof(float))));

static inline qg_vec qg_load(const float *p) {
    qg_vec v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* tmp[o, l] = sum_i panel[o, i] xt[i, l] for o < QG_NR, l < V * VLANES (vectors VEC of
 * VLANES floats); meanwhile the `ahead` bytes at `next` (the next panel's blocks) are fetched
 * into the cache, a line per column, so its dequantization does not wait for memory. Defined
 * per vector width (below). */
#define QG_DEFINE_MICRO(NAME, VEC, VLANES)                                                     \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const int V, const float *panel, int64_t cols, const float *xt, float *tmp,            \
        const char *next, int64_t ahead) {                                                     \
        VEC acc[QG_NR][2];                                                                     \
        _Pragma("GCC unroll 16") for (int o = 0; o < QG_NR; ++o)                               \
            _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) acc[o][v] = (VEC){0};          \
        const int64_t width = (int64_t)V * (VLANES);                                           \
        for (int64_t i = 0; i < cols; ++i) {                                                   \
            if (i * 64 < ahead) __builtin_prefetch(next + i * 64, 0, 3);                       \
            VEC x[2];                                                                          \
            _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v)                                \
                memcpy(&x[v], xt + i * width + v * (VLANES), sizeof(VEC));                     \
            _Pragma("GCC unroll 16") for (int o = 0; o < QG_NR; ++o) {                         \
                /* a broadcast: x - 0 folds to it, x + 0 does not (-0 + 0 is +0) */            \
                const VEC w = panel[o * cols + i] - (VEC){0};                                  \
                _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v) acc[o][v] += w * x[v];     \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 16") for (int o = 0; o < QG_NR; ++o)                               \
            _Pragma("GCC unroll 2") for (int v = 0; v < V; ++v)                                \
                memcpy(tmp + o * width + v * (VLANES), &acc[o][v], sizeof(VEC));               \
    }

QG_DEFINE_MICRO(qg_micro, qg_vec, QG_LANES)
#if QG_LANES == 16
/* Half-width vectors for groups of at most 8 rows: 16 lanes would leave half of every FMA
 * empty. On Zen 4 a 512-bit FMA issues at half the rate of a 256-bit one, so 8 full lanes do
 * the same work in half the time (a 16-row fused step took no longer than an 8-row one); on
 * CPUs with two 512-bit FMA units the two tie. */
typedef float qg_half __attribute__((vector_size(8 * sizeof(float))));
QG_DEFINE_MICRO(qg_micro_half, qg_half, 8)
#endif
#undef QG_DEFINE_MICRO

#if defined(__AVX512F__)
/* Rows [o0, o1) of m into panel `[o1 - o0, cols]`: `qb_dequantize_rows` with the blocks of 32
 * unpacked in vector registers (that one leaves the unpacking to the compiler, and dequantizing
 * took a third of a 32-row product). Bit-equal to it: where an FMA replaces its multiply and
 * add, the product is exact. */
static inline QB_NO_CONTRACT void qg_dequantize(const qb_matrix *m, int64_t o0, int64_t o1,
                                         float *panel) {
    if (m->block != 32) {
        qb_dequantize_rows(m, o0, o1, panel);
        return;
    }
    const int64_t nb = m->cols / 32, cols = m->cols;
    /* the panel's scales (and mins) widened in one pass ahead of the rows that read them */
    float sbuf[(o1 - o0) * nb], mbuf[(o1 - o0) * nb];
    const float *ts, *tm;
    qb_tile_floats(m, nb, o0, o1, sbuf, mbuf, &ts, &tm);
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t o = o0; o < o1; ++o) {
        const float *sc = ts + (o - o0) * nb;
        float *row = panel + (o - o0) * cols;
        if (m->kind == QB_Q4) {
            const float *mn = tm + (o - o0) * nb;
            const uint8_t *q = (const uint8_t *)m->qs + o * (cols / 2);
            for (int64_t b = 0; b < nb; ++b) {
                /* The block's 16 possible values q * s + m, then two lookups by nibble
                 * (vpermps reads only an index's low 4 bits: the low nibble needs no mask).
                 * With float16 scales (symmetric blocks' too) q * s is exact, so one FMA
                 * rounds as multiply-then-add does. */
                const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 16)));
                const __m512 s = _mm512_set1_ps(sc[b]), min = _mm512_set1_ps(mn[b]);
                const __m512 table = m->scale_f16 ? _mm512_fmadd_ps(levels, s, min)
                                                  : _mm512_add_ps(_mm512_mul_ps(levels, s), min);
                _mm512_storeu_ps(row + b * 32, _mm512_permutexvar_ps(w, table));
                _mm512_storeu_ps(row + b * 32 + 16,
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), table));
            }
        } else {
            const int8_t *q = (const int8_t *)m->qs + o * cols;
            for (int64_t b = 0; b < nb; ++b) {
                const __m512 s = _mm512_set1_ps(sc[b]);
                for (int h = 0; h < 2; ++h) {
                    const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + b * 32 + h * 16));
                    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
                    _mm512_storeu_ps(row + b * 32 + h * 16, _mm512_mul_ps(v, s));
                }
            }
        }
    }
}
#else
#define qg_dequantize qb_dequantize_rows
#endif

#if QG_LANES == 16
/* A 16 x 16 tile transposed in registers (t[r] row r in, column r out): four stages, each
 * swapping the off-diagonal blocks of 1, 2, 4 then 8 lanes between rows B apart. */
#define QG_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define QG_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define QG_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define QG_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define QG_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define QG_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define QG_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define QG_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define QG_STAGE(B, LO, HI)                                                                  \
    for (int r = 0; r < 16; ++r)                                                             \
        if (!(r & B)) {                                                                      \
            const qg_vec a = t[r], b = t[r + B];                                             \
            t[r] = __builtin_shufflevector(a, b, LO);                                        \
            t[r + B] = __builtin_shufflevector(a, b, HI);                                    \
        }
static inline __attribute__((always_inline)) void qg_transpose_tile(qg_vec t[16]) {
    QG_STAGE(1, QG_LO1, QG_HI1)
    QG_STAGE(2, QG_LO2, QG_HI2)
    QG_STAGE(4, QG_LO4, QG_HI4)
    QG_STAGE(8, QG_LO8, QG_HI8)
}
#undef QG_STAGE
#endif

/* Rows [r0, r0 + n) of x (`cols` values a row, `ldx` apart) as groups `[cols, width]`,
 * zero-padded. In blocks of 16 columns, every row writing into the block's 2 KiB of the
 * group before the next block, 16 rows at a time as a tile transposed in registers where the
 * vectors have 16 lanes. Row by row over all columns, a line written per value across the
 * whole group (74-196 KiB, past L1), it had cost 2 ms of a 32-row SmolLM2 step on Zen 4; one
 * stage's transpose at 32 rows and 576 columns: 11.4 us that way, 5.9 in blocks, 2.5 in
 * tiles. */
static inline void qg_transpose(const float *x, int64_t ldx, int64_t cols, int64_t r0,
                                int64_t n, int64_t width, float *xt) {
    for (int64_t g = 0; g * width < n; ++g) {
        float *group = xt + g * width * cols;
        const float *first = x + (r0 + g * width) * ldx;
        const int64_t rows = n - g * width < width ? n - g * width : width;
        if (rows < width) memset(group, 0, sizeof(float) * width * cols);
        for (int64_t i0 = 0; i0 < cols; i0 += 16) {
            const int64_t count = cols - i0 < 16 ? cols - i0 : 16;
            int64_t r = 0;
#if QG_LANES == 16
            for (; count == 16 && r + 16 <= rows; r += 16) {
                qg_vec t[16];
                for (int k = 0; k < 16; ++k) t[k] = qg_load(first + (r + k) * ldx + i0);
                qg_transpose_tile(t);
                for (int k = 0; k < 16; ++k)
                    memcpy(group + (i0 + k) * width + r, &t[k], sizeof(qg_vec));
            }
#endif
            for (; r < rows; ++r) {
                const float *row = first + r * ldx + i0;
                float *column = group + i0 * width + r;
                for (int64_t i = 0; i < count; ++i) column[i * width] = row[i];
            }
        }
    }
}

/* Vectors per activation group for `rows` (the int16 panels' groups): 32-row groups where
 * there are more than 16 rows (16 with 8-lane vectors), else one vector (no half-empty second
 * vector). */
static inline int qg_vectors(int64_t rows) { return rows > QG_LANES ? 2 : 1; }

/* Rows per activation group of the float panels for `rows`: as `qg_vectors`, and 8 (one
 * half-width vector) for at most 8 rows where vectors have 16 lanes. */
static inline int64_t qg_width(int64_t rows) {
#if QG_LANES == 16
    if (rows <= 8) return 8;
#endif
    return (int64_t)qg_vectors(rows) * QG_LANES;
}

/* Floats of `qg_transpose`'s output for `rows` rows of `cols` values. */
static inline int64_t qg_transposed_floats(int64_t rows, int64_t cols) {
    const int64_t width = qg_width(rows);
    return (rows + width - 1) / width * width * cols;
}

/* Floats of one thread's scratch (a panel and its output tile) for `cols` values a row. */
static inline int64_t qg_scratch_floats(int64_t cols) {
    return QG_NR * cols + QG_NR * 2 * QG_LANES;
}

/* A micro-kernel's output tile `tmp` (`[count weight rows, width lanes]`) into `nr` rows of
 * y from `y` (`ldy` apart, `count` columns each): = or += where `accumulate`. */
static inline void qg_store_tile(const float *tmp, int64_t width, int64_t nr, int64_t count,
                                 float *y, int64_t ldy, int accumulate) {
    for (int64_t r = 0; r < nr; ++r) {
        float *dst = y + r * ldy;
        const float *col = tmp + r;
        if (accumulate)
            for (int64_t k = 0; k < count; ++k) dst[k] += col[k * width];
        else
            for (int64_t k = 0; k < count; ++k) dst[k] = col[k * width];
    }
}

/* y[r, o] (= or += where `accumulate`) sum_i W[o, i] x[r, i] for o in [o0, o1), r < rows;
 * `xt` is x as `qg_transpose` wrote it with width = qg_width(rows). W is `m`'s blocks, or
 * where m is NULL the float32 rows `w` `[*, cols]` (read in place). `scratch`: this thread's
 * `qg_scratch_floats(cols)`. */
static inline void qg_stripe(const qb_matrix *m, const float *w, int64_t cols, const float *xt,
                      int64_t rows, float *y, int64_t ldy, int64_t o0, int64_t o1,
                      int accumulate, float *scratch) {
    const int64_t width = qg_width(rows), groups = (rows + width - 1) / width;
    float *panel = scratch, *tmp = scratch + QG_NR * cols;
    const int64_t row_bytes = m == NULL ? cols * 4 : (m->kind == QB_Q4 ? cols / 2 : cols);
    const int64_t scale_row = m == NULL ? 0 : (cols / m->block) * (m->scale_f16 ? 2 : 4);
    const char *base = m == NULL ? (const char *)w : (const char *)m->qs;
    for (int64_t o = o0; o < o1; o += QG_NR) {
        const int64_t e = o + QG_NR < o1 ? o + QG_NR : o1, count = e - o;
        const int64_t next_rows = e + QG_NR < o1 ? QG_NR : o1 - e;
        const float *use = panel;
        if (m != NULL) {
            qg_dequantize(m, o, e, panel);
            for (int64_t b = 0; b < next_rows * scale_row; b += 64) {
                __builtin_prefetch((const char *)m->scales + e * scale_row + b, 0, 3);
                if (m->mins) __builtin_prefetch((const char *)m->mins + e * scale_row + b, 0, 3);
            }
        } else if (count == QG_NR) {
            use = w + o * cols;
        } else {
            memcpy(panel, w + o * cols, sizeof(float) * count * cols);
        }
        if (use == panel && count < QG_NR)
            memset(panel + count * cols, 0, sizeof(float) * (QG_NR - count) * cols);
        const char *next = base + e * row_bytes;
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t ahead = g ? 0 : next_rows * row_bytes;
            if (width == 2 * QG_LANES)
                qg_micro(2, use, cols, xt + g * width * cols, tmp, next, ahead);
            else if (width == QG_LANES)
                qg_micro(1, use, cols, xt + g * width * cols, tmp, next, ahead);
#if QG_LANES == 16
            else
                qg_micro_half(1, use, cols, xt + g * width * cols, tmp, next, ahead);
#endif
            const int64_t rg = g * width, nr = rows - rg < width ? rows - rg : width;
            qg_store_tile(tmp, width, nr, count, y + rg * ldy + o, ldy, accumulate);
        }
    }
}

#endif
