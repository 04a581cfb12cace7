/* Decode attention that reads the paged KV cache in place (docs/performance.md).
 *
 * One query token per batch row attends to its first context_lens[b] cached positions (a sliding-window
 * layer's call, window W > 0: to its last W of them, context_lens[b] - W .. context_lens[b] - 1, as
 * transformers' sliding-window mask; only those positions' blocks are read). Keys and values are
 * read straight from their blocks through the block table: nothing is gathered or copied. The cache holds
 * fp32 values, or 8-bit codes with one fp16 scale per (token, kv head): value = lut[code] * scale, where
 * lut maps a code to its float (int8: the signed integer; fp8 e4m3: the decoded float).
 *
 * Work is split into items (batch row, a range of its q heads, context split of SPLIT_TOKENS positions) so
 * one long request still spreads over every thread. An item takes every kv head of its row when the rows
 * and splits alone give each thread 2 items: it then reads each position's K and V rows of all kv heads
 * as one contiguous run (plain streams from memory: strided per-head rows read ~1.5x slower here), and
 * each K and V row serves all G q heads of its group. Fewer items: one kv head per item, and its group's
 * q heads cut into chunks. Each item keeps a partial softmax
 * (max, sum, weighted values) per q head, and a second pass merges the splits (flash-decoding). A q head's
 * numbers do not depend on how the items are cut or which thread runs them: the forking call
 * (paged_decode_attention) and the pooled fused step (decode_step.c, attention_items / attention_merge)
 * give the same bits. With one split the item writes its normalised output itself (the merge's arithmetic:
 * (0 + acc * exp(0)) / (0 + l * exp(0)), the same bits).
 *
 * Kernels: AVX2 (head_dim a multiple of 8; a vector exp on the scores; an 8-bit cache's rows of an item
 * dequantised into a per-thread buffer first) or the portable loops, chosen at run time by decode_isa()
 * (decode_step.c; tests force the portable path). They round
 * differently (summation order, exp), within the tests' 1e-5 of the torch backend.
 *
 * Layouts (row-major):
 *   q              [B, H, D] fp32, row b at q + b * q_row_stride (heads contiguous)
 *   out            [B, H, D] fp32 contiguous
 *   k, v           [num_blocks, block_size, KVH, D] fp32, or uint8 codes
 *   k_scale, v_scale [num_blocks, block_size, KVH] fp16 (8-bit caches only)
 *   block_table    [B, max_blocks] int32
 *   context_lens   [B] int32
 *   parts          [B, splits, H, D + 2] fp32 scratch: per (row, split) m[H], l[H], acc[H][D]
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"
#include "paged_attention.h"
#include "vexp.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define PARALLEL_MIN_VALUES 65536
#define MAX_HEAD_DIM 256

int decode_isa(void); /* decode_step.c: 2 = AVX2 allowed, 0 = portable loops */

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

/* Partial attention of q heads [hq0, hq1) of row b (any kv heads) over positions [t0, t1) (portable
 * loops). Writes per q head hq: max score m[hq], sum of exp(score - m) l[hq], sum of exp(score - m) * v
 * acc[hq*D]. */
static void attend_portable(const AttnWork *a, int b, int hq0, int hq1, int t0, int t1, float *m_out,
                            float *l_out, float *acc_out) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads;
    const int32_t *table = a->block_table + (int64_t)b * a->max_blocks;
    float scores[MAX_GROUP][SPLIT_TOKENS];
    float row[MAX_HEAD_DIM];
    const float *q = a->q + b * a->q_row_stride;
    for (int t = t0; t < t1; t++) {
        const int64_t slot = slot_of(a, table, t);
        const float *k = NULL;
        for (int hq = hq0; hq < hq1; hq++) {
            if (hq == hq0 || hq % G == 0) k = load_row(a, a->k, a->k_scale, slot, hq / G, row);
            const float *qh = q + hq * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qh[d] * k[d];
            scores[hq - hq0][t - t0] = dot * a->scale;
        }
    }
    for (int hq = hq0; hq < hq1; hq++) {
        float m = -FLT_MAX, l = 0.f, *s = scores[hq - hq0];
        for (int i = 0; i < t1 - t0; i++) m = s[i] > m ? s[i] : m;
        for (int i = 0; i < t1 - t0; i++) {
            s[i] = expf(s[i] - m);
            l += s[i];
        }
        m_out[hq] = m;
        l_out[hq] = l;
        memset(acc_out + hq * D, 0, sizeof(float) * D);
    }
    for (int t = t0; t < t1; t++) {
        const int64_t slot = slot_of(a, table, t);
        const float *v = NULL;
        for (int hq = hq0; hq < hq1; hq++) {
            if (hq == hq0 || hq % G == 0) v = load_row(a, a->v, a->v_scale, slot, hq / G, row);
            float p = scores[hq - hq0][t - t0], *acc = acc_out + hq * D;
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

/* 8 dot products (one per position) of D values, summed across lanes at once: a[j] holds position j's
 * lane sums; returns the 8 totals in position order (3 hadds and a lane swap for 8 positions, not 8
 * horizontal sums). */
INL __m256 reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                   __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* [0-3 lo, 0-3 hi] ... */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define V_TILE 32 /* positions whose V rows stay in L1 while every q head of the group uses them */

/* An 8-bit cache's rows of the item, dequantised (lut[code] * scale, the values load_row gives) into
 * buf: position i's kv heads [kh0, kh1) at buf + i * span; rows[i] becomes that offset less the span's
 * start, so the fp32 code below reads them as it reads the cache. 8 codes at a time: int8 codes
 * converted (the lut's values exactly), fp8 ones through a gather of the lut. */
static void dequantise_rows(const AttnWork *a, const void *cache, const uint16_t *scales,
                            const int64_t *slot_rows, int n, int kh0, int kh1, float *buf) {
    const int D = a->head_dim, KVH = a->num_kv_heads;
    const int64_t span = (int64_t)(kh1 - kh0) * D;
    for (int i = 0; i < n; i++) {
        const int64_t slot = slot_rows[i] / ((int64_t)KVH * D);
        for (int h = kh0; h < kh1; h++) {
            const int64_t index = slot * KVH + h;
            const uint8_t *codes = (const uint8_t *)cache + index * D;
            const __m256 sv = _mm256_set1_ps(half_to_float(scales[index]));
            float *dst = buf + i * span + (int64_t)(h - kh0) * D;
            for (int d = 0; d < D; d += 8) {
                const __m128i c8 = _mm_loadl_epi64((const __m128i *)(codes + d));
                const __m256 vals = a->int8_lut
                                        ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c8))
                                        : _mm256_i32gather_ps(a->lut, _mm256_cvtepu8_epi32(c8), 4);
                _mm256_storeu_ps(dst + d, _mm256_mul_ps(vals, sv));
            }
        }
    }
}

/* per-thread scratch for dequantised rows (OpenMP threads persist: grown, never shrunk) */
static _Thread_local float *tl_rows;
static _Thread_local int64_t tl_rows_floats;

static float *row_scratch(int64_t floats) {
    if (floats > tl_rows_floats) {
        float *grown = realloc(tl_rows, sizeof(float) * floats);
        if (!grown) return NULL;
        tl_rows = grown, tl_rows_floats = floats;
    }
    return tl_rows;
}

/* Every 64-byte line of n floats from p into L2 (the V rows an item reads after its scores). */
INL void prefetch_l2(const float *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 16) _mm_prefetch((const char *)(p + o), _MM_HINT_T1);
}

/* One K row against NQ q heads of its kv head (q + h * D): the lane sums of the NQ dot products, stored at
 * out + 8 * h (reduced later, 8 positions at once). Each K vector is loaded once for all NQ heads. */
INL void k_dots(const int NQ, const float *q, const float *k, int D, float *out) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int h = 0; h < NQ; h++) acc[h] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 kv = _mm256_loadu_ps(k + d);
#pragma GCC unroll 8
        for (int h = 0; h < NQ; h++)
            acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (int64_t)h * D + d), kv, acc[h]);
    }
#pragma GCC unroll 8
    for (int h = 0; h < NQ; h++) _mm256_store_ps(out + 8 * h, acc[h]);
}

/* The same item on AVX2 (fp32 cache, or an 8-bit one dequantised first; D % 8 == 0). Scores, 8 positions
 * at a time (a tail group repeats its last position; its extra lanes are masked). An fp32 item of every
 * kv head reads each position's row once, in memory order (its kv heads in turn, each K vector serving
 * the kv head's 1-8 q heads), keeps the lane sums of every (position, q head), then reduces each q
 * head's 8 together: from memory this streams ~1.15x faster than a q head at a time over 8 rows
 * (SmolLM2-135M's 768-byte rows, Zen 3). Other items take a q head at a time, 8 positions' dot
 * products accumulated together. Both give the same bits: each dot product is the same fma chain and
 * the same reduction. Software prefetch: only the item's V rows, into L2, as its K rows are read (an
 * item of every kv head: each position's row with its K row; other items: each group of 8 positions'
 * spans), so the V pass reads L2 while the K rows' fetch overlaps the scores (Zen 4: the fused step
 * 1.07x faster at 4,000 tokens, 1.2x at batch 16 x 1,000 and 48 x 512, 1.02-1.06x at batch 1 x
 * 500-700, where the items take a kv head each). K rows are left to the hardware's
 * stream prefetchers (each item is a run of 16-position blocks): prefetching K 16 positions ahead into L1
 * made the step slower on Zen 3 (with the V prefetch, 1.05x) and on Zen 4 (alone, 1.1x in a harness)
 * (docs/performance.md, "Decode attention in place"). Softmax on 8 scores at a time. Values: tiles of
 * V_TILE positions, every q head of the item accumulating CHUNK values in registers over the tile
 * while its V rows are in L1. */
static void attend_avx2(const AttnWork *a, int b, int hq0, int hq1, int t0, int t1, float *m_out,
                        float *l_out, float *acc_out) {
    const int D = a->head_dim, G = a->num_heads / a->num_kv_heads, n = t1 - t0, bs = a->block_size;
    const int32_t *table = a->block_table + (int64_t)b * a->max_blocks;
    const float *q = a->q + b * a->q_row_stride;
    const float *kc = (const float *)a->k, *vc = (const float *)a->v;
    const int64_t slot_stride = (int64_t)a->num_kv_heads * D;
    /* the item's kv heads [hq0 / G, (hq1 - 1) / G] are one contiguous run of each slot */
    const int64_t span_off = (int64_t)(hq0 / G) * D, span = (int64_t)((hq1 - 1) / G + 1) * D - span_off;
    float scores[MAX_GROUP][SPLIT_TOKENS] __attribute__((aligned(32)));
    int64_t rows[SPLIT_TOKENS + 8]; /* offset of each position's slot in either cache */
    for (int t = t0; t < t1;) { /* one block at a time: one division per block */
        const int64_t base = (int64_t)table[t / bs] * bs;
        for (int off = t % bs; off < bs && t < t1; off++, t++) rows[t - t0] = (base + off) * slot_stride;
    }
    if (a->lut != NULL) { /* 8-bit: this item's K and V rows as fp32, then the fp32 code */
        float *buf = row_scratch(2 * (int64_t)n * span);
        if (buf == NULL) { /* no memory for the rows: the portable loops read the codes */
            attend_portable(a, b, hq0, hq1, t0, t1, m_out, l_out, acc_out);
            return;
        }
        const int kh0 = hq0 / G, kh1 = (hq1 - 1) / G + 1;
        dequantise_rows(a, a->k, a->k_scale, rows, n, kh0, kh1, buf);
        dequantise_rows(a, a->v, a->v_scale, rows, n, kh0, kh1, buf + (int64_t)n * span);
        kc = buf - span_off, vc = buf + (int64_t)n * span - span_off;
        for (int i = 0; i < n; i++) rows[i] = i * span;
    }
    for (int i = n; i < ((n + 7) & ~7); i++) rows[i] = rows[n - 1]; /* the tail group's extra lanes */
    const __m256 scale = _mm256_set1_ps(a->scale);
    const int g_item = hq1 - hq0 < G ? hq1 - hq0 : G; /* q heads of each kv head in the item */
    /* whole rows in memory order: an fp32 cache's item of every kv head (a part of each row is a strided
     * read whatever the order, and there a q head at a time does less work: 1.2x faster at 128
     * positions) */
    const int by_rows = g_item <= 8 && a->lut == NULL && span == slot_stride;
    const int64_t ps = (int64_t)(hq1 - hq0) * 8;        /* floats per position in sums */
    float sums[8 * MAX_GROUP * 8] __attribute__((aligned(32))); /* [position][q head][lane] */
    for (int i = 0; i < n; i += 8) {
        if (by_rows) {
            for (int j = 0; j < 8; j++) {
                const float *row = kc + rows[i + j];
                /* this position's V row into L2 while the K rows stream: the V pass then reads L2 */
                prefetch_l2(vc + rows[i + j], slot_stride);
                for (int kh = hq0 / G; kh * G < hq1; kh++) {
                    const int h0 = kh * G > hq0 ? kh * G : hq0;
                    const float *qh = q + (int64_t)h0 * D, *k = row + (int64_t)kh * D;
                    float *o = sums + j * ps + (h0 - hq0) * 8;
                    switch (g_item) { /* the count a compile-time constant: accumulators in registers */
                    case 1: k_dots(1, qh, k, D, o); break;
                    case 2: k_dots(2, qh, k, D, o); break;
                    case 3: k_dots(3, qh, k, D, o); break;
                    case 4: k_dots(4, qh, k, D, o); break;
                    case 5: k_dots(5, qh, k, D, o); break;
                    case 6: k_dots(6, qh, k, D, o); break;
                    case 7: k_dots(7, qh, k, D, o); break;
                    default: k_dots(8, qh, k, D, o); break;
                    }
                }
            }
            for (int h = 0; h < hq1 - hq0; h++) {
                const float *l = sums + h * 8;
                const __m256 dots =
                    reduce8(_mm256_load_ps(l), _mm256_load_ps(l + ps), _mm256_load_ps(l + 2 * ps),
                            _mm256_load_ps(l + 3 * ps), _mm256_load_ps(l + 4 * ps),
                            _mm256_load_ps(l + 5 * ps), _mm256_load_ps(l + 6 * ps), _mm256_load_ps(l + 7 * ps));
                _mm256_store_ps(scores[h] + i, _mm256_mul_ps(dots, scale));
            }
            continue;
        }
        if (a->lut == NULL) /* these positions' V spans into L2 (an 8-bit item's are in its buffer) */
            for (int j = i; j < i + 8 && j < n; j++) prefetch_l2(vc + rows[j] + span_off, span);
        for (int hq = hq0; hq < hq1; hq++) { /* a q head at a time, 8 positions' dot products at once */
            const float *qh = q + hq * D, *kh = kc + (int64_t)(hq / G) * D;
            const float *k0 = kh + rows[i], *k1 = kh + rows[i + 1], *k2 = kh + rows[i + 2],
                        *k3 = kh + rows[i + 3], *k4 = kh + rows[i + 4], *k5 = kh + rows[i + 5],
                        *k6 = kh + rows[i + 6], *k7 = kh + rows[i + 7];
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                   a7 = a0;
            for (int d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k4 + d), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k5 + d), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k6 + d), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k7 + d), a7);
            }
            _mm256_store_ps(scores[hq - hq0] + i,
                            _mm256_mul_ps(reduce8(a0, a1, a2, a3, a4, a5, a6, a7), scale));
        }
    }
    const int n8 = n & ~7;
    for (int hq = hq0; hq < hq1; hq++) {
        float *s = scores[hq - hq0];
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
        m_out[hq] = m;
        l_out[hq] = hsum8(lv);
        memset(acc_out + hq * D, 0, sizeof(float) * D);
    }
    for (int i0 = 0; i0 < n; i0 += V_TILE) {
        const int i1 = i0 + V_TILE < n ? i0 + V_TILE : n;
        for (int hq = hq0; hq < hq1; hq++) {
            const float *p = scores[hq - hq0], *vh = vc + (int64_t)(hq / G) * D;
            for (int c = 0; c < D; c += CHUNK) {
                float *out = acc_out + hq * D + c;
                if (D - c >= CHUNK) { /* a full chunk: 8 accumulators, no lane test */
                    __m256 acc[CHUNK / 8];
                    for (int j = 0; j < CHUNK / 8; j++) acc[j] = _mm256_loadu_ps(out + 8 * j);
                    for (int i = i0; i < i1; i++) {
                        const __m256 pb = _mm256_broadcast_ss(p + i);
                        const float *v = vh + rows[i] + c;
                        for (int j = 0; j < CHUNK / 8; j++)
                            acc[j] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8 * j), acc[j]);
                    }
                    for (int j = 0; j < CHUNK / 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
                } else {
                    for (int j = 0; j < (D - c) / 8; j++) {
                        __m256 acc = _mm256_loadu_ps(out + 8 * j);
                        for (int i = i0; i < i1; i++)
                            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i),
                                                  _mm256_loadu_ps(vh + rows[i] + c + 8 * j), acc);
                        _mm256_storeu_ps(out + 8 * j, acc);
                    }
                }
            }
        }
    }
}
#endif /* __AVX2__ */

/* First position row b reads: 0, or the start of its window. */
static inline int first_position(const AttnWork *w, int b) {
    const int c = w->context_lens[b];
    return w->window > 0 && c > w->window ? c - w->window : 0;
}

int attention_setup(AttnWork *w, const float *q, const void *k, const void *v,
                    const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                    const int32_t *block_table, const int32_t *context_lens, float *out,
                    int64_t q_row_stride, int batch, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int num_threads) {
    return attention_setup_window(w, q, k, v, k_scale, v_scale, lut, block_table, context_lens, out,
                                  q_row_stride, batch, num_heads, num_kv_heads, head_dim,
                                  block_size, max_blocks, scale, num_threads, 0);
}

int attention_setup_window(AttnWork *w, const float *q, const void *k, const void *v,
                           const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                           const int32_t *block_table, const int32_t *context_lens, float *out,
                           int64_t q_row_stride, int batch, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks, float scale,
                           int num_threads, int window) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP ||
        head_dim > MAX_HEAD_DIM || block_size < 1 || window < 0)
        return -1;
    *w = (AttnWork){q, k, v, k_scale, v_scale, lut, block_table, context_lens, out, q_row_stride,
                    batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    w->window = window;
    const int G = num_heads / num_kv_heads;
    int max_splits = 1;
    int64_t total_tokens = 0;
    for (int b = 0; b < batch; b++) {
        /* a longer context would read past its block-table row */
        if (context_lens[b] < 0 || context_lens[b] > (int64_t)max_blocks * block_size) return -3;
        const int read = context_lens[b] - first_position(w, b); /* positions this row reads */
        int n = (read + SPLIT_TOKENS - 1) / SPLIT_TOKENS;
        max_splits = n > max_splits ? n : max_splits;
        total_tokens += read;
    }
    w->max_splits = max_splits;
    w->total_values = total_tokens * num_kv_heads * head_dim;
    /* kv heads per item: all of them (one contiguous read per position) while the rows and splits give
     * 2 items a thread, else fewer; with one kv head per item, its q heads cut into chunks likewise */
    const int64_t units = (int64_t)batch * max_splits, want = 2 * (int64_t)num_threads;
    int kv_per_item = num_kv_heads;
    while (kv_per_item > 1 && (num_kv_heads % kv_per_item || kv_per_item * G > MAX_GROUP ||
                               units * (num_kv_heads / kv_per_item) < want))
        kv_per_item--;
    int chunks = 1;
    while (kv_per_item == 1 && chunks < G && units * num_kv_heads * chunks < want) {
        chunks++;
        while (G % chunks) chunks++;
    }
    w->kv_per_item = kv_per_item;
    w->chunks = chunks;
    w->num_items = units * (num_kv_heads / kv_per_item) * chunks;
    w->isa = decode_isa() >= 2 && head_dim % 8 == 0 ? 2 : 0;
    w->int8_lut = lut != NULL;
    for (int c = 0; lut != NULL && c < 256; c++) w->int8_lut &= lut[c] == (float)(int8_t)c;
    return 0;
}

int64_t attention_parts_floats(const AttnWork *w) {
    return (int64_t)w->batch * w->max_splits * w->num_heads * (w->head_dim + 2);
}

void attention_items(const AttnWork *w, float *parts, int64_t i0, int64_t i1) {
    const int H = w->num_heads, D = w->head_dim, S = w->max_splits;
    const int per = w->kv_per_item * (H / w->num_kv_heads) / w->chunks; /* q heads per item */
    const int64_t ranges = (int64_t)H / per;                              /* q-head ranges per row */
    for (int64_t item = i0; item < i1; item++) {
        const int split = item % S, hq0 = (item / S) % ranges * per, hq1 = hq0 + per;
        const int b = item / (S * ranges);
        int t0 = first_position(w, b) + split * SPLIT_TOKENS, t1 = t0 + SPLIT_TOKENS;
        t1 = t1 < w->context_lens[b] ? t1 : w->context_lens[b];
        float *m = parts + ((int64_t)b * S + split) * H * (D + 2), *l = m + H;
        /* one split: acc straight into the output row */
        float *acc = S == 1 ? w->out + (int64_t)b * H * D : l + H;
        if (t0 >= t1) {
            for (int hq = hq0; hq < hq1; hq++) m[hq] = -INFINITY, l[hq] = 0.f;
            if (S == 1) memset(acc + hq0 * D, 0, sizeof(float) * per * D);
            continue;
        }
#ifdef __AVX2__
        if (w->isa >= 2)
            attend_avx2(w, b, hq0, hq1, t0, t1, m, l, acc);
        else
#endif
            attend_portable(w, b, hq0, hq1, t0, t1, m, l, acc);
        if (S == 1)
            for (int hq = hq0; hq < hq1; hq++) {
                const float total = 0.f + l[hq] * 1.f, inv = total > 0.f ? 1.f / total : 0.f;
                for (int d = 0; d < D; d++) acc[hq * D + d] = (0.f + acc[hq * D + d]) * inv;
            }
    }
}

void attention_merge(const AttnWork *w, const float *parts, int64_t r0, int64_t r1) {
    const int H = w->num_heads, D = w->head_dim, S = w->max_splits;
    if (S == 1) return; /* the items wrote the output */
    for (int64_t r = r0; r < r1; r++) { /* r = b * H + hq */
        const int hq = r % H, b = r / H;
        const float *first = parts + (int64_t)b * S * H * (D + 2);
        float *o = w->out + r * D;
        float big = -INFINITY, total = 0.f;
        for (int s = 0; s < S; s++) {
            float ms = first[s * H * (D + 2) + hq];
            big = ms > big ? ms : big;
        }
        memset(o, 0, sizeof(float) * D);
        for (int s = 0; s < S; s++) {
            const float *m = first + s * H * (D + 2), *l = m + H, *acc = l + H + hq * D;
            if (l[hq] == 0.f) continue;
            float wt = expf(m[hq] - big);
            total += l[hq] * wt;
            for (int d = 0; d < D; d++) o[d] += acc[d] * wt;
        }
        float inv = total > 0.f ? 1.f / total : 0.f;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

int paged_decode_attention_window(const float *q, const void *k, const void *v,
                                  const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                                  const int32_t *block_table, const int32_t *context_lens, float *out,
                                  int64_t q_row_stride, int batch, int num_heads, int num_kv_heads,
                                  int head_dim, int block_size, int max_blocks, float scale,
                                  int num_threads, int window) {
    AttnWork w;
    const int refused = attention_setup_window(
        &w, q, k, v, k_scale, v_scale, lut, block_table, context_lens, out, q_row_stride, batch,
        num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads, window);
    if (refused) return refused;
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

int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride, int batch,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads) {
    return paged_decode_attention_window(q, k, v, k_scale, v_scale, lut, block_table, context_lens,
                                         out, q_row_stride, batch, num_heads, num_kv_heads, head_dim,
                                         block_size, max_blocks, scale, num_threads, 0);
}
