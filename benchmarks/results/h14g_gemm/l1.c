#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#define INL static inline __attribute__((always_inline))
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
/* A: rows of x strided by K (as decode_step) */
__attribute__((noinline)) void kA(const float *w, const float *x, int K, float *y) {
    __m256 acc[6][2];
    for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
        for (int r = 0; r < 6; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) { _mm256_storeu_ps(y + r * 16, acc[r][0]); _mm256_storeu_ps(y + r * 16 + 8, acc[r][1]); }
}
/* B: x packed [k][6] */
__attribute__((noinline)) void kB(const float *w, const float *xp, int K, float *y) {
    __m256 acc[6][2];
    for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
        for (int r = 0; r < 6; r++) {
            const __m256 xb = _mm256_broadcast_ss(xp + k * 6 + r);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) { _mm256_storeu_ps(y + r * 16, acc[r][0]); _mm256_storeu_ps(y + r * 16 + 8, acc[r][1]); }
}
/* C: like A, w forced into registers */
__attribute__((noinline)) void kC(const float *w, const float *x, int K, float *y) {
    __m256 acc[6][2];
    for (int r = 0; r < 6; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
        __asm__("" : "+x"(w0), "+x"(w1));
        for (int r = 0; r < 6; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < 6; r++) { _mm256_storeu_ps(y + r * 16, acc[r][0]); _mm256_storeu_ps(y + r * 16 + 8, acc[r][1]); }
}
/* D: 4 rows (8 acc), w in regs */
__attribute__((noinline)) void kD(const float *w, const float *x, int K, float *y) {
    __m256 acc[4][2];
    for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
        __asm__("" : "+x"(w0), "+x"(w1));
        for (int r = 0; r < 4; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]); acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
        }
    }
    for (int r = 0; r < 4; r++) { _mm256_storeu_ps(y + r * 16, acc[r][0]); _mm256_storeu_ps(y + r * 16 + 8, acc[r][1]); }
}
int main(int argc, char **argv) {
    int K = argc > 1 ? atoi(argv[1]) : 256;
    float *w = aligned_alloc(64, K * 64), *x = aligned_alloc(64, 6 * K * 4), *xp = aligned_alloc(64, 6 * K * 4), y[96];
    for (int i = 0; i < K * 16; i++) w[i] = (i % 13) * 0.01f;
    for (int i = 0; i < 6 * K; i++) x[i] = (i % 7) * 0.1f;
    for (int k = 0; k < K; k++) for (int r = 0; r < 6; r++) xp[k * 6 + r] = x[r * K + k];
    int iters = 20000000 / K;
    for (int rep = 0; rep < 2; rep++) {
        double t;
        t = now(); for (int i = 0; i < iters; i++) kA(w, x, K, y); t = now() - t; printf("A strided x, loads folded: %.1f GFLOP/s\n", 2.0 * 6 * 16 * K * iters / t / 1e9);
        t = now(); for (int i = 0; i < iters; i++) kB(w, xp, K, y); t = now() - t; printf("B packed x:                %.1f GFLOP/s\n", 2.0 * 6 * 16 * K * iters / t / 1e9);
        t = now(); for (int i = 0; i < iters; i++) kC(w, x, K, y); t = now() - t; printf("C strided x, w in regs:    %.1f GFLOP/s\n", 2.0 * 6 * 16 * K * iters / t / 1e9);
        t = now(); for (int i = 0; i < iters; i++) kD(w, x, K, y); t = now() - t; printf("D 4 rows, w in regs:       %.1f GFLOP/s\n", 2.0 * 4 * 16 * K * iters / t / 1e9);
    }
}
