/* The q4 block product's activations as int16 (included by `quant_blocks.h`).
 *
 * Why: with float32 activations a q4 block of 32 weights costs six vector instructions per
 * weight row (widen, convert, look up, multiply, two FMAs), three of them on the two FMA
 * pipes, so batch-1 decode ran at ~20 GB/s a thread, well under the read rate. Rounded to
 * int16, two blocks of activations meet two blocks of nibbles in one `vpmaddwd` and one
 * `vpdpwssd` (AVX-512 VNNI): about four instructions a block, measured 1.4x faster on Zen 5.
 * Not bit-equal to the float32 form, so it is a form of its own (`q_int16`, the fused
 * stack's "int16" activations) that warmup keeps only where it measures faster.
 *
 * The rounding: each 32-value block x_b of an activation row becomes integers in steps of
 * d_b = max|x_b| / 32767, each off by at most d_b / 2, a relative error of 1.5e-5 of the
 * block's largest value (int8 activations, `quant_blocks_i8.h`, are 258x coarser). Only the
 * weights' `q * scale` part meets the rounded values; the q4 `min * sum(x_b)` term keeps the
 * exact float sum. `runtime.quant.int8_activations.error_bound(..., levels=32767)` states
 * the bound the tests hold it to.
 *
 * Prepared row (`qb_prepare_q4_i16`), `qb_q4_i16_row_floats(cols)` floats, 64-byte aligned when the
 * buffer is: per pair of blocks (p = b / 2) 64 int16, [low halves of blocks 2p, 2p + 1]
 * then [high halves of blocks 2p, 2p + 1] (a block's value j < 16 meets its bytes' low
 * nibbles, value j + 16 their high nibbles); then d_b for every block, zero-padded to a
 * multiple of 16. An odd last block's partner is zeros.
 */
#ifndef LLM_RUNTIME_QUANT_BLOCKS_I16_H
#define LLM_RUNTIME_QUANT_BLOCKS_I16_H

/* QB_Q4_I16 (this CPU has AVX-512 BW and VNNI) is set by `quant_blocks.h`. */
#define QB_I16_LEVELS 32767.0f

#if QB_Q4_I16

static inline int64_t qb_i16_pairs(int64_t nb) { return (nb + 1) / 2; }
static inline int64_t qb_i16_steps(int64_t nb) { return (nb + 15) / 16 * 16; }

/* Groups of 4 blocks in the one-row layout (`qb_prepare_q4_i16_row`). */
static inline int64_t qb_i16_groups(int64_t nb) { return (nb + 3) / 4; }

/* Floats one prepared activation row takes (in either layout). */
static inline int64_t qb_q4_i16_row_floats(int64_t cols) {
    const int64_t nb = cols / 32;
    const int64_t pairs = qb_i16_pairs(nb) * 32 + qb_i16_steps(nb);
    const int64_t groups = qb_i16_groups(nb) * (64 + 16);
    return pairs > groups ? pairs : groups;
}

/* One 32-value block `xb` rounded to int16 in steps of its largest |value| / 32767: values
 * 0-15 into *lo and 16-31 into *hi; returns the step and sets *sum to the block's exact
 * float sum (the q4 min term). The one rounding every int16 form shares (the streamed rows
 * below and the panels' groups, `gemm_panels_i16.h`). */
static inline float qb_i16_round_block(const float *xb, __m256i *lo, __m256i *hi, float *sum) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const float largest = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, b)));
    const __m512 scale = _mm512_set1_ps(largest > 0.0f ? QB_I16_LEVELS / largest : 0.0f);
    /* round to nearest, then narrow with saturation (|x| * inverse <= 32767) */
    *lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, scale)));
    *hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, scale)));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    return largest / QB_I16_LEVELS;
}

/* One row's blocks, rounded as above, in the one-row layout (`qb_q4_i16_row_tile`): per group
 * of 4 blocks 256 bytes, each int16 value v split as v = 256 h + l (h signed, l unsigned
 * bytes): [h of values 0-15 of the 4 blocks][h of values 16-31][l of 0-15][l of 16-31], byte
 * 16 i + j for block i's value j (+ 16); then per group the 4 blocks' steps, each repeated
 * 4 times (one per int32 lane of the block). Blocks past the row are zeros. */
static inline void qb_prepare_q4_i16_row(const float *x, int64_t cols, float *xp, float *sums) {
    const int64_t nb = cols / 32, groups = qb_i16_groups(nb);
    uint8_t *bytes = (uint8_t *)xp;
    float *steps = xp + groups * 64;
    const __m256i low8 = _mm256_set1_epi16(0xFF);
    for (int64_t b = 0; b < groups * 4; ++b) {
        uint8_t *at = bytes + (b / 4) * 256 + (b % 4) * 16;
        if (b >= nb) {
            for (int part = 0; part < 4; ++part) memset(at + part * 64, 0, 16);
            _mm_storeu_ps(steps + b * 4, _mm_setzero_ps());
            continue;
        }
        __m256i lo, hi;
        const float step = qb_i16_round_block(x + b * 32, &lo, &hi, &sums[b]);
        /* high bytes (arithmetic shift: signed) and low bytes, narrowed to 16 bytes each */
        _mm_storeu_si128((__m128i *)at, _mm256_cvtepi16_epi8(_mm256_srai_epi16(lo, 8)));
        _mm_storeu_si128((__m128i *)(at + 64), _mm256_cvtepi16_epi8(_mm256_srai_epi16(hi, 8)));
        _mm_storeu_si128((__m128i *)(at + 128), _mm256_cvtepi16_epi8(_mm256_and_si256(lo, low8)));
        _mm_storeu_si128((__m128i *)(at + 192), _mm256_cvtepi16_epi8(_mm256_and_si256(hi, low8)));
        _mm_storeu_ps(steps + b * 4, _mm_set1_ps(step));
    }
}

/* Row r's blocks of x (`[rows, ldx]`) as int16 and their steps into xp (`[rows,
 * qb_q4_i16_row_floats(cols)]`), and sums[r, b] = the exact sum of block b (the min term).
 * One row takes the one-row layout (`qb_prepare_q4_i16_row`), more rows the pairs below. */
static inline void qb_prepare_q4_i16(const float *x, int64_t ldx, int64_t rows, int64_t cols,
                                     float *xp, float *sums) {
    if (rows == 1) {
        qb_prepare_q4_i16_row(x, cols, xp, sums);
        return;
    }
    const int64_t nb = cols / 32, stride = qb_q4_i16_row_floats(cols);
    for (int64_t r = 0; r < rows; ++r) {
        int16_t *words = (int16_t *)(xp + r * stride);
        float *steps = xp + r * stride + qb_i16_pairs(nb) * 32;
        for (int64_t b = 0; b < nb; ++b) {
            int16_t *pair = words + (b / 2) * 64 + (b % 2) * 16;
            __m256i lo, hi;
            steps[b] = qb_i16_round_block(x + r * ldx + b * 32, &lo, &hi, &sums[r * nb + b]);
            _mm256_storeu_si256((__m256i *)pair, lo);
            _mm256_storeu_si256((__m256i *)(pair + 32), hi);
        }
        if (nb % 2) { /* the odd last block's partner */
            int16_t *pair = words + (nb / 2) * 64 + 16;
            memset(pair, 0, 16 * sizeof(int16_t));
            memset(pair + 32, 0, 16 * sizeof(int16_t));
        }
        for (int64_t b = nb; b < qb_i16_steps(nb); ++b) steps[b] = 0.0f;
    }
}

/* dots[k][r] for NO weight rows and R prepared rows (row stride ldp floats): per pair of
 * blocks, 16 int32 sums (lanes 0-7 the first block, 8-15 the second), widened and scaled by
 * the weight's scale times the activation step of each lane's block. */
static inline __attribute__((always_inline)) void qb_q4_i16_tile(
    const int R, const int NO, const uint8_t *qs, int64_t qs_stride, const float *const *sc,
    const float *const *mn, const float *xsum, int64_t nb, const float *xp, int64_t ldp,
    float dots[QB_OUTS][QB_ROWS]) {
    __m512 acc[QB_OUTS][QB_ROWS];
    qb_min_term(R, NO, mn, xsum, nb, acc);
    const int64_t step_at = qb_i16_pairs(nb) * 32;
    const __m512i low4 = _mm512_set1_epi16(0x0F);
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t g = 0; g < nb; g += 16) {
        const __mmask16 mask =
            nb - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - g)) - 1);
        __m512 steps[QB_OUTS][QB_ROWS]; /* scale of block g + i times its activation step */
        for (int k = 0; k < NO; ++k) {
            const __m512 s = _mm512_maskz_loadu_ps(mask, sc[k] + g);
            for (int r = 0; r < R; ++r)
                steps[k][r] = _mm512_mul_ps(s, _mm512_loadu_ps(xp + r * ldp + step_at + g));
        }
        const int64_t end = g + 16 < nb ? g + 16 : nb;
        for (int64_t b = g; b < end; b += 2) {
            if ((b & 3) == 0) qb_prefetch_rows(qs, qs_stride, b * 16, NO, R);
            __m512i xl[QB_ROWS], xh[QB_ROWS];
            for (int r = 0; r < R; ++r) {
                const int16_t *words = (const int16_t *)(xp + r * ldp) + (b / 2) * 64;
                xl[r] = _mm512_loadu_si512((const void *)words);
                xh[r] = _mm512_loadu_si512((const void *)(words + 32));
            }
            const __m512i lanes = _mm512_add_epi32(halves, _mm512_set1_epi32((int)(b - g)));
            for (int k = 0; k < NO; ++k) {
                const uint8_t *q = qs + k * qs_stride + b * 16;
                const __m256i bytes = b + 1 < nb
                                          ? _mm256_loadu_si256((const __m256i *)q)
                                          : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)q));
                const __m512i w = _mm512_cvtepu8_epi16(bytes);
                const __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_srli_epi16(w, 4);
                for (int r = 0; r < R; ++r) {
                    const __m512i sum = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, xl[r]), hi, xh[r]);
                    acc[k][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                                _mm512_permutexvar_ps(lanes, steps[k][r]),
                                                acc[k][r]);
                }
            }
        }
    }
    qb_reduce(R, NO, acc, dots);
}

/* acc + (256 h + l) scaled lane by lane: each int32 lane by its block's weight scale (the
 * blocks' scales at `scales`, `blocks` of them read, spread over their lanes by `expand`)
 * times the activation step of its block (`step`, already spread). The one-row kernels'
 * epilogue. */
static inline __attribute__((always_inline)) __m512 qb_i16_row_scaled(
    __m512i h, __m512i l, __m512i expand, __mmask8 blocks, const float *scales, __m512 step,
    __m512 acc) {
    const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
    const __m512 scale =
        _mm512_permutexvar_ps(expand, _mm512_castps128_ps512(_mm_maskz_loadu_ps(blocks, scales)));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(scale, step), acc);
}

/* dots[k][0] for NO weight rows and the one row prepared by `qb_prepare_q4_i16_row`.
 *
 * Why a layout of its own: at one row there is no second row to share a widened weight
 * vector, and the pair kernel above spends 8 instructions on 64 weights. Here 64 bytes (4
 * blocks) are split into their low and high nibbles as bytes and meet the rows' high and
 * low activation bytes in four `vpdpbusd` (64 products each): sum q x = 256 sum q h +
 * sum q l, exact in int32 (the weights enter as unsigned bytes against h, and as signed
 * ones, 0-15, against the unsigned l). Each int32 lane holds 4 weights of one block, so
 * the lane's block scale (4 floats expanded to 16 lanes) times the activation step scales it
 * once. Measured on Zen 5 from L2, one thread: 2.8-3.6 cycles per 64 weights a row against
 * 3.3-4.1 for the pair kernel (576 to 4096 values a row). */
static inline __attribute__((always_inline)) void qb_q4_i16_row_tile(
    const int NO, const uint8_t *qs, int64_t qs_stride, const float *const *sc,
    const float *const *mn, const float *xsum, int64_t nb, const float *xp,
    float dots[QB_OUTS][QB_ROWS]) {
    __m512 acc[QB_OUTS][QB_ROWS];
    qb_min_term(1, NO, mn, xsum, nb, acc);
    const int64_t groups = qb_i16_groups(nb);
    const uint8_t *xb = (const uint8_t *)xp;
    const float *steps = xp + groups * 64;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t g = 0; g < groups; ++g) {
        qb_prefetch_rows(qs, qs_stride, g * 64, NO, 1);
        const uint8_t *x = xb + g * 256;
        const __m512i high_lo = _mm512_loadu_si512((const void *)x);
        const __m512i high_hi = _mm512_loadu_si512((const void *)(x + 64));
        const __m512i low_lo = _mm512_loadu_si512((const void *)(x + 128));
        const __m512i low_hi = _mm512_loadu_si512((const void *)(x + 192));
        const __m512 step = _mm512_loadu_ps(steps + g * 16);
        /* a last group of fewer than 4 blocks reads none past the row */
        const int64_t left = nb - g * 4;
        const __mmask64 bytes = left >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (left * 16)) - 1);
        const __mmask8 blocks = left >= 4 ? (__mmask8)0x0F : (__mmask8)((1u << left) - 1);
        for (int k = 0; k < NO; ++k) {
            const __m512i q = _mm512_maskz_loadu_epi8(bytes, qs + k * qs_stride + g * 64);
            const __m512i lo = _mm512_and_si512(q, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, high_lo);
            h = _mm512_dpbusd_epi32(h, hi, high_hi);
            __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low_lo, lo);
            l = _mm512_dpbusd_epi32(l, low_hi, hi);
            acc[k][0] = qb_i16_row_scaled(h, l, expand, blocks, sc[k] + g * 4, step, acc[k][0]);
        }
    }
    qb_reduce(1, NO, acc, dots);
}

/* Floats of one row in the q8 one-row layout (`qb_prepare_q8_i16_row`): 64 per 2 blocks. */
static inline int64_t qb_q8_i16_row_floats(int64_t cols) { return (cols / 32 + 1) / 2 * 64; }

/* One row for q8 blocks of 32 (`qb_q8_i16_row_tile`), rounded as the q4 forms round it: per
 * pair of blocks 256 bytes, [h of the 64 values][l of them][the 2 steps, each repeated over
 * its block's 8 int32 lanes][-128 sum(h) of each block in its first lane, zeros]. A missing
 * second block of the last pair is zeros. */
static inline void qb_prepare_q8_i16_row(const float *x, int64_t cols, float *xp) {
    const int64_t nb = cols / 32;
    const __m256i low8 = _mm256_set1_epi16(0xFF), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < (nb + 1) / 2 * 2; ++b) {
        uint8_t *pair = (uint8_t *)(xp + (b / 2) * 64), *at = pair + (b % 2) * 32;
        float *steps = (float *)(pair + 128) + (b % 2) * 8;
        int32_t *corr = (int32_t *)(pair + 192) + (b % 2) * 8;
        if (b >= nb) {
            memset(at, 0, 32), memset(at + 64, 0, 32), memset(steps, 0, 32), memset(corr, 0, 32);
            continue;
        }
        __m256i lo, hi;
        float sum;
        const float step = qb_i16_round_block(x + b * 32, &lo, &hi, &sum);
        const __m256i h_lo = _mm256_srai_epi16(lo, 8), h_hi = _mm256_srai_epi16(hi, 8);
        _mm_storeu_si128((__m128i *)at, _mm256_cvtepi16_epi8(h_lo));
        _mm_storeu_si128((__m128i *)(at + 16), _mm256_cvtepi16_epi8(h_hi));
        _mm_storeu_si128((__m128i *)(at + 64), _mm256_cvtepi16_epi8(_mm256_and_si256(lo, low8)));
        _mm_storeu_si128((__m128i *)(at + 80), _mm256_cvtepi16_epi8(_mm256_and_si256(hi, low8)));
        _mm256_storeu_ps(steps, _mm256_set1_ps(step));
        const __m256i h_sum = _mm256_add_epi32(_mm256_madd_epi16(h_lo, ones), _mm256_madd_epi16(h_hi, ones));
        __m128i four = _mm_add_epi32(_mm256_castsi256_si128(h_sum), _mm256_extracti128_si256(h_sum, 1));
        four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0x4E));
        four = _mm_add_epi32(four, _mm_shuffle_epi32(four, 0xB1));
        memset(corr, 0, 32);
        corr[0] = -128 * _mm_cvtsi128_si32(four);
    }
}

/* dots[k][0] for NO q8 weight rows (blocks of 32) and one row from `qb_prepare_q8_i16_row`:
 * sum q x = 256 sum q h + sum q l with `vpdpbusd`, whose first operand is unsigned: against h
 * the weights enter as q + 128 (one xor) and the prepared -128 sum(h) of each block takes the
 * surplus back; against the unsigned l they enter as they are. Each int32 lane holds 4
 * weights of one block; 8 lanes a block. Why: the float32 q8 kernel spends 3 instructions
 * on 16 weights in chains of FMAs, bound at 35 GB/s a thread from cache on Zen 5 (a tied LM
 * head's 28 MB of Q8_0 then takes 0.42 ms a decode step with 2 threads). */
static inline __attribute__((always_inline)) void qb_q8_i16_row_tile(
    const int NO, const int8_t *qs, int64_t qs_stride, const float *const *sc, int64_t nb,
    const float *xp, float dots[QB_OUTS][QB_ROWS]) {
    __m512 acc[QB_OUTS][QB_ROWS];
    for (int k = 0; k < NO; ++k) acc[k][0] = _mm512_setzero_ps();
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const __m512i expand = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t g = 0; g < (nb + 1) / 2; ++g) {
        qb_prefetch_rows(qs, qs_stride, g * 64, NO, 1);
        const uint8_t *pair = (const uint8_t *)(xp + g * 64);
        const __m512i high = _mm512_loadu_si512((const void *)pair);
        const __m512i low = _mm512_loadu_si512((const void *)(pair + 64));
        const __m512 step = _mm512_loadu_ps((const float *)(pair + 128));
        const __m512i corr = _mm512_loadu_si512((const void *)(pair + 192));
        const int whole = g * 2 + 2 <= nb; /* else one block: read none past the row */
        const __mmask64 bytes = whole ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
        const __mmask8 blocks = whole ? (__mmask8)3 : (__mmask8)1;
        for (int k = 0; k < NO; ++k) {
            const __m512i q = _mm512_maskz_loadu_epi8(bytes, qs + k * qs_stride + g * 64);
            const __m512i h = _mm512_dpbusd_epi32(corr, _mm512_xor_si512(q, offset), high);
            const __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, q);
            acc[k][0] = qb_i16_row_scaled(h, l, expand, blocks, sc[k] + g * 2, step, acc[k][0]);
        }
    }
    qb_reduce(1, NO, acc, dots);
}

#endif /* QB_Q4_I16 */
#endif
