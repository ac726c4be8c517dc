// Shared device helpers: dtype conversion, launch checks, the 128-point warp Hadamard, EXL3 codebooks.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "trellm_kernels.h"

#define TRELLM_LAUNCH_CHECK()                          \
    do {                                               \
        cudaError_t err_ = cudaGetLastError();         \
        if (err_ != cudaSuccess) return (int)err_;     \
    } while (0)

// ---------------------------------------------------------------------------------------------
// dtype helpers

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<half>(half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ half from_f32<half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }

// Element i of a run-time-typed buffer (TRELLM_F16 / TRELLM_BF16 / TRELLM_F32) as float, and back.
__device__ __forceinline__ float load_as_f32(const void *p, int dtype, size_t i) {
    if (dtype == TRELLM_F16) return __half2float(static_cast<const half *>(p)[i]);
    if (dtype == TRELLM_BF16) return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
    return static_cast<const float *>(p)[i];
}

// Elements i..i+3 (i a multiple of 4) as float: one 8-byte load for 16-bit dtypes, 16 bytes for f32.
// The buffer must be aligned to 4 elements (the EXL3 binding checks it).
__device__ __forceinline__ void load4_as_f32(const void *p, int dtype, size_t i, float (&v)[4]) {
    if (dtype == TRELLM_F32) {
        const float4 f = *reinterpret_cast<const float4 *>(static_cast<const float *>(p) + i);
        v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
        return;
    }
    const uint2 raw = *reinterpret_cast<const uint2 *>(static_cast<const uint16_t *>(p) + i);
    if (dtype == TRELLM_F16) {
        const float2 a = __half22float2(*reinterpret_cast<const half2 *>(&raw.x));
        const float2 b = __half22float2(*reinterpret_cast<const half2 *>(&raw.y));
        v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
    } else {
        v[0] = __uint_as_float(raw.x << 16); v[1] = __uint_as_float(raw.x & 0xFFFF0000u);
        v[2] = __uint_as_float(raw.y << 16); v[3] = __uint_as_float(raw.y & 0xFFFF0000u);
    }
}

__device__ __forceinline__ void store_from_f32(void *p, int dtype, size_t i, float v) {
    if (dtype == TRELLM_F16) static_cast<half *>(p)[i] = __float2half_rn(v);
    else if (dtype == TRELLM_BF16) static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn(v);
    else static_cast<float *>(p)[i] = v;
}

// v rounded to a run-time dtype and back: where a fused kernel must match the unfused ops' rounding.
__device__ __forceinline__ float round_as(float v, int dtype) {
    if (dtype == TRELLM_F16) return __half2float(__float2half_rn(v));
    if (dtype == TRELLM_BF16) return __bfloat162float(__float2bfloat16_rn(v));
    return v;
}

// The gated activations' act(g) (TRELLM_ACT_*), in float.
__device__ __forceinline__ float apply_act(float g, int act) {
    switch (act) {
        case TRELLM_ACT_SILU: return g / (1.f + expf(-g));
        case TRELLM_ACT_GELU: return 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
        case TRELLM_ACT_GELU_TANH: {
            const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
            return 0.5f * g * (1.f + tanhf(inner));
        }
        case TRELLM_ACT_RELU: return fmaxf(g, 0.f);
        default: { const float r = fmaxf(g, 0.f); return r * r; }
    }
}

// Calls F.template operator()<T>() with T the C type of a dtype code; returns TRELLM_E_BAD_DTYPE otherwise.
#define TRELLM_DISPATCH_DTYPE(code, T, ...)                              \
    switch (code) {                                                      \
        case TRELLM_F16: { typedef half T; __VA_ARGS__; break; }         \
        case TRELLM_BF16: { typedef __nv_bfloat16 T; __VA_ARGS__; break; } \
        case TRELLM_F32: { typedef float T; __VA_ARGS__; break; }        \
        default: return TRELLM_E_BAD_DTYPE;                              \
    }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// ---------------------------------------------------------------------------------------------
// 128-point natural-order Sylvester Hadamard over one warp: lane l holds elements 4l..4l+3.
// In-register butterflies for index bits 0-1, shuffles for bits 2-6; scaled by 1/sqrt(128).

__device__ __forceinline__ void warp_hadamard_128(float v[4]) {
    float a0 = v[0] + v[1], a1 = v[0] - v[1], a2 = v[2] + v[3], a3 = v[2] - v[3];
    v[0] = a0 + a2; v[1] = a1 + a3; v[2] = a0 - a2; v[3] = a1 - a3;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const bool upper = lane & d;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float other = __shfl_xor_sync(0xffffffffu, v[i], d);
            v[i] = upper ? other - v[i] : v[i] + other;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] *= 0.08838834764831845f;
}

// ---------------------------------------------------------------------------------------------
// EXL3 codebooks (shared/exl3_format.md section 2.4). decode_pair turns two 16-bit states into the
// half2 (decode(a), decode(b)).

// Each codebook's hash is s * mult + add (mod 2^32). (Template id 3, MUL1 on the GEMV's split route, hashes as MUL1.)
template <int CB> constexpr uint32_t cb_mult = CB == TRELLM_CB_3INST ? 89226354u : (CB == TRELLM_CB_MCG ? 0xCBAC1FEDu : 0x83DCD12Du);
template <int CB> constexpr uint32_t cb_add = CB == TRELLM_CB_3INST ? 64248484u : 0u;

template <int CB> __device__ __forceinline__ uint32_t cb_hash(uint32_t s) { return s * cb_mult<CB> + cb_add<CB>; }

// (a & b) ^ c in ONE lop3 (immLut 0x6A). Written in PTX with the constants in registers: left to
// itself the compiler emits two LOP3s with an immediate each, an eighth of the GEMV's integer work.
__device__ __forceinline__ uint32_t lop3_and_xor(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// cb_hash of both 16-bit states packed in w (low half, high half), without masking the low one:
// hash(lo) = w*C - hi*(C << 16) (+ the 3INST offset). The two multiply-adds run on the FMA pipe
// instead of a mask on the integer ALU, which the GEMV's decode saturates (state extraction, the
// codebook's mask/xor). In PTX so the compiler does not fold it back into (w & 0xFFFF) * C.
__device__ __forceinline__ uint32_t mad_lo(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
template <int CB> __device__ __forceinline__ void cb_hash_packed(uint32_t w, uint32_t &h_lo, uint32_t &h_hi) {
    const uint32_t hi = w >> 16;
    h_hi = cb_hash<CB>(hi);
    h_lo = mad_lo(hi, 0u - (cb_mult<CB> << 16), mad_lo(w, cb_mult<CB>, cb_add<CB>));
}

// Half2 (decode(a), decode(b)) from the codebook hashes of two states.
template <int CB> __device__ __forceinline__ half2 decode_hashed_pair(uint32_t ha, uint32_t hb) {
    static_assert(CB <= TRELLM_CB_MUL1, "a format codebook (MUL1's split route decodes in tile_fragments_split)");
    if constexpr (CB == TRELLM_CB_MUL1) {
        // 0x6400 + byte sum of the hash = fp16(1024 + s); then fp16 fma with k_inv, k_bias.
        ha = __dp4a(ha, 0x01010101u, 0x6400u);
        hb = __dp4a(hb, 0x01010101u, 0x6400u);
        uint32_t packed = __byte_perm(ha, hb, 0x5410);
        const half2 k_inv = __halves2half2(__ushort_as_half(0x1EEE), __ushort_as_half(0x1EEE));
        const half2 k_bias = __halves2half2(__ushort_as_half(0xC931), __ushort_as_half(0xC931));
        return __hfma2(*reinterpret_cast<half2 *>(&packed), k_inv, k_bias);
    } else {
        uint32_t xa = lop3_and_xor(ha, 0x8FFF8FFFu, 0x3B603B60u);
        uint32_t xb = lop3_and_xor(hb, 0x8FFF8FFFu, 0x3B603B60u);
        uint32_t lo = __byte_perm(xa, xb, 0x5410);
        uint32_t hi = __byte_perm(xa, xb, 0x7632);
        return __hadd2(*reinterpret_cast<half2 *>(&lo), *reinterpret_cast<half2 *>(&hi));
    }
}

template <int CB> __device__ __forceinline__ half2 decode_pair(uint32_t a, uint32_t b) {
    return decode_hashed_pair<CB>(cb_hash<CB>(a), cb_hash<CB>(b));
}

template <int CB> __device__ __forceinline__ half decode_one(uint32_t s) {
    return __low2half(decode_pair<CB>(s & 0xFFFFu, 0u));
}

// ---------------------------------------------------------------------------------------------
// Trellis tile reading. Tile words w[0..8K) are the little-endian uint32 view of the 16*K int16;
// the stream is MSB-first per word. Lane t decodes positions 8t..8t+7: the 16-bit windows ending at
// stream bits (8t+e+1)*K. It needs stream bits [8tK + K - 16, 8tK + 8K) (circular).

template <int K> struct TileGeom {
    static constexpr int L = 256 * K;                 // bits per tile
    static constexpr int WORDS = 8 * K;               // uint32 words per tile
    static constexpr int NEED = 7 * K + 16;           // bits a lane needs
    static constexpr bool R_CONST = (K % 4) == 0;     // start offset inside a word is lane-independent
    static constexpr int R_FIXED = ((K - 16) % 32 + 32) % 32;
    static constexpr int R_MAX = R_CONST ? R_FIXED : 31;
    static constexpr int NW = (R_MAX + NEED + 31) / 32;  // raw words to load
    static constexpr int NN = (NEED + 31) / 32;          // normalised words
};

// Word index of the lane's first word and its bit offset.
template <int K> __device__ __forceinline__ void lane_window(int lane, int &w0, int &r) {
    using G = TileGeom<K>;
    int s = 8 * lane * K + K - 16;
    if (s < 0) s += G::L;
    w0 = s >> 5;
    r = G::R_CONST ? G::R_FIXED : (s & 31);
}

// Load the lane's raw words of one tile (tile = pointer to its first uint32 word).
template <int K> __device__ __forceinline__ void load_lane_words(const uint32_t *__restrict__ tile, int w0,
                                                                 uint32_t (&raw)[TileGeom<K>::NW]) {
    using G = TileGeom<K>;
#pragma unroll
    for (int q = 0; q < G::NW; ++q) {
        int idx = w0 + q;
        if (idx >= G::WORDS) idx -= G::WORDS;
        raw[q] = __ldg(tile + idx);
    }
}

// 16-bit field starting at bit B (MSB-first) of the normalised stream n[0..NN).
template <int B, int NN> __device__ __forceinline__ uint32_t field16(const uint32_t (&n)[NN]) {
    constexpr int wi = B / 32, off = B % 32;
    if constexpr (off + 16 <= 32) {
        return (n[wi] >> (16 - off)) & 0xFFFFu;
    } else {
        // spans n[wi] (low 32-off bits) and n[wi+1]
        return __funnelshift_r(n[wi + 1], n[wi], 48 - off) & 0xFFFFu;
    }
}

// Bits [SHIFT, SHIFT + 16) of the 64-bit value (hi:lo), as a state.
template <int SHIFT> __device__ __forceinline__ uint32_t bits16(uint32_t hi, uint32_t lo) {
    if constexpr (SHIFT == 0) return lo & 0xFFFFu;
    else if constexpr (SHIFT == 8) return __byte_perm(lo, 0u, 0x4421);   // bytes 1-2 of lo, zero above
    else if constexpr (SHIFT == 16) return lo >> 16;
    else if constexpr (SHIFT < 16) return (lo >> SHIFT) & 0xFFFFu;
    else return __funnelshift_r(lo, hi, SHIFT) & 0xFFFFu;
}

// The eight states of lane positions 8t..8t+7 from its raw words.
template <int K> __device__ __forceinline__ void lane_states(const uint32_t (&raw)[TileGeom<K>::NW], int r,
                                                            uint32_t (&st)[8]) {
    using G = TileGeom<K>;
    if constexpr (K == 4) {
        // The lane's 44 bits end at the last bit of raw[1]: state e is (raw[0]:raw[1]) >> (28 - 4e).
        // Byte-aligned states take one byte_perm/shift; the others come from raw[1:0] >> 4.
        const uint32_t lo = raw[1], hi = raw[0];
        const uint32_t lo4 = __funnelshift_r(lo, hi, 4);
        st[7] = bits16<0>(hi, lo);
        st[6] = lo4 & 0xFFFFu;
        st[5] = bits16<8>(hi, lo);
        st[4] = __byte_perm(lo4, 0u, 0x4421);
        st[3] = bits16<16>(hi, lo);
        st[2] = lo4 >> 16;
        st[1] = bits16<24>(hi, lo);
        st[0] = bits16<28>(hi, lo);
    } else if constexpr (K == 2) {
        // 30 bits: state e is (v >> (16 - 2e)) & 0xFFFF of the normalised word v. With v >> 2, 4, 6 every
        // state is a byte-aligned 16-bit field of one of four words: one byte_perm or mask each.
        const uint32_t v = __funnelshift_l(raw[1], raw[0], r);
        const uint32_t v2 = v >> 2, v4 = v >> 4, v6 = v >> 6;
        st[0] = v >> 16;
        st[1] = __byte_perm(v6, 0u, 0x4421);
        st[2] = __byte_perm(v4, 0u, 0x4421);
        st[3] = __byte_perm(v2, 0u, 0x4421);
        st[4] = __byte_perm(v, 0u, 0x4421);
        st[5] = v6 & 0xFFFFu;
        st[6] = v4 & 0xFFFFu;
        st[7] = v2 & 0xFFFFu;
    } else if constexpr (K == 8) {
        // 72 bits ending at the last bit of raw[2]: state e is (raw[0]:raw[1]:raw[2]) >> (56 - 8e).
        st[0] = bits16<24>(raw[0], raw[1]);
        st[1] = bits16<16>(raw[0], raw[1]);
        st[2] = bits16<8>(raw[0], raw[1]);
        st[3] = bits16<0>(raw[0], raw[1]);
        st[4] = bits16<24>(raw[1], raw[2]);
        st[5] = bits16<16>(raw[1], raw[2]);
        st[6] = bits16<8>(raw[1], raw[2]);
        st[7] = bits16<0>(raw[1], raw[2]);
    } else {
        uint32_t n[G::NN];
#pragma unroll
        for (int q = 0; q < G::NN; ++q) {
            uint32_t hi = raw[q];
            uint32_t lo = (q + 1 < G::NW) ? raw[q + 1] : 0u;
            if constexpr (G::R_CONST) n[q] = G::R_FIXED ? ((hi << G::R_FIXED) | (lo >> (32 - G::R_FIXED))) : hi;
            else n[q] = __funnelshift_l(lo, hi, r);
        }
        st[0] = field16<0 * K, G::NN>(n);
        st[1] = field16<1 * K, G::NN>(n);
        st[2] = field16<2 * K, G::NN>(n);
        st[3] = field16<3 * K, G::NN>(n);
        st[4] = field16<4 * K, G::NN>(n);
        st[5] = field16<5 * K, G::NN>(n);
        st[6] = field16<6 * K, G::NN>(n);
        st[7] = field16<7 * K, G::NN>(n);
    }
}

// The codebook hashes of the lane's eight states (cb_hash of lane_states). For K = 4 and 8, the lane's
// 32-bit windows at 4 or 8 shifts each hold two states 16 bits apart, hashed as a pair (cb_hash_packed):
// K = 4 takes 7 integer-ALU ops per 8 states instead of 11, K = 8 takes 6 instead of 10.
#ifndef TRELLM_GEMV_PACKED_HASH
#define TRELLM_GEMV_PACKED_HASH 1  // 0: hash each extracted state (the A/B baseline)
#endif
template <int K, int CB> __device__ __forceinline__ void lane_hashes(const uint32_t (&raw)[TileGeom<K>::NW], int r,
                                                                    uint32_t (&h)[8]) {
    if constexpr (K == 4 && TRELLM_GEMV_PACKED_HASH) {
        // state e is (raw[0]:raw[1]) >> (28 - 4e): windows at shifts 0/4/8/12 hold (7, 3) (6, 2) (5, 1) (4, 0).
        const uint32_t lo = raw[1], hi = raw[0];
        cb_hash_packed<CB>(lo, h[7], h[3]);
        cb_hash_packed<CB>(__funnelshift_r(lo, hi, 4), h[6], h[2]);
        cb_hash_packed<CB>(__funnelshift_r(lo, hi, 8), h[5], h[1]);
        cb_hash_packed<CB>(__funnelshift_r(lo, hi, 12), h[4], h[0]);
    } else if constexpr (K == 8 && TRELLM_GEMV_PACKED_HASH) {
        // state e is (raw[0]:raw[1]:raw[2]) >> (56 - 8e): raw[2] holds (7, 5), raw[1] (3, 1), and the windows
        // 8 bits up hold (6, 4) and (2, 0).
        cb_hash_packed<CB>(raw[2], h[7], h[5]);
        cb_hash_packed<CB>(__funnelshift_r(raw[2], raw[1], 8), h[6], h[4]);
        cb_hash_packed<CB>(raw[1], h[3], h[1]);
        cb_hash_packed<CB>(__funnelshift_r(raw[1], raw[0], 8), h[2], h[0]);
    } else if constexpr (K == 2 && TRELLM_GEMV_PACKED_HASH) {
        // state e is bits [16 - 2e, 32 - 2e) of the normalised word v: (v << 2e) >> 16, the left shift
        // as a multiply on the FMA pipe, 9 ALU ops per 8 states instead of 12.
        const uint32_t v = __funnelshift_l(raw[1], raw[0], r);
        h[0] = cb_hash<CB>(v >> 16);
#pragma unroll
        for (int e = 1; e < 8; ++e) h[e] = cb_hash<CB>(mad_lo(v, 1u << (2 * e), 0u) >> 16);
    } else {
        uint32_t st[8];
        lane_states<K>(raw, r, st);
#pragma unroll
        for (int e = 0; e < 8; ++e) h[e] = cb_hash<CB>(st[e]);
    }
}

// ---------------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+): a kernel launched with launch_pdl may start while the kernel
// before it in the stream is still running; it must call pdl_wait() before it reads anything that
// kernel wrote (or writes anything it may read). Kernels call pdl_trigger() early so the next one can
// be scheduled onto SMs as theirs free up. Both are no-ops on older GPUs or without the launch attribute.

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

namespace trellm {
// Whether launch_pdl uses the attribute: compute capability >= 9 and not switched off (trellm_set_pdl).
bool pdl_enabled();
void pdl_disable();
}

// kernel<<<grid, block, smem, stream>>>(args...), as a programmatic dependent launch where enabled.
template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args &&...args) {
    if (trellm::pdl_enabled()) {
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem;
        cfg.stream = stream;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
        if (err == cudaSuccess) return err;
        // Refused (a driver or capture mode without PDL): clear the error, launch plainly from now on.
        cudaGetLastError();
        trellm::pdl_disable();
    }
    kernel<<<grid, block, smem, stream>>>(static_cast<KArgs>(args)...);
    return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Asynchronous global -> shared copies (sm_80+): the GEMV keeps several columns of trellis words in
// flight per warp without holding them in registers.

// v, opaque to the optimiser: it stays computed where it is instead of being recomputed inside a loop
// (the compiler sinks cheap lane-derived values, even a thread-id read, into the loops that use them).
template <typename T> __device__ __forceinline__ T opaque(T v) {
    asm volatile("" : "+r"(v));
    return v;
}

// The warp's index in its block, as a value the compiler knows is the same in every lane: shuffled from
// lane 0 (call it where the warp is converged, at the top of a kernel). From threadIdx.x >> 5 the
// compiler must assume lanes may differ (it cannot know the block is one-dimensional), so branches and
// loops on it count as divergent and every __shfl_sync inside them becomes an emulated collective
// (WARPSYNC.COLLECTIVE ... ENDCOLLECTIVE in the SASS).
__device__ __forceinline__ int warp_index() { return __shfl_sync(0xffffffffu, (int)(threadIdx.x >> 5), 0); }

// dst as a shared-window address (__cvta_generic_to_shared): loops keep it in one 32-bit register.
__device__ __forceinline__ void cp_async_16_to(uint32_t smem_dst, const void *gmem_src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_dst), "l"(gmem_src));
}
__device__ __forceinline__ void cp_async_16(void *smem_dst, const void *gmem_src) {
    cp_async_16_to((uint32_t)__cvta_generic_to_shared(smem_dst), gmem_src);
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ---------------------------------------------------------------------------------------------
// One tensor-core mma (f16 inputs, f32 accumulators) and the lane's decoded A fragment of a tile
// (shared by the EXL3 GEMV and the MoE pair kernels).

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same mma on bf16 inputs (the DSA indexer's queries and keys).
__device__ __forceinline__ void mma_16816_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Decoded A fragment of the transposed tile: {e0e1, e4e5, e2e3, e6e7}.
template <int K, int CB> __device__ __forceinline__ void tile_fragment(const uint32_t (&raw)[TileGeom<K>::NW], int r,
                                                                      uint32_t (&a)[4]) {
    uint32_t h[8];
    lane_hashes<K, CB>(raw, r, h);
    half2 p01 = decode_hashed_pair<CB>(h[0], h[1]);
    half2 p45 = decode_hashed_pair<CB>(h[4], h[5]);
    half2 p23 = decode_hashed_pair<CB>(h[2], h[3]);
    half2 p67 = decode_hashed_pair<CB>(h[6], h[7]);
    a[0] = *reinterpret_cast<uint32_t *>(&p01);
    a[1] = *reinterpret_cast<uint32_t *>(&p45);
    a[2] = *reinterpret_cast<uint32_t *>(&p23);
    a[3] = *reinterpret_cast<uint32_t *>(&p67);
}

// The MUL1 codebook on the split-halves route below (TRELLM_MUL1_GEMV=split: the GEMV and the MoE pair
// kernels): a codebook id for the kernel templates, never a format marker. MUL1's weight is
// k_inv * (1024 + s) + k_bias, s the byte sum of the hash (0..1020). One dp4a turns a hash into the word (fp16(1024 + s), fp16(-1534)), whose halves
// sum to s - 510 exactly: the word is a split-halves A operand like 3INST's and MCG's, with no byte_perm and
// no fp16 fma per pair (MUL1 took 11-15% longer than MCG at 1 row). The mma then accumulates
// sum (s - 510) x, and each k-slice's partial becomes k_inv * acc + (k_bias + 1534 k_inv) * sum x
// (mul1_split_partial). The difference from the format's fp16 weights is their rounding: the route
// multiplies by the exact value of the fp16 fma, before its rounding to fp16.
constexpr int CB_MUL1_SPLIT = 3;
constexpr uint32_t MUL1_SPLIT_WORD = 0xE5FE6400u;        // (fp16(1024), fp16(-1534)), the byte sum added to the low half
constexpr float MUL1_K_INV = 1774.0f / 262144.0f;        // fp16 0x1EEE
constexpr float MUL1_OFFSET_REST = -476.0f / 262144.0f;  // fp16 0xC931 + 1534 * fp16 0x1EEE, exact

__device__ __forceinline__ float mul1_split_partial(float acc, float x_sum) {
    return fmaf(acc, MUL1_K_INV, x_sum * MUL1_OFFSET_REST);
}

// Split-halves A fragments for the 3INST and MCG codebooks. Their weight is the sum of the two fp16
// halves of one 32-bit word; instead of adding the halves (two byte_perms and an hadd2 per pair), the
// raw word goes into the mma as two k positions that both multiply the same x value: one mma takes the
// even k of the tile ({e0, e4, e2, e6}), one the odd k ({e1, e5, e3, e7}), against duplicated x.
// CB_MUL1_SPLIT's words are made the same way from a dp4a (see above).
template <int K, int CB> __device__ __forceinline__ void tile_fragments_split(const uint32_t (&raw)[TileGeom<K>::NW],
                                                                             int r, uint32_t (&even)[4],
                                                                             uint32_t (&odd)[4]) {
    uint32_t h[8];
    lane_hashes<K, CB>(raw, r, h);
    if constexpr (CB == CB_MUL1_SPLIT) {
        even[0] = __dp4a(h[0], 0x01010101u, MUL1_SPLIT_WORD);
        even[1] = __dp4a(h[4], 0x01010101u, MUL1_SPLIT_WORD);
        even[2] = __dp4a(h[2], 0x01010101u, MUL1_SPLIT_WORD);
        even[3] = __dp4a(h[6], 0x01010101u, MUL1_SPLIT_WORD);
        odd[0] = __dp4a(h[1], 0x01010101u, MUL1_SPLIT_WORD);
        odd[1] = __dp4a(h[5], 0x01010101u, MUL1_SPLIT_WORD);
        odd[2] = __dp4a(h[3], 0x01010101u, MUL1_SPLIT_WORD);
        odd[3] = __dp4a(h[7], 0x01010101u, MUL1_SPLIT_WORD);
        return;
    }
    const uint32_t mask = 0x8FFF8FFFu, flip = 0x3B603B60u;
    even[0] = lop3_and_xor(h[0], mask, flip);
    even[1] = lop3_and_xor(h[4], mask, flip);
    even[2] = lop3_and_xor(h[2], mask, flip);
    even[3] = lop3_and_xor(h[6], mask, flip);
    odd[0] = lop3_and_xor(h[1], mask, flip);
    odd[1] = lop3_and_xor(h[5], mask, flip);
    odd[2] = lop3_and_xor(h[3], mask, flip);
    odd[3] = lop3_and_xor(h[7], mask, flip);
}

// The B operands of a split-halves tile from x's fragment word b (x at k, k + 1): x at k in both halves (for
// the even-k mma) and x at k + 1 in both (the odd-k mma).
__device__ __forceinline__ void split_b_operand(uint32_t b, uint32_t &even, uint32_t &odd) {
    even = __byte_perm(b, b, 0x1010);
    odd = __byte_perm(b, b, 0x3232);
}
