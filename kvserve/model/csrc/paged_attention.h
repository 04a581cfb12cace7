/* Decode attention over the paged cache, cut into items (paged_attention.c): shared by the forking
 * call (paged_decode_attention) and the pooled fused step (decode_step.c). */
#ifndef KVSERVE_PAGED_ATTENTION_H
#define KVSERVE_PAGED_ATTENTION_H
#include <stdint.h>

#define SPLIT_TOKENS 256 /* context positions per item: the flash-decoding split */
#define MAX_GROUP 32     /* q heads per kv head */

typedef struct {
    const float *q;
    const void *k, *v;
    const uint16_t *k_scale, *v_scale;
    const float *lut; /* NULL: fp32 cache */
    const int32_t *block_table, *context_lens;
    float *out;
    int64_t q_row_stride;
    int batch, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
    float scale;
    /* from attention_setup: */
    int max_splits, kv_per_item, chunks, isa; /* splits of the longest context; kv heads per item;
                                                 q-head chunks per kv head (kv_per_item 1) */
    int64_t num_items, total_values;
    int int8_lut; /* lut is the int8 table (lut[c] = (int8_t)c): codes convert without it */
    int window;   /* > 0: a row reads its last `window` positions only (sliding-window layers) */
} AttnWork;

/* Describe one call (the arguments of paged_decode_attention); -1 for shapes it refuses, -3 for a
 * context longer than its block-table row (max_blocks x block_size positions) or negative. */
int attention_setup(AttnWork *w, const float *q, const void *k, const void *v,
                    const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                    const int32_t *block_table, const int32_t *context_lens, float *out,
                    int64_t q_row_stride, int batch, int num_heads, int num_kv_heads, int head_dim,
                    int block_size, int max_blocks, float scale, int num_threads);
/* As attention_setup, each row reading positions [context - window, context) only (window > 0). */
int attention_setup_window(AttnWork *w, const float *q, const void *k, const void *v,
                           const uint16_t *k_scale, const uint16_t *v_scale, const float *lut,
                           const int32_t *block_table, const int32_t *context_lens, float *out,
                           int64_t q_row_stride, int batch, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, int max_blocks, float scale,
                           int num_threads, int window);
/* floats of the `parts` scratch: [B, splits, H, D + 2] */
int64_t attention_parts_floats(const AttnWork *w);
/* items [i0, i1) of w->num_items (any thread, any order); then, once every item is done, */
void attention_items(const AttnWork *w, float *parts, int64_t i0, int64_t i1);
/* the output rows [r0, r1) of B x H (a no-op when there is one split: the items wrote them) */
void attention_merge(const AttnWork *w, const float *parts, int64_t r0, int64_t r1);
#endif
