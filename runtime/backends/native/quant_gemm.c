/* Many-row products over quantized weight blocks: out[r, o] = sum_i W[o, i] x[r, i] for the
 * row counts of prefill chunks and large decode batches (the `q_gemm` form).
 *
 * Why not dequantize a tile and call the library's GEMM (`q_tiles`): torch's GEMM on a tile
 * it has not packed runs at well under half of the packed inner product float32 weights get,
 * so at 32 rows block weights lost to the float32 copy they were meant to beat. Here the
 * weight never exists as a float32 matrix either: `gemm_panels.h` dequantizes a panel of rows
 * at a time and multiplies it in registers. Each thread takes a contiguous stripe of whole
 * panels; rows are taken QG_CHUNK at a time so the transposed activations stay in L2.
 * `quant_gemm_i16` is the same over q4 blocks or q8 blocks of 32 with int16 activations
 * (`gemm_panels_i16.h`): the many-row half of the `q_int16` form (`quant_matmul.c`).
 */
#include <omp.h>
#include <stdlib.h>

#include "gemm_panels.h"
#include "gemm_panels_i16.h"
#include "scratch_alloc.h"

/* Activation rows transposed and multiplied per pass over the panels. */
#define QG_CHUNK 128

/* The pass structure both forms share: rows QG_CHUNK at a time, staged once (transposed
 * float32 groups, or with `int16` the int16 groups of `qi_prepare`), then each thread a
 * contiguous stripe of whole panels. 0 done, 1 out of memory. */
static int gemm(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                int n_threads, int int16) {
    const int64_t cols = m->cols, chunk = rows < QG_CHUNK ? rows : QG_CHUNK;
    const int64_t nr = int16 ? QI_NR : QG_NR, panels = (n_out + nr - 1) / nr;
    if (n_threads > panels) n_threads = (int)(panels > 0 ? panels : 1);
    int64_t staged = qg_transposed_floats(chunk, cols), per_thread = qg_scratch_floats(cols);
#if QB_Q4_I16
    if (int16) staged = qi_prepared_floats(chunk, cols), per_thread = qi_scratch_floats(cols);
#endif
    float *xt = (float *)scratch_alloc(sizeof(float) * (staged + n_threads * per_thread));
    if (xt == NULL) return 1;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t n = rows - r0 < chunk ? rows - r0 : chunk;
#if QB_Q4_I16
        if (int16)
            qi_prepare(x + r0 * cols, cols, n, cols, xt);
        else
#endif
            qg_transpose(x, cols, cols, r0, n, qg_width(n), xt);
#pragma omp parallel num_threads(n_threads)
        {
            const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
            const int64_t per = (panels + threads - 1) / threads * nr;
            const int64_t o0 = thread * per < n_out ? thread * per : n_out;
            const int64_t o1 = o0 + per < n_out ? o0 + per : n_out;
            float *scratch = xt + staged + thread * per_thread;
            if (o0 < o1) {
#if QB_Q4_I16
                if (int16)
                    qi_stripe(m, xt, n, out + r0 * n_out, n_out, o0, o1, 0, scratch);
                else
#endif
                    qg_stripe(m, NULL, cols, xt, n, out + r0 * n_out, n_out, o0, o1, 0, scratch);
            }
        }
    }
    free(xt);
    return 0;
}

int quant_gemm(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
               int n_threads) {
    return gemm(m, x, out, rows, n_out, n_threads, 0);
}

#if QB_Q4_I16
/* `quant_gemm` over q4 blocks or q8 blocks of 32 with the activations rounded to int16 per
 * block. */
int quant_gemm_i16(const qb_matrix *m, const float *x, float *out, int64_t rows, int64_t n_out,
                   int n_threads) {
    return gemm(m, x, out, rows, n_out, n_threads, 1);
}
#endif
