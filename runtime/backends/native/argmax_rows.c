/* The greedy choice: out[r] = the first index of row r's largest value (`x` float32 `[rows,
 * n]`, contiguous), with torch.argmax's rule that a NaN counts as the largest (the first NaN
 * wins).
 *
 * Why: torch's CPU argmax over a 49,152-token vocabulary took 27 us a row on Zen 5, about 1%
 * of a SmolLM2 batch-1 decode step and 0.42 ms of a batch-32 one, where reading the 192 KB
 * row takes a few microseconds. Here each lane keeps its largest value and the first index
 * holding it (a strict `>` keeps the first), and the lanes are merged by value, then index.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Row `x` of n values: the first NaN's index, or -1 when there is none. */
static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (x[i] != x[i]) return i;
    return -1;
}

static int64_t argmax_scalar(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i)
        if (x[i] > x[best]) best = i;
    return best;
}

static int64_t argmax_row(const float *x, int64_t n) {
#if defined(__AVX512F__)
    if (n >= 16) {
        __m512 top = _mm512_loadu_ps(x);
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512i index = at;
        __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
        const __m512i step = _mm512_set1_epi32(16);
        int64_t i = 16;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(x + i);
            index = _mm512_add_epi32(index, step);
            const __mmask16 larger = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_mask_mov_ps(top, larger, v);
            at = _mm512_mask_mov_epi32(at, larger, index);
        }
        if (nan) return first_nan(x, n);
        float value[16];
        int32_t where[16];
        _mm512_storeu_ps(value, top);
        _mm512_storeu_si512((void *)where, at);
        int64_t best = where[0];
        float best_value = value[0];
        for (int j = 1; j < 16; ++j)
            if (value[j] > best_value || (value[j] == best_value && where[j] < best)) {
                best_value = value[j];
                best = where[j];
            }
        for (; i < n; ++i) {
            if (x[i] != x[i]) return i;
            if (x[i] > best_value) best_value = x[i], best = i;
        }
        return best;
    }
#endif
    const int64_t nan = first_nan(x, n);
    return nan >= 0 ? nan : argmax_scalar(x, n);
}

/* Rows split over up to n_threads threads (one row: no team). n >= 1. */
void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t *out, int n_threads) {
    if (rows <= 1) {
        if (rows == 1) out[0] = argmax_row(x, n);
        return;
    }
#pragma omp parallel for schedule(static) num_threads(n_threads)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * n, n);
}
