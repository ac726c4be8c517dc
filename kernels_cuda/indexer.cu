// The DSA lightning indexer's scores for a few tokens (decode steps, draft verification; DeepSeek V3.2 / V4, GLM 5):
// for token t of sequence b and key slot s of b's block-table row, logit = sum_h w[t, h] * relu(scale * q[t, h] . k[s]),
// -inf where t cannot see the key (s >= (pos + 1) / rate) or b has no such key (s >= key_counts[b]). The logits span
// the table's whole width, so no shape depends on the data and the step captures in a CUDA graph; torch's top-k
// finishes the selection (trellm.ops.sparse.top_visible).
//
// One block per (token, IDX_KEYS_PER_BLOCK key slots), one warp per 16 heads. A warp keeps its heads' query rows in
// registers as tensor-core A fragments and scores 8 keys per mma (m16n8k16, f32 accumulators): for the B fragment
// each lane loads 16 contiguous bytes of one key, which puts the dims of a 32-dim chunk in a lane-major order; the
// query's A fragment is loaded in the same order, and a dot product does not depend on the order of its dims. Only
// the visible keys are read, each once per token (the block's warps read the same bytes, the later ones from L1).
// relu, scale and the head weights apply to the accumulators; a shuffle tree sums a warp's 16 heads, shared memory
// the warps'. float32 keys (GLM 5.3's pooled keys) go through the tensor cores as two 16-bit parts, the key rounded
// to the query's dtype and what that rounding left (two mmas per k-step; each key element kept to ~2^-17 of itself
// with bf16 queries, ~2^-22 with f16).
#include <type_traits>

#include "common.cuh"

namespace {

constexpr int IDX_KEYS_PER_BLOCK = 128;
constexpr int IDX_TILES = 4;  // n8 key tiles per warp iteration: 32 keys, 16 bytes per lane each in flight
constexpr int IDX_MAX_WARPS = TRELLM_INDEX_MAX_HEADS / 16;

template <typename T> __device__ __forceinline__ void mma_k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                              uint32_t b1) {
    if constexpr (std::is_same_v<T, half>) mma_16816(c, a, b0, b1);
    else mma_16816_bf16(c, a, b0, b1);
}

__device__ __forceinline__ uint4 load16(const void *p) { return *reinterpret_cast<const uint4 *>(p); }

template <typename T> __device__ __forceinline__ uint32_t pack_pair(float a, float b) {
    if constexpr (std::is_same_v<T, half>) {
        const half2 h = __floats2half2_rn(a, b);
        return *reinterpret_cast<const uint32_t *>(&h);
    } else {
        const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<const uint32_t *>(&h);
    }
}

template <typename T> __device__ __forceinline__ float2 unpack_pair(uint32_t v) {
    if constexpr (std::is_same_v<T, half>) return __half22float2(*reinterpret_cast<const half2 *>(&v));
    else return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&v));
}

// One lane's 8 dims of one key in one 32-dim chunk (dims 8c .. 8c + 7), as B fragments for queries of dtype T.
template <typename T, typename K> struct KeyChunk {  // keys of the queries' dtype: one 16-byte load
    uint4 raw;
    __device__ __forceinline__ void load(const K *p) { raw = load16(p); }
    __device__ __forceinline__ void zero() { raw = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4]) const {
        mma_k16<T>(acc, a_lo, raw.x, raw.y);  // dims 8c + 0..3
        mma_k16<T>(acc, a_hi, raw.z, raw.w);  // dims 8c + 4..7
    }
};

// dims (e0, e1), (e2, e3) as T pairs: the rounded key in hi, the rounding's remainder in lo
template <typename T> __device__ __forceinline__ void split_pairs(float4 v, uint32_t &hi0, uint32_t &hi1, uint32_t &lo0,
                                                                 uint32_t &lo1) {
    hi0 = pack_pair<T>(v.x, v.y);
    hi1 = pack_pair<T>(v.z, v.w);
    const float2 r0 = unpack_pair<T>(hi0), r1 = unpack_pair<T>(hi1);
    lo0 = pack_pair<T>(v.x - r0.x, v.y - r0.y);
    lo1 = pack_pair<T>(v.z - r1.x, v.w - r1.y);
}

template <typename T> struct KeyChunk<T, float> {  // float32 keys: two 16-byte loads, two parts per k-step
    float4 first, second;
    __device__ __forceinline__ void load(const float *p) {
        first = *reinterpret_cast<const float4 *>(p);
        second = *reinterpret_cast<const float4 *>(p + 4);
    }
    __device__ __forceinline__ void zero() { first = second = make_float4(0.f, 0.f, 0.f, 0.f); }
    __device__ __forceinline__ void mma(float (&acc)[4], const uint32_t (&a_lo)[4], const uint32_t (&a_hi)[4]) const {
        uint32_t h0, h1, l0, l1;
        split_pairs<T>(first, h0, h1, l0, l1);
        mma_k16<T>(acc, a_lo, h0, h1);
        mma_k16<T>(acc, a_lo, l0, l1);
        split_pairs<T>(second, h0, h1, l0, l1);
        mma_k16<T>(acc, a_hi, h0, h1);
        mma_k16<T>(acc, a_hi, l0, l1);
    }
};

// grid (ceil(width / IDX_KEYS_PER_BLOCK), tokens), 32 * ceil(heads / 16) threads. q [tokens, heads, 32 * CHUNKS] (T),
// w float32 [tokens, heads]; keys: key slot r of page p at keys + p * page_stride + r * row_stride (K elements);
// block_table int32 [batch, table_width]; logits float32 [tokens, width], width = table_width * page_size.
template <typename T, typename K, int CHUNKS>
__global__ void __launch_bounds__(32 * IDX_MAX_WARPS)
    index_logits_kernel(const T *__restrict__ q, const float *__restrict__ w, const K *__restrict__ keys,
                        const int32_t *__restrict__ block_table, const int32_t *__restrict__ cu_seqlens,
                        const int32_t *__restrict__ key_counts, const int64_t *__restrict__ positions,
                        float *__restrict__ logits, int heads, int batch, int page_size, int64_t page_stride,
                        int64_t row_stride, int64_t table_width, int64_t width, float scale, int64_t rate) {
    constexpr int D = 32 * CHUNKS;
    constexpr int TILES = sizeof(K) == 4 ? IDX_TILES / 2 : IDX_TILES;  // float32 keys: twice the registers per key
    __shared__ float partial[IDX_MAX_WARPS][IDX_KEYS_PER_BLOCK];
    const int64_t t = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int warps = blockDim.x >> 5;

    // the token's sequence (the last b with cu_seqlens[b] <= t) and how many of its keys it sees
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    const int b = lo;
    int64_t visible = 0;
    if (t < cu_seqlens[batch]) {
        const int64_t passed = (positions[t] + 1) / rate;  // positions >= 0; a negative one sees nothing either way
        visible = max((int64_t)0, min(min((int64_t)key_counts[b], passed), width));
    }
    const int64_t first = (int64_t)blockIdx.x * IDX_KEYS_PER_BLOCK;
    const int64_t end = min(first + IDX_KEYS_PER_BLOCK, width);
    const int64_t stop = min(end, max(visible, first));  // the same for every thread: mma.sync needs whole warps

    // this warp's heads h0 (rows g) and h1 (rows g + 8); heads past the count score zero with weight zero
    const int h0 = warp * 16 + g, h1 = h0 + 8;
    uint4 qa[CHUNKS][2];
    const T *q0 = q + ((size_t)t * heads + h0) * D + 8 * c, *q1 = q + ((size_t)t * heads + h1) * D + 8 * c;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
        qa[j][0] = h0 < heads ? load16(q0 + 32 * j) : make_uint4(0, 0, 0, 0);
        qa[j][1] = h1 < heads ? load16(q1 + 32 * j) : make_uint4(0, 0, 0, 0);
    }
    const float w0 = h0 < heads ? w[t * heads + h0] : 0.f, w1 = h1 < heads ? w[t * heads + h1] : 0.f;
    const int32_t *pages = block_table + (size_t)b * table_width;

    for (int64_t base = first; base < stop; base += 8 * TILES) {
        KeyChunk<T, K> kb[TILES][CHUNKS];
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            const int64_t s = base + 8 * i + g;  // this lane's key of tile i
            if (s < stop) {
                const K *row = keys + (int64_t)pages[s / page_size] * page_stride + (s % page_size) * row_stride + 8 * c;
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) kb[i][j].load(row + 32 * j);
            } else {
#pragma unroll
                for (int j = 0; j < CHUNKS; ++j) kb[i][j].zero();
            }
        }
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < CHUNKS; ++j) {  // dims 32j + 8c + {0..3}, then 32j + 8c + {4..7}
                const uint32_t lo[4] = {qa[j][0].x, qa[j][1].x, qa[j][0].y, qa[j][1].y};
                const uint32_t hi[4] = {qa[j][0].z, qa[j][1].z, qa[j][0].w, qa[j][1].w};
                kb[i][j].mma(acc, lo, hi);
            }
            // acc: heads h0 (0, 1) and h1 (2, 3) against keys 2c and 2c + 1 of the tile
            float v0 = w0 * fmaxf(scale * acc[0], 0.f) + w1 * fmaxf(scale * acc[2], 0.f);
            float v1 = w0 * fmaxf(scale * acc[1], 0.f) + w1 * fmaxf(scale * acc[3], 0.f);
#pragma unroll
            for (int m = 4; m < 32; m <<= 1) {
                v0 += __shfl_xor_sync(0xffffffffu, v0, m);
                v1 += __shfl_xor_sync(0xffffffffu, v1, m);
            }
            const int64_t slot = base - first + 8 * i + 2 * c;
            if (g == 0 && slot < IDX_KEYS_PER_BLOCK) {
                partial[warp][slot] = v0;
                partial[warp][slot + 1] = v1;
            }
        }
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < end - first; i += blockDim.x) {
        float sum = -INFINITY;
        if (first + i < visible) {
            sum = 0.f;
            for (int k = 0; k < warps; ++k) sum += partial[k][i];
        }
        logits[t * width + first + i] = sum;
    }
}

template <typename T, typename K>
int launch_index_logits(const void *q, const float *w, const void *keys, const int32_t *block_table,
                        const int32_t *cu_seqlens, const int32_t *key_counts, const int64_t *positions, float *logits,
                        int64_t tokens, int heads, int dim, int batch, int page_size, int64_t page_stride,
                        int64_t row_stride, int64_t table_width, int64_t width, float scale, int64_t rate,
                        cudaStream_t stream) {
    const dim3 grid((unsigned)((width + IDX_KEYS_PER_BLOCK - 1) / IDX_KEYS_PER_BLOCK), (unsigned)tokens);
    const int threads = 32 * ((heads + 15) / 16);
#define TRELLM_INDEX_LAUNCH(CH)                                                                                       \
    index_logits_kernel<T, K, CH><<<grid, threads, 0, stream>>>(                                                     \
        static_cast<const T *>(q), w, static_cast<const K *>(keys), block_table, cu_seqlens, key_counts, positions,   \
        logits, heads, batch, page_size, page_stride, row_stride, table_width, width, scale, rate)
    switch (dim / 32) {
        case 1: TRELLM_INDEX_LAUNCH(1); break;
        case 2: TRELLM_INDEX_LAUNCH(2); break;
        case 3: TRELLM_INDEX_LAUNCH(3); break;
        default: TRELLM_INDEX_LAUNCH(4); break;
    }
#undef TRELLM_INDEX_LAUNCH
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_sparse_index_logits(const void *q, int dtype, const float *weights, const void *keys,
                                          int key_dtype, const int32_t *block_table, const int32_t *cu_seqlens,
                                          const int32_t *key_counts, const int64_t *positions, float *logits,
                                          int64_t tokens, int64_t heads, int64_t dim, int64_t batch,
                                          int64_t page_size, int64_t page_stride, int64_t row_stride,
                                          int64_t table_width, float scale, int64_t rate, cudaStream_t stream) {
    if ((dtype != TRELLM_F16 && dtype != TRELLM_BF16) || (key_dtype != dtype && key_dtype != TRELLM_F32))
        return TRELLM_E_BAD_DTYPE;
    if (tokens < 0 || tokens > 65535 || heads < 1 || heads > TRELLM_INDEX_MAX_HEADS || dim < 32 ||
        dim > TRELLM_INDEX_MAX_DIM || dim % 32 || batch < 1 || batch > INT32_MAX || page_size < 1 ||
        page_size > INT32_MAX || table_width < 0 || rate < 1 || page_stride < 0 || row_stride < dim ||
        page_stride % 8 || row_stride % 8)
        return TRELLM_E_BAD_SHAPE;
    if (reinterpret_cast<uintptr_t>(q) % 16 || reinterpret_cast<uintptr_t>(keys) % 16) return TRELLM_E_BAD_ARG;
    const int64_t width = table_width * page_size;
    if (tokens == 0 || width == 0) return TRELLM_OK;
    if ((width + IDX_KEYS_PER_BLOCK - 1) / IDX_KEYS_PER_BLOCK > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    auto launch = dtype == TRELLM_F16 ? (key_dtype == TRELLM_F32 ? launch_index_logits<half, float>
                                                                 : launch_index_logits<half, half>)
                                      : (key_dtype == TRELLM_F32 ? launch_index_logits<__nv_bfloat16, float>
                                                                 : launch_index_logits<__nv_bfloat16, __nv_bfloat16>);
    return launch(q, weights, keys, block_table, cu_seqlens, key_counts, positions, logits, tokens, (int)heads,
                  (int)dim, (int)batch, (int)page_size, page_stride, row_stride, table_width, width, scale, rate,
                  stream);
}
