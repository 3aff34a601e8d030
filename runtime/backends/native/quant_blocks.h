/* Few-row products over quantized weight blocks (`runtime/quant/matrix.py::QuantizedMatrix`).
 *
 * Why a header of static inline routines: the standalone product (`quant_matmul.c`) and the
 * fused decode stack (`fused_decode_layers.c`) stream the same blocks the same way, and each
 * inlines them into its own threads' stripes.
 *
 * Forms (one weight row of `cols` values, blocks of `block` values):
 *   q4: `qs` uint8 `[rows, cols / 2]`; per 32-value block (16 bytes) byte j holds value j in
 *       its low nibble and value j + 16 in its high nibble; value = q * scale + min, or, with
 *       no mins stored (Q4_0's symmetric blocks), min = -8 * scale (`qb_row_mins`).
 *   q8: `qs` int8 `[rows, cols]`, natural order; value = q * scale (no mins).
 *   scales / mins: `[rows, cols / block]`, float16 or float32.
 *
 * y[r, o] = sum_i W[o, i] x[r, i] is computed per block as scale * dot(q, x_block) +
 * min * sum(x_block): the activation block sums (and, for q4, a form of x that saves the
 * nibble unpacking, `qb_prepare_q4`) are computed once per call, so the inner loop only
 * widens the integers, multiplies them with the activations and scales the block's partial
 * sum. Each weight block is loaded once and used for up to 4 activation rows; 4 weight rows
 * are in flight at once (independent accumulator chains). Accumulators are float32; so are
 * the activations, except in the int16 form (`qb_project(..., int16)`, where the CPU has
 * AVX-512 VNNI: q4 activations rounded to int16 per block, `quant_blocks_i16.h`, 1.4x faster
 * from cache, within a stated bound). Float16 scales are widened once per tile of rows
 * (`qb_tile_floats`).
 */
#ifndef LLM_RUNTIME_QUANT_BLOCKS_H
#define LLM_RUNTIME_QUANT_BLOCKS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { QB_Q4 = 0, QB_Q8 = 1 };

/* This CPU can run q4 products with int16 activations (`quant_blocks_i16.h`). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QB_Q4_I16 1
#else
#define QB_Q4_I16 0
#endif

/* One quantized matrix (or a row range of one): the kernels' view of a `QuantizedMatrix`. */
typedef struct {
    int32_t kind;      /* QB_Q4 or QB_Q8 */
    int32_t scale_f16; /* 1: scales/mins are float16 (uint16 bits), 0: float32 */
    int64_t block;     /* values per block: 32 for q4; 32 or 16 (any even count) for q8 */
    int64_t cols;      /* values per row (a multiple of block) */
    const void *qs;    /* q4: uint8 [rows, cols / 2]; q8: int8 [rows, cols] */
    const void *scales; /* [rows, cols / block] */
    const void *mins;   /* [rows, cols / block] for q4 (NULL: -8 * scale), NULL for q8 */
} qb_matrix;

/* Activation rows handled by one pass over a weight tile, and weight rows in flight. */
#define QB_ROWS 4
#define QB_OUTS 4
/* Output rows per tile: their blocks stay in L1/L2 while every group of 4 rows uses them. */
#define QB_TILE 16
/* Bytes ahead of the block being read that each weight row's stream is prefetched: the
 * memory's latency times the rate a pass consumes weight bytes, which falls as the pass
 * multiplies more activation rows R. Measured on Zen 5 (SmolLM2 Q4_1, 2 threads): at 1 row
 * the stack's projections took 2.5-2.7 ms a step 2 KB ahead and 2.0-2.3 ms 8 KB ahead; at 8
 * rows 8 KB ahead was 5% slower than 2 KB (lines fetched too early leave L1 before use). */
#define QB_PREFETCH(R) ((R) == 1 ? 8192 : (R) == 2 ? 4096 : 2048)

/* Prefetches byte `at` + QB_PREFETCH(R) of each of NO weight rows (`stride` bytes apart):
 * every tile kernel's read-ahead of its weight streams. */
static inline __attribute__((always_inline)) void qb_prefetch_rows(const void *qs,
                                                                   int64_t stride, int64_t at,
                                                                   int NO, int R) {
    for (int k = 0; k < NO; ++k)
        __builtin_prefetch((const char *)qs + k * stride + at + QB_PREFETCH(R), 0, 3);
}

static inline float qb_half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu, bits;
    if (exponent == 0x1Fu) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113u;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            --exponent;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FFu) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
#endif
}

static inline void qb_halves_to_floats(const uint16_t *in, float *out, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(in + i))));
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    if (i < n) { /* the short tail in one masked step */
        const __mmask16 mask = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(out + i, mask,
                              _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, in + i)));
        return;
    }
#endif
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(in + i))));
#endif
    for (; i < n; ++i) out[i] = qb_half_to_float(in[i]);
}

/* Row o's scales (or mins) as float32: in place when stored so, else widened into `buffer`. */
static inline const float *qb_row_floats(const void *base, int scale_f16, int64_t nb, int64_t o,
                                         float *buffer) {
    if (!scale_f16) return (const float *)base + o * nb;
    qb_halves_to_floats((const uint16_t *)base + o * nb, buffer, nb);
    return buffer;
}

/* -8 * scales[i] into mins (the mins of symmetric q4 blocks: exact in float32). */
static inline void qb_symmetric_mins(const float *scales, float *mins, int64_t n) {
    for (int64_t i = 0; i < n; ++i) mins[i] = -8.0f * scales[i];
}

/* Row o's q4 mins as float32 (`qb_row_floats`), or -8 times its scales `sc` (already
 * float32) where the blocks are symmetric (no mins stored). */
static inline const float *qb_row_mins(const qb_matrix *m, int64_t nb, int64_t o, const float *sc,
                                       float *buffer) {
    if (m->mins != NULL) return qb_row_floats(m->mins, m->scale_f16, nb, o, buffer);
    qb_symmetric_mins(sc, buffer, nb);
    return buffer;
}

/* Floats of one tile's widened scales (and as many for its mins): tiles of wider rows
 * shrink to QB_OUTS rows so the buffers stay a small part of a thread's stack. */
#define QB_TILE_FLOATS 16384
static inline int64_t qb_tile_rows(int64_t nb) {
    return nb * QB_TILE <= QB_TILE_FLOATS ? QB_TILE : QB_OUTS;
}

/* Rows [t0, t1)'s scales (*scales) and mins (*mins, NULL for q8) as float32, row-major
 * `[t1 - t0, nb]`: in place when stored so, else widened into sbuf / mbuf in one contiguous
 * pass ahead of the loops that read them. Widening each group's rows just before use, as
 * this did before, stalled those reads on store-to-load forwarding: measured on Zen 5, a
 * 576-wide q4 product ran 1.5x slower with float16 scales than with float32 ones. */
static inline void qb_tile_floats(const qb_matrix *m, int64_t nb, int64_t t0, int64_t t1,
                                  float *sbuf, float *mbuf, const float **scales,
                                  const float **mins) {
    const int64_t n = (t1 - t0) * nb;
    if (!m->scale_f16) {
        *scales = (const float *)m->scales + t0 * nb;
    } else {
        qb_halves_to_floats((const uint16_t *)m->scales + t0 * nb, sbuf, n);
        *scales = sbuf;
    }
    *mins = NULL;
    if (m->kind != QB_Q4) return;
    if (m->mins == NULL) { /* symmetric blocks */
        qb_symmetric_mins(*scales, mbuf, n);
        *mins = mbuf;
    } else if (!m->scale_f16) {
        *mins = (const float *)m->mins + t0 * nb;
    } else {
        qb_halves_to_floats((const uint16_t *)m->mins + t0 * nb, mbuf, n);
        *mins = mbuf;
    }
}

/* For q4 with float32 activations: xt (`[rows, cols]`, row-major) the tile's form of x
 * (see `qb_q4_tile`) and sums[r, b] the sum of x[r]'s block b (32 values), for the min
 * term. */
static inline void qb_prepare_q4(const float *x, int64_t ldx, int64_t rows, int64_t cols,
                                 float *xt, float *sums) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * 32;
            float *tb = xt + r * cols + b * 32;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int j = 0; j < 16; ++j) {
                const float high = xb[j + 16] * 0.0625f;
                tb[j] = high;
                tb[j + 16] = xb[j] - high;
                s += xb[j] + xb[j + 16];
            }
            sums[r * nb + b] = s;
        }
}

/* --------------------------------------------------------------------------------------- */
/* Tiles: dots[k][r] = sum_b scale[k][b] * dot(q[k, b], x[r, b]) for NO weight rows, R rows. */

#if defined(__AVX512F__)

/* dots[k][r] = the lane sum of acc[k][r]: four vectors at a time share one transpose-add tree
 * (13 shuffles and adds for four sums instead of 32). */
static inline __attribute__((always_inline)) float qb_sum1(__m512 v) {
    return _mm512_reduce_add_ps(v);
}

static inline __attribute__((always_inline)) __m128 qb_sum4(__m512 a, __m512 b, __m512 c,
                                                             __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: [a0+a1, b0+b1, a2+a3, b2+b3] and the same for c, d */
    const __m512 abcd = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                          _mm512_castps_pd(abcd), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

static inline __attribute__((always_inline)) void qb_reduce(const int R, const int NO,
                                                            __m512 acc[QB_OUTS][QB_ROWS],
                                                            float dots[QB_OUTS][QB_ROWS]) {
    if (NO == 4) {
        for (int r = 0; r < R; ++r) {
            float four[4];
            _mm_storeu_ps(four, qb_sum4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]));
            for (int k = 0; k < 4; ++k) dots[k][r] = four[k];
        }
    } else if (NO == 2 && R >= 2) {
        int r = 0;
        for (; r + 2 <= R; r += 2) {
            float four[4];
            _mm_storeu_ps(four, qb_sum4(acc[0][r], acc[1][r], acc[0][r + 1], acc[1][r + 1]));
            dots[0][r] = four[0], dots[1][r] = four[1];
            dots[0][r + 1] = four[2], dots[1][r + 1] = four[3];
        }
        for (; r < R; ++r)
            for (int k = 0; k < NO; ++k) dots[k][r] = qb_sum1(acc[k][r]);
    } else {
        for (int k = 0; k < NO; ++k)
            for (int r = 0; r < R; ++r) dots[k][r] = qb_sum1(acc[k][r]);
    }
}

/* acc[k][r] = the q4 min term sum_b min[k][b] * xsum[r][b], spread over the lanes (the
 * accumulators' starting value). */
static inline __attribute__((always_inline)) void qb_min_term(const int R, const int NO,
                                                              const float *const *mn,
                                                              const float *xsum, int64_t nb,
                                                              __m512 acc[QB_OUTS][QB_ROWS]) {
    for (int k = 0; k < NO; ++k)
        for (int r = 0; r < R; ++r) acc[k][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 mask = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        for (int k = 0; k < NO; ++k) {
            const __m512 m = _mm512_maskz_loadu_ps(mask, mn[k] + b);
            for (int r = 0; r < R; ++r)
                acc[k][r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, xsum + r * nb + b),
                                            acc[k][r]);
        }
    }
}

/* x prepared for q4 (`qb_prepare_q4`): per block, 16 values xh / 16 (dotted with each whole
 * byte b = 16 hi + lo) then 16 values xl - xh / 16 (dotted with the low nibble), since
 * lo xl + hi xh = b (xh / 16) + lo (xl - xh / 16): one conversion of the byte and one table
 * lookup of its low nibble replace two masks, a shift and two conversions. */
static inline __attribute__((always_inline)) void qb_q4_tile(
    const int R, const int NO, const uint8_t *qs, int64_t qs_stride, const float *const *sc,
    const float *const *mn, const float *xsum, int64_t nb, const float *xt, int64_t ldx,
    float dots[QB_OUTS][QB_ROWS]) {
    __m512 acc[QB_OUTS][QB_ROWS];
    qb_min_term(R, NO, mn, xsum, nb, acc);
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t b = 0; b < nb; ++b) {
        if ((b & 3) == 0) qb_prefetch_rows(qs, qs_stride, b * 16, NO, R);
        __m512 xw[QB_ROWS], xl[QB_ROWS];
        for (int r = 0; r < R; ++r) {
            xw[r] = _mm512_loadu_ps(xt + r * ldx + b * 32);
            xl[r] = _mm512_loadu_ps(xt + r * ldx + b * 32 + 16);
        }
        for (int k = 0; k < NO; ++k) {
            const __m512i v = _mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(qs + k * qs_stride + b * 16)));
            const __m512 whole = _mm512_cvtepi32_ps(v);
            const __m512 lo = _mm512_permutexvar_ps(v, table);
            const __m512 s = _mm512_set1_ps(sc[k][b]);
            if (R <= 2) {
                for (int r = 0; r < R; ++r) {
                    const __m512 t = _mm512_fmadd_ps(lo, xl[r], _mm512_mul_ps(whole, xw[r]));
                    acc[k][r] = _mm512_fmadd_ps(t, s, acc[k][r]);
                }
            } else { /* scale the block once, then two FMAs per row */
                const __m512 ws = _mm512_mul_ps(whole, s), ls = _mm512_mul_ps(lo, s);
                for (int r = 0; r < R; ++r)
                    acc[k][r] = _mm512_fmadd_ps(ls, xl[r], _mm512_fmadd_ps(ws, xw[r], acc[k][r]));
            }
        }
    }
    qb_reduce(R, NO, acc, dots);
}

/* q8 with a block of 16 or 32 (a multiple of 16: chunks of 16 share the block's scale). */
static inline __attribute__((always_inline)) void qb_q8_tile(
    const int R, const int NO, const int8_t *qs, int64_t qs_stride, const float *const *sc,
    int64_t nb, int64_t block, const float *x, int64_t ldx, float dots[QB_OUTS][QB_ROWS]) {
    __m512 acc[QB_OUTS][QB_ROWS];
    for (int k = 0; k < NO; ++k)
        for (int r = 0; r < R; ++r) acc[k][r] = _mm512_setzero_ps();
    const int64_t chunks = block / 16;
    for (int64_t b = 0; b < nb; ++b) {
        if ((b & 1) == 0) qb_prefetch_rows(qs, qs_stride, b * block, NO, R);
        __m512 part[QB_OUTS][QB_ROWS];
        for (int k = 0; k < NO; ++k)
            for (int r = 0; r < R; ++r) part[k][r] = _mm512_setzero_ps();
        for (int64_t c = 0; c < chunks; ++c) {
            const int64_t at = b * block + c * 16;
            __m512 xv[QB_ROWS];
            for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + at);
            for (int k = 0; k < NO; ++k) {
                const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                    _mm_loadu_si128((const __m128i *)(qs + k * qs_stride + at))));
                for (int r = 0; r < R; ++r)
                    part[k][r] = _mm512_fmadd_ps(q, xv[r], part[k][r]);
            }
        }
        for (int k = 0; k < NO; ++k) {
            const __m512 s = _mm512_set1_ps(sc[k][b]);
            for (int r = 0; r < R; ++r) acc[k][r] = _mm512_fmadd_ps(part[k][r], s, acc[k][r]);
        }
    }
    qb_reduce(R, NO, acc, dots);
}

#define QB_Q8_VECTOR_BLOCK(block) ((block) % 16 == 0)

#include "quant_blocks_i16.h"

#else /* portable: plain loops the compiler vectorises as it can */

static inline __attribute__((always_inline)) void qb_q4_tile(
    const int R, const int NO, const uint8_t *qs, int64_t qs_stride, const float *const *sc,
    const float *const *mn, const float *xsum, int64_t nb, const float *xt, int64_t ldx,
    float dots[QB_OUTS][QB_ROWS]) {
    for (int k = 0; k < NO; ++k)
        for (int r = 0; r < R; ++r) {
            const uint8_t *q = qs + k * qs_stride;
            const float *xr = xt + r * ldx;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; ++b) total += mn[k][b] * xsum[r * nb + b];
            for (int64_t b = 0; b < nb; ++b) {
                float part = 0.0f;
                for (int j = 0; j < 16; ++j)
                    part += (float)q[b * 16 + j] * xr[b * 32 + j] +
                            (float)(q[b * 16 + j] & 0x0F) * xr[b * 32 + 16 + j];
                total += part * sc[k][b];
            }
            dots[k][r] = total;
        }
}

#define QB_Q8_VECTOR_BLOCK(block) 1

static inline __attribute__((always_inline)) void qb_q8_tile(
    const int R, const int NO, const int8_t *qs, int64_t qs_stride, const float *const *sc,
    int64_t nb, int64_t block, const float *x, int64_t ldx, float dots[QB_OUTS][QB_ROWS]) {
    for (int k = 0; k < NO; ++k)
        for (int r = 0; r < R; ++r) {
            const int8_t *q = qs + k * qs_stride;
            const float *xr = x + r * ldx;
            float total = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                float part = 0.0f;
                for (int64_t j = 0; j < block; ++j) part += (float)q[b * block + j] * xr[b * block + j];
                total += part * sc[k][b];
            }
            dots[k][r] = total;
        }
}

#endif

/* The form in which `qb_project` reads a product's activations: as given, or prepared
 * (`qb_prepare_input`) for q4 blocks (float32 or int16) or, at one row, for q8 blocks of 32
 * with int16 activations. The one place that decides it, for every caller. */
enum { QB_INPUT_RAW, QB_INPUT_Q4_FLOAT, QB_INPUT_Q4_INT16, QB_INPUT_Q8_INT16_ROW };

static inline int qb_input_form(const qb_matrix *m, int64_t rows, int int16) {
    if (!QB_Q4_I16) int16 = 0;
    if (m->kind == QB_Q4) return int16 ? QB_INPUT_Q4_INT16 : QB_INPUT_Q4_FLOAT;
    return int16 && rows == 1 && m->block == 32 ? QB_INPUT_Q8_INT16_ROW : QB_INPUT_RAW;
}

/* Floats a row of any prepared form takes, and a prepared input of `rows` rows: the rows,
 * then their block sums (at `rows * qb_prepared_row_floats(cols)`). */
static inline int64_t qb_prepared_row_floats(int64_t cols) {
#if QB_Q4_I16
    int64_t words = qb_q4_i16_row_floats(cols);
    if (qb_q8_i16_row_floats(cols) > words) words = qb_q8_i16_row_floats(cols);
    return words > cols ? words : cols;
#else
    return cols;
#endif
}

static inline int64_t qb_prepared_floats(int64_t rows, int64_t cols) {
    return rows * (qb_prepared_row_floats(cols) + cols / 32) + 1;
}

/* x (`[rows, ldx]`) in `form` (not QB_INPUT_RAW) into xt, q4 block sums into xsum; returns
 * the row stride `qb_project` then reads it with. */
static inline int64_t qb_prepare_input(int form, const float *x, int64_t ldx, int64_t rows,
                                       int64_t cols, float *xt, float *xsum) {
#if QB_Q4_I16
    if (form == QB_INPUT_Q4_INT16) {
        qb_prepare_q4_i16(x, ldx, rows, cols, xt, xsum);
        return qb_q4_i16_row_floats(cols);
    }
    if (form == QB_INPUT_Q8_INT16_ROW) {
        qb_prepare_q8_i16_row(x, cols, xt);
        return qb_q8_i16_row_floats(cols);
    }
#endif
    (void)form;
    qb_prepare_q4(x, ldx, rows, cols, xt, xsum);
    return cols;
}

/* Any q8 block the vector tile cannot take (not a multiple of 16): one scalar dot. */
static inline float qb_q8_dot_scalar(const int8_t *q, const float *sc, int64_t nb, int64_t block,
                                     const float *xr) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        float part = 0.0f;
        for (int64_t j = 0; j < block; ++j) part += (float)q[b * block + j] * xr[b * block + j];
        total += part * sc[b];
    }
    return total;
}

/* Dispatch on (R, NO) so each combination is a fully unrolled, register-resident tile:
 * 4 weight rows in flight for 1-2 activation rows, 2 for 3-4 (all accumulators and
 * activations stay in the 32 vector registers). */
#define QB_OUTS_FOR(R) ((R) <= 2 ? 4 : 2)
#define QB_CASES(CALL)                                                                         \
    switch (R * 8 + NO) {                                                                      \
        case 9: CALL(1, 1); break;                                                             \
        case 12: CALL(1, 4); break;                                                            \
        case 17: CALL(2, 1); break;                                                            \
        case 20: CALL(2, 4); break;                                                            \
        case 25: CALL(3, 1); break;                                                            \
        case 26: CALL(3, 2); break;                                                            \
        case 33: CALL(4, 1); break;                                                            \
        default: CALL(4, 2); break;                                                            \
    }

/* y[r * ldy + o] (= or +=, by `accumulate`) sum_i W[o, i] x[r, i] for o in [o0, o1) (o
 * counts m's rows from 0). x is the activations (`[rows, ldx]`) in the form
 * `qb_input_form(m, rows, int16)` names: as given (QB_INPUT_RAW), else as `qb_prepare_input`
 * wrote them, ldx the stride it returned, with the q4 block sums in xsum (`[rows, cols / 32]`,
 * unused for q8). */
static inline void qb_project(const qb_matrix *m, const float *x, int64_t ldx, int64_t rows,
                              const float *xsum, float *y, int64_t ldy, int64_t o0, int64_t o1,
                              int accumulate, int int16) {
    (void)int16; /* only read where QB_Q4_I16 */
    const int64_t nb = m->cols / m->block;
    const int64_t qs_stride = m->kind == QB_Q4 ? m->cols / 2 : m->cols;
    const int64_t tile = qb_tile_rows(nb);
    float sbuf[tile * nb], mbuf[tile * nb];
    for (int64_t t0 = o0; t0 < o1; t0 += tile) {
        const int64_t t1 = t0 + tile < o1 ? t0 + tile : o1;
        const float *ts, *tm;
        qb_tile_floats(m, nb, t0, t1, sbuf, mbuf, &ts, &tm);
        for (int64_t r0 = 0; r0 < rows; r0 += QB_ROWS) {
            const int R = rows - r0 < QB_ROWS ? (int)(rows - r0) : QB_ROWS;
            const float *xr = x + r0 * ldx;
            for (int64_t o = t0; o < t1;) {
                const int NO = t1 - o >= QB_OUTS_FOR(R) ? QB_OUTS_FOR(R) : 1;
                const float *sc[QB_OUTS], *mn[QB_OUTS];
                for (int k = 0; k < NO; ++k) {
                    sc[k] = ts + (o + k - t0) * nb;
                    mn[k] = tm != NULL ? tm + (o + k - t0) * nb : NULL;
                }
                float dots[QB_OUTS][QB_ROWS];
                if (m->kind == QB_Q4) {
                    const uint8_t *q = (const uint8_t *)m->qs + o * qs_stride;
#define QB_Q4_CALL(RR, NN) \
    qb_q4_tile(RR, NN, q, qs_stride, sc, mn, xsum + r0 * nb, nb, xr, ldx, dots)
#if QB_Q4_I16
#define QB_Q4_I16_CALL(RR, NN) \
    qb_q4_i16_tile(RR, NN, q, qs_stride, sc, mn, xsum + r0 * nb, nb, xr, ldx, dots)
                    if (int16 && rows == 1) { /* the one-row layout */
                        if (NO == 4)
                            qb_q4_i16_row_tile(4, q, qs_stride, sc, mn, xsum, nb, xr, dots);
                        else
                            qb_q4_i16_row_tile(1, q, qs_stride, sc, mn, xsum, nb, xr, dots);
                    } else if (int16) {
                        QB_CASES(QB_Q4_I16_CALL)
                    } else {
                        QB_CASES(QB_Q4_CALL)
                    }
#undef QB_Q4_I16_CALL
#else
                    QB_CASES(QB_Q4_CALL)
#endif
#undef QB_Q4_CALL
                }
#if QB_Q4_I16
                else if (qb_input_form(m, rows, int16) == QB_INPUT_Q8_INT16_ROW) {
                    const int8_t *q = (const int8_t *)m->qs + o * qs_stride;
                    if (NO == 4)
                        qb_q8_i16_row_tile(4, q, qs_stride, sc, nb, xr, dots);
                    else
                        qb_q8_i16_row_tile(1, q, qs_stride, sc, nb, xr, dots);
                }
#endif
                else if (QB_Q8_VECTOR_BLOCK(m->block)) {
                    const int8_t *q = (const int8_t *)m->qs + o * qs_stride;
                    const int64_t block = m->block;
#define QB_Q8_CALL(RR, NN) qb_q8_tile(RR, NN, q, qs_stride, sc, nb, block, xr, ldx, dots)
                    QB_CASES(QB_Q8_CALL)
#undef QB_Q8_CALL
                } else {
                    for (int k = 0; k < NO; ++k)
                        for (int r = 0; r < R; ++r)
                            dots[k][r] = qb_q8_dot_scalar((const int8_t *)m->qs +
                                                              (o + k) * qs_stride,
                                                          sc[k], nb, m->block, xr + r * ldx);
                }
                for (int r = 0; r < R; ++r) {
                    float *yr = y + (r0 + r) * ldy + o;
                    for (int k = 0; k < NO; ++k)
                        yr[k] = accumulate ? yr[k] + dots[k][r] : dots[k][r];
                }
                o += NO;
            }
        }
    }
}

/* Rows [r0, r1) of m as float32 into out ([r1 - r0, cols], row-major): value = q * scale
 * (+ min), a multiply and a separate add (no FMA contraction), as the reference
 * (`QuantizedMatrix.dequantize`, torch) computes it: bit-equal. */
#if defined(__clang__)
#define QB_NO_CONTRACT
#elif defined(__GNUC__)
#define QB_NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define QB_NO_CONTRACT
#endif
static QB_NO_CONTRACT void qb_dequantize_rows(const qb_matrix *m, int64_t r0, int64_t r1,
                                              float *out) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    const int64_t nb = m->cols / m->block, cols = m->cols;
    const int64_t qs_stride = m->kind == QB_Q4 ? cols / 2 : cols;
    float sbuf[nb], mbuf[nb];
    for (int64_t o = r0; o < r1; ++o) {
        const float *sc = qb_row_floats(m->scales, m->scale_f16, nb, o, sbuf);
        float *row = out + (o - r0) * cols;
        if (m->kind == QB_Q4) {
            const float *mn = qb_row_mins(m, nb, o, sc, mbuf);
            const uint8_t *q = (const uint8_t *)m->qs + o * qs_stride;
            for (int64_t b = 0; b < nb; ++b) {
                const float s = sc[b], mb = mn[b];
                float *rb = row + b * 32;
                const uint8_t *qb = q + b * 16;
#pragma omp simd
                for (int j = 0; j < 16; ++j) {
                    rb[j] = (float)(qb[j] & 0x0F) * s + mb;
                    rb[j + 16] = (float)(qb[j] >> 4) * s + mb;
                }
            }
        } else {
            const int8_t *q = (const int8_t *)m->qs + o * qs_stride;
            const int64_t block = m->block;
            for (int64_t b = 0; b < nb; ++b) {
                const float s = sc[b];
#pragma omp simd
                for (int64_t j = 0; j < block; ++j) row[b * block + j] = (float)q[b * block + j] * s;
            }
        }
    }
}

#endif
