// Trellis Viterbi encoder (conversion): per 16x16 tile, the tail-biting path of 16-bit states that
// minimises sum_p (decode(state_p) - target_p)^2, with state_p = (state_{p-1} << K | code_p) & 0xFFFF.
//
// Same two-pass scheme as the torch reference (trellm.ops.exl3.trellis_viterbi): pass 1 runs from
// position 128 round to 127 from free start nodes and backtracks to the node entering position 0;
// pass 2 runs 0..255 from that node only and backtracks from it, closing the ring.
//
// A node is the low 16-K bits of a state (what the next state inherits); state s = t << (16-K) | v
// has out-node v and in-node s >> K. One block (1024 threads) owns a tile at a time: each thread owns
// a few out-nodes and takes the min over their 2^K candidate states, decoding the codebook on the fly
// (no 64K-entry table, so everything fits on chip). K = 7, 8 split a node's candidates over 2 or 4
// lanes of a warp. Node costs live in shared memory; back-pointers (the winning t per node and step)
// go to a per-block global scratch area.
#include "common.cuh"

namespace {

constexpr int VT_THREADS = 1024;

template <int K>
struct VGeom {
    static constexpr int NODES = 1 << (16 - K);
    static constexpr int LANES_PER_NODE = NODES >= VT_THREADS ? 1 : VT_THREADS / NODES;  // 1, 2 (K=7), 4 (K=8)
    static constexpr int NODES_PER_THREAD = NODES >= VT_THREADS ? NODES / VT_THREADS : 1;
    static constexpr int T_PER_LANE = (1 << K) / LANES_PER_NODE;
};

template <int CB> __device__ __forceinline__ float decode_f32(uint32_t s) { return __half2float(decode_one<CB>(s)); }

// One trellis step at target w: new cost of every node (in place) and its back-pointers.
template <int K, int CB>
__device__ __forceinline__ void viterbi_step(float *cost, uint8_t *bp_step, float w) {
    using G = VGeom<K>;
    const int tid = threadIdx.x;
    float best[G::NODES_PER_THREAD];
    int arg[G::NODES_PER_THREAD];
#pragma unroll
    for (int i = 0; i < G::NODES_PER_THREAD; ++i) {
        const int v = G::LANES_PER_NODE == 1 ? tid + i * VT_THREADS : tid / G::LANES_PER_NODE;
        const int t0 = G::LANES_PER_NODE == 1 ? 0 : (tid % G::LANES_PER_NODE) * G::T_PER_LANE;
        float b = INFINITY;
        int a = t0;
#pragma unroll 4
        for (int t = t0; t < t0 + G::T_PER_LANE; ++t) {
            const uint32_t s = ((uint32_t)t << (16 - K)) | (uint32_t)v;
            const float d = decode_f32<CB>(s) - w;
            const float c = cost[s >> K] + d * d;
            if (c < b) { b = c; a = t; }
        }
        if constexpr (G::LANES_PER_NODE > 1) {
#pragma unroll
            for (int o = 1; o < G::LANES_PER_NODE; o <<= 1) {
                const float ob = __shfl_xor_sync(0xffffffffu, b, o);
                const int oa = __shfl_xor_sync(0xffffffffu, a, o);
                if (ob < b || (ob == b && oa < a)) { b = ob; a = oa; }
            }
        }
        best[i] = b;
        arg[i] = a;
    }
    __syncthreads();  // every read of the old costs is done
#pragma unroll
    for (int i = 0; i < G::NODES_PER_THREAD; ++i) {
        if (G::LANES_PER_NODE == 1 || tid % G::LANES_PER_NODE == 0) {
            const int v = G::LANES_PER_NODE == 1 ? tid + i * VT_THREADS : tid / G::LANES_PER_NODE;
            cost[v] = best[i];
            bp_step[v] = (uint8_t)arg[i];
        }
    }
    __syncthreads();
}

// Backtrack `steps` stored steps from end node; writes the full states of those steps (oldest first).
template <int K>
__device__ void backtrack(const uint8_t *bp, int steps, int end_node, uint32_t *states_out) {
    int node = end_node;
    for (int s = steps - 1; s >= 0; --s) {
        const uint32_t t = __ldcg(bp + (size_t)s * VGeom<K>::NODES + node);
        const uint32_t state = (t << (16 - K)) | (uint32_t)node;
        states_out[s] = state;
        node = (int)(state >> K);
    }
}

template <int K, int CB>
__global__ void __launch_bounds__(VT_THREADS, 1)
viterbi_kernel(const float *__restrict__ targets, int32_t *__restrict__ states, int64_t tiles, uint8_t *scratch) {
    using G = VGeom<K>;
    extern __shared__ float cost[];  // [NODES]
    __shared__ float w[256];
    __shared__ uint32_t head[128];
    __shared__ float red_v[VT_THREADS / 32];
    __shared__ int red_i[VT_THREADS / 32];
    __shared__ int ring_node;
    uint8_t *bp = scratch + (size_t)blockIdx.x * 256 * G::NODES;
    const int tid = threadIdx.x;

    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        if (tid < 256) w[tid] = targets[tile * 256 + tid];
        for (int v = tid; v < G::NODES; v += VT_THREADS) cost[v] = 0.f;
        __syncthreads();

        // Pass 1: positions 128..255 (back-pointers discarded), then 0..127 (kept).
        for (int p = 128; p < 256; ++p) viterbi_step<K, CB>(cost, bp, w[p]);
        for (int p = 0; p < 128; ++p) viterbi_step<K, CB>(cost, bp + (size_t)p * G::NODES, w[p]);

        // argmin over end nodes (first index on ties)
        float bv = INFINITY;
        int bi = 0;
        for (int v = tid; v < G::NODES; v += VT_THREADS)
            if (cost[v] < bv) { bv = cost[v]; bi = v; }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov < bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if ((tid & 31) == 0) { red_v[tid >> 5] = bv; red_i[tid >> 5] = bi; }
        __syncthreads();
        if (tid == 0) {
            float v0 = red_v[0];
            int i0 = red_i[0];
            for (int j = 1; j < VT_THREADS / 32; ++j)
                if (red_v[j] < v0 || (red_v[j] == v0 && red_i[j] < i0)) { v0 = red_v[j]; i0 = red_i[j]; }
            __threadfence_block();
            backtrack<K>(bp, 128, i0, head);
            ring_node = (int)(head[0] >> K);
        }
        __syncthreads();

        // Pass 2: start from ring_node only, positions 0..255, end on ring_node.
        for (int v = tid; v < G::NODES; v += VT_THREADS) cost[v] = v == ring_node ? 0.f : INFINITY;
        __syncthreads();
        for (int p = 0; p < 256; ++p) viterbi_step<K, CB>(cost, bp + (size_t)p * G::NODES, w[p]);
        __threadfence_block();
        if (tid == 0) {
            int node = ring_node;
            for (int s = 255; s >= 0; --s) {
                const uint32_t t = __ldcg(bp + (size_t)s * G::NODES + node);
                const uint32_t state = (t << (16 - K)) | (uint32_t)node;
                states[tile * 256 + s] = (int32_t)state;
                node = (int)(state >> K);
            }
        }
        __syncthreads();
    }
}

template <int K, int CB>
int launch_viterbi(const float *targets, int32_t *states, int64_t tiles, void *scratch, int blocks,
                   cudaStream_t stream) {
    const size_t smem = (size_t)VGeom<K>::NODES * sizeof(float);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(viterbi_kernel<K, CB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    viterbi_kernel<K, CB><<<blocks, VT_THREADS, smem, stream>>>(targets, states, tiles, static_cast<uint8_t *>(scratch));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <int CB>
int launch_viterbi_cb(const float *targets, int32_t *states, int64_t tiles, int K, void *scratch, int blocks,
                      cudaStream_t stream) {
    switch (K) {
        case 1: return launch_viterbi<1, CB>(targets, states, tiles, scratch, blocks, stream);
        case 2: return launch_viterbi<2, CB>(targets, states, tiles, scratch, blocks, stream);
        case 3: return launch_viterbi<3, CB>(targets, states, tiles, scratch, blocks, stream);
        case 4: return launch_viterbi<4, CB>(targets, states, tiles, scratch, blocks, stream);
        case 5: return launch_viterbi<5, CB>(targets, states, tiles, scratch, blocks, stream);
        case 6: return launch_viterbi<6, CB>(targets, states, tiles, scratch, blocks, stream);
        case 7: return launch_viterbi<7, CB>(targets, states, tiles, scratch, blocks, stream);
        case 8: return launch_viterbi<8, CB>(targets, states, tiles, scratch, blocks, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}

int viterbi_blocks(int64_t tiles, int num_sms) {
    const int64_t b = num_sms > 0 ? num_sms : 132;
    return (int)(tiles < b ? tiles : b);
}

}  // namespace

extern "C" int64_t trellm_viterbi_scratch_bytes(int64_t tiles, int K, int num_sms) {
    if (K < 1 || K > 8 || tiles <= 0) return 0;
    return (int64_t)viterbi_blocks(tiles, num_sms) * 256 * ((int64_t)1 << (16 - K));
}

extern "C" int trellm_trellis_viterbi(const float *targets, int32_t *states, int64_t tiles, int K, int codebook,
                                      void *scratch, int num_sms, cudaStream_t stream) {
    if (tiles < 0) return TRELLM_E_BAD_SHAPE;
    if (K < 1 || K > 8) return TRELLM_E_BAD_ARG;
    if (tiles == 0) return TRELLM_OK;
    if (!scratch) return TRELLM_E_BAD_ARG;
    const int blocks = viterbi_blocks(tiles, num_sms);
    switch (codebook) {
        case 0: return launch_viterbi_cb<0>(targets, states, tiles, K, scratch, blocks, stream);
        case 1: return launch_viterbi_cb<1>(targets, states, tiles, K, scratch, blocks, stream);
        case 2: return launch_viterbi_cb<2>(targets, states, tiles, K, scratch, blocks, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}
