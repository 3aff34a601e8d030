/* Decode attention that reads a paged K/V cache in place (no gather into a workspace).
 *
 * One query token per row, grouped-query heads folded: q and out are [B, kv, g, hd] float32.
 * The caches are [num_blocks, kv, block_size, hd] (float32 or bfloat16 stored as uint16);
 * row b attends to its first n_keys[b] positions, position t living on page pages[b, t / bs]
 * at offset t % bs (a page of -1 is unmapped: its keys are masked out).
 *
 * Why it is shaped this way: a batch-32 decode step reads about as many K/V bytes as weight
 * bytes, so attention must run at the memory's read rate, not at the rate of scalar code.
 * - Work items are (row, kv head, key span) triples handed out dynamically to the OpenMP
 *   threads: long rows do not leave a thread idle, and a preempted thread's share is taken
 *   by the others. A row is split into spans (flash-decoding) only when rows x heads are too
 *   few to keep every thread busy; the spans are merged at the end.
 * - Each item walks its pages once with an online softmax: a page's keys (contiguous
 *   [bs, hd] for one head) are dotted with the head's g queries, the running maximum and sum
 *   are updated, and the same page's values are accumulated into a [g, hd] state on the
 *   stack. Every key and value is read once per step; nothing grows with the context.
 * - The inner loops use GCC/clang vector extensions (16 lanes with AVX-512, else 8) and an
 *   exp without libm, so they vectorise without -ffast-math; the next page is prefetched
 *   while the current one is processed. Head sizes that are not a multiple of the lane count
 *   take a scalar loop with the same arithmetic.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Floats of per-item scratch (scores and state) kept on the stack; larger heads malloc. */
#define STACK_FLOATS 8192
/* Work items per thread below which rows are split into key spans. */
#define ITEMS_PER_THREAD 4

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));
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

static inline vfloat splat(float x) { return x - (vfloat){0}; }

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

static inline float hmax(vfloat v) {
    float lanes[LANES];
    memcpy(lanes, &v, sizeof(v));
    float out = lanes[0];
    for (int i = 1; i < LANES; ++i) out = lanes[i] > out ? lanes[i] : out;
    return out;
}

/* e^x for x <= 0 (scores minus their running maximum), relative error below 2e-7; 0 below
 * -87 (so -inf gives 0). Cody-Waite reduction and Cephes' polynomial, no libm. */
#define EXP_BODY(FLOAT, INT, SPLAT_F, SPLAT_I, SELECT)                                          \
    const FLOAT shifter = SPLAT_F(12582912.0f); /* 1.5 * 2^23: adding it rounds */            \
    const FLOAT low = SPLAT_F(-87.0f);                                                         \
    const FLOAT clamped = SELECT(x < low, low, x);                                             \
    const FLOAT shifted = clamped * SPLAT_F(1.44269504f) + shifter;                            \
    const FLOAT n = shifted - shifter;                                                         \
    const FLOAT r = (clamped - n * SPLAT_F(0.693145752f)) - n * SPLAT_F(1.42860677e-6f);       \
    FLOAT p = SPLAT_F(1.98756912e-4f);                                                         \
    p = p * r + SPLAT_F(1.39819994e-3f);                                                       \
    p = p * r + SPLAT_F(8.33345205e-3f);                                                       \
    p = p * r + SPLAT_F(4.16657962e-2f);                                                       \
    p = p * r + SPLAT_F(1.66666672e-1f);                                                       \
    p = p * r + SPLAT_F(5.0e-1f);                                                              \
    p = p * r * r + r + SPLAT_F(1.0f);                                                         \
    INT bits;                                                                                  \
    memcpy(&bits, &shifted, sizeof(bits));                                                     \
    INT scale_bits = (bits - SPLAT_I(0x4B400000)) * SPLAT_I(1 << 23) + SPLAT_I(0x3F800000);    \
    FLOAT scale;                                                                               \
    memcpy(&scale, &scale_bits, sizeof(scale));                                                \
    return SELECT(x < low, SPLAT_F(0.0f), p * scale);

#define SCALAR_SELECT(mask, a, b) ((mask) ? (a) : (b))
#define SCALAR_SPLAT(x) (x)
static inline float exp_nonpositive(float x) {
    EXP_BODY(float, int32_t, SCALAR_SPLAT, SCALAR_SPLAT, SCALAR_SELECT)
}

static inline vint splat_i(int32_t x) { return x - (vint){0}; }
static inline vfloat vselect(vint mask, vfloat a, vfloat b) {
    vint ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    vint out = (ai & mask) | (bi & ~mask);
    vfloat f;
    memcpy(&f, &out, sizeof(f));
    return f;
}
static inline vfloat vexp_nonpositive(vfloat x) { EXP_BODY(vfloat, vint, splat, splat_i, vselect) }

/* Online-softmax state of one work item: running maximum and sum per query, and the
 * unnormalised output [g, hd], in `state_floats` floats of someone's buffer. */
typedef struct {
    float *top;
    float *total;
    float *acc;
} span_state;

static inline int64_t state_floats(int64_t group, int64_t head_dim) {
    return group * (head_dim + 2);
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
 * its running maximum (rescaling the state), turn the scores into weights, add their sum. */
static inline void softmax_page(const span_state *state, int64_t gi, float *s, int64_t count,
                                int64_t head_dim) {
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    vfloat top_v = load_f32(s);
    for (int64_t t = LANES; t < padded; t += LANES) {
        const vfloat x = load_f32(s + t);
        top_v = vselect(x > top_v, x, top_v);
    }
    const float top = hmax(top_v), old = state->top[gi];
    if (top > old) {
        const float factor = exp_nonpositive(old - top);
        float *acc = state->acc + gi * head_dim;
        state->total[gi] *= factor;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= factor;
        state->top[gi] = top;
    }
    const vfloat current = splat(state->top[gi]);
    vfloat sum = splat(0.0f);
    for (int64_t t = 0; t < padded; t += LANES) {
        const vfloat w = vexp_nonpositive(load_f32(s + t) - current);
        memcpy(s + t, &w, sizeof(w));
        sum += w;
    }
    state->total[gi] += hsum(sum);
}

/* One page of one (row, head), vector loops: head_dim is a multiple of LANES. `next_keys` /
 * `next_values` (or NULL) are the next page's, prefetched row by row. */
#define DEFINE_PAGE_VECTOR(NAME, KV_T, LOAD)                                                   \
    static inline void NAME(const float *restrict qh, const KV_T *restrict keys,              \
                            const KV_T *restrict values, const KV_T *next_keys,               \
                            const KV_T *next_values, int64_t count, int64_t group,            \
                            int64_t head_dim, float scale, int64_t stride,                  \
                            float *restrict scores, const span_state *state) {                \
        const int64_t padded = (count + LANES - 1) / LANES * LANES;                           \
        const int64_t chunks = head_dim / LANES;                                              \
        const int64_t row_bytes = head_dim * (int64_t)sizeof(KV_T);                           \
        for (int64_t t = 0; t < count; ++t) {                                                 \
            const KV_T *kt = keys + t * head_dim;                                             \
            if (next_keys != NULL)                                                            \
                for (int64_t b = 0; b < row_bytes; b += 64)                                   \
                    __builtin_prefetch((const char *)(next_keys + t * head_dim) + b);         \
            for (int64_t gi = 0; gi < group; ++gi) {                                          \
                const float *qg = qh + gi * head_dim;                                         \
                vfloat a0 = splat(0.0f), a1 = splat(0.0f);                                    \
                int64_t c = 0;                                                                \
                for (; c + 1 < chunks; c += 2) {                                              \
                    a0 += load_f32(qg + c * LANES) * LOAD(kt + c * LANES);                    \
                    a1 += load_f32(qg + (c + 1) * LANES) * LOAD(kt + (c + 1) * LANES);        \
                }                                                                             \
                if (c < chunks) a0 += load_f32(qg + c * LANES) * LOAD(kt + c * LANES);        \
                scores[gi * stride + t] = hsum(a0 + a1) * scale;              \
            }                                                                                 \
        }                                                                                     \
        for (int64_t gi = 0; gi < group; ++gi) {                                              \
            float *s = scores + gi * stride;                                  \
            for (int64_t t = count; t < padded; ++t) s[t] = -INFINITY;                        \
            softmax_page(state, gi, s, count, head_dim);                                      \
        }                                                                                     \
        for (int64_t t = 0; t < count; ++t) {                                                 \
            const KV_T *vt = values + t * head_dim;                                           \
            if (next_values != NULL)                                                          \
                for (int64_t b = 0; b < row_bytes; b += 64)                                   \
                    __builtin_prefetch((const char *)(next_values + t * head_dim) + b);       \
            for (int64_t c = 0; c < chunks; ++c) {                                            \
                const vfloat v = LOAD(vt + c * LANES);                                        \
                for (int64_t gi = 0; gi < group; ++gi) {                                      \
                    float *acc = state->acc + gi * head_dim + c * LANES;                      \
                    const vfloat w = splat(scores[gi * stride + t]);          \
                    const vfloat sum = load_f32(acc) + w * v;                                 \
                    memcpy(acc, &sum, sizeof(sum));                                           \
                }                                                                             \
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

DEFINE_PAGE_VECTOR(page_vector_f32, float, load_f32)
DEFINE_PAGE_VECTOR(page_vector_bf16, uint16_t, load_bf16)
DEFINE_PAGE_SCALAR(page_scalar_f32, float, SCALAR_F32)
DEFINE_PAGE_SCALAR(page_scalar_bf16, uint16_t, SCALAR_BF16)

/* Scores per query in the page buffer: a page's keys padded to a multiple of LANES. */
static inline int64_t score_stride(int64_t block_size) {
    return (block_size + LANES - 1) / LANES * LANES;
}

/* Keys [first, last) of one row's kv head h, page by page, into `state` (cleared). */
#define DEFINE_SPAN(NAME, KV_T, PAGE_VECTOR, PAGE_SCALAR)                                      \
    static void NAME(const float *qh, const KV_T *k_cache, const KV_T *v_cache,               \
                     const int64_t *row_pages, int64_t first, int64_t last, int64_t kv,       \
                     int64_t h, int64_t group, int64_t head_dim, int64_t block_size,          \
                     float scale, float *scores, const span_state *state) {                   \
        const int vector = head_dim % LANES == 0;                                             \
        const int64_t stride = score_stride(block_size);                                      \
        for (int64_t start = first; start < last;) {                                          \
            const int64_t slot = start / block_size, offset = start % block_size;             \
            const int64_t room = block_size - offset;                                         \
            const int64_t count = room < last - start ? room : last - start;                  \
            const int64_t page = row_pages[slot];                                             \
            start += count;                                                                   \
            if (page < 0) continue;                                                           \
            const int64_t base = ((page * kv + h) * block_size + offset) * head_dim;          \
            const KV_T *next_keys = NULL, *next_values = NULL;                                \
            if (start < last && row_pages[slot + 1] >= 0) {                                   \
                const int64_t next = (row_pages[slot + 1] * kv + h) * block_size * head_dim;  \
                next_keys = k_cache + next;                                                   \
                next_values = v_cache + next;                                                 \
            }                                                                                 \
            if (vector)                                                                       \
                PAGE_VECTOR(qh, k_cache + base, v_cache + base, next_keys, next_values, count, \
                            group, head_dim, scale, stride, scores, state);                   \
            else                                                                              \
                PAGE_SCALAR(qh, k_cache + base, v_cache + base, count, group, head_dim, scale, \
                            stride, scores, state);                                           \
        }                                                                                     \
    }

DEFINE_SPAN(attend_span_f32, float, page_vector_f32, page_scalar_f32)
DEFINE_SPAN(attend_span_bf16, uint16_t, page_vector_bf16, page_scalar_bf16)

/* Spans per (row, head): 1 unless rows x heads leave threads idle; then enough that every
 * thread gets ITEMS_PER_THREAD items, each span at least one page long. */
static int64_t spans_per_row(int64_t pairs, int64_t longest, int64_t block_size, int threads) {
    const int64_t wanted = (int64_t)threads * ITEMS_PER_THREAD;
    if (threads <= 1 || pairs <= 0 || pairs >= wanted) return 1;
    int64_t spans = (wanted + pairs - 1) / pairs;
    const int64_t pages = (longest + block_size - 1) / block_size;
    if (spans > pages) spans = pages;
    return spans < 1 ? 1 : spans;
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

/* Returns 0, or 1 when scratch memory cannot be allocated. */
#define DEFINE_KERNEL(NAME, SPAN, KV_T)                                                        \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *pages,  \
             const int64_t *n_keys, float *out, int64_t batch, int64_t kv, int64_t group,     \
             int64_t head_dim, int64_t block_size, int64_t width, float scale,                \
             int n_threads) {                                                                 \
        int64_t longest = 0;                                                                  \
        for (int64_t b = 0; b < batch; ++b) longest = n_keys[b] > longest ? n_keys[b] : longest; \
        const int64_t pairs = batch * kv, pair_dim = group * head_dim;                        \
        const int64_t spans = spans_per_row(pairs, longest, block_size, n_threads);           \
        const int64_t per_state = state_floats(group, head_dim);                              \
        const int64_t per_item = group * score_stride(block_size) + per_state;                \
        /* Split rows keep every span's state until the merge: [pairs * spans] states. */     \
        float *kept = NULL;                                                                   \
        span_state *states = NULL;                                                            \
        if (spans > 1) {                                                                      \
            kept = (float *)malloc(sizeof(float) * per_state * pairs * spans);                \
            states = (span_state *)malloc(sizeof(span_state) * pairs * spans);                \
            if (kept == NULL || states == NULL) {                                             \
                free(kept);                                                                   \
                free(states);                                                                 \
                return 1;                                                                     \
            }                                                                                 \
        }                                                                                     \
        int failed = 0;                                                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(n_threads)")               \
        for (int64_t item = 0; item < pairs * spans; ++item) {                                \
            float stack[STACK_FLOATS] __attribute__((aligned(64)));                           \
            float *scratch = per_item <= STACK_FLOATS ? stack                                 \
                                                      : (float *)malloc(sizeof(float) * per_item); \
            if (scratch == NULL) {                                                            \
                failed = 1;                                                                   \
                continue;                                                                     \
            }                                                                                 \
            const int64_t pair = item / spans, part = item % spans;                           \
            const int64_t b = pair / kv, h = pair % kv;                                       \
            const int64_t keys = n_keys[b] > 0 ? n_keys[b] : 0;                               \
            const int64_t per_span = ((keys + block_size - 1) / block_size + spans - 1) / spans; \
            const int64_t first = part * per_span * block_size;                               \
            const int64_t last = (part + 1) * per_span * block_size;                          \
            const span_state state = clear_state(                                             \
                kept != NULL ? kept + item * per_state : scratch + per_item - per_state, group, \
                head_dim);                                                                    \
            SPAN(q + pair * pair_dim, k_cache, v_cache, pages + b * width,                    \
                 first < keys ? first : keys, last < keys ? last : keys, kv, h, group,        \
                 head_dim, block_size, scale, scratch, &state);                               \
            if (states != NULL)                                                               \
                states[item] = state;                                                         \
            else                                                                              \
                merge_spans(&state, 1, group, head_dim, out + pair * pair_dim);               \
            if (scratch != stack) free(scratch);                                              \
        }                                                                                     \
        if (states != NULL) {                                                                 \
            if (!failed) {                                                                    \
                _Pragma("omp parallel for schedule(static) num_threads(n_threads)")           \
                for (int64_t pair = 0; pair < pairs; ++pair)                                  \
                    merge_spans(states + pair * spans, spans, group, head_dim,                \
                                out + pair * pair_dim);                                       \
            }                                                                                 \
            free(kept);                                                                       \
            free(states);                                                                     \
        }                                                                                     \
        return failed;                                                                        \
    }

DEFINE_KERNEL(paged_decode_attention_f32, attend_span_f32, float)
DEFINE_KERNEL(paged_decode_attention_bf16, attend_span_bf16, uint16_t)

/* Work items for a caller that is itself an OpenMP team (the fused decode stack): the same
 * spans, items and merge as the kernels above, one call per item, so its threads share them
 * with their own worksharing loop. Float32 caches. */

int64_t paged_attention_spans(int64_t pairs, int64_t longest, int64_t block_size, int threads) {
    return spans_per_row(pairs, longest, block_size, threads);
}

/* Floats of one item's kept state, and of its page scratch (scores and a state). */
int64_t paged_attention_state_floats(int64_t group, int64_t head_dim) {
    return state_floats(group, head_dim);
}

int64_t paged_attention_scratch_floats(int64_t group, int64_t head_dim, int64_t block_size) {
    return group * score_stride(block_size) + state_floats(group, head_dim);
}

/* Span `part` of `spans` of one (row, kv head h) over its `keys` keys; qh its [g, hd] queries.
 * With one span the result goes to `out` ([g, hd]); else the state is left in `kept` for
 * `paged_attention_merge`. */
void paged_attention_item_f32(const float *qh, const float *k_cache, const float *v_cache,
                              const int64_t *row_pages, int64_t keys, int64_t kv, int64_t h,
                              int64_t group, int64_t head_dim, int64_t block_size, float scale,
                              int64_t part, int64_t spans, float *scratch, float *kept,
                              float *out) {
    keys = keys > 0 ? keys : 0;
    const int64_t per_span = ((keys + block_size - 1) / block_size + spans - 1) / spans;
    const int64_t first = part * per_span * block_size, last = (part + 1) * per_span * block_size;
    const span_state state = clear_state(
        spans > 1 ? kept : scratch + group * score_stride(block_size), group, head_dim);
    attend_span_f32(qh, k_cache, v_cache, row_pages, first < keys ? first : keys,
                    last < keys ? last : keys, kv, h, group, head_dim, block_size, scale, scratch,
                    &state);
    if (spans == 1) merge_spans(&state, 1, group, head_dim, out);
}

/* One (row, head)'s output from its `spans` kept states (consecutive in `kept`). */
void paged_attention_merge(float *kept, int64_t spans, int64_t group, int64_t head_dim,
                           float *out) {
    span_state states[spans];
    const int64_t per_state = state_floats(group, head_dim);
    for (int64_t part = 0; part < spans; ++part) {
        float *buffer = kept + part * per_state;
        states[part] = (span_state){buffer, buffer + group, buffer + 2 * group};
    }
    merge_spans(states, spans, group, head_dim, out);
}
