/* The whole decoder stack of a Llama-family decode step for a few rows, in one call.
 *
 * Why: at batch 1 a decode step streams every weight once (~14 MB a layer for SmolLM2-135M)
 * and does almost no arithmetic, yet the per-op torch path spends a third of the step on
 * ~1,000 small ops (norms, rotary, views, copies, residual adds). Here one OpenMP parallel
 * region runs every layer: the threads split each projection's output rows (each streams
 * its own contiguous stripe of the weight once) and meet at a barrier between stages:
 *
 *   RMSNorm -> QKV -> | rotary, K/V write | attention over the row's pages | O + residual |
 *   RMSNorm -> gate/up, SiLU * up -> | down + residual |
 *
 * Layouts and conventions are the model's (`models/llama`): x is float32 `[rows, dim]`, the
 * residual stream, updated in place. Per layer, `table` holds 8 addresses: attention norm
 * weight, fused QKV `[q + 2 kv, dim]`, O `[dim, q]`, MLP norm weight, fused gate/up
 * `[2 ffn, dim]`, down `[dim, ffn]`, K cache, V cache (caches `[blocks, kv, block_size, hd]`).
 * `layouts[4]` says how QKV, O, gate/up and down are stored: 0 `[out, in]`, 1 `[in, out]`.
 * Rotary is rotate-half with the model's `cos` / signed `sin` tables `[positions, head_dim]`,
 * read at the row's position (the caller checked it is inside them). Row b
 * sits at position n_keys[b] - 1, writes its K/V there (on page pages[b, pos / bs]; an
 * unmapped page, -1, is not written and its keys are masked) and attends to its first
 * n_keys[b] positions. Attention is `paged_decode_attention.c`'s own team body (rows longest
 * first, split into key spans when they are too few for the threads), run by this stack's
 * threads, so both paths share one kernel: the stack's own scalar loop had cost 1 ms of a
 * 3.5 ms batch-1 step and lost to the per-op path on long mixed contexts. With `final_norm`
 * (not NULL) the model's final RMSNorm is applied to x at the end, in the same call: what the
 * head reads. Done by torch after the call, on a cache the weight stream had just emptied, it
 * took 25-40 us of a 2.6 ms batch-1 step. With `head` (one projection's parts, the layout
 * of a `parts` entry below, and `final_norm` given) the head's product of the normed x
 * follows as one more stage into `logits` `[rows, vocab]`: a separate call had cost its
 * Python path and a second team start.
 *
 * With `parts` instead of `layouts` (the mixed stack) it is the same stack with each
 * projection given as up to 3 parts stacked by output rows (a GGUF Q4_K_M file mixes Q4_K and Q6_K inside one fused QKV), each
 * float32 or quantized blocks (`quant_blocks.h`). Per layer, `parts` holds
 * PARTS_WIDTH = 4 projections (QKV, O, gate/up, down) x 3 parts x 6 int64:
 *   {kind, block, rows, weight or qs address, scales address, mins address}
 * kind: -1 unused (skipped), 0 float32 `[rows, in]`, 1 float32 `[in, rows]`, 2 q4 / f16
 * scales, 3 q4 / f32, 4 q8 / f16, 5 q8 / f32, 6-9 the same four block kinds with int8
 * activations (`quant_blocks_i8.h`), 10-13 the same four with int16 activations (q4:
 * `quant_blocks_i16.h` below QI_PANEL_FROM_ROWS rows; q8 in blocks of 32: one row streamed
 * the same way, 2 to QI_PANEL_FROM_ROWS - 1 rows float32 activations; both on
 * `gemm_panels_i16.h` from there on). A library built without VNNI runs 6-13 with float32
 * activations, and `stack_parts_table` never writes them there. A part's rows are the
 * projection's next `rows` outputs. The layer table's 4 projection columns are unused
 * there.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp_nonpositive.h"
#include "gemm_panels.h"
#include "gemm_panels_i16.h"
#include "quant_blocks.h"
#include "quant_blocks_i8.h"
#include "scratch_alloc.h"

/* Rows from which a stage's float32 (`[out, in]`) and float-activation block products run
 * on panels (`gemm_panels.h`) instead of the few-row dot kernels. Float32: from 3 rows the dot
 * kernel's reloads of each weight tile per group of rows and its horizontal sums cost more
 * (a 4-row SmolLM2 step 19.8 -> 16.8 ms on Zen 5; at 2 rows the two tie). Blocks: the
 * streaming kernel stays ahead up to 8 rows, where a panel's dequantization is shared by too
 * few rows (Q4_1 SmolLM2 on Zen 5: 8 rows 14.9 ms streaming against 18.5 on panels, 16 rows
 * 30.8 against 22.6). Q4 blocks with int16 activations stream (`quant_blocks_i16.h`, about 4
 * instructions a block where the float kernel takes 6) up to 10 rows and run on int16 panels
 * (`gemm_panels_i16.h`, 32 products a `vpdpwssd`) from 11: the same SmolLM2 Q4_1 decode
 * steps in one process, alternating, on Zen 5, streaming against int16 panels: 8 rows 11.8
 * against 13.3 ms, 10 rows 14.9 against 15.2, 11 rows 16.7 against 16.3, 13 rows 19.1
 * against 17.6, 16 rows 21.5 against 18.3, 32 rows 38.6 against 30.5 (float panels: 35.9). */
#define PANEL_FROM_ROWS 3
#define BLOCK_PANEL_FROM_ROWS 9

enum { ATTN_NORM, WQKV, WO, MLP_NORM, W_GATE_UP, W_DOWN, K_CACHE, V_CACHE, TABLE_WIDTH };
enum { L_QKV, L_O, L_GATE_UP, L_DOWN };
enum { PART_KIND, PART_BLOCK, PART_ROWS, PART_W, PART_SCALES, PART_MINS, PART_WIDTH };
enum { MAX_PARTS = 3, PROJ_WIDTH = MAX_PARTS * PART_WIDTH, PARTS_WIDTH = 4 * PROJ_WIDTH };
/* The timed phases of a step (`native_kernels.STACK_PHASES` names them in this order). */
enum {
    PHASE_QKV,
    PHASE_ROTARY,
    PHASE_ATTENTION,
    PHASE_O,
    PHASE_GATE_UP,
    PHASE_DOWN,
    PHASE_HEAD,
    STACK_PHASES
};

/* Portable vectors (GCC/Clang vector extensions) of the native width of -march=native, as
 * `exp_nonpositive.h` defines them. */
#define LANES EXP_LANES
typedef exp_vfloat vf;

static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof(v));
    return v;
}

typedef float v4f __attribute__((vector_size(4 * sizeof(float))));

/* The sum of v's lanes: quarters added as 4-wide vectors, then the last four. */
static inline float hsum(vf v) {
    v4f quarters[LANES / 4];
    memcpy(quarters, &v, sizeof(v));
    v4f s = quarters[0];
    for (int i = 1; i < LANES / 4; ++i) s += quarters[i];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* Per-thread activation forms of a stage's input, made on first need: the form a block
 * product reads (`qb_prepare_input`; `ready` says which `QB_INPUT_*`, -1 none yet, `ld` its
 * row stride), the int8 form
 * (`qb_prepare_i8`, keyed by the weight's kind and block) and the transposed row groups of the
 * panel products (`qg_transpose`, with their scratch). */
typedef struct {
    float *xt, *xsum;
    int ready;
    int64_t ld;
    qb_i8_input i8;
    float *groups, *scratch;
    int groups_ready;
    float *i16_groups, *i16_scratch; /* int16 panel products' groups (`qi_prepare`), scratch */
    int i16_groups_ready;
} q4_input;

/* A new stage input: every form made for the last one is stale. */
static inline void new_stage(q4_input *q4) {
    q4->ready = -1, q4->i8.key = -1, q4->groups_ready = 0, q4->i16_groups_ready = 0;
}

/* The stage input as `qg_stripe` takes it (transposed once per stage and thread). */
static const float *panel_groups(const float *x, int64_t ldx, int64_t n_in, int64_t rows,
                                 q4_input *q4) {
    if (!q4->groups_ready) qg_transpose(x, ldx, n_in, 0, rows, qg_width(rows), q4->groups);
    q4->groups_ready = 1;
    return q4->groups;
}

/* out[r][k] = W[k] . x[r] for 4 consecutive weight rows and R (<= 4) input rows: every
 * weight vector is loaded once and used for all R rows (R is a constant where inlined). */
static inline __attribute__((always_inline)) void dot4(const int R, const float *w0,
                                                       int64_t n_in, const float *x,
                                                       int64_t ldx, float out[4][4]) {
    const float *w1 = w0 + n_in, *w2 = w1 + n_in, *w3 = w2 + n_in;
    vf acc[4][4];
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < 4; ++k) acc[r][k] = (vf){0};
    int64_t i = 0;
    for (; i + LANES <= n_in; i += LANES) {
        const vf a = load_vf(w0 + i), b = load_vf(w1 + i), c = load_vf(w2 + i),
                 d = load_vf(w3 + i);
        for (int r = 0; r < R; ++r) {
            const vf xv = load_vf(x + r * ldx + i);
            acc[r][0] += a * xv;
            acc[r][1] += b * xv;
            acc[r][2] += c * xv;
            acc[r][3] += d * xv;
        }
    }
    for (int r = 0; r < R; ++r) {
        const float *xr = x + r * ldx;
        float t0 = hsum(acc[r][0]), t1 = hsum(acc[r][1]), t2 = hsum(acc[r][2]),
              t3 = hsum(acc[r][3]);
        for (int64_t j = i; j < n_in; ++j) {
            t0 += w0[j] * xr[j];
            t1 += w1[j] * xr[j];
            t2 += w2[j] * xr[j];
            t3 += w3[j] * xr[j];
        }
        out[r][0] = t0;
        out[r][1] = t1;
        out[r][2] = t2;
        out[r][3] = t3;
    }
}

/* `project_out_in` over the output rows [o0, o1) of one tile, for up to 4 input rows at a
 * time (R a constant where `dot4` is inlined). */
static void project_tile(const float *w, int64_t n_in, const float *x, int64_t ldx,
                         int64_t rows, float *y, int64_t ldy, int64_t o0, int64_t o1,
                         int accumulate) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int R = rows - r0 < 4 ? (int)(rows - r0) : 4;
        const float *xr = x + r0 * ldx;
        float *yr = y + r0 * ldy;
        int64_t o = o0;
        for (; o + 4 <= o1; o += 4) {
            float out[4][4];
            const float *wo = w + o * n_in;
            switch (R) {
                case 1: dot4(1, wo, n_in, xr, ldx, out); break;
                case 2: dot4(2, wo, n_in, xr, ldx, out); break;
                case 3: dot4(3, wo, n_in, xr, ldx, out); break;
                default: dot4(4, wo, n_in, xr, ldx, out); break;
            }
            for (int r = 0; r < R; ++r)
                for (int k = 0; k < 4; ++k)
                    yr[r * ldy + o + k] = accumulate ? yr[r * ldy + o + k] + out[r][k] : out[r][k];
        }
        for (; o < o1; ++o) {
            const float *wo = w + o * n_in;
            for (int r = 0; r < R; ++r) {
                float a = 0.0f;
                for (int64_t i = 0; i < n_in; ++i) a += wo[i] * xr[r * ldx + i];
                yr[r * ldy + o] = accumulate ? yr[r * ldy + o] + a : a;
            }
        }
    }
}

/* Output rows per tile of `project_out_in`: their weights (16 x 1536 float32 = 96 KiB at
 * most here) stay in L2 while every group of 4 input rows passes over them, so a step of many
 * rows reads each weight from memory once, not once per 4 rows. */
#define OUT_TILE 16

/* y[r, o] (= or +=) sum_i W[o, i] x[r, i] for o in [o0, o1), W `[n_out, n_in]` row-major:
 * one sequential pass over the stripe's weight rows in tiles of `OUT_TILE`, each used for
 * every input row, 4 at a time. */
static void project_out_in(const float *w, int64_t n_in, const float *x, int64_t ldx,
                           int64_t rows, float *y, int64_t ldy, int64_t o0, int64_t o1,
                           int accumulate) {
    for (int64_t t0 = o0; t0 < o1; t0 += OUT_TILE) {
        const int64_t t1 = t0 + OUT_TILE < o1 ? t0 + OUT_TILE : o1;
        project_tile(w, n_in, x, ldx, rows, y, ldy, t0, t1, accumulate);
    }
}

/* The same product from W stored transposed, `[n_in, n_out]`: each input element scales a
 * contiguous chunk of W's row into the (L1-resident) outputs. */
static void project_in_out(const float *wt, int64_t n_in, int64_t n_out, const float *x,
                           int64_t ldx, int64_t rows, float *y, int64_t ldy, int64_t o0,
                           int64_t o1, int accumulate) {
    if (!accumulate)
        for (int64_t r = 0; r < rows; ++r) memset(y + r * ldy + o0, 0, sizeof(float) * (o1 - o0));
    for (int64_t i = 0; i < n_in; ++i) {
        const float *wi = wt + i * n_out;
        for (int64_t r = 0; r < rows; ++r) {
            const float xi = x[r * ldx + i];
            float *yr = y + r * ldy;
#pragma omp simd
            for (int64_t o = o0; o < o1; ++o) yr[o] += xi * wi[o];
        }
    }
}

static void project(int layout, const float *w, int64_t n_in, int64_t n_out, const float *x,
                    int64_t ldx, int64_t rows, float *y, int64_t ldy, int64_t o0, int64_t o1,
                    int accumulate, q4_input *q4) {
    if (o0 >= o1) return;
    if (layout == 0 && rows >= PANEL_FROM_ROWS)
        qg_stripe(NULL, w, n_in, panel_groups(x, ldx, n_in, rows, q4), rows, y, ldy, o0, o1,
                  accumulate, q4->scratch);
    else if (layout == 0)
        project_out_in(w, n_in, x, ldx, rows, y, ldy, o0, o1, accumulate);
    else
        project_in_out(w, n_in, n_out, x, ldx, rows, y, ldy, o0, o1, accumulate);
}


/* `project` over a projection given as parts (see the header): each part's slice of this
 * thread's output range [o0, o1) from its own weights. */
static void project_parts(const int64_t *parts, int64_t n_in, const float *x, int64_t ldx,
                          int64_t rows, float *y, int64_t ldy, int64_t o0, int64_t o1,
                          int accumulate, q4_input *q4) {
    int64_t base = 0;
    for (int p = 0; p < MAX_PARTS; ++p) {
        const int64_t *part = parts + p * PART_WIDTH;
        const int64_t kind = part[PART_KIND], n = part[PART_ROWS];
        if (kind < 0 || n <= 0) continue;
        const int64_t lo = (o0 > base ? o0 : base) - base;
        const int64_t hi = (o1 < base + n ? o1 : base + n) - base;
        if (lo < hi) {
            if (kind <= 1) {
                project((int)kind, (const float *)(intptr_t)part[PART_W], n_in, n, x, ldx, rows,
                        y + base, ldy, lo, hi, accumulate, q4);
            } else {
                const int int8 = kind >= 6 && kind <= 9, int16 = kind >= 10 && QB_Q4_I16;
                const int code = int8 ? kind - 4 : kind >= 10 ? kind - 8 : kind;
                const int is_q4 = code <= 3;
                const qb_matrix m = {is_q4 ? QB_Q4 : QB_Q8,
                                     (code & 1) == 0,
                                     part[PART_BLOCK],
                                     n_in,
                                     (const void *)(intptr_t)part[PART_W],
                                     (const void *)(intptr_t)part[PART_SCALES],
                                     (const void *)(intptr_t)part[PART_MINS]};
#if QB_I8_AVAILABLE
                if (int8) {
                    if (q4->i8.key != m.kind * 1024 + m.block)
                        qb_prepare_i8(x, ldx, rows, n_in, m.kind, m.block, &q4->i8);
                    qb_project_i8(&m, &q4->i8, rows, y + base, ldy, lo, hi, accumulate);
                    base += n;
                    continue;
                }
#endif
#if QB_Q4_I16
                if (int16 && rows >= QI_PANEL_FROM_ROWS) {
                    if (!q4->i16_groups_ready) qi_prepare(x, ldx, rows, n_in, q4->i16_groups);
                    q4->i16_groups_ready = 1;
                    qi_stripe(&m, q4->i16_groups, rows, y + base, ldy, lo, hi, accumulate,
                              q4->i16_scratch);
                    base += n;
                    continue;
                }
#endif
                if ((!int16 || !is_q4) && rows >= BLOCK_PANEL_FROM_ROWS) {
                    qg_stripe(&m, NULL, n_in, panel_groups(x, ldx, n_in, rows, q4), rows,
                              y + base, ldy, lo, hi, accumulate, q4->scratch);
                    base += n;
                    continue;
                }
                const float *xin = x;
                int64_t ld = ldx;
                const int form = qb_input_form(&m, rows, int16);
                if (form != QB_INPUT_RAW) {
                    if (q4->ready != form)
                        q4->ld = qb_prepare_input(form, x, ldx, rows, n_in, q4->xt, q4->xsum);
                    q4->ready = form;
                    xin = q4->xt;
                    ld = q4->ld;
                }
                qb_project(&m, xin, ld, rows, q4->xsum, y + base, ldy, lo, hi, accumulate,
                           int16);
            }
        }
        base += n;
    }
}

/* This thread's share [*o0, *o1) of n outputs, in multiples of 16 (one cache line). */
static void stripe(int64_t n, int thread, int threads, int64_t *o0, int64_t *o1) {
    int64_t step = (n + threads - 1) / threads;
    step = (step + 15) / 16 * 16;
    *o0 = thread * step < n ? thread * step : n;
    *o1 = *o0 + step < n ? *o0 + step : n;
}

static void rms_norm(const float *x, const float *weight, float *out, int64_t rows, int64_t dim,
                     float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * dim;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; ++i) sum += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        float *orow = out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) orow[i] = xr[i] * inv * weight[i];
    }
}

/* out = SiLU(gate) * up over n values, SiLU(x) = x e / (1 + e) with e = e^-|x| (for x >= 0
 * the numerator's e is 1), so the exponent is never positive; vectorised
 * (`exp_nonpositive.h`). */
static void swiglu(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        vf x, u;
        memcpy(&x, gate + i, sizeof(x));
        memcpy(&u, up + i, sizeof(u));
        const exp_vint positive = x >= exp_splat(0.0f);
        const vf e = vexp_nonpositive(exp_select(positive, -x, x));
        const vf y = x * exp_select(positive, exp_splat(1.0f), e) / (exp_splat(1.0f) + e) * u;
        memcpy(out + i, &y, sizeof(y));
    }
    for (; i < n; ++i) {
        const float x = gate[i], e = exp_nonpositive(x >= 0.0f ? -x : x);
        out[i] = x * (x >= 0.0f ? 1.0f : e) / (1.0f + e) * up[i];
    }
}

/* Rotate-half in place: value d pairs with d + half (the signed `sin` carries the minus).
 * Two halves side by side, so the loop vectorises: with a `(d + half) % head_dim` partner
 * and a scratch copy the scalar loop cost 0.85 ms of a 30 ms batch-32 step on Zen 5. */
static void rotate(float *head, const float *cos, const float *sin, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp simd
    for (int64_t d = 0; d < half; ++d) {
        const float a = head[d], b = head[d + half];
        head[d] = a * cos[d] + b * sin[d];
        head[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* Row b, KV head h: softmax(q K^T * scale) V over the row's pages, for its `group` queries. */
/* Decode attention (`paged_decode_attention.c`), run by this stack's own team. */
int64_t paged_attention_spans(int64_t batch, int64_t longest, int64_t block_size, int threads);
int64_t paged_attention_team_bytes(int64_t batch, int64_t kv, int64_t group, int64_t head_dim,
                                   int64_t spans);
void paged_attention_team_prepare(void *memory, const int64_t *n_keys, int64_t batch,
                                  int64_t kv, int64_t spans);
void paged_attention_team_f32(void *memory, const float *q, int64_t q_stride,
                              const float *k_cache, const float *v_cache, const int64_t *pages,
                              const int64_t *n_keys, float *out, int64_t batch, int64_t kv,
                              int64_t group, int64_t head_dim, int64_t block_size, int64_t width,
                              float scale, int64_t spans, int mode, int *failed);

/* The stack; `parts` NULL: float32 projections from the table in `layouts`, else from parts. */
static int run_stack(const int64_t *table, const int64_t *layouts, const int64_t *parts, float *x,
                     const float *cos, const float *sin, const int64_t *pages,
                     const int64_t *n_keys, const float *final_norm, const int64_t *head,
                     float *logits, int64_t vocab, int64_t rows, int64_t n_layers, int64_t dim,
                     int64_t n_heads, int64_t kv, int64_t head_dim, int64_t ffn,
                     int64_t block_size, int64_t width, float eps, float scale, int n_threads,
                     int attention_mode, double *phase_seconds) {
    const int64_t q_out = n_heads * head_dim, kv_out = kv * head_dim;
    const int64_t qkv_out = q_out + 2 * kv_out, group = n_heads / kv;
    int64_t max_keys = 1;
    for (int64_t b = 0; b < rows; ++b) max_keys = n_keys[b] > max_keys ? n_keys[b] : max_keys;
    float *qkv = (float *)scratch_alloc(sizeof(float) * rows * qkv_out);
    float *attended = (float *)scratch_alloc(sizeof(float) * rows * q_out);
    float *gate_up = (float *)scratch_alloc(sizeof(float) * rows * 2 * ffn);
    float *hidden = (float *)scratch_alloc(sizeof(float) * rows * ffn);
    /* attention: the rows' order and span states, shared by every layer of the step */
    const int64_t spans = paged_attention_spans(rows, max_keys, block_size, n_threads);
    void *attention = scratch_alloc((size_t)paged_attention_team_bytes(rows, kv, group, head_dim, spans));
    if (attention != NULL)
        paged_attention_team_prepare(attention, n_keys, rows, kv, spans);
    int failed = qkv == NULL || attended == NULL || gate_up == NULL || hidden == NULL ||
                 attention == NULL;
    /* Shared by the team: the attention's loops read it after a barrier, so all agree. */
    int attention_failed = 0;
    if (!failed) {
#pragma omp parallel num_threads(n_threads)
        {
            const int thread = omp_get_thread_num(), threads = omp_get_num_threads();
            float *normed = (float *)scratch_alloc(sizeof(float) * rows * dim);
            /* q4 inputs: [rows, n_in] plus block sums, n_in at most max(dim, q, ffn) */
            const int64_t widest = dim > q_out ? (dim > ffn ? dim : ffn) : (q_out > ffn ? q_out : ffn);
            q4_input q4 = {NULL, NULL, -1, 0, {NULL, NULL, NULL, 0, 0, 0, -1}, NULL, NULL, 0,
                           NULL, NULL, 0};
            if (rows >= PANEL_FROM_ROWS) {
                q4.groups = (float *)scratch_alloc(
                    sizeof(float) * (qg_transposed_floats(rows, widest) + qg_scratch_floats(widest)));
                q4.scratch = q4.groups == NULL ? NULL : q4.groups + qg_transposed_floats(rows, widest);
            }
            void *i8_memory = NULL;
            /* int16 panel products need their groups and scratch (`gemm_panels_i16.h`) */
            const int blocks = parts != NULL || head != NULL;
            const int i16_panels = blocks && QB_Q4_I16 && rows >= QI_PANEL_FROM_ROWS;
            if (blocks) {
                q4.xt = (float *)scratch_alloc(sizeof(float) * qb_prepared_floats(rows, widest));
                q4.xsum = q4.xt == NULL ? NULL : q4.xt + rows * qb_prepared_row_floats(widest);
                i8_memory = scratch_alloc((size_t)qb_i8_bytes(rows, widest));
                if (i8_memory != NULL) qb_i8_bind(&q4.i8, i8_memory, rows, widest);
#if QB_Q4_I16
                if (i16_panels) {
                    q4.i16_groups = (float *)scratch_alloc(
                        sizeof(float) * (qi_prepared_floats(rows, widest) + qi_scratch_floats(widest)));
                    q4.i16_scratch = q4.i16_groups == NULL ? NULL
                                                           : q4.i16_groups + qi_prepared_floats(rows, widest);
                }
#endif
            }
            int mine_failed = normed == NULL ||
                              (rows >= PANEL_FROM_ROWS && q4.groups == NULL) ||
                              (blocks && (q4.xt == NULL || i8_memory == NULL)) ||
                              (i16_panels && q4.i16_groups == NULL);
#pragma omp atomic
            failed += mine_failed;
#pragma omp barrier
            /* Phase timing (`phase_seconds`, else NULL): thread 0 reads the clock as it
             * leaves each barrier, so a phase is its slowest thread's time. */
            double mark = omp_get_wtime();
#define LAP(PHASE)                                                                  \
    if (phase_seconds != NULL && thread == 0) {                                     \
        const double now = omp_get_wtime();                                         \
        phase_seconds[PHASE] += now - mark;                                         \
        mark = now;                                                                 \
    }
            int64_t f0, f1, d0, d1, v0, v1;
            stripe(qkv_out, thread, threads, &v0, &v1);
            stripe(dim, thread, threads, &d0, &d1);
            stripe(ffn, thread, threads, &f0, &f1);
            for (int64_t layer = 0; layer < n_layers && !failed; ++layer) {
                const int64_t *entry = table + layer * TABLE_WIDTH;
                const float *k_cache = (const float *)(intptr_t)entry[K_CACHE];
                const float *v_cache = (const float *)(intptr_t)entry[V_CACHE];
                float *k_store = (float *)(intptr_t)entry[K_CACHE];
                float *v_store = (float *)(intptr_t)entry[V_CACHE];
                /* 1. QKV of the normed stream (each thread norms for itself: no barrier) */
                const int64_t *lp = parts == NULL ? NULL : parts + layer * PARTS_WIDTH;
                rms_norm(x, (const float *)(intptr_t)entry[ATTN_NORM], normed, rows, dim, eps);
                new_stage(&q4);
                if (lp != NULL)
                    project_parts(lp + L_QKV * PROJ_WIDTH, dim, normed, dim, rows, qkv, qkv_out, v0,
                                  v1, 0, &q4);
                else
                    project((int)layouts[L_QKV], (const float *)(intptr_t)entry[WQKV], dim,
                            qkv_out, normed, dim, rows, qkv, qkv_out, v0, v1, 0, &q4);
#pragma omp barrier
                LAP(PHASE_QKV)
                /* 2. per (row, KV head): rotary on its q group and k, K/V into the cache at
                 * the row's position */
#pragma omp for schedule(static)
                for (int64_t job = 0; job < rows * kv; ++job) {
                    const int64_t b = job / kv, h = job % kv, pos = n_keys[b] - 1;
                    float *row = qkv + b * qkv_out;
                    const float *cos_b = cos + pos * head_dim, *sin_b = sin + pos * head_dim;
                    for (int64_t g = 0; g < group; ++g)
                        rotate(row + (h * group + g) * head_dim, cos_b, sin_b, head_dim);
                    float *k = row + q_out + h * head_dim;
                    rotate(k, cos_b, sin_b, head_dim);
                    const int64_t page = pages[b * width + pos / block_size];
                    if (page >= 0) {
                        const int64_t slot =
                            ((page * kv + h) * block_size + pos % block_size) * head_dim;
                        memcpy(k_store + slot, k, sizeof(float) * head_dim);
                        memcpy(v_store + slot, row + q_out + kv_out + h * head_dim,
                               sizeof(float) * head_dim);
                    }
                }
                LAP(PHASE_ROTARY)
                /* (implicit barrier: rows may share pages, so every write lands before any
                 * read, as in the per-op path) 3. attention over each row's pages in place:
                 * `paged_decode_attention.c`'s own items, run by this team */
                paged_attention_team_f32(attention, qkv, qkv_out, k_cache, v_cache, pages, n_keys,
                                         attended, rows, kv, group, head_dim, block_size, width,
                                         scale, spans, attention_mode, &attention_failed);
                LAP(PHASE_ATTENTION)
                /* (implicit barrier) 4. O projection into the residual stream */
                new_stage(&q4);
                if (lp != NULL)
                    project_parts(lp + L_O * PROJ_WIDTH, q_out, attended, q_out, rows, x, dim, d0,
                                  d1, 1, &q4);
                else
                    project((int)layouts[L_O], (const float *)(intptr_t)entry[WO], q_out, dim,
                            attended, q_out, rows, x, dim, d0, d1, 1, &q4);
#pragma omp barrier
                LAP(PHASE_O)
                /* 5. gate and up of the same outputs, then SiLU(gate) * up */
                rms_norm(x, (const float *)(intptr_t)entry[MLP_NORM], normed, rows, dim, eps);
                const float *w_gu = (const float *)(intptr_t)entry[W_GATE_UP];
                const int gu_layout = layouts == NULL ? 0 : (int)layouts[L_GATE_UP];
                new_stage(&q4);
                if (lp != NULL) {
                    const int64_t *gu = lp + L_GATE_UP * PROJ_WIDTH;
                    project_parts(gu, dim, normed, dim, rows, gate_up, 2 * ffn, f0, f1, 0, &q4);
                    project_parts(gu, dim, normed, dim, rows, gate_up, 2 * ffn, ffn + f0,
                                  ffn + f1, 0, &q4);
                } else {
                    project(gu_layout, w_gu, dim, 2 * ffn, normed, dim, rows, gate_up, 2 * ffn,
                            f0, f1, 0, &q4);
                    project(gu_layout, w_gu, dim, 2 * ffn, normed, dim, rows, gate_up, 2 * ffn,
                            ffn + f0, ffn + f1, 0, &q4);
                }
                for (int64_t r = 0; r < rows; ++r) {
                    const float *gr = gate_up + r * 2 * ffn;
                    swiglu(gr + f0, gr + ffn + f0, hidden + r * ffn + f0, f1 - f0);
                }
#pragma omp barrier
                LAP(PHASE_GATE_UP)
                /* 6. down projection into the residual stream */
                new_stage(&q4);
                if (lp != NULL)
                    project_parts(lp + L_DOWN * PROJ_WIDTH, ffn, hidden, ffn, rows, x, dim, d0, d1,
                                  1, &q4);
                else
                    project((int)layouts[L_DOWN], (const float *)(intptr_t)entry[W_DOWN], ffn,
                            dim, hidden, ffn, rows, x, dim, d0, d1, 1, &q4);
#pragma omp barrier
                LAP(PHASE_DOWN)
            }
            if (final_norm != NULL && !failed) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < rows; ++r)
                    rms_norm(x + r * dim, final_norm, x + r * dim, 1, dim, eps);
                /* (implicit barrier: every row is normed) the head, a stripe of it each */
                if (head != NULL) {
                    int64_t h0, h1;
                    stripe(vocab, thread, threads, &h0, &h1);
                    new_stage(&q4);
                    project_parts(head, dim, x, dim, rows, logits, vocab, h0, h1, 0, &q4);
                }
            }
            if (phase_seconds != NULL) { /* every thread or none: the same condition */
#pragma omp barrier
                LAP(PHASE_HEAD)
            }
#undef LAP
            free(normed);
            free(q4.xt);
            free(q4.groups);
            free(q4.i16_groups);
            free(i8_memory);
        }
    }
    free(qkv);
    free(attended);
    free(gate_up);
    free(hidden);
    free(attention);
    return failed != 0 || attention_failed != 0;
}

/* The exported stack: `layouts` for float32 projections from the table, or `parts` (the
 * other NULL) for the mixed stack; `attention_mode`: the attention's ATTENTION_* bits
 * (`paged_decode_attention.c`: its prefetch placement, or its reads alone for benchmarks);
 * `phase_seconds` (or NULL) [STACK_PHASES] accumulates each phase's time over the layers. */
int fused_decode_layers(const int64_t *table, const int64_t *layouts, const int64_t *parts,
                        float *x, const float *cos, const float *sin, const int64_t *pages,
                        const int64_t *n_keys, const float *final_norm, const int64_t *head,
                        float *logits, int64_t vocab, int64_t rows, int64_t n_layers,
                        int64_t dim, int64_t n_heads, int64_t kv, int64_t head_dim, int64_t ffn,
                        int64_t block_size, int64_t width, float eps, float scale,
                        int n_threads, int attention_mode, double *phase_seconds) {
    if ((layouts == NULL) == (parts == NULL)) return 2;
    return run_stack(table, layouts, parts, x, cos, sin, pages, n_keys, final_norm, head,
                     logits, vocab, rows, n_layers, dim, n_heads, kv, head_dim, ffn,
                     block_size, width, eps, scale, n_threads, attention_mode, phase_seconds);
}
