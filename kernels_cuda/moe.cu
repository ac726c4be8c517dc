// Sync-free mixture-of-experts kernels for small token counts (decode).
//
// A decode step routes each token to top_k experts: P = tokens * top_k (token, expert) pairs, each a
// GEMV with a different weight. Grouping by expert needs the per-expert counts on the host (a sync per
// layer, no CUDA graph); these kernels instead take the expert id of every pair from device memory and
// reach the weights through a pointer table built once at load, so the launch shapes depend only on P.
//
// EXL3 experts (two launches per projection): moe_exl3_partial_kernel computes, for each (matrix m,
// pair p, 128-column group, k-slice), the trellis product of H128(x * suh) with W_hat; it decodes each
// 16x16 tile straight into the A fragment of the transposed tile (the trellis layout is the m16n8k16
// fragment layout, see common.cuh) and multiplies it by the pair's x row with one mma. The finish kernel
// sums the k-slices, applies H128 * svh (+ bias) and then, per mode, stores y, stores act(gate) * up
// (gate and up in one pass), or sums the top_k pairs of each token weighted by the routing weights.
//
// Dense experts: one warp per four output rows of one pair, 16-byte loads of W and x.
#include "common.cuh"

namespace {

constexpr int MOE_WARPS = 8;
constexpr int MOE_GROUP = 128;  // output columns of one block: the Hadamard's width

// Pointer table row of expert e of matrix m: {trellis, suh, svh, bias (0 = none)}.
struct ExpertTensors {
    const uint32_t *trellis;
    const half *suh;
    const half *svh;
    const half *bias;
};

__device__ __forceinline__ ExpertTensors expert_tensors(const uint64_t *table, int m, int64_t e, int num_experts) {
    const uint64_t *row = table + ((size_t)m * num_experts + e) * 4;
    ExpertTensors t;
    t.trellis = reinterpret_cast<const uint32_t *>(row[0]);
    t.suh = reinterpret_cast<const half *>(row[1]);
    t.svh = reinterpret_cast<const half *>(row[2]);
    t.bias = reinterpret_cast<const half *>(row[3]);
    return t;
}

struct FinishArgs {
    const float *partial;        // [slices, matrices, pairs, n]
    const int64_t *expert_of;    // [pairs]
    const uint64_t *table;       // [matrices, experts, 4]
    const float *pair_weights;   // [pairs] (combine mode)
    void *y;
    int y_dtype, mode, pairs, matrices, num_experts, n, slices, top_k;
};

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + __expf(-g)); }

// The lane's 4 finished outputs of (matrix m, pair p, column group): H128(sum of slices) * svh + bias.
__device__ __forceinline__ void finished_values(const FinishArgs &a, int m, int p, int group, float (&v)[4]) {
    const int lane = threadIdx.x & 31;
    const int col = group * MOE_GROUP + lane * 4;
    v[0] = v[1] = v[2] = v[3] = 0.f;
    for (int s = 0; s < a.slices; ++s) {
        const float4 q = __ldcg(reinterpret_cast<const float4 *>(a.partial + (((size_t)s * a.matrices + m) * a.pairs + p) * a.n + col));
        v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
    }
    warp_hadamard_128(v);
    const int64_t e = a.expert_of[p];
    if (e < 0 || e >= a.num_experts) {
        v[0] = v[1] = v[2] = v[3] = 0.f;
        return;
    }
    const ExpertTensors w = expert_tensors(a.table, m, e, a.num_experts);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] *= __half2float(w.svh[col + i]);
        if (w.bias) v[i] += __half2float(w.bias[col + i]);
    }
}

// Finishes one (item, 128-column group) with the block's warps, warp w taking units w, w + warps, ...:
// TRELLM_MOE_PLAIN: item = pair, unit = matrix, y [matrices, pairs, n].
// TRELLM_MOE_SILU_GATED: item = pair, units 0/1 = gate/up, y [pairs, n] = silu(gate) * up.
// TRELLM_MOE_COMBINE: item = token, unit j = pair t*top_k + j, y [pairs / top_k, n] = sum_j w_j * y_j.
// vals: units * MOE_GROUP floats of shared memory (not PLAIN).
constexpr int FINISH_MAX_WARPS = 32;

// Units finished per item: the token's pairs (COMBINE), gate and up (SILU_GATED), or the matrices (PLAIN).
__host__ __device__ __forceinline__ int finish_units(int mode, int top_k, int matrices) {
    return mode == TRELLM_MOE_COMBINE ? top_k : mode == TRELLM_MOE_SILU_GATED ? 2 : matrices;
}

__device__ void finish_item(const FinishArgs &a, int item, int group, float *vals) {
    const int lane = threadIdx.x & 31, warp = warp_index(), warps = blockDim.x / 32;
    const int units = finish_units(a.mode, a.top_k, a.matrices);
    const bool combine = a.mode == TRELLM_MOE_COMBINE;
    const int col = group * MOE_GROUP + lane * 4;
    for (int u = warp; u < units; u += warps) {
        const int m = combine ? 0 : u;
        const int p = combine ? item * a.top_k + u : item;
        float v[4];
        finished_values(a, m, p, group, v);
        if (a.mode == TRELLM_MOE_PLAIN) {
#pragma unroll
            for (int i = 0; i < 4; ++i) store_from_f32(a.y, a.y_dtype, ((size_t)m * a.pairs + p) * a.n + col + i, v[i]);
        } else {
            const float scale = combine ? a.pair_weights[p] : 1.f;
#pragma unroll
            for (int i = 0; i < 4; ++i) vals[u * MOE_GROUP + lane * 4 + i] = scale * v[i];
        }
    }
    if (a.mode == TRELLM_MOE_PLAIN) return;
    __syncthreads();
    for (int c = threadIdx.x; c < MOE_GROUP; c += blockDim.x) {
        float out;
        if (a.mode == TRELLM_MOE_SILU_GATED) {
            out = silu_f(vals[c]) * vals[MOE_GROUP + c];
        } else {
            out = 0.f;
            for (int j = 0; j < units; ++j) out += vals[j * MOE_GROUP + c];
        }
        store_from_f32(a.y, a.y_dtype, (size_t)item * a.n + group * MOE_GROUP + c, out);
    }
}

// One block per (item, column group), one warp per unit (at least 4 warps).
__global__ void moe_exl3_finish_kernel(const FinishArgs a) {
    __shared__ float vals[FINISH_MAX_WARPS * MOE_GROUP];
    const int groups = a.n / MOE_GROUP;
    finish_item(a, blockIdx.x / groups, blockIdx.x % groups, vals);
}

struct PartialArgs {
    const void *x;               // [rows, k], x_dtype; pair p reads row p / pairs_per_row
    const int64_t *expert_of;    // [pairs]
    const uint64_t *table;       // [matrices, experts, 4]
    float *partial;              // [slices, matrices, pairs, n]
    int x_dtype, pairs, pairs_per_row, matrices, num_experts, k, n, kt;
};

// The tail of a one-launch block, after its partial sums: counts its arrival at its (item, column group); the
// last block to arrive finishes that (finish_item) and sets the counter back to zero for the next launch.
__device__ __forceinline__ void finish_if_last(const PartialArgs &a, const FinishArgs &f, int *counters, int p,
                                               unsigned char *smem_raw) {
    __shared__ int last;
    const int group = blockIdx.x;
    __threadfence();  // this block's partial sums reach L2 before its arrival is counted
    __syncthreads();
    const int item = f.mode == TRELLM_MOE_COMBINE ? p / f.top_k : p;
    if (threadIdx.x == 0) {
        int *counter = counters + (size_t)item * gridDim.x + group;
        const int arrivals = (int)gridDim.y * finish_units(f.mode, f.top_k, a.matrices);
        last = atomicAdd(counter, 1) == arrivals - 1;
        if (last) *counter = 0;  // every arrival is in
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    finish_item(f, item, group, reinterpret_cast<float *>(smem_raw));
}

// grid (n / 128, slices, matrices * pairs); MOE_WARPS warps; warp w owns k tiles [w*kt, (w+1)*kt) of the
// block's slice and all 8 column tiles of the group. FUSED (one launch): counters int32 [items * groups], zero
// between launches, count the blocks of each (item, group) that have written their partial sums; the last one
// to arrive finishes it (finish_item) and sets its counter back to zero.
template <int K, int CB, bool FUSED>
__global__ void __launch_bounds__(MOE_WARPS * 32, 2) moe_exl3_partial_kernel(const PartialArgs a, const FinishArgs f,
                                                                             int *counters) {
    using G = TileGeom<K>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int slice_k = MOE_WARPS * a.kt * 16;
    half *xs = reinterpret_cast<half *>(smem_raw);                                       // [slice_k]
    float *red = reinterpret_cast<float *>(smem_raw + (size_t)slice_k * sizeof(half));   // [warps][128]

    const int lane = threadIdx.x & 31, warp = warp_index();
    const int group = blockIdx.x, slice = blockIdx.y;
    const int m = blockIdx.z / a.pairs, p = blockIdx.z % a.pairs;
    float *out = a.partial + (((size_t)slice * a.matrices + m) * a.pairs + p) * a.n + (size_t)group * MOE_GROUP;
    const int64_t e = a.expert_of[p];
    if (e < 0 || e >= a.num_experts) {  // not a valid expert: contributes zeros (the caller validates ids)
        if (threadIdx.x < MOE_GROUP) out[threadIdx.x] = 0.f;
        if constexpr (FUSED) finish_if_last(a, f, counters, p, smem_raw);
        return;
    }
    const ExpertTensors w = expert_tensors(a.table, m, e, a.num_experts);
    const int row = p / a.pairs_per_row;
    const int k0 = slice * slice_k;
    const int chunks = min(slice_k, a.k - k0) / 128;
    const int tiles_k = a.k / 16, tiles_n = a.n / 16;
    // CB_MUL1_SPLIT: the sum of the slice's x by 128-chunk (kt <= 32: at most MOE_WARPS * 4 chunks).
    __shared__ float x_chunk_sums[CB == CB_MUL1_SPLIT ? MOE_WARPS * 4 : 1];

    // Phase 0: xs = fp16(H128(x * suh)) over the slice.
    for (int c = warp; c < chunks; c += MOE_WARPS) {
        const int col = k0 + c * 128 + lane * 4;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            v[i] = load_as_f32(a.x, a.x_dtype, (size_t)row * a.k + col + i) * __half2float(w.suh[col + i]);
        warp_hadamard_128(v);
        half2 *dst = reinterpret_cast<half2 *>(xs + c * 128 + lane * 4);
        dst[0] = __floats2half2_rn(v[0], v[1]);
        dst[1] = __floats2half2_rn(v[2], v[3]);
        if constexpr (CB == CB_MUL1_SPLIT) {
            const float2 lo = __half22float2(dst[0]), hi = __half22float2(dst[1]);
            const float chunk_sum = warp_sum((lo.x + lo.y) + (hi.x + hi.y));
            if (lane == 0) x_chunk_sums[c] = chunk_sum;
        }
    }
    __syncthreads();

    // Phase 1: each warp runs its k tiles against the group's 8 column tiles, loads one k tile ahead.
    int w0, r;
    lane_window<K>(lane, w0, r);
    const size_t row_stride = (size_t)tiles_n * G::WORDS;
    const uint32_t *group_base = w.trellis + (size_t)group * 8 * G::WORDS;
    const int first_tile = slice * MOE_WARPS * a.kt + warp * a.kt;  // global k tile of t = 0
    const int my_tiles = max(0, min(a.kt, tiles_k - first_tile));

    float c[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;

    uint32_t raw[2][8][G::NW];
    auto load = [&](uint32_t(&dst)[8][G::NW], int i) {
        const uint32_t *base = group_base + (size_t)i * row_stride;
#pragma unroll
        for (int j = 0; j < 8; ++j) load_lane_words<K>(base + (size_t)j * G::WORDS, w0, dst[j]);
    };
    auto compute = [&](const uint32_t(&src)[8][G::NW], int t) {
        // B fragment: x row 0 lives in lanes 0..3 (k = 2*lane, +1 and +8, +9); the other 7 rows are zero.
        uint32_t b0 = 0u, b1 = 0u;
        if (lane < 4) {
            const uint32_t *px = reinterpret_cast<const uint32_t *>(xs + (warp * a.kt + t) * 16 + lane * 2);
            b0 = px[0];
            b1 = px[4];
        }
        if constexpr (CB == CB_MUL1_SPLIT) {
            uint32_t x_even[2], x_odd[2];
            split_b_operand(b0, x_even[0], x_odd[0]);
            split_b_operand(b1, x_even[1], x_odd[1]);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                uint32_t even[4], odd[4];
                tile_fragments_split<K, CB>(src[j], r, even, odd);
                mma_16816(c[j], even, x_even[0], x_even[1]);
                mma_16816(c[j], odd, x_odd[0], x_odd[1]);
            }
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                uint32_t frag[4];
                tile_fragment<K, CB>(src[j], r, frag);
                mma_16816(c[j], frag, b0, b1);
            }
        }
    };
    if (my_tiles > 0) load(raw[0], first_tile);
    int t = 0;
    for (; t + 1 < my_tiles; t += 2) {
        load(raw[1], first_tile + t + 1);
        compute(raw[0], t);
        if (t + 2 < my_tiles) load(raw[0], first_tile + t + 2);
        compute(raw[1], t + 1);
    }
    if (t < my_tiles) compute(raw[0], t);

    // Phase 2: c[j][0] / c[j][2] of lanes 4q hold columns j*16 + q and j*16 + q + 8 (x row 0).
    if ((lane & 3) == 0) {
        const int q = lane >> 2;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            red[warp * MOE_GROUP + j * 16 + q] = c[j][0];
            red[warp * MOE_GROUP + j * 16 + q + 8] = c[j][2];
        }
    }
    __syncthreads();
    if (threadIdx.x < MOE_GROUP) {
        float s = 0.f;
#pragma unroll
        for (int ww = 0; ww < MOE_WARPS; ++ww) s += red[ww * MOE_GROUP + threadIdx.x];
        if constexpr (CB == CB_MUL1_SPLIT) {
            float x_sum = 0.f;
            for (int ch = 0; ch < chunks; ++ch) x_sum += x_chunk_sums[ch];
            s = mul1_split_partial(s, x_sum);
        }
        out[threadIdx.x] = s;
    }
    if constexpr (FUSED) finish_if_last(a, f, counters, p, smem_raw);
}

// k tiles per warp: enough blocks for about four per SM, but no more slices than needed.
int choose_kt(int tiles_k, int base_blocks, int num_sms) {
    const int target = 4 * (num_sms > 0 ? num_sms : 132);
    const int slices_wanted = max(1, (target + base_blocks - 1) / base_blocks);
    int kt = (tiles_k + MOE_WARPS * slices_wanted - 1) / (MOE_WARPS * slices_wanted);
    return max(1, min(kt, 32));
}

// The partial kernel; with counters (one launch) it also finishes, so its shared memory holds the finish's values too.
template <int K, int CB>
int launch_partial(const PartialArgs &a, const FinishArgs &f, int *counters, int slices, cudaStream_t stream) {
    size_t smem = (size_t)MOE_WARPS * a.kt * 16 * sizeof(half) + (size_t)MOE_WARPS * MOE_GROUP * sizeof(float);
    dim3 grid(a.n / MOE_GROUP, slices, a.matrices * a.pairs);
    if (counters) {
        smem = max(smem, (size_t)finish_units(f.mode, f.top_k, f.matrices) * MOE_GROUP * sizeof(float));
        moe_exl3_partial_kernel<K, CB, true><<<grid, MOE_WARPS * 32, smem, stream>>>(a, f, counters);
    } else {
        moe_exl3_partial_kernel<K, CB, false><<<grid, MOE_WARPS * 32, smem, stream>>>(a, f, nullptr);
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <int CB>
int launch_partial_cb(const PartialArgs &a, const FinishArgs &f, int *counters, int K, int slices, cudaStream_t stream) {
    switch (K) {
        case 1: return launch_partial<1, CB>(a, f, counters, slices, stream);
        case 2: return launch_partial<2, CB>(a, f, counters, slices, stream);
        case 3: return launch_partial<3, CB>(a, f, counters, slices, stream);
        case 4: return launch_partial<4, CB>(a, f, counters, slices, stream);
        case 5: return launch_partial<5, CB>(a, f, counters, slices, stream);
        case 6: return launch_partial<6, CB>(a, f, counters, slices, stream);
        case 7: return launch_partial<7, CB>(a, f, counters, slices, stream);
        case 8: return launch_partial<8, CB>(a, f, counters, slices, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}

int moe_slices(int64_t k, int kt) { return (int)((k / 16 + (int64_t)MOE_WARPS * kt - 1) / ((int64_t)MOE_WARPS * kt)); }

// ---- dense experts -------------------------------------------------------------------------------

constexpr int DENSE_ROWS_PER_WARP = 4;

// grid (ceil(n / (warps * 4)), pairs); y[p, row] = sum_k W_{e_p}[row, k] * x[p / pairs_per_row, k] (+ bias).
template <typename T>
__global__ void moe_dense_pairs_kernel(const T *__restrict__ x, const int64_t *__restrict__ expert_of,
                                       const uint64_t *__restrict__ weights, const uint64_t *__restrict__ biases,
                                       T *__restrict__ y, int pairs_per_row, int num_experts, int n, int k) {
    constexpr int VEC = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, warp = warp_index();
    const int p = blockIdx.y;
    const int row0 = (blockIdx.x * (blockDim.x / 32) + warp) * DENSE_ROWS_PER_WARP;
    if (row0 >= n) return;
    const int64_t e = expert_of[p];
    const bool valid = e >= 0 && e < num_experts;
    const T *w = valid ? reinterpret_cast<const T *>(weights[e]) : nullptr;
    const T *xr = x + (size_t)(p / pairs_per_row) * k;
    float acc[DENSE_ROWS_PER_WARP] = {0.f, 0.f, 0.f, 0.f};
    if (valid) {
        for (int c = lane * VEC; c < k; c += 32 * VEC) {
            const uint4 xv = __ldg(reinterpret_cast<const uint4 *>(xr + c));
            const T *xe = reinterpret_cast<const T *>(&xv);
#pragma unroll
            for (int rr = 0; rr < DENSE_ROWS_PER_WARP; ++rr) {
                const int row = min(row0 + rr, n - 1);
                const uint4 wv = __ldg(reinterpret_cast<const uint4 *>(w + (size_t)row * k + c));
                const T *we = reinterpret_cast<const T *>(&wv);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[rr] += to_f32<T>(we[i]) * to_f32<T>(xe[i]);
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < DENSE_ROWS_PER_WARP; ++rr) acc[rr] = warp_sum(acc[rr]);
    if (lane < DENSE_ROWS_PER_WARP && row0 + lane < n) {
        float v = acc[0];
#pragma unroll
        for (int rr = 1; rr < DENSE_ROWS_PER_WARP; ++rr) if (lane == rr) v = acc[rr];
        const int row = row0 + lane;
        if (valid && biases && biases[e]) v += to_f32<T>(reinterpret_cast<const T *>(biases[e])[row]);
        y[(size_t)p * n + row] = from_f32<T>(v);
    }
}

}  // namespace

extern "C" int64_t trellm_moe_exl3_workspace(int64_t pairs, int64_t matrices, int64_t k, int64_t n, int num_sms) {
    if (pairs <= 0 || matrices <= 0 || k <= 0 || n <= 0 || k % 128 || n % 128) return 0;
    const int base = (int)(n / MOE_GROUP * pairs * matrices);
    const int kt = choose_kt((int)(k / 16), base, num_sms);
    return (int64_t)moe_slices(k, kt) * matrices * pairs * n;
}

extern "C" int64_t trellm_moe_exl3_counters(int64_t pairs, int64_t top_k, int mode, int64_t n) {
    if (pairs <= 0 || n <= 0 || n % MOE_GROUP || (mode == TRELLM_MOE_COMBINE && (top_k <= 0 || pairs % top_k))) return 0;
    return (mode == TRELLM_MOE_COMBINE ? pairs / top_k : pairs) * (n / MOE_GROUP);
}

extern "C" int trellm_moe_exl3_matmul(const void *x, int x_dtype, const int64_t *expert_of, const uint64_t *table,
                                      float *workspace, int *counters, const float *pair_weights, void *y, int y_dtype,
                                      int mode,
                                      int64_t pairs, int64_t pairs_per_row, int64_t top_k, int64_t matrices,
                                      int64_t num_experts, int64_t k, int64_t n, int K, int codebook, int num_sms,
                                      cudaStream_t stream) {
    if (k <= 0 || n <= 0 || k % 128 || n % 128 || k > INT32_MAX / 2 || n > INT32_MAX / 2) return TRELLM_E_BAD_SHAPE;
    if (pairs <= 0 || pairs_per_row <= 0 || matrices <= 0 || num_experts <= 0) return TRELLM_E_BAD_SHAPE;
    if (matrices * pairs > 65535 || num_experts > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    if (K < 1 || K > 8 || codebook < 0 || codebook > CB_MUL1_SPLIT) return TRELLM_E_BAD_ARG;
    if (x_dtype < TRELLM_F16 || x_dtype > TRELLM_F32 || y_dtype < TRELLM_F16 || y_dtype > TRELLM_F32)
        return TRELLM_E_BAD_DTYPE;
    if (mode == TRELLM_MOE_SILU_GATED && matrices != 2) return TRELLM_E_BAD_ARG;
    if (mode == TRELLM_MOE_COMBINE && (matrices != 1 || top_k <= 0 || top_k > FINISH_MAX_WARPS || pairs % top_k ||
                                       !pair_weights))
        return TRELLM_E_BAD_ARG;
    if (mode == TRELLM_MOE_PLAIN && matrices > FINISH_MAX_WARPS) return TRELLM_E_BAD_ARG;
    if ((int64_t)pairs * (n / MOE_GROUP) > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    if (mode < TRELLM_MOE_PLAIN || mode > TRELLM_MOE_COMBINE) return TRELLM_E_BAD_ARG;

    PartialArgs pa;
    pa.x = x;
    pa.expert_of = expert_of;
    pa.table = table;
    pa.partial = workspace;
    pa.x_dtype = x_dtype;
    pa.pairs = (int)pairs;
    pa.pairs_per_row = (int)pairs_per_row;
    pa.matrices = (int)matrices;
    pa.num_experts = (int)num_experts;
    pa.k = (int)k;
    pa.n = (int)n;
    pa.kt = choose_kt((int)(k / 16), (int)(n / MOE_GROUP * pairs * matrices), num_sms);
    const int slices = moe_slices(k, pa.kt);

    FinishArgs fa;
    fa.partial = workspace;
    fa.expert_of = expert_of;
    fa.table = table;
    fa.pair_weights = pair_weights;
    fa.y = y;
    fa.y_dtype = y_dtype;
    fa.mode = mode;
    fa.pairs = (int)pairs;
    fa.matrices = (int)matrices;
    fa.num_experts = (int)num_experts;
    fa.n = (int)n;
    fa.slices = slices;
    fa.top_k = (int)top_k;
    int rc;
    switch (codebook) {
        case 0: rc = launch_partial_cb<0>(pa, fa, counters, K, slices, stream); break;
        case 1: rc = launch_partial_cb<1>(pa, fa, counters, K, slices, stream); break;
        case 2: rc = launch_partial_cb<2>(pa, fa, counters, K, slices, stream); break;
        default: rc = launch_partial_cb<CB_MUL1_SPLIT>(pa, fa, counters, K, slices, stream); break;
    }
    if (rc || counters) return rc;  // one launch: the partial kernel's last blocks finished

    const int blocks = (int)trellm_moe_exl3_counters(pairs, top_k, mode, n);  // one per (item, column group)
    const int threads = 32 * max(finish_units(mode, fa.top_k, fa.matrices), 4);  // >= 128 threads for the column loop
    moe_exl3_finish_kernel<<<blocks, threads, 0, stream>>>(fa);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_moe_dense_matmul(const void *x, const int64_t *expert_of, const uint64_t *weights,
                                       const uint64_t *biases, void *y, int dtype, int64_t pairs,
                                       int64_t pairs_per_row, int64_t num_experts, int64_t k, int64_t n,
                                       cudaStream_t stream) {
    if (pairs <= 0 || pairs_per_row <= 0 || num_experts <= 0 || k <= 0 || n <= 0) return TRELLM_E_BAD_SHAPE;
    if (pairs > 65535 || k > INT32_MAX / 2 || n > INT32_MAX / 2) return TRELLM_E_BAD_SHAPE;
    const int warps = 8;
    const int rows_per_block = warps * DENSE_ROWS_PER_WARP;
    dim3 grid((unsigned)((n + rows_per_block - 1) / rows_per_block), (unsigned)pairs);
    const int64_t vec = dtype == TRELLM_F32 ? 4 : 8;
    if (k % vec) return TRELLM_E_BAD_SHAPE;
    TRELLM_DISPATCH_DTYPE(dtype, T,
        moe_dense_pairs_kernel<T><<<grid, warps * 32, 0, stream>>>(
            static_cast<const T *>(x), expert_of, weights, biases, static_cast<T *>(y), (int)pairs_per_row,
            (int)num_experts, (int)n, (int)k));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

// ---- router: softmax over the experts, top k, optional renormalisation, in one launch -----------------

namespace {

constexpr int ROUTER_THREADS = 256;
constexpr int ROUTER_PER_THREAD = 4;  // experts per thread: up to 1024 experts

// Block-wide argmax of (value, index); ties go to the lower index. Every thread gets the result.
__device__ __forceinline__ void block_argmax(float &v, int &i, float *sv, int *si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // sv/si free from the previous round
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    v = sv[0];
    i = si[0];
    for (int w = 1; w < ROUTER_THREADS / 32; ++w)
        if (sv[w] > v || (sv[w] == v && si[w] < i)) { v = sv[w]; i = si[w]; }
}

__device__ __forceinline__ float block_sum(float v, float *sv) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < ROUTER_THREADS / 32; ++w) s += sv[w];
    return s;
}

// grid (tokens); logits [tokens, experts (+ 1 with a sigmoid shared gate)]; weights float32 and ids int64
// [tokens, out_k] (descending weight), out_k = k, or k + 1 with a shared pair (expert id `experts`, weight
// 1 or sigmoid of the row's last logit) after the routed ones.
__global__ void __launch_bounds__(ROUTER_THREADS) softmax_topk_kernel(const void *logits, int dtype, float *weights,
                                                                      int64_t *ids, int experts, int k, int normalize,
                                                                      float scaling, int shared) {
    __shared__ float sv[ROUTER_THREADS / 32];
    __shared__ int si[ROUTER_THREADS / 32];
    const size_t row = blockIdx.x;
    const size_t row_stride = experts + (shared == TRELLM_SHARED_PAIR_SIGMOID);
    const int out_k = k + (shared != TRELLM_SHARED_PAIR_NONE);
    float p[ROUTER_PER_THREAD];
    float local_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_THREAD; ++j) {
        const int e = threadIdx.x + j * ROUTER_THREADS;
        p[j] = e < experts ? load_as_f32(logits, dtype, row * row_stride + e) : -INFINITY;
        local_max = fmaxf(local_max, p[j]);
    }
    int unused = 0;
    block_argmax(local_max, unused, sv, si);
    float local_sum = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_PER_THREAD; ++j) {
        const int e = threadIdx.x + j * ROUTER_THREADS;
        p[j] = e < experts ? __expf(p[j] - local_max) : -1.f;  // taken / absent experts are -1 (probs are >= 0)
        if (e < experts) local_sum += p[j];
    }
    const float inv_total = 1.f / block_sum(local_sum, sv);
    float chosen_sum = 0.f;
    for (int r = 0; r < k; ++r) {
        float v = -2.f;
        int i = INT32_MAX;
#pragma unroll
        for (int j = 0; j < ROUTER_PER_THREAD; ++j) {
            const int e = threadIdx.x + j * ROUTER_THREADS;
            if (p[j] > v) { v = p[j]; i = e; }  // e rises with j: the first maximum is the lowest index
        }
        block_argmax(v, i, sv, si);
#pragma unroll
        for (int j = 0; j < ROUTER_PER_THREAD; ++j)
            if (threadIdx.x + j * ROUTER_THREADS == i) p[j] = -1.f;
        const float prob = v * inv_total;
        chosen_sum += prob;
        if (threadIdx.x == 0) {
            weights[row * out_k + r] = prob;
            ids[row * out_k + r] = i;
        }
    }
    if (threadIdx.x == 0) {
        const float factor = (normalize ? 1.f / chosen_sum : 1.f) * scaling;
        for (int r = 0; r < k; ++r) weights[row * out_k + r] *= factor;
        if (shared != TRELLM_SHARED_PAIR_NONE) {
            float w = 1.f;
            if (shared == TRELLM_SHARED_PAIR_SIGMOID)
                w = 1.f / (1.f + __expf(-load_as_f32(logits, dtype, row * row_stride + experts)));
            weights[row * out_k + k] = w;
            ids[row * out_k + k] = experts;
        }
    }
}

}  // namespace

extern "C" int trellm_softmax_topk_shared(const void *logits, int dtype, float *weights, int64_t *ids, int64_t tokens,
                                          int64_t experts, int64_t k, int normalize, float scaling, int shared,
                                          cudaStream_t stream) {
    if (tokens < 0 || experts < 1 || experts > ROUTER_THREADS * ROUTER_PER_THREAD || k < 1 || k > experts)
        return TRELLM_E_BAD_SHAPE;
    if (dtype < TRELLM_F16 || dtype > TRELLM_F32) return TRELLM_E_BAD_DTYPE;
    if (shared < TRELLM_SHARED_PAIR_NONE || shared > TRELLM_SHARED_PAIR_SIGMOID) return TRELLM_E_BAD_ARG;
    if (tokens == 0) return TRELLM_OK;
    if (tokens > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    softmax_topk_kernel<<<(unsigned)tokens, ROUTER_THREADS, 0, stream>>>(logits, dtype, weights, ids, (int)experts,
                                                                         (int)k, normalize, scaling, shared);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_softmax_topk(const void *logits, int dtype, float *weights, int64_t *ids, int64_t tokens,
                                   int64_t experts, int64_t k, int normalize, cudaStream_t stream) {
    return trellm_softmax_topk_shared(logits, dtype, weights, ids, tokens, experts, k, normalize, 1.f,
                                      TRELLM_SHARED_PAIR_NONE, stream);
}
