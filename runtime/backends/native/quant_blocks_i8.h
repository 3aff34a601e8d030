/* Few-row products over quantized weight blocks with int8 activations (AVX-512 VNNI).
 *
 * Why a second form next to `quant_blocks.h`: with float32 activations each 32 weights cost
 * about 7 vector instructions (widen, convert, nibble lookup, two FMAs, scale), so the q4
 * product is bound by arithmetic at about half the read bandwidth. Quantizing each activation
 * block to int8 once per call lets `vpdpbusd` multiply 64 weight bytes by 64 activation bytes
 * and add them in groups of 4 in one instruction: about 5 instructions per 128 q4 weights and
 * row. The price is the activations' rounding, so this is a separate form that warmup keeps
 * only where it measures faster, held to its own tolerance (`runtime.quant.int8_activations`
 * states the bound: half an activation step per weight magnitude).
 *
 * Activation form (`qb_prepare_i8`, per call): each block of `block` activation values x_b
 * (32 for q4; the weight's block for q8) gets a step d_b = max|x_b| / 127 and integers
 * round(x / d_b) in [-127, 127]. They are laid out for 64-byte loads:
 *   q4: per group of 4 blocks, 128 bytes: the first 64 hold values 0-15 of each block (they
 *       meet the low nibbles of the weight's 64 bytes), the next 64 values 16-31 (the high
 *       nibbles);
 *   q8: natural order, 64 bytes a group (64 / block blocks).
 * A group's 16 int32 lanes of `vpdpbusd` each sum 4 neighbouring bytes of one block, so a lane
 * is scaled by its block's weight scale times d_b (`xs`, per lane). The weight's other term:
 *   q4: min_b * sum(x_b), with the exact float32 sum (only q * scale meets rounded values);
 *   q8: the weights are signed and `vpdpbusd` takes unsigned bytes, so they enter as q + 128
 *       (one xor) and -128 * d_b * sum(round(x_b / d_b)) * scale_b takes the offset back out.
 * Both are a dot of a per-block weight vector (mins, or scales) with `term`, done in float.
 */
#ifndef LLM_RUNTIME_QUANT_BLOCKS_I8_H
#define LLM_RUNTIME_QUANT_BLOCKS_I8_H

#include <math.h>

#include "quant_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define QB_I8_AVAILABLE 1
#else
#define QB_I8_AVAILABLE 0
#endif

/* Blocks the int8 form takes: q4 (32) and q8 blocks of 16, 32 or 64 (whole lanes per block,
 * whole blocks per 64-byte group). */
#define QB_I8_BLOCK_OK(kind, block) \
    ((kind) == QB_Q4 || (block) == 16 || (block) == 32 || (block) == 64)

/* One call's activations in int8 form for one weight kind and block (see the header). */
typedef struct {
    int8_t *xq;    /* [rows, row_bytes] */
    float *xs;     /* [rows, groups, 16]: d_b per int32 lane */
    float *term;   /* [rows, nb]: q4 sum(x_b); q8 -128 d_b sum(round(x_b / d_b)) */
    int64_t groups, nb, row_bytes;
    int64_t key;   /* kind * 1024 + block of the prepared form; -1: not prepared */
} qb_i8_input;

/* Bytes of the buffers for `rows` activation rows of at most `cols` values. */
static inline int64_t qb_i8_bytes(int64_t rows, int64_t cols) {
    const int64_t groups = cols / 64 + 2, nb = cols / 16 + 1;
    return rows * (groups * 128 + (groups * 16 + nb) * (int64_t)sizeof(float)) + 64;
}

/* Lays the buffers of `qb_i8_bytes(rows, cols)` bytes at `memory` (64-byte aligned). */
static inline void qb_i8_bind(qb_i8_input *in, void *memory, int64_t rows, int64_t cols) {
    const int64_t groups = cols / 64 + 2;
    char *base = (char *)(((uintptr_t)memory + 63) & ~(uintptr_t)63);
    in->xq = (int8_t *)base;
    in->xs = (float *)(base + rows * groups * 128);
    in->term = in->xs + rows * groups * 16;
    in->key = -1;
}

#if QB_I8_AVAILABLE

/* `in` from x `[rows, ldx]` for a weight of `kind` / `block` and `cols` inputs. */
static inline void qb_prepare_i8(const float *x, int64_t ldx, int64_t rows, int64_t cols,
                                 int kind, int64_t block, qb_i8_input *in) {
    const int is_q4 = kind == QB_Q4;
    const int64_t nb = cols / block;
    const int64_t groups = is_q4 ? (nb + 3) / 4 : (cols + 63) / 64;
    const int64_t row_bytes = groups * (is_q4 ? 128 : 64);
    in->groups = groups, in->nb = nb, in->row_bytes = row_bytes;
    in->key = kind * 1024 + block;
    for (int64_t r = 0; r < rows; ++r) {
        int8_t *q = in->xq + r * row_bytes;
        float *xs = in->xs + r * groups * 16, *term = in->term + r * nb;
        memset(q, 0, (size_t)row_bytes);
        memset(xs, 0, sizeof(float) * (size_t)(groups * 16));
        for (int64_t b = 0; b < nb; ++b) {
            const float *xb = x + r * ldx + b * block;
            const int chunks = (int)(block / 16);
            __m512 v[4], amax = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
            for (int c = 0; c < chunks; ++c) {
                v[c] = _mm512_loadu_ps(xb + 16 * c);
                amax = _mm512_max_ps(amax, _mm512_abs_ps(v[c]));
                sum = _mm512_add_ps(sum, v[c]);
            }
            const float d = _mm512_reduce_max_ps(amax) / 127.0f;
            const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m512i isum = _mm512_setzero_si512();
            for (int c = 0; c < chunks; ++c) {
                /* round to nearest, ties to even (the default rounding mode) */
                const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v[c], inv));
                isum = _mm512_add_epi32(isum, i);
                const __m128i bytes = _mm512_cvtepi32_epi8(i);
                int8_t *to = is_q4 ? q + (b / 4) * 128 + c * 64 + (b % 4) * 16
                                   : q + b * block + 16 * c;
                _mm_storeu_si128((__m128i *)to, bytes);
            }
            const int64_t first = is_q4 ? (b / 4) * 16 + (b % 4) * 4 : (b * block) / 64 * 16 +
                                                                          (b * block % 64) / 4;
            const int64_t lanes = is_q4 ? 4 : block / 4;
            for (int64_t l = 0; l < lanes; ++l) xs[first + l] = d;
            term[b] = is_q4 ? _mm512_reduce_add_ps(sum)
                            : -128.0f * d * (float)_mm512_reduce_add_epi32(isum);
        }
    }
}

/* dots[k][r] for NO weight rows and R prepared activation rows (see the header). `sc` are
 * the rows' scales as float32, `tm` the per-block weights of the term (q4 mins, q8 scales). */
static inline __attribute__((always_inline)) void qb_i8_tile(
    const int R, const int NO, const int is_q4, const uint8_t *qs, int64_t qs_stride,
    const float *const *sc, const float *const *tm, const qb_i8_input *in, int64_t r0,
    int64_t block, float dots[QB_OUTS][QB_ROWS]) {
    const int64_t nb = in->nb, groups = in->groups;
    __m512 acc[QB_OUTS][QB_ROWS];
    for (int k = 0; k < NO; ++k)
        for (int r = 0; r < R; ++r) acc[k][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 mask = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        for (int k = 0; k < NO; ++k) {
            const __m512 m = _mm512_maskz_loadu_ps(mask, tm[k] + b);
            for (int r = 0; r < R; ++r)
                acc[k][r] = _mm512_fmadd_ps(
                    m, _mm512_maskz_loadu_ps(mask, in->term + (r0 + r) * nb + b), acc[k][r]);
        }
    }
    const int64_t row_bytes = is_q4 ? nb * 16 : nb * block;
    const int64_t per = is_q4 ? 4 : 64 / block; /* blocks per group */
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    const __m512i lane_block = is_q4 || block == 16
                                   ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                   : (block == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1,
                                                                      1, 1, 1, 1, 1, 1)
                                                  : _mm512_setzero_si512());
    const int8_t *xq = in->xq + r0 * in->row_bytes;
    const float *xs = in->xs + r0 * groups * 16;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t at = g * 64, left = row_bytes - at, b0 = g * per;
        const __mmask64 wmask = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
        const int64_t nblk = nb - b0 < per ? nb - b0 : per;
        const __mmask8 smask = (__mmask8)((1u << nblk) - 1);
        qb_prefetch_rows(qs, qs_stride, at, NO, R);
        for (int k = 0; k < NO; ++k) {
            const uint8_t *wq = qs + k * qs_stride + at;
            const __m512i v = left >= 64 ? _mm512_loadu_si512((const void *)wq)
                                         : _mm512_maskz_loadu_epi8(wmask, wq);
            const __m512 ws = _mm512_permutexvar_ps(
                lane_block, _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, sc[k] + b0)));
            if (is_q4) {
                const __m512i lo = _mm512_and_si512(v, low);
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < R; ++r) {
                    const int8_t *xr = xq + r * in->row_bytes + g * 128;
                    __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,
                                                    _mm512_loadu_si512((const void *)xr));
                    i = _mm512_dpbusd_epi32(i, hi, _mm512_loadu_si512((const void *)(xr + 64)));
                    const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xs + (r * groups + g) * 16));
                    acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc[k][r]);
                }
            } else {
                const __m512i u = _mm512_xor_si512(v, flip);
                for (int r = 0; r < R; ++r) {
                    const int8_t *xr = xq + r * in->row_bytes + g * 64;
                    const __m512i i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u,
                                                          _mm512_loadu_si512((const void *)xr));
                    const __m512 scale = _mm512_mul_ps(ws, _mm512_loadu_ps(xs + (r * groups + g) * 16));
                    acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc[k][r]);
                }
            }
        }
    }
    qb_reduce(R, NO, acc, dots);
}

/* `qb_project` with int8 activations: y[r * ldy + o] (= or +=) for o in [o0, o1), the
 * activations prepared in `in` for m's kind and block (`qb_prepare_i8`). */
static inline void qb_project_i8(const qb_matrix *m, const qb_i8_input *in, int64_t rows,
                                 float *y, int64_t ldy, int64_t o0, int64_t o1, int accumulate) {
    const int64_t nb = m->cols / m->block;
    const int is_q4 = m->kind == QB_Q4;
    const int64_t qs_stride = is_q4 ? m->cols / 2 : m->cols;
    const int64_t tile = qb_tile_rows(nb);
    float sbuf[tile * nb], mbuf[tile * nb];
    for (int64_t t0 = o0; t0 < o1; t0 += tile) {
        const int64_t t1 = t0 + tile < o1 ? t0 + tile : o1;
        const float *ts, *tms;
        qb_tile_floats(m, nb, t0, t1, sbuf, mbuf, &ts, &tms);
        for (int64_t r0 = 0; r0 < rows; r0 += QB_ROWS) {
            const int R = rows - r0 < QB_ROWS ? (int)(rows - r0) : QB_ROWS;
            for (int64_t o = t0; o < t1;) {
                const int NO = t1 - o >= QB_OUTS_FOR(R) ? QB_OUTS_FOR(R) : 1;
                const float *sc[QB_OUTS], *tm[QB_OUTS];
                for (int k = 0; k < NO; ++k) {
                    sc[k] = ts + (o + k - t0) * nb;
                    tm[k] = is_q4 ? tms + (o + k - t0) * nb : sc[k];
                }
                float dots[QB_OUTS][QB_ROWS];
                const uint8_t *q = (const uint8_t *)m->qs + o * qs_stride;
                if (is_q4) {
#define QB_I8_Q4_CALL(RR, NN) qb_i8_tile(RR, NN, 1, q, qs_stride, sc, tm, in, r0, 32, dots)
                    QB_CASES(QB_I8_Q4_CALL)
#undef QB_I8_Q4_CALL
                } else {
                    const int64_t block = m->block;
#define QB_I8_Q8_CALL(RR, NN) qb_i8_tile(RR, NN, 0, q, qs_stride, sc, tm, in, r0, block, dots)
                    QB_CASES(QB_I8_Q8_CALL)
#undef QB_I8_Q8_CALL
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

#endif /* QB_I8_AVAILABLE */
#endif
