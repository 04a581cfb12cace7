/* A vector exp for the C kernels (paged_attention.c: the scores' softmax; layer_ops.c: SiLU). */
#ifndef KVSERVE_VEXP_H
#define KVSERVE_VEXP_H
#ifdef __AVX2__
#include <immintrin.h>

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial; ~1 ulp);
 * below -87.3 (where expf is denormal or 0), 0. */
static inline __attribute__((always_inline)) __m256 exp8_nonpositive(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(lo, x); /* lo first: a NaN x passes through (max_ps returns its 2nd operand) */
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}
#endif /* __AVX2__ */
#endif
