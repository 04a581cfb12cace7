/* Shared by decode_step.c (the fused step, fp32 GEMV) and qgemv.c (the quantised GEMV / GEMM).
 * See docs/performance.md, "The fused decode step". */
#ifndef KVSERVE_DECODE_STEP_H
#define KVSERVE_DECODE_STEP_H
#include <stdatomic.h>
#include <stdint.h>

#define DECODE_MAX_ROWS 4
#define QBLOCK 32
#define QPANEL 8 /* output columns interleaved in one panel of the quantised layout */
#define FPANEL 16 /* output columns interleaved in one panel of the fp32 layout */

enum { LIN_F32 = 0, LIN_Q8 = 1, LIN_Q4 = 2, LIN_BF16 = 3, LIN_BF16DOT = 4 };
/* fp32 arithmetic on the fp32 panel layout: weights stored as fp32, or as bf16 bits (each one an fp32
 * whose low 16 bits are zero, so widening it is exact) */
#define LIN_IS_FLOAT(kind) ((kind) == LIN_F32 || (kind) == LIN_BF16)
/* output columns per panel: 16 for the float layouts and bf16 products, 8 for the integer ones */
#define LIN_WIDTH(kind) (LIN_IS_FLOAT(kind) || (kind) == LIN_BF16DOT ? FPANEL : QPANEL)

/* One linear y [M, N] = x [M, K] W^T + b.
 * fp32: the panel layout w[p][k][c] (fp32) = W[16p + c][k], N padded to a multiple of 16 columns
 *   (zeros), K as it is: one 64-byte line per input holds the panel's 16 columns.
 * bf16 (LIN_BF16): the same layout of uint16 bf16 bits, 32 bytes per input; the arithmetic is the fp32
 *   one on the widened weights, so it gives the bits the fp32 layout of the same values gives.
 * bf16 products (LIN_BF16DOT, bf16dot.c): w[p][j][c][t] (bf16 bits) = W[16p + c][2j + t], K padded to
 *   an even kp (zeros): one 64-byte line per pair of inputs; the activations are rounded to bf16 too.
 * int8 / int4 (qgemv.c): the panel-interleaved layout, N padded to Np = a multiple of 8 columns and
 *   K to Kp = a multiple of 32 inputs (zeros). Panel p holds columns 8p .. 8p + 7.
 *   int8: w[p][b][j][c][t] (int8) = code of column 8p + c, input 32b + 4j + t (j < 8, t < 4): one
 *     32-byte row holds 4 consecutive inputs of the panel's 8 columns.
 *   int4: w[p][b][j][c][t] (uint8, j < 4) = code of input 32b + 4j + t (low nibble) and of input
 *     32b + 16 + 4j + t (high nibble); codes unsigned, value = scale * (code - zero).
 *   scales [P, G, 8] fp16 (P = Np / 8, G groups of bpg blocks: the checkpoint's fp16 scales, so
 *   exact), zeros [P, G, 8] fp16 or NULL (symmetric int4: zero 8). */
typedef struct {
    int kind;     /* LIN_F32 | LIN_Q8 | LIN_Q4 | LIN_BF16 | LIN_BF16DOT */
    int n, k, kp; /* outputs, inputs, inputs padded (quantised: to a multiple of 32; LIN_BF16DOT: even) */
    int groups, bpg, act_mode; /* scale groups per row, blocks per group, activation rounding mode */
    const void *w;
    const void *scales, *zeros; /* quantised: fp16 bits, see above */
    const float *bias;          /* [N] or NULL */
} Linear;

/* Linear.act_mode, how activations are rounded to int8 (kvserve/model/qlinear.py _ACT_MODES): per 32
 * inputs of a row; per row; per tensor; per 32 inputs with the remainder rounded again (ACT_BLOCK2:
 * x = d1 q1 + d2 q2 + e with |e| <= d1 / 508, two Acts rows per input row, 2m and 2m + 1, whose
 * products store_panel adds). ACT_ONE_SCALE: one scale for a whole row (integer sums across blocks). */
enum { ACT_BLOCK = 0, ACT_ROW = 1, ACT_TENSOR = 2, ACT_BLOCK2 = 3 };
#define ACT_ROWS(mode) ((mode) == ACT_BLOCK2 ? 2 : 1)
#define ACT_ONE_SCALE(mode) ((mode) == ACT_ROW || (mode) == ACT_TENSOR)

/* Activations rounded to int8 (qgemv.c quantize_acts), for up to `rows` rows of `kp` inputs. */
typedef struct {
    int rows, kp;
    int8_t *codes;   /* [M, Kp] */
    float *scale;    /* [M, nb] */
    float *sum;      /* [M, nb]: sum of the block's codes */
    uint32_t *pairs; /* [M, Kp / 2]: bf16 products' activations (bf16dot.c), or NULL */
} Acts;

/* with_pairs: also the bf16 pairs buffer (a step with bf16-product linears) */
int alloc_acts(Acts *a, int rows, int max_kp, int with_pairs);
void free_acts(Acts *a);
/* M input rows into M * ACT_ROWS(mode) rows of a */
void quantize_acts(const float *x, int M, int K, int Kp, int mode, Acts *a, int isa, int num_threads);
/* the quantised linear for any M from fp32 input: rounding and panels in one parallel region */
int q_linear_x(const Linear *L, const float *x, int M, float *y, int isa, int num_threads);
/* panels [p0, p1) of the same, on the calling thread (the fused step's one-region mode) */
void q_linear_panels(const Linear *L, const Acts *a, int M, float *y, int isa, int p0, int p1);
/* bf16dot.c: rows [m0, m1) of x [M, K] as bf16 pairs [M, Kp / 2]; panels [p0, p1) on this thread; the
 * whole linear in one parallel region */
void bf16_round_rows(const float *x, int m0, int m1, int K, int Kp, uint32_t *pairs);
void bf16dot_panels(const Linear *L, const uint32_t *xp, int M, float *y, int isa, int p0, int p1);
int bf16dot_linear_x(const Linear *L, const float *x, int M, float *y, int isa, int num_threads);
/* decode_step.c: whether linears hand their panels out in chunks (decode_set_guided), and the next
 * chunk (at least min_k panels) of a shared counter's [*next, end) for one of `nt` threads; 0 when
 * none is left */
int decode_guided(void);
int decode_claim_panels(atomic_llong *next, long long end, int nt, long long min_k, long long *first,
                        long long *count);
/* the smallest chunk of L's panels worth one claim at M rows (decode_step.c) */
long long decode_claim_min_panels(const Linear *L, int M);

#endif
