/* A whole decode step of the decoder layers in one native call, for a few rows (docs/performance.md,
 * "The fused decode step").
 *
 * At batch 1 the per-layer Python and op dispatch (~10 calls per layer, 30 layers) cost as much as the
 * arithmetic. decode_layers runs every layer here: add + RMSNorm, the q/k/v GEMV, RoPE, the KV write,
 * paged attention (in place), o_proj, add + RMSNorm, gate/up GEMV, SiLU-and-multiply, down GEMV. The
 * small ops are the same functions the per-op path calls (layer_ops.c, paged_attention.c); the GEMVs
 * split output columns over the threads.
 *
 * GEMV kernels (y[m, n] = sum_k x[m, k] w[n, k] + bias[n], M <= DECODE_MAX_ROWS):
 *   fp32: w [N, K] row-major (the checkpoint's layout).
 *   int8 / int4: qgemv.c, the panel-interleaved layout of decode_step.h (activations rounded to int8
 *     as kvserve/quant/csrc/qgemm.cpp rounds them; integer dot products per 32-input block).
 * The AVX2 paths exist when the library is compiled for a CPU with AVX2 (-march=native; the build is
 * keyed by the CPU's flags) and can be switched off at run time (decode_set_max_isa(0): the scalar path,
 * which tests force).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "decode_step.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef struct {
    const float *input_norm, *post_norm; /* [D] */
    Linear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [num_blocks, block_size, KVH, Dh] fp32 */
} Layer;

typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, block_size;
    float eps, scale;
    const Layer *layers;
    const float *final_norm;
} Model;

/* from layer_ops.c / paged_attention.c */
void add_rms_norm(const float *x, const float *residual, const float *weight, float *out,
                  float *residual_out, int num_rows, int dim, float eps, int num_threads);
void rotary(float *qkv, int64_t row_stride, const float *cos_rows, const float *sin_rows, int num_rows,
            int num_rotated, int head_dim, int num_threads);
void write_kv(const float *k, const float *v, int64_t row_stride, const int64_t *slots, float *k_cache,
              float *v_cache, int num_rows, int kv_values, int num_threads);
void silu_mul(const float *gate_up, float *out, int num_rows, int inter, int num_threads);
int paged_decode_attention(const float *q, const void *k, const void *v, const uint16_t *k_scale,
                           const uint16_t *v_scale, const float *lut, const int32_t *block_table,
                           const int32_t *context_lens, float *out, int64_t q_row_stride, int batch,
                           int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, float scale, int num_threads);

static int g_max_isa = 2; /* 2: AVX2 allowed; 0: scalar only */

static int have_avx2(void) {
#ifdef __AVX2__
    static int cached = -1;
    if (cached < 0) cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    return cached;
#else
    return 0;
#endif
}

int decode_isa(void) { return have_avx2() && g_max_isa >= 2 ? 2 : 0; }
void decode_set_max_isa(int level) { g_max_isa = level; }
int decode_max_rows(void) { return DECODE_MAX_ROWS; }

/* ---- scalar kernels: columns [n0, n1) ------------------------------------------------------------ */

static void f32_scalar(const Linear *L, const float *x, int M, float *y, int n0, int n1) {
    const float *w = L->w;
    for (int n = n0; n < n1; n++)
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            for (int k = 0; k < L->k; k++) acc += x[(int64_t)m * L->k + k] * w[(int64_t)n * L->k + k];
            y[(int64_t)m * L->n + n] = acc + (L->bias ? L->bias[n] : 0.f);
        }
}

/* ---- AVX2 kernels ------------------------------------------------------------------------------- */
#ifdef __AVX2__
#define INL static inline __attribute__((always_inline))

INL float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* fp32: R rows x C columns from n0; two accumulators per pair to hide the FMA latency at R = 1. */
INL void f32_tile(const Linear *L, const float *x, float *y, int n0, const int R, const int C) {
    const int K = L->k, K8 = K & ~7;
    const float *w = (const float *)L->w + (int64_t)n0 * K;
    __m256 acc[DECODE_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < K8; k += 8) {
        __m256 wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm256_loadu_ps(w + (int64_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (int64_t)r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float v = hsum8(acc[r][c]);
            for (int k = K8; k < K; k++) v += x[(int64_t)r * K + k] * w[(int64_t)c * K + k];
            const int n = n0 + c;
            y[(int64_t)r * L->n + n] = v + (L->bias ? L->bias[n] : 0.f);
        }
}

static void f32_avx2(const Linear *L, const float *x, int M, float *y, int n0, int n1) {
    int n = n0;
#define F32_COLS(R, C)                                                      \
    for (; n + (C) <= n1; n += (C)) f32_tile(L, x, y, n, R, C);             \
    for (; n < n1; n++) f32_tile(L, x, y, n, R, 1);
    switch (M) {
    case 1: F32_COLS(1, 4) break;
    case 2: F32_COLS(2, 4) break;
    case 3: F32_COLS(3, 2) break;
    default: F32_COLS(4, 2) break;
    }
#undef F32_COLS
}

#endif /* __AVX2__ */

/* ---- one linear: y [M, N] = x [M, K] W^T + b, columns split over the threads ------------------------ */

#define COLUMN_CHUNK 16 /* fp32: output columns per work item (a multiple of every tile width) */

static void run_linear(const Linear *L, const float *x, int M, float *y, Acts *acts, int num_threads) {
    const int isa = decode_isa();
    if (L->kind != LIN_F32) {
        quantize_acts(x, M, L->k, L->kp, L->act_mode, acts, isa, num_threads);
        q_linear(L, acts, M, y, isa, num_threads);
        return;
    }
    const int num_chunks = (L->n + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int chunk = 0; chunk < num_chunks; chunk++) {
        const int n0 = chunk * COLUMN_CHUNK;
        const int n1 = n0 + COLUMN_CHUNK < L->n ? n0 + COLUMN_CHUNK : L->n;
#ifdef __AVX2__
        if (isa >= 2) {
            f32_avx2(L, x, M, y, n0, n1);
            continue;
        }
#endif
        f32_scalar(L, x, M, y, n0, n1);
    }
}

static int max_int(int a, int b) { return a > b ? a : b; }

/* One linear on its own (the LM head, or a projection outside the fused step): fp32 for at most
 * DECODE_MAX_ROWS rows, the quantised layouts for any number. 0 on success. */
int small_linear(const Linear *L, const float *x, int M, float *y, int num_threads) {
    if (M < 1 || (L->kind == LIN_F32 && M > DECODE_MAX_ROWS)) return -1;
    Acts a = {0};
    if (!alloc_acts(&a, M, L->kind == LIN_F32 ? QBLOCK : L->kp)) {
        free_acts(&a);
        return -2;
    }
    run_linear(L, x, M, y, &a, num_threads);
    free_acts(&a);
    return 0;
}

/* The decoder layers for M single-token rows, then the final norm.
 * hidden: [M, D] in: the embedded tokens; out: the final norm of the residual stream.
 * cos, sin: [M, Dh / 2]; slots: [M] int64 cache slots; block_table [M, max_blocks] int32;
 * context_lens [M] int32. 0 on success. */
int decode_layers(const Model *mdl, float *hidden, int M, const float *cos_rows, const float *sin_rows,
                  const int64_t *slots, const int32_t *block_table, int max_blocks,
                  const int32_t *context_lens, int num_threads) {
    if (M < 1 || M > DECODE_MAX_ROWS) return -1;
    const int D = mdl->hidden, H = mdl->num_heads, KVH = mdl->num_kv_heads, Dh = mdl->head_dim;
    const int q_size = H * Dh, kv_size = KVH * Dh, qkv_width = q_size + 2 * kv_size;
    const int I = mdl->inter;
    int max_kp = QBLOCK;
    for (int l = 0; l < mdl->num_layers; l++) {
        const Linear *ls[4] = {&mdl->layers[l].qkv, &mdl->layers[l].o, &mdl->layers[l].gate_up,
                               &mdl->layers[l].down};
        for (int i = 0; i < 4; i++) {
            if (ls[i]->kind != LIN_F32) max_kp = max_int(max_kp, ls[i]->kp);
        }
    }
    float *residual = malloc(sizeof(float) * M * D), *normed = malloc(sizeof(float) * M * D);
    float *qkv = malloc(sizeof(float) * M * qkv_width), *attn = malloc(sizeof(float) * M * q_size);
    float *gate_up = malloc(sizeof(float) * M * 2 * I), *act = malloc(sizeof(float) * M * I);
    Acts acts = {0};
    int status = 0;
    if (!residual || !normed || !qkv || !attn || !gate_up || !act ||
        !alloc_acts(&acts, M, max_kp)) {
        status = -2;
        goto done;
    }
    for (int l = 0; l < mdl->num_layers; l++) {
        const Layer *L = &mdl->layers[l];
        /* hidden holds the previous layer's MLP output (layer 0: the embeddings) */
        if (l == 0) memcpy(residual, hidden, sizeof(float) * M * D); /* the stream starts as x */
        add_rms_norm(hidden, l == 0 ? NULL : residual, L->input_norm, normed, residual, M, D, mdl->eps,
                     1);
        run_linear(&L->qkv, normed, M, qkv, &acts, num_threads);
        rotary(qkv, qkv_width, cos_rows, sin_rows, M, H + KVH, Dh, 1);
        write_kv(qkv + q_size, qkv + q_size + kv_size, qkv_width, slots, L->k_cache, L->v_cache, M,
                 kv_size, 1);
        status = paged_decode_attention(qkv, L->k_cache, L->v_cache, NULL, NULL, NULL, block_table,
                                        context_lens, attn, qkv_width, M, H, KVH, Dh, mdl->block_size,
                                        max_blocks, mdl->scale, num_threads);
        if (status != 0) goto done;
        run_linear(&L->o, attn, M, hidden, &acts, num_threads);
        add_rms_norm(hidden, residual, L->post_norm, normed, residual, M, D, mdl->eps, 1);
        run_linear(&L->gate_up, normed, M, gate_up, &acts, num_threads);
        silu_mul(gate_up, act, M, I, 1);
        run_linear(&L->down, act, M, hidden, &acts, num_threads);
    }
    add_rms_norm(hidden, residual, mdl->final_norm, normed, residual, M, D, mdl->eps, 1);
    memcpy(hidden, normed, sizeof(float) * M * D);
done:
    free(residual), free(normed), free(qkv), free(attn), free(gate_up), free(act);
    free_acts(&acts);
    return status;
}
