/* The small per-layer ops of the decoder, fused for fp32 on CPU (docs/performance.md).
 *
 * At decode each of these touches a few KB; in torch each is several dispatched ops (~40 per layer), which
 * cost more than their arithmetic. Rows are independent, so large batches (prefill) split rows over threads.
 * The arithmetic follows Hugging Face's order in fp32 (normalise, then scale; rotate-half RoPE).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "half.h"
#include "vexp.h"

int decode_isa(void); /* decode_step.c: 3 AVX-512, 2 AVX2, 0 the portable loops */

#define PARALLEL_MIN_VALUES 32768 /* below this, one thread: waking the others costs more */

/* Whether an op opens a parallel region: more than one thread asked for, and `values` worth waking
 * them. Otherwise its rows run in a plain loop on the calling thread. An `omp parallel if (0)` is not
 * free: libgomp still builds (and, nested inside the fused step's region, allocates) a team of one,
 * about 2-5 us each on a Zen 3 VM, and the fused step calls these ops ~8 times a layer on each
 * thread. Each op's row is one non-inlined function, called by both paths: the same code, the same
 * bits. */
#define PARALLEL(num_threads, values, min_values) ((num_threads) > 1 && (values) >= (min_values))
#define NOINLINE __attribute__((noinline))

/* ROW_CALL for t = 0 .. num_rows - 1: in a plain loop, or split over the caller's `num_threads` when
 * PARALLEL says so */
#define FOR_ROWS(num_rows, values, min_values, ROW_CALL)                                              \
    do {                                                                                           \
        if (!PARALLEL(num_threads, (values), (min_values))) {                                      \
            for (int t = 0; t < (num_rows); t++) ROW_CALL;                                         \
        } else {                                                                                   \
            _Pragma("omp parallel for num_threads(num_threads)")                                   \
            for (int t = 0; t < (num_rows); t++) ROW_CALL;                                         \
        }                                                                                          \
    } while (0)

/* residual_out = x + residual (when residual != NULL, else x); out = rms_norm(residual_out) * weight.
 * x, residual, out, residual_out: [T, D] contiguous; weight [D]. out may alias x. */
static NOINLINE void add_rms_norm_row(const float *x, const float *residual, const float *weight,
                                      float *out, float *residual_out, int t, int dim, float eps) {
    const float *xr = x + (int64_t)t * dim;
    float *o = out + (int64_t)t * dim, *r = residual_out + (int64_t)t * dim;
    float sum = 0.f;
    if (residual != NULL) {
        const float *rr = residual + (int64_t)t * dim;
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < dim; d++) {
            float h = xr[d] + rr[d];
            r[d] = h;
            sum += h * h;
        }
    } else {
#pragma omp simd reduction(+ : sum)
        for (int d = 0; d < dim; d++) sum += xr[d] * xr[d];
    }
    const float *h = residual != NULL ? r : xr;
    float inv = 1.f / sqrtf(sum / dim + eps);
#pragma omp simd
    for (int d = 0; d < dim; d++) o[d] = weight[d] * (h[d] * inv);
}

void add_rms_norm(const float *x, const float *residual, const float *weight, float *out,
                  float *residual_out, int num_rows, int dim, float eps, int num_threads) {
    FOR_ROWS(num_rows, (int64_t)num_rows * dim, PARALLEL_MIN_VALUES,
             add_rms_norm_row(x, residual, weight, out, residual_out, t, dim, eps));
}

/* In place on the fused projection qkv [T, row_stride]: rotate the first num_rotated heads of head_dim
 * (q heads then k heads). cos, sin: [T, head_dim / 2], each row's position already looked up. */
static NOINLINE void rotary_row(float *qkv, int64_t row_stride, const float *cos_rows,
                                const float *sin_rows, int t, int num_rotated, int head_dim) {
    const int half = head_dim / 2;
    const float *c = cos_rows + (int64_t)t * half, *s = sin_rows + (int64_t)t * half;
    for (int h = 0; h < num_rotated; h++) {
        float *x1 = qkv + t * row_stride + (int64_t)h * head_dim, *x2 = x1 + half;
#pragma omp simd
        for (int d = 0; d < half; d++) {
            float a = x1[d], b = x2[d];
            x1[d] = a * c[d] - b * s[d];
            x2[d] = b * c[d] + a * s[d];
        }
    }
}

void rotary(float *qkv, int64_t row_stride, const float *cos_rows, const float *sin_rows, int num_rows,
            int num_rotated, int head_dim, int num_threads) {
    FOR_ROWS(num_rows, (int64_t)num_rows * num_rotated * head_dim, PARALLEL_MIN_VALUES,
             rotary_row(qkv, row_stride, cos_rows, sin_rows, t, num_rotated, head_dim));
}

/* Copy rows of k and v (heads of head_dim, row stride in elements) into cache slots:
 * cache[slot[t], :, :] = src[t] for k_cache, v_cache [num_slots, num_kv_heads, head_dim]. */
static NOINLINE void write_kv_row(const float *k, const float *v, int64_t row_stride,
                                  const int64_t *slots, float *k_cache, float *v_cache, int t,
                                  int kv_values) {
    float *kd = k_cache + slots[t] * kv_values, *vd = v_cache + slots[t] * kv_values;
    const float *ks = k + t * row_stride, *vs = v + t * row_stride;
#pragma omp simd
    for (int d = 0; d < kv_values; d++) kd[d] = ks[d], vd[d] = vs[d];
}

void write_kv(const float *k, const float *v, int64_t row_stride, const int64_t *slots, float *k_cache,
              float *v_cache, int num_rows, int kv_values, int num_threads) {
    FOR_ROWS(num_rows, (int64_t)num_rows * kv_values, PARALLEL_MIN_VALUES,
             write_kv_row(k, v, row_stride, slots, k_cache, v_cache, t, kv_values));
}

/* The same rows into an 8-bit cache (kv_cache.py `quantise`, bit for bit): per (row, kv head) the fp16
 * scale = fp16(max(max |value| / code_max, 2^-24)), and each code = value / scale clamped to +-code_max,
 * int8 (kind 1, code_max 127) rounded half to even, fp8 e4m3fn (kind 2, code_max 448) converted as torch
 * converts. codes [num_blocks, block_size, KVH, Dh] uint8, scales [num_blocks, block_size, KVH] fp16.
 * A NaN value gives a NaN scale and codes of 0 (int8) or NaN (fp8). */
static NOINLINE void quantise_row(const float *x, int head_dim, int kind, uint8_t *codes,
                                  uint16_t *scale) {
    const float code_max = kind == 1 ? 127.f : 448.f;
    float amax = 0.f;
    int nan = 0;
    for (int d = 0; d < head_dim; d++) {
        const float a = fabsf(x[d]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float s = nan ? NAN : amax / code_max;
    s = s < 0x1p-24f ? 0x1p-24f : s; /* NaN compares false: kept */
    *scale = float_to_half(s);
    const float sf = half_to_float(*scale);
    for (int d = 0; d < head_dim; d++) {
        float q = x[d] / sf;
        q = q < -code_max ? -code_max : q > code_max ? code_max : q;
        if (kind == 1) {
            q = nearbyintf(q); /* the default rounding mode: half to even, as torch.round */
            codes[d] = q == q ? (uint8_t)(int8_t)q : 0;
        } else {
            codes[d] = float_to_e4m3(q);
        }
    }
}

static NOINLINE void write_kv_q_row(const float *k, const float *v, int64_t row_stride,
                                    const int64_t *slots, uint8_t *k_codes, uint8_t *v_codes,
                                    uint16_t *k_scale, uint16_t *v_scale, int t, int num_kv_heads,
                                    int head_dim, int kind) {
    for (int h = 0; h < num_kv_heads; h++) {
        const int64_t index = slots[t] * num_kv_heads + h;
        const int64_t src = t * row_stride + (int64_t)h * head_dim;
        quantise_row(k + src, head_dim, kind, k_codes + index * head_dim, k_scale + index);
        quantise_row(v + src, head_dim, kind, v_codes + index * head_dim, v_scale + index);
    }
}

void write_kv_q(const float *k, const float *v, int64_t row_stride, const int64_t *slots,
                uint8_t *k_codes, uint8_t *v_codes, uint16_t *k_scale, uint16_t *v_scale,
                int num_rows, int num_kv_heads, int head_dim, int kind, int num_threads) {
    const int64_t kv_values = (int64_t)num_kv_heads * head_dim;
    FOR_ROWS(num_rows, (int64_t)num_rows * kv_values, PARALLEL_MIN_VALUES,
             write_kv_q_row(k, v, row_stride, slots, k_codes, v_codes, k_scale, v_scale, t,
                            num_kv_heads, head_dim, kind));
}

/* out = silu(gate) * up for gate_up [T, 2 I] (gate first); out [T, I]. */
/* One value: silu(g) * u = g / (1 + exp(-g)) * u. */
static inline float silu_mul1(float g, float u) { return g / (1.f + expf(-g)) * u; }

#ifdef __AVX2__
/* 8 values: sigmoid(g) from e = exp(-|g|) <= 1 (the vector exp takes x <= 0): 1 / (1 + e) for g >= 0,
 * e / (1 + e) below; then g * sigmoid * u. Within a few ulp of silu_mul1 (tests: 1e-6 relative); a NaN
 * or infinite g gives what silu_mul1 gives (the product with g carries a NaN; -inf: -inf * 0 = NaN). */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const __m256 e = exp8_nonpositive(_mm256_or_ps(g, sign)); /* exp(-|g|) */
    const __m256 num = _mm256_blendv_ps(one, e, g); /* g < 0 (sign bit set): e */
    return _mm256_mul_ps(_mm256_mul_ps(g, _mm256_div_ps(num, _mm256_add_ps(one, e))), u);
}
#endif

/* out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate first). The vector path is taken where
 * decode_isa() allows AVX2 (tests force the portable one). */
static NOINLINE void silu_mul_row(const float *gate_up, float *out, int t, int inter, int vec) {
    (void)vec;
    const float *g = gate_up + (int64_t)t * 2 * inter, *u = g + inter;
    float *o = out + (int64_t)t * inter;
    int d = 0;
#ifdef __AVX2__
    if (vec)
        for (; d + 8 <= inter; d += 8)
            _mm256_storeu_ps(o + d, silu_mul8(_mm256_loadu_ps(g + d), _mm256_loadu_ps(u + d)));
#endif
    for (; d < inter; d++) o[d] = silu_mul1(g[d], u[d]);
}

void silu_mul(const float *gate_up, float *out, int num_rows, int inter, int num_threads) {
    const int vec = decode_isa() >= 2;
    /* the vector path does ~8 values a ns: below 8x the portable threshold (a 32-token prefill of a
     * 1,536-wide MLP), waking the other threads costs more than it saves */
    const int64_t min_values = vec ? 8 * PARALLEL_MIN_VALUES : PARALLEL_MIN_VALUES;
    FOR_ROWS(num_rows, (int64_t)num_rows * inter, min_values, silu_mul_row(gate_up, out, t, inter, vec));
}
