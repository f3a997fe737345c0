/* Float32 <-> IEEE half with the F16C instructions, float32 -> bfloat16 with AVX2, each
   compiled for its instructions with a target attribute and chosen at run time
   (hpcdl_f16c_supported, hpcdl_avx2_supported), so the module still runs on any x86-64 and
   builds elsewhere (aarch64, MSVC), where the functions convert nothing.

   The half functions convert whole blocks of 8 and stop before the first block holding a
   NaN, or before a tail of fewer than 8: they return how many elements they converted, and
   the caller converts the next block (or the tail) in software and calls again. Hardware
   and NumPy round finite values, infinities and subnormals alike (to nearest even: the
   rounding comes from the immediate, not MXCSR); NaNs they do not treat alike (F16C quiets
   signalling NaNs: 0x7f800001 -> 0x7e00, NumPy 0x7c01), hence the software blocks. */
#ifndef HPCDL_HALF_H
#define HPCDL_HALF_H
#include <stddef.h>
#include <stdint.h>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define HPCDL_F16C __attribute__((target("avx,f16c")))
#define HPCDL_AVX2 __attribute__((target("avx2")))

/* CPU and OS support (GCC's and Clang's "avx" includes the OS saving the YMM registers) */
static inline int hpcdl_f16c_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
}

static inline int hpcdl_avx2_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2");
}

HPCDL_F16C static inline int hpcdl_has_nan_ps(__m256 x) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0;
}

HPCDL_F16C static size_t hpcdl_f32_to_f16_f16c(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        if (hpcdl_has_nan_ps(x)) break;
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    }
    return i;
}

/* dst = float(src) * s, the product in float32 (skipped when s == 1: exact either way) */
HPCDL_F16C static size_t hpcdl_f16_to_f32_f16c(const uint16_t *src, float *dst, size_t n, float s) {
    size_t i = 0;
    __m256 vs = _mm256_set1_ps(s);
    int scaled = s != 1.0f;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)));
        if (hpcdl_has_nan_ps(x)) break;
        if (scaled) x = _mm256_mul_ps(x, vs);
        _mm256_storeu_ps(dst + i, x);
    }
    return i;
}

/* dst = double(src) * s, the product in float64 (half -> float -> double is exact) */
HPCDL_F16C static size_t hpcdl_f16_to_f64_f16c(const uint16_t *src, double *dst, size_t n, double s) {
    size_t i = 0;
    __m256d vs = _mm256_set1_pd(s);
    int scaled = s != 1.0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i)));
        if (hpcdl_has_nan_ps(x)) break;
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
        __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
        if (scaled) {
            lo = _mm256_mul_pd(lo, vs);
            hi = _mm256_mul_pd(hi, vs);
        }
        _mm256_storeu_pd(dst + i, lo);
        _mm256_storeu_pd(dst + i + 4, hi);
    }
    return i;
}

/* bfloat16 bits of 8 floats, the software rule lane by lane in integers (hence identical):
   round to nearest even, NaN -> its top half with the quiet bit set */
HPCDL_AVX2 static inline __m256i hpcdl_bf16_lanes(__m256i x) {
    __m256i hi = _mm256_srli_epi32(x, 16);
    __m256i odd = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd), 16);
    __m256i a = _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
}

/* whole blocks of 16; returns how many were converted (the tail is the caller's) */
HPCDL_AVX2 static size_t hpcdl_f32_to_bf16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = hpcdl_bf16_lanes(_mm256_loadu_si256((const __m256i *)(src + i)));
        __m256i b = hpcdl_bf16_lanes(_mm256_loadu_si256((const __m256i *)(src + i + 8)));
        /* packus works within 128-bit lanes: a0-3 b0-3 a4-7 b4-7, then reorder the quarters */
        __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), h);
    }
    return i;
}

#else
static inline int hpcdl_f16c_supported(void) { return 0; }
static inline int hpcdl_avx2_supported(void) { return 0; }
static inline size_t hpcdl_f32_to_bf16_avx2(const float *src, uint16_t *dst, size_t n) {
    (void)src; (void)dst; (void)n;
    return 0;
}
static inline size_t hpcdl_f32_to_f16_f16c(const float *src, uint16_t *dst, size_t n) {
    (void)src; (void)dst; (void)n;
    return 0;
}
static inline size_t hpcdl_f16_to_f32_f16c(const uint16_t *src, float *dst, size_t n, float s) {
    (void)src; (void)dst; (void)n; (void)s;
    return 0;
}
static inline size_t hpcdl_f16_to_f64_f16c(const uint16_t *src, double *dst, size_t n, double s) {
    (void)src; (void)dst; (void)n; (void)s;
    return 0;
}
#endif
#endif
