// Quantized KV cache: quantize (optionally straight into cache rows) and dequantize (optionally a gather
// of whole pages), in the packed format of core/ops/kv_quant.py.
//
// Format, per group of 32 consecutive values of a row: y = x @ H32 * (1/sqrt(32)) (natural-order
// Sylvester Hadamard), scale = fp16(absmax(y) + 1e-10), code = clamp(floor(y / scale * half + half), 0,
// 2^bits - 1) with half = 2^(bits-1). The codes go into bit planes whose widths are the set bits of
// `bits` (8, or some of 4/2/1), most significant plane first; a plane of width w is w int32 words,
// value j's w bits at bit offset (j % (32/w)) * w of word j / (32/w).
//
// Work split: four lanes own a group, lane q holding values 8q..8q+7 (one 16-byte load of a 16-bit
// dtype). The Hadamard runs three butterfly stages in registers and two through shuffles inside the
// lane quad; absmax and the narrow planes (width 2 and 1) are OR/max-reduced the same way. A dequantize
// loop step of a warp covers 4 x 8 groups, all their loads issued before any arithmetic (bytes in flight).
//
// Bit-exactness with the torch reference on the GPU: the quantize arithmetic repeats the reference's
// float32 operations one by one (the product by 1/sqrt(32) as torch computes a division by a Python
// scalar on CUDA, an IEEE division by the scale, no fused multiply-adds). The 32-term Hadamard sums of
// fp16/bf16 inputs are exact in float32 unless the group spans more than ~19 binades, so codes and
// scales then match cuBLAS's matmul whatever its summation order. Dequantization transforms the
// half-integer codes exactly and multiplies by the scale once at the end (the reference rounds each
// term first), so it agrees with the reference to float32 rounding, not bit for bit.
#include "common.cuh"

#include <math.h>

namespace {

constexpr int KVQ_GROUP = 32;
constexpr int KVQ_LANES = 4;                        // lanes per group
constexpr int KVQ_VALS = KVQ_GROUP / KVQ_LANES;     // values per lane
constexpr int KVQ_THREADS = 256;
constexpr int KVQ_GROUPS_PER_WARP = 32 / KVQ_LANES;
// Groups per quad per loop step, loads first. Dequantize: 4 (its loads are small; 10% faster than 1 at
// 65536 x 1024 on the H200). Quantize: 1 (4 took 80 registers and measured 15% slower at 8192 x 1024).
constexpr int KVQ_DEQUANT_UNROLL = 4;
constexpr int KVQ_QUANT_UNROLL = 1;

// ---------------------------------------------------------------------------------------------
// Eight consecutive values of a row as float32 (16-byte vectors when `vec`, i.e. the base is aligned).

template <typename T>
__device__ __forceinline__ void load8(const T *__restrict__ src, bool vec, float (&v)[KVQ_VALS]) {
    if constexpr (sizeof(T) == 2) {
        if (vec) {
            uint4 raw = __ldg(reinterpret_cast<const uint4 *>(src));
            const T *e = reinterpret_cast<const T *>(&raw);
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) v[i] = to_f32(e[i]);
            return;
        }
    } else {
        if (vec) {
            float4 a = __ldg(reinterpret_cast<const float4 *>(src));
            float4 b = __ldg(reinterpret_cast<const float4 *>(src) + 1);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
            v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < KVQ_VALS; ++i) v[i] = to_f32(src[i]);
}

template <typename T>
__device__ __forceinline__ void store8(T *__restrict__ dst, bool vec, const float (&v)[KVQ_VALS]) {
    if constexpr (sizeof(T) == 2) {
        if (vec) {
            uint4 raw;
            T *e = reinterpret_cast<T *>(&raw);
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) e[i] = from_f32<T>(v[i]);
            *reinterpret_cast<uint4 *>(dst) = raw;
            return;
        }
    } else {
        if (vec) {
            reinterpret_cast<float4 *>(dst)[0] = make_float4(v[0], v[1], v[2], v[3]);
            reinterpret_cast<float4 *>(dst)[1] = make_float4(v[4], v[5], v[6], v[7]);
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < KVQ_VALS; ++i) dst[i] = from_f32<T>(v[i]);
}

// y = x @ H32 over the quad's 32 values (unnormalised; H32 symmetric, so also H32 @ x).
__device__ __forceinline__ void quad_hadamard_32(float (&v)[KVQ_VALS], int q) {
#pragma unroll
    for (int d = 1; d < KVQ_VALS; d <<= 1) {
#pragma unroll
        for (int i = 0; i < KVQ_VALS; ++i) {
            if (i & d) continue;
            const float a = v[i], b = v[i + d];
            v[i] = __fadd_rn(a, b);
            v[i + d] = __fsub_rn(a, b);
        }
    }
#pragma unroll
    for (int d = 1; d < KVQ_LANES; d <<= 1) {
        const bool upper = q & d;
#pragma unroll
        for (int i = 0; i < KVQ_VALS; ++i) {
            const float other = __shfl_xor_sync(0xffffffffu, v[i], d);
            v[i] = upper ? __fsub_rn(other, v[i]) : __fadd_rn(v[i], other);
        }
    }
}

// max that propagates NaN like torch.amax
__device__ __forceinline__ float nan_max(float a, float b) { return (a > b || a != a) ? a : b; }

// Bit planes of BITS: the plane of width W exists iff BITS & W. Its words follow those of the wider planes
// (word offset BITS & ~(2W - 1)) and it holds code bits [shift, shift + W), shift = BITS & (W - 1) being
// the width of the narrower planes. A lane fills W/4 whole words of a plane of width >= 4 and a share of
// one word of a narrower plane.
template <int W> constexpr int kv_lane_words() { return W >= 4 ? W / 4 : 1; }

// Pack the lane's 8 codes into plane W and write the plane's words of this group (OR-reduced across the
// quad when W < 4). Every lane of the warp must call it (shuffles); only `active` lanes store.
template <int BITS, int W>
__device__ __forceinline__ void pack_plane(const uint32_t (&codes)[KVQ_VALS], int q, bool active,
                                           int32_t *__restrict__ group_words) {
    if constexpr ((BITS & W) != 0) {
        constexpr int word_offset = BITS & ~(2 * W - 1), shift = BITS & (W - 1), lane_words = kv_lane_words<W>();
        constexpr uint32_t mask = (1u << W) - 1u;
        uint32_t part[lane_words];
#pragma unroll
        for (int k = 0; k < lane_words; ++k) part[k] = 0u;
        const int base_bit = W >= 4 ? 0 : (KVQ_VALS * q * W) & 31;
#pragma unroll
        for (int i = 0; i < KVQ_VALS; ++i) {
            const uint32_t val = (codes[i] >> shift) & mask;
            part[(i * W) >> 5] |= val << (base_bit + ((i * W) & 31));
        }
        if constexpr (W < 4) {
#pragma unroll
            for (int d = 1; d < 4 / W; d <<= 1) part[0] |= __shfl_xor_sync(0xffffffffu, part[0], d);
        }
        if (!active) return;
        if constexpr (W >= 4) {
#pragma unroll
            for (int k = 0; k < lane_words; ++k) group_words[word_offset + q * lane_words + k] = (int32_t)part[k];
        } else {
            if ((q & (4 / W - 1)) == 0) group_words[word_offset + (q * W) / 4] = (int32_t)part[0];
        }
    }
}

// The words of the group a lane needs, plane by plane (widest first): W/4 words of a plane of width >= 4,
// the one shared word of a narrower plane.
template <int BITS> constexpr int kv_lane_word_count() {
    return ((BITS & 8) ? 2 : 0) + ((BITS & 4) ? 1 : 0) + ((BITS & 2) ? 1 : 0) + (BITS & 1);
}

template <int BITS, int W> constexpr int kv_lane_word_offset() {  // first slot of plane W in the lane's words
    return ((W < 8 && (BITS & 8)) ? 2 : 0) + ((W < 4 && (BITS & 4)) ? 1 : 0) + ((W < 2 && (BITS & 2)) ? 1 : 0);
}

template <int BITS, int W>
__device__ __forceinline__ void load_plane(const int32_t *__restrict__ group_words, int q,
                                           uint32_t (&words)[kv_lane_word_count<BITS>()]) {
    if constexpr ((BITS & W) != 0) {
        constexpr int word_offset = BITS & ~(2 * W - 1), lane_words = kv_lane_words<W>();
        const int first = W >= 4 ? q * lane_words : (q * W) / 4;
#pragma unroll
        for (int k = 0; k < lane_words; ++k)
            words[kv_lane_word_offset<BITS, W>() + k] = (uint32_t)__ldg(group_words + word_offset + first + k);
    }
}

template <int BITS, int W>
__device__ __forceinline__ void decode_plane(const uint32_t (&words)[kv_lane_word_count<BITS>()], int q,
                                             uint32_t (&codes)[KVQ_VALS]) {
    if constexpr ((BITS & W) != 0) {
        constexpr int shift = BITS & (W - 1), slot = kv_lane_word_offset<BITS, W>();
        constexpr uint32_t mask = (1u << W) - 1u;
        const int base_bit = W >= 4 ? 0 : (KVQ_VALS * q * W) & 31;
#pragma unroll
        for (int i = 0; i < KVQ_VALS; ++i) {
            const uint32_t val = (words[slot + ((i * W) >> 5)] >> (base_bit + ((i * W) & 31))) & mask;
            codes[i] |= val << shift;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantize: x [tokens, dim] -> packed int32 [out_rows, groups*BITS], scales fp16 [out_rows, groups],
// token t to row slots[t] (or t). A warp handles KVQ_QUANT_UNROLL x 8 consecutive groups per step (grid-stride).

template <typename T, int BITS>
__global__ void __launch_bounds__(KVQ_THREADS) kv_quantize_kernel(
    const T *__restrict__ x, int32_t *__restrict__ packed, half *__restrict__ scales, const int64_t *__restrict__ slots,
    int64_t tokens, int64_t groups_per_row, int64_t out_rows, bool vec) {
    constexpr float kHalf = (float)(1 << (BITS - 1));
    constexpr float kMaxCode = (float)((1 << BITS) - 1);
    const float inv_sqrt_group = 1.0f / 5.656854249492381f;  // torch: x / 5.65.. on CUDA is x * (1 / 5.65..f)
    const int lane = threadIdx.x & 31, q = lane & (KVQ_LANES - 1);
    const int64_t total = tokens * groups_per_row;
    const int64_t warp = (int64_t)blockIdx.x * (KVQ_THREADS / 32) + warp_index();  // warp-uniform: see warp_index
    const int64_t warp_stride = ((int64_t)gridDim.x * KVQ_THREADS) >> 5;
    constexpr int64_t kStep = KVQ_GROUPS_PER_WARP * KVQ_QUANT_UNROLL;
    for (int64_t first = warp * kStep; first < total; first += warp_stride * kStep) {
        // Issue every load of the step first (KVQ_QUANT_UNROLL groups per quad).
        float v[KVQ_QUANT_UNROLL][KVQ_VALS];
        int64_t row[KVQ_QUANT_UNROLL], gi[KVQ_QUANT_UNROLL];
        bool active[KVQ_QUANT_UNROLL];
#pragma unroll
        for (int u = 0; u < KVQ_QUANT_UNROLL; ++u) {
            const int64_t group = first + u * KVQ_GROUPS_PER_WARP + lane / KVQ_LANES;
            active[u] = group < total;
            const int64_t token = active[u] ? group / groups_per_row : 0;
            gi[u] = active[u] ? group - token * groups_per_row : 0;
            row[u] = (slots != nullptr && active[u]) ? slots[token] : token;
            if (active[u]) {
                load8(x + group * KVQ_GROUP + q * KVQ_VALS, vec, v[u]);
            } else {
#pragma unroll
                for (int i = 0; i < KVQ_VALS; ++i) v[u][i] = 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < KVQ_QUANT_UNROLL; ++u) {
            quad_hadamard_32(v[u], q);
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) {
                v[u][i] = __fmul_rn(v[u][i], inv_sqrt_group);
                amax = nan_max(amax, fabsf(v[u][i]));
            }
#pragma unroll
            for (int d = 1; d < KVQ_LANES; d <<= 1) amax = nan_max(amax, __shfl_xor_sync(0xffffffffu, amax, d));
            const half scale16 = __float2half_rn(__fadd_rn(amax, 1e-10f));
            const float scale = __half2float(scale16);
            uint32_t codes[KVQ_VALS];
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) {
                const float f = floorf(__fadd_rn(__fmul_rn(__fdiv_rn(v[u][i], scale), kHalf), kHalf));
                // torch: clamp keeps NaN (0/0 of an all-zero group), whose integer cast has zero low bits.
                codes[i] = f != f ? 0u : (uint32_t)fminf(fmaxf(f, 0.f), kMaxCode);
            }
            const bool store = active[u] && row[u] >= 0 && row[u] < out_rows;
            int32_t *group_words = packed + (row[u] * groups_per_row + gi[u]) * BITS;
            pack_plane<BITS, 8>(codes, q, store, group_words);
            pack_plane<BITS, 4>(codes, q, store, group_words);
            pack_plane<BITS, 2>(codes, q, store, group_words);
            pack_plane<BITS, 1>(codes, q, store, group_words);
            if (store && q == 0) scales[row[u] * groups_per_row + gi[u]] = scale16;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantize: out [rows, dim]; output row r reads source row pages[r / page_size] * page_size + r % page_size
// (or r). Rows whose source falls outside [0, src_rows) come out zero.

template <typename T, int BITS>
__global__ void __launch_bounds__(KVQ_THREADS) kv_dequantize_kernel(
    const int32_t *__restrict__ packed, const half *__restrict__ scales, const int64_t *__restrict__ pages,
    int64_t page_size, int64_t src_rows, T *__restrict__ out, int64_t rows, int64_t groups_per_row, bool vec) {
    constexpr float kOffset = (float)(1 << (BITS - 1)) - 0.5f;
    // torch: scales / (sqrt(32) * half) on CUDA is scales * (1 / float(sqrt(32) * half))
    const float inv_norm = 1.0f / (float)(5.656854249492381 * (double)(1 << (BITS - 1)));
    const int lane = threadIdx.x & 31, q = lane & (KVQ_LANES - 1);
    const int64_t total = rows * groups_per_row;
    const int64_t warp = (int64_t)blockIdx.x * (KVQ_THREADS / 32) + warp_index();  // warp-uniform: see warp_index
    const int64_t warp_stride = ((int64_t)gridDim.x * KVQ_THREADS) >> 5;
    constexpr int64_t kStep = KVQ_GROUPS_PER_WARP * KVQ_DEQUANT_UNROLL;
    for (int64_t first = warp * kStep; first < total; first += warp_stride * kStep) {
        // Issue every load of the step first (KVQ_DEQUANT_UNROLL groups per quad) so more bytes are in flight.
        uint32_t words[KVQ_DEQUANT_UNROLL][kv_lane_word_count<BITS>()];
        float factor[KVQ_DEQUANT_UNROLL];
#pragma unroll
        for (int u = 0; u < KVQ_DEQUANT_UNROLL; ++u) {
            const int64_t group = first + u * KVQ_GROUPS_PER_WARP + lane / KVQ_LANES;
            const bool active = group < total;
            const int64_t row = active ? group / groups_per_row : 0;
            const int64_t gi = active ? group - row * groups_per_row : 0;
            int64_t src = row;
            if (pages != nullptr && active) {
                const int64_t page = row / page_size;
                src = pages[page] * page_size + (row - page * page_size);
            }
            factor[u] = 0.f;  // absent rows (past the end, or a page outside the cache) decode to zeros
#pragma unroll
            for (int k = 0; k < kv_lane_word_count<BITS>(); ++k) words[u][k] = 0u;
            if (active && src >= 0 && src < src_rows) {
                const int64_t src_group = src * groups_per_row + gi;
                const int32_t *group_words = packed + src_group * BITS;
                load_plane<BITS, 8>(group_words, q, words[u]);
                load_plane<BITS, 4>(group_words, q, words[u]);
                load_plane<BITS, 2>(group_words, q, words[u]);
                load_plane<BITS, 1>(group_words, q, words[u]);
                factor[u] = __fmul_rn(__half2float(__ldg(scales + src_group)), inv_norm);
            }
        }
#pragma unroll
        for (int u = 0; u < KVQ_DEQUANT_UNROLL; ++u) {
            uint32_t codes[KVQ_VALS];
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) codes[i] = 0u;
            decode_plane<BITS, 8>(words[u], q, codes);
            decode_plane<BITS, 4>(words[u], q, codes);
            decode_plane<BITS, 2>(words[u], q, codes);
            decode_plane<BITS, 1>(words[u], q, codes);
            float v[KVQ_VALS];
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) v[i] = (float)codes[i] - kOffset;  // half-integers: exact
            quad_hadamard_32(v, q);  // exact: sums of at most 32 half-integers below 128
#pragma unroll
            for (int i = 0; i < KVQ_VALS; ++i) v[i] = __fmul_rn(v[i], factor[u]);
            const int64_t group = first + u * KVQ_GROUPS_PER_WARP + lane / KVQ_LANES;
            if (group < total) store8(out + group * KVQ_GROUP + q * KVQ_VALS, vec, v);
        }
    }
}

int kvq_blocks(int64_t groups, int unroll) {
    const int64_t groups_per_block = KVQ_THREADS / KVQ_LANES * unroll;
    const int64_t blocks = (groups + groups_per_block - 1) / groups_per_block;
    return (int)(blocks < 65536 ? blocks : 65536);  // the kernels stride over the rest
}

#define TRELLM_DISPATCH_KV_BITS(bits, B, ...)           \
    switch (bits) {                                     \
        case 2: { constexpr int B = 2; __VA_ARGS__; break; } \
        case 3: { constexpr int B = 3; __VA_ARGS__; break; } \
        case 4: { constexpr int B = 4; __VA_ARGS__; break; } \
        case 5: { constexpr int B = 5; __VA_ARGS__; break; } \
        case 6: { constexpr int B = 6; __VA_ARGS__; break; } \
        case 7: { constexpr int B = 7; __VA_ARGS__; break; } \
        case 8: { constexpr int B = 8; __VA_ARGS__; break; } \
        default: return TRELLM_E_BAD_ARG;               \
    }

}  // namespace

extern "C" int trellm_kv_quantize(const void *x, int dtype, int32_t *packed, void *scales, const int64_t *slots,
                                  int64_t tokens, int64_t dim, int64_t out_rows, int bits, cudaStream_t stream) {
    if (tokens < 0 || dim <= 0 || dim % KVQ_GROUP || out_rows < 0) return TRELLM_E_BAD_SHAPE;
    if (bits < 2 || bits > 8) return TRELLM_E_BAD_ARG;
    if (!slots && out_rows < tokens) return TRELLM_E_BAD_SHAPE;
    if (dtype < TRELLM_F16 || dtype > TRELLM_F32) return TRELLM_E_BAD_DTYPE;
    if (tokens == 0) return TRELLM_OK;
    const int64_t groups_per_row = dim / KVQ_GROUP;
    const bool vec = (uintptr_t)x % 16 == 0;
    const int blocks = kvq_blocks(tokens * groups_per_row, KVQ_QUANT_UNROLL);
    TRELLM_DISPATCH_DTYPE(dtype, T,
        TRELLM_DISPATCH_KV_BITS(bits, B,
            kv_quantize_kernel<T, B><<<blocks, KVQ_THREADS, 0, stream>>>(
                static_cast<const T *>(x), packed, static_cast<half *>(scales), slots, tokens, groups_per_row,
                out_rows, vec)));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_kv_dequantize(const int32_t *packed, const void *scales, const int64_t *pages,
                                    int64_t page_size, int64_t src_rows, void *out, int dtype, int64_t rows,
                                    int64_t dim, int bits, cudaStream_t stream) {
    if (rows < 0 || dim <= 0 || dim % KVQ_GROUP || src_rows < 0) return TRELLM_E_BAD_SHAPE;
    if (bits < 2 || bits > 8) return TRELLM_E_BAD_ARG;
    if (pages && (page_size <= 0 || rows % page_size)) return TRELLM_E_BAD_SHAPE;
    if (!pages && src_rows < rows) return TRELLM_E_BAD_SHAPE;
    if (dtype < TRELLM_F16 || dtype > TRELLM_F32) return TRELLM_E_BAD_DTYPE;
    if (rows == 0) return TRELLM_OK;
    const int64_t groups_per_row = dim / KVQ_GROUP;
    const bool vec = (uintptr_t)out % 16 == 0;
    const int blocks = kvq_blocks(rows * groups_per_row, KVQ_DEQUANT_UNROLL);
    TRELLM_DISPATCH_DTYPE(dtype, T,
        TRELLM_DISPATCH_KV_BITS(bits, B,
            kv_dequantize_kernel<T, B><<<blocks, KVQ_THREADS, 0, stream>>>(
                packed, static_cast<const half *>(scales), pages, page_size, src_rows, static_cast<T *>(out), rows,
                groups_per_row, vec)));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}
