/* Microbenchmark of paged decode attention at batch 1 under the real step's cache conditions:
 * 30 layers' KV (SmolLM2-135M shape: 9 q heads, 3 kv heads, head_dim 64, block 16), each layer's
 * attention called in turn so its KV comes from DRAM, as in a decode step.
 * Build: cc -O3 -march=native -fopenmp attn_bench.c ../../../kvserve/model/csrc/{paged_attention,layer_ops,decode_step,qgemv}.c -lm
 * Run:   ./a.out CONTEXT THREADS [shuffle]  (prints us per layer: attention, and a plain read of the same bytes) */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride, int batch,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int ctx = atoi(argv[1]), nt = atoi(argv[2]), shuffle = argc > 3 ? atoi(argv[3]) : 0;
    const int L = 30, H = 9, KVH = 3, D = 64, BS = 16, nb = (ctx + BS - 1) / BS;
    const int64_t layer_floats = (int64_t)nb * BS * KVH * D;
    float *kv = aligned_alloc(64, sizeof(float) * layer_floats * 2 * L);
    for (int64_t i = 0; i < layer_floats * 2 * L; i++) kv[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    int32_t *table = malloc(sizeof(int32_t) * nb), lens[1] = {ctx};
    for (int i = 0; i < nb; i++) table[i] = i;
    if (shuffle) for (int i = nb - 1; i > 0; i--) { int j = rand() % (i + 1), t = table[i]; table[i] = table[j]; table[j] = t; }
    float q[H * D], out[H * D];
    for (int i = 0; i < H * D; i++) q[i] = (float)(i % 7) / 7.f;
    omp_set_num_threads(nt);
    double best = 1e9, best_read = 1e9;
    volatile float sink = 0;
    for (int rep = 0; rep < 12; rep++) {
        double t0 = now();
        for (int l = 0; l < L; l++) {
            const float *k = kv + (int64_t)l * 2 * layer_floats, *v = k + layer_floats;
            paged_decode_attention(q, k, v, NULL, NULL, NULL, table, lens, out, H * D, 1, H, KVH, D, BS, nb, 0.125f, nt);
        }
        double t = (now() - t0) / L * 1e6;
        best = t < best ? t : best;
        t0 = now();
        float s = 0;
        for (int l = 0; l < L; l++) {
            const float *k = kv + (int64_t)l * 2 * layer_floats;
#pragma omp parallel for reduction(+ : s) num_threads(nt) schedule(static)
            for (int64_t i = 0; i < 2 * layer_floats; i += 16) s += k[i];
        }
        sink += s;
        t = (now() - t0) / L * 1e6;
        best_read = t < best_read ? t : best_read;
    }
    double mb = 2.0 * layer_floats * 4 / 1e6;
    printf("ctx %d threads %d shuffle %d: attention %.0f us/layer (%.1f GB/s), touch-every-line read %.0f us/layer (%.1f GB/s)\n",
           ctx, nt, shuffle, best, mb / best * 1e3, best_read, mb / best_read * 1e3);
    return 0;
}
