/* The quantised GEMV / GEMM on the panel-interleaved layout (decode_step.h; docs/performance.md, "The
 * fused decode step").
 *
 * Activations are rounded to int8 as kvserve/quant/csrc/qgemm.cpp rounds them (per 32 inputs, per row
 * or per tensor), or per 32 inputs twice (ACT_BLOCK2, decode_step.h: the value, then its remainder,
 * as two rows of codes that store_panel adds back into one). A panel is 8 output columns whose codes are interleaved 4 inputs at a time, so one
 * 32-byte load holds 4 inputs of 8 columns: a broadcast 4-byte activation group times it
 * (vpmaddubsw + vpmaddwd) gives each column's partial sum in its own 32-bit lane. A 32-input block's
 * integer sum of 8 columns is then one vector (no horizontal sum per column), scaled once per block
 * (activation scale x the 8 columns' fp16 weight scales) into 8 fp32 accumulators. Each thread reads its
 * panels as one sequential stream (every line prefetched 8 blocks ahead); a panel serves up to 4
 * rows per pass (more rows: row tiles of 4 over the panel while it is in L1).
 *
 * int8: x * w = |w| * sign(x, w) (the weight's magnitude, computed once per load, is the unsigned
 *   operand, so a -128 code is 128; each row's codes take the weight's sign). The other order,
 *   |x| * sign(w, x) with |x| kept beside the codes (before session 1212), broadcast two vectors per
 *   row and load instead of one: the SmolLM2 head at 16 rows ran 1.4x slower.
 * int4: codes are unsigned nibbles, the unsigned operand as they are; 8 products of one block sum in
 *   int16 without overflow (8 x 2 x 15 x 127 < 2^15); the zero-point enters per block as
 *   zero x (sum of the block's activation codes).
 * The scalar path computes the same integers and the same fp32 operations in the same order
 * (explicit fmaf), so both paths give the same bits.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "decode_step.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

int alloc_acts(Acts *a, int rows, int max_kp, int with_pairs) {
    a->rows = rows, a->kp = max_kp;
    a->codes = malloc((size_t)rows * max_kp);
    a->scale = malloc(sizeof(float) * rows * (max_kp / QBLOCK));
    a->sum = malloc(sizeof(float) * rows * (max_kp / QBLOCK));
    a->pairs = with_pairs ? malloc(sizeof(uint32_t) * rows * (max_kp / 2)) : NULL;
    return a->codes && a->scale && a->sum && (a->pairs || !with_pairs);
}

void free_acts(Acts *a) { free(a->codes), free(a->scale), free(a->sum), free(a->pairs); }

/* Rounds 32 values of one block with scale d = amax / 127 into codes; returns the codes' sum. */
static int32_t round_block(const float *row, int n, float amax, int8_t *q, float *d_out, int isa) {
    const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
    *d_out = d;
    (void)isa;
#ifdef __AVX2__
    if (n == QBLOCK && isa >= 2) {
        const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
        __m256i c[4];
        for (int i = 0; i < 4; i++) {
            /* round(x * inv) half to even (the scalar path's nearbyintf), clamped to +-127 */
            __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(row + 8 * i), vinv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            c[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
        }
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
        /* packs work per 128-bit lane: restore the order with one permute */
        const __m256i p16a = _mm256_packs_epi32(c[0], c[1]), p16b = _mm256_packs_epi32(c[2], c[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                       _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, p8);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        return _mm_cvtsi128_si32(s4);
    }
#endif
    int32_t s = 0;
    for (int k = 0; k < QBLOCK; k++) {
        int32_t v = 0;
        if (k < n) {
            v = (int32_t)nearbyintf(row[k] * inv);
            v = v < -127 ? -127 : (v > 127 ? 127 : v);
        }
        q[k] = (int8_t)v;
        s += v;
    }
    return s;
}

static float abs_max(const float *x, int n, int isa) {
    float m = 0.f;
    int k = 0;
#ifdef __AVX2__
    if (isa >= 2 && n >= 8) {
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 v = _mm256_setzero_ps();
        for (; k + 8 <= n; k += 8) v = _mm256_max_ps(v, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    }
#else
    (void)isa;
#endif
    for (; k < n; k++) m = fmaxf(m, fabsf(x[k]));
    return m;
}

/* per tensor: the max over every row (M * K may not fit an int) */
static float tensor_abs_max(const float *x, int M, int K, int isa) {
    float m = 0.f;
    for (int r = 0; r < M; r++) m = fmaxf(m, abs_max(x + (int64_t)r * K, K, isa));
    return m;
}

/* rows [m0, m1) of x rounded into a (mode 2: tensor_max is the whole tensor's) */
static __attribute__((noinline)) void quantize_rows(const float *x, int m0, int m1, int K, int Kp,
                                                    int mode, float tensor_max, Acts *a, int isa) {
    const int nb = Kp / QBLOCK, per_block = mode == ACT_BLOCK || mode == ACT_BLOCK2;
    for (int m = m0; m < m1; m++) {
        const float *row = x + (int64_t)m * K;
        const float row_max = mode == ACT_ROW ? abs_max(row, K, isa) : tensor_max;
        const int64_t am = (int64_t)m * ACT_ROWS(mode); /* this row's first row of a */
        for (int b = 0; b < nb; b++) {
            const int k0 = b * QBLOCK, n = K - k0 < QBLOCK ? K - k0 : QBLOCK;
            const float amax = per_block ? abs_max(row + k0, n, isa) : row_max;
            const int64_t i = am * nb + b;
            int8_t *q = a->codes + am * Kp + k0;
            a->sum[i] = (float)round_block(row + k0, n, amax, q, &a->scale[i], isa);
            if (mode == ACT_BLOCK2) {
                /* the remainder x - d q (one rounding: fmaf on every path, so the same bits), rounded
                 * with its own scale into the next row of a */
                float rem[QBLOCK] = {0.f};
                for (int k = 0; k < n; k++) rem[k] = fmaf(-(float)q[k], a->scale[i], row[k0 + k]);
                a->sum[i + nb] =
                    (float)round_block(rem, n, abs_max(rem, n, isa), q + Kp, &a->scale[i + nb], isa);
            }
        }
    }
}

void quantize_acts(const float *x, int M, int K, int Kp, int mode, Acts *a, int isa, int num_threads) {
    const float tensor_max = mode == ACT_TENSOR ? tensor_abs_max(x, M, K, isa) : 0.f;
    if (M <= DECODE_MAX_ROWS || num_threads <= 1) { /* no region: see layer_ops.c PARALLEL */
        quantize_rows(x, 0, M, K, Kp, mode, tensor_max, a, isa);
        return;
    }
#pragma omp parallel for num_threads(num_threads)
    for (int m = 0; m < M; m++) quantize_rows(x, m, m + 1, K, Kp, mode, tensor_max, a, isa);
}

/* An fp16 scale (IEEE binary16 bits) as fp32: exact. */
static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    float f;
    if (exp == 0) {
        f = (float)man * 0x1p-24f; /* zero or subnormal */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* The 8 results of panel p for row m: v[c] (+ bias) into y for the columns that exist. */
static void store_panel(const Linear *L, const float *v, float *y, int m, int p) {
    const int n0 = p * QPANEL, count = L->n - n0 < QPANEL ? L->n - n0 : QPANEL;
    if (L->act_mode == ACT_BLOCK2) {
        /* rows 2m and 2m + 1 of the rounded activations are one row of y: the first stores (its
         * products + bias), the second adds its products. Every kernel computes a panel's rows on one
         * thread in ascending order, so the first always comes first. */
        float *out = y + (int64_t)(m >> 1) * L->n + n0;
        if (m & 1)
            for (int c = 0; c < count; c++) out[c] += v[c];
        else
            for (int c = 0; c < count; c++) out[c] = v[c] + (L->bias ? L->bias[n0 + c] : 0.f);
        return;
    }
    for (int c = 0; c < count; c++)
        y[(int64_t)m * L->n + n0 + c] = v[c] + (L->bias ? L->bias[n0 + c] : 0.f);
}

/* ---- scalar: the same integers and fp32 operations as the AVX2 path ------------------------------ */

static void q_panel_scalar(const Linear *L, const Acts *a, float *y, int p, int m) {
    const int nb = L->kp / QBLOCK, G = L->groups;
    const int int_acc = L->kind == LIN_Q8 && ACT_ONE_SCALE(L->act_mode) && G == 1;
    const uint16_t *s = (const uint16_t *)L->scales + (int64_t)p * G * QPANEL;
    const uint16_t *z = L->zeros ? (const uint16_t *)L->zeros + (int64_t)p * G * QPANEL : NULL;
    const int8_t *xq = a->codes + (int64_t)m * L->kp;
    const float *xd = a->scale + (int64_t)m * nb, *xs = a->sum + (int64_t)m * nb;
    float v[QPANEL];
    for (int c = 0; c < QPANEL; c++) {
        float acc = 0.f;
        int32_t total = 0;
        for (int b = 0; b < nb; b++) {
            int32_t isum = 0;
            if (L->kind == LIN_Q8) {
                const int8_t *w = (const int8_t *)L->w + ((int64_t)p * nb + b) * QPANEL * QBLOCK;
                for (int k = 0; k < QBLOCK; k++)
                    isum += (int32_t)w[(k / 4) * 32 + c * 4 + k % 4] * xq[b * QBLOCK + k];
            } else {
                const uint8_t *w = (const uint8_t *)L->w + ((int64_t)p * nb + b) * QPANEL * 16;
                for (int k = 0; k < 16; k++) {
                    const uint8_t byte = w[(k / 4) * 32 + c * 4 + k % 4];
                    isum += (int32_t)(byte & 0x0F) * xq[b * QBLOCK + k] +
                            (int32_t)(byte >> 4) * xq[b * QBLOCK + 16 + k];
                }
            }
            const int g = b / L->bpg;
            if (int_acc) {
                total += isum;
            } else if (L->kind == LIN_Q8) {
                acc = fmaf(G == 1 ? xd[b] : xd[b] * h2f(s[g * QPANEL + c]), (float)isum, acc);
            } else {
                const float zero = z ? h2f(z[g * QPANEL + c]) : 8.f;
                const float f = fmaf(-zero, xs[b], (float)isum);
                acc = fmaf(xd[b] * h2f(s[g * QPANEL + c]), f, acc);
            }
        }
        if (int_acc) v[c] = (float)total * xd[0] * h2f(s[c]);
        else v[c] = L->kind == LIN_Q8 && G == 1 ? acc * h2f(s[c]) : acc;
    }
    store_panel(L, v, y, m, p);
}

static int g_prefetch = 1; /* see prefetch_block */
void q_set_prefetch(int mode) { g_prefetch = mode; }

/* ---- AVX2 ------------------------------------------------------------------------------------------ */
#ifdef __AVX2__
#define INL static inline __attribute__((always_inline))

/* 8 fp16 scales as fp32 */
INL __m256 load_h8(const uint16_t *p) {
#ifdef __F16C__
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float f[8];
    for (int i = 0; i < 8; i++) f[i] = h2f(p[i]);
    return _mm256_loadu_ps(f);
#endif
}

/* Software prefetch of the weight stream. Mode 1 (default): every 64-byte line of the block 8 blocks
 * ahead (int8: 2 KB, int4: 1 KB). Mode 0: one line 4 blocks ahead (the previous kernel: the other
 * lines of a 256-byte int8 block were left to the hardware prefetcher). q_set_prefetch switches
 * them at run time so one process can time both alternately (docs/performance.md, "The fused
 * decode step"). */
INL void prefetch_block(const void *block, const int bytes) {
    if (g_prefetch == 0) {
        _mm_prefetch((const char *)block + 4 * bytes, _MM_HINT_T0);
        return;
    }
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)block + 8 * bytes + o, _MM_HINT_T0);
}

/* keeps GCC from re-associating a row's integer sums into one tree over every product of a block
 * (32 live vectors at 4 rows: spilled to the stack), so each load's products are added as they come */
#define PIN(v) __asm__("" : "+x"(v))

INL __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Rows m0 .. m0 + R - 1 of panel p, v[r] their 8 results: store_panel's operations on vectors where
 * the panel's 8 columns all exist (the same fp32 adds, so the same bits), without a call and a
 * scalar loop per row. ACT_BLOCK2: rows 2m and 2m + 1 (a tile starts at an even row and holds pairs)
 * are added in registers, (v[2m] + bias) + v[2m + 1], and stored once. */
INL void store_rows(const Linear *L, const __m256 *v, float *y, int m0, const int R, int p) {
    const int n0 = p * QPANEL;
    const int pairs = L->act_mode == ACT_BLOCK2;
    if (L->n - n0 < QPANEL || (pairs && ((m0 | R) & 1))) {
        for (int r = 0; r < R; r++) {
            float out[QPANEL];
            _mm256_storeu_ps(out, v[r]);
            store_panel(L, out, y, m0 + r, p);
        }
        return;
    }
    const __m256 bias = L->bias ? _mm256_loadu_ps(L->bias + n0) : _mm256_setzero_ps();
    if (pairs) {
        for (int r = 0; r < R; r += 2)
            _mm256_storeu_ps(y + (int64_t)((m0 + r) >> 1) * L->n + n0,
                             _mm256_add_ps(_mm256_add_ps(v[r], bias), v[r + 1]));
        return;
    }
    for (int r = 0; r < R; r++)
        _mm256_storeu_ps(y + (int64_t)(m0 + r) * L->n + n0, _mm256_add_ps(v[r], bias));
}

/* ---- a block's integer sums, R rows: blk[r] lane c = sum over the block's 32 inputs of column c's
 * code times row r's activation code (exact) ---------------------------------------------------- */

/* int8, AVX2: |w| * sign(x, w) through vpmaddubsw + vpmaddwd */
INL void q8_sums_avx2(const Acts *a, const int8_t *wb, int m0, const int R, int Kp, int b,
                      __m256i blk[]) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; r++) blk[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(wb + j * 32));
        const __m256i aw = _mm256_sign_epi8(wv, wv); /* |w|: -128 becomes 128 as unsigned */
        for (int r = 0; r < R; r++) {
            const __m256i xv = bcast4(a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK + j * 4);
            const __m256i p16 = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
            blk[r] = _mm256_add_epi32(blk[r], _mm256_madd_epi16(p16, ones));
            PIN(blk[r]);
        }
    }
}

/* int4, AVX2: 8 products of a block sum in int16 without overflow (8 x 2 x 15 x 127 < 2^15) */
INL void q4_sums_avx2(const Acts *a, const uint8_t *wb, int m0, const int R, int Kp, int b,
                      __m256i blk[]) {
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    __m256i s16[DECODE_MAX_ROWS];
    for (int r = 0; r < R; r++) s16[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + j * 32));
        const __m256i lo = _mm256_and_si256(raw, low4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
        for (int r = 0; r < R; r++) {
            const int8_t *xr = a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK + j * 4;
            s16[r] = _mm256_add_epi16(
                s16[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast4(xr)),
                                         _mm256_maddubs_epi16(hi, bcast4(xr + 16))));
            PIN(s16[r]);
        }
    }
    for (int r = 0; r < R; r++) blk[r] = _mm256_madd_epi16(s16[r], ones);
}

/* ---- AVX-512 with VNNI ------------------------------------------------------------------------------
 * The same layout and the same integers: one 64-byte load holds two 4-input groups (j, j + 1) of the
 * panel's 8 columns, lanes 0-7 group j and lanes 8-15 group j + 1; its activation vector holds group
 * j's 4 codes in lanes 0-7 and group j + 1's in lanes 8-15 (one permute of the block's 32 codes).
 * vpdpbusd multiplies unsigned by signed bytes and sums each lane's 4 products into 32 bits:
 *   int8: the weights made unsigned, w + 128 = w ^ 0x80, times the signed activation codes:
 *     sum (w + 128) x = sum w x + 128 sum x, and the block's sum of codes is known (Acts.sum), so
 *     the block sum is exact for every code, -128 included;
 *   int4: the unsigned nibbles times the signed codes as they are.
 * The two halves are added (exact integers), and from there the fp32 operations are the AVX2 path's,
 * in the same order, on the same integers: the same bits. Decode rows (M <= 4) take one panel at a
 * time: one sequential stream per thread from DRAM. More rows take tiles of 2 panels x up to 4 rows:
 * each row's activation vectors (4 permutes a block) serve both panels, and the two panels' sums are
 * folded, scaled and accumulated as one 16-lane vector (32 rows, cached: 1.2-1.3x the one-panel
 * tile; at one row from DRAM the two streams ran 1.4x slower than one, so decode keeps one). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_Q512 1

/* the block's 32 activation codes as 4 vectors: pair q = group 2q (lanes 0-7), 2q + 1 (lanes 8-15) */
INL void act_pairs(const int8_t *x, __m512i out[4]) {
    const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x));
    out[0] = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), v);
    out[1] = _mm512_permutexvar_epi32(_mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), v);
    out[2] = _mm512_permutexvar_epi32(_mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5), v);
    out[3] = _mm512_permutexvar_epi32(_mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7), v);
}

/* the 8 columns' block sums: lanes c and 8 + c added */
INL __m256i fold_halves(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* int8, AVX-512 VNNI: (w ^ 0x80) x codes, less 128 x the block's code sum */
INL void q8_sums512(const Acts *a, const int8_t *wb, int m0, const int R, int Kp, int nb, int b,
                    __m256i blk[]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i w[4];
    for (int i = 0; i < 4; i++) w[i] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * i), flip);
    for (int r = 0; r < R; r++) {
        __m512i x[4];
        act_pairs(a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK, x);
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x[0]);
        for (int q = 1; q < 4; q++) d = _mm512_dpbusd_epi32(d, w[q], x[q]);
        const int32_t sum = (int32_t)a->sum[(int64_t)(m0 + r) * nb + b];
        blk[r] = _mm256_sub_epi32(fold_halves(d), _mm256_set1_epi32(128 * sum));
    }
}

/* int4, AVX-512 VNNI: the unsigned nibbles x codes */
INL void q4_sums512(const Acts *a, const uint8_t *wb, int m0, const int R, int Kp, int b,
                    __m256i blk[]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i raw0 = _mm512_loadu_si512(wb), raw1 = _mm512_loadu_si512(wb + 64);
    const __m512i w[4] = {_mm512_and_si512(raw0, low4), _mm512_and_si512(raw1, low4),
                          _mm512_and_si512(_mm512_srli_epi16(raw0, 4), low4),
                          _mm512_and_si512(_mm512_srli_epi16(raw1, 4), low4)};
    for (int r = 0; r < R; r++) {
        __m512i x[4]; /* inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 (high) */
        act_pairs(a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK, x);
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x[0]);
        for (int q = 1; q < 4; q++) d = _mm512_dpbusd_epi32(d, w[q], x[q]);
        blk[r] = fold_halves(d);
    }
}
#endif /* AVX-512 VNNI */

/* int8, R rows m0 .. m0 + R - 1 of panel p: each block's sums (vnni: q8_sums512, else AVX2), then
 * the same fp32 operations on them. */
INL void q8_panel(const Linear *L, const Acts *a, float *y, int p, int m0, const int R,
                  const int int_acc, const int vnni) {
    const int nb = L->kp / QBLOCK, G = L->groups, Kp = L->kp;
    const int8_t *w = (const int8_t *)L->w + (int64_t)p * nb * QPANEL * QBLOCK;
    const uint16_t *s = (const uint16_t *)L->scales + (int64_t)p * G * QPANEL;
    __m256 acc[DECODE_MAX_ROWS];
    __m256i total[DECODE_MAX_ROWS];
    (void)vnni;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), total[r] = _mm256_setzero_si256();
    for (int b = 0, g = 0, gb = 0; b < nb; b++) {
        const int8_t *wb = w + (int64_t)b * QPANEL * QBLOCK;
        __m256i blk[DECODE_MAX_ROWS];
        prefetch_block(wb, QPANEL * QBLOCK);
#ifdef HAVE_Q512
        if (vnni) q8_sums512(a, wb, m0, R, Kp, nb, b, blk);
        else
#endif
            q8_sums_avx2(a, wb, m0, R, Kp, b, blk);
        if (int_acc) {
            for (int r = 0; r < R; r++) total[r] = _mm256_add_epi32(total[r], blk[r]);
            continue;
        }
        /* group g of block b (a counter: no integer division per block) */
        const __m256 sv = G == 1 ? _mm256_setzero_ps() : load_h8(s + g * QPANEL);
        if (++gb == L->bpg) gb = 0, g++;
        for (int r = 0; r < R; r++) {
            const __m256 d = _mm256_set1_ps(a->scale[(int64_t)(m0 + r) * nb + b]);
            acc[r] = _mm256_fmadd_ps(G == 1 ? d : _mm256_mul_ps(d, sv), _mm256_cvtepi32_ps(blk[r]),
                                     acc[r]);
        }
    }
    const __m256 s0 = load_h8(s);
    __m256 v[DECODE_MAX_ROWS];
    for (int r = 0; r < R; r++) {
        if (int_acc)
            v[r] = _mm256_mul_ps(
                _mm256_mul_ps(_mm256_cvtepi32_ps(total[r]),
                              _mm256_set1_ps(a->scale[(int64_t)(m0 + r) * nb])),
                s0);
        else v[r] = G == 1 ? _mm256_mul_ps(acc[r], s0) : acc[r];
    }
    store_rows(L, v, y, m0, R, p);
}

/* int4, R rows of panel p (as q8_panel): the zero-point enters per block as zero x (sum of the block's
 * activation codes). */
INL void q4_panel(const Linear *L, const Acts *a, float *y, int p, int m0, const int R,
                  const int vnni) {
    const int nb = L->kp / QBLOCK, G = L->groups, Kp = L->kp;
    const uint8_t *w = (const uint8_t *)L->w + (int64_t)p * nb * QPANEL * 16;
    const uint16_t *s = (const uint16_t *)L->scales + (int64_t)p * G * QPANEL;
    const uint16_t *z = L->zeros ? (const uint16_t *)L->zeros + (int64_t)p * G * QPANEL : NULL;
    const __m256 eight = _mm256_set1_ps(8.f);
    __m256 acc[DECODE_MAX_ROWS];
    (void)vnni;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int b = 0, g = 0, gb = 0; b < nb; b++) {
        const uint8_t *wb = w + (int64_t)b * QPANEL * 16;
        __m256i blk[DECODE_MAX_ROWS];
        prefetch_block(wb, QPANEL * QBLOCK / 2);
#ifdef HAVE_Q512
        if (vnni) q4_sums512(a, wb, m0, R, Kp, b, blk);
        else
#endif
            q4_sums_avx2(a, wb, m0, R, Kp, b, blk);
        const __m256 sv = load_h8(s + g * QPANEL);
        const __m256 zv = z ? load_h8(z + g * QPANEL) : eight;
        if (++gb == L->bpg) gb = 0, g++;
        for (int r = 0; r < R; r++) {
            const int64_t i = (int64_t)(m0 + r) * nb + b;
            const __m256 f =
                _mm256_fnmadd_ps(zv, _mm256_set1_ps(a->sum[i]), _mm256_cvtepi32_ps(blk[r]));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(a->scale[i]), sv), f, acc[r]);
        }
    }
    store_rows(L, acc, y, m0, R, p);
}

/* Q8(RR) or Q4(RR) by the kind, with RR = R (1-4) as a constant: each tile height is its own code */
#define BY_ROWS(kind, R, Q8, Q4)                                                                  \
    do {                                                                                          \
        const int rows_ = (R);                                                                    \
        if ((kind) == LIN_Q8) {                                                                   \
            if (rows_ == 1) Q8(1);                                                                \
            else if (rows_ == 2) Q8(2);                                                           \
            else if (rows_ == 3) Q8(3);                                                           \
            else Q8(4);                                                                           \
        } else {                                                                                  \
            if (rows_ == 1) Q4(1);                                                                \
            else if (rows_ == 2) Q4(2);                                                           \
            else if (rows_ == 3) Q4(3);                                                           \
            else Q4(4);                                                                           \
        }                                                                                         \
    } while (0)

/* rows 0 .. M - 1 of panel p in row tiles of 4 (vnni: the block sums of q8_sums512 / q4_sums512) */
INL void q_panel_rows(const Linear *L, const Acts *a, int M, float *y, int p, const int vnni) {
    const int int_acc = L->kind == LIN_Q8 && ACT_ONE_SCALE(L->act_mode) && L->groups == 1;
    for (int m0 = 0; m0 < M; m0 += DECODE_MAX_ROWS) {
        const int R = M - m0 < DECODE_MAX_ROWS ? M - m0 : DECODE_MAX_ROWS;
#define Q8(RR) (int_acc ? q8_panel(L, a, y, p, m0, RR, 1, vnni) : q8_panel(L, a, y, p, m0, RR, 0, vnni))
#define Q4(RR) q4_panel(L, a, y, p, m0, RR, vnni)
        BY_ROWS(L->kind, R, Q8, Q4);
#undef Q8
#undef Q4
    }
}

#ifdef HAVE_Q512
/* Two panels' block sums side by side: lanes 0-7 panel A's columns (its lanes c and 8 + c added),
 * lanes 8-15 panel B's. */
INL __m512i fold_pair(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}

/* 16 fp16 scales as fp32: panel A's 8 (lanes 0-7), panel B's 8 (lanes 8-15) */
INL __m512 load_h8x2(const uint16_t *a, const uint16_t *b) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)a), hi = _mm_loadu_si128((const __m128i *)b);
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

/* the 16 results of panels pa (lanes 0-7) and pb (8-15; not stored when pb == pa) for row m */
INL void store_pair(const Linear *L, __m512 v, float *y, int m, int pa, int pb) {
    float out[2 * QPANEL];
    _mm512_storeu_ps(out, v);
    store_panel(L, out, y, m, pa);
    if (pb != pa) store_panel(L, out + QPANEL, y, m, pb);
}

/* int8, R rows m0 .. m0 + R - 1 of panels pa and pb (pb == pa: one panel, computed twice and stored
 * once). Each row's 4 activation vectors serve both panels; per lane, the AVX2 q8_panel's integers and
 * fp32 operations. */
/* this row tile's share of the next pair's lines: nxt_step bytes at block b (none: nxt NULL) */
INL void next_pair_lines(const char *nxt, int b, int nxt_step, const char *nxt_end) {
    if (!nxt) return;
    for (const char *p = nxt + (int64_t)b * nxt_step, *e = p + nxt_step; p < e && p < nxt_end; p += 64)
        _mm_prefetch(p, _MM_HINT_T0);
}

INL void q8_pair512(const Linear *L, const Acts *a, float *y, int pa, int pb, int m0, const int R,
                    const int int_acc, const char *nxt, int nxt_step, const char *nxt_end) {
    const int nb = L->kp / QBLOCK, G = L->groups, Kp = L->kp;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *wa = (const int8_t *)L->w + (int64_t)pa * nb * QPANEL * QBLOCK;
    const int8_t *wbp = (const int8_t *)L->w + (int64_t)pb * nb * QPANEL * QBLOCK;
    const uint16_t *sa = (const uint16_t *)L->scales + (int64_t)pa * G * QPANEL;
    const uint16_t *sb = (const uint16_t *)L->scales + (int64_t)pb * G * QPANEL;
    __m512 acc[DECODE_MAX_ROWS];
    __m512i total[DECODE_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps(), total[r] = _mm512_setzero_si512();
    for (int b = 0, g = 0, gb = 0; b < nb; b++) {
        const int8_t *ba = wa + (int64_t)b * QPANEL * QBLOCK, *bb = wbp + (int64_t)b * QPANEL * QBLOCK;
        prefetch_block(ba, QPANEL * QBLOCK);
        if (pb != pa) prefetch_block(bb, QPANEL * QBLOCK);
        next_pair_lines(nxt, b, nxt_step, nxt_end);
        __m512i A[4], B[4];
        for (int i = 0; i < 4; i++) {
            A[i] = _mm512_xor_si512(_mm512_loadu_si512(ba + 64 * i), flip);
            B[i] = _mm512_xor_si512(_mm512_loadu_si512(bb + 64 * i), flip);
        }
        const __m512 sv = G == 1 ? _mm512_setzero_ps() : load_h8x2(sa + g * QPANEL, sb + g * QPANEL);
        if (++gb == L->bpg) gb = 0, g++;
        for (int r = 0; r < R; r++) {
            const int64_t i = (int64_t)(m0 + r) * nb + b;
            __m512i x[4];
            act_pairs(a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK, x);
            __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), A[0], x[0]);
            __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), B[0], x[0]);
            for (int q = 1; q < 4; q++)
                da = _mm512_dpbusd_epi32(da, A[q], x[q]), db = _mm512_dpbusd_epi32(db, B[q], x[q]);
            const __m512i blk = _mm512_sub_epi32(fold_pair(da, db), _mm512_set1_epi32(128 * (int32_t)a->sum[i]));
            if (int_acc) {
                total[r] = _mm512_add_epi32(total[r], blk);
            } else {
                const __m512 d = _mm512_set1_ps(a->scale[i]);
                acc[r] = _mm512_fmadd_ps(G == 1 ? d : _mm512_mul_ps(d, sv), _mm512_cvtepi32_ps(blk), acc[r]);
            }
        }
    }
    const __m512 s0 = load_h8x2(sa, sb);
    for (int r = 0; r < R; r++) {
        __m512 v;
        if (int_acc)
            v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(total[r]),
                                            _mm512_set1_ps(a->scale[(int64_t)(m0 + r) * nb])),
                              s0);
        else v = G == 1 ? _mm512_mul_ps(acc[r], s0) : acc[r];
        store_pair(L, v, y, m0 + r, pa, pb);
    }
}

/* int4, R rows of panels pa and pb (as q8_pair512). A 64-byte load holds groups j, j + 1 of a block's
 * first 16 inputs (low nibbles) and of its last 16 (high nibbles). */
INL void q4_pair512(const Linear *L, const Acts *a, float *y, int pa, int pb, int m0, const int R,
                    const char *nxt, int nxt_step, const char *nxt_end) {
    const int nb = L->kp / QBLOCK, G = L->groups, Kp = L->kp;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const uint8_t *wa = (const uint8_t *)L->w + (int64_t)pa * nb * QPANEL * 16;
    const uint8_t *wbp = (const uint8_t *)L->w + (int64_t)pb * nb * QPANEL * 16;
    const uint16_t *sa = (const uint16_t *)L->scales + (int64_t)pa * G * QPANEL;
    const uint16_t *sb = (const uint16_t *)L->scales + (int64_t)pb * G * QPANEL;
    const uint16_t *za = L->zeros ? (const uint16_t *)L->zeros + (int64_t)pa * G * QPANEL : NULL;
    const uint16_t *zb = L->zeros ? (const uint16_t *)L->zeros + (int64_t)pb * G * QPANEL : NULL;
    const __m512 eight = _mm512_set1_ps(8.f);
    __m512 acc[DECODE_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0, g = 0, gb = 0; b < nb; b++) {
        const uint8_t *ba = wa + (int64_t)b * QPANEL * 16, *bb = wbp + (int64_t)b * QPANEL * 16;
        prefetch_block(ba, QPANEL * QBLOCK / 2);
        if (pb != pa) prefetch_block(bb, QPANEL * QBLOCK / 2);
        next_pair_lines(nxt, b, nxt_step, nxt_end);
        __m512i A[4], B[4]; /* [0], [1]: low nibbles of groups 0-1, 2-3; [2], [3]: high nibbles */
        for (int i = 0; i < 2; i++) {
            const __m512i ra = _mm512_loadu_si512(ba + 64 * i), rb = _mm512_loadu_si512(bb + 64 * i);
            A[i] = _mm512_and_si512(ra, low4), A[2 + i] = _mm512_and_si512(_mm512_srli_epi16(ra, 4), low4);
            B[i] = _mm512_and_si512(rb, low4), B[2 + i] = _mm512_and_si512(_mm512_srli_epi16(rb, 4), low4);
        }
        const __m512 sv = load_h8x2(sa + g * QPANEL, sb + g * QPANEL);
        const __m512 zv = za ? load_h8x2(za + g * QPANEL, zb + g * QPANEL) : eight;
        if (++gb == L->bpg) gb = 0, g++;
        for (int r = 0; r < R; r++) {
            const int64_t i = (int64_t)(m0 + r) * nb + b;
            __m512i x[4]; /* inputs 0-7, 8-15 (low nibbles), 16-23, 24-31 (high) */
            act_pairs(a->codes + (int64_t)(m0 + r) * Kp + b * QBLOCK, x);
            __m512i da = _mm512_dpbusd_epi32(_mm512_setzero_si512(), A[0], x[0]);
            __m512i db = _mm512_dpbusd_epi32(_mm512_setzero_si512(), B[0], x[0]);
            for (int q = 1; q < 4; q++)
                da = _mm512_dpbusd_epi32(da, A[q], x[q]), db = _mm512_dpbusd_epi32(db, B[q], x[q]);
            const __m512 f = _mm512_fnmadd_ps(zv, _mm512_set1_ps(a->sum[i]),
                                              _mm512_cvtepi32_ps(fold_pair(da, db)));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(a->scale[i]), sv), f, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) store_pair(L, acc[r], y, m0 + r, pa, pb);
}

/* panels [p0, p1) of every row: pairs of panels (an odd last one alone), row tiles of 4 while the
 * pair's codes are in cache. The later row tiles prefetch the next pair's codes, spread over them,
 * so that the next pair's first tile finds them in cache (as the fp32 GEMM does from 5 tiles on).
 * On the 120 block linears of the SmolLM2-shaped model, 20 paired alternations (Zen 4, 2 threads),
 * int8 8 / 16 / 32 / 64 rows 1.08 / 1.13 / 1.11 / 1.03x, int4-g32 1.05 / 1.06 / 1.01-1.05 /
 * 1.05x faster (benchmarks/results/zen4_avx512/next_panels/). */
static void q_panels_512(const Linear *L, const Acts *a, int M, float *y, int p0, int p1) {
    const int int_acc = L->kind == LIN_Q8 && ACT_ONE_SCALE(L->act_mode) && L->groups == 1;
    if (M <= DECODE_MAX_ROWS) { /* decode rows: one panel at a time (one stream from DRAM) */
        for (int p = p0; p < p1; p++) q_panel_rows(L, a, M, y, p, 1);
        return;
    }
    const int nb = L->kp / QBLOCK, tiles = (M + DECODE_MAX_ROWS - 1) / DECODE_MAX_ROWS;
    const int64_t panel_bytes = (int64_t)nb * QPANEL * (L->kind == LIN_Q8 ? QBLOCK : QBLOCK / 2);
    for (int pa = p0; pa < p1; pa += 2) {
        const int pb = pa + 1 < p1 ? pa + 1 : pa;
        /* the next pair (panels are contiguous): its bytes spread over the later row tiles */
        const int next = pb + 1 < p1 ? (pb + 2 < p1 ? 2 : 1) : 0;
        const char *nxt_base =
            tiles >= 2 && next ? (const char *)L->w + (int64_t)(pb + 1) * panel_bytes : NULL;
        const char *nxt_end = nxt_base ? nxt_base + next * panel_bytes : NULL;
        const int64_t share = nxt_base ? (next * panel_bytes + tiles - 2) / (tiles - 1) : 0;
        const int nxt_step = (int)(((share + nb - 1) / nb + 63) / 64 * 64);
        for (int m0 = 0; m0 < M; m0 += DECODE_MAX_ROWS) {
            const int R = M - m0 < DECODE_MAX_ROWS ? M - m0 : DECODE_MAX_ROWS, t = m0 / DECODE_MAX_ROWS;
            const char *nxt = nxt_base && t > 0 ? nxt_base + (t - 1) * share : NULL;
            const char *nxt_stop = nxt ? (nxt + share < nxt_end ? nxt + share : nxt_end) : NULL;
#define Q8(RR) (int_acc ? q8_pair512(L, a, y, pa, pb, m0, RR, 1, nxt, nxt_step, nxt_stop) \
                        : q8_pair512(L, a, y, pa, pb, m0, RR, 0, nxt, nxt_step, nxt_stop))
#define Q4(RR) q4_pair512(L, a, y, pa, pb, m0, RR, nxt, nxt_step, nxt_stop)
            BY_ROWS(L->kind, R, Q8, Q4);
#undef Q8
#undef Q4
        }
    }
}
#endif /* AVX-512 VNNI */

static void q_panel_avx2(const Linear *L, const Acts *a, int M, float *y, int p) {
    q_panel_rows(L, a, M, y, p, 0);
}
#endif /* __AVX2__ */

/* panels [p0, p1) of y on this thread (inlined into q_linear_x: no call through the PLT per panel) */
INL void panels_range(const Linear *L, const Acts *a, int M, float *y, int isa, int p0, int p1) {
    (void)isa;
#ifdef HAVE_Q512
    if (isa >= 3) {
        q_panels_512(L, a, M, y, p0, p1);
        return;
    }
#endif
    for (int p = p0; p < p1; p++) {
#ifdef __AVX2__
        if (isa >= 2) {
            q_panel_avx2(L, a, M, y, p);
            continue;
        }
#endif
        for (int m = 0; m < M; m++) q_panel_scalar(L, a, y, p, m);
    }
}

void q_linear_panels(const Linear *L, const Acts *a, int M, float *y, int isa, int p0, int p1) {
    panels_range(L, a, M, y, isa, p0, p1);
}

/* Rows up to this many are rounded by every thread of q_linear_x into its own buffer (no barrier);
 * more are split over the threads, then a barrier. */
#define QUANT_SPLIT_ROWS 64

/* y [M, N] = round(x) W^T + b for any M in one parallel region: the rounding and the panels. Under
 * OMP_WAIT_POLICY=PASSIVE each region wakes the sleeping threads (tens of us here), and a linear of a
 * prefill or a large batch used to open two (rounding, then the panels). Every thread rounds
 * every row itself when there are few (the same code on the same input: the same bits), else its
 * share of the rows into the shared buffer before a barrier. 0, or -2 when a buffer cannot be had. */
int q_linear_x(const Linear *L, const float *x, int M, float *y, int isa, int num_threads) {
    const int own = M <= QUANT_SPLIT_ROWS || num_threads == 1, copies = own ? num_threads : 1;
    const int MA = M * ACT_ROWS(L->act_mode); /* rows of rounded activations */
    Acts *acts = calloc(copies, sizeof(Acts));
    int status = acts ? 0 : -2;
    for (int t = 0; t < copies && status == 0; t++)
        if (!alloc_acts(&acts[t], MA, L->kp, 0)) status = -2;
    if (status == 0) {
        const float tensor_max = L->act_mode == ACT_TENSOR ? tensor_abs_max(x, M, L->k, isa) : 0.f;
        const int num_panels = (L->n + QPANEL - 1) / QPANEL, guided = decode_guided();
        const long long min_k = decode_claim_min_panels(L, MA);
        atomic_llong next = 0; /* guided: the next unclaimed panel (decode_claim_panels) */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
        {
            const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
            Acts *a = &acts[own ? tid : 0];
            if (own) {
                quantize_rows(x, 0, M, L->k, L->kp, L->act_mode, tensor_max, a, isa);
            } else {
                quantize_rows(x, (int)((int64_t)M * tid / nt), (int)((int64_t)M * (tid + 1) / nt),
                              L->k, L->kp, L->act_mode, tensor_max, a, isa);
#pragma omp barrier
            }
            if (guided && nt > 1) {
                for (long long c, k; decode_claim_panels(&next, num_panels, nt, min_k, &c, &k);)
                    panels_range(L, a, MA, y, isa, (int)c, (int)(c + k));
            } else {
                const int64_t p0 = (int64_t)num_panels * tid / nt;
                const int64_t p1 = (int64_t)num_panels * (tid + 1) / nt;
                panels_range(L, a, MA, y, isa, (int)p0, (int)p1);
            }
        }
    }
    for (int t = 0; acts && t < copies; t++) free_acts(&acts[t]);
    free(acts);
    return status;
}
