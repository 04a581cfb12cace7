/* bf16 products, fp32 sums: y [M, N] = bf16(x) bf16(W)^T + b (LIN_BF16DOT, decode_step.h).
 *
 * The linear llama.cpp runs for a BF16 GGUF and vLLM's CPU build runs by default: weights stored in
 * bf16, each row of activations rounded to bf16 (nearest, ties to even) before the product, products
 * summed in fp32. A product of two bf16 values is exact in fp32, so the only roundings are the
 * inputs' and the sums'. On a CPU with AVX512_BF16 one vdpbf16ps does 32 multiply-adds (16 columns x
 * one pair of inputs): twice the fp32 FMA's work per instruction, from half the weight bytes.
 * (docs/performance.md, "bf16 products").
 *
 * Order of operations, the same on every path (so that every path gives the same bits): each column's
 * sum starts at 0 and takes the input pairs (2j, 2j + 1) in order; per pair it adds the odd input's
 * product, then the even one's, each with one rounding (a fused multiply-add; the product is exact), as
 * Intel's definition of vdpbf16ps does. Inputs are flushed to zero when subnormal (the instruction
 * treats them so: the rounding here flushes activations, fused_decode.bf16_pair_panels weights).
 * Results that would be subnormal are flushed by the instruction and not by the fallbacks; such sums
 * (|y| < 1.2e-38) do not occur in a model's linears.
 *
 * Layout (decode_step.h): panel p, pair j: w[p][j][c][t] = bf16(W[16p + c][2j + t]), K padded to an
 * even Kp with zeros; one 64-byte line per pair holds the panel's 16 columns. Activations: pairs
 * [M][Kp / 2] of uint32, bf16(x[m][2j]) in the low half, bf16(x[m][2j + 1]) in the high half.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_step.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define BD_AVX512 1
#if defined(__AVX512BF16__)
#define BD_INSN 1
#endif
#endif

static int g_bf16_insn = 1; /* 0: the AVX-512 level emulates vdpbf16ps with FMAs (tests compare) */
void decode_set_bf16_insn(int enabled) { g_bf16_insn = enabled; }

/* whether this CPU and build run vdpbf16ps (AVX512_BF16) */
int decode_has_bf16_insn(void) {
#ifdef BD_INSN
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("avx512bf16");
    return cached;
#else
    return 0;
#endif
}

/* fp32 -> bf16 bits, nearest with ties to even; subnormals and zeros to a signed zero; NaN stays NaN */
static inline uint32_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t exp = u & 0x7F800000u;
    if (exp == 0) return (u >> 16) & 0x8000u;
    if (exp == 0x7F800000u) return (u >> 16) | ((u & 0x7FFFFFu) ? 0x40u : 0u);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

void bf16_round_rows(const float *x, int m0, int m1, int K, int Kp, uint32_t *pairs) {
    const int J = Kp / 2;
    for (int m = m0; m < m1; m++) {
        const float *xr = x + (int64_t)m * K;
        uint32_t *pr = pairs + (int64_t)m * J;
        for (int j = 0; j < K / 2; j++) pr[j] = to_bf16(xr[2 * j]) | to_bf16(xr[2 * j + 1]) << 16;
        for (int j = K / 2; j < J; j++) pr[j] = 2 * j < K ? to_bf16(xr[2 * j]) : 0u;
    }
}

static inline float bf16_value(uint32_t bits16) {
    const uint32_t u = bits16 << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void store_cols(const Linear *L, float *y, int m, int n0, const float *sums) {
    const int cols = L->n - n0 < FPANEL ? L->n - n0 : FPANEL;
    float *yr = y + (int64_t)m * L->n + n0;
    for (int c = 0; c < cols; c++) yr[c] = sums[c] + (L->bias ? L->bias[n0 + c] : 0.f);
}

static void bd_panel_scalar(const Linear *L, const uint32_t *xp, int M, float *y, int p) {
    const int J = L->kp / 2;
    const uint16_t *w = (const uint16_t *)L->w + (int64_t)p * J * FPANEL * 2;
    float sums[FPANEL];
    for (int m = 0; m < M; m++) {
        const uint32_t *xr = xp + (int64_t)m * J;
        for (int c = 0; c < FPANEL; c++) {
            float acc = 0.f;
            for (int j = 0; j < J; j++) {
                const uint16_t *wj = w + ((int64_t)j * FPANEL + c) * 2;
                acc = fmaf(bf16_value(xr[j] >> 16), bf16_value(wj[1]), acc);
                acc = fmaf(bf16_value(xr[j] & 0xFFFFu), bf16_value(wj[0]), acc);
            }
            sums[c] = acc;
        }
        store_cols(L, y, m, p * FPANEL, sums);
    }
}

#ifdef BD_AVX512
#define INL static inline __attribute__((always_inline))
#define BD_PREFETCH_LINES 16

INL void bd_out(const Linear *L, float *y, int m, int n0, __m512 v) {
    const int cols = L->n - n0 < FPANEL ? L->n - n0 : FPANEL;
    if (cols == FPANEL && !L->bias) {
        _mm512_storeu_ps(y + (int64_t)m * L->n + n0, v);
        return;
    }
    float sums[FPANEL];
    _mm512_storeu_ps(sums, v);
    store_cols(L, y, m, n0, sums);
}

/* acc += the pair's two products (odd input first), from one line of 16 columns x 2 inputs `w` and a
 * row's pair `xb` broadcast to every lane */
INL __m512 bd_madd(__m512 acc, __m512i w, __m512i xb, const int insn) {
#ifdef BD_INSN
    if (insn) return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)xb);
#endif
    (void)insn;
    const __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    const __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)));
    const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(xb, 16));
    const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(xb, _mm512_set1_epi32((int)0xFFFF0000u)));
    return _mm512_fmadd_ps(x_even, w_even, _mm512_fmadd_ps(x_odd, w_odd, acc));
}

/* R rows (m0 ..) x NP panels (p ..), R x NP <= 12 accumulators, named (an array spills: see
 * decode_step.c f32_panel_tile) */
INL void bd_tile(const Linear *L, const uint32_t *xp, float *y, int p, const int NP, int m0, const int R,
                 int prefetch, const int insn) {
    const int J = L->kp / 2;
    const int64_t pstride = (int64_t)J * FPANEL; /* uint32 (one pair of a column) per line entry */
    const uint32_t *w = (const uint32_t *)L->w + (int64_t)p * pstride;
    const uint32_t *xr = xp + (int64_t)m0 * J;
    __m512 a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23;
    __m512 a30, a31, a32, a33, a40, a41, a42, a43, a50, a51, a52, a53; /* a?2, a?3: unused, dropped */
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = _mm512_setzero_ps();
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = _mm512_setzero_ps();
    for (int j = 0; j < J; j++) {
        const uint32_t *wj = w + (int64_t)j * FPANEL;
        __m512i w0, w1 = _mm512_setzero_si512(), w2 = w1, w3 = w1;
#define BD_PF(q) _mm_prefetch((const char *)(wj + (q) * pstride + BD_PREFETCH_LINES * FPANEL), _MM_HINT_T0)
        if (prefetch) BD_PF(0);
        w0 = _mm512_loadu_si512(wj);
        if (NP > 1) {
            if (prefetch) BD_PF(1);
            w1 = _mm512_loadu_si512(wj + pstride);
        }
        if (NP > 2) {
            if (prefetch) BD_PF(2), BD_PF(3);
            w2 = _mm512_loadu_si512(wj + 2 * pstride), w3 = _mm512_loadu_si512(wj + 3 * pstride);
        }
#undef BD_PF
#define BD_ROW(r)                                                                                   \
    if (R > r) {                                                                                    \
        const __m512i xb = _mm512_set1_epi32((int)xr[(int64_t)(r) * J + j]);                        \
        a##r##0 = bd_madd(a##r##0, w0, xb, insn);                                                   \
        if (NP > 1) a##r##1 = bd_madd(a##r##1, w1, xb, insn);                                       \
        if (NP > 2) a##r##2 = bd_madd(a##r##2, w2, xb, insn), a##r##3 = bd_madd(a##r##3, w3, xb, insn); \
    }
        BD_ROW(0) BD_ROW(1) BD_ROW(2)
        if (NP <= 2) {
            BD_ROW(3) BD_ROW(4) BD_ROW(5)
        }
#undef BD_ROW
    }
    const int n0 = p * FPANEL;
#define BD_OUT(r)                                                                                  \
    if (R > r) {                                                                                   \
        bd_out(L, y, m0 + r, n0, a##r##0);                                                         \
        if (NP > 1) bd_out(L, y, m0 + r, n0 + FPANEL, a##r##1);                                    \
        if (NP > 2) bd_out(L, y, m0 + r, n0 + 2 * FPANEL, a##r##2), bd_out(L, y, m0 + r, n0 + 3 * FPANEL, a##r##3); \
    }
    BD_OUT(0) BD_OUT(1) BD_OUT(2)
    if (NP <= 2) {
        BD_OUT(3) BD_OUT(4) BD_OUT(5)
    }
#undef BD_OUT
}

/* panels [p0, p1): 1-3 rows in tiles of 4 panels (memory-bound: 4 streams), more rows in tiles of 6
 * rows x 2 panels, the panels' lines in cache across the row tiles (the first one prefetches) */
INL void bd_panels512_w(const Linear *L, const uint32_t *xp, int M, float *y, int p0, int p1,
                        const int insn) {
    const int NPmax = M <= 3 ? 4 : 2, RT = M <= 3 ? 3 : 6;
    for (int p = p0; p < p1;) {
        const int np = p1 - p >= NPmax ? NPmax : p1 - p >= 2 ? 2 : 1;
        for (int m0 = 0; m0 < M; m0 += RT) {
            const int R = M - m0 < RT ? M - m0 : RT, pf = m0 == 0;
#define BD_NP(NPV)                                                                \
    switch (R) {                                                                  \
    case 1: bd_tile(L, xp, y, p, NPV, m0, 1, pf, insn); break;                   \
    case 2: bd_tile(L, xp, y, p, NPV, m0, 2, pf, insn); break;                   \
    case 3: bd_tile(L, xp, y, p, NPV, m0, 3, pf, insn); break;                   \
    case 4: bd_tile(L, xp, y, p, NPV > 2 ? 2 : NPV, m0, 4, pf, insn); break;     \
    case 5: bd_tile(L, xp, y, p, NPV > 2 ? 2 : NPV, m0, 5, pf, insn); break;     \
    default: bd_tile(L, xp, y, p, NPV > 2 ? 2 : NPV, m0, 6, pf, insn); break;    \
    }
            if (np == 4) {
                BD_NP(4)
            } else if (np == 2) {
                BD_NP(2)
            } else {
                BD_NP(1)
            }
#undef BD_NP
        }
        p += np;
    }
}
#endif /* BD_AVX512 */

void bf16dot_panels(const Linear *L, const uint32_t *xp, int M, float *y, int isa, int p0, int p1) {
    (void)isa;
#ifdef BD_AVX512
    if (isa >= 3) {
        if (g_bf16_insn && decode_has_bf16_insn()) bd_panels512_w(L, xp, M, y, p0, p1, 1);
        else bd_panels512_w(L, xp, M, y, p0, p1, 0);
        return;
    }
#endif
    for (int p = p0; p < p1; p++) bd_panel_scalar(L, xp, M, y, p);
}

/* Rows up to this many are rounded by every thread into its own buffer (no barrier); more are split
 * over the threads, then a barrier (as q_linear_x). */
#define BD_SPLIT_ROWS 64

/* y [M, N] = bf16(x) W^T + b for any M in one parallel region: the rounding and the panels, handed
 * out in chunks (decode_claim_panels). 0, or -2 when a buffer cannot be had. */
int bf16dot_linear_x(const Linear *L, const float *x, int M, float *y, int isa, int num_threads) {
    const int own = M <= BD_SPLIT_ROWS || num_threads == 1, copies = own ? num_threads : 1;
    const int64_t per_copy = (int64_t)M * (L->kp / 2);
    uint32_t *pairs = malloc(sizeof(uint32_t) * per_copy * copies);
    if (!pairs) return -2;
    const int num_panels = (L->n + FPANEL - 1) / FPANEL, guided = decode_guided();
    const long long min_k = decode_claim_min_panels(L, M);
    atomic_llong next = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        uint32_t *xp = pairs + (own ? per_copy * tid : 0);
        if (own) {
            bf16_round_rows(x, 0, M, L->k, L->kp, xp);
        } else {
            bf16_round_rows(x, (int)((int64_t)M * tid / nt), (int)((int64_t)M * (tid + 1) / nt), L->k,
                            L->kp, xp);
#pragma omp barrier
        }
        if (guided && nt > 1) {
            for (long long c, k; decode_claim_panels(&next, num_panels, nt, min_k, &c, &k);)
                bf16dot_panels(L, xp, M, y, isa, (int)c, (int)(c + k));
        } else {
            bf16dot_panels(L, xp, M, y, isa, num_panels * tid / nt, num_panels * (tid + 1) / nt);
        }
    }
    free(pairs);
    return 0;
}
