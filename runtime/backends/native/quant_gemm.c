/* Many-row products over quantized weight blocks: out[r, o] = sum_i W[o, i] x[r, i] for the
 * row counts of prefill chunks and large decode batches, where the product is bound by
 * arithmetic rather than by reading the weight.
 *
 * Why not dequantize a tile and call the library's GEMM (`q_tiles`): torch's GEMM on a tile
 * it has not packed runs at well under half of the packed inner product float32 weights get,
 * so at 32 rows block weights lost to the float32 copy they were meant to beat. Here the
 * weight never exists as a float32 matrix either, but the packing is ours:
 * - Each thread takes panels of QG_NR weight rows. A panel is dequantized into a per-thread
 *   buffer `[QG_NR, cols]` (bit-equal to `QuantizedMatrix.dequantize`, `qb_dequantize_rows`),
 *   which stays in L1/L2 while every group of activation rows uses it.
 * - The activations are transposed once per call into groups of 16 or 32 rows, `[cols,
 *   lanes]` with zero padding, so a row group's value at column i is one or two vector loads.
 * - The micro-kernel keeps QG_NR x (lanes / 16) accumulator vectors in registers: per column
 *   it loads the group's values once, broadcasts each panel row's weight and multiplies
 *   (2 loads and 12 broadcasts per 24 FMAs for 32 rows), so it runs at the FMA units' rate.
 * - Rows are taken QG_CHUNK at a time so the transposed activations stay in L2.
 * Float32 activations and accumulators, as `q_rows` and `q_tiles`; only the summation order
 * differs. GCC/clang vector extensions keep it portable (16 lanes with AVX-512, else 8).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "quant_blocks.h"

#if defined(__AVX512F__)
#define QG_LANES 16
#else
#define QG_LANES 8
#endif
/* Weight rows per panel (accumulators: QG_NR x vectors per row group). */
#define QG_NR 12
/* Activation rows transposed and multiplied per pass over the panels. */
#define QG_CHUNK 128

typedef float qg_vec __attribute__((vector_size(QG_LANES * sizeof(float))));

static inline qg_vec qg_load(const float *p) {
    qg_vec v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* tmp[o, l] = sum_i panel[o, i] xt[i, l] for o < QG_NR, l < V * QG_LANES; meanwhile the
 * `ahead` bytes at `next` (the next panel's blocks) are fetched into the cache, a line per
 * column, so its dequantization does not wait for memory. */
static inline __attribute__((always_inline)) void qg_micro(const int V, const float *panel,
                                                           int64_t cols, const float *xt,
                                                           float *tmp, const char *next,
                                                           int64_t ahead) {
    qg_vec acc[QG_NR][2];
#pragma GCC unroll 16
    for (int o = 0; o < QG_NR; ++o)
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) acc[o][v] = (qg_vec){0};
    const int64_t width = (int64_t)V * QG_LANES;
    for (int64_t i = 0; i < cols; ++i) {
        if (i * 64 < ahead) __builtin_prefetch(next + i * 64, 0, 3);
        qg_vec x[2];
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) x[v] = qg_load(xt + i * width + v * QG_LANES);
#pragma GCC unroll 16
        for (int o = 0; o < QG_NR; ++o) {
            const qg_vec w = (qg_vec){0} + panel[o * cols + i];
#pragma GCC unroll 2
            for (int v = 0; v < V; ++v) acc[o][v] += w * x[v];
        }
    }
#pragma GCC unroll 16
    for (int o = 0; o < QG_NR; ++o)
#pragma GCC unroll 2
        for (int v = 0; v < V; ++v) memcpy(tmp + o * width + v * QG_LANES, &acc[o][v], sizeof(qg_vec));
}

#if defined(__AVX512F__)
/* Rows [o0, o1) of m into panel `[o1 - o0, cols]`: `qb_dequantize_rows` with the blocks of 32
 * unpacked in vector registers (that one leaves the unpacking to the compiler, and dequantizing
 * took a third of a 32-row product). Multiply then add, unfused: bit-equal to it. */
static QB_NO_CONTRACT void qg_dequantize(const qb_matrix *m, int64_t o0, int64_t o1,
                                         float *panel) {
    if (m->block != 32) {
        qb_dequantize_rows(m, o0, o1, panel);
        return;
    }
    const int64_t nb = m->cols / 32, cols = m->cols;
    float sbuf[nb], mbuf[nb];
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int64_t o = o0; o < o1; ++o) {
        const float *sc = qb_row_floats(m->scales, m->scale_f16, nb, o, sbuf);
        float *row = panel + (o - o0) * cols;
        if (m->kind == QB_Q4) {
            const float *mn = qb_row_floats(m->mins, m->scale_f16, nb, o, mbuf);
            const uint8_t *q = (const uint8_t *)m->qs + o * (cols / 2);
            for (int64_t b = 0; b < nb; ++b) {
                const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 16)));
                const __m512 s = _mm512_set1_ps(sc[b]), mb = _mm512_set1_ps(mn[b]);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, low));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
                _mm512_storeu_ps(row + b * 32, _mm512_add_ps(_mm512_mul_ps(lo, s), mb));
                _mm512_storeu_ps(row + b * 32 + 16, _mm512_add_ps(_mm512_mul_ps(hi, s), mb));
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

/* Rows [r0, r0 + n) of x `[*, cols]` as groups `[cols, V * QG_LANES]`, zero-padded. */
static void qg_transpose(const float *x, int64_t cols, int64_t r0, int64_t n, int V,
                         float *xt) {
    const int64_t width = (int64_t)V * QG_LANES;
    for (int64_t g = 0; g * width < n; ++g) {
        float *group = xt + g * width * cols;
        const int64_t rows = n - g * width < width ? n - g * width : width;
        if (rows < width) memset(group, 0, sizeof(float) * width * cols);
        for (int64_t r = 0; r < rows; ++r) {
            const float *row = x + (r0 + g * width + r) * cols;
            for (int64_t i = 0; i < cols; ++i) group[i * width + r] = row[i];
        }
    }
}

/* 0 done, 1 out of memory. */
int quant_gemm(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
               int n_threads) {
    const int64_t cols = m->cols;
    /* 32-row groups where there are more than 16 rows, else 16 (no half-empty vectors). */
    const int V = rows > QG_LANES ? 2 : 1;
    const int64_t width = (int64_t)V * QG_LANES;
    const int64_t chunk = rows < QG_CHUNK ? rows : QG_CHUNK;
    const int64_t groups = (chunk + width - 1) / width;
    const int64_t panels = (n_out + QG_NR - 1) / QG_NR;
    if (n_threads > panels) n_threads = (int)(panels > 0 ? panels : 1);
    const int64_t per_thread = QG_NR * cols + QG_NR * width;
    float *xt = (float *)malloc(sizeof(float) * (groups * width * cols + n_threads * per_thread));
    if (xt == NULL) return 1;
    float *scratch = xt + groups * width * cols;
    const int64_t row_bytes = m->kind == QB_Q4 ? cols / 2 : cols;
    const int64_t scale_row = (cols / m->block) * (m->scale_f16 ? 2 : 4);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
        const int64_t used = (n + width - 1) / width;
        qg_transpose(x, cols, r0, n, V, xt);
#pragma omp parallel num_threads(n_threads)
        {
            float *panel = scratch + omp_get_thread_num() * per_thread;
            float *tmp = panel + QG_NR * cols;
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; ++p) {
                const int64_t o0 = p * QG_NR, o1 = o0 + QG_NR < n_out ? o0 + QG_NR : n_out;
                qg_dequantize(m, o0, o1, panel);
                /* The next panel's blocks (and its scales and mins, a few lines). */
                const int64_t n1 = o1 + QG_NR < n_out ? o1 + QG_NR : n_out;
                const char *next = (const char *)m->qs + o1 * row_bytes;
                const int64_t ahead = (n1 - o1) * row_bytes;
                for (int64_t b = 0; b < (n1 - o1) * scale_row; b += 64) {
                    __builtin_prefetch((const char *)m->scales + o1 * scale_row + b, 0, 3);
                    if (m->mins) __builtin_prefetch((const char *)m->mins + o1 * scale_row + b, 0, 3);
                }
                if (o1 - o0 < QG_NR) memset(panel + (o1 - o0) * cols, 0,
                                            sizeof(float) * (QG_NR - (o1 - o0)) * cols);
                for (int64_t g = 0; g < used; ++g) {
                    if (V == 2)
                        qg_micro(2, panel, cols, xt + g * width * cols, tmp, next, g ? 0 : ahead);
                    else
                        qg_micro(1, panel, cols, xt + g * width * cols, tmp, next, g ? 0 : ahead);
                    const int64_t rg = g * width, nr = n - rg < width ? n - rg : width;
                    for (int64_t r = 0; r < nr; ++r) {
                        float *dst = out + (r0 + rg + r) * n_out + o0;
                        for (int64_t o = 0; o < o1 - o0; ++o) dst[o] = tmp[o * width + r];
                    }
                }
            }
        }
    }
    free(xt);
    return 0;
}
