/* A whole decode step of the decoder layers in one native call, for a few rows (docs/performance.md,
 * "The fused decode step").
 *
 * At batch 1 the per-layer Python and op dispatch (~10 calls per layer, 30 layers) cost as much as the
 * arithmetic. decode_layers runs every layer here: add + RMSNorm, the q/k/v GEMV, RoPE, the KV write,
 * paged attention (in place), o_proj, add + RMSNorm, gate/up GEMV, SiLU-and-multiply, down GEMV. The
 * small ops are the same functions the per-op path calls (layer_ops.c, paged_attention.c); the GEMVs
 * split output columns over the threads.
 *
 * GEMV kernels (y[m, n] = sum_k x[m, k] w[n, k] + bias[n]; a step has M <= DECODE_MAX_ROWS rows, or
 * up to F32_STEP_ROWS when every linear is fp32, decode_step_max_rows):
 *   fp32: the 16-column panel layout of decode_step.h (built once at load, fused_decode.f32_panels),
 *     its values stored as fp32 or, when every one is a bf16 value, as bf16 (LIN_BF16: widened
 *     exactly, the same arithmetic and bits).
 *   int8 / int4: qgemv.c, the panel-interleaved layout of decode_step.h (activations rounded to int8
 *     as kvserve/quant/csrc/qgemm.cpp rounds them; integer dot products per 32-input block).
 * The AVX2 paths exist when the library is compiled for a CPU with AVX2, the AVX-512 ones (level 3)
 * for one with AVX-512 F/BW/VL and VNNI (-march=native; the build is keyed by the CPU's flags); each is
 * checked again at run time and can be capped (decode_set_max_isa(2): AVX2, 0: the scalar path, which
 * tests force). Every level gives the same bits.
 */
#define _GNU_SOURCE /* syscall (the futex) */
#include <math.h>
#include <omp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#include "decode_step.h"
#include "paged_attention.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef struct {
    const float *input_norm, *post_norm; /* [D] */
    Linear qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_blocks, block_size, KVH, Dh] fp32, or uint8 codes (kv_kind) */
    uint16_t *k_scale, *v_scale; /* 8-bit caches: [num_blocks, block_size, KVH] fp16; else NULL */
} Layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    const Layer *layers;
    const float *final_norm;
    int kv_kind;          /* 0: fp32 cache; 1: int8 codes, 2: fp8 e4m3 codes (kv_cache.py) */
    const float *kv_lut;  /* 8-bit caches: [256] the value of each code */
} Model;

/* from layer_ops.c / paged_attention.c */
void add_rms_norm(const float *x, const float *residual, const float *weight, float *out,
                  float *residual_out, int num_rows, int dim, float eps, int num_threads);
void rotary(float *qkv, int64_t row_stride, const float *cos_rows, const float *sin_rows, int num_rows,
            int num_rotated, int head_dim, int num_threads);
void write_kv(const float *k, const float *v, int64_t row_stride, const int64_t *slots, float *k_cache,
              float *v_cache, int num_rows, int kv_values, int num_threads);
void write_kv_q(const float *k, const float *v, int64_t row_stride, const int64_t *slots,
                uint8_t *k_codes, uint8_t *v_codes, uint16_t *k_scale, uint16_t *v_scale,
                int num_rows, int num_kv_heads, int head_dim, int kind, int num_threads);
void silu_mul(const float *gate_up, float *out, int num_rows, int inter, int num_threads);
int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride, int batch,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads);

/* this layer's new K and V rows (qkv [M, qkv_width], after q) into its cache, fp32 or 8-bit */
static void layer_write_kv(const Model *mdl, const Layer *L, const float *qkv, int64_t qkv_width,
                           const int64_t *slots, int M) {
    const int q_size = mdl->num_heads * mdl->head_dim, kv_size = mdl->num_kv_heads * mdl->head_dim;
    const float *k = qkv + q_size, *v = qkv + q_size + kv_size;
    if (mdl->kv_kind == 0)
        write_kv(k, v, qkv_width, slots, L->k_cache, L->v_cache, M, kv_size, 1);
    else
        write_kv_q(k, v, qkv_width, slots, L->k_cache, L->v_cache, L->k_scale, L->v_scale, M,
                   mdl->num_kv_heads, mdl->head_dim, mdl->kv_kind, 1);
}

static int g_max_isa = 3; /* 3: AVX-512 (with VNNI) allowed; 2: AVX2; 0: scalar only */

static int have_avx2(void) {
#ifdef __AVX2__
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return cached;
#else
    return 0;
#endif
}

/* AVX-512 F/BW/VL with VNNI (Ice Lake, Zen 4 and later): compiled in when -march=native has them (the
 * build is keyed by the CPU's flags), and taken when this CPU reports them. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HAVE_AVX512 1
#endif
static int have_avx512(void) {
#ifdef HAVE_AVX512
    static int cached = -1;
    if (cached < 0)
        cached = have_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return cached;
#else
    return 0;
#endif
}

/* the best level this CPU and build have (3 AVX-512 VNNI, 2 AVX2, 0 scalar), and the one in force */
int decode_cpu_isa(void) { return have_avx512() ? 3 : have_avx2() ? 2 : 0; }
int decode_isa(void) {
    const int cpu = decode_cpu_isa(), cap = g_max_isa >= 3 ? 3 : g_max_isa >= 2 ? 2 : 0;
    return cpu < cap ? cpu : cap;
}
void decode_set_max_isa(int level) { g_max_isa = level; }
static int g_pooled_step = 1; /* 0: the step forks and joins per linear (tests compare both) */
void decode_set_pooled_step(int enabled) { g_pooled_step = enabled; }
static atomic_llong g_pooled_steps; /* steps run by decode_layers_pooled (tests check it is taken) */
int64_t decode_pooled_steps(void) { return atomic_load(&g_pooled_steps); }
int decode_max_rows(void) { return DECODE_MAX_ROWS; }
/* Rows a fused step may have (fp32 or quantised projections): the panel GEMVs reuse each panel for
 * all rows (row tiles while it is in cache), so the step needs no other kernel; tests and benchmarks
 * set it (decode_set_f32_max_rows: 4 = DECODE_MAX_ROWS, the GEMVs' register tile). 64 since the
 * prompt chunks of a small step run here too, one row per token (runner/forward.py as_rows);
 * 16 before. */
#define F32_STEP_ROWS 64
static int g_f32_max_rows = F32_STEP_ROWS;
void decode_set_f32_max_rows(int rows) {
    g_f32_max_rows = rows < 1 ? 1 : rows > F32_STEP_ROWS ? F32_STEP_ROWS : rows;
}
int decode_f32_max_rows(void) { return g_f32_max_rows; }

/* ---- fp32 GEMV / GEMM on the panel layout (decode_step.h): panel p = columns 16p .. 16p + 15 ---------
 * w[p][k][c]: one 64-byte line per input k holds the panel's 16 columns, so a panel is one sequential
 * stream (a few rows read several panels side by side: f32_multi_tile). Each column's sum runs over k
 * in order, one fused multiply-add per input, from 0; the bias is added last. The scalar path does the
 * same operations in the same order (fmaf), so both paths give the same bits. */

/* weight i of a float panel layout as fp32 (bf16: its bits in the high half, exact) */
static inline float panel_weight(const Linear *L, int64_t i) {
    if (L->kind == LIN_F32) return ((const float *)L->w)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)L->w)[i] << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static void f32_panel_scalar(const Linear *L, const float *x, int M, float *y, int p) {
    const int K = L->k, n0 = p * FPANEL, cols = L->n - n0 < FPANEL ? L->n - n0 : FPANEL;
    const int64_t w0 = (int64_t)p * K * FPANEL;
    for (int m = 0; m < M; m++)
        for (int c = 0; c < cols; c++) {
            float acc = 0.f;
            for (int k = 0; k < K; k++)
                acc = fmaf(x[(int64_t)m * K + k], panel_weight(L, w0 + (int64_t)k * FPANEL + c), acc);
            y[(int64_t)m * L->n + n0 + c] = acc + (L->bias ? L->bias[n0 + c] : 0.f);
        }
}

#ifdef __AVX2__
#define INL static inline __attribute__((always_inline))
#define F32_PREFETCH_LINES 16 /* software prefetch distance: inputs (64-byte lines) ahead */
#define F32_TILE_MAX 6        /* rows of the largest register tile */
#define NEXT_PANELS_MIN_TILES 5 /* row tiles from which the later ones prefetch the next panels */

/* store row m's sums with the bias added */
INL void f32_sums_out(const Linear *L, float *y, int m, int n0, int cols, __m256 a0, __m256 a1) {
    float *yr = y + (int64_t)m * L->n + n0;
    if (cols == FPANEL && !L->bias) {
        _mm256_storeu_ps(yr, a0), _mm256_storeu_ps(yr + 8, a1);
        return;
    }
    float sums[FPANEL];
    _mm256_storeu_ps(sums, a0), _mm256_storeu_ps(sums + 8, a1);
    for (int c = 0; c < cols; c++) yr[c] = sums[c] + (L->bias ? L->bias[n0 + c] : 0.f);
}

/* R rows (1-6) of one panel: 2 accumulators (8 columns each) per row, 12 at R = 6 (2 FMA pipes of
 * latency 4 need >= 8 independent sums). They are named variables, not an array: gcc 12 kept an
 * array of accumulators in memory and stored every one of them on every input, so the loop ran at
 * the store port's rate, half the FMA pipes'. The panel's lines are read once for the R rows. */
/* 8 weights of a float panel line as fp32: fp32 as they are, bf16 widened (exact) */
INL __m256 load_w8(const void *base, int64_t i, const int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)base + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INL void f32_panel_tile(const Linear *L, const float *x, float *y, int p, int m0, const int R,
                        int prefetch, const int bf16) {
    const int K = L->k, n0 = p * FPANEL, cols = L->n - n0 < FPANEL ? L->n - n0 : FPANEL;
    const int64_t wbase = (int64_t)p * K * FPANEL;
    const char *wbytes = (const char *)L->w;
    const int wsize = bf16 ? 2 : 4;
    const float *xr = x + (int64_t)m0 * K;
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const int64_t wk = wbase + (int64_t)k * FPANEL;
        if (prefetch)
            _mm_prefetch(wbytes + (wk + F32_PREFETCH_LINES * FPANEL) * wsize, _MM_HINT_T0);
        const __m256 w0 = load_w8(L->w, wk, bf16), w1 = load_w8(L->w, wk + 8, bf16);
#define F32_FMA(r)                                                                                 \
    if (R > r) {                                                                                   \
        const __m256 xb = _mm256_broadcast_ss(xr + (int64_t)(r) * K + k);                          \
        c##r##0 = _mm256_fmadd_ps(xb, w0, c##r##0), c##r##1 = _mm256_fmadd_ps(xb, w1, c##r##1);  \
    }
        F32_FMA(0) F32_FMA(1) F32_FMA(2) F32_FMA(3) F32_FMA(4) F32_FMA(5)
#undef F32_FMA
    }
#define F32_OUT(r) \
    if (R > r) f32_sums_out(L, y, m0 + r, n0, cols, c##r##0, c##r##1)
    F32_OUT(0); F32_OUT(1); F32_OUT(2); F32_OUT(3); F32_OUT(4); F32_OUT(5);
#undef F32_OUT
}

/* every row of panel p, in row tiles of 6 while the panel's lines are in cache (L1 / L2: 36 KB at
 * K = 576, 98 KB at K = 1536); the first tile prefetches the panel. Blocking K so that a slab stays
 * in L1 across the tiles, and tiles of 5 rows, measured no faster (docs/performance.md). */
INL void f32_panel_rows(const Linear *L, const float *x, int M, float *y, int p, const int bf16) {
    for (int m0 = 0; m0 < M; m0 += F32_TILE_MAX) {
        const int pf = m0 == 0;
        switch (M - m0 < F32_TILE_MAX ? M - m0 : F32_TILE_MAX) {
        case 1: f32_panel_tile(L, x, y, p, m0, 1, pf, bf16); break;
        case 2: f32_panel_tile(L, x, y, p, m0, 2, pf, bf16); break;
        case 3: f32_panel_tile(L, x, y, p, m0, 3, pf, bf16); break;
        case 4: f32_panel_tile(L, x, y, p, m0, 4, pf, bf16); break;
        case 5: f32_panel_tile(L, x, y, p, m0, 5, pf, bf16); break;
        default: f32_panel_tile(L, x, y, p, m0, 6, pf, bf16); break;
        }
    }
}

static void f32_panel_avx2(const Linear *L, const float *x, int M, float *y, int p) {
    if (L->kind == LIN_BF16) f32_panel_rows(L, x, M, y, p, 1);
    else f32_panel_rows(L, x, M, y, p, 0);
}

/* A few rows are bound by memory, not arithmetic, and one panel at a time is one sequential stream
 * per thread: the core keeps too few lines in flight. NP panels side by side are NP streams, each
 * prefetched 16 lines ahead. Tiles of R rows (1-3) x NP panels (2 or 4), R x NP <= 6 (two
 * accumulators per panel and row, 12 at most); each column's sum still runs over k in order from 0,
 * so the bits are those of one panel at a time. Measured on a Zen 3 against one panel at a time
 * (benchmarks/ab_switch.py, 30 alternations, batch-1 fp32 step; docs/performance.md "The fp32 panel
 * GEMM"): 2 panels 1.058x, 4 panels 1.137x (29 of 30), 6 panels 0.96x of 4. At 4 rows pairs in tiles
 * of 3 + 1 rows were 1.01-1.06x (not significant: kept, they lose nothing); at 6 rows one 6-row tile
 * of one panel wins (pairs 0.91x). */
#define F32_FEW_ROWS 4
INL void f32_multi_tile(const Linear *L, const float *x, float *y, int p, const int NP, int m0,
                        const int R, int prefetch, const int bf16) {
    const int K = L->k;
    const int64_t pstride = (int64_t)K * FPANEL, wbase = (int64_t)p * pstride;
    const char *wbytes = (const char *)L->w;
    const int wsize = bf16 ? 2 : 4;
    const float *xr = x + (int64_t)m0 * K;
    /* row r, vector v (panel v / 2, columns 8 (v % 2) ..): named, not an array (see f32_panel_tile) */
    __m256 c00, c01, c02, c03, c04, c05, c06, c07, c10, c11, c12, c13, c20, c21, c22, c23;
    c00 = c01 = c02 = c03 = c04 = c05 = c06 = c07 = _mm256_setzero_ps();
    c10 = c11 = c12 = c13 = c20 = c21 = c22 = c23 = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const int64_t wk = wbase + (int64_t)k * FPANEL;
        for (int q = 0; q < NP; q++)
            if (prefetch)
                _mm_prefetch(wbytes + (wk + q * pstride + F32_PREFETCH_LINES * FPANEL) * wsize,
                             _MM_HINT_T0);
        /* panel by panel: its two vectors (widened, for bf16) are used by every row at once, so at
         * most two weight vectors are live beside the 8-12 accumulators (16 registers in all) */
        if (NP > 2) { /* one row, four panels */
            const __m256 xb = _mm256_broadcast_ss(xr + k);
            c00 = _mm256_fmadd_ps(xb, load_w8(L->w, wk, bf16), c00);
            c01 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + 8, bf16), c01);
            c02 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + pstride, bf16), c02);
            c03 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + pstride + 8, bf16), c03);
            c04 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + 2 * pstride, bf16), c04);
            c05 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + 2 * pstride + 8, bf16), c05);
            c06 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + 3 * pstride, bf16), c06);
            c07 = _mm256_fmadd_ps(xb, load_w8(L->w, wk + 3 * pstride + 8, bf16), c07);
            continue;
        }
#define F32_PAIR_ROW(r, a, b)                                                                   \
    if (R > r) {                                                                                \
        const __m256 xb = _mm256_broadcast_ss(xr + (int64_t)(r) * K + k);                       \
        c##r##a = _mm256_fmadd_ps(xb, w0, c##r##a), c##r##b = _mm256_fmadd_ps(xb, w1, c##r##b); \
    }
        __m256 w0 = load_w8(L->w, wk, bf16), w1 = load_w8(L->w, wk + 8, bf16);
        F32_PAIR_ROW(0, 0, 1) F32_PAIR_ROW(1, 0, 1) F32_PAIR_ROW(2, 0, 1)
        w0 = load_w8(L->w, wk + pstride, bf16), w1 = load_w8(L->w, wk + pstride + 8, bf16);
        F32_PAIR_ROW(0, 2, 3) F32_PAIR_ROW(1, 2, 3) F32_PAIR_ROW(2, 2, 3)
#undef F32_PAIR_ROW
    }
    const int n0 = p * FPANEL;
#define F32_MULTI_OUT(r, q, a, b)                                                               \
    f32_sums_out(L, y, m0 + (r), n0 + (q) * FPANEL,                                             \
                 L->n - n0 - (q) * FPANEL < FPANEL ? L->n - n0 - (q) * FPANEL : FPANEL, a, b)
    F32_MULTI_OUT(0, 0, c00, c01);
    F32_MULTI_OUT(0, 1, c02, c03);
    if (NP > 2) {
        F32_MULTI_OUT(0, 2, c04, c05);
        F32_MULTI_OUT(0, 3, c06, c07);
    }
    if (NP == 2 && R > 1) F32_MULTI_OUT(1, 0, c10, c11), F32_MULTI_OUT(1, 1, c12, c13);
    if (NP == 2 && R > 2) F32_MULTI_OUT(2, 0, c20, c21), F32_MULTI_OUT(2, 1, c22, c23);
#undef F32_MULTI_OUT
}

/* panels [p0, p1) of M <= F32_FEW_ROWS rows: one row in groups of 4 panels, more in pairs of panels
 * with row tiles of up to 3 (the first tile streams the pair, the rest read it from cache); a panel
 * left over goes alone */
INL void f32_panels_few_w(const Linear *L, const float *x, int M, float *y, int p0, int p1,
                          const int bf16) {
    int p = p0;
    if (M == 1)
        for (; p + 4 <= p1; p += 4) f32_multi_tile(L, x, y, p, 4, 0, 1, 1, bf16);
    for (; p + 2 <= p1; p += 2)
        for (int m0 = 0; m0 < M; m0 += 3) {
            const int pf = m0 == 0;
            switch (M - m0 < 3 ? M - m0 : 3) {
            case 1: f32_multi_tile(L, x, y, p, 2, m0, 1, pf, bf16); break;
            case 2: f32_multi_tile(L, x, y, p, 2, m0, 2, pf, bf16); break;
            default: f32_multi_tile(L, x, y, p, 2, m0, 3, pf, bf16); break;
            }
        }
    if (p < p1) f32_panel_rows(L, x, M, y, p, bf16);
}

static void f32_panels_few(const Linear *L, const float *x, int M, float *y, int p0, int p1) {
    if (L->kind == LIN_BF16) f32_panels_few_w(L, x, M, y, p0, p1, 1);
    else f32_panels_few_w(L, x, M, y, p0, p1, 0);
}
#endif /* __AVX2__ */

#ifdef HAVE_AVX512
/* ---- AVX-512: one 64-byte line (a panel's 16 columns at one input) is one vector ------------------
 * A tile is R rows x NP panels, one accumulator each (R x NP <= 12). At one row a single panel would
 * be one chain of dependent multiply-adds (4 cycles each: 16 bytes a cycle); NP panels side by side
 * are NP independent chains, each column's sum still running over k in order from 0 (the scalar
 * path's order, so the same bits). */
INL void f32_sums_out512(const Linear *L, float *y, int m, int n0, __m512 v) {
    const int cols = L->n - n0 < FPANEL ? L->n - n0 : FPANEL;
    float *yr = y + (int64_t)m * L->n + n0;
    if (cols == FPANEL && !L->bias) {
        _mm512_storeu_ps(yr, v);
        return;
    }
    float sums[FPANEL];
    _mm512_storeu_ps(sums, v);
    for (int c = 0; c < cols; c++) yr[c] = sums[c] + (L->bias ? L->bias[n0 + c] : 0.f);
}

/* 16 weights of a float panel line as fp32: fp32 as they are, bf16 widened (exact) */
INL __m512 load_w16(const void *base, int64_t i, const int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)base + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INL void f32_tile512(const Linear *L, const float *x, float *y, int p, const int NP, int m0,
                     const int R, int prefetch, const int bf16, int next_p, int64_t g0, int shift,
                     int64_t nlines) {
    const int K = L->k;
    const int64_t pstride = (int64_t)K * FPANEL, wbase = (int64_t)p * pstride;
    const char *wbytes = (const char *)L->w;
    const int wsize = bf16 ? 2 : 4;
    const float *xr = x + (int64_t)m0 * K;
    /* named, not an array (see f32_panel_tile); those a tile does not use are dropped */
    __m512 a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23;
    __m512 a30, a31, a32, a33, a40, a41, a42, a43, a50, a51, a52, a53;
    a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = a20 = a21 = a22 = a23 = _mm512_setzero_ps();
    a30 = a31 = a32 = a33 = a40 = a41 = a42 = a43 = a50 = a51 = a52 = a53 = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const int64_t wk = wbase + (int64_t)k * FPANEL;
        __m512 w0, w1 = _mm512_setzero_ps(), w2 = w1, w3 = w1;
#define F32_PF(q) _mm_prefetch(wbytes + (wk + (q) * pstride + F32_PREFETCH_LINES * FPANEL) * wsize, _MM_HINT_T0)
        if (prefetch) F32_PF(0);
        {
            const int64_t g = g0 + k, line = g >> shift;
            if (NP <= 2 && !(g & ((1 << shift) - 1)) && line < nlines) /* not in 1-3 row tiles */
                _mm_prefetch(wbytes + ((int64_t)next_p * pstride + line * FPANEL) * wsize, _MM_HINT_T0);
        }
        w0 = load_w16(L->w, wk, bf16);
        if (NP > 1) {
            if (prefetch) F32_PF(1);
            w1 = load_w16(L->w, wk + pstride, bf16);
        }
        if (NP > 2) {
            if (prefetch) F32_PF(2), F32_PF(3);
            w2 = load_w16(L->w, wk + 2 * pstride, bf16), w3 = load_w16(L->w, wk + 3 * pstride, bf16);
        }
#undef F32_PF
#define F32_ROW512(r)                                                                  \
    if (R > r) {                                                                       \
        const __m512 xb = _mm512_set1_ps(xr[(int64_t)(r) * K + k]);                    \
        a##r##0 = _mm512_fmadd_ps(xb, w0, a##r##0);                                    \
        if (NP > 1) a##r##1 = _mm512_fmadd_ps(xb, w1, a##r##1);                        \
        if (NP > 2) a##r##2 = _mm512_fmadd_ps(xb, w2, a##r##2), a##r##3 = _mm512_fmadd_ps(xb, w3, a##r##3); \
    }
        F32_ROW512(0) F32_ROW512(1) F32_ROW512(2)
        if (NP <= 2) {
            F32_ROW512(3) F32_ROW512(4) F32_ROW512(5)
        }
#undef F32_ROW512
    }
    const int n0 = p * FPANEL;
#define F32_OUT512(r)                                                                   \
    if (R > r) {                                                                        \
        f32_sums_out512(L, y, m0 + r, n0, a##r##0);                                     \
        if (NP > 1) f32_sums_out512(L, y, m0 + r, n0 + FPANEL, a##r##1);                \
        if (NP > 2) f32_sums_out512(L, y, m0 + r, n0 + 2 * FPANEL, a##r##2),            \
                    f32_sums_out512(L, y, m0 + r, n0 + 3 * FPANEL, a##r##3);            \
    }
    F32_OUT512(0) F32_OUT512(1) F32_OUT512(2)
    if (NP <= 2) {
        F32_OUT512(3) F32_OUT512(4) F32_OUT512(5)
    }
#undef F32_OUT512
}

/* panels [p0, p1) of every row: 1-3 rows in tiles of 4 panels (4-12 independent chains), more rows
 * in tiles of 6 rows x 2 panels (12 accumulators: 2 weight loads and 6 broadcasts per 12 FMAs),
 * each group of panels' lines in cache across its row tiles. The first row tile of a group streams
 * it from memory (prefetching 16 lines ahead) while the later tiles compute from cache: with 5 or
 * more row tiles (M > 24) those later tiles also prefetch the next group, one line every 2^shift
 * inputs spread over them, so that its first tile finds it in cache and the memory stream overlaps
 * the arithmetic. Measured on 120 distinct 576/1536-wide matrices, 20 alternations (Zen 4, 2
 * threads): 32 rows 1.09-1.14x, 64 rows 1.11x, 128 rows 1.10x faster; 8 and 16 rows 5-10% slower
 * and 24 rows even, hence the threshold. */
INL void f32_panels512_w(const Linear *L, const float *x, int M, float *y, int p0, int p1,
                         const int bf16) {
    const int NPmax = M <= 3 ? 4 : 2, RT = M <= 3 ? 3 : 6, tiles = (M + RT - 1) / RT;
    for (int p = p0; p < p1;) {
        const int np = p1 - p >= NPmax ? NPmax : p1 - p >= 2 ? 2 : 1;
        const int pn = p + np, npn = p1 - pn < 2 ? p1 - pn : 2; /* the next group's panels */
        int shift = 0;
        while (npn && (2 << shift) * npn <= tiles - 1) shift++;
        const int64_t nlines = tiles >= NEXT_PANELS_MIN_TILES ? (int64_t)npn * L->k : 0;
        for (int m0 = 0; m0 < M; m0 += RT) {
            const int t = m0 / RT, R = M - m0 < RT ? M - m0 : RT;
            const int pf = t == 0 && (p == p0 || nlines == 0);
            const int64_t g0 = t > 0 ? (int64_t)(t - 1) * L->k : 0, nl = t > 0 ? nlines : 0;
            const int np0 = pn;
#define F32_NP(NPV)                                                        \
    switch (R) {                                                          \
    case 1: f32_tile512(L, x, y, p, NPV, m0, 1, pf, bf16, np0, g0, shift, nl); break;               \
    case 2: f32_tile512(L, x, y, p, NPV, m0, 2, pf, bf16, np0, g0, shift, nl); break;               \
    case 3: f32_tile512(L, x, y, p, NPV, m0, 3, pf, bf16, np0, g0, shift, nl); break;               \
    case 4: f32_tile512(L, x, y, p, NPV > 2 ? 2 : NPV, m0, 4, pf, bf16, np0, g0, shift, nl); break; \
    case 5: f32_tile512(L, x, y, p, NPV > 2 ? 2 : NPV, m0, 5, pf, bf16, np0, g0, shift, nl); break; \
    default: f32_tile512(L, x, y, p, NPV > 2 ? 2 : NPV, m0, 6, pf, bf16, np0, g0, shift, nl); break; \
    }
            if (np == 4) {
                F32_NP(4)
            } else if (np == 2) {
                F32_NP(2)
            } else {
                F32_NP(1)
            }
#undef F32_NP
        }
        p += np;
    }
}

static void f32_panels512(const Linear *L, const float *x, int M, float *y, int p0, int p1) {
    if (L->kind == LIN_BF16) f32_panels512_w(L, x, M, y, p0, p1, 1);
    else f32_panels512_w(L, x, M, y, p0, p1, 0);
}
#endif /* HAVE_AVX512 */

/* panels [p0, p1) of y = x W^T + b on this thread */
static void f32_panels(const Linear *L, const float *x, int M, float *y, int isa, int p0, int p1) {
    (void)isa;
#ifdef HAVE_AVX512
    if (isa >= 3) {
        f32_panels512(L, x, M, y, p0, p1);
        return;
    }
#endif
#ifdef __AVX2__
    if (isa >= 2 && M <= F32_FEW_ROWS) {
        f32_panels_few(L, x, M, y, p0, p1);
        return;
    }
#endif
    for (int p = p0; p < p1; p++) {
#ifdef __AVX2__
        if (isa >= 2) {
            f32_panel_avx2(L, x, M, y, p);
            continue;
        }
#endif
        f32_panel_scalar(L, x, M, y, p);
    }
}

static int g_guided = 1; /* 0: each thread takes a fixed contiguous share of a linear's panels */
void decode_set_guided(int enabled) { g_guided = enabled; }
int decode_guided(void) { return g_guided; }
#define GUIDED_MIN_PANELS 2
#define CLAIM_MIN_BYTES (64 << 10) /* a claim of a few rows' panels: at least this many weight bytes */
#define CLAIM_FEW_ROWS 4            /* rows up to which CLAIM_MIN_BYTES applies (as F32_FEW_ROWS) */

/* The smallest chunk of L's panels a thread claims at M rows. Each claim starts a new memory stream
 * (the software prefetch runs ahead within a chunk, not into the next one), so at up to
 * CLAIM_FEW_ROWS rows, where the GEMV is bound by memory, a chunk holds at least CLAIM_MIN_BYTES of
 * weights, rounded up to an even count (the AVX-512 quantised kernel takes panels in pairs): 2 fp32
 * panels, 16 int8 or 30 int4 panels at 576 inputs. Quantised panels are small (8 columns, 2.3 KB of
 * int4 at 576 inputs) and the tail of the guided schedule claimed them 2 at a time. Batch-1
 * int4-g32 step, Zen 3 (benchmarks/ab_switch.py, 40 alternations): 1.05x faster (36 of 40 pairs);
 * fixed shares had been 1.036x faster than the old claims. Claims of 32 KB were 1.6% slower than 64
 * KB, 128 KB even. At more rows the panels carry more arithmetic and the finer tail balances better
 * (batch 16 int4: 1.2% slower with 64 KB claims), so there it stays 2 panels. */
long long decode_claim_min_panels(const Linear *L, int M) {
    if (M > CLAIM_FEW_ROWS) return GUIDED_MIN_PANELS;
    const long long panel_bytes =
        LIN_IS_FLOAT(L->kind)       ? (long long)L->k * FPANEL * (L->kind == LIN_BF16 ? 2 : 4)
        : L->kind == LIN_BF16DOT ? (long long)L->kp * FPANEL * 2
                                 : (long long)L->kp * QPANEL / (L->kind == LIN_Q4 ? 2 : 1);
    const long long k = (CLAIM_MIN_BYTES + panel_bytes - 1) / panel_bytes;
    return k < GUIDED_MIN_PANELS ? GUIDED_MIN_PANELS : (k + 1) & ~1LL;
}

/* Guided scheduling of panels: the next chunk of [*next, end), (what is left) / (2 nt) panels and at
 * least min_k (decode_claim_min_panels), claimed from the shared counter `next` into
 * [*first, *first + *count); 0 when none is left. Threads do not stream memory at the same speed, so
 * the faster one takes more (with fixed shares it waited for the other at the end of every linear). */
int decode_claim_panels(atomic_llong *next, long long end, int nt, long long min_k, long long *first,
                        long long *count) {
    long long c = atomic_load_explicit(next, memory_order_relaxed);
    while (c < end) {
        long long k = (end - c) / (2 * nt);
        k = k < min_k ? min_k : k;
        k = k > end - c ? end - c : k;
        if (atomic_compare_exchange_weak_explicit(next, &c, c + k, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            *first = c, *count = k;
            return 1;
        } /* else c holds the counter's value now */
    }
    return 0;
}

/* y [M, N] = x [M, K] W^T + b on the fp32 panel layout, any M; the panels claimed by the threads in
 * chunks (decode_claim_panels; each chunk one contiguous stream), or split in fixed contiguous ranges
 * (decode_set_guided(0)). Each panel is computed by one thread either way: the same bits. */
static void f32_linear(const Linear *L, const float *x, int M, float *y, int isa, int num_threads) {
    const int num_panels = (L->n + FPANEL - 1) / FPANEL, guided = g_guided;
    const long long min_k = decode_claim_min_panels(L, M);
    atomic_llong next = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        if (guided && nt > 1)
            for (long long c, k; decode_claim_panels(&next, num_panels, nt, min_k, &c, &k);)
                f32_panels(L, x, M, y, isa, (int)c, (int)(c + k));
        else
            f32_panels(L, x, M, y, isa, num_panels * tid / nt, num_panels * (tid + 1) / nt);
    }
}

/* ---- one linear: y [M, N] = x [M, K] W^T + b, output columns split over the threads ---------------- */

/* One linear, any number of rows, in one parallel region (the fp32 panels, or q_linear_x: rounding
 * and panels together): the LM head, a projection outside the fused step (prefill, larger batches)
 * and the forking step's projections. 0 on success, -2 when a buffer cannot be had. */
static int run_linear(const Linear *L, const float *x, int M, float *y, int num_threads) {
    const int isa = decode_isa();
    if (L->kind == LIN_BF16DOT) return bf16dot_linear_x(L, x, M, y, isa, num_threads);
    if (!LIN_IS_FLOAT(L->kind)) return q_linear_x(L, x, M, y, isa, num_threads);
    f32_linear(L, x, M, y, isa, num_threads);
    return 0;
}

int small_linear(const Linear *L, const float *x, int M, float *y, int num_threads) {
    return M < 1 ? -1 : run_linear(L, x, M, y, num_threads);
}

/* ---- the pooled step: one OpenMP region for the whole step (any context) -----------------------
 * The pooled step runs every layer inside one parallel region, so its thread pool stays up for the
 * whole step instead of one region per linear. Under OMP_WAIT_POLICY=PASSIVE (kvserve's default,
 * docs/performance.md "Threads") every parallel region and every libgomp barrier puts the other
 * threads to sleep in the kernel and wakes them again (tens of us each on this VM); a step of ~5
 * regions per layer paid that 150 times. The pooled step
 * opens one region and synchronises with step_barrier: it spins briefly (the waits inside a step are
 * short: work imbalance and the small ops of thread 0), then sleeps on a futex, so a thread whose core
 * was taken by a neighbour does not hold the other core spinning. Each thread computes the RMSNorms
 * and SiLU-and-multiply (and rounds the activations of a quantised linear) itself into its own buffers
 * (the same code on the same inputs: the same bits),
 * so only the GEMVs' outputs, thread 0's RoPE and KV write, and the attention need a barrier: 6 per
 * layer, 7 when a context is longer than one attention split (the splits' merge). The attention's items
 * (paged_attention.h: row, kv head, q-head chunk, context split) are cut over the pool's threads
 * the way the forking call cuts them over its threads; a q head's numbers do not depend on the cut, so both steps
 * give the same bits at any context length. A linear's panels are claimed in shrinking chunks
 * (linear_guided), not split in fixed halves: the two threads do not stream memory at the same speed,
 * and with fixed halves the faster one waited at every linear's barrier (docs/performance.md, "The
 * fused decode step": ~1.5 thread-ms of a batch-1 step on a Zen 3). */

#define BARRIER_SPINS 4000 /* pause iterations before sleeping (~50-100 us) */

typedef struct {
    atomic_int arrived, generation, sleepers;
} StepBarrier;

/* all `num_threads` threads of the region meet here */
static void step_barrier(StepBarrier *b, int num_threads) {
    const int gen = atomic_load(&b->generation);
    if (atomic_fetch_add(&b->arrived, 1) == num_threads - 1) {
        atomic_store(&b->arrived, 0);
        atomic_fetch_add(&b->generation, 1);
        if (atomic_load(&b->sleepers) > 0) {
#ifdef __linux__
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, 1 << 30, NULL, NULL, 0);
#endif
        }
        return;
    }
    for (int i = 0; i < BARRIER_SPINS; i++) {
        if (atomic_load_explicit(&b->generation, memory_order_acquire) != gen) return;
#ifdef __AVX2__
        _mm_pause();
#endif
    }
    atomic_fetch_add(&b->sleepers, 1);
    while (atomic_load(&b->generation) == gen) {
#ifdef __linux__
        syscall(SYS_futex, &b->generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(&b->sleepers, 1);
}

/* this thread's share (contiguous panels) of y = x W^T + b; quantised: the activations are rounded
 * by every thread into its own `acts` (the same bits) */
static void linear_share(const Linear *L, const float *x, int M, float *y, Acts *acts, int isa,
                         int tid, int nt) {
    const int width = LIN_WIDTH(L->kind);
    const int64_t panels = (L->n + width - 1) / width;
    const int p0 = (int)(panels * tid / nt), p1 = (int)(panels * (tid + 1) / nt);
    if (LIN_IS_FLOAT(L->kind)) {
        f32_panels(L, x, M, y, isa, p0, p1);
        return;
    }
    if (L->kind == LIN_BF16DOT) {
        bf16_round_rows(x, 0, M, L->k, L->kp, acts->pairs);
        bf16dot_panels(L, acts->pairs, M, y, isa, p0, p1);
        return;
    }
    quantize_acts(x, M, L->k, L->kp, L->act_mode, acts, isa, 1);
    q_linear_panels(L, acts, M * ACT_ROWS(L->act_mode), y, isa, p0, p1);
}

/* The pool's share of y = x W^T + b, handed out in shrinking chunks (guided scheduling) from `next`, a
 * counter over the step's panels, linear after linear: this linear owns [*base, *base + panels). Every
 * thread calls it for the same linears in the same order, so `base` is the same on each; the barrier
 * after a linear makes sure every panel of it was claimed before any thread claims the next one's.
 * Each panel is still computed by one thread in one order: the bits do not depend on who takes it. */
static void linear_guided(const Linear *L, const float *x, int M, float *y, Acts *acts, int isa,
                          int nt, atomic_llong *next, int64_t *base) {
    const int width = LIN_WIDTH(L->kind);
    const int64_t panels = (L->n + width - 1) / width, begin = *base, end = begin + panels;
    *base = end;
    if (L->kind == LIN_BF16DOT) bf16_round_rows(x, 0, M, L->k, L->kp, acts->pairs);
    else if (!LIN_IS_FLOAT(L->kind)) quantize_acts(x, M, L->k, L->kp, L->act_mode, acts, isa, 1);
    const int MA = LIN_IS_FLOAT(L->kind) ? M : M * ACT_ROWS(L->act_mode); /* rounded rows */
    const long long min_k = decode_claim_min_panels(L, MA);
    for (long long c, k; decode_claim_panels(next, end, nt, min_k, &c, &k);) {
        const int p0 = (int)(c - begin), p1 = (int)(c + k - begin);
        if (LIN_IS_FLOAT(L->kind)) f32_panels(L, x, M, y, isa, p0, p1);
        else if (L->kind == LIN_BF16DOT) bf16dot_panels(L, acts->pairs, M, y, isa, p0, p1);
        else q_linear_panels(L, acts, MA, y, isa, p0, p1);
    }
}

/* the widest padded input of the model's quantised and bf16-product linears; *pairs: whether any
 * linear takes bf16 products (the pool's Acts then hold a pairs buffer) */
static int max_kp_of(const Model *mdl, int *pairs) {
    int max_kp = QBLOCK;
    *pairs = 0;
    for (int l = 0; l < mdl->num_layers; l++) {
        const Linear *ls[4] = {&mdl->layers[l].qkv, &mdl->layers[l].o, &mdl->layers[l].gate_up,
                               &mdl->layers[l].down};
        for (int i = 0; i < 4; i++) {
            if (!LIN_IS_FLOAT(ls[i]->kind) && ls[i]->kp > max_kp) max_kp = ls[i]->kp;
            if (ls[i]->kind == LIN_BF16DOT) *pairs = 1;
        }
    }
    return max_kp;
}

static int decode_layers_pooled(const Model *mdl, float *hidden, int M, const float *cos_rows,
                              const float *sin_rows, const int64_t *slots, const int32_t *block_table,
                              int max_blocks, const int32_t *context_lens, int num_threads) {
    const int D = mdl->hidden, H = mdl->num_heads, KVH = mdl->num_kv_heads, Dh = mdl->head_dim;
    const int q_size = H * Dh, kv_size = KVH * Dh, qkv_width = q_size + 2 * kv_size;
    const int I = mdl->inter, isa = decode_isa();
    /* shared: the GEMV outputs, the attention; per thread: residual, normed, act */
    float *qkv = malloc(sizeof(float) * M * qkv_width), *attn = malloc(sizeof(float) * M * q_size);
    float *gate_up = malloc(sizeof(float) * M * 2 * I);
    const int64_t per_thread = (int64_t)M * (2 * D + I);
    float *own = malloc(sizeof(float) * per_thread * num_threads);
    Acts *acts = calloc(num_threads, sizeof(Acts));
    int with_pairs;
    const int max_kp = max_kp_of(mdl, &with_pairs);
    StepBarrier bar = {0, 0, 0};
    int status = 0;
    float *parts = NULL;
    AttnWork work; /* the attention of layer 0; each layer points it at its own cache */
    status = attention_setup(&work, qkv, mdl->layers[0].k_cache, mdl->layers[0].v_cache,
                             mdl->layers[0].k_scale, mdl->layers[0].v_scale,
                             mdl->kv_kind ? mdl->kv_lut : NULL, block_table, context_lens, attn,
                             qkv_width, M, H, KVH, Dh, mdl->block_size, max_blocks, mdl->scale,
                             num_threads);
    if (status != 0) goto done; /* -3: a context past its block-table row (as the forking call) */
    parts = malloc(sizeof(float) * attention_parts_floats(&work));
    if (!qkv || !attn || !gate_up || !own || !acts || !parts) {
        status = -2;
        goto done;
    }
    for (int t = 0; t < num_threads; t++)
        /* two rounded rows per input row: enough for every act_mode (ACT_BLOCK2 takes two) */
        if (!alloc_acts(&acts[t], M * ACT_ROWS(ACT_BLOCK2), max_kp, with_pairs)) {
            status = -2;
            goto done;
        }
    atomic_llong next_item = 0; /* the attention's next unclaimed item (reset every layer) */
    atomic_llong next_panel = 0; /* the GEMVs' next unclaimed panel, over the step (linear_guided) */
    const int guided = g_guided;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *residual = own + per_thread * tid, *normed = residual + M * D, *act = normed + M * D;
        Acts *own_acts = &acts[tid];
        int64_t panel_base = 0;
#define LINEAR(lin, xin, yout)                                                                       \
    do {                                                                                           \
        if (guided) linear_guided(lin, xin, M, yout, own_acts, isa, nt, &next_panel, &panel_base);  \
        else linear_share(lin, xin, M, yout, own_acts, isa, tid, nt);                              \
    } while (0)
        memcpy(residual, hidden, sizeof(float) * M * D); /* the stream starts as x */
        for (int l = 0; l < mdl->num_layers; l++) {
            const Layer *L = &mdl->layers[l];
            add_rms_norm(hidden, l == 0 ? NULL : residual, L->input_norm, normed, residual, M, D,
                         mdl->eps, 1);
            LINEAR(&L->qkv, normed, qkv);
            step_barrier(&bar, nt);
            if (tid == 0) {
                rotary(qkv, qkv_width, cos_rows, sin_rows, M, H + KVH, Dh, 1);
                layer_write_kv(mdl, L, qkv, qkv_width, slots, M);
                atomic_store_explicit(&next_item, 0, memory_order_relaxed); /* its last use ended
                                                           at least two barriers ago */
            }
            step_barrier(&bar, nt);
            AttnWork w = work;
            w.k = L->k_cache, w.v = L->v_cache, w.k_scale = L->k_scale, w.v_scale = L->v_scale;
            /* items are claimed one at a time: a batch mixing one long context with short ones
             * has most of its work in a few items (the bits do not depend on who runs an item) */
            for (int64_t i; (i = atomic_fetch_add_explicit(&next_item, 1, memory_order_relaxed)) <
                            w.num_items;)
                attention_items(&w, parts, i, i + 1);
            if (w.max_splits > 1) {
                step_barrier(&bar, nt);
                const int64_t heads = (int64_t)M * H;
                attention_merge(&w, parts, heads * tid / nt, heads * (tid + 1) / nt);
            }
            step_barrier(&bar, nt);
            LINEAR(&L->o, attn, hidden);
            step_barrier(&bar, nt);
            add_rms_norm(hidden, residual, L->post_norm, normed, residual, M, D, mdl->eps, 1);
            LINEAR(&L->gate_up, normed, gate_up);
            step_barrier(&bar, nt);
            silu_mul(gate_up, act, M, I, 1);
            LINEAR(&L->down, act, hidden);
            step_barrier(&bar, nt);
        }
        if (tid == 0) {
            add_rms_norm(hidden, residual, mdl->final_norm, normed, residual, M, D, mdl->eps, 1);
            memcpy(hidden, normed, sizeof(float) * M * D);
        }
    }
#undef LINEAR
    atomic_fetch_add(&g_pooled_steps, 1);
done:
    if (acts)
        for (int t = 0; t < num_threads; t++) free_acts(&acts[t]);
    free(qkv), free(attn), free(gate_up), free(own), free(acts), free(parts);
    return status;
}

/* The rows a fused step takes: decode_f32_max_rows() (64 unless a test or benchmark set it), whatever
 * the projections' kinds. The quantised GEMV takes any rows (row tiles of 4, pairs of panels above 4
 * rows), so quantised steps are no longer capped at DECODE_MAX_ROWS: at 16 rows the fused step ran
 * int8 and int4 batch-16 decode 1.6-1.7x faster than the per-op path (docs/performance.md). */
int decode_step_max_rows(const Model *mdl) {
    (void)mdl;
    return g_f32_max_rows > DECODE_MAX_ROWS ? g_f32_max_rows : DECODE_MAX_ROWS;
}

/* Whether the step runs pooled (one region): whenever there is more than one thread (any context
 * length: the pool's threads split the attention themselves). */
static int use_pooled_step(int num_threads) { return num_threads >= 2; }

/* The decoder layers for M single-token rows, then the final norm.
 * hidden: [M, D] in: the embedded tokens; out: the final norm of the residual stream.
 * cos, sin: [M, Dh / 2]; slots: [M] int64 cache slots; block_table [M, max_blocks] int32;
 * context_lens [M] int32. 0 on success. */
int decode_layers(const Model *mdl, float *hidden, int M, const float *cos_rows, const float *sin_rows,
                  const int64_t *slots, const int32_t *block_table, int max_blocks,
                  const int32_t *context_lens, int num_threads) {
    if (M < 1 || M > decode_step_max_rows(mdl)) return -1;
    if (g_pooled_step && use_pooled_step(num_threads))
        return decode_layers_pooled(mdl, hidden, M, cos_rows, sin_rows, slots, block_table, max_blocks,
                                  context_lens, num_threads);
    const int D = mdl->hidden, H = mdl->num_heads, KVH = mdl->num_kv_heads, Dh = mdl->head_dim;
    const int q_size = H * Dh, kv_size = KVH * Dh, qkv_width = q_size + 2 * kv_size;
    const int I = mdl->inter;
    float *residual = malloc(sizeof(float) * M * D), *normed = malloc(sizeof(float) * M * D);
    float *qkv = malloc(sizeof(float) * M * qkv_width), *attn = malloc(sizeof(float) * M * q_size);
    float *gate_up = malloc(sizeof(float) * M * 2 * I), *act = malloc(sizeof(float) * M * I);
    int status = 0;
    if (!residual || !normed || !qkv || !attn || !gate_up || !act) {
        status = -2;
        goto done;
    }
    for (int l = 0; l < mdl->num_layers; l++) {
        const Layer *L = &mdl->layers[l];
        /* hidden holds the previous layer's MLP output (layer 0: the embeddings) */
        if (l == 0) memcpy(residual, hidden, sizeof(float) * M * D); /* the stream starts as x */
        add_rms_norm(hidden, l == 0 ? NULL : residual, L->input_norm, normed, residual, M, D, mdl->eps,
                     1);
        if ((status = run_linear(&L->qkv, normed, M, qkv, num_threads)) != 0) goto done;
        rotary(qkv, qkv_width, cos_rows, sin_rows, M, H + KVH, Dh, 1);
        layer_write_kv(mdl, L, qkv, qkv_width, slots, M);
        status = paged_decode_attention(qkv, L->k_cache, L->v_cache, L->k_scale, L->v_scale,
                                        mdl->kv_kind ? mdl->kv_lut : NULL, block_table, context_lens,
                                        attn, qkv_width, M, H, KVH, Dh, mdl->block_size, max_blocks,
                                        mdl->scale, num_threads);
        if (status != 0) goto done;
        if ((status = run_linear(&L->o, attn, M, hidden, num_threads)) != 0) goto done;
        add_rms_norm(hidden, residual, L->post_norm, normed, residual, M, D, mdl->eps, 1);
        if ((status = run_linear(&L->gate_up, normed, M, gate_up, num_threads)) != 0) goto done;
        silu_mul(gate_up, act, M, I, 1);
        if ((status = run_linear(&L->down, act, M, hidden, num_threads)) != 0) goto done;
    }
    add_rms_norm(hidden, residual, mdl->final_norm, normed, residual, M, D, mdl->eps, 1);
    memcpy(hidden, normed, sizeof(float) * M * D);
done:
    free(residual), free(normed), free(qkv), free(attn), free(gate_up), free(act);
    return status;
}

/* ---- the step from token ids: the embedding lookup and the RoPE rows, then decode_layers ----------
 * A decode step's host side used to look up the embeddings and the cos / sin rows in torch (~6 small
 * ops, each slow after the weights' stream has evicted the interpreter's state from the caches); here
 * they are copies, so the hidden rows and the tables' rows are the same bits.
 * embed_kind: 0 hidden already holds the embedded rows (a table with no native lookup: a quantised
 * embedding); 1 an fp32 table [vocab, D]; 2 the fp32 panels of a tied head [P, D, 16] (row r is
 * panels[r / 16, :, r % 16], linear.py PanelEmbedding); 3 the same panels as bf16 bits (widened,
 * exact). cos_table, sin_table: [max_positions, Dh / 2]. -1: an unknown embed_kind (or M out of
 * range); -4: a token id outside [0, vocab); -5: a position outside [0, max_positions), both
 * checked before anything is written; otherwise decode_layers' status. */
int decode_step_tokens(const Model *mdl, const int64_t *ids, const int64_t *positions, int M,
                       int embed_kind, const void *table, int64_t vocab, const float *cos_table,
                       const float *sin_table, int64_t max_positions, float *hidden,
                       const int64_t *slots, const int32_t *block_table, int max_blocks,
                       const int32_t *context_lens, int num_threads) {
    if (M < 1 || M > decode_step_max_rows(mdl) || embed_kind < 0 || embed_kind > 3) return -1;
    const int D = mdl->hidden, half = mdl->head_dim / 2;
    for (int m = 0; m < M; m++) {
        if (embed_kind != 0 && (ids[m] < 0 || ids[m] >= vocab)) return -4;
        if (positions[m] < 0 || positions[m] >= max_positions) return -5;
    }
    for (int m = 0; m < M && embed_kind != 0; m++) {
        float *row = hidden + (int64_t)m * D;
        const int64_t r = ids[m];
        if (embed_kind == 1) {
            memcpy(row, (const float *)table + r * D, sizeof(float) * D);
            continue;
        }
        const int64_t base = r / FPANEL * D * FPANEL + r % FPANEL; /* then + d * FPANEL */
        for (int d = 0; d < D; d++) {
            const int64_t i = base + (int64_t)d * FPANEL;
            if (embed_kind == 2) {
                row[d] = ((const float *)table)[i];
            } else {
                const uint32_t bits = (uint32_t)((const uint16_t *)table)[i] << 16;
                memcpy(row + d, &bits, 4);
            }
        }
    }
    float *rows = malloc(sizeof(float) * 2 * M * half);
    if (!rows) return -2;
    for (int m = 0; m < M; m++) {
        memcpy(rows + (int64_t)m * half, cos_table + positions[m] * half, sizeof(float) * half);
        memcpy(rows + (int64_t)(M + m) * half, sin_table + positions[m] * half, sizeof(float) * half);
    }
    const int status = decode_layers(mdl, hidden, M, rows, rows + (int64_t)M * half, slots,
                                     block_table, max_blocks, context_lens, num_threads);
    free(rows);
    return status;
}
