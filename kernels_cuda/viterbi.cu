// Trellis Viterbi encoder (conversion): per 16x16 tile, the tail-biting path of 16-bit states that
// minimises sum_p (decode(state_p) - target_p)^2, with state_p = (state_{p-1} << K | code_p) & 0xFFFF.
//
// Same two-pass scheme as the torch reference (trellm.ops.exl3.trellis_viterbi): pass 1 runs from
// position 128 round to 127 from free start nodes and backtracks to the node entering position 0;
// pass 2 runs 0..255 from that node only and backtracks from it, closing the ring.
//
// A node is the low 16-K bits of a state (what the next state inherits). Split a state as
// s = t << (16-K) | hi << K | lo (t, lo: K bits; hi: 16-2K bits): its in-node is t << (16-2K) | hi, its
// out-node hi << K | lo. The 2^K out-nodes of one "group" hi all read the same 2^K in-node costs.
//
// Work per step: every (out-node, t) candidate, 65536 of them per tile. Why this layout is fast:
//  - T tiles (1, 2 or 4, as shared memory allows) run in lockstep in one block: decode(state) is the
//    same for all of them, so a candidate costs one decode plus T x (sub, fma, pack, min).
//  - A thread owns LO_PER out-nodes of one group (and a slice of the t's for K >= 6), so each in-node
//    cost it loads serves LO_PER candidates, and the codebook hash of state t is the hash of t = 0
//    plus a constant (the hash is linear in s), i.e. one add.
//  - The argmin is a single unsigned min: costs are non-negative floats, whose bit patterns order like
//    the values, so the low K mantissa bits are replaced by t (ties go to the lowest t, as in the
//    reference); the kept cost loses those K bits (relative 2^(K-23) per step).
// Node costs live in shared memory ([T][NODES] fp32), read in one phase and written after a barrier;
// back-pointers (the winning t per node and step, one byte) go to a per-block global scratch area.
#include "common.cuh"

namespace {

constexpr int VT_THREADS = 512;
constexpr int VT_WARPS = VT_THREADS / 32;
constexpr int VT_MAX_T = 4;  // tiles per block, at most

// T x NODES fp32 costs must fit the largest opt-in shared memory (227 KB on sm_90): K = 1 only runs
// one tile per block, K = 2 two. Not instantiating the larger T keeps the build time down.
constexpr int vt_max_t(int K) { return K == 1 ? 1 : K == 2 ? 2 : VT_MAX_T; }

template <int K>
struct VGeom {
    static constexpr int NB = 16 - K;                // node bits
    static constexpr int NODES = 1 << NB;
    static constexpr int HI_BITS = 16 - 2 * K;       // >= 0 for K <= 8
    static constexpr int GROUPS = 1 << HI_BITS;
    static constexpr int NK = 1 << K;                // t's (and lo's) per group
    static constexpr int LO_PER = K == 1 ? 2 : (K == 3 || K == 4) ? 8 : 4;  // out-nodes per thread and group
    static constexpr int TS = K <= 5 ? 1 : 1 << (K - 5);                    // threads sharing an out-node's t's
    static constexpr int TR = NK / TS;               // t's per thread
    static constexpr int LOSETS = NK / LO_PER;       // threads per group and t slice
    static constexpr int GQ = VT_THREADS / (TS * LOSETS);  // distinct group slots per block pass
    static constexpr int G_PER = GROUPS / GQ;        // groups per thread
    static_assert(G_PER >= 1 && G_PER * GQ == GROUPS, "thread layout must cover the groups exactly");
    static_assert(TS <= 32 && (TS & (TS - 1)) == 0, "t slices of one out-node must share a warp");
    static_assert(TS == 1 || G_PER == 1, "the t-slice reduction handles one group per thread");
};

// decode(s) from the codebook hash h = cb_hash(s): the same arithmetic as decode_one (common.cuh), one
// state at a time so the fp16 sum uses one HADD2 on the two halves.
template <int CB> __device__ __forceinline__ float decode_hashed(uint32_t h) {
    if constexpr (CB == TRELLM_CB_MUL1) {
        const uint32_t v = __dp4a(h, 0x01010101u, 0x6400u);
        const half x = __ushort_as_half((unsigned short)v);
        return __half2float(__hfma(x, __ushort_as_half(0x1EEE), __ushort_as_half(0xC931)));
    } else {
        const uint32_t x = lop3_and_xor(h, 0x8FFF8FFFu, 0x3B603B60u);
        const half2 p = *reinterpret_cast<const half2 *>(&x);
        return __half2float(__hadd(__low2half(p), __high2half(p)));
    }
}

// (c & mask) | t in ONE lop3 (immLut 0xEA); with both constants as immediates the compiler emits two.
__device__ __forceinline__ uint32_t pack_key(float c, uint32_t mask, uint32_t t) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(__float_as_uint(c)), "r"(mask), "r"(t));
    return d;
}

// One trellis step at position p for T tiles: the new cost of every node (in place) and, when
// bp_step is set, its back-pointers (bp_step + j * tile_stride + node for tile j).
template <int K, int T, int CB>
__device__ __forceinline__ void viterbi_step(float *cost, const float (*w)[256], int p, uint8_t *bp_step,
                                             size_t tile_stride, int ts, int lo0, int gq) {
    using G = VGeom<K>;
    constexpr uint32_t M = (1u << K) - 1u;
    const uint32_t mult = cb_hash<CB>(1u) - cb_hash<CB>(0u);  // cb_hash(s + d) = cb_hash(s) + d * mult
    float wj[T];
#pragma unroll
    for (int j = 0; j < T; ++j) wj[j] = w[j][p];

    uint32_t key[G::G_PER][G::LO_PER][T];
#pragma unroll
    for (int g = 0; g < G::G_PER; ++g) {
        const uint32_t hi = (uint32_t)(gq + g * G::GQ);
        const uint32_t h0 = cb_hash<CB>(((uint32_t)ts << G::NB) | (hi << K) | (uint32_t)lo0);
        const float *cin = cost + (((uint32_t)ts << G::HI_BITS) | hi);
#pragma unroll
        for (int l = 0; l < G::LO_PER; ++l)
#pragma unroll
            for (int j = 0; j < T; ++j) key[g][l][j] = 0xFFFFFFFFu;
#pragma unroll 4
        for (int i = 0; i < G::TR; ++i) {
            const uint32_t t = (uint32_t)(i * G::TS + ts);
            float c_in[T];
#pragma unroll
            for (int j = 0; j < T; ++j) c_in[j] = cin[j * G::NODES + ((i * G::TS) << G::HI_BITS)];
            const uint32_t ht = h0 + ((uint32_t)(i * G::TS) << G::NB) * mult;
#pragma unroll
            for (int l = 0; l < G::LO_PER; ++l) {
                const float f = decode_hashed<CB>(ht + (uint32_t)l * mult);
#pragma unroll
                for (int j = 0; j < T; ++j) {
                    const float d = f - wj[j];
                    const float c = fmaf(d, d, c_in[j]);
                    key[g][l][j] = min(key[g][l][j], pack_key(c, ~M, t));
                }
            }
        }
    }
    if constexpr (G::TS > 1) {
#pragma unroll
        for (int o = 1; o < G::TS; o <<= 1)
#pragma unroll
            for (int l = 0; l < G::LO_PER; ++l)
#pragma unroll
                for (int j = 0; j < T; ++j)
                    key[0][l][j] = min(key[0][l][j], __shfl_xor_sync(0xffffffffu, key[0][l][j], o));
    }
    __syncthreads();  // every read of the old costs is done
    if (G::TS == 1 || ts == 0) {
#pragma unroll
        for (int g = 0; g < G::G_PER; ++g) {
            const uint32_t node0 = ((uint32_t)(gq + g * G::GQ) << K) | (uint32_t)lo0;
#pragma unroll
            for (int j = 0; j < T; ++j) {
                float nc[G::LO_PER];
                uint32_t b[G::LO_PER];
#pragma unroll
                for (int l = 0; l < G::LO_PER; ++l) {
                    nc[l] = __uint_as_float(key[g][l][j] & ~M);
                    b[l] = key[g][l][j] & M;
                }
                float *dst = cost + j * G::NODES + node0;
                if constexpr (G::LO_PER == 2) {
                    *reinterpret_cast<float2 *>(dst) = make_float2(nc[0], nc[1]);
                } else {
#pragma unroll
                    for (int l = 0; l < G::LO_PER; l += 4)
                        *reinterpret_cast<float4 *>(dst + l) = make_float4(nc[l], nc[l + 1], nc[l + 2], nc[l + 3]);
                }
                if (bp_step) {
                    uint8_t *bdst = bp_step + j * tile_stride + node0;
                    if constexpr (G::LO_PER == 2) {
                        *reinterpret_cast<uint16_t *>(bdst) = (uint16_t)(b[0] | (b[1] << 8));
                    } else {
#pragma unroll
                        for (int l = 0; l < G::LO_PER; l += 4)
                            *reinterpret_cast<uint32_t *>(bdst + l) = b[l] | (b[l + 1] << 8) | (b[l + 2] << 16) | (b[l + 3] << 24);
                    }
                }
            }
        }
    }
    __syncthreads();
}

template <int K, int T, int CB>
__global__ void __launch_bounds__(VT_THREADS, 1)
viterbi_kernel(const float *__restrict__ targets, int32_t *__restrict__ states, int64_t tiles, uint8_t *scratch) {
    using G = VGeom<K>;
    extern __shared__ float cost[];  // [T][NODES]
    __shared__ float w[T][256];
    __shared__ float red_v[T][VT_WARPS];
    __shared__ int red_i[T][VT_WARPS];
    __shared__ int ring_node[T];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int ts = tid % G::TS;
    const int lo0 = (tid / G::TS) % G::LOSETS * G::LO_PER;
    const int gq = tid / (G::TS * G::LOSETS);
    const size_t tile_stride = (size_t)256 * G::NODES;  // back-pointer bytes per tile
    uint8_t *bp = scratch + (size_t)blockIdx.x * T * tile_stride;
    const int64_t groups = (tiles + T - 1) / T;

    for (int64_t q = blockIdx.x; q < groups; q += gridDim.x) {
        const int64_t tile0 = q * T;
        for (int i = tid; i < T * 256; i += VT_THREADS) {
            const int64_t tile = tile0 + i / 256;
            w[i / 256][i % 256] = tile < tiles ? targets[tile * 256 + i % 256] : 0.f;  // spare slots: dummy tile
        }
        for (int v = tid; v < T * G::NODES; v += VT_THREADS) cost[v] = 0.f;
        __syncthreads();

        // Pass 1: positions 128..255 (back-pointers discarded), then 0..127 (kept).
        for (int p = 128; p < 256; ++p) viterbi_step<K, T, CB>(cost, w, p, nullptr, tile_stride, ts, lo0, gq);
        for (int p = 0; p < 128; ++p)
            viterbi_step<K, T, CB>(cost, w, p, bp + (size_t)p * G::NODES, tile_stride, ts, lo0, gq);

        // argmin over end nodes per tile (first index on ties)
        float bv[T];
        int bi[T];
#pragma unroll
        for (int j = 0; j < T; ++j) {
            bv[j] = INFINITY;
            bi[j] = 0;
            for (int v = tid; v < G::NODES; v += VT_THREADS) {
                const float c = cost[j * G::NODES + v];
                if (c < bv[j]) { bv[j] = c; bi[j] = v; }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv[j], o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi[j], o);
                if (ov < bv[j] || (ov == bv[j] && oi < bi[j])) { bv[j] = ov; bi[j] = oi; }
            }
            if (lane == 0) { red_v[j][warp] = bv[j]; red_i[j][warp] = bi[j]; }
        }
        __syncthreads();
        if (lane == 0 && warp < T) {  // warp j backtracks tile j: the node entering position 0
            const int j = warp;
            float v0 = red_v[j][0];
            int node = red_i[j][0];
            for (int k = 1; k < VT_WARPS; ++k)
                if (red_v[j][k] < v0 || (red_v[j][k] == v0 && red_i[j][k] < node)) { v0 = red_v[j][k]; node = red_i[j][k]; }
            __threadfence_block();
            const uint8_t *bpj = bp + j * tile_stride;
            for (int s = 127; s >= 0; --s) {
                const uint32_t t = __ldcg(bpj + (size_t)s * G::NODES + node);
                node = (int)((((t << G::NB) | (uint32_t)node)) >> K);
            }
            ring_node[j] = node;
        }
        __syncthreads();

        // Pass 2: start from ring_node only, positions 0..255, end on ring_node.
        for (int v = tid; v < T * G::NODES; v += VT_THREADS)
            cost[v] = (v % G::NODES) == ring_node[v / G::NODES] ? 0.f : INFINITY;
        __syncthreads();
        for (int p = 0; p < 256; ++p)
            viterbi_step<K, T, CB>(cost, w, p, bp + (size_t)p * G::NODES, tile_stride, ts, lo0, gq);
        __threadfence_block();
        if (lane == 0 && warp < T && tile0 + warp < tiles) {
            const int j = warp;
            const int64_t tile = tile0 + j;
            const uint8_t *bpj = bp + j * tile_stride;
            int node = ring_node[j];
            for (int s = 255; s >= 0; --s) {
                const uint32_t t = __ldcg(bpj + (size_t)s * G::NODES + node);
                const uint32_t state = (t << G::NB) | (uint32_t)node;
                states[tile * 256 + s] = (int32_t)state;
                node = (int)(state >> K);
            }
        }
        __syncthreads();
    }
}

// Tiles per block and grid size; the scratch size and the launch must agree, so both use this.
struct VPlan {
    int T;
    int blocks;
};

VPlan viterbi_plan(int64_t tiles, int K, int num_sms) {
    const int64_t sms = num_sms > 0 ? num_sms : 132;
    int optin = 48 * 1024;
    int dev = 0;
    if (cudaGetDevice(&dev) == cudaSuccess) {
        int v = 0;
        if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess && v > 0) optin = v;
    }
    const int64_t node_bytes = (int64_t)4 << (16 - K);
    const int64_t static_bytes = 8 * 1024;  // w, reductions: under 5 KB at T = 4
    // Time of one call ~ rounds * T * per-tile cost at T; the per-candidate instruction count is about
    // 4 + 4 / T (the decode is shared by the T tiles), so cost(T) ~ 4 + 4/T.
    int best_t = 1;
    double best_time = 0.0;
    for (int T = 1; T <= vt_max_t(K); T *= 2) {
        if (T > 1 && T * node_bytes + static_bytes > optin) break;
        const int64_t groups = (tiles + T - 1) / T;
        const int64_t rounds = (groups + sms - 1) / sms;
        const double time = (double)rounds * T * (4.0 + 4.0 / T);
        if (T == 1 || time < best_time) { best_t = T; best_time = time; }
    }
    const int64_t groups = (tiles + best_t - 1) / best_t;
    return {best_t, (int)(groups < sms ? groups : sms)};
}

template <int K, int T, int CB>
int launch_viterbi(const float *targets, int32_t *states, int64_t tiles, void *scratch, int blocks,
                   cudaStream_t stream) {
    const size_t smem = (size_t)T * VGeom<K>::NODES * sizeof(float);
    if (smem > 48 * 1024) {
        cudaError_t e = cudaFuncSetAttribute(viterbi_kernel<K, T, CB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (e != cudaSuccess) return (int)e;
    }
    viterbi_kernel<K, T, CB><<<blocks, VT_THREADS, smem, stream>>>(targets, states, tiles, static_cast<uint8_t *>(scratch));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <int K, int CB>
int launch_viterbi_t(const float *targets, int32_t *states, int64_t tiles, void *scratch, VPlan plan,
                     cudaStream_t stream) {
    switch (plan.T) {
        case 1: return launch_viterbi<K, 1, CB>(targets, states, tiles, scratch, plan.blocks, stream);
        case 2:
            if constexpr (vt_max_t(K) >= 2) return launch_viterbi<K, 2, CB>(targets, states, tiles, scratch, plan.blocks, stream);
            break;
        case 4:
            if constexpr (vt_max_t(K) >= 4) return launch_viterbi<K, 4, CB>(targets, states, tiles, scratch, plan.blocks, stream);
            break;
        default: break;
    }
    return TRELLM_E_BAD_ARG;
}

template <int CB>
int launch_viterbi_cb(const float *targets, int32_t *states, int64_t tiles, int K, void *scratch, VPlan plan,
                      cudaStream_t stream) {
    switch (K) {
        case 1: return launch_viterbi_t<1, CB>(targets, states, tiles, scratch, plan, stream);
        case 2: return launch_viterbi_t<2, CB>(targets, states, tiles, scratch, plan, stream);
        case 3: return launch_viterbi_t<3, CB>(targets, states, tiles, scratch, plan, stream);
        case 4: return launch_viterbi_t<4, CB>(targets, states, tiles, scratch, plan, stream);
        case 5: return launch_viterbi_t<5, CB>(targets, states, tiles, scratch, plan, stream);
        case 6: return launch_viterbi_t<6, CB>(targets, states, tiles, scratch, plan, stream);
        case 7: return launch_viterbi_t<7, CB>(targets, states, tiles, scratch, plan, stream);
        case 8: return launch_viterbi_t<8, CB>(targets, states, tiles, scratch, plan, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}

}  // namespace

extern "C" int64_t trellm_viterbi_scratch_bytes(int64_t tiles, int K, int num_sms) {
    if (K < 1 || K > 8 || tiles <= 0) return 0;
    const VPlan plan = viterbi_plan(tiles, K, num_sms);
    return (int64_t)plan.blocks * plan.T * 256 * ((int64_t)1 << (16 - K));
}

extern "C" int trellm_trellis_viterbi(const float *targets, int32_t *states, int64_t tiles, int K, int codebook,
                                      void *scratch, int num_sms, cudaStream_t stream) {
    if (tiles < 0) return TRELLM_E_BAD_SHAPE;
    if (K < 1 || K > 8) return TRELLM_E_BAD_ARG;
    if (tiles == 0) return TRELLM_OK;
    if (!scratch) return TRELLM_E_BAD_ARG;
    const VPlan plan = viterbi_plan(tiles, K, num_sms);
    switch (codebook) {
        case 0: return launch_viterbi_cb<0>(targets, states, tiles, K, scratch, plan, stream);
        case 1: return launch_viterbi_cb<1>(targets, states, tiles, K, scratch, plan, stream);
        case 2: return launch_viterbi_cb<2>(targets, states, tiles, K, scratch, plan, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}
