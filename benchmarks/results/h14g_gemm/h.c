/* small_linear of decode_step.c called from C: 30 layers x 4 shapes, fresh weights */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include "decode_step.h"
int small_linear(const Linear *L, const float *x, int M, float *y, int num_threads);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    int NL = 30; Linear ls[30][4];
    int rnd = argc > 1 && argv[1][0] == 'r';
    unsigned s32 = 1;
    for (int i = 0; i < NL; i++) for (int s = 0; s < 4; s++) {
        int n = shapes[s][0], k = shapes[s][1]; float *w = aligned_alloc(64, (size_t)n * k * 4);
        for (size_t j = 0; j < (size_t)n * k; j++) { s32 = s32 * 1664525u + 1013904223u;
            w[j] = rnd ? ((float)(s32 >> 8) / 16777216.f - 0.5f) : (float)((j * 2654435761u) % 1000) * 1e-3f; }
        ls[i][s] = (Linear){0, n, k, k, 1, 1, 0, 0, w, 0, 0, 0};
    }
    float *x = aligned_alloc(64, 64 * 1536 * 4), *y = aligned_alloc(64, 64 * 3072 * 4);
    for (int j = 0; j < 64 * 1536; j++) { s32 = s32 * 1664525u + 1013904223u; x[j] = rnd ? ((float)(s32 >> 8) / 16777216.f - 0.5f) : (float)(j % 7) * 0.1f; }
    int Ms[] = {1, 16, 64};
    for (int mi = 0; mi < 3; mi++) for (int v = 0; v < 2; v++) {
        int M = Ms[mi]; double best = 1e9;
        for (int rep = 0; rep < 5; rep++) {
            double t = now();
            for (int i = 0; i < NL; i++) for (int s = 0; s < 4; s++) small_linear(&ls[i][s], x, M, y, 2);
            t = now() - t; if (t < best) best = t;
        }
        double fl = 0; for (int s = 0; s < 4; s++) fl += 2.0 * M * shapes[s][0] * shapes[s][1] * NL;
        printf("M=%2d %s: %7.2f ms  %6.1f GFLOP/s\n", M, rnd ? "rand" : "synth", best * 1e3, fl / best / 1e9);
    }
}
