/* e^x for x <= 0 without libm, as a scalar and as a vector of the native width: the
 * attention's online softmax and the fused stack's SiLU share it.
 *
 * Why: glibc's scalar `expf` is not vectorised without -ffast-math (which this build does not
 * use), and it cost ~4 ns a value: the SiLU of a 32-row SmolLM2 step is 1.5 M of them, ~3 ms
 * of a 64 ms step on Zen 4. Relative error below 2e-7; 0 below -87 (so -inf gives 0); NaN
 * stays NaN. Cody-Waite reduction and Cephes' polynomial.
 */
#ifndef LLM_RUNTIME_EXP_NONPOSITIVE_H
#define LLM_RUNTIME_EXP_NONPOSITIVE_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define EXP_LANES 16
#else
#define EXP_LANES 8
#endif

/* The same types as each source's own native-width vectors (GCC vector types are equal when
 * their element type and size are). */
typedef float exp_vfloat __attribute__((vector_size(EXP_LANES * sizeof(float))));
typedef int32_t exp_vint __attribute__((vector_size(EXP_LANES * sizeof(int32_t))));

static inline exp_vfloat exp_splat(float x) { return x - (exp_vfloat){0}; }
static inline exp_vint exp_splat_i(int32_t x) { return x - (exp_vint){0}; }

/* Lane-wise `mask ? a : b` for a comparison's mask (all bits set or none). */
static inline exp_vfloat exp_select(exp_vint mask, exp_vfloat a, exp_vfloat b) {
    exp_vint ai, bi;
    memcpy(&ai, &a, sizeof(ai));
    memcpy(&bi, &b, sizeof(bi));
    exp_vint out = (ai & mask) | (bi & ~mask);
    exp_vfloat f;
    memcpy(&f, &out, sizeof(f));
    return f;
}

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


#define EXP_SCALAR_SELECT(mask, a, b) ((mask) ? (a) : (b))
#define EXP_SCALAR_SPLAT(x) (x)
static inline float exp_nonpositive(float x) {
    EXP_BODY(float, int32_t, EXP_SCALAR_SPLAT, EXP_SCALAR_SPLAT, EXP_SCALAR_SELECT)
}

static inline exp_vfloat vexp_nonpositive(exp_vfloat x) {
    EXP_BODY(exp_vfloat, exp_vint, exp_splat, exp_splat_i, exp_select)
}

#undef EXP_SCALAR_SELECT
#undef EXP_SCALAR_SPLAT
#undef EXP_BODY

#endif
