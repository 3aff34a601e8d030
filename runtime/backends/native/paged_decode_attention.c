/* Decode attention that reads a paged K/V cache in place (no gather into a workspace).
 *
 * One query token per row, grouped-query heads folded: q and out are [B, kv, g, hd] float32.
 * The caches are [num_blocks, kv, block_size, hd] (float32 or bfloat16 stored as uint16);
 * row b attends to its first n_keys[b] positions, position t living on page pages[b, t / bs]
 * at offset t % bs (a page of -1 is unmapped: its keys are masked out). Work is split over
 * (row, kv head) pairs with OpenMP; each pair walks its pages once for the scores and once
 * for the values, so every cached key and value is read exactly once per step.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t value) {
    uint32_t bits = ((uint32_t)value) << 16;
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

#define DEFINE_KERNEL(NAME, KV_T, LOAD)                                                       \
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache, const int64_t *pages,  \
             const int64_t *n_keys, float *out, int64_t batch, int64_t kv, int64_t group,     \
             int64_t head_dim, int64_t block_size, int64_t width, float scale,                \
             int n_threads) {                                                                 \
        int failed = 0;                                                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(n_threads)")               \
        for (int64_t job = 0; job < batch * kv; ++job) {                                      \
            const int64_t b = job / kv, h = job % kv;                                         \
            const int64_t keys = n_keys[b];                                                   \
            const float *qh = q + job * group * head_dim;                                     \
            float *oh = out + job * group * head_dim;                                         \
            memset(oh, 0, sizeof(float) * group * head_dim);                                  \
            if (keys <= 0) continue;                                                          \
            float *scores = (float *)malloc(sizeof(float) * group * keys);                    \
            float *row = (float *)malloc(sizeof(float) * head_dim);                           \
            if (scores == NULL || row == NULL) {                                              \
                free(scores);                                                                 \
                free(row);                                                                    \
                failed = 1;                                                                   \
                continue;                                                                     \
            }                                                                                 \
            for (int64_t t = 0; t < keys; ++t) {                                              \
                const int64_t page = pages[b * width + t / block_size];                      \
                if (page < 0) {                                                               \
                    for (int64_t g = 0; g < group; ++g) scores[g * keys + t] = -INFINITY;     \
                    continue;                                                                 \
                }                                                                             \
                const KV_T *kp = k_cache + ((page * kv + h) * block_size + t % block_size) *  \
                                               head_dim;                                      \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(kp[d]);                  \
                for (int64_t g = 0; g < group; ++g) {                                         \
                    const float *qg = qh + g * head_dim;                                      \
                    float dot = 0.0f;                                                         \
                    _Pragma("omp simd reduction(+ : dot)")                                    \
                    for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];             \
                    scores[g * keys + t] = dot * scale;                                       \
                }                                                                             \
            }                                                                                 \
            for (int64_t g = 0; g < group; ++g) {                                             \
                float *s = scores + g * keys;                                                 \
                float top = -INFINITY;                                                        \
                for (int64_t t = 0; t < keys; ++t) top = s[t] > top ? s[t] : top;             \
                if (top == -INFINITY) {                                                       \
                    for (int64_t t = 0; t < keys; ++t) s[t] = 0.0f;                           \
                    continue;                                                                 \
                }                                                                             \
                float total = 0.0f;                                                           \
                for (int64_t t = 0; t < keys; ++t) {                                          \
                    s[t] = expf(s[t] - top);                                                  \
                    total += s[t];                                                            \
                }                                                                             \
                const float inv = 1.0f / total;                                               \
                for (int64_t t = 0; t < keys; ++t) s[t] *= inv;                               \
            }                                                                                 \
            for (int64_t t = 0; t < keys; ++t) {                                              \
                const int64_t page = pages[b * width + t / block_size];                      \
                if (page < 0) continue;                                                       \
                const KV_T *vp = v_cache + ((page * kv + h) * block_size + t % block_size) *  \
                                               head_dim;                                      \
                for (int64_t d = 0; d < head_dim; ++d) row[d] = LOAD(vp[d]);                  \
                for (int64_t g = 0; g < group; ++g) {                                         \
                    const float p = scores[g * keys + t];                                     \
                    float *og = oh + g * head_dim;                                            \
                    _Pragma("omp simd")                                                       \
                    for (int64_t d = 0; d < head_dim; ++d) og[d] += p * row[d];               \
                }                                                                             \
            }                                                                                 \
            free(scores);                                                                     \
            free(row);                                                                        \
        }                                                                                     \
        return failed;                                                                        \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

DEFINE_KERNEL(paged_decode_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_decode_attention_bf16, uint16_t, LOAD_BF16)
