/* trellm CUDA kernels: the C ABI.
 *
 * Plain C functions taking device pointers, sizes and a stream, returning an int error code:
 * 0 on success, a positive cudaError_t from a failed launch, or a negative TRELLM_E_* code for an
 * argument the kernel cannot handle. trellm_error_string() turns either into text.
 * Tensors are dense and row-major unless a stride argument says otherwise.
 *
 * The block between ABI BEGIN and ABI END is read verbatim by cffi (binding.py): keep it plain C
 * declarations, no preprocessor lines.
 */
#ifndef TRELLM_KERNELS_H
#define TRELLM_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ABI BEGIN */
typedef struct CUstream_st *cudaStream_t;

enum {
    TRELLM_OK = 0,
    TRELLM_E_BAD_DTYPE = -1,
    TRELLM_E_BAD_SHAPE = -2,
    TRELLM_E_BAD_ARG = -3,
    TRELLM_E_UNSUPPORTED = -4
};

/* dtype codes */
enum { TRELLM_F16 = 0, TRELLM_BF16 = 1, TRELLM_F32 = 2 };

/* codebook codes: 3INST, MCG, MUL1. The small-batch matmuls (trellm_exl3_matmul_small*) and
 * trellm_moe_exl3_matmul also take 3: MUL1 through the split-halves decode (no per-weight fp16 fma; the
 * weights unrounded, see CB_MUL1_SPLIT in common.cuh). */
enum { TRELLM_CB_3INST = 0, TRELLM_CB_MCG = 1, TRELLM_CB_MUL1 = 2 };

/* activation codes for trellm_gated_activation */
enum { TRELLM_ACT_SILU = 0, TRELLM_ACT_GELU = 1, TRELLM_ACT_GELU_TANH = 2, TRELLM_ACT_RELU = 3, TRELLM_ACT_RELU2 = 4 };

const char *trellm_error_string(int code);
int trellm_abi_version(void);

/* Programmatic dependent launch of the EXL3 GEMV (its weight prefetch overlaps the previous kernel's
 * tail): on by default on compute capability 9+. Returns the resulting state. */
int trellm_set_pdl(int enabled);

/* out[i] = value for i < n (float32): the smallest launch, for build/graph checks. */
int trellm_fill_f32(float *out, int64_t n, float value, cudaStream_t stream);

/* y[r, :] = H128_blocks(x[r, :] * pre) * post + bias, float32 math. pre/post/bias are fp16 [dim] or NULL.
 * x and y may have different dtypes; dim % 128 == 0. */
int trellm_hadamard_128(const void *x, int x_dtype, void *y, int y_dtype, int64_t rows, int64_t dim,
                        const void *pre, const void *post, const void *bias, cudaStream_t stream);

/* EXL3 matmul for 1..16 rows in one launch: y [m, n] (y_dtype) = H128(H128(x * suh) @ W_hat) * svh + bias.
 * x [m, k] (x_dtype); suh, svh, bias fp16 (bias may be NULL); trellis int16 [k/16, n/16, 16*K].
 * workspace: float32 of trellm_exl3_matmul_small_workspace(m, k, n) elements; counters: int32 [>= n/128],
 * all zero before the first call (each call leaves them zero). Calls sharing counters must not run
 * concurrently on different streams. */
int64_t trellm_exl3_matmul_small_workspace(int64_t m, int64_t k, int64_t n);

/* A pre-norm block's residual stream through the small-batch GEMVs, so no RMSNorm launch sits between
 * them (rs argument below; NULL: neither end).
 * residual != NULL (one part, no head epilogue: trellm_exl3_matmul_small, _gated): y = round(round(x W + bias)
 *   + residual) with residual [m, n] of y_dtype, and ssq_out [m, n/128] float32 receives each row's sum of
 *   squares of y per 128-column group.
 * ssq_in != NULL (not with gate/up): the input is rms_norm(x) over k, x's squares summed from ssq_in
 *   [m, k/128] (the ssq_out of the GEMV that produced x), scaled by norm_weight [k] of x_dtype (NULL: no
 *   scale; by 1 + weight with norm_unit_offset), rounded as trellm_rms_norm rounds it. */
typedef struct {
    const void *residual;
    float *ssq_out;
    const float *ssq_in;
    const void *norm_weight;
    float norm_eps;
    int norm_unit_offset;
} trellm_residual_stream;

int trellm_exl3_matmul_small(const void *x, int x_dtype, const void *suh, const int16_t *trellis, const void *svh,
                             const void *bias, void *y, int y_dtype, float *workspace, int32_t *counters,
                             int64_t counters_len, int64_t m, int64_t k, int64_t n, int K, int codebook,
                             const trellm_residual_stream *rs, int num_sms, cudaStream_t stream);

/* EXL3 matmul for 1..64 rows (a batched decode step; the route above 16 rows) of x by 1..4 parts, as
 * trellm_exl3_matmul_small_multi takes them (trellis[p] int16 [k/16, n[p]/16, 16*K], suh[p], svh[p], bias[p]
 * (may be NULL), y[p] [m, n[p]]; one K and codebook): the same y, in three launches (x packed into
 * tensor-core fragments per part; the trellis decoded in registers against them, the work split evenly over
 * one wave of blocks; the partials summed with H128 * svh + bias). workspace: float32 of
 * trellm_exl3_matmul_mid_workspace(m, k, parts, n, num_sms) elements (0: the shape is not supported),
 * 16-byte aligned; no counters, no state between calls. rs as for trellm_exl3_matmul_small (NULL: neither
 * end): the residual add with one part, the input norm with any. */
int64_t trellm_exl3_matmul_mid_workspace(int64_t m, int64_t k, int parts, const int64_t *n, int num_sms);
int trellm_exl3_matmul_mid(const void *x, int x_dtype, int parts, const void *const *suh,
                           const int16_t *const *trellis, const void *const *svh, const void *const *bias,
                           void *const *y, const int64_t *n, int y_dtype, float *workspace, int64_t workspace_len,
                           int64_t m, int64_t k, int K, int codebook, const trellm_residual_stream *rs, int num_sms,
                           cudaStream_t stream);

/* The same with x = act(gate) * up (gate, up [m, k] of x_dtype; activation TRELLM_ACT_*), the activation
 * applied in the input transform and rounded as trellm_gated_activation rounds it: a gated MLP's down
 * projection in one launch. */
int trellm_exl3_matmul_small_gated(const void *gate, const void *up, int activation, int x_dtype,
                                   const void *suh, const int16_t *trellis, const void *svh, const void *bias,
                                   void *y, int y_dtype, float *workspace, int32_t *counters, int64_t counters_len,
                                   int64_t m, int64_t k, int64_t n, int K, int codebook,
                                   const trellm_residual_stream *rs, int num_sms,
                                   cudaStream_t stream);

/* The same for 1..4 matmuls of one x (q/k/v, gate/up) in one launch: part p has trellis[p] int16
 * [k/16, n[p]/16, 16*K], suh[p], svh[p], bias[p] (may be NULL) and output y[p] [m, n[p]]; all parts share
 * K and the codebook. workspace: float32 of trellm_exl3_matmul_small_workspace(m, k, sum of n) elements;
 * counters: int32 [>= sum of n / 128], zero before the first call. */
int trellm_exl3_matmul_small_multi(const void *x, int x_dtype, int parts, const void *const *suh,
                                   const int16_t *const *trellis, const void *const *svh, const void *const *bias,
                                   void *const *y, const int64_t *n, int y_dtype, float *workspace,
                                   int32_t *counters, int64_t counters_len, int64_t m, int64_t k, int K,
                                   int codebook, const trellm_residual_stream *rs, int num_sms, cudaStream_t stream);

/* The q/k/v projections of trellm_exl3_matmul_small_multi (parts 0, 1, 2; x and y of one dtype, fp16 or
 * bf16; 128-wide heads: n[0] = 128 * hq, n[1] = n[2] = 128 * hkv) finished as trellm_rotary_qk does it:
 * q and k (y[0], y[1]) optionally RMS-normed per head with q_norm / k_norm [128] (both or neither), then
 * rotated at positions[t] of the float32 tables cos/sin [table_len, rot_half] (rot_half % 4 == 0,
 * 2 * rot_half <= 128); with k_pages != NULL, the rotated k and v also stored at slots[t] (negative = skip)
 * of k_pages/v_pages [num_pages, page_size, hkv, 128]. One launch. */
int trellm_exl3_matmul_small_qkv_rope(const void *x, int dtype, const void *const *suh,
                                      const int16_t *const *trellis, const void *const *svh,
                                      const void *const *bias, void *const *y, const int64_t *n, float *workspace,
                                      int32_t *counters, int64_t counters_len, int64_t m, int64_t k, int K,
                                      int codebook, const int64_t *positions, const float *cos, const float *sin,
                                      int64_t table_len, int64_t rot_half, int interleaved, const void *q_norm,
                                      const void *k_norm, float norm_eps, int norm_unit_offset, void *k_pages,
                                      void *v_pages, const int64_t *slots, const trellm_residual_stream *rs,
                                      int num_sms, cudaStream_t stream);

/* The q/k/v projections on the mid-size route (1..64 rows), finished for attention as
 * trellm_exl3_matmul_small_qkv_rope finishes them (its arguments, with the mid route's workspace and no
 * counters); the epilogue runs in the finish launch. */
int trellm_exl3_matmul_mid_qkv_rope(const void *x, int dtype, const void *const *suh, const int16_t *const *trellis,
                                    const void *const *svh, const void *const *bias, void *const *y, const int64_t *n,
                                    float *workspace, int64_t workspace_len, int64_t m, int64_t k, int K, int codebook,
                                    const int64_t *positions, const float *cos, const float *sin, int64_t table_len,
                                    int64_t rot_half, int interleaved, const void *q_norm, const void *k_norm,
                                    float norm_eps, int norm_unit_offset, void *k_pages, void *v_pages,
                                    const int64_t *slots, const trellm_residual_stream *rs, int num_sms,
                                    cudaStream_t stream);

/* W_hat fp16 [k, n] from the trellis (no Hadamards, no scales). */
int trellm_exl3_decode_tiles(const int16_t *trellis, void *w_hat, int64_t k, int64_t n, int K, int codebook,
                             cudaStream_t stream);

/* out fp16 [count] = decode(states[i] & 0xFFFF). */
int trellm_exl3_codebook_decode(const int32_t *states, void *out, int64_t count, int codebook, cudaStream_t stream);

/* Tail-biting Viterbi over tiles: targets float32 [tiles, 256] (position order) -> states int32 [tiles, 256].
 * scratch: trellm_viterbi_scratch_bytes(tiles, K, num_sms) bytes of device memory. */
int64_t trellm_viterbi_scratch_bytes(int64_t tiles, int K, int num_sms);
int trellm_trellis_viterbi(const float *targets, int32_t *states, int64_t tiles, int K, int codebook,
                           void *scratch, int num_sms, cudaStream_t stream);

/* RMSNorm over rows of x [rows, dim] (dtype), float32 math. If residual != NULL: h = x + residual
 * (rounded to dtype) is written to h_out and normalised. weight (w_dtype) may be NULL. */
int trellm_rms_norm(const void *x, const void *residual, const void *weight, void *y, void *h_out,
                    int64_t rows, int64_t dim, int dtype, int w_dtype, float eps, int unit_offset,
                    cudaStream_t stream);

/* x, y [tokens, heads, head_dim]; cos, sin float32 [tokens, half]; rotates the first 2*half dims. */
int trellm_rotary_embedding(const void *x, void *y, const float *cos, const float *sin, int64_t tokens,
                            int64_t heads, int64_t head_dim, int64_t rot_half, int interleaved, int dtype,
                            cudaStream_t stream);

/* out [rows, dim] = act(gate) * up; gate/up rows are gate_stride/up_stride elements apart. */
int trellm_gated_activation(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride, void *out,
                            int64_t rows, int64_t dim, int dtype, int activation, cudaStream_t stream);

/* k, v [tokens, row_elems] -> k_pages/v_pages rows at slots[t] (int64; negative = skip). */
int trellm_write_kv_pages(const void *k, const void *v, void *k_pages, void *v_pages, const int64_t *slots,
                          int64_t tokens, int64_t row_elems, int dtype, cudaStream_t stream);

/* Paged attention of each query token over its sequence's cached context (decode and chunked prefill).
 * q [tokens, hq, d]; pages [num_pages, page_size, hkv, d]; block_table int32 [batch, max_blocks];
 * cu_seqlens int32 [batch+1]; context_lens int32 [batch]; sinks float32 [hq] or NULL; out like q.
 * splits: key splits per (token, head) from trellm_paged_attention_splits_for (whole waves of the kernel
 * instance for dtype and d); when > 1, workspace is float32 [tokens * hq * splits * (d + 2)]. */
int trellm_paged_attention_splits_for(int64_t tokens, int64_t hq, int64_t hkv, int64_t head_dim, int dtype,
                                      int64_t page_size, int64_t max_blocks, int num_sms);
int trellm_paged_attention(const void *q, const void *k_pages, const void *v_pages, const int32_t *block_table,
                           const int32_t *cu_seqlens, const int32_t *context_lens, const float *sinks, void *out,
                           float *workspace, int splits, int64_t tokens, int64_t batch, int64_t hq, int64_t hkv,
                           int64_t head_dim, int64_t page_size, int64_t max_blocks, float scale, int sliding_window,
                           float softcap, int dtype, cudaStream_t stream);

/* ---- KV-cache quantization (kv_quant.cu; format of core/ops/kv_quant.py) ----
 * Each 32-value group of a row is rotated by H32/sqrt(32), scaled by its fp16 absmax and coded at bits (2..8)
 * in bit planes: a row of dim values is dim/32*bits int32 words plus dim/32 fp16 scales.
 * Quantize x [tokens, dim] (dtype) into rows of packed int32 [out_rows, dim/32*bits] and scales fp16
 * [out_rows, dim/32]: token t goes to row slots[t] (int64; negative or >= out_rows = skipped), or to row t
 * when slots is NULL. */
int trellm_kv_quantize(const void *x, int dtype, int32_t *packed, void *scales, const int64_t *slots,
                       int64_t tokens, int64_t dim, int64_t out_rows, int bits, cudaStream_t stream);

/* Dequantize into out [rows, dim] (dtype) from packed/scales of src_rows rows. pages int64 [rows/page_size]
 * or NULL: output row r reads row pages[r / page_size] * page_size + r % page_size (a gather of whole pages,
 * a source outside [0, src_rows) gives zeros), or row r when pages is NULL. */
int trellm_kv_dequantize(const int32_t *packed, const void *scales, const int64_t *pages, int64_t page_size,
                         int64_t src_rows, void *out, int dtype, int64_t rows, int64_t dim, int bits,
                         cudaStream_t stream);
/* ---- MoE decode and gated delta net decode (moe.cu, deltanet.cu) ---- */

/* modes of trellm_moe_exl3_matmul */
enum { TRELLM_MOE_PLAIN = 0, TRELLM_MOE_SILU_GATED = 1, TRELLM_MOE_COMBINE = 2 };

/* Sync-free EXL3 expert matmuls of `pairs` (row, expert) pairs: pair p multiplies x row p / pairs_per_row
 * by matrix m of expert expert_of[p] (int64, read on the device). table: uint64 [matrices, num_experts, 4]
 * = {trellis, suh, svh, bias or 0} device pointers (int16 [k/16, n/16, 16*K], fp16 [k], fp16 [n], fp16 [n]).
 * mode PLAIN: y [matrices, pairs, n]; SILU_GATED (matrices 2): y [pairs, n] = silu(W0 x) * (W1 x);
 * COMBINE (matrices 1): y [pairs / top_k, n] = sum_j pair_weights[t*top_k + j] * y_{t*top_k + j}
 * (pair_weights float32 [pairs]). workspace: float32 of trellm_moe_exl3_workspace(...) elements. */
int64_t trellm_moe_exl3_workspace(int64_t pairs, int64_t matrices, int64_t k, int64_t n, int num_sms);
/* counters: NULL (two launches: partial sums, then a finishing kernel) or int32 [trellm_moe_exl3_counters(...)]
 * all zero (one launch: the last block of each (item, 128-column group) to write its partial sums finishes it,
 * and leaves its counter zero again; one stream at a time per counter buffer). */
int64_t trellm_moe_exl3_counters(int64_t pairs, int64_t top_k, int mode, int64_t n);
int trellm_moe_exl3_matmul(const void *x, int x_dtype, const int64_t *expert_of, const uint64_t *table,
                           float *workspace, int *counters, const float *pair_weights, void *y, int y_dtype, int mode,
                           int64_t pairs, int64_t pairs_per_row, int64_t top_k, int64_t matrices,
                           int64_t num_experts, int64_t k, int64_t n, int K, int codebook, int num_sms,
                           cudaStream_t stream);

/* Dense expert GEMVs: y [pairs, n] = W_{expert_of[p]} x[p / pairs_per_row] (+ bias). weights: uint64 [num_experts]
 * pointers to row-major [n, k] matrices (dtype, 16-byte aligned, k % 8 == 0; % 4 for float32); biases:
 * uint64 [num_experts] pointers to [n] (0 = none) or NULL. */
int trellm_moe_dense_matmul(const void *x, const int64_t *expert_of, const uint64_t *weights, const uint64_t *biases,
                            void *y, int dtype, int64_t pairs, int64_t pairs_per_row, int64_t num_experts, int64_t k,
                            int64_t n, cudaStream_t stream);

/* Gated delta rule, one token per sequence: q/k [BH, dk], v [BH, dv] (own dtypes), g/beta float32 [BH],
 * state float32 [BH, dk, dv] -> new_state float32 [BH, dk, dv], out [BH, dv] (v dtype). dk in {64, 128, 256},
 * dv % 32 == 0. */
int trellm_gated_delta_rule_step(const void *q, int q_dtype, const void *k, int k_dtype, const void *v, int v_dtype,
                                 const float *g, const float *beta, const float *state, float *new_state, void *out,
                                 int64_t batch_heads, int64_t dk, int64_t dv, float scale, cudaStream_t stream);

/* Causal depthwise conv1d, one token per sequence: x [B, C], weight [C, width] (width <= 8), bias [C] or NULL,
 * states [B, C, width-1] -> out [B, C] (x dtype), new_states [B, C, width-1] (states dtype); silu 0/1. */
int trellm_causal_conv1d_step(const void *x, int x_dtype, const void *weight, int w_dtype, const void *bias,
                              int b_dtype, const void *states, int s_dtype, void *out, void *new_states, int64_t batch,
                              int64_t channels, int64_t width, int silu, cudaStream_t stream);
/* ---- end MoE / gated delta net ---- */
/* --- fused RoPE (decode-step fusion) --- */
/* q [tokens, hq, d], k [tokens, hkv, d] -> q_out, k_out (same shapes, dtype of q): each head row optionally
 * RMS-normed with q_norm / k_norm [d] (dtype of q; both or neither; rounded to the dtype), then rotated with
 * row positions[t] (int64) of the float32 tables cos/sin [table_len, rot_half] (positions clamped into the
 * table). With k_pages != NULL, also stores the rotated k and v [tokens, hkv, d] at slots[t] (int64, negative
 * = skip) of k_pages/v_pages [num_pages, page_size, hkv, d] (dtype of q). d <= 1024. */
int trellm_rotary_qk(const void *q, const void *k, void *q_out, void *k_out, const int64_t *positions,
                     const float *cos, const float *sin, int64_t table_len, const void *q_norm, const void *k_norm,
                     float norm_eps, int norm_unit_offset, const void *v, void *k_pages, void *v_pages,
                     const int64_t *slots, int64_t tokens, int64_t hq, int64_t hkv, int64_t head_dim, int64_t rot_half,
                     int interleaved, int dtype, cudaStream_t stream);
/* ---- gated delta net decode on the cache's slots, in place (deltanet.cu) ----
 * As trellm_gated_delta_rule_step / trellm_causal_conv1d_step, but sequence b reads and updates row slots[b]
 * (int64) of the slot storage in place: states float32 [slots, heads, dk, dv], conv states [slots, C, width-1].
 * fresh: uint8 [batch] or NULL; 1 = the sequence starts from the zero state (its old slot contents ignored). */
int trellm_gated_delta_rule_step_slots(const void *q, int q_dtype, const void *k, int k_dtype, const void *v,
                                       int v_dtype, const float *g, const float *beta, float *states,
                                       const int64_t *slots, const uint8_t *fresh, void *out, int64_t batch,
                                       int64_t heads, int64_t dk, int64_t dv, float scale, cudaStream_t stream);
int trellm_causal_conv1d_step_slots(const void *x, int x_dtype, const void *weight, int w_dtype, const void *bias,
                                    int b_dtype, void *states, int s_dtype, const int64_t *slots, const uint8_t *fresh,
                                    void *out, int64_t batch, int64_t channels, int64_t width, int silu,
                                    cudaStream_t stream);
/* A gated delta net's decode step from its raw inputs, as trellm_gated_delta_rule_step_slots otherwise: mixed
 * [batch, row_stride] (dtype) holds q [k_heads * dk] | k [k_heads * dk] | v [v_heads * dv] per row; value head h
 * reads key head h / (v_heads / k_heads); q and k are L2-normalised (x / sqrt(sum x^2 + l2_eps)); a, b
 * [batch, v_heads] (gate_dtype) give g = -exp(A_log[h]) * softplus(a + dt_bias[h]) and beta = sigmoid(b) *
 * beta_scale (A_log, dt_bias float32 [v_heads]). out [batch, v_heads, dv] (dtype). */
int trellm_gated_delta_net_step_slots(const void *mixed, int dtype, int64_t row_stride, const void *a, const void *b,
                                      int gate_dtype, const float *A_log, const float *dt_bias, float beta_scale,
                                      float l2_eps, float *states, const int64_t *slots, const uint8_t *fresh, void *out,
                                      int64_t batch, int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv,
                                      float scale, cudaStream_t stream);
/* Kimi delta attention (KDA): as trellm_gated_delta_rule_step_slots with a decay per key channel, g float32
 * [batch, heads, dk] (row i of each head's state scaled by exp(g[i])). */
int trellm_kda_step_slots(const void *q, int q_dtype, const void *k, int k_dtype, const void *v, int v_dtype,
                          const float *g, const float *beta, float *states, const int64_t *slots, const uint8_t *fresh,
                          void *out, int64_t batch, int64_t heads, int64_t dk, int64_t dv, float scale,
                          cudaStream_t stream);
/* A KDA layer's decode step from its raw inputs, as trellm_gated_delta_net_step_slots (mixed, heads, L2 norms) but
 * g per key channel from f [batch, v_heads * dk] (gate_dtype): x = f + dt_bias (float32 [v_heads * dk]),
 * g = lower_bound * sigmoid(exp(A_log[h]) * x) when bounded, else -exp(A_log[h]) * softplus(x); beta = sigmoid(b),
 * b [batch, v_heads] (gate_dtype). */
int trellm_kimi_delta_attention_step_slots(const void *mixed, int dtype, int64_t row_stride, const void *f,
                                           const void *b, int gate_dtype, const float *A_log, const float *dt_bias,
                                           int bounded, float lower_bound, float l2_eps, float *states,
                                           const int64_t *slots, const uint8_t *fresh, void *out, int64_t batch,
                                           int64_t k_heads, int64_t v_heads, int64_t dk, int64_t dv, float scale,
                                           cudaStream_t stream);
/* y [rows, dim] (x's dtype) = rms_norm(x) * weight (rounded to x's dtype) * act(gate), act sigmoid (sigmoid_gate 1)
 * or silu, per row: a gated delta net's (KDA's) output norm. x, gate [rows, dim], weight [dim], own dtypes. */
int trellm_gated_rms_norm(const void *x, int x_dtype, const void *weight, int w_dtype, const void *gate, int g_dtype,
                          void *y, int64_t rows, int64_t dim, float eps, int sigmoid_gate, cudaStream_t stream);
/* ---- end gated delta net slots ---- */
/* ---- MoE router (moe.cu) ----
 * Per row of logits [tokens, experts] (dtype, experts <= 1024): softmax in float32, the k largest probabilities
 * (descending, ties to the lower expert) -> weights float32 [tokens, k], ids int64 [tokens, k]; normalize 1:
 * weights divided by their sum. */
int trellm_softmax_topk(const void *logits, int dtype, float *weights, int64_t *ids, int64_t tokens, int64_t experts,
                        int64_t k, int normalize, cudaStream_t stream);
/* shared pair modes of trellm_softmax_topk_shared */
enum { TRELLM_SHARED_PAIR_NONE = 0, TRELLM_SHARED_PAIR_ONE = 1, TRELLM_SHARED_PAIR_SIGMOID = 2 };
/* As trellm_softmax_topk with the routed weights times scaling, plus (shared ONE / SIGMOID) one more pair per row
 * after the k routed ones: weights/ids [tokens, k + 1], id `experts` (the shared expert's slot), weight 1 (ONE)
 * or sigmoid of the row's last logit (SIGMOID: logits [tokens, experts + 1], the shared gate's logit last). */
int trellm_softmax_topk_shared(const void *logits, int dtype, float *weights, int64_t *ids, int64_t tokens,
                               int64_t experts, int64_t k, int normalize, float scaling, int shared,
                               cudaStream_t stream);
/* ---- end MoE router ---- */
/* ---- tiled paged-attention prefill (attention_prefill.cu) ----
 * Same arguments and result as trellm_paged_attention (no key splits, no workspace), for prefill chunks:
 * one block per 64 (token, head) rows of one sequence and kv head walks that sequence's keys in tiles
 * through shared memory, both matmuls on tensor cores. fp16/bf16 only; head_dim 64, 96, 128, 160, 192
 * or 256; hq / hkv <= 64; q, pages and out 16-byte aligned. */
int trellm_paged_attention_prefill(const void *q, const void *k_pages, const void *v_pages, const int32_t *block_table,
                                   const int32_t *cu_seqlens, const int32_t *context_lens, const float *sinks,
                                   void *out, int64_t tokens, int64_t batch, int64_t hq, int64_t hkv, int64_t head_dim,
                                   int64_t page_size, int64_t max_blocks, float scale, int sliding_window,
                                   float softcap, int dtype, cudaStream_t stream);
/* ---- end tiled prefill ---- */
/* ---- LoRA ---- */
/* The largest adapter rank trellm_lora_add takes; the k-slice of one shrink block of trellm_lora_add_split. */
enum { TRELLM_LORA_MAX_RANK = 256, TRELLM_LORA_MAX_PARTS = 4, TRELLM_LORA_SPLIT_K = 512 };

/* Per-row LoRA update, one launch: out[i, :] = y[i, :] + b[:, s*rank:(s+1)*rank] @ (a[s*rank:(s+1)*rank, :] @ x[i, :])
 * with s = slots[i]; rows whose s is negative (or >= num_slots) get y[i, :] as it is. out may be y (in place).
 * x [rows, k] (row stride ldx), y and out [rows, n] (row strides ldy, ldo), a [num_slots*rank, k],
 * b [n, num_slots*rank]: one dtype; slots int64 [rows]. Float32 accumulation; out rounded once. */
int trellm_lora_add(const void *x, int64_t ldx, const void *y, int64_t ldy, void *out, int64_t ldo, const void *a,
                    const void *b, const int64_t *slots, int64_t rows, int64_t k, int64_t n, int64_t num_slots,
                    int64_t rank, int dtype, cudaStream_t stream);

/* trellm_lora_add in place for 1..TRELLM_LORA_MAX_PARTS projections of one x (q/k/v, gate/up) in ONE launch:
 * y[p] [rows, n[p]] (row stride ldy[p]) += b[p] @ (a[p] @ x) per row's slot; every part has the same k, slots,
 * num_slots and rank. */
int trellm_lora_add_parts(const void *x, int64_t ldx, int count, void *const *y, const int64_t *ldy,
                          const void *const *a, const void *const *b, const int64_t *n, const int64_t *slots,
                          int64_t rows, int64_t k, int64_t num_slots, int64_t rank, int dtype, cudaStream_t stream);

/* The same updates in two programmatic dependent launches: the shrink split over k (blocks of TRELLM_LORA_SPLIT_K
 * elements) writing float partials of h to workspace [rows, count, ceil(k / TRELLM_LORA_SPLIT_K), rank], then
 * the expand summing them: out[p] [rows, n[p]] (row stride ldo[p]; may be y[p]) = y[p] + b[p] @ (a[p] @ x). */
int trellm_lora_add_split(const void *x, int64_t ldx, int count, const void *const *y, const int64_t *ldy,
                          void *const *out, const int64_t *ldo, const void *const *a, const void *const *b,
                          const int64_t *n, const int64_t *slots, float *workspace, int64_t rows, int64_t k,
                          int64_t num_slots, int64_t rank, int dtype, cudaStream_t stream);
/* ---- hyper-connections (hyper.cu) ----
 * A block's hyper-connection weights from the streams x [tokens, streams, dim] (dtype, dim % 4 == 0, 16-byte
 * aligned): mixes = fn [(2 + streams) * streams, streams * dim] . rmsnorm(flat x) (norm_eps; raw float32
 * [tokens, (2 + streams) * streams] holds them), then with bias [(2 + streams) * streams] and scale [3] (float32):
 * pre = sigmoid(.) + eps, post = 2 sigmoid(.) float32 [tokens, streams], comb float32 [tokens, streams, streams] a
 * row softmax + eps normalised by columns, then sinkhorn_iters - 1 times by rows and columns (x / (sum + eps));
 * block_input [tokens, dim] (dtype) = sum_j pre[j] x[:, j]. tokens <= 65535. */
enum { TRELLM_HC_MAX_STREAMS = 8 };
int trellm_hyper_connection_weights(const void *x, int dtype, const float *fn, const float *bias, const float *scale,
                                    float *raw, float *post, float *comb, void *block_input, int64_t tokens,
                                    int64_t streams, int64_t dim, int64_t sinkhorn_iters, float eps, float norm_eps,
                                    cudaStream_t stream);
/* The streams after a block: y [tokens, streams, dim] = post[:, i] * out + sum_j comb[:, j, i] x[:, j], x and y
 * [tokens, streams, dim], out [tokens, dim] (dtype), products and sums rounded to dtype as in torch. */
int trellm_hyper_connection_merge(const void *x, const void *out, const float *post, const float *comb, void *y,
                                  int dtype, int64_t tokens, int64_t streams, int64_t dim, cudaStream_t stream);
/* ---- end hyper-connections ---- */
/* ---- the DSA lightning indexer (indexer.cu) ----
 * Scores of a few tokens against every key slot of their sequence's block-table row: logits float32 [tokens, width],
 * width = table_width * page_size, logits[t, s] = sum_h weights[t, h] * relu(scale * q[t, h] . key(s)) where
 * s < min(key_counts[b], (positions[t] + 1) / rate) for token t's sequence b (cu_seqlens[b] <= t < cu_seqlens[b + 1]),
 * else -inf. q [tokens, heads, dim] (dtype f16 / bf16), keys of q's dtype or f32 (key_dtype), dim a multiple of 32
 * up to TRELLM_INDEX_MAX_DIM, heads up to TRELLM_INDEX_MAX_HEADS; weights float32 [tokens, heads]; key slot r of page
 * p at keys + p * page_stride + r * row_stride elements (strides multiples of 8, q and keys 16-byte aligned);
 * block_table int32 [batch, table_width], cu_seqlens int32 [batch + 1], key_counts int32 [batch], positions int64
 * [tokens]. Only the visible keys are read. tokens <= 65535. */
enum { TRELLM_INDEX_MAX_HEADS = 64, TRELLM_INDEX_MAX_DIM = 128 };
int trellm_sparse_index_logits(const void *q, int dtype, const float *weights, const void *keys, int key_dtype,
                               const int32_t *block_table, const int32_t *cu_seqlens, const int32_t *key_counts,
                               const int64_t *positions, float *logits, int64_t tokens, int64_t heads, int64_t dim,
                               int64_t batch, int64_t page_size, int64_t page_stride, int64_t row_stride,
                               int64_t table_width, float scale, int64_t rate, cudaStream_t stream);
/* ---- end the DSA lightning indexer ---- */
/* ABI END */

#ifdef __cplusplus
}
#endif

#endif /* TRELLM_KERNELS_H */
