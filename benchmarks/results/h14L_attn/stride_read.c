/* Plain reads of 30 layers' KV at 4,000 positions (3 kv heads x 64 fp32 per position, K then V) in the
 * order the attention items read them: per (kv head, 256-position split) item, the head's 256-byte rows
 * at a 768-byte stride ("strided"), or per split all heads' rows contiguously ("contiguous").
 * Build: cc -O3 -march=native -fopenmp stride_read.c -o stride_read; run: ./stride_read THREADS */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <immintrin.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int nt = atoi(argv[1]), L = 30, KVH = 3, D = 64, N = 4000, S = 256, splits = (N + S - 1) / S;
    const int64_t lf = (int64_t)N * KVH * D;
    float *kv = aligned_alloc(64, sizeof(float) * lf * 2 * L);
    for (int64_t i = 0; i < lf * 2 * L; i++) kv[i] = 1.f;
    double best[2] = {1e9, 1e9};
    volatile float sink = 0;
    for (int rep = 0; rep < 10; rep++)
        for (int mode = 0; mode < 2; mode++) {
            double t0 = now();
            for (int l = 0; l < L; l++) {
                const float *k = kv + (int64_t)l * 2 * lf, *v = k + lf;
                const int items = mode == 0 ? splits * KVH : splits;
                float s = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) reduction(+ : s)
                for (int it = 0; it < items; it++) {
                    const int split = mode == 0 ? it % splits : it, h0 = mode == 0 ? it / splits : 0,
                              h1 = mode == 0 ? h0 + 1 : KVH;
                    __m256 acc = _mm256_setzero_ps();
                    for (int pass = 0; pass < 2; pass++) {
                        const float *c = pass == 0 ? k : v;
                        for (int t = split * S; t < (split + 1) * S && t < N; t++)
                            for (int h = h0; h < h1; h++)
                                for (int d = 0; d < D; d += 8)
                                    acc = _mm256_add_ps(acc, _mm256_loadu_ps(c + ((int64_t)t * KVH + h) * D + d));
                    }
                    float lanes[8];
                    _mm256_storeu_ps(lanes, acc);
                    s += lanes[0];
                }
                sink += s;
            }
            double t = (now() - t0) / L * 1e6;
            best[mode] = t < best[mode] ? t : best[mode];
        }
    double mb = 2.0 * lf * 4 / 1e6;
    printf("threads %d: strided items %.0f us/layer (%.1f GB/s), contiguous items %.0f us/layer (%.1f GB/s)\n", nt,
           best[0], mb / best[0] * 1e3, best[1], mb / best[1] * 1e3);
}
