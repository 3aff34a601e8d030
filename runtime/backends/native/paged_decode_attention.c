/* Decode attention that reads a paged K/V cache in place (no gather into a workspace).
 *
 * One query token per row, grouped-query heads folded: q and out are [B, kv, g, hd] float32.
 * The caches are [num_blocks, kv, block_size, hd] (float32 or bfloat16 stored as uint16);
 * row b attends to its first n_keys[b] positions, position t living on page pages[b, t / bs]
 * at offset t % bs (a page of -1 is unmapped: its keys are masked out).
 *
 * Why it is shaped this way: a batch-32 decode step reads about as many K/V bytes as weight
 * bytes, so attention must run at the memory's read rate, and the math must be small next
 * to the reads (measured on Zen 5: ~2.3x less math than a per-key dot product with a
 * horizontal sum; the reads, not the math, now set the time).
 * - Work items are (row, key span) pairs, handed out dynamically to the OpenMP threads,
 *   longest rows first so that the threads finish together. A row is split into spans
 *   (flash-decoding) only when the rows are too few to keep every thread busy; the spans are
 *   merged at the end. An item does every kv head: a page's heads are contiguous
 *   ([kv, bs, hd]), so a page is one sweep of K and one of V. The items and the merge are
 *   one team body (`paged_attention_team_*`, orphaned worksharing loops): the kernel opens
 *   its own team for it, and the fused decode stack runs it with its threads.
 * - Per page and head, the keys and values are first read line by line side by side (two
 *   streams keep more lines in flight than one) while the next page's lines are
 *   prefetched; the math then runs from L1 (`spread`: prefetching the next page's lines
 *   again through it).
 * - Scores are computed LANES keys at a time (16 with AVX-512, else 8): one partial-sum
 *   vector per key, then a transposing tree sums the 16 vectors into one vector of 16 scores
 *   (~2 shuffles a score, not ~8). The online softmax is vectorised over a page's scores,
 *   with an exp without libm, so nothing needs -ffast-math.
 * - The values are accumulated into register tiles of up to 4 queries x 4 lane chunks (the
 *   whole [3, 64] output for SmolLM2), the page's rescale folded into loading the tile.
 * - Head sizes that are not a multiple of the lane count take a scalar loop with the same
 *   arithmetic. Head sizes 64 and 128 are compiled as constants (fixed key-row offsets).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"
#include "scratch_alloc.h"

/* Bits of the calls' `mode`: the spread prefetch placement (see DEFINE_SPAN), and, for
 * benchmarks, the reads without the math: every page read in the kernel's order with its
 * prefetches, the outputs left at zero (the page walk where the attention runs, e.g. inside
 * the fused decode stack's team). The exported callers pass these values. */
#define ATTENTION_SPREAD 1
#define ATTENTION_READS_ONLY 2

/* Floats of per-item scratch (scores, a key block, states) kept on the stack; more is allocated. */
#define STACK_FLOATS 8192
/* Work items per thread below which rows are split into key spans. */
#define ITEMS_PER_THREAD 4

/* The native vector width and types (16 lanes with AVX-512, else 8), as `exp_nonpositive.h`
 * defines them. */
#define LANES EXP_LANES
typedef exp_vfloat vfloat;
typedef exp_vint vint;
typedef uint16_t vhalf __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = ((uint32_t)value) << 16;
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

static inline vfloat load_f32(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof(v));
    return v;
}

static inline vfloat load_bf16(const uint16_t *p) {
    vhalf h;
    memcpy(&h, p, sizeof(h));
    vint bits = __builtin_convertvector(h, vint) << 16;
    vfloat v;
    memcpy(&v, &bits, sizeof(v));
    return v;
}

typedef float vquarter __attribute__((vector_size(4 * sizeof(float))));

/* Sum of the lanes as a tree (halves added until four lanes are left). */
static inline float hsum(vfloat v) {
#if LANES == 16
    typedef float vhalf_f __attribute__((vector_size(8 * sizeof(float))));
    vhalf_f lo, hi;
    memcpy(&lo, &v, sizeof(lo));
    memcpy(&hi, (const char *)&v + sizeof(lo), sizeof(hi));
    const vhalf_f eight = lo + hi;
#else
    const vfloat eight = v;
#endif
    vquarter a, b;
    memcpy(&a, &eight, sizeof(a));
    memcpy(&b, (const char *)&eight + sizeof(a), sizeof(b));
    const vquarter four = a + b;
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* Largest lane: each step keeps the larger of the vector and its halves swapped. */
static inline vfloat vmax(vfloat a, vfloat b) { return exp_select(a > b, a, b); }
static inline float hmax(vfloat v) {
#if LANES == 16
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
#else
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 1, 0, 1, 0, 1, 0));
#endif
    return v[0];
}

/* Online-softmax state of one work item: running maximum and sum per query, and the
 * unnormalised output [g, hd], in `state_floats` floats of someone's buffer. */
typedef struct {
    float *top;
    float *total;
    float *acc;
} span_state;

/* Rounded up to whole cache lines: when a row is split into key spans, the threads write
 * neighbouring states on every page, and states sharing a line made two threads slower than
 * one (measured on Zen 5, batch 1, 164 keys: 6.8 against 3.4 us a layer once apart). */
static inline int64_t state_floats(int64_t group, int64_t head_dim) {
    return (group * (head_dim + 2) + 15) / 16 * 16;
}

/* A cleared state laid out in `buffer`. */
static span_state clear_state(float *buffer, int64_t group, int64_t head_dim) {
    span_state state = {buffer, buffer + group, buffer + 2 * group};
    for (int64_t gi = 0; gi < group; ++gi) {
        state.top[gi] = -INFINITY;
        state.total[gi] = 0.0f;
    }
    memset(state.acc, 0, sizeof(float) * group * head_dim);
    return state;
}

/* Query gi's page of `count` scores (in `s`, padded to a multiple of LANES with -inf): update
 * its running maximum and sum, turn the scores into weights, and return the factor the output
 * so far must be scaled by (the vector path folds it into loading its register tiles). */
static inline float softmax_scores(const span_state *state, int64_t gi, float *s, int64_t count) {
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    vfloat top_v = load_f32(s);
    for (int64_t t = LANES; t < padded; t += LANES) {
        const vfloat x = load_f32(s + t);
        top_v = vmax(x, top_v);
    }
    const float top = hmax(top_v), old = state->top[gi];
    float factor = 1.0f;
    if (top > old) {
        factor = exp_nonpositive(old - top);
        state->total[gi] *= factor;
        state->top[gi] = top;
    }
    const vfloat current = exp_splat(state->top[gi]);
    vfloat sum = exp_splat(0.0f);
    for (int64_t t = 0; t < padded; t += LANES) {
        const vfloat w = vexp_nonpositive(load_f32(s + t) - current);
        memcpy(s + t, &w, sizeof(w));
        sum += w;
    }
    state->total[gi] += hsum(sum);
    return factor;
}

/* `softmax_scores` with the output rescaled here (the scalar path). */
static inline void softmax_page(const span_state *state, int64_t gi, float *s, int64_t count,
                                int64_t head_dim) {
    const float factor = softmax_scores(state, gi, s, count);
    if (factor != 1.0f) {
        float *acc = state->acc + gi * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= factor;
    }
}

/* Vector path tiles: V accumulators of up to TILE_QUERIES queries x TILE_CHUNKS lane chunks
 * stay in registers while a page's values stream past (12 of 32 zmm for g = 3, hd = 64). */
#define TILE_QUERIES 4
#if LANES == 16
#define TILE_CHUNKS 4
#else
#define TILE_CHUNKS 2
#endif

/* Lane j of the result is the sum of part[j]'s lanes: a transposing tree (each level adds
 * pairs of vectors after interleaving their halves), ~2 shuffles a sum instead of ~8. */
static inline vfloat reduce_lanes(vfloat *part) {
#if LANES == 16
    for (int j = 0; j < 8; ++j)
        part[j] = __builtin_shufflevector(part[j], part[j + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                          18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(part[j], part[j + 8], 8, 9, 10, 11, 12, 13, 14, 15,
                                          24, 25, 26, 27, 28, 29, 30, 31);
    for (int j = 0; j < 4; ++j)
        part[j] = __builtin_shufflevector(part[j], part[j + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8,
                                          9, 10, 11, 24, 25, 26, 27) +
                  __builtin_shufflevector(part[j], part[j + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12,
                                          13, 14, 15, 28, 29, 30, 31);
    for (int j = 0; j < 2; ++j)
        part[j] = __builtin_shufflevector(part[j], part[j + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8,
                                          9, 24, 25, 12, 13, 28, 29) +
                  __builtin_shufflevector(part[j], part[j + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                          11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(part[0], part[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26,
                                   12, 28, 14, 30) +
           __builtin_shufflevector(part[0], part[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27,
                                   13, 29, 15, 31);
#else
    for (int j = 0; j < 4; ++j)
        part[j] = __builtin_shufflevector(part[j], part[j + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(part[j], part[j + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int j = 0; j < 2; ++j)
        part[j] = __builtin_shufflevector(part[j], part[j + 2], 0, 1, 8, 9, 4, 5, 12, 13) +
                  __builtin_shufflevector(part[j], part[j + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(part[0], part[1], 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(part[0], part[1], 1, 9, 3, 11, 5, 13, 7, 15);
#endif
}

/* Prefetches cache lines [first, last) from `start` into L2: the next page's, a few at a time
 * through this page's math, so that the memory keeps reading while the math runs from L1.
 * Measured on Zen 4 (batch 32, 418 MB of K/V): 19.7 -> 13.3-15 ms against prefetching the
 * whole next page during the read pass, after which the memory idled through the math. */
static inline void prefetch_lines(const void *start, int64_t first, int64_t last) {
    const char *p = (const char *)start;
    for (int64_t line = first; line < last; ++line) __builtin_prefetch(p + line * 64, 0, 2);
}

/* Cache lines of `rows` rows of `row_bytes`. */
static inline int64_t lines_of(int64_t rows, int64_t row_bytes) {
    return (rows * row_bytes + 63) / 64;
}

static const float lane_index[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Vector path pieces per cache type: scores of LANES keys for every query, then the values of
 * a page into one register tile of the output state. */
#define DEFINE_VECTOR_PIECES(SUFFIX, KV_T, LOAD)                                                \
    /* Scores of keys rows[0 .. LANES) (row j at keys + j * head_dim) for each query; lanes  \
     * at or past `valid` get -inf. The `ahead_lines` lines at `ahead` are prefetched, a     \
     * share before each query. */                                                           \
    static inline __attribute__((always_inline)) void key_block_##SUFFIX(                    \
        const float *restrict qh, const KV_T *restrict keys, int64_t valid, int64_t group,   \
        int64_t head_dim, float scale, int64_t stride, float *restrict out,                  \
        const KV_T *ahead, int64_t ahead_lines) {                                            \
        const vint beyond = load_f32(lane_index) >= exp_splat((float)valid);                  \
        for (int64_t gi = 0; gi < group; ++gi) {                                             \
            prefetch_lines(ahead, gi * ahead_lines / group, (gi + 1) * ahead_lines / group);  \
            const float *qg = qh + gi * head_dim;                                            \
            vfloat part[LANES];                                                              \
            for (int j = 0; j < LANES; ++j) part[j] = exp_splat(0.0f);                        \
            for (int64_t c = 0; c < head_dim; c += LANES) {                                  \
                const vfloat qv = load_f32(qg + c);                                          \
                for (int j = 0; j < LANES; ++j) part[j] += qv * LOAD(keys + j * head_dim + c); \
            }                                                                                \
            const vfloat s = exp_select(beyond, exp_splat(-INFINITY), reduce_lanes(part) * exp_splat(scale)); \
            memcpy(out + gi * stride, &s, sizeof(s));                                        \
        }                                                                                    \
    }                                                                                        \
    /* key_block with the common head sizes as constants: the 16 key rows are then fixed    \
     * offsets from one pointer instead of 16 pointers spilled to the stack. */              \
    static void key_block_any_##SUFFIX(const float *qh, const KV_T *keys, int64_t valid,     \
                                       int64_t group, int64_t head_dim, float scale,         \
                                       int64_t stride, float *out, const KV_T *ahead,        \
                                       int64_t ahead_lines) {                                \
        if (head_dim == 64)                                                                  \
            key_block_##SUFFIX(qh, keys, valid, group, 64, scale, stride, out, ahead,        \
                               ahead_lines);                                                 \
        else if (head_dim == 128)                                                            \
            key_block_##SUFFIX(qh, keys, valid, group, 128, scale, stride, out, ahead,       \
                               ahead_lines);                                                 \
        else                                                                                 \
            key_block_##SUFFIX(qh, keys, valid, group, head_dim, scale, stride, out, ahead,  \
                               ahead_lines);                                                 \
    }                                                                                        \
    /* acc[qi][c] = acc * factor[qi] + sum_t w[qi][t] v[t][c] for NQ queries, NC chunks;     \
     * row t of `ahead` (the next page's values, or NULL) is prefetched at step t. */        \
    static inline __attribute__((always_inline)) void value_tile_##SUFFIX(                   \
        const KV_T *restrict values, int64_t count, int64_t head_dim, const float *w,        \
        int64_t stride, float *acc, const float *factor, int nq, int nc,                     \
        const KV_T *ahead) {                                                                 \
        vfloat a[TILE_QUERIES][TILE_CHUNKS];                                                 \
        for (int qi = 0; qi < nq; ++qi)                                                      \
            for (int c = 0; c < nc; ++c)                                                     \
                a[qi][c] = load_f32(acc + qi * head_dim + c * LANES) * exp_splat(factor[qi]); \
        for (int64_t t = 0; t < count; ++t) {                                                \
            if (ahead != NULL)                                                               \
                prefetch_lines(ahead + t * head_dim, 0, lines_of(1, head_dim * sizeof(KV_T)));  \
            vfloat v[TILE_CHUNKS];                                                           \
            for (int c = 0; c < nc; ++c) v[c] = LOAD(values + t * head_dim + c * LANES);     \
            for (int qi = 0; qi < nq; ++qi) {                                                \
                const vfloat wq = exp_splat(w[qi * stride + t]);                              \
                for (int c = 0; c < nc; ++c) a[qi][c] += wq * v[c];                          \
            }                                                                                \
        }                                                                                    \
        for (int qi = 0; qi < nq; ++qi)                                                      \
            for (int c = 0; c < nc; ++c)                                                     \
                memcpy(acc + qi * head_dim + c * LANES, &a[qi][c], sizeof(vfloat));          \
    }

DEFINE_VECTOR_PIECES(f32, float, load_f32)
DEFINE_VECTOR_PIECES(bf16, uint16_t, load_bf16)

/* value_tile with nq and nc as constants, so that its tile lives in registers. */
#define VALUE_TILE_CASE(SUFFIX, NQ, NC)                                                       \
    case (NQ) * 8 + (NC):                                                                     \
        value_tile_##SUFFIX(values, count, head_dim, w, stride, acc, factor, NQ, NC, ahead);  \
        return;
#if LANES == 16
#define VALUE_TILE_CASES(SUFFIX, NQ)                                                          \
    VALUE_TILE_CASE(SUFFIX, NQ, 1)                                                            \
    VALUE_TILE_CASE(SUFFIX, NQ, 2) VALUE_TILE_CASE(SUFFIX, NQ, 3) VALUE_TILE_CASE(SUFFIX, NQ, 4)
#else
#define VALUE_TILE_CASES(SUFFIX, NQ) VALUE_TILE_CASE(SUFFIX, NQ, 1) VALUE_TILE_CASE(SUFFIX, NQ, 2)
#endif
#define DEFINE_VALUE_TILE_ANY(SUFFIX, KV_T)                                                   \
    static void value_tile_any_##SUFFIX(const KV_T *values, int64_t count, int64_t head_dim,  \
                                        const float *w, int64_t stride, float *acc,           \
                                        const float *factor, int nq, int nc,                  \
                                        const KV_T *ahead) {                                  \
        switch (nq * 8 + nc) {                                                                \
            VALUE_TILE_CASES(SUFFIX, 1)                                                       \
            VALUE_TILE_CASES(SUFFIX, 2) VALUE_TILE_CASES(SUFFIX, 3) VALUE_TILE_CASES(SUFFIX, 4) \
        }                                                                                     \
    }
DEFINE_VALUE_TILE_ANY(f32, float)
DEFINE_VALUE_TILE_ANY(bf16, uint16_t)

/* One page of one (row, head), vector loops: head_dim is a multiple of LANES. Scores come
 * LANES keys at a time (a partial last block is copied, zero-padded, into `tail`), then the
 * online softmax, then the values tile by tile. `next_keys` / `next_values` (or NULL) are
 * the next page's: their rows are prefetched a key block (or a value row) at a time through
 * this page's math, so that the memory stays busy while it runs. */
#define DEFINE_PAGE_VECTOR(NAME, SUFFIX, KV_T)                                                 \
    static void NAME(const float *restrict qh, const KV_T *restrict keys,                     \
                     const KV_T *restrict values, int64_t count, int64_t group,               \
                     int64_t head_dim, float scale, int64_t stride, float *restrict scores,   \
                     const span_state *state, KV_T *tail, const KV_T *next_keys,              \
                     const KV_T *next_values) {                                               \
        const int64_t row_bytes = head_dim * (int64_t)sizeof(KV_T);                           \
        for (int64_t t0 = 0; t0 < count; t0 += LANES) {                                       \
            const int64_t valid = count - t0 < LANES ? count - t0 : LANES;                    \
            const KV_T *ahead = next_keys != NULL ? next_keys + t0 * head_dim : NULL;         \
            const int64_t ahead_lines = ahead != NULL ? lines_of(valid, row_bytes) : 0;       \
            const KV_T *block = keys + t0 * head_dim;                                         \
            if (valid < LANES) {                                                              \
                memcpy(tail, block, valid * row_bytes);                                       \
                memset(tail + valid * head_dim, 0, (LANES - valid) * row_bytes);              \
                block = tail;                                                                 \
            }                                                                                 \
            key_block_any_##SUFFIX(qh, block, valid, group, head_dim, scale, stride,          \
                                   scores + t0, ahead, ahead_lines);                          \
        }                                                                                     \
        for (int64_t q0 = 0; q0 < group; q0 += TILE_QUERIES) {                                \
            const int nq = group - q0 < TILE_QUERIES ? (int)(group - q0) : TILE_QUERIES;      \
            float factor[TILE_QUERIES];                                                       \
            for (int qi = 0; qi < nq; ++qi)                                                   \
                factor[qi] = softmax_scores(state, q0 + qi, scores + (q0 + qi) * stride, count); \
            for (int64_t c0 = 0; c0 < head_dim; c0 += TILE_CHUNKS * LANES) {                  \
                const int64_t left = (head_dim - c0) / LANES;                                 \
                const int nc = left < TILE_CHUNKS ? (int)left : TILE_CHUNKS;                  \
                value_tile_any_##SUFFIX(values + c0, count, head_dim, scores + q0 * stride,   \
                                        stride, state->acc + q0 * head_dim + c0, factor, nq,  \
                                        nc, q0 == 0 && c0 == 0 ? next_values : NULL);         \
            }                                                                                 \
        }                                                                                     \
    }

/* The same page, scalar loops (any head_dim). */
#define DEFINE_PAGE_SCALAR(NAME, KV_T, LOAD)                                                   \
    static inline void NAME(const float *restrict qh, const KV_T *restrict keys,              \
                            const KV_T *restrict values, int64_t count, int64_t group,        \
                            int64_t head_dim, float scale, int64_t stride,                  \
                            float *restrict scores, const span_state *state) {                \
        const int64_t padded = (count + LANES - 1) / LANES * LANES;                           \
        for (int64_t gi = 0; gi < group; ++gi) {                                              \
            float *s = scores + gi * stride;                                  \
            for (int64_t t = 0; t < count; ++t) {                                             \
                float dot = 0.0f;                                                             \
                for (int64_t d = 0; d < head_dim; ++d)                                        \
                    dot += qh[gi * head_dim + d] * LOAD(keys[t * head_dim + d]);              \
                s[t] = dot * scale;                                                           \
            }                                                                                 \
            for (int64_t t = count; t < padded; ++t) s[t] = -INFINITY;                        \
            softmax_page(state, gi, s, count, head_dim);                                      \
        }                                                                                     \
        for (int64_t t = 0; t < count; ++t)                                                   \
            for (int64_t gi = 0; gi < group; ++gi) {                                          \
                const float w = scores[gi * stride + t];                      \
                for (int64_t d = 0; d < head_dim; ++d)                                        \
                    state->acc[gi * head_dim + d] += w * LOAD(values[t * head_dim + d]);      \
            }                                                                                 \
    }

#define SCALAR_F32(x) (x)
#define SCALAR_BF16(x) bf16_to_float(x)

DEFINE_PAGE_VECTOR(page_vector_f32, f32, float)
DEFINE_PAGE_VECTOR(page_vector_bf16, bf16, uint16_t)
DEFINE_PAGE_SCALAR(page_scalar_f32, float, SCALAR_F32)
DEFINE_PAGE_SCALAR(page_scalar_bf16, uint16_t, SCALAR_BF16)

/* Scores per query in the page buffer: a page's keys padded to a multiple of LANES. */
static inline int64_t score_stride(int64_t block_size) {
    return (block_size + LANES - 1) / LANES * LANES;
}

/* Reads `bytes` of a page's keys and values line by line, the two streams side by side,
 * prefetching the next page's lines at the same offsets up to `ahead` bytes (NULL: none),
 * into L1 or, `into_l2`, into L2; returns the OR of what it read.
 * Measured: the two streams at once read ~20% faster than keys then values; prefetches
 * issued line by line through the reads, not in one burst before them (Zen 4, batch 32:
 * a burst made the walk without math 13.0 -> 15.2 ms). */
static inline __attribute__((always_inline)) vint read_page(const void *keys,
                                                            const void *values,
                                                            const void *next_keys,
                                                            const void *next_values,
                                                            int64_t bytes, int64_t ahead,
                                                            int into_l2) {
    const char *k = (const char *)keys, *v = (const char *)values;
    vint sink = exp_splat_i(0);
    for (int64_t b = 0; b + (int64_t)sizeof(vint) <= bytes; b += (int64_t)sizeof(vint)) {
        vint x, y;
        memcpy(&x, k + b, sizeof(x));
        memcpy(&y, v + b, sizeof(y));
        sink |= x | y;
        if (next_keys != NULL && b % 64 == 0 && b < ahead) {
            if (into_l2) {
                __builtin_prefetch((const char *)next_keys + b, 0, 2);
                __builtin_prefetch((const char *)next_values + b, 0, 2);
            } else {
                __builtin_prefetch((const char *)next_keys + b);
                __builtin_prefetch((const char *)next_values + b);
            }
        }
    }
    return sink;
}
/* read_page with its result kept: the page's math then runs from L1. Measured: the math after
 * this pass is faster than with the loads spread through it. The whole next page is
 * prefetched into L1, or (`spread`, the math prefetching it again) its first three quarters
 * into L2: measured on Zen 4, median of 40 rounds, 1.21x against 1.26x with all of it. */
static void touch_page(const void *keys, const void *values, const void *next_keys,
                       const void *next_values, int64_t bytes, int spread) {
    const vint sink =
        spread ? read_page(keys, values, next_keys, next_values, bytes, bytes * 3 / 4, 1)
               : read_page(keys, values, next_keys, next_values, bytes, bytes, 0);
    __asm__ volatile("" : : "x"(sink));
}

/* Keys [first, last) of one row's kv heads [h0, h1), page by page, into
 * states[(h - h0) * apart].
 * Each head's page is read by touch_page, then scored and accumulated from L1. The next
 * page's lines are prefetched during the read pass: into L1 without `spread`; with it, most
 * of them into L2, and all once more through the vector math (which is faster depends on
 * the CPU: warmup times both, `paged_inplace_spread`). Measured on Zen 4, batch 32, 471 MB
 * of K/V, medians of 20-40 rounds alternating with the read probe: 1.31-1.34x with the
 * prefetches through the math only, 1.21-1.27x with the read pass prefetching the whole
 * next page as well, 1.16-1.22x with three quarters of it (the walk without math:
 * 1.10-1.16x); the math no longer prefetching what the read pass did was 1.32x again, as if
 * some prefetches were dropped. */
#define DEFINE_SPAN(NAME, KV_T, PAGE_VECTOR, PAGE_SCALAR)                                      \
    static void NAME(const float *q_row, const KV_T *k_cache, const KV_T *v_cache,            \
                     const int64_t *row_pages, int64_t first, int64_t last, int64_t kv,       \
                     int64_t h0, int64_t h1, int64_t group, int64_t head_dim,                 \
                     int64_t block_size, float scale, float *scores,                          \
                     const span_state *states, int64_t apart, int mode) {                     \
        const int vector = head_dim % LANES == 0;                                             \
        const int through_math = vector && (mode & ATTENTION_SPREAD);                         \
        const int64_t stride = score_stride(block_size);                                      \
        const int64_t head_floats = block_size * head_dim, pair_dim = group * head_dim;       \
        KV_T *tail = (KV_T *)(scores + group * stride);                                       \
        for (int64_t start = first; start < last;) {                                          \
            const int64_t slot = start / block_size, offset = start % block_size;             \
            const int64_t room = block_size - offset;                                         \
            const int64_t count = room < last - start ? room : last - start;                  \
            const int64_t page = row_pages[slot];                                             \
            start += count;                                                                   \
            if (page < 0) continue;                                                           \
            const int64_t next = start < last ? row_pages[slot + 1] : -1;                     \
            for (int64_t h = h0; h < h1; ++h) {                                               \
                const int64_t base = (page * kv + h) * head_floats + offset * head_dim;       \
                const KV_T *next_keys = NULL, *next_values = NULL;                            \
                if (next >= 0) {                                                              \
                    next_keys = k_cache + (next * kv + h) * head_floats;                      \
                    next_values = v_cache + (next * kv + h) * head_floats;                    \
                }                                                                             \
                const float *qh = q_row + h * pair_dim;                                       \
                touch_page(k_cache + base, v_cache + base, next_keys, next_values,            \
                           count * head_dim * (int64_t)sizeof(KV_T), through_math);           \
                if (mode & ATTENTION_READS_ONLY) continue;                                    \
                if (vector)                                                                   \
                    PAGE_VECTOR(qh, k_cache + base, v_cache + base, count, group, head_dim,   \
                                scale, stride, scores, &states[(h - h0) * apart], tail,       \
                                through_math ? next_keys : NULL,                              \
                                through_math ? next_values : NULL);                           \
                else                                                                          \
                    PAGE_SCALAR(qh, k_cache + base, v_cache + base, count, group, head_dim,   \
                                scale, stride, scores, &states[(h - h0) * apart]);            \
            }                                                                                 \
        }                                                                                     \
    }

DEFINE_SPAN(attend_span_f32, float, page_vector_f32, page_scalar_f32)
DEFINE_SPAN(attend_span_bf16, uint16_t, page_vector_bf16, page_scalar_bf16)

/* Spans per row: 1 unless the rows leave threads idle; then enough that every thread gets
 * ITEMS_PER_THREAD items, each span at least one page long. */
static int64_t spans_per_row(int64_t rows, int64_t longest, int64_t block_size, int threads) {
    const int64_t wanted = (int64_t)threads * ITEMS_PER_THREAD;
    if (threads <= 1 || rows <= 0 || rows >= wanted) return 1;
    int64_t spans = (wanted + rows - 1) / rows;
    const int64_t pages = (longest + block_size - 1) / block_size;
    if (spans > pages) spans = pages;
    return spans < 1 ? 1 : spans;
}

/* Rows by decreasing key count (stable): handed out longest first, the last items are the
 * shortest, so the threads finish close together. */
static void longest_first(const int64_t *n_keys, int64_t batch, int64_t *order) {
    for (int64_t i = 0; i < batch; ++i) {
        int64_t j = i;
        for (; j > 0 && n_keys[order[j - 1]] < n_keys[i]; --j) order[j] = order[j - 1];
        order[j] = i;
    }
}

/* Output of one (row, head) from its spans' states: rescale to the common maximum, add,
 * normalise (a row without keys gets zeros). */
static void merge_spans(const span_state *states, int64_t spans, int64_t group,
                        int64_t head_dim, float *out) {
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int64_t gi = 0; gi < group; ++gi) {
        float top = -INFINITY, total = 0.0f;
        for (int64_t part = 0; part < spans; ++part)
            top = states[part].top[gi] > top ? states[part].top[gi] : top;
        if (top == -INFINITY) continue;
        float *og = out + gi * head_dim;
        for (int64_t part = 0; part < spans; ++part) {
            const span_state s = states[part];
            if (s.top[gi] == -INFINITY) continue;
            const float factor = exp_nonpositive(s.top[gi] - top);
            total += s.total[gi] * factor;
            for (int64_t d = 0; d < head_dim; ++d) og[d] += s.acc[gi * head_dim + d] * factor;
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < head_dim; ++d) og[d] *= inv;
    }
}

/* Where one step's work items keep their order and states: the rows longest first,
 * [rows, kv, spans] states and, when rows are split into spans, their floats until the
 * merge. One block of memory, laid out by `team_layout`. */
typedef struct {
    int64_t *order;
    span_state *states;
    float *kept;
} team_memory;

static team_memory team_layout(void *memory, int64_t batch, int64_t kv, int64_t spans) {
    char *at = (char *)memory;
    team_memory m;
    m.order = (int64_t *)at;
    at += sizeof(int64_t) * (batch > 0 ? batch : 1);
    m.states = (span_state *)at;
    at += sizeof(span_state) * (batch * kv * spans + 1);
    at += (64 - (uintptr_t)at % 64) % 64; /* the kept states start on a line */
    m.kept = spans > 1 ? (float *)at : NULL;
    return m;
}

/* Bytes of `team_layout`'s memory (scratch_alloc's alignment suffices for each part). */
int64_t paged_attention_team_bytes(int64_t batch, int64_t kv, int64_t group, int64_t head_dim,
                                   int64_t spans) {
    int64_t bytes = sizeof(int64_t) * (batch > 0 ? batch : 1) +
                    sizeof(span_state) * (batch * kv * spans + 1);
    if (spans > 1) bytes += 64 + sizeof(float) * state_floats(group, head_dim) * batch * kv * spans;
    return bytes;
}

/* Key spans per row for `threads` (1 unless rows are too few to keep every thread busy). */
int64_t paged_attention_spans(int64_t batch, int64_t longest, int64_t block_size, int threads) {
    return spans_per_row(batch, longest, block_size, threads);
}

/* Orders the rows in `memory` (once per step: every layer's call reuses it). */
void paged_attention_team_prepare(void *memory, const int64_t *n_keys, int64_t batch,
                                  int64_t kv, int64_t spans) {
    longest_first(n_keys, batch, team_layout(memory, batch, kv, spans).order);
}

/* One step's attention, run by every thread of the calling OpenMP team (orphaned worksharing
 * loops: the standalone kernel opens its own team; the fused decode stack calls it from
 * inside its one). Work items are (row, key span) over all KV heads, longest rows first;
 * split rows are merged after the items. q rows `q_stride` floats apart (`[kv, g, hd]` at
 * the start of each), out `[batch, kv, g, hd]`; `mode`: ATTENTION_* bits. Sets *failed when
 * an item's scratch cannot be allocated. */
#define DEFINE_TEAM(NAME, SPAN, KV_T)                                                          \
    void NAME(void *memory, const float *q, int64_t q_stride, const KV_T *k_cache,            \
              const KV_T *v_cache, const int64_t *pages, const int64_t *n_keys, float *out,   \
              int64_t batch, int64_t kv, int64_t group, int64_t head_dim, int64_t block_size, \
              int64_t width, float scale, int64_t spans, int mode, int *failed) {             \
        const team_memory m = team_layout(memory, batch, kv, spans);         \
        const int64_t pair_dim = group * head_dim, per_state = state_floats(group, head_dim); \
        /* Scratch: scores [g, stride], a padded key block [LANES, hd], kv states. */         \
        const int64_t per_item =                                                              \
            group * score_stride(block_size) + LANES * head_dim + kv * per_state;             \
        _Pragma("omp for schedule(dynamic, 1)")                                               \
        for (int64_t item = 0; item < batch * spans; ++item) {                                \
            float stack[STACK_FLOATS] __attribute__((aligned(64)));                           \
            float *scratch = per_item <= STACK_FLOATS ? stack                                 \
                                                      : (float *)scratch_alloc(sizeof(float) * per_item); \
            if (scratch == NULL) {                                                            \
                _Pragma("omp atomic write") *failed = 1;                                      \
                continue;                                                                     \
            }                                                                                 \
            const int64_t b = m.order[item / spans], part = item % spans;                     \
            const int64_t keys = n_keys[b] > 0 ? n_keys[b] : 0;                               \
            const int64_t per_span = ((keys + block_size - 1) / block_size + spans - 1) / spans; \
            const int64_t first = part * per_span * block_size;                               \
            const int64_t last = (part + 1) * per_span * block_size;                          \
            span_state *row_states = m.states + b * kv * spans + part;                        \
            for (int64_t h = 0; h < kv; ++h) {                                                \
                const int64_t at = (b * kv + h) * spans + part;                               \
                float *buffer = m.kept != NULL ? m.kept + at * per_state                      \
                                               : scratch + per_item - (kv - h) * per_state;   \
                row_states[h * spans] = clear_state(buffer, group, head_dim);                 \
            }                                                                                 \
            SPAN(q + b * q_stride, k_cache, v_cache, pages + b * width,                       \
                 first < keys ? first : keys, last < keys ? last : keys, kv, 0, kv, group,    \
                 head_dim, block_size, scale, scratch, row_states, spans, mode);              \
            if (m.kept == NULL)                                                               \
                for (int64_t h = 0; h < kv; ++h)                                              \
                    merge_spans(&row_states[h], 1, group, head_dim,                           \
                                out + (b * kv + h) * pair_dim);                               \
            if (scratch != stack) free(scratch);                                              \
        }                                                                                     \
        if (m.kept != NULL && !*failed) { /* after the loop's barrier: one answer for all */ \
            _Pragma("omp for schedule(static)")                                               \
            for (int64_t pair = 0; pair < batch * kv; ++pair)                                 \
                merge_spans(m.states + pair * spans, spans, group, head_dim,                  \
                            out + pair * pair_dim);                                           \
        }                                                                                     \
    }

DEFINE_TEAM(paged_attention_team_f32, attend_span_f32, float)
DEFINE_TEAM(paged_attention_team_bf16, attend_span_bf16, uint16_t)

/* Returns 0, or 1 when scratch memory cannot be allocated. `mode`: ATTENTION_* bits. */
#define DEFINE_KERNEL(NAME, TEAM, KV_T)                                                        \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *pages,  \
             const int64_t *n_keys, float *out, int64_t batch, int64_t kv, int64_t group,     \
             int64_t head_dim, int64_t block_size, int64_t width, float scale,                \
             int n_threads, int mode) {                                                       \
        int64_t longest = 0;                                                                  \
        for (int64_t b = 0; b < batch; ++b) longest = n_keys[b] > longest ? n_keys[b] : longest; \
        const int64_t spans = spans_per_row(batch, longest, block_size, n_threads);           \
        void *memory = scratch_alloc((size_t)paged_attention_team_bytes(batch, kv, group, head_dim, spans)); \
        if (memory == NULL) return 1;                                                         \
        paged_attention_team_prepare(memory, n_keys, batch, kv, spans);      \
        int failed = 0;                                                                       \
        _Pragma("omp parallel num_threads(n_threads)")                                        \
        TEAM(memory, q, kv * group * head_dim, k_cache, v_cache, pages, n_keys, out, batch,   \
             kv, group, head_dim, block_size, width, scale, spans, mode, &failed);            \
        free(memory);                                                                         \
        return failed;                                                                        \
    }

DEFINE_KERNEL(paged_decode_attention_f32, paged_attention_team_f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, paged_attention_team_bf16, uint16_t)

/* The attention's memory side alone: the pages of every row read as the kernel reads them
 * (rows longest first, shared dynamically by the threads; per page and kv head, the keys and
 * values side by side, the whole next page prefetched into L2: what the spread placement's
 * read pass and math prefetch between them), without the math. Benchmarks
 * time it beside the kernel: the walk against the read-rate floor is the cost of the access
 * pattern, the kernel against the walk the math that does not hide under the reads.
 * Returns the OR of every byte read (which keeps the reads, and tells tests which bytes
 * were read), or -1 when scratch memory cannot be allocated. */
int paged_kv_walk(const void *k_cache, const void *v_cache, int64_t element_bytes,
                  const int64_t *pages, const int64_t *n_keys, int64_t batch, int64_t kv,
                  int64_t head_dim, int64_t block_size, int64_t width, int n_threads) {
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * (batch > 0 ? batch : 1));
    if (order == NULL) return -1;
    longest_first(n_keys, batch, order);
    const int64_t row_bytes = head_dim * element_bytes, head_bytes = block_size * row_bytes;
    const char *k_base = (const char *)k_cache, *v_base = (const char *)v_cache;
    unsigned char seen = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) reduction(| : seen)
    for (int64_t item = 0; item < batch; ++item) {
        const int64_t b = order[item], keys = n_keys[b] > 0 ? n_keys[b] : 0;
        const int64_t *row_pages = pages + b * width;
        vint sink = exp_splat_i(0);
        for (int64_t slot = 0; slot * block_size < keys; ++slot) {
            const int64_t page = row_pages[slot];
            if (page < 0) continue;
            const int64_t count = keys - slot * block_size < block_size ? keys - slot * block_size
                                                                        : block_size;
            const int64_t next = (slot + 1) * block_size < keys ? row_pages[slot + 1] : -1;
            const int64_t bytes = count * row_bytes;
            const int64_t whole = bytes / (int64_t)sizeof(vint) * (int64_t)sizeof(vint);
            for (int64_t h = 0; h < kv; ++h) {
                const int64_t at = (page * kv + h) * head_bytes;
                const char *next_k = next >= 0 ? k_base + (next * kv + h) * head_bytes : NULL;
                const char *next_v = next >= 0 ? v_base + (next * kv + h) * head_bytes : NULL;
                sink |= read_page(k_base + at, v_base + at, next_k, next_v, bytes, bytes, 1);
                for (int64_t tail = whole; tail < bytes; ++tail)
                    seen |= (unsigned char)(k_base[at + tail] | v_base[at + tail]);
            }
        }
        unsigned char lanes[sizeof(vint)];
        memcpy(lanes, &sink, sizeof(lanes));
        for (size_t i = 0; i < sizeof(lanes); ++i) seen |= lanes[i];
    }
    free(order);
    return seen;
}
