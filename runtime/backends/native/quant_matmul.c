/* Products and tile dequantization over quantized weight blocks (`quant_blocks.h`).
 *
 * `quant_matmul`: out[r, o] = sum_i W[o, i] x[r, i] for any number of float32 rows x
 * `[rows, cols]` (out float32 `[rows, n_out]`), W a `qb_matrix`. Decode is bound by reading
 * the weight, so each thread streams one contiguous stripe of output rows (a multiple of 16)
 * once, using every block for up to 4 rows at a time (a tile of 16 weight rows is reused from
 * cache for each further group of 4 rows).
 * `quant_dequantize_rows`: rows [r0, r1) of W as float32 into `out` `[r1 - r0, cols]`, for
 * prefill, which multiplies a dequantized tile at a time with torch.mm; `quant_take_rows`
 * the same for scattered rows (token embeddings).
 * `quant_matmul_i8`: `quant_matmul` with the activations quantized to int8 per block
 * (`quant_blocks_i8.h`); returns 3 where this CPU has no AVX-512 VNNI (`quant_i8_available`).
 * `quant_matmul_i16`: `quant_matmul` over q4 blocks (or q8 blocks of 32) with the activations
 * rounded to int16 per block, q4 streamed (`quant_blocks_i16.h`) below QI_PANEL_FROM_ROWS rows
 * and on int16 panels (`quant_gemm_i16`) from there on, q8 streamed at one row and on panels
 * from two; returns 3 where this CPU cannot (`quant_q4_int16`).
 */
#include <omp.h>
#include <stdlib.h>

#include "gemm_panels_i16.h"
#include "quant_blocks.h"
#include "quant_blocks_i8.h"
#include "scratch_alloc.h"

/* This thread's share [*o0, *o1) of n rows, in multiples of 16. */
static void qm_stripe(int64_t n, int thread, int threads, int64_t *o0, int64_t *o1) {
    int64_t step = (n + threads - 1) / threads;
    step = (step + 15) / 16 * 16;
    *o0 = thread * step < n ? thread * step : n;
    *o1 = *o0 + step < n ? *o0 + step : n;
}

/* The product with float32 (int16 = 0) or int16 (int16 = 1, QB_Q4_I16 only) activations:
 * q4 at any row count, q8 blocks of 32 at one row. */
static int matmul(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                  int n_threads, int int16) {
    float *xt = NULL, *xsum = NULL;
    const float *xin = x;
    int64_t ldx = m->cols;
    const int form = qb_input_form(m, rows, int16);
    if (form != QB_INPUT_RAW) {
        xt = (float *)scratch_alloc(sizeof(float) * qb_prepared_floats(rows, m->cols));
        if (xt == NULL) return 1;
        xsum = xt + rows * qb_prepared_row_floats(m->cols);
        ldx = qb_prepare_input(form, x, m->cols, rows, m->cols, xt, xsum);
        xin = xt;
    }
    int64_t per_thread = (n_out + 15) / 16;
    if (n_threads > per_thread) n_threads = (int)(per_thread > 0 ? per_thread : 1);
#pragma omp parallel num_threads(n_threads)
    {
        int64_t o0, o1;
        qm_stripe(n_out, omp_get_thread_num(), omp_get_num_threads(), &o0, &o1);
        if (o0 < o1) qb_project(m, xin, ldx, rows, xsum, out, n_out, o0, o1, 0, int16);
    }
    free(xt);
    return 0;
}

int quant_matmul(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                 int n_threads) {
    return matmul(m, x, out, rows, n_out, n_threads, 0);
}

int quant_q4_int16(void) { return QB_Q4_I16; }

/* Rows from which int16 products run on panels (`gemm_panels_i16.h`). */
int quant_i16_panel_from_rows(void) { return QI_PANEL_FROM_ROWS; }

int quant_gemm_i16(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                   int n_threads);

/* 0 done, 1 out of memory, 2 neither q4 nor q8 blocks of 32, 3 this CPU has no AVX-512 VNNI. */
int quant_matmul_i16(const qb_matrix *m, const float *x, float *out, int64_t rows,
                     int64_t n_out, int n_threads) {
    if (!QB_Q4_I16) return 3;
    if (m->kind != QB_Q4 && m->block != 32) return 2;
#if QB_Q4_I16
    /* q8 blocks stream one row (`qb_q8_i16_row_tile`), else run on panels */
    if (rows >= QI_PANEL_FROM_ROWS || (m->kind != QB_Q4 && rows != 1))
        return quant_gemm_i16(m, x, out, rows, n_out, n_threads);
#endif
    return matmul(m, x, out, rows, n_out, n_threads, 1);
}

void quant_dequantize_rows(const qb_matrix *m, int64_t r0, int64_t r1, float *out,
                           int n_threads) {
    const int64_t chunks = (r1 - r0 + 15) / 16;
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t a = r0 + c * 16, b = a + 16 < r1 ? a + 16 : r1;
        qb_dequantize_rows(m, a, b, out + (a - r0) * m->cols);
    }
}

/* Rows index[0..n) of m as float32 into out (`[n, cols]`), as `quant_dequantize_rows` writes
 * them: a tied head's token embeddings, a few scattered rows, so no thread team. */
void quant_take_rows(const qb_matrix *m, const int64_t *index, int64_t n, float *out) {
    for (int64_t i = 0; i < n; ++i)
        qb_dequantize_rows(m, index[i], index[i] + 1, out + i * m->cols);
}

int quant_i8_available(void) { return QB_I8_AVAILABLE; }

/* 0 done, 1 out of memory, 2 a block the int8 form does not take, 3 no VNNI on this CPU. */
int quant_matmul_i8(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                    int n_threads) {
#if QB_I8_AVAILABLE
    if (!QB_I8_BLOCK_OK(m->kind, m->block)) return 2;
    void *memory = scratch_alloc((size_t)qb_i8_bytes(rows, m->cols));
    if (memory == NULL) return 1;
    qb_i8_input in;
    qb_i8_bind(&in, memory, rows, m->cols);
    qb_prepare_i8(x, m->cols, rows, m->cols, m->kind, m->block, &in);
    int64_t per_thread = (n_out + 15) / 16;
    if (n_threads > per_thread) n_threads = (int)(per_thread > 0 ? per_thread : 1);
#pragma omp parallel num_threads(n_threads)
    {
        int64_t o0, o1;
        qm_stripe(n_out, omp_get_thread_num(), omp_get_num_threads(), &o0, &o1);
        if (o0 < o1) qb_project_i8(m, &in, rows, out, n_out, o0, o1, 0);
    }
    free(memory);
    return 0;
#else
    (void)m, (void)x, (void)out, (void)rows, (void)n_out, (void)n_threads;
    return 3;
#endif
}
