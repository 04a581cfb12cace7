/* Decode attention that reads the paged KV cache in place (docs/performance.md).
 *
 * One query token per batch row attends to its first context_lens[b] cached positions. Keys and values are
 * read straight from their blocks through the block table: nothing is gathered or copied. The cache holds
 * fp32 values, or 8-bit codes with one fp16 scale per (token, kv head): value = lut[code] * scale, where
 * lut maps a code to its float (int8: the signed integer; fp8 e4m3: the decoded float).
 *
 * Work is split into items (batch row, kv head, context split of SPLIT_TOKENS positions) so one long
 * request still spreads over every thread; each item keeps a partial softmax (max, sum, weighted values)
 * for the q heads of its group, and a second pass merges the splits (flash-decoding).
 *
 * Layouts (row-major):
 *   q              [B, H, D] fp32, row b at q + b * q_row_stride (heads contiguous)
 *   out            [B, H, D] fp32 contiguous
 *   k, v           [num_blocks, block_size, KVH, D] fp32, or uint8 codes
 *   k_scale, v_scale [num_blocks, block_size, KVH] fp16 (8-bit caches only)
 *   block_table    [B, max_blocks] int32
 *   context_lens   [B] int32
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SPLIT_TOKENS 256
#define PARALLEL_MIN_VALUES 65536
#define MAX_GROUP 32
#define MAX_HEAD_DIM 256

typedef struct {
    const float *q;
    const void *k, *v;
    const uint16_t *k_scale, *v_scale;
    const float *lut; /* NULL: fp32 cache */
    const int32_t *block_table, *context_lens;
    float *out;
    int64_t q_row_stride;
    int batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
} Args;

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Row of D values for (slot, head) as fp32 into dst (8-bit: dequantised). */
static inline const float *load_row(const Args *a, const void *cache, const uint16_t *scales,
                                    int64_t slot, int head, float *dst) {
    int64_t index = slot * a->num_kv_heads + head;
    if (a->lut == NULL) return (const float *)cache + index * a->head_dim;
    const uint8_t *codes = (const uint8_t *)cache + index * a->head_dim;
    float s = half_to_float(scales[index]);
    for (int d = 0; d < a->head_dim; d++) dst[d] = a->lut[codes[d]] * s;
    return dst;
}

/* Partial attention of one item: the `group` q heads of kv head `h` over positions [t0, t1) of row b.
 * Writes per q head: max score m, sum of exp(score - m) l, and sum of exp(score - m) * v into acc. */
static void attend_split(const Args *a, int b, int h, int t0, int t1, float *m_out, float *l_out,
                         float *acc_out) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int32_t *table = a->block_table + (int64_t)b * a->max_blocks;
    float scores[MAX_GROUP][SPLIT_TOKENS];
    float row[MAX_HEAD_DIM];
    const float *q = a->q + b * a->q_row_stride + (int64_t)h * G * D;
    for (int t = t0; t < t1; t++) {
        int64_t slot = (int64_t)table[t / a->block_size] * a->block_size + t % a->block_size;
        const float *k = load_row(a, a->k, a->k_scale, slot, h, row);
        for (int g = 0; g < G; g++) {
            const float *qg = q + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qg[d] * k[d];
            scores[g][t - t0] = dot * a->scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float m = -FLT_MAX, l = 0.f;
        for (int i = 0; i < t1 - t0; i++) m = scores[g][i] > m ? scores[g][i] : m;
        for (int i = 0; i < t1 - t0; i++) {
            scores[g][i] = expf(scores[g][i] - m);
            l += scores[g][i];
        }
        m_out[g] = m;
        l_out[g] = l;
        memset(acc_out + g * D, 0, sizeof(float) * D);
    }
    for (int t = t0; t < t1; t++) {
        int64_t slot = (int64_t)table[t / a->block_size] * a->block_size + t % a->block_size;
        const float *v = load_row(a, a->v, a->v_scale, slot, h, row);
        for (int g = 0; g < G; g++) {
            float p = scores[g][t - t0], *acc = acc_out + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += p * v[d];
        }
    }
}

int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride,
                           int batch, int num_heads,
                           int num_kv_heads, int head_dim, int block_size, int max_blocks,
                           float scale, int num_threads) {
    Args a = {q, k, v, k_scale, v_scale, lut, block_table, context_lens, out, q_row_stride, batch,
              num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    const int G = num_heads / num_kv_heads, D = head_dim;
    if (G > MAX_GROUP || D > MAX_HEAD_DIM || num_heads % num_kv_heads) return -1;
    int max_splits = 1;
    int64_t total_tokens = 0;
    for (int b = 0; b < batch; b++) {
        int n = (context_lens[b] + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
        max_splits = n > max_splits ? n : max_splits;
        total_tokens += context_lens[b];
    }
    /* Small work stays on this thread: waking the others costs more than it saves. */
    const int parallel = total_tokens * num_kv_heads * D >= PARALLEL_MIN_VALUES;
    const int64_t num_items = (int64_t)batch * num_kv_heads * max_splits;
    /* per item and q head of its group: m, l, acc[D] */
    float *parts = malloc(sizeof(float) * num_items * G * (D + 2));
    if (parts == NULL) return -2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (parallel)
    for (int64_t item = 0; item < num_items; item++) {
        int split = item % max_splits, h = (item / max_splits) % num_kv_heads;
        int b = item / ((int64_t)max_splits * num_kv_heads);
        int t0 = split * SPLIT_TOKENS, t1 = t0 + SPLIT_TOKENS;
        t1 = t1 < context_lens[b] ? t1 : context_lens[b];
        float *m = parts + item * G * (D + 2), *l = m + G, *acc = l + G;
        if (t0 >= t1) {
            for (int g = 0; g < G; g++) m[g] = -INFINITY, l[g] = 0.f;
            continue;
        }
        attend_split(&a, b, h, t0, t1, m, l, acc);
    }
    /* merge the splits of each (row, q head) */
    for (int b = 0; b < batch; b++) {
        for (int hq = 0; hq < num_heads; hq++) {
            int h = hq / G, g = hq % G;
            float *o = out + ((int64_t)b * num_heads + hq) * D;
            float big = -INFINITY, total = 0.f;
            for (int s = 0; s < max_splits; s++) {
                float ms = parts[(((int64_t)b * num_kv_heads + h) * max_splits + s) * G * (D + 2) + g];
                big = ms > big ? ms : big;
            }
            memset(o, 0, sizeof(float) * D);
            for (int s = 0; s < max_splits; s++) {
                float *m = parts + (((int64_t)b * num_kv_heads + h) * max_splits + s) * G * (D + 2);
                float *l = m + G, *acc = l + G + g * D;
                if (l[g] == 0.f) continue;
                float w = expf(m[g] - big);
                total += l[g] * w;
                for (int d = 0; d < D; d++) o[d] += acc[d] * w;
            }
            float inv = total > 0.f ? 1.f / total : 0.f;
            for (int d = 0; d < D; d++) o[d] *= inv;
        }
    }
    free(parts);
    return 0;
}
