/* Decode attention that reads the paged KV cache in place (docs/performance.md).
 *
 * One query token per batch row attends to its first context_lens[b] cached positions. Keys and values are
 * read straight from their blocks through the block table: nothing is gathered or copied. The cache holds
 * fp32 values, or 8-bit codes with one fp16 scale per (token, kv head): value = lut[code] * scale, where
 * lut maps a code to its float (int8: the signed integer; fp8 e4m3: the decoded float).
 *
 * Work is split into items (batch row, kv head, chunk of its q heads, context split of SPLIT_TOKENS
 * positions) so one long request still spreads over every thread; each item keeps a partial softmax
 * (max, sum, weighted values) per q head, and a second pass merges the splits (flash-decoding). A q head's
 * numbers do not depend on how the items are cut or which thread runs them: the forking call
 * (paged_decode_attention) and the fused step's team (decode_step.c, attention_items / attention_merge)
 * give the same bits. With one split the item writes its normalised output itself (the merge's arithmetic:
 * (0 + acc * exp(0)) / (0 + l * exp(0)), the same bits).
 *
 * Kernels: AVX2 (fp32 cache, head_dim a multiple of 8; a vector exp on the scores) or the portable loops,
 * chosen at run time by decode_isa() (decode_step.c; tests force the portable path). They round
 * differently (summation order, exp), within the tests' 1e-5 of the torch backend.
 *
 * Layouts (row-major):
 *   q              [B, H, D] fp32, row b at q + b * q_row_stride (heads contiguous)
 *   out            [B, H, D] fp32 contiguous
 *   k, v           [num_blocks, block_size, KVH, D] fp32, or uint8 codes
 *   k_scale, v_scale [num_blocks, block_size, KVH] fp16 (8-bit caches only)
 *   block_table    [B, max_blocks] int32
 *   context_lens   [B] int32
 *   parts          [B, KVH, splits, G, D + 2] fp32 scratch: per q head m[G], l[G], acc[G][D]
 */
#include <float.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "paged_attention.h"

#define PARALLEL_MIN_VALUES 65536
#define MAX_HEAD_DIM 256

int decode_isa(void); /* decode_step.c: 2 = AVX2 allowed, 0 = portable loops */

static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Row of D values for (slot, head) as fp32 into dst (8-bit: dequantised). */
static inline const float *load_row(const AttnWork *a, const void *cache, const uint16_t *scales,
                                    int64_t slot, int head, float *dst) {
    int64_t index = slot * a->num_kv_heads + head;
    if (a->lut == NULL) return (const float *)cache + index * a->head_dim;
    const uint8_t *codes = (const uint8_t *)cache + index * a->head_dim;
    float s = half_to_float(scales[index]);
    for (int d = 0; d < a->head_dim; d++) dst[d] = a->lut[codes[d]] * s;
    return dst;
}

static inline int64_t slot_of(const AttnWork *a, const int32_t *table, int t) {
    return (int64_t)table[t / a->block_size] * a->block_size + t % a->block_size;
}

/* Partial attention of q heads [g0, g1) of kv head h over positions [t0, t1) of row b (portable loops).
 * Writes per q head g: max score m[g], sum of exp(score - m) l[g], sum of exp(score - m) * v acc[g*D]. */
static void attend_portable(const AttnWork *a, int b, int h, int g0, int g1, int t0, int t1,
                            float *m_out, float *l_out, float *acc_out) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int32_t *table = a->block_table + (int64_t)b * a->max_blocks;
    float scores[MAX_GROUP][SPLIT_TOKENS];
    float row[MAX_HEAD_DIM];
    const float *q = a->q + b * a->q_row_stride + (int64_t)h * G * D;
    for (int t = t0; t < t1; t++) {
        const float *k = load_row(a, a->k, a->k_scale, slot_of(a, table, t), h, row);
        for (int g = g0; g < g1; g++) {
            const float *qg = q + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qg[d] * k[d];
            scores[g][t - t0] = dot * a->scale;
        }
    }
    for (int g = g0; g < g1; g++) {
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
        const float *v = load_row(a, a->v, a->v_scale, slot_of(a, table, t), h, row);
        for (int g = g0; g < g1; g++) {
            float p = scores[g][t - t0], *acc = acc_out + g * D;
#pragma omp simd
            for (int d = 0; d < D; d++) acc[d] += p * v[d];
        }
    }
}

#ifdef __AVX2__
#define INL static inline __attribute__((always_inline))
#define CHUNK 64 /* values of a head held in 8 registers while the positions stream */

INL float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial; ~1 ulp);
 * below -87.3 (where expf is denormal or 0), 0. */
INL __m256 exp8_nonpositive(__m256 x) {
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

/* The same item on AVX2 (fp32 cache, D % 8 == 0). Scores: one dot per (position, q head), two
 * accumulators over D; softmax on 8 scores at a time; values: per q head, CHUNK values of acc in
 * registers while the positions stream. */
static void attend_avx2(const AttnWork *a, int b, int h, int g0, int g1, int t0, int t1, float *m_out,
                        float *l_out, float *acc_out) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, n = t1 - t0;
    const int32_t *table = a->block_table + (int64_t)b * a->max_blocks;
    const float *q = a->q + b * a->q_row_stride + (int64_t)h * G * D;
    const float *kc = (const float *)a->k, *vc = (const float *)a->v;
    const int64_t head_off = (int64_t)h * D, slot_stride = (int64_t)a->num_kv_heads * D;
    float scores[MAX_GROUP][SPLIT_TOKENS] __attribute__((aligned(32)));
    int64_t rows[SPLIT_TOKENS]; /* offset of each position's head row in either cache */
    for (int t = t0; t < t1; t++) rows[t - t0] = slot_of(a, table, t) * slot_stride + head_off;
    for (int i = 0; i < n; i++) {
        const float *k = kc + rows[i];
        if (i + 2 < n) _mm_prefetch((const char *)(kc + rows[i + 2]), _MM_HINT_T0);
        for (int g = g0; g < g1; g++) {
            const float *qg = q + g * D;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            int d = 0;
            for (; d + 16 <= D; d += 16) {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(k + d + 8), s1);
            }
            if (d < D) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), s0);
            scores[g][i] = hsum8(_mm256_add_ps(s0, s1)) * a->scale;
        }
    }
    const int n8 = n & ~7;
    for (int g = g0; g < g1; g++) {
        float *s = scores[g];
        for (int i = n; i < ((n + 7) & ~7); i++) s[i] = -INFINITY; /* the tail's lanes give 0 */
        __m256 mv = _mm256_set1_ps(-FLT_MAX), nan = _mm256_setzero_ps();
        for (int i = 0; i < n8; i += 8) {
            const __m256 v = _mm256_load_ps(s + i);
            mv = _mm256_max_ps(mv, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float m = -FLT_MAX, lanes[8];
        _mm256_storeu_ps(lanes, mv);
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        int any_nan = _mm256_movemask_ps(nan) != 0;
        for (int i = n8; i < n; i++) m = s[i] > m ? s[i] : m, any_nan |= s[i] != s[i];
        if (any_nan) m = NAN; /* a NaN score (a NaN in q or the cache) makes the output NaN, as torch */
        const __m256 mb = _mm256_set1_ps(m);
        __m256 lv = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) {
            const __m256 p = exp8_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + i), mb));
            _mm256_store_ps(s + i, p);
            lv = _mm256_add_ps(lv, p);
        }
        m_out[g] = m;
        l_out[g] = hsum8(lv);
    }
    for (int g = g0; g < g1; g++) {
        const float *p = scores[g];
        for (int c = 0; c < D; c += CHUNK) {
            const int w = (D - c < CHUNK ? D - c : CHUNK) / 8;
            __m256 acc[CHUNK / 8];
            for (int j = 0; j < CHUNK / 8; j++) acc[j] = _mm256_setzero_ps();
            for (int i = 0; i < n; i++) {
                const __m256 pb = _mm256_broadcast_ss(p + i);
                const float *v = vc + rows[i] + c;
                for (int j = 0; j < CHUNK / 8; j++)
                    if (j < w) acc[j] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8 * j), acc[j]);
            }
            for (int j = 0; j < w; j++) _mm256_storeu_ps(acc_out + g * D + c + 8 * j, acc[j]);
        }
    }
}
#endif /* __AVX2__ */

int attention_setup(AttnWork *w, const float *q, const void *k, const void *v,
                    const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                    const int32_t *block_table, const int32_t *context_lens, float *out,
                    int64_t q_row_stride, int batch, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int num_threads) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim > MAX_HEAD_DIM)
        return -1;
    *w = (AttnWork){q, k, v, k_scale, v_scale, lut, block_table, context_lens, out, q_row_stride,
                    batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    const int G = num_heads / num_kv_heads;
    int max_splits = 1;
    int64_t total_tokens = 0;
    for (int b = 0; b < batch; b++) {
        int n = (context_lens[b] + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
        max_splits = n > max_splits ? n : max_splits;
        total_tokens += context_lens[b];
    }
    w->max_splits = max_splits;
    w->total_values = total_tokens * num_kv_heads * head_dim;
    /* q-head chunks per kv head: cut a group further while there are fewer than 2 items a thread */
    int chunks = 1;
    while (chunks < G && (int64_t)batch * num_kv_heads * max_splits * chunks < 2 * num_threads) {
        chunks++;
        while (G % chunks) chunks++;
    }
    w->chunks = chunks;
    w->num_items = (int64_t)batch * num_kv_heads * chunks * max_splits;
    w->isa = decode_isa() >= 2 && lut == NULL && head_dim % 8 == 0 ? 2 : 0;
    return 0;
}

int64_t attention_parts_floats(const AttnWork *w) {
    const int G = w->num_heads / w->num_kv_heads;
    return (int64_t)w->batch * w->num_kv_heads * w->max_splits * G * (w->head_dim + 2);
}

void attention_items(const AttnWork *w, float *parts, int64_t i0, int64_t i1) {
    const int G = w->num_heads / w->num_kv_heads, D = w->head_dim, S = w->max_splits;
    const int per = G / w->chunks;
    for (int64_t item = i0; item < i1; item++) {
        const int split = item % S, c = (item / S) % w->chunks;
        const int64_t bh = item / ((int64_t)S * w->chunks); /* b * KVH + h */
        const int h = bh % w->num_kv_heads, b = bh / w->num_kv_heads, g0 = c * per, g1 = g0 + per;
        int t0 = split * SPLIT_TOKENS, t1 = t0 + SPLIT_TOKENS;
        t1 = t1 < w->context_lens[b] ? t1 : w->context_lens[b];
        float *m = parts + (bh * S + split) * G * (D + 2), *l = m + G;
        /* one split: acc straight into the output rows of this group's q heads */
        float *acc = S == 1 ? w->out + bh * G * D : l + G;
        if (t0 >= t1) {
            for (int g = g0; g < g1; g++) m[g] = -INFINITY, l[g] = 0.f;
            if (S == 1) memset(acc + g0 * D, 0, sizeof(float) * (g1 - g0) * D);
            continue;
        }
#ifdef __AVX2__
        if (w->isa >= 2)
            attend_avx2(w, b, h, g0, g1, t0, t1, m, l, acc);
        else
#endif
            attend_portable(w, b, h, g0, g1, t0, t1, m, l, acc);
        if (S == 1)
            for (int g = g0; g < g1; g++) {
                const float total = 0.f + l[g] * 1.f, inv = total > 0.f ? 1.f / total : 0.f;
                for (int d = 0; d < D; d++) acc[g * D + d] = (0.f + acc[g * D + d]) * inv;
            }
    }
}

void attention_merge(const AttnWork *w, const float *parts, int64_t r0, int64_t r1) {
    const int G = w->num_heads / w->num_kv_heads, D = w->head_dim, S = w->max_splits;
    if (S == 1) return; /* the items wrote the output */
    for (int64_t r = r0; r < r1; r++) { /* r = b * H + hq */
        const int hq = r % w->num_heads, b = r / w->num_heads, h = hq / G, g = hq % G;
        const float *first = parts + ((int64_t)b * w->num_kv_heads + h) * S * G * (D + 2);
        float *o = w->out + r * D;
        float big = -INFINITY, total = 0.f;
        for (int s = 0; s < S; s++) {
            float ms = first[s * G * (D + 2) + g];
            big = ms > big ? ms : big;
        }
        memset(o, 0, sizeof(float) * D);
        for (int s = 0; s < S; s++) {
            const float *m = first + s * G * (D + 2), *l = m + G, *acc = l + G + g * D;
            if (l[g] == 0.f) continue;
            float wt = expf(m[g] - big);
            total += l[g] * wt;
            for (int d = 0; d < D; d++) o[d] += acc[d] * wt;
        }
        float inv = total > 0.f ? 1.f / total : 0.f;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride, int batch,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads) {
    AttnWork w;
    if (attention_setup(&w, q, k, v, k_scale, v_scale, lut, block_table, context_lens, out,
                        q_row_stride, batch, num_heads, num_kv_heads, head_dim, block_size,
                        max_blocks, scale, num_threads) != 0)
        return -1;
    /* Small work stays on this thread: waking the others costs more than it saves. */
    const int parallel = w.total_values >= PARALLEL_MIN_VALUES && num_threads > 1;
    float *parts = malloc(sizeof(float) * attention_parts_floats(&w));
    if (parts == NULL) return -2;
    if (!parallel) {
        attention_items(&w, parts, 0, w.num_items);
        attention_merge(&w, parts, 0, (int64_t)batch * num_heads);
    } else {
#pragma omp parallel num_threads(num_threads)
        {
            const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
            for (int64_t item = 0; item < w.num_items; item++) attention_items(&w, parts, item, item + 1);
            const int64_t rows = (int64_t)batch * num_heads;
            attention_merge(&w, parts, rows * tid / nt, rows * (tid + 1) / nt);
        }
    }
    free(parts);
    return 0;
}
