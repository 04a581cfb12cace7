/* GGUF block weights (kvserve/model/block_weights.py) times fp32 activations, and their dequantisation.
 *
 * A weight row n holds, per group g of L = 16 or 32 inputs, W[n, k] = s[n, g] * c[n, k] (+ b[n, g]) with
 * c a small integer: int8 codes (one per byte) or nibble codes (groups of 32 in 16 bytes, byte j =
 * (c_j + off) | (c_{j+16} + off) << 4).
 *
 * block_linear: y[m, n] = sum_g (sum_{k in g} x[m, k] * fl(s[n, g] * c[n, k])) + sum_g b[n, g] * xsum[m, g]
 *   (+ out_bias[n]), xsum[m, g] = sum_{k in g} x[m, k] computed once per call. A group's codes are
 *   widened to fp32 and scaled once (in registers) and then FMA'd into up to BLK_ROWS activation rows,
 *   so a batch of M rows reads the weights once per BLK_ROWS rows, not M times. Threads split output
 *   rows in chunks of BLK_NCHUNK; within a chunk the loop runs activation tiles outermost, so a tile
 *   of x stays in L2 while the chunk's weight rows stream through L1.
 * block_dequant_rows: out[r, :] = W[row r, :] in fp32, fl(fl(s * c) + b): the same bits as ggml's
 *   dequantize (no FMA: -std=c11 compiles with -ffp-contract=off, the AVX2 path uses mul then add).
 *
 * Paths: AVX2+FMA (compiled in under -march=native with AVX2, taken when decode_isa() >= 2, which
 * decode_set_max_isa caps: tests force the scalar path) and a portable scalar path.
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

int decode_isa(void); /* decode_step.c: 3 AVX-512, 2 AVX2, 0 the portable loops */

#define BLK_ROWS 8     /* activation rows per pass over a weight row */
#define BLK_NCHUNK 16  /* output rows a thread takes at a time */
#define BLK_MAX_GROUP 32

typedef struct {
    const uint8_t *codes; /* [N, K / 2] nibbles or [N, K] int8 */
    const float *scales;  /* [N, G] */
    const float *biases;  /* [N, G] or NULL */
    int K, G, L, nibble, offset;
} BlockMat;

/* the codes c of group g of row n, as integers */
static inline void group_codes(const BlockMat *w, int64_t n, int g, int *c) {
    if (w->nibble) {
        const uint8_t *p = w->codes + n * (w->K / 2) + (int64_t)g * 16;
        for (int j = 0; j < 16; j++) c[j] = (p[j] & 15) - w->offset, c[j + 16] = (p[j] >> 4) - w->offset;
    } else {
        const int8_t *p = (const int8_t *)w->codes + n * w->K + (int64_t)g * w->L;
        for (int j = 0; j < w->L; j++) c[j] = p[j];
    }
}

/* ---- scalar -------------------------------------------------------------------------------------- */

static void row_scalar(const BlockMat *w, int64_t n, const float *x, int64_t ldx, int R, const float *xsum,
                       float *acc) {
    float wv[BLK_MAX_GROUP];
    int c[BLK_MAX_GROUP];
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int g = 0; g < w->G; g++) {
        const float s = w->scales[n * w->G + g];
        group_codes(w, n, g, c);
        for (int j = 0; j < w->L; j++) wv[j] = s * (float)c[j];
        for (int r = 0; r < R; r++) {
            const float *xr = x + r * ldx + (int64_t)g * w->L;
            float a = 0.f;
            for (int j = 0; j < w->L; j++) a += xr[j] * wv[j];
            acc[r] += a;
            if (w->biases) acc[r] += w->biases[n * w->G + g] * xsum[(int64_t)r * w->G + g];
        }
    }
}

/* ---- AVX2 ---------------------------------------------------------------------------------------- */
#ifdef __AVX2__
static inline float hsum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

/* group g of row n as fp32 codes: v[0..nv), nv = L / 8 (a compile-time constant after inlining: a runtime
 * bound kept v in memory, and the 8-bit path of a 262,144-row head ran at a third of its speed) */
static inline __attribute__((always_inline)) void group_codes_avx2(const BlockMat *w, int64_t n, int g,
                                                                   const int nv, __m256 *v) {
    if (w->nibble) {
        const __m128i b = _mm_loadu_si128((const __m128i *)(w->codes + n * (w->K / 2) + (int64_t)g * 16));
        const __m128i mask = _mm_set1_epi8(15), off = _mm_set1_epi8((char)w->offset);
        const __m128i lo = _mm_sub_epi8(_mm_and_si128(b, mask), off);
        const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), off);
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        v[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        v[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        const int8_t *p = (const int8_t *)w->codes + n * w->K + (int64_t)g * w->L;
        for (int i = 0; i < nv / 2; i++) {
            const __m128i b = _mm_loadu_si128((const __m128i *)(p + 16 * i));
            v[2 * i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
            v[2 * i + 1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
        }
    }
}

/* R (a compile-time constant after inlining) rows of x times weight row n */
static inline __attribute__((always_inline)) void row_avx2_r(const BlockMat *w, int64_t n, const float *x,
                                                             int64_t ldx, const int R, const int nv,
                                                             const float *xsum, float *out) {
    __m256 acc[BLK_ROWS], v[4];
    float bacc[BLK_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), bacc[r] = 0.f;
    for (int g = 0; g < w->G; g++) {
        const __m256 s = _mm256_broadcast_ss(w->scales + n * w->G + g);
        group_codes_avx2(w, n, g, nv, v);
        for (int i = 0; i < nv; i++) v[i] = _mm256_mul_ps(v[i], s);
        const float *xg = x + (int64_t)g * w->L;
        /* a group's products are summed on their own, then added to the row's sum: the next group's
         * FMAs do not wait on this one's (one chained accumulator held a single row at 2 weights a
         * cycle), and every R sums in the same order (a row's result does not depend on the batch) */
        for (int r = 0; r < R; r++) {
            const float *xr = xg + r * ldx;
            __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xr), v[0]);
            for (int i = 1; i < nv; i++) t = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * i), v[i], t);
            acc[r] = _mm256_add_ps(acc[r], t);
        }
        if (w->biases) {
            const float b = w->biases[n * w->G + g];
            for (int r = 0; r < R; r++) bacc[r] += b * xsum[(int64_t)r * w->G + g];
        }
    }
    for (int r = 0; r < R; r++) out[r] = hsum8(acc[r]) + bacc[r];
}

/* R and the group's vector count are compile-time constants in every case (a runtime bound keeps the
 * accumulators and codes in memory instead of registers) */
#define ROW_CASES(NV)                                                       \
    switch (R) {                                                            \
        case 8: row_avx2_r(w, n, x, ldx, 8, NV, xsum, out); break;          \
        case 7: row_avx2_r(w, n, x, ldx, 7, NV, xsum, out); break;          \
        case 6: row_avx2_r(w, n, x, ldx, 6, NV, xsum, out); break;          \
        case 5: row_avx2_r(w, n, x, ldx, 5, NV, xsum, out); break;          \
        case 4: row_avx2_r(w, n, x, ldx, 4, NV, xsum, out); break;          \
        case 3: row_avx2_r(w, n, x, ldx, 3, NV, xsum, out); break;          \
        case 2: row_avx2_r(w, n, x, ldx, 2, NV, xsum, out); break;          \
        default: row_avx2_r(w, n, x, ldx, 1, NV, xsum, out); break;         \
    }

static void row_avx2(const BlockMat *w, int64_t n, const float *x, int64_t ldx, int R, const float *xsum,
                     float *out) {
    if (w->L == 32) {
        ROW_CASES(4)
    } else {
        ROW_CASES(2)
    }
}
#endif

static int check_shape(int K, int L, int nibble) {
    if ((L != 16 && L != 32) || K <= 0 || K % L || (nibble && L != 32)) return -1;
    return 0;
}

/* y[m * ldy + n] = x[m] . W[n] (+ out_bias[n]) for m < M, n < N. Returns 0, -1 (bad shape) or -2 (no
 * memory). */
int block_linear(const float *x, int64_t ldx, int M, int K, const uint8_t *codes, int nibble, int offset,
                 const float *scales, const float *biases, int L, int N, const float *out_bias, float *y,
                 int64_t ldy, int num_threads) {
    if (check_shape(K, L, nibble) || M < 0 || N < 0) return -1;
    const BlockMat w = {codes, scales, biases, K, K / L, L, nibble, offset};
    const int G = w.G;
    float *xsum = NULL;
    if (biases) {
        xsum = malloc(sizeof(float) * ((size_t)M * G + 1));
        if (!xsum) return -2;
        for (int64_t i = 0; i < (int64_t)M * G; i++) {
            const float *xp = x + (i / G) * ldx + (i % G) * L;
            float s = 0.f;
            for (int j = 0; j < L; j++) s += xp[j];
            xsum[i] = s;
        }
    }
    const int vec = decode_isa() >= 2;
    const int64_t num_chunks = ((int64_t)N + BLK_NCHUNK - 1) / BLK_NCHUNK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t chunk = 0; chunk < num_chunks; chunk++) {
        const int64_t n0 = chunk * BLK_NCHUNK, n1 = n0 + BLK_NCHUNK < N ? n0 + BLK_NCHUNK : N;
        float out[BLK_ROWS];
        for (int m0 = 0; m0 < M; m0 += BLK_ROWS) {
            const int R = M - m0 < BLK_ROWS ? M - m0 : BLK_ROWS;
            const float *xt = x + m0 * ldx, *st = xsum ? xsum + (int64_t)m0 * G : NULL;
            for (int64_t n = n0; n < n1; n++) {
#ifdef __AVX2__
                if (vec) row_avx2(&w, n, xt, ldx, R, st, out);
                else
#endif
                    row_scalar(&w, n, xt, ldx, R, st, out);
                const float ob = out_bias ? out_bias[n] : 0.f;
                for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = out[r] + ob;
            }
        }
    }
    (void)vec;
    free(xsum);
    return 0;
}

/* out[r * ldo + k] = W[row, k] for r < R, row = row_ids[r] (or row0 + r when row_ids is NULL) */
int block_dequant_rows(const uint8_t *codes, int nibble, int offset, const float *scales, const float *biases,
                       int L, int K, const int64_t *row_ids, int64_t row0, int R, float *out, int64_t ldo,
                       int num_threads) {
    if (check_shape(K, L, nibble) || R < 0) return -1;
    const BlockMat w = {codes, scales, biases, K, K / L, L, nibble, offset};
    const int vec = decode_isa() >= 2;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int r = 0; r < R; r++) {
        const int64_t n = row_ids ? row_ids[r] : row0 + r;
        float *o = out + r * ldo;
        for (int g = 0; g < w.G; g++) {
            const float s = w.scales[n * w.G + g], b = w.biases ? w.biases[n * w.G + g] : 0.f;
            float *og = o + (int64_t)g * L;
#ifdef __AVX2__
            if (vec) {
                __m256 v[4];
                if (L == 32) group_codes_avx2(&w, n, g, 4, v);
                else group_codes_avx2(&w, n, g, 2, v);
                const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
                for (int i = 0; i < L / 8; i++) {
                    __m256 t = _mm256_mul_ps(v[i], vs);
                    if (w.biases) t = _mm256_add_ps(t, vb);
                    _mm256_storeu_ps(og + 8 * i, t);
                }
                continue;
            }
#endif
            int c[BLK_MAX_GROUP];
            group_codes(&w, n, g, c);
            for (int j = 0; j < L; j++) {
                const float p = s * (float)c[j];
                og[j] = w.biases ? p + b : p;
            }
        }
    }
    (void)vec;
    return 0;
}
