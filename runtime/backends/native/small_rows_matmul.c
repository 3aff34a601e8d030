/* `out = x @ W^T` for a few rows of x, streaming W `[n_out, n_in]` (row-major) exactly once.
 *
 * Decode projections have 1-8 rows: the product is bound by reading the weight, so the
 * kernel's only job is to stream W at the memory's rate. Threads take contiguous stripes of
 * output rows (one sequential stream each); four weight rows are dotted with every input row
 * while they sit in L1. x is float32 `[rows, n_in]`, out float32 `[rows, n_out]`; W is float32
 * or bfloat16 (uint16, widened on the fly: half the bytes to stream).
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 4

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = ((uint32_t)value) << 16;
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

#define DEFINE_MATMUL(NAME, W_T, LOAD)                                                        \
    void NAME(const W_T *w, const float *x, float *out, int64_t rows, int64_t n_out,          \
              int64_t n_in, int n_threads) {                                                  \
        const int64_t blocks = (n_out + BLOCK - 1) / BLOCK;                                   \
        _Pragma("omp parallel for schedule(static) num_threads(n_threads)")                   \
        for (int64_t block = 0; block < blocks; ++block) {                                    \
            const int64_t o0 = block * BLOCK;                                                 \
            const int64_t count = n_out - o0 < BLOCK ? n_out - o0 : BLOCK;                    \
            if (count == BLOCK) {                                                             \
                const W_T *w0 = w + o0 * n_in, *w1 = w0 + n_in, *w2 = w1 + n_in,              \
                          *w3 = w2 + n_in;                                                    \
                for (int64_t r = 0; r < rows; ++r) {                                          \
                    const float *xr = x + r * n_in;                                           \
                    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;                         \
                    _Pragma("omp simd reduction(+ : a0, a1, a2, a3)")                         \
                    for (int64_t i = 0; i < n_in; ++i) {                                      \
                        const float xi = xr[i];                                               \
                        a0 += LOAD(w0[i]) * xi;                                               \
                        a1 += LOAD(w1[i]) * xi;                                               \
                        a2 += LOAD(w2[i]) * xi;                                               \
                        a3 += LOAD(w3[i]) * xi;                                               \
                    }                                                                         \
                    float *orow = out + r * n_out + o0;                                       \
                    orow[0] = a0;                                                             \
                    orow[1] = a1;                                                             \
                    orow[2] = a2;                                                             \
                    orow[3] = a3;                                                             \
                }                                                                             \
            } else {                                                                          \
                for (int64_t k = 0; k < count; ++k) {                                         \
                    const W_T *wk = w + (o0 + k) * n_in;                                      \
                    for (int64_t r = 0; r < rows; ++r) {                                      \
                        const float *xr = x + r * n_in;                                       \
                        float a = 0.0f;                                                       \
                        _Pragma("omp simd reduction(+ : a)")                                  \
                        for (int64_t i = 0; i < n_in; ++i) a += LOAD(wk[i]) * xr[i];          \
                        out[r * n_out + o0 + k] = a;                                          \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

DEFINE_MATMUL(small_rows_matmul_f32, float, LOAD_F32)
DEFINE_MATMUL(small_rows_matmul_bf16, uint16_t, LOAD_BF16)
