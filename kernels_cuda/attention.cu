// Paged-KV attention for decode and chunked prefill (GQA, causal, sliding window, softcap, sinks).
//
// One block per (query token, kv head, chunk of up to GMAX query heads, key split): the group's
// queries share every K/V row read. Inside a block each warp takes tiles of 32 keys, one key per
// lane for the scores (no shuffles per key), then accumulates P.V with each lane owning D/32
// contiguous output dims. Warps merge through shared memory; with several key splits
// (flash-decoding, for short batches over long contexts) the last split block of each group to finish
// merges them (arrival counters), or a second kernel does when no counters are available.
// Prefill chunks run through the same kernel (each query token is its own block): correct, but
// K/V are re-read per token; a tiled prefill kernel is the follow-up.
#include "common.cuh"

#include <mutex>
#include <type_traits>
#include <stdlib.h>

namespace {

constexpr int ATT_WARPS = 4;
constexpr int GMAX = 8;

// Query heads per block: 4 for groups up to 4 (Llama 3: 32 q / 8 kv heads), else GMAX; but 1 when there
// are few query heads in all and a short cache (single-sequence decode). A block's warps walk their keys
// one after another (about 3400 instructions per warp at batch 1, 512 keys, G = 4, one warp per
// scheduler: ncu); four times the blocks with a quarter of the work each, sharing K/V rows through L2,
// made the 8B decode step 3.400 -> 3.290 ms at 528 keys of capacity (the kernel 8.1 us per layer in the
// step). Alone, in a graph of attention calls, the same kernel measured slower (b1: 512 keys 13.6 -> 16.0
// us, 4096 keys 19.8 -> 24.4), so the rule stays where the step was measured: up to 1024 keys.
int heads_per_block(int64_t tokens, int64_t hq, int64_t hkv, int64_t capacity) {
    if (tokens * hq <= 128 && capacity <= 1024) return 1;
    return hq / hkv <= 4 ? 4 : GMAX;
}
int head_chunks_for(int64_t hq, int64_t hkv, int g) { return (int)((hq / hkv + g - 1) / g); }

struct AttnArgs {
    const void *q, *k_pages, *v_pages;
    const int32_t *block_table, *cu_seqlens, *context_lens;
    const float *sinks;
    void *out;
    float *ws_m, *ws_l, *ws_acc;  // [tokens, hq, splits] (+ [.., D]) when splits > 1
    int32_t *counters;            // zeroed [tokens * hkv * head chunks] or NULL: the last split merges
    int batch, hq, hkv, page_size, max_blocks, sliding_window, splits, min_split_keys;
    bool vec16;  // K/V pages 16-byte aligned: rows are read with vector loads
    float scale, softcap;
};

// Merge the key splits of one (token, head), one warp: softmax-weighted partial sums (and the sink).
// Lane s holds split s's (and s + 32's) max and weight, so the per-split loads are independent and in
// flight together; each lane then sums its dims over the splits (empty splits wrote zeros and weigh 0).
// The workspace is read through L2 (__ldcg): other blocks of this launch wrote it.
template <typename T>
__device__ __forceinline__ void merge_splits(const AttnArgs &a, int token, int head, int head_dim) {
    const int lane = threadIdx.x & 31;
    const size_t base = ((size_t)token * a.hq + head) * a.splits;
    const float m0 = lane < a.splits ? __ldcg(a.ws_m + base + lane) : -INFINITY;
    const float m1 = lane + 32 < a.splits ? __ldcg(a.ws_m + base + lane + 32) : -INFINITY;
    const float l0 = lane < a.splits ? __ldcg(a.ws_l + base + lane) : 0.f;
    const float l1 = lane + 32 < a.splits ? __ldcg(a.ws_l + base + lane + 32) : 0.f;
    const float sink = a.sinks ? a.sinks[head] : -INFINITY;
    const float m_all = warp_max(fmaxf(fmaxf(m0, m1), sink));
    const float w0 = m0 == -INFINITY ? 0.f : __expf(m0 - m_all);
    const float w1 = m1 == -INFINITY ? 0.f : __expf(m1 - m_all);
    float l_all = warp_sum(l0 * w0 + l1 * w1);
    if (a.sinks && m_all != -INFINITY) l_all += __expf(sink - m_all);
    constexpr int MAX_DPL = 8;  // head_dim <= 256
    float o[MAX_DPL] = {};
#pragma unroll 4
    for (int sp = 0; sp < a.splits; ++sp) {
        const float w = __shfl_sync(0xffffffffu, sp < 32 ? w0 : w1, sp & 31);
        const float *acc = a.ws_acc + (base + sp) * head_dim + lane;
#pragma unroll
        for (int i = 0; i < MAX_DPL; ++i)
            if (lane + 32 * i < head_dim) o[i] += __ldcg(acc + 32 * i) * w;
    }
    const float inv = l_all > 0.f ? 1.f / l_all : 0.f;
#pragma unroll
    for (int i = 0; i < MAX_DPL; ++i)
        if (lane + 32 * i < head_dim)
            static_cast<T *>(a.out)[((size_t)token * a.hq + head) * head_dim + lane + 32 * i] = from_f32<T>(o[i] * inv);
}

// A lane's DPL contiguous dims of a V row: one 16- or 8-byte load when they fill one (and rows are aligned).
template <typename T, int DPL>
__device__ __forceinline__ void load_lane_dims(const T *__restrict__ p, float (&out)[DPL], bool vec) {
    constexpr int BYTES = DPL * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        if (vec) {
            constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
            for (int c = 0; c < BYTES / 16; ++c) {
                const uint4 u = reinterpret_cast<const uint4 *>(p)[c];
                const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
                for (int i = 0; i < PER; ++i) out[c * PER + i] = to_f32(e[i]);
            }
            return;
        }
    } else if constexpr (BYTES == 8) {
        if (vec) {
            const uint2 u = *reinterpret_cast<const uint2 *>(p);
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (int i = 0; i < DPL; ++i) out[i] = to_f32(e[i]);
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < DPL; ++i) out[i] = to_f32(p[i]);
}

// A lane's DPL contiguous dims of a V row held as raw words (RAW: the dims fill whole 32-bit words),
// loaded with the widest aligned vector, converted when used. VPF keys are kept in flight: about 64
// registers' worth (32 keys of fp16 at head_dim 128).
template <typename T, int DPL> struct VRow {
    static constexpr int BYTES = DPL * (int)sizeof(T);
    static constexpr bool RAW = BYTES % 4 == 0;
    static constexpr int WORDS = RAW ? BYTES / 4 : 1;
    static constexpr int VEC = BYTES % 16 == 0 ? 16 : (BYTES % 8 == 0 ? 8 : 4);  // bytes per load
    static constexpr int FIT = 64 / WORDS;
    static constexpr int VPF = FIT >= 32 ? 32 : (FIT >= 16 ? 16 : 8);
    __device__ __forceinline__ static void load(const T *p, uint32_t (&w)[WORDS]) {
        if constexpr (VEC == 16) {
#pragma unroll
            for (int c = 0; c < WORDS / 4; ++c) {
                const uint4 u = reinterpret_cast<const uint4 *>(p)[c];
                w[4 * c] = u.x; w[4 * c + 1] = u.y; w[4 * c + 2] = u.z; w[4 * c + 3] = u.w;
            }
        } else if constexpr (VEC == 8) {
#pragma unroll
            for (int c = 0; c < WORDS / 2; ++c) {
                const uint2 u = reinterpret_cast<const uint2 *>(p)[c];
                w[2 * c] = u.x; w[2 * c + 1] = u.y;
            }
        } else {
#pragma unroll
            for (int c = 0; c < WORDS; ++c) w[c] = reinterpret_cast<const uint32_t *>(p)[c];
        }
    }
    __device__ __forceinline__ static void unpack(const uint32_t (&w)[WORDS], float (&out)[DPL]) {
        if constexpr (sizeof(T) == 4) {
#pragma unroll
            for (int i = 0; i < DPL; ++i) out[i] = __uint_as_float(w[i]);
        } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {  // bf16 -> f32 is a 16-bit shift
#pragma unroll
            for (int i = 0; i < DPL; ++i) out[i] = __uint_as_float(i & 1 ? w[i / 2] & 0xFFFF0000u : w[i / 2] << 16);
        } else {
#pragma unroll
            for (int i = 0; i < DPL; i += 2) {
                const float2 f = __half22float2(*reinterpret_cast<const half2 *>(&w[i / 2]));
                out[i] = f.x;
                out[i + 1] = f.y;
            }
        }
    }
};

// 16-byte K chunks a lane keeps in flight: the largest divisor of the row's chunk count up to 16, so the
// rounds tile the row exactly (head_dim 160 in fp16 is 20 chunks: two rounds of 10).
constexpr int chunks_in_flight(int chunks) {
    int k = 16;
    while (chunks % k) --k;
    return k;
}

// G: query heads per block (the chunk): heads_per_block.
template <typename T, int DPL, int G>
__global__ void __launch_bounds__(ATT_WARPS * 32) paged_attention_kernel(const AttnArgs a) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    constexpr int D = DPL * 32;
    const T *q = static_cast<const T *>(a.q);
    const T *k_pages = static_cast<const T *>(a.k_pages);
    const T *v_pages = static_cast<const T *>(a.v_pages);
    const int token = blockIdx.x, kvh = blockIdx.y;
    const int head_chunks = (a.hq / a.hkv + G - 1) / G;
    const int chunk = blockIdx.z % head_chunks, split = blockIdx.z / head_chunks;
    const int group = a.hq / a.hkv;
    const int g0 = chunk * G;
    const int gn = min(G, group - g0);
    const int lane = threadIdx.x & 31, warp = warp_index();

    __shared__ float q_s[G][D];
    __shared__ float p_s[ATT_WARPS][G][32];
    __shared__ float sm_m[ATT_WARPS][G], sm_l[ATT_WARPS][G];
    __shared__ float sm_acc[ATT_WARPS][G][D];

    // Which sequence holds this token: the last b with cu_seqlens[b] <= token.
    int lo = 0, hi = a.batch - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (a.cu_seqlens[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const int b = lo;
    const int q_len = a.cu_seqlens[b + 1] - a.cu_seqlens[b];
    const int ctx = a.context_lens[b];
    const int qpos = ctx - q_len + (token - a.cu_seqlens[b]);
    int k_end = min(qpos, ctx - 1) + 1;  // exclusive
    int k_begin = a.sliding_window > 0 ? max(0, qpos - a.sliding_window + 1) : 0;
    if (a.splits > 1) {
        // The splits share this token's actual key range, each at least min_split_keys (whole 32-key
        // tiles): short contexts in a large cache use several splits instead of one, trailing splits
        // are empty. Every block of the token computes the same boundaries.
        const int per_split = (k_end - k_begin + a.splits - 1) / a.splits;
        const int split_keys = max(a.min_split_keys, (per_split + 31) & ~31);
        const int begin = k_begin + split * split_keys;
        k_end = min(k_end, begin + split_keys);
        k_begin = begin;
    }

    // The lane's key row (page lookup) of a tile, clamped into the tile so every lane holds a real row;
    // the P.V phase gets the other keys' rows by shuffle. The first tile's lookup is issued before the
    // queries are staged, each next tile's before the current one is scored.
    const int32_t *table = a.block_table + (size_t)b * a.max_blocks;
    auto key_row_of = [&](int tile0) {
        const int jr = min(tile0 + lane, k_end - 1);
        return table[jr / a.page_size] * a.page_size + jr % a.page_size;
    };
    int next_key_row = k_begin + warp * 32 < k_end ? key_row_of(k_begin + warp * 32) : 0;

    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        q_s[g][d] = g < gn ? to_f32(q[((size_t)token * a.hq + kvh * group + g0 + g) * D + d]) * a.scale : 0.f;
    }
    for (int g = gn; g < G; ++g) p_s[warp][g][lane] = 0.f;  // heads past gn weigh nothing in P.V
    __syncthreads();

    float m_run[G], l_run[G], acc[G][DPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m_run[g] = -INFINITY;
        l_run[g] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
    }

    const size_t row_stride = (size_t)a.hkv * D;  // elements between consecutive token rows of a page
    using VR = VRow<T, DPL>;
    for (int tile0 = k_begin + warp * 32; tile0 < k_end; tile0 += ATT_WARPS * 32) {
        // Scores: lane = key.
        const int j = tile0 + lane;
        const bool valid = j < k_end;
        const int n_keys = min(32, k_end - tile0);
        const int key_row = next_key_row;
        if (tile0 + ATT_WARPS * 32 < k_end) next_key_row = key_row_of(tile0 + ATT_WARPS * 32);
        // The first VPF keys' V dims go in flight now, so their latency overlaps the K loads and scores.
        uint32_t vraw[VR::VPF][VR::WORDS];
        const bool raw_v = VR::RAW && a.vec16;
        auto load_v = [&](int jj0) {
#pragma unroll
            for (int u = 0; u < VR::VPF; ++u) {
                const int r = __shfl_sync(0xffffffffu, key_row, min(jj0 + u, n_keys - 1));
                VR::load(v_pages + (size_t)r * row_stride + (size_t)kvh * D + lane * DPL, vraw[u]);
            }
        };
        if (raw_v) load_v(0);
        float s[G];
#pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
        if (valid) {
            const T *krow = k_pages + (size_t)key_row * row_stride + (size_t)kvh * D;
            if (a.vec16) {  // 16-byte loads of the lane's key row (same summation order as below),
                            // KPF of them issued before use so their latencies overlap
                constexpr int KV = 16 / (int)sizeof(T);
                constexpr int KPF = chunks_in_flight(D / KV);
#pragma unroll 1
                for (int d0 = 0; d0 < D; d0 += KPF * KV) {
                    uint4 u[KPF];
#pragma unroll
                    for (int c = 0; c < KPF; ++c) u[c] = *reinterpret_cast<const uint4 *>(krow + d0 + c * KV);
#pragma unroll
                    for (int c = 0; c < KPF; ++c) {
                        const T *e = reinterpret_cast<const T *>(&u[c]);
#pragma unroll
                        for (int t = 0; t < KV; ++t) {
                            const float kv = to_f32(e[t]);
#pragma unroll
                            for (int g = 0; g < G; ++g) s[g] += q_s[g][d0 + c * KV + t] * kv;
                        }
                    }
                }
            } else {
#pragma unroll 4
                for (int d = 0; d < D; ++d) {
                    const float kv = to_f32(krow[d]);
#pragma unroll
                    for (int g = 0; g < G; ++g) s[g] += q_s[g][d] * kv;
                }
            }
        }
        // Online softmax over the tile, per head.
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= gn) break;
            float sv = s[g];
            if (a.softcap > 0.f) sv = tanhf(sv / a.softcap) * a.softcap;
            sv = valid ? sv : -INFINITY;
            const float m_new = fmaxf(m_run[g], warp_max(sv));
            const float corr = m_run[g] == -INFINITY ? 0.f : __expf(m_run[g] - m_new);
            const float p = valid ? __expf(sv - m_new) : 0.f;
            l_run[g] = l_run[g] * corr + warp_sum(p);
            m_run[g] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] *= corr;
            p_s[warp][g][lane] = p;
        }
        __syncwarp();
        // P.V: lane owns dims lane*DPL .. lane*DPL + DPL - 1; keys past the tile's end have p = 0.
        // Branch-free: p_s is 0 for keys past the tile's end and for heads past gn (zeroed at the start).
        auto add_pv = [&](int key, const float (&vv)[DPL]) {
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = p_s[warp][g][key];
#pragma unroll
                for (int i = 0; i < DPL; ++i) acc[g][i] += p * vv[i];
            }
        };
        if (raw_v) {
            if constexpr (VR::RAW)
            for (int jj0 = 0; jj0 < n_keys; jj0 += VR::VPF) {
                if (jj0 > 0) load_v(jj0);
#pragma unroll
                for (int u = 0; u < VR::VPF; ++u) {
                    float vv[DPL];
                    VR::unpack(vraw[u], vv);
                    add_pv(jj0 + u, vv);
                }
            }
        } else {  // rows not word-sized or not aligned: 8 keys at a time, element loads
            constexpr int VPF = 8;
            for (int jj0 = 0; jj0 < n_keys; jj0 += VPF) {
                float vv[VPF][DPL];
#pragma unroll
                for (int u = 0; u < VPF; ++u) {
                    const int r = __shfl_sync(0xffffffffu, key_row, min(jj0 + u, n_keys - 1));
                    load_lane_dims<T, DPL>(v_pages + (size_t)r * row_stride + (size_t)kvh * D + lane * DPL, vv[u], a.vec16);
                }
#pragma unroll
                for (int u = 0; u < VPF; ++u) add_pv(jj0 + u, vv[u]);
            }
        }
        __syncwarp();
    }

#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm_m[warp][g] = m_run[g]; sm_l[warp][g] = l_run[g]; }
#pragma unroll
        for (int i = 0; i < DPL; ++i) sm_acc[warp][g][lane * DPL + i] = acc[g][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < gn * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        const int head = kvh * group + g0 + g;
        float m_all = -INFINITY;
        for (int w = 0; w < ATT_WARPS; ++w) m_all = fmaxf(m_all, sm_m[w][g]);
        float l_all = 0.f, o = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w) {
            if (sm_m[w][g] == -INFINITY) continue;
            const float f = __expf(sm_m[w][g] - m_all);
            l_all += sm_l[w][g] * f;
            o += sm_acc[w][g][d] * f;
        }
        if (a.splits == 1) {
            if (a.sinks) {
                const float sink = a.sinks[head];
                const float m2 = fmaxf(m_all, sink);
                const float f = m_all == -INFINITY ? 0.f : __expf(m_all - m2);
                o *= f;
                l_all = l_all * f + __expf(sink - m2);
            }
            static_cast<T *>(a.out)[((size_t)token * a.hq + head) * D + d] = from_f32<T>(l_all > 0.f ? o / l_all : 0.f);
        } else {
            const size_t slot = ((size_t)token * a.hq + head) * a.splits + split;
            a.ws_acc[slot * D + d] = o;
            if (d == 0) { a.ws_m[slot] = m_all; a.ws_l[slot] = l_all; }
        }
    }
    if (a.splits == 1 || !a.counters) return;
    // Flash-decoding merge without a second launch: the last split of this (token, kv head, chunk) to
    // finish merges all splits and resets the counter to zero for the next call.
    __shared__ bool last_split;
    __threadfence();
    __syncthreads();
    int32_t *counter = a.counters + ((size_t)token * a.hkv + kvh) * head_chunks + chunk;
    if (threadIdx.x == 0) {
        last_split = atomicAdd(counter, 1) == a.splits - 1;
        if (last_split) *counter = 0;
    }
    __syncthreads();
    if (!last_split) return;
    __threadfence();
    for (int g = warp; g < gn; g += ATT_WARPS) merge_splits<T>(a, token, kvh * group + g0 + g, D);
}

// Merge the key splits of one (token, head) per warp (when no counters are available).
template <typename T>
__global__ void attention_merge_kernel(const AttnArgs a, int head_dim) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    merge_splits<T>(a, blockIdx.x, blockIdx.y, head_dim);
}

// Calls f with the decode kernel instance for head_dim = 32 * dpl and g query heads per block (1, 4, or
// GMAX for anything else): the one place that maps the runtime choice onto a template instance, for the
// launch and the occupancy query alike. False for an unsupported head_dim.
template <typename T, typename F> bool with_attention_kernel(int dpl, int g, F &&f) {
    auto pick = [&](auto dpl_constant) {
        constexpr int DPL = decltype(dpl_constant)::value;
        if (g == 1) f(paged_attention_kernel<T, DPL, 1>);
        else if (g == 4) f(paged_attention_kernel<T, DPL, 4>);
        else f(paged_attention_kernel<T, DPL, GMAX>);
        return true;
    };
    switch (dpl) {
        case 2: return pick(std::integral_constant<int, 2>{});
        case 3: return pick(std::integral_constant<int, 3>{});
        case 4: return pick(std::integral_constant<int, 4>{});
        case 5: return pick(std::integral_constant<int, 5>{});
        case 6: return pick(std::integral_constant<int, 6>{});
        case 8: return pick(std::integral_constant<int, 8>{});
        default: return false;
    }
}

template <typename T>
int launch_attention(const AttnArgs &a, int64_t tokens, int64_t d, int g, cudaStream_t stream) {
    dim3 grid((unsigned)tokens, (unsigned)a.hkv, (unsigned)(head_chunks_for(a.hq, a.hkv, g) * a.splits));
    const bool known = with_attention_kernel<T>((int)(d / 32), g, [&](auto kernel) {
        kernel<<<grid, ATT_WARPS * 32, 0, stream>>>(a);
    });
    if (!known) return TRELLM_E_UNSUPPORTED;
    TRELLM_LAUNCH_CHECK();
    if (a.splits > 1 && !a.counters) {
        attention_merge_kernel<T><<<dim3((unsigned)tokens, (unsigned)a.hq), 32, 0, stream>>>(a, (int)d);
        TRELLM_LAUNCH_CHECK();
    }
    return TRELLM_OK;
}

// Arrival counters of the in-kernel split merge, one zeroed buffer per device, made on the first call
// outside a graph capture (splits > 1 only when there are fewer than 4 * SMs / 2 blocks, so a few
// thousand groups always suffice). Without it (capture first, allocation failed) the merge kernel runs.
// Like the EXL3 matmul's counters: calls must not run concurrently on two streams of one device.
constexpr int64_t MERGE_COUNTERS = 4096;
constexpr int MAX_DEVICES = 64;
std::mutex merge_counters_mutex;
int32_t *merge_counters_by_device[MAX_DEVICES] = {};

int32_t *merge_counters(int64_t groups, cudaStream_t stream) {
    if (groups > MERGE_COUNTERS) return nullptr;
    int dev = -1;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= MAX_DEVICES) {
        cudaGetLastError();
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(merge_counters_mutex);
    if (merge_counters_by_device[dev]) return merge_counters_by_device[dev];
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return nullptr;
    }
    int32_t *p = nullptr;
    if (cudaMalloc(&p, MERGE_COUNTERS * sizeof(int32_t)) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
    }
    if (cudaMemsetAsync(p, 0, MERGE_COUNTERS * sizeof(int32_t), stream) != cudaSuccess) {  // ordered before the kernel
        cudaGetLastError();
        cudaFree(p);
        return nullptr;
    }
    merge_counters_by_device[dev] = p;
    return p;
}

// Fewest keys a split takes: 128 (one 32-key tile per warp); TRELLM_ATTN_SPLIT_KEYS (16..4096)
// overrides it, for tuning runs (read at each call: the split count is fixed when a graph is captured).
int64_t min_split_keys() {
    if (const char *env = getenv("TRELLM_ATTN_SPLIT_KEYS")) {
        const long v = strtol(env, nullptr, 10);
        if (v >= 16 && v <= 4096) return v;
    }
    return 128;
}

// Blocks of the decode kernel instance for (dtype, head_dim, group) that one SM holds; 0 if unknown.
template <typename T> int attention_blocks_per_sm(int dpl, int g) {
    int b = 0;
    auto occupancy = [&](auto kernel) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, ATT_WARPS * 32, 0) != cudaSuccess) {
            cudaGetLastError();
            b = 0;
        }
    };
    with_attention_kernel<T>(dpl, g, occupancy);
    return b;
}

}  // namespace

extern "C" int trellm_paged_attention_splits_for(int64_t tokens, int64_t hq, int64_t hkv, int64_t head_dim, int dtype,
                                                 int64_t page_size, int64_t max_blocks, int num_sms) {
    if (tokens <= 0 || hkv <= 0 || hq <= 0) return 1;
    const int64_t capacity = page_size * max_blocks;
    const int g = heads_per_block(tokens, hq, hkv, capacity);
    const int64_t groups = tokens * hkv * head_chunks_for(hq, hkv, g);  // blocks per split
    const int64_t sms = num_sms > 0 ? num_sms : 132;
    // No more splits than the cache's capacity fills with min_split_keys each.
    const int64_t min_keys = min_split_keys();
    int64_t max_splits = (capacity + min_keys - 1) / min_keys;
    if (max_splits > 64) max_splits = 64;
    if (max_splits < 1) max_splits = 1;
    int per_sm = 0;
    const int dpl = (int)(head_dim / 32);
    if (dpl >= 2 && dpl <= 8 && dtype >= TRELLM_F16 && dtype <= TRELLM_F32) {
        // Asked once per kernel instance (the answer does not change; this runs once per attention call).
        static int cached[3][9][3] = {};  // [dtype][dpl][G 1, 4, 8]; 0: not asked yet, -1: unknown
        int &c = cached[dtype - TRELLM_F16][dpl][g == 1 ? 0 : (g == 4 ? 1 : 2)];
        if (c == 0) {
            int b = 0;
            if (dtype == TRELLM_F16) b = attention_blocks_per_sm<half>(dpl, g);
            else if (dtype == TRELLM_BF16) b = attention_blocks_per_sm<__nv_bfloat16>(dpl, g);
            else b = attention_blocks_per_sm<float>(dpl, g);
            c = b > 0 ? b : -1;
        }
        per_sm = c;
    }
    if (per_sm < 1) {  // occupancy unknown (head size or dtype of no instance): about 4 blocks per SM
        int64_t splits = 4 * sms / groups;
        if (splits > max_splits) splits = max_splits;
        return splits < 1 ? 1 : (int)splits;
    }
    // Whole waves: the blocks run in ceil(groups * s / resident) waves of about (min_keys + capacity / s)
    // keys each (a block's fixed cost counted as one minimal split). The fewest splits with the least
    // cost win: e.g. 256 groups on 396 slots take 3 splits (2 waves of 811), not 2 (2 waves of 1152).
    const int64_t resident = sms * per_sm;
    int64_t best = 1;
    double best_cost = 1e300;
    for (int64_t s = 1; s <= max_splits; ++s) {
        const double waves_needed = (double)((groups * s + resident - 1) / resident);
        const double cost = waves_needed * ((double)min_keys + (double)capacity / (double)s);
        if (cost < best_cost * (1.0 - 1e-9)) {
            best_cost = cost;
            best = s;
        }
    }
    return (int)best;
}

extern "C" int trellm_paged_attention(const void *q, const void *k_pages, const void *v_pages,
                                      const int32_t *block_table, const int32_t *cu_seqlens,
                                      const int32_t *context_lens, const float *sinks, void *out, float *workspace,
                                      int splits, int64_t tokens, int64_t batch, int64_t hq, int64_t hkv,
                                      int64_t head_dim, int64_t page_size, int64_t max_blocks, float scale,
                                      int sliding_window, float softcap, int dtype, cudaStream_t stream) {
    if (tokens < 0 || batch <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || page_size <= 0 || max_blocks <= 0)
        return TRELLM_E_BAD_SHAPE;
    if (head_dim % 32 || head_dim < 64 || head_dim > 256 || head_dim == 224) return TRELLM_E_UNSUPPORTED;
    if (splits < 1 || (splits > 1 && !workspace)) return TRELLM_E_BAD_ARG;
    if (tokens == 0) return TRELLM_OK;
    AttnArgs a;
    a.q = q; a.k_pages = k_pages; a.v_pages = v_pages;
    a.block_table = block_table; a.cu_seqlens = cu_seqlens; a.context_lens = context_lens;
    a.sinks = sinks; a.out = out;
    const size_t slots = (size_t)tokens * hq * splits;
    a.ws_m = workspace;
    a.ws_l = workspace ? workspace + slots : nullptr;
    a.ws_acc = workspace ? workspace + 2 * slots : nullptr;
    a.batch = (int)batch; a.hq = (int)hq; a.hkv = (int)hkv; a.page_size = (int)page_size;
    a.max_blocks = (int)max_blocks; a.sliding_window = sliding_window; a.splits = splits;
    a.min_split_keys = (int)min_split_keys();
    a.scale = scale; a.softcap = softcap;
    a.vec16 = (((uintptr_t)k_pages | (uintptr_t)v_pages) & 15) == 0;  // row offsets are multiples of 64 bytes
    const int g = heads_per_block(tokens, hq, hkv, page_size * max_blocks);
    a.counters = splits > 1 ? merge_counters(tokens * hkv * head_chunks_for(hq, hkv, g), stream) : nullptr;
    TRELLM_DISPATCH_DTYPE(dtype, T, return launch_attention<T>(a, tokens, head_dim, g, stream));
    return TRELLM_OK;
}
