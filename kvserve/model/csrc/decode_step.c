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
 *   int8 / int4: kvserve/quant/csrc/qgemm.cpp's packed layout and arithmetic (activations rounded to
 *     int8 per 32 inputs / per row / per tensor; integer dot products per block); the AVX2 path mirrors
 *     qgemm.cpp's per-(row, column) accumulation exactly, so both give the same bits.
 * The AVX2 paths exist when the library is compiled for a CPU with AVX2 (-march=native; the build is
 * keyed by the CPU's flags) and can be switched off at run time (decode_set_max_isa(0): the scalar path,
 * which tests force).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define DECODE_MAX_ROWS 4
#define QBLOCK 32
#ifndef Q_COLS_ONE_ROW
#define Q_COLS_ONE_ROW 4 /* weight columns per tile at one row */
#endif

enum { LIN_F32 = 0, LIN_Q8 = 1, LIN_Q4 = 2 };

typedef struct {
    int kind;     /* LIN_F32 | LIN_Q8 | LIN_Q4 */
    int n, k, kp; /* outputs, inputs, inputs padded to a multiple of 32 (quantised) */
    int groups, bpg, act_mode; /* scale groups per row, blocks per group, activation rounding mode */
    const void *w;             /* f32 [N, K] | int8 [N, Kp] | uint8 nibbles [N, Kp / 2] */
    const float *scales, *zeros, *bias; /* [N, G], [N, G] (int4), [N] or NULL */
} Linear;

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

/* ---- activation rounding (qgemm.cpp quantize_acts) --------------------------------------------- */

typedef struct {
    int8_t *codes; /* [M, Kp] */
    float *scale;  /* [M, nb] */
    int32_t *sum;  /* [M, nb] */
    float *group_sum; /* [M, G] (int4) */
} Acts;

static void quantize_acts(const float *x, int M, int K, int Kp, int mode, Acts *a) {
    const int nb = Kp / QBLOCK;
    float tensor_max = 0.f;
    if (mode == 2)
        for (int64_t i = 0; i < (int64_t)M * K; i++) tensor_max = fmaxf(tensor_max, fabsf(x[i]));
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * K;
        int8_t *q = a->codes + (int64_t)m * Kp;
        float row_max = tensor_max;
        if (mode == 1) {
            row_max = 0.f;
            for (int k = 0; k < K; k++) row_max = fmaxf(row_max, fabsf(row[k]));
        }
        for (int b = 0; b < nb; b++) {
            const int k0 = b * QBLOCK, k1 = K < k0 + QBLOCK ? K : k0 + QBLOCK;
            float amax = row_max;
            if (mode == 0) {
                amax = 0.f;
                for (int k = k0; k < k1; k++) amax = fmaxf(amax, fabsf(row[k]));
            }
            const float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
            int32_t s = 0;
            for (int k = k0; k < k0 + QBLOCK; k++) {
                int32_t v = 0;
                if (k < k1) {
                    v = (int32_t)nearbyintf(row[k] * inv);
                    v = v < -127 ? -127 : (v > 127 ? 127 : v);
                }
                q[k] = (int8_t)v;
                s += v;
            }
            a->scale[m * nb + b] = d;
            a->sum[m * nb + b] = s;
        }
    }
}

static void group_sums(const Acts *a, int M, int nb, int G, int bpg) {
    for (int m = 0; m < M; m++) {
        float *g = a->group_sum + (int64_t)m * G;
        for (int i = 0; i < G; i++) g[i] = 0.f;
        for (int b = 0; b < nb; b++) g[b / bpg] += a->scale[m * nb + b] * (float)a->sum[m * nb + b];
    }
}

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

static void q_scalar(const Linear *L, const Acts *a, int M, float *y, int n0, int n1) {
    const int nb = L->kp / QBLOCK, G = L->groups;
    for (int n = n0; n < n1; n++)
        for (int m = 0; m < M; m++) {
            float acc = 0.f;
            const int8_t *xq = a->codes + (int64_t)m * L->kp;
            for (int b = 0; b < nb; b++) {
                int32_t isum = 0;
                const int64_t g = (int64_t)n * G + b / L->bpg;
                if (L->kind == LIN_Q8) {
                    const int8_t *wb = (const int8_t *)L->w + (int64_t)n * L->kp + b * QBLOCK;
                    for (int j = 0; j < QBLOCK; j++) isum += (int32_t)wb[j] * xq[b * QBLOCK + j];
                    acc += L->scales[g] * a->scale[m * nb + b] * (float)isum;
                } else {
                    const uint8_t *wb = (const uint8_t *)L->w + (int64_t)n * (L->kp / 2) + b * 16;
                    for (int j = 0; j < 16; j++)
                        isum += (int32_t)(wb[j] & 0x0F) * xq[b * QBLOCK + j] +
                                (int32_t)(wb[j] >> 4) * xq[b * QBLOCK + j + 16];
                    acc += L->scales[g] * a->scale[m * nb + b] *
                           ((float)isum - L->zeros[g] * (float)a->sum[m * nb + b]);
                }
            }
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

INL int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
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

/* int8: qgemm.cpp q8_tile, per (row, column) the same operations in the same order. */
INL void q8_tile(const Linear *L, const Acts *a, float *y, int n0, const int R, const int C,
                 const int int_acc) {
    const int nb = L->kp / QBLOCK, G = L->groups, per_channel = G == 1;
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *w = L->w;
    __m256 acc[DECODE_MAX_ROWS][4];
    __m256i iacc[DECODE_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps(), iacc[r][c] = _mm256_setzero_si256();
    for (int b = 0; b < nb; b++) {
        __m256i wv[4], aw[4];
        __m256 sv[4];
        for (int c = 0; c < C; c++) {
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + (int64_t)(n0 + c) * L->kp + b * QBLOCK));
            aw[c] = _mm256_sign_epi8(wv[c], wv[c]);
            if (!per_channel) sv[c] = _mm256_set1_ps(L->scales[(int64_t)(n0 + c) * G + b / L->bpg]);
        }
        for (int r = 0; r < R; r++) {
            const __m256i xv =
                _mm256_loadu_si256((const __m256i *)(a->codes + (int64_t)r * L->kp + b * QBLOCK));
            const __m256 d = _mm256_broadcast_ss(a->scale + r * nb + b);
            for (int c = 0; c < C; c++) {
                const __m256i p =
                    _mm256_madd_epi16(_mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xv, wv[c])), ones);
                if (int_acc) {
                    iacc[r][c] = _mm256_add_epi32(iacc[r][c], p);
                } else {
                    const __m256 f = _mm256_cvtepi32_ps(p);
                    acc[r][c] = _mm256_fmadd_ps(per_channel ? d : _mm256_mul_ps(d, sv[c]), f, acc[r][c]);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const int n = n0 + c;
            float v = int_acc ? (float)hsum8i(iacc[r][c]) * a->scale[r * nb] : hsum8(acc[r][c]);
            if (per_channel) v *= L->scales[n];
            y[(int64_t)r * L->n + n] = v + (L->bias ? L->bias[n] : 0.f);
        }
}

/* int4: qgemm.cpp q4_tile. */
INL void q4_tile(const Linear *L, const Acts *a, float *y, int n0, const int R, const int C) {
    const int nb = L->kp / QBLOCK, G = L->groups, per_channel = G == 1;
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0F);
    const uint8_t *w = L->w;
    __m256 acc[DECODE_MAX_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        __m256i wv[4];
        __m256 sv[4];
        for (int c = 0; c < C; c++) {
            const __m128i raw =
                _mm_loadu_si128((const __m128i *)(w + (int64_t)(n0 + c) * (L->kp / 2) + b * 16));
            wv[c] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low4);
            if (!per_channel) sv[c] = _mm256_set1_ps(L->scales[(int64_t)(n0 + c) * G + b / L->bpg]);
        }
        for (int r = 0; r < R; r++) {
            const __m256i xv =
                _mm256_loadu_si256((const __m256i *)(a->codes + (int64_t)r * L->kp + b * QBLOCK));
            const __m256 d = _mm256_broadcast_ss(a->scale + r * nb + b);
            for (int c = 0; c < C; c++) {
                const __m256 f =
                    _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wv[c], xv), ones));
                acc[r][c] = _mm256_fmadd_ps(per_channel ? d : _mm256_mul_ps(d, sv[c]), f, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            const int n = n0 + c;
            float corr = 0.f;
            for (int g = 0; g < G; g++)
                corr += L->scales[(int64_t)n * G + g] * L->zeros[(int64_t)n * G + g] *
                        a->group_sum[(int64_t)r * G + g];
            const float v = hsum8(acc[r][c]) * (per_channel ? L->scales[n] : 1.f) - corr;
            y[(int64_t)r * L->n + n] = v + (L->bias ? L->bias[n] : 0.f);
        }
}

static void q_avx2(const Linear *L, const Acts *a, int M, float *y, int n0, int n1) {
    const int int_acc = L->kind == LIN_Q8 && L->act_mode != 0 && L->groups == 1;
    int n = n0;
#define Q_COLS(R, C)                                                                     \
    if (L->kind == LIN_Q8) {                                                             \
        if (int_acc) {                                                                   \
            for (; n + (C) <= n1; n += (C)) q8_tile(L, a, y, n, R, C, 1);                \
            for (; n < n1; n++) q8_tile(L, a, y, n, R, 1, 1);                            \
        } else {                                                                         \
            for (; n + (C) <= n1; n += (C)) q8_tile(L, a, y, n, R, C, 0);                \
            for (; n < n1; n++) q8_tile(L, a, y, n, R, 1, 0);                            \
        }                                                                                \
    } else {                                                                             \
        for (; n + (C) <= n1; n += (C)) q4_tile(L, a, y, n, R, C);                       \
        for (; n < n1; n++) q4_tile(L, a, y, n, R, 1);                                   \
    }
    switch (M) {
    case 1: Q_COLS(1, Q_COLS_ONE_ROW) break;
    case 2: Q_COLS(2, 2) break;
    case 3: Q_COLS(3, 2) break;
    default: Q_COLS(4, 2) break;
    }
#undef Q_COLS
}
#endif /* __AVX2__ */

/* ---- one linear: y [M, N] = x [M, K] W^T + b, columns split over the threads ------------------------ */

#define COLUMN_CHUNK 16 /* output columns per work item (a multiple of every tile width) */

static void run_linear(const Linear *L, const float *x, int M, float *y, Acts *acts, int num_threads) {
    const int isa = decode_isa();
    if (L->kind != LIN_F32) {
        quantize_acts(x, M, L->k, L->kp, L->act_mode, acts);
        if (L->kind == LIN_Q4) group_sums(acts, M, L->kp / QBLOCK, L->groups, L->bpg);
    }
    const int num_chunks = (L->n + COLUMN_CHUNK - 1) / COLUMN_CHUNK;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int chunk = 0; chunk < num_chunks; chunk++) {
        const int n0 = chunk * COLUMN_CHUNK;
        const int n1 = n0 + COLUMN_CHUNK < L->n ? n0 + COLUMN_CHUNK : L->n;
#ifdef __AVX2__
        if (isa >= 2) {
            if (L->kind == LIN_F32) f32_avx2(L, x, M, y, n0, n1);
            else q_avx2(L, acts, M, y, n0, n1);
            continue;
        }
#endif
        if (L->kind == LIN_F32) f32_scalar(L, x, M, y, n0, n1);
        else q_scalar(L, acts, M, y, n0, n1);
    }
}

static int max_int(int a, int b) { return a > b ? a : b; }

static int alloc_acts(Acts *a, int M, int max_kp, int max_groups) {
    a->codes = malloc((size_t)M * max_kp);
    a->scale = malloc(sizeof(float) * M * (max_kp / QBLOCK));
    a->sum = malloc(sizeof(int32_t) * M * (max_kp / QBLOCK));
    a->group_sum = malloc(sizeof(float) * M * max_groups);
    return a->codes && a->scale && a->sum && a->group_sum;
}

static void free_acts(Acts *a) {
    free(a->codes), free(a->scale), free(a->sum), free(a->group_sum);
}

/* One linear on its own (the LM head, or a projection outside the fused step). 0 on success. */
int small_linear(const Linear *L, const float *x, int M, float *y, int num_threads) {
    if (M < 1 || M > DECODE_MAX_ROWS) return -1;
    Acts a = {0};
    const int kp = L->kind == LIN_F32 ? QBLOCK : L->kp;
    if (!alloc_acts(&a, M, kp, max_int(L->groups, 1))) {
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
    int max_kp = QBLOCK, max_groups = 1;
    for (int l = 0; l < mdl->num_layers; l++) {
        const Linear *ls[4] = {&mdl->layers[l].qkv, &mdl->layers[l].o, &mdl->layers[l].gate_up,
                               &mdl->layers[l].down};
        for (int i = 0; i < 4; i++) {
            if (ls[i]->kind != LIN_F32) max_kp = max_int(max_kp, ls[i]->kp);
            max_groups = max_int(max_groups, ls[i]->groups);
        }
    }
    float *residual = malloc(sizeof(float) * M * D), *normed = malloc(sizeof(float) * M * D);
    float *qkv = malloc(sizeof(float) * M * qkv_width), *attn = malloc(sizeof(float) * M * q_size);
    float *gate_up = malloc(sizeof(float) * M * 2 * I), *act = malloc(sizeof(float) * M * I);
    Acts acts = {0};
    int status = 0;
    if (!residual || !normed || !qkv || !attn || !gate_up || !act ||
        !alloc_acts(&acts, M, max_kp, max_groups)) {
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
