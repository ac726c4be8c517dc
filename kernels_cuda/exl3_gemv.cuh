// EXL3 small-batch matmul (m <= 16) and tile decoding, templated on K (bits) and codebook.
//
// The GEMV computes partial[s, m, n] = sum over the k-slice s of xh[m, k] * W_hat[k, n].
// A lane holding trellis positions 8t..8t+7 of a tile holds exactly the m16n8k16 A fragment of the
// TRANSPOSED tile (rows = output columns, cols = k), so one mma.m16n8k16 per tile multiplies
// W_hat^T (16 n x 16 k) by xh^T (16 k x 8 rows of x): batch 1..8 wastes nothing, and each further
// group of 8 rows of x reuses the decoded fragment for one more mma.
//
// Work split: a block of WARPS warps owns a k-slice of WARPS*KT tiles and a run of column tiles;
// each warp owns KT tiles of that slice (its x fragments stay in registers) and walks the column
// tiles; the trellis words of its next few columns are in flight into shared memory (cp.async ring,
// GemvPipe) while it decodes the current one. The warps add their 16x8 results into a shared-memory
// accumulator; the block writes it once per slice. One launch may hold several matmuls of the same x
// (MatmulParts: q/k/v, gate/up).
#pragma once

#include "common.cuh"

#include <stdlib.h>

namespace trellm {

constexpr int GEMV_WARPS = 8;
// Tuning knobs (build with TRELLM_NVCC_FLAGS="-D..." to try others): trellis bytes in flight per warp,
// and the blocks per SM the register budget is sized for.
#ifndef TRELLM_GEMV_RING_KB
#define TRELLM_GEMV_RING_KB 3
#endif
#ifndef TRELLM_GEMV_MIN_BLOCKS
#define TRELLM_GEMV_MIN_BLOCKS 3
#endif
// k tiles per warp (KT): 8 (default) or 4 (TRELLM_EXL3_KT=4); always 4 for more than 8 rows (gemv_kt).
// A block's k-slice is GEMV_WARPS * KT tiles.

struct MatmulArgs {
    const void *x;          // [m, k], x_dtype
    const void *x_up;       // null, or [m, k] x_dtype: the input is act(x) * x_up (a gated MLP's down projection)
    int act;                // TRELLM_ACT_* when x_up is set
    const half *suh;        // [k]
    const uint32_t *trellis;
    const half *svh;        // [n]
    const half *bias;       // [n] or null
    void *y;                // [m, n], y_dtype
    float *partial;         // [slices, m, n]
    int *counters;          // [n / 128], zero between calls (the last block of a group resets it)
    int x_dtype, y_dtype, m, k, n, cols_per_block;
};

// The q/k/v launch's finishing work for attention (parts 0, 1, 2 = q, k, v; 128-wide heads, so one
// 128-column group is one head of one row): q and k optionally RMS-normed per head, rotated (RoPE) at
// positions[row], and k and v also stored at slots[row] of the KV pages, as rotary_qk_write_kv does after
// a separate GEMV (one launch fewer per layer, and q/k do not go through memory in between).
struct HeadEpilogue {
    int enabled;
    const int64_t *positions;      // [m], clamped into the table
    const float *cos, *sin;        // [table_len, rot_half]
    int64_t table_len;
    int rot_half, interleaved;     // rotated dims 2 * rot_half <= 128, rot_half % 4 == 0
    const void *q_norm, *k_norm;   // [128] of y_dtype, both or neither
    float eps;
    int unit_offset;
    void *k_pages, *v_pages;       // [pages, page_size, hkv, 128] of y_dtype, or null
    const int64_t *slots;          // [m]; negative: not stored
    int hkv;
};

// The residual stream of a pre-norm block through the GEMVs, so that no RMSNorm launch sits between them:
// the GEMV that ends a sub-layer (o_proj, down) adds the residual in its finishing warp and sums the squares
// of each 128-column group of its output, and the GEMV that starts the next sub-layer (q/k/v, gate/up) reads
// those sums in its input transform (one float per lane, beside the x it loads anyway) and RMS-norms x.
// The code of both ends shifts the column loop's register allocation (4 bpw, 1 row: 367 -> 372 instructions
// per column) and costs the step 0.6% where unused; the route gains 1.0-1.4% (NOTES 2026-12-04a). Built with
// -DTRELLM_GEMV_NO_RESIDUAL_STREAM (TRELLM_NVCC_FLAGS) the kernel has neither end: the A/B baseline.
struct ResidualStream {
    const void *residual;     // [m, n] of y_dtype, or null: y = round(round(x W + bias) + residual)
    float *ssq_out;           // with residual: [m, n / 128], y's sum of squares per row and 128-column group
    const float *ssq_in;      // [m, k / 128], or null: the input is rms_norm(x), x's squares summed from these
    const void *norm_weight;  // with ssq_in: [k] of x_dtype, or null (no scale)
    float norm_eps;
    int norm_unit_offset;     // scale by 1 + weight (Gemma)
};

// The residual stream's two ends for one lane's 4 consecutive values, shared by the GEMV and the mid-size
// matmul. Input: v (x at row, col..col + 3) becomes rms_norm(x), x's squares summed from the producer's ssq
// (k / 128 floats per row), rounded as the rms_norm kernel rounds it.
__device__ __forceinline__ void stream_norm_input(const ResidualStream &st, int x_dtype, int k, int row, int col,
                                                  int lane, float (&v)[4]) {
    const int groups = k / 128;
    float ssq = 0.f, w[4] = {1.f, 1.f, 1.f, 1.f};
    for (int g = lane; g < groups; g += 32) ssq += __ldcg(st.ssq_in + (size_t)row * groups + g);
    if (st.norm_weight) load4_as_f32(st.norm_weight, x_dtype, col, w);
    const float rstd = rsqrtf(warp_sum(ssq) / (float)k + st.norm_eps);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float scale = st.norm_weight ? (st.norm_unit_offset ? 1.f + w[i] : w[i]) : 1.f;
        v[i] = round_as(v[i] * rstd * scale, x_dtype);
    }
}

// Output: y = x W + residual at row, col..col + 3 of a 128-column group (the warp holds the group), each
// rounded as its own op would round it, stored, and the group's sum of squares of y stored by lane 0.
__device__ __forceinline__ void stream_add_output(const ResidualStream &st, void *y, int y_dtype, const half *svh,
                                                  const half *bias, int n, int row, int col, int lane,
                                                  const float (&v)[4], const float (&res)[4]) {
    float ssq = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float o = v[i] * __half2float(svh[col + i]);
        if (bias) o += __half2float(bias[col + i]);
        o = round_as(round_as(o, y_dtype) + res[i], y_dtype);
        ssq += o * o;
        store_from_f32(y, y_dtype, (size_t)row * n + col + i, o);
    }
    ssq = warp_sum(ssq);
    if (lane == 0) st.ssq_out[(size_t)row * (n / 128) + col / 128] = ssq;
}

// Up to GEMV_MAX_PARTS matmuls of the same x (q/k/v, gate/up) in one launch: blocks
// [block_begin[p], block_begin[p+1]) work on part p. Each part has its own suh, so each block
// transforms x with its own part's suh (it does that per block anyway).
constexpr int GEMV_MAX_PARTS = 4;
struct MatmulParts {
    MatmulArgs part[GEMV_MAX_PARTS];
    int block_begin[GEMV_MAX_PARTS + 1];
    int count;
    // 0: each warp keeps its result for every column of the run, summed once after the loop. R > 0: each
    // warp keeps R columns, and the block sums them into one [m][columns] buffer every R columns (a
    // barrier per round): shared memory per column drops from 8 warps' to one result, so more rows fit
    // one wave (the same fixed sum order: bit-stable).
    int reduce_period;
    HeadEpilogue head;    // head.enabled: the attention epilogue above (3 parts)
    ResidualStream stream;  // the residual add (one part, no head epilogue) and the input norm above
    int early_stages;     // ring columns requested before pdl_wait (TRELLM_GEMV_EARLY_STAGES, default 0)
    int serial_arrivals;  // 1: thread 0 arrives at the block's groups one after another (TRELLM_GEMV_SERIAL_ARRIVALS=1, the A/B baseline)
};

// Trellis words in flight per warp: STAGES columns of KT tiles each, in shared memory (cp.async),
// about TRELLM_GEMV_RING_KB per warp whatever K is (at least 2 stages). 3 KB measured fastest of
// 3/6/9/12 on the H200: the kernel is bound by its decode work, and deeper rings cost occupancy.
template <int K, int KT> struct GemvPipe {
    static constexpr int TILE_WORDS = TileGeom<K>::WORDS;
    static constexpr int STAGE_WORDS = KT * TILE_WORDS;
    static constexpr int CHUNKS = STAGE_WORDS / 4;                 // 16-byte copies per stage
    static constexpr int CHUNKS_PER_LANE = (CHUNKS + 31) / 32;
    static constexpr int S = TRELLM_GEMV_RING_KB * 1024 / (STAGE_WORDS * 4);
    static constexpr int STAGES = S < 2 ? 2 : (S > 16 ? 16 : S);
    static constexpr size_t RING_BYTES = (size_t)GEMV_WARPS * STAGES * STAGE_WORDS * 4;
};

// Blocks per SM the register budget is sized for: two row groups with KT=8 hold 64 registers of x
// fragments, so they get two blocks' budget.
template <int MT, int KT> constexpr int gemv_min_blocks = (MT == 2 && KT == 8) ? 2 : TRELLM_GEMV_MIN_BLOCKS;

// Phase trace for benchmarks/gemv_phases.cu, compiled in only with -DTRELLM_GEMV_TRACE: thread 0 of each
// block records the SM clock at each phase boundary, and the global timer, SM id and whether the block
// finished a group; lane 0 of each warp records three points of the first phases. The harness prints
// where a launch's time goes. Without the macro the marks are empty statements.
#ifdef TRELLM_GEMV_TRACE
constexpr int GEMV_TRACE_MARKS = 8, GEMV_TRACE_BLOCKS = 8192, GEMV_TRACE_WARP_MARKS = 3;
enum { GEMV_TRACE_START_NS = GEMV_TRACE_MARKS, GEMV_TRACE_END_NS, GEMV_TRACE_SM, GEMV_TRACE_FIELDS };
__device__ long long gemv_trace[GEMV_TRACE_BLOCKS][GEMV_TRACE_FIELDS];
// Per warp: its prefetch issued, pdl_wait passed, its x transform done (before the barrier).
__device__ long long gemv_trace_warps[GEMV_TRACE_BLOCKS][GEMV_WARPS][GEMV_TRACE_WARP_MARKS];
__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ int trace_block() { return blockIdx.y * gridDim.x + blockIdx.x; }
#define GEMV_MARK(i)                                                                                    \
    do {                                                                                                \
        if (threadIdx.x == 0 && trace_block() < GEMV_TRACE_BLOCKS) gemv_trace[trace_block()][i] = clock64(); \
    } while (0)
#define GEMV_WARP_MARK(i)                                                                               \
    do {                                                                                                \
        if ((threadIdx.x & 31) == 0 && trace_block() < GEMV_TRACE_BLOCKS)                               \
            gemv_trace_warps[trace_block()][threadIdx.x >> 5][i] = clock64();                           \
    } while (0)
#else
#define GEMV_MARK(i) \
    do {             \
    } while (0)
#define GEMV_WARP_MARK(i) \
    do {                  \
    } while (0)
#endif

// The attention epilogue for one (head, row) of part `part` (0, 1, 2 = q, k, v; output out.y [rows, out.n] of
// dtype dt): the lane's 4 columns of H128(sum) in v (col = the first). The steps and roundings are rotary_qk_kernel's
// on the matmul's rounded output; the per-head sum of squares adds in another order (the lane holds 4
// consecutive dims, not every 32nd). The GEMV's finishing warp and the mid-size matmul's finish both end here.
template <class Out>  // MatmulArgs or MidPart: svh, bias, y, n
__device__ __forceinline__ void finish_head(const HeadEpilogue &h, const Out &out, int dt, int part, float (&v)[4],
                                            int row, int col, int lane) {
    float o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float y = v[i] * __half2float(out.svh[col + i]);
        if (out.bias) y += __half2float(out.bias[col + i]);
        o[i] = round_as(y, dt);  // as the separate GEMV stores it
    }
    if (part < 2) {
        const void *w = part == 0 ? h.q_norm : h.k_norm;
        if (w) {
            const float rstd = rsqrtf(warp_sum(o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3]) / 128.f + h.eps);
            float wv[4];
            load4_as_f32(w, dt, lane * 4, wv);
#pragma unroll
            for (int i = 0; i < 4; ++i) o[i] = round_as(o[i] * rstd * (h.unit_offset ? 1.f + wv[i] : wv[i]), dt);
        }
        int64_t pos = h.positions[row];
        pos = pos < 0 ? 0 : pos >= h.table_len ? h.table_len - 1 : pos;
        const float *c = h.cos + pos * h.rot_half, *s = h.sin + pos * h.rot_half;
        const int half = h.rot_half, d0 = lane * 4;
        float r[4];
        if (h.interleaved) {  // pairs (2j, 2j + 1) within the lane
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const int j = (d0 + i) >> 1;
                const bool rot = d0 + i < 2 * half;
                r[i] = rot ? o[i] * c[j] - o[i + 1] * s[j] : o[i];
                r[i + 1] = rot ? o[i + 1] * c[j] + o[i] * s[j] : o[i + 1];
            }
        } else {  // NeoX: d pairs with d + half, held by lane + half / 4
            const int partner = d0 < half ? lane + half / 4 : d0 < 2 * half ? lane - half / 4 : lane;
            float p[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) p[i] = __shfl_sync(0xffffffffu, o[i], partner);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int d = d0 + i;
                r[i] = d < half ? o[i] * c[d] - p[i] * s[d] : d < 2 * half ? o[i] * c[d - half] + p[i] * s[d - half] : o[i];
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = r[i];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) store_from_f32(out.y, dt, (size_t)row * out.n + col + i, o[i]);
    if (part > 0 && h.k_pages) {
        const int64_t slot = h.slots[row];
        if (slot >= 0) {
            void *pages = part == 1 ? h.k_pages : h.v_pages;
            const int64_t at = (slot * h.hkv + col / 128) * 128 + lane * 4;
#pragma unroll
            for (int i = 0; i < 4; ++i) store_from_f32(pages, dt, (size_t)(at + i), o[i]);
        }
    }
}

// One launch: x transform, trellis matmul of the block's (k-slice, column run), partial store, and the
// last block to arrive at a 128-column group sums the slices and applies H128 * svh (+ bias).
template <int K, int CB, int MT, int KT>
__global__ void __launch_bounds__(GEMV_WARPS * 32, (gemv_min_blocks<MT, KT>)) exl3_matmul_small_kernel(const __grid_constant__ MatmulParts parts) {
    int part = 0;
    while (part + 1 < parts.count && (int)blockIdx.x >= parts.block_begin[part + 1]) ++part;
    const MatmulArgs &args = parts.part[part];
    const int block_x = (int)blockIdx.x - parts.block_begin[part];
    pdl_trigger();
#ifdef TRELLM_GEMV_TRACE
    if (threadIdx.x == 0 && trace_block() < GEMV_TRACE_BLOCKS) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        gemv_trace[trace_block()][GEMV_TRACE_START_NS] = global_ns();
        gemv_trace[trace_block()][GEMV_TRACE_SM] = sm;
    }
#endif
    GEMV_MARK(0);
    using G = TileGeom<K>;
    using P = GemvPipe<K, KT>;
    constexpr int SLICE_K = GEMV_WARPS * KT * 16;   // k elements per block slice
    const int acc_stride = args.m | 1;          // odd row stride of a warp's accumulator: valid rows only
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int m = args.m, k = args.k, n = args.n, cols_per_block = args.cols_per_block;
    uint32_t *ring_all = reinterpret_cast<uint32_t *>(smem_raw);                      // [warps][STAGES][STAGE_WORDS]
    half *xs = reinterpret_cast<half *>(smem_raw + P::RING_BYTES);                    // [m][SLICE_K]
    // The column accumulators [warps][cols][16][acc_stride] reuse xs's bytes: xs is dead once every warp
    // holds its x fragments (8 rows: 16 KB more for columns, which lets one wave run 3 blocks per SM).
    float *acc_all = reinterpret_cast<float *>(smem_raw + P::RING_BYTES);
    __shared__ int last_groups[16];
    // CB_MUL1_SPLIT: the sum of this slice's x (as the mma reads it) per row, by 128-chunk, then whole.
    __shared__ float x_chunk_sums[CB == CB_MUL1_SPLIT ? 16 : 1][CB == CB_MUL1_SPLIT ? KT : 1];
    __shared__ float x_sums[CB == CB_MUL1_SPLIT ? 16 : 1];

    const int lane = threadIdx.x & 31, warp = warp_index();
    const int tiles_k = k / 16, tiles_n = n / 16;
    const int slice = blockIdx.y, slices = gridDim.y;
    const int j_begin = block_x * cols_per_block;
    const int j_end = min(j_begin + cols_per_block, tiles_n);
    const int ncols = j_end - j_begin;
    const int k0 = slice * SLICE_K;
    const int slice_chunks = min(SLICE_K, k - k0) / 128;

    // Trellis words of the first STAGES-1 columns go in flight before the x transform.
    const int i_begin = slice * GEMV_WARPS * KT + warp * KT;
    const size_t row_stride = (size_t)tiles_n * P::TILE_WORDS;  // words between tile (i, j) and (i+1, j)
    uint32_t *ring = ring_all + (size_t)warp * P::STAGES * P::STAGE_WORDS;
    // Each lane copies chunks lane, lane + 32, ... of a stage; src walks one column per issue.
    const uint32_t *src[P::CHUNKS_PER_LANE];
#pragma unroll
    for (int q = 0; q < P::CHUNKS_PER_LANE; ++q) {
        const int c = min(lane + 32 * q, P::CHUNKS - 1);
        const int t = c / (P::TILE_WORDS / 4), part = c % (P::TILE_WORDS / 4);
        // Past the end of k, re-read the last tile row: its x fragments are zero.
        const int i = min(i_begin + t, tiles_k - 1);
        src[q] = args.trellis + (size_t)i * row_stride + (size_t)j_begin * P::TILE_WORDS + part * 4;
    }
    // The column loop is issue-bound (NOTES): its per-column bookkeeping works on byte offsets into the
    // warp's ring and on pointers hoisted out of it, so nothing is recomputed from the lane id per column.
    constexpr uint32_t STAGE_BYTES = P::STAGE_WORDS * 4, RING_WARP_BYTES = P::STAGES * STAGE_BYTES;
    const uint32_t ring_dst = opaque((uint32_t)__cvta_generic_to_shared(ring) + lane * 16);  // chunk `lane` of stage 0
    auto issue_next = [&](uint32_t stage_off) {  // the next column in order into the stage at byte stage_off
#pragma unroll
        for (int q = 0; q < P::CHUNKS_PER_LANE; ++q) {
            const int c = lane + 32 * q;
            if (P::CHUNKS % 32 == 0 || c < P::CHUNKS) cp_async_16_to(ring_dst + stage_off + q * 512, src[q]);
            src[q] += P::TILE_WORDS;
        }
    };
    // Phase 0 below: xs = fp16(H128(x * suh)) for this slice. A warp's jobs are chunk `warp % slice_chunks`
    // of each row (all of them when the slice is whole), so its suh is loaded once, ahead of the weights
    // (behind them it waited for them: one launch alone, 4096->14336, 26.8 -> 25.7 us).
    float su[4] = {0.f, 0.f, 0.f, 0.f};
    if (warp < m * slice_chunks) load4_as_f32(args.suh, TRELLM_F16, k0 + (warp % slice_chunks) * 128 + lane * 4, su);
    // The ring's first STAGES-1 columns, one commit group each (the column loop's wait counts them): the
    // first parts.early_stages requested before pdl_wait (while the kernel before may still run), the
    // rest after the x transform.
    const int early = parts.early_stages;
    auto issue_ring = [&](bool before_wait) {
#pragma unroll
        for (int s = 0; s < P::STAGES - 1; ++s) {
            if ((s < early) == before_wait) {
                if (s < ncols) issue_next(s * STAGE_BYTES);
                cp_async_commit();
            }
        }
    };
    issue_ring(true);
    GEMV_WARP_MARK(0);
    // Only weights were read so far: from here on x, the workspace and y, which the kernel before
    // may still be using (programmatic dependent launch).
    pdl_wait();
    GEMV_MARK(1);
    GEMV_WARP_MARK(1);

    for (int job = warp; job < m * slice_chunks; job += GEMV_WARPS) {
        const int row = job / slice_chunks, chunk = job % slice_chunks;
        const int col = k0 + chunk * 128 + lane * 4;
        float v[4];
        load4_as_f32(args.x, args.x_dtype, (size_t)row * k + col, v);
#ifndef TRELLM_GEMV_NO_RESIDUAL_STREAM
        if (parts.stream.ssq_in) stream_norm_input(parts.stream, args.x_dtype, k, row, col, lane, v);
#endif
        if (args.x_up) {  // rounded as the separate gated_activation kernel rounds: the same x, bit for bit
            float u[4];
            load4_as_f32(args.x_up, args.x_dtype, (size_t)row * k + col, u);
#pragma unroll
            for (int i = 0; i < 4; ++i)
                v[i] = round_as(round_as(apply_act(v[i], args.act), args.x_dtype) * u[i], args.x_dtype);
        }
        const bool own_chunk = chunk == warp % slice_chunks;
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= own_chunk ? su[i] : __half2float(args.suh[col + i]);
        warp_hadamard_128(v);
        half2 *dst = reinterpret_cast<half2 *>(xs + (size_t)row * SLICE_K + chunk * 128 + lane * 4);
        dst[0] = __floats2half2_rn(v[0], v[1]);
        dst[1] = __floats2half2_rn(v[2], v[3]);
        if constexpr (CB == CB_MUL1_SPLIT) {
            const float2 lo = __half22float2(dst[0]), hi = __half22float2(dst[1]);
            const float chunk_sum = warp_sum((lo.x + lo.y) + (hi.x + hi.y));
            if (lane == 0) x_chunk_sums[row][chunk] = chunk_sum;
        }
    }
    issue_ring(false);
    GEMV_WARP_MARK(2);
    __syncthreads();
    GEMV_MARK(2);

    // x fragments (B operand: k x batch rows), one pair of registers per (k tile, group of 8 rows).
    // SPLIT (codebooks with split halves): xf holds x at the even k of the lane's
    // pairs, duplicated into both halves, and xo the odd k (see tile_fragments_split).
    constexpr bool SPLIT = CB != TRELLM_CB_MUL1;
    uint32_t xf[KT][MT][2];
    uint32_t xo[SPLIT ? KT : 1][SPLIT ? MT : 1][2];
#pragma unroll
    for (int t = 0; t < KT; ++t) {
        const int i = i_begin + t;
#pragma unroll
        for (int g = 0; g < MT; ++g) {
            const int row = g * 8 + (lane >> 2);
            const int col = (warp * KT + t) * 16 + (lane & 3) * 2;
            uint32_t b0 = 0, b1 = 0;
            if (i < tiles_k && row < m) {
                const uint32_t *p = reinterpret_cast<const uint32_t *>(xs + (size_t)row * SLICE_K + col);
                b0 = p[0];
                b1 = p[4];
            }
            if constexpr (SPLIT) {
                split_b_operand(b0, xf[t][g][0], xo[t][g][0]);
                split_b_operand(b1, xf[t][g][1], xo[t][g][1]);
            } else {
                xf[t][g][0] = b0;
                xf[t][g][1] = b1;
            }
        }
    }
    if constexpr (CB == CB_MUL1_SPLIT) {
        if (threadIdx.x < m) {
            float sum = 0.f;
            for (int c = 0; c < slice_chunks; ++c) sum += x_chunk_sums[threadIdx.x][c];
            x_sums[threadIdx.x] = sum;
        }
    }
    __syncthreads();  // every warp holds its x fragments: xs becomes the accumulators
    GEMV_MARK(3);

    // The lane's words of a tile in a stage: (w0 + q) mod TILE_WORDS, q < NW.
    int w0, r;
    lane_window<K>(lane, w0, r);
    const uint32_t *lane_words[G::NW];
#pragma unroll
    for (int q = 0; q < G::NW; ++q) lane_words[q] = ring + (w0 + q) % P::TILE_WORDS;

    // The lane's accumulator slots: (n = lane/4 (+8), rows 2(lane%4)+{0,1}) of the current column, which
    // goes to slot col % slots. `red`: the warps' sums [m][cols_per_block * 16] (reduce_period > 0).
    const int period = parts.reduce_period;
    const int slots = period > 0 ? period : cols_per_block;
    const size_t warp_stride = (size_t)slots * 16 * acc_stride;
    float *acc_lane = acc_all + (size_t)warp * warp_stride + (lane >> 2) * acc_stride + (lane & 3) * 2;
    const int acc_col_stride = opaque(16 * acc_stride);
    float *red = acc_all + GEMV_WARPS * warp_stride;
    const int red_stride = cols_per_block * 16;
    // The sum over the warps of (slot-relative) element e = column * 16 + n, row: a fixed order.
    auto warps_sum = [&](int e, int row) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += acc_all[w * warp_stride + e * acc_stride + row];
        return s;
    };
    const int n8_off = opaque(8 * acc_stride);  // accumulator offset of n + 8
    // Which of the lane's two rows per row group are valid.
    int row_ok[MT][2];
#pragma unroll
    for (int g = 0; g < MT; ++g) {
        row_ok[g][0] = opaque(int(g * 8 + (lane & 3) * 2 < m));
        row_ok[g][1] = opaque(int(g * 8 + (lane & 3) * 2 + 1 < m));
    }

    auto compute = [&](uint32_t stage_off, float *dst) {
        float c[MT][4];
#pragma unroll
        for (int g = 0; g < MT; ++g) c[g][0] = c[g][1] = c[g][2] = c[g][3] = 0.f;
#pragma unroll
        for (int t = 0; t < KT; ++t) {
            uint32_t raw[G::NW];
#pragma unroll
            for (int q = 0; q < G::NW; ++q)
                raw[q] = *reinterpret_cast<const uint32_t *>(reinterpret_cast<const unsigned char *>(lane_words[q]) + stage_off +
                                                             t * P::TILE_WORDS * 4);
            if constexpr (SPLIT) {
                uint32_t even[4], odd[4];
                tile_fragments_split<K, CB>(raw, r, even, odd);
#pragma unroll
                for (int g = 0; g < MT; ++g) {
                    mma_16816(c[g], even, xf[t][g][0], xf[t][g][1]);
                    mma_16816(c[g], odd, xo[t][g][0], xo[t][g][1]);
                }
            } else {
                uint32_t a[4];
                tile_fragment<K, CB>(raw, r, a);
#pragma unroll
                for (int g = 0; g < MT; ++g) mma_16816(c[g], a, xf[t][g][0], xf[t][g][1]);
            }
        }
        // c[g]: (n = lane/4, rows 2(lane%4)+{0,1}) and (n = lane/4 + 8, same rows)
#pragma unroll
        for (int g = 0; g < MT; ++g) {
            if (row_ok[g][0]) {
                dst[g * 8] = c[g][0];
                dst[n8_off + g * 8] = c[g][2];
            }
            if (row_ok[g][1]) {
                dst[g * 8 + 1] = c[g][1];
                dst[n8_off + g * 8 + 1] = c[g][3];
            }
        }
    };

    // Main loop: wait for column col's stage, refill the stage the previous column used, decode column
    // col into accumulator slot `slot` (col, or col % period), and every `period` columns sum the warps.
    uint32_t read_off = 0, write_off = (P::STAGES - 1) * STAGE_BYTES;
    float *dst = acc_lane;
    int slot = 0;
    // The warps are summed after slot sum_slot and after column last_col (never without a period).
    const int sum_slot = opaque(period > 0 ? period - 1 : -1), last_col = opaque(period > 0 ? ncols - 1 : -1);
    for (int col = 0; col < ncols; ++col) {
        cp_async_wait<P::STAGES - 2>();
        __syncwarp();
        if (col + P::STAGES - 1 < ncols) issue_next(write_off);
        cp_async_commit();
        compute(read_off, dst);
        read_off = read_off + STAGE_BYTES == RING_WARP_BYTES ? 0u : read_off + STAGE_BYTES;
        write_off = write_off + STAGE_BYTES == RING_WARP_BYTES ? 0u : write_off + STAGE_BYTES;
        if (slot == sum_slot || col == last_col) {  // the same col in every warp
            __syncthreads();
            const int first = col - slot, round = (slot + 1) * 16;
            for (int idx = threadIdx.x; idx < m * round; idx += blockDim.x) {
                const int row = idx / round, e = idx % round;
                red[row * red_stride + first * 16 + e] = warps_sum(e, row);
            }
            __syncthreads();
        }
        dst += acc_col_stride;
        if (++slot == slots) {
            slot = 0;
            dst -= slots * acc_col_stride;
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    GEMV_MARK(4);

    // Phase 2: the warps' sums, this slice's partial sums (valid rows only), stored coalesced along n.
    const int cols = (j_end - j_begin) * 16;
    for (int idx = threadIdx.x; idx < m * cols; idx += blockDim.x) {
        const int row = idx / cols, c = idx % cols;
        float value = period > 0 ? red[row * red_stride + c] : warps_sum(c, row);
        if constexpr (CB == CB_MUL1_SPLIT) value = mul1_split_partial(value, x_sums[row]);
        args.partial[((size_t)slice * m + row) * n + j_begin * 16 + c] = value;
    }
    __syncthreads();
    GEMV_MARK(5);

    // Phase 3: the last arrival at a 128-column group finishes it. Lane i of warp 0 arrives at the
    // block's i-th group (a run of up to 120 tiles touches at most 16), so the arrivals' round trips
    // overlap instead of following one another; each arriving lane fences for the block (the barrier
    // orders the other threads' partial stores before its fence, as in a grid sync): release before
    // its arrival, acquire after it, for the partials the last block reads.
    const int g_begin = (j_begin * 16) / 128, g_end = (j_end * 16 + 127) / 128, n_groups = g_end - g_begin;
    auto arrive = [&](int g) {
        __threadfence();
        const int old = atomicAdd(args.counters + g, 1);
        // Blocks of any width: every (block, slice) overlapping the group's 8 tiles arrives once.
        const int overlapping = min(8 * g + 7, tiles_n - 1) / cols_per_block - (8 * g) / cols_per_block + 1;
        const bool last = old == slices * overlapping - 1;
        if (last) args.counters[g] = 0;
        last_groups[g - g_begin] = last;
        __threadfence();
    };
    if (parts.serial_arrivals) {
        if (threadIdx.x == 0)
            for (int g = g_begin; g < g_end; ++g) arrive(g);
    } else if (warp == 0 && lane < n_groups) {
        arrive(g_begin + lane);
    }
    __syncthreads();
    GEMV_MARK(6);
    // The finishing work, (group, row) pairs spread over the warps: one row finishes several groups at once.
    for (int job = warp; job < n_groups * m; job += GEMV_WARPS) {
        const int gi = job / m, row = job % m;
        if (!last_groups[gi]) continue;
        const int col = (g_begin + gi) * 128 + lane * 4;
#ifndef TRELLM_GEMV_NO_RESIDUAL_STREAM
        const ResidualStream &st = parts.stream;
        float res[4];
        if (st.residual) load4_as_f32(st.residual, args.y_dtype, (size_t)row * n + col, res);  // beside the partials
#endif
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < slices; ++s) {
            const float4 p = __ldcg(reinterpret_cast<const float4 *>(args.partial + ((size_t)s * m + row) * n + col));
            v[0] += p.x; v[1] += p.y; v[2] += p.z; v[3] += p.w;
        }
        warp_hadamard_128(v);
        if (parts.head.enabled) {
            // The part again, from a fresh block index: kept from the top, it held a register through the loop.
            int head_part = 0;
            const int bx = opaque((int)blockIdx.x);
            while (head_part + 1 < parts.count && bx >= parts.block_begin[head_part + 1]) ++head_part;
            finish_head(parts.head, parts.part[head_part], parts.part[head_part].y_dtype, head_part, v, row, col, lane);
            continue;
        }
#ifndef TRELLM_GEMV_NO_RESIDUAL_STREAM
        if (st.residual) {
            stream_add_output(st, args.y, args.y_dtype, args.svh, args.bias, n, row, col, lane, v, res);
            continue;
        }
#endif
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float o = v[i] * __half2float(args.svh[col + i]);
            if (args.bias) o += __half2float(args.bias[col + i]);
            store_from_f32(args.y, args.y_dtype, (size_t)row * n + col + i, o);
        }
    }
#ifdef TRELLM_GEMV_TRACE
    __syncthreads();
    GEMV_MARK(7);
    if (threadIdx.x == 0 && trace_block() < GEMV_TRACE_BLOCKS) {
        bool finished = false;
        for (int gi = 0; gi < n_groups; ++gi) finished |= last_groups[gi] != 0;
        gemv_trace[trace_block()][GEMV_TRACE_SM] |= (long long)finished << 32;
        gemv_trace[trace_block()][GEMV_TRACE_END_NS] = global_ns();
    }
#endif
}

// One warp per tile: decode into shared memory, then 16-byte stores (two lanes per tile row).
template <int K, int CB>
__global__ void exl3_decode_tiles_kernel(const uint32_t *__restrict__ trellis, half *__restrict__ w, int k, int n) {
    __shared__ __align__(16) half stage[8][16][16 + 8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles_n = n / 16;
    const int64_t tile = (int64_t)blockIdx.x * (blockDim.x / 32) + warp;
    if (tile >= (int64_t)(k / 16) * tiles_n) return;
    const int i = (int)(tile / tiles_n), j = (int)(tile % tiles_n);
    int w0, r;
    lane_window<K>(lane, w0, r);
    uint32_t raw[TileGeom<K>::NW];
    load_lane_words<K>(trellis + tile * TileGeom<K>::WORDS, w0, raw);
    uint32_t st[8];
    lane_states<K>(raw, r, st);
    const int r0 = (lane % 4) * 2, c0 = lane / 4;
    const int row_off[8] = {0, 1, 8, 9, 0, 1, 8, 9};
    const int col_off[8] = {0, 0, 0, 0, 8, 8, 8, 8};
#pragma unroll
    for (int e = 0; e < 8; ++e) stage[warp][r0 + row_off[e]][c0 + col_off[e]] = decode_one<CB>(st[e]);
    __syncwarp();
    const int row = lane >> 1, half_col = (lane & 1) * 8;
    const uint4 v = *reinterpret_cast<const uint4 *>(&stage[warp][row][half_col]);
    *reinterpret_cast<uint4 *>(w + (size_t)(i * 16 + row) * n + j * 16 + half_col) = v;
}

template <int CB>
__global__ void exl3_codebook_decode_kernel(const int32_t *__restrict__ states, half *__restrict__ out, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = decode_one<CB>((uint32_t)states[i]);
}

// Host launchers, one translation unit per codebook (exl3_cb{0,1,2}.cu).
template <int CB>
int launch_exl3_matmul_small(MatmulParts args, int K, int num_sms, cudaStream_t stream);
template <int CB>
int launch_exl3_decode_tiles(const uint32_t *trellis, half *w, int k, int n, int K, cudaStream_t stream);

// k tiles per warp: 8 up to 8 rows (4 measured slower). Two row groups (m > 8)
// hold twice the x fragments: KT=8 then runs two blocks per SM (gemv_min_blocks), which pays where the
// matmul is large (half the k-slices, so half the partial sums written and re-read: at 16 rows, K=4,
// 4096->14336 49.4 -> 44.3 us, 14336->4096 55.0 -> 50.3, lm_head 346 -> 289) and loses where it is
// small (4096^2 17.8 -> 22.0: fewer resident warps, twice the x transform per block). So KT=8 when (n/16 column tiles) x (its k-slices)
// is at least 2048 units (about 8 columns per block on an H200), else 4. n is the launch's total over its
// parts: the workspace size and the launcher must agree.
inline int gemv_kt(int m, int k, int n) {
    if (m <= 8) return 8;
    const int slices_at_8 = (k / 16 + GEMV_WARPS * 8 - 1) / (GEMV_WARPS * 8);
    return (int64_t)(n / 16) * slices_at_8 >= 2048 ? 8 : 4;
}

inline int gemv_slices(int k, int m, int n) {
    const int slice = GEMV_WARPS * gemv_kt(m, k, n);
    return (k / 16 + slice - 1) / slice;
}

// The total output width of a launch's parts.
inline int parts_n(const MatmulParts &parts) {
    int n = 0;
    for (int p = 0; p < parts.count; ++p) n += parts.part[p].n;
    return n;
}

template <int K, int CB, int MT, int KT>
int launch_matmul_mt(MatmulParts parts, int num_sms, cudaStream_t stream) {
    const MatmulArgs &first = parts.part[0];
    const int tiles_n = parts_n(parts) / 16;  // all parts together
    const int slices = gemv_slices(first.k, first.m, parts_n(parts));
    const size_t acc_per_col = (size_t)GEMV_WARPS * 16 * (first.m | 1) * sizeof(float);
    const size_t ring_bytes = GemvPipe<K, KT>::RING_BYTES;
    const size_t xs_bytes = (size_t)first.m * GEMV_WARPS * KT * 16 * sizeof(half);  // the accumulators reuse it
    const size_t red_per_col = (size_t)16 * first.m * sizeof(float);
    // Shared memory per block, for reduce period R (0: the warps' results of every column kept to the end).
    auto smem_for = [&](int cols, int period) {
        const size_t acc = period > 0 ? (size_t)period * acc_per_col + (size_t)cols * red_per_col : (size_t)cols * acc_per_col;
        return ring_bytes + max(xs_bytes, acc);
    };
    auto kernel = exl3_matmul_small_kernel<K, CB, MT, KT>;
    static int optin = 0;  // dynamic shared memory a block may opt in to (minus the kernel's static part)
    static int per_sm = 0, per_block = 0;  // shared memory of an SM; a block's static part + 1 KB reserve
    if (optin == 0) {
        int dev = 0, limit = 0, sm_limit = 0;
        cudaFuncAttributes fa;
        cudaGetDevice(&dev);
        if (cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&sm_limit, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess ||
            cudaFuncGetAttributes(&fa, kernel) != cudaSuccess)
            return (int)cudaGetLastError();
        optin = limit - (int)fa.sharedSizeBytes;
        per_sm = sm_limit;
        per_block = (int)fa.sharedSizeBytes + 1024;
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
        if (err != cudaSuccess) {
            optin = 0;
            cudaGetLastError();
            return (int)err;
        }
    }
    // A plan per shared-memory budget and reduce period: one wave where it fits (every block resident at
    // once, each walking a run of column tiles so its trellis loads overlap its decoding). Any run width
    // works (a 128-column group may be shared by several blocks); at most 120 tiles, so a block touches
    // at most 16 groups (last_groups). Budgets: an SM's share for TRELLM_GEMV_MIN_BLOCKS blocks (the
    // register budget is sized for as many) or for two; never more than the device allows a block
    // (99 KB on sm_86/89), never less than one column needs.
    struct Plan { int cols, resident, blocks, period; };
    static int occupancy[2][2] = {};  // per instantiation, budget and period; the register count also bounds it
    auto plan_for = [&](bool many_blocks, int period) {
        const int target_blocks = many_blocks ? TRELLM_GEMV_MIN_BLOCKS : 2;
        const size_t budget = max(min((size_t)(per_sm / target_blocks - per_block) & ~(size_t)127, (size_t)optin),
                                  smem_for(1, period));
        const size_t fixed = ring_bytes + (period > 0 ? (size_t)period * acc_per_col : 0);
        const int max_cols = max(1, (int)((budget - fixed) / (period > 0 ? red_per_col : acc_per_col)));
        int &blocks_per_sm = occupancy[many_blocks][period > 0];
        if (blocks_per_sm == 0) {
            int b = 0;
            if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, GEMV_WARPS * 32, budget) != cudaSuccess || b < 1)
                b = 1;
            blocks_per_sm = b;
        }
        Plan plan;
        plan.period = period;
        plan.resident = (num_sms > 0 ? num_sms : 132) * blocks_per_sm;
        auto blocks_for = [&](int cols) {
            int blocks = 0;
            for (int p = 0; p < parts.count; ++p) blocks += (parts.part[p].n / 16 + cols - 1) / cols * slices;
            return blocks;
        };
        plan.cols = max(1, min(min(max_cols, 120), (tiles_n * slices + plan.resident - 1) / plan.resident));
        plan.blocks = blocks_for(plan.cols);
        // Rounding each part's runs up can spill a few blocks into a second wave (8 bpw, 8 rows,
        // 14336->4096: 266 blocks on 264 slots): widen the runs while that is allowed.
        while (plan.blocks > plan.resident && plan.cols < min(max_cols, 120)) plan.blocks = blocks_for(++plan.cols);
        return plan;
    };
    // Up to 4 rows: three blocks per SM. 5..16 rows: three where that is one wave, else two (always two
    // measured slower). Above 8 rows, when even that takes several waves, the block sums its warps every 2
    // columns (the periodic barriers cost more than they save where one wave fits: NOTES 2026-12-03d).
    auto best_plan = [&](int period) {
        const Plan plan = plan_for(true, period);
        if (first.m <= 4 || plan.blocks <= plan.resident) return plan;
        return plan_for(false, period);
    };
    Plan plan = best_plan(0);
    if (first.m > 8 && plan.blocks > plan.resident) plan = best_plan(2);
    parts.reduce_period = plan.period;
    parts.serial_arrivals = 0;  // one lane per 128-column group arrives at its counter, in parallel (serial: slower)
    // No weight column requested before pdl_wait (only suh), the ring after the x transform: weight
    // requests would compete with the kernel before (attention, norms), which is latency-bound. Chained
    // GEMVs alone do not tell (benchmarks/gemv_phases.cu: equal); the 8B decode step does: 16 columns
    // 3.278 ms, 1 column 3.204, none 3.151 (NOTES 2026-12-03f, 2026-12-04a).
    parts.early_stages = 0;
    const int cols = plan.cols;
    int blocks_x = 0;
    for (int p = 0; p < parts.count; ++p) {
        MatmulArgs &a = parts.part[p];
        a.cols_per_block = cols;
        parts.block_begin[p] = blocks_x;
        blocks_x += (a.n / 16 + cols - 1) / cols;
    }
    parts.block_begin[parts.count] = blocks_x;
    dim3 grid(blocks_x, slices);
    const size_t smem = smem_for(cols, plan.period);
    const cudaError_t err = launch_pdl(kernel, grid, dim3(GEMV_WARPS * 32), smem, stream, parts);
    return err == cudaSuccess ? TRELLM_OK : (int)err;
}

template <int K, int CB>
int launch_matmul_k(MatmulParts args, int num_sms, cudaStream_t stream) {
    const int m = args.part[0].m;
    const int kt = gemv_kt(m, args.part[0].k, parts_n(args));
    if (m <= 8) return kt == 4 ? launch_matmul_mt<K, CB, 1, 4>(args, num_sms, stream)
                               : launch_matmul_mt<K, CB, 1, 8>(args, num_sms, stream);
    if (m <= 16) return kt == 8 ? launch_matmul_mt<K, CB, 2, 8>(args, num_sms, stream)
                                : launch_matmul_mt<K, CB, 2, 4>(args, num_sms, stream);
    return TRELLM_E_UNSUPPORTED;
}

#define TRELLM_FOR_EACH_K(MACRO) MACRO(1) MACRO(2) MACRO(3) MACRO(4) MACRO(5) MACRO(6) MACRO(7) MACRO(8)

#define TRELLM_DEFINE_GEMV_LAUNCHER(CB_VALUE)                                                                  \
    template <>                                                                                                 \
    int launch_exl3_matmul_small<CB_VALUE>(MatmulParts args, int K, int num_sms, cudaStream_t stream) {        \
        switch (K) {                                                                                            \
            _GEMV_CASE(1) _GEMV_CASE(2) _GEMV_CASE(3) _GEMV_CASE(4)                                             \
            _GEMV_CASE(5) _GEMV_CASE(6) _GEMV_CASE(7) _GEMV_CASE(8)                                             \
            default: return TRELLM_E_BAD_ARG;                                                                   \
        }                                                                                                       \
    }

#define TRELLM_DEFINE_CODEBOOK_LAUNCHERS(CB_VALUE)                                                              \
    TRELLM_DEFINE_GEMV_LAUNCHER(CB_VALUE)                                                                       \
    template <>                                                                                                 \
    int launch_exl3_decode_tiles<CB_VALUE>(const uint32_t *trellis, half *w, int k, int n, int K,              \
                                           cudaStream_t stream) {                                              \
        const int64_t tiles = (int64_t)(k / 16) * (n / 16);                                                     \
        const int blocks = (int)((tiles + 7) / 8);                                                              \
        switch (K) {                                                                                            \
            _DEC_CASE(1) _DEC_CASE(2) _DEC_CASE(3) _DEC_CASE(4)                                                 \
            _DEC_CASE(5) _DEC_CASE(6) _DEC_CASE(7) _DEC_CASE(8)                                                 \
            default: return TRELLM_E_BAD_ARG;                                                                   \
        }                                                                                                       \
        TRELLM_LAUNCH_CHECK();                                                                                  \
        return TRELLM_OK;                                                                                       \
    }

#define _GEMV_CASE(KV) \
    case KV: return launch_matmul_k<KV, CB_VALUE>(args, num_sms, stream);
#define _DEC_CASE(KV) \
    case KV: exl3_decode_tiles_kernel<KV, CB_VALUE><<<blocks, 256, 0, stream>>>(trellis, w, k, n); break;

}  // namespace trellm
