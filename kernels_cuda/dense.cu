// Error strings, the fill probe, the 128-point Hadamard, RMSNorm (+ residual), RoPE (+ QK-norm and the
// KV-cache write), gated activations, and the paged KV-cache write.
#include "common.cuh"

#include <math.h>
#include <stdlib.h>

extern "C" const char *trellm_error_string(int code) {
    switch (code) {
        case TRELLM_OK: return "no error";
        case TRELLM_E_BAD_DTYPE: return "unsupported dtype";
        case TRELLM_E_BAD_SHAPE: return "unsupported or inconsistent shape";
        case TRELLM_E_BAD_ARG: return "invalid argument";
        case TRELLM_E_UNSUPPORTED: return "not supported by this kernel";
        default: return code > 0 ? cudaGetErrorString((cudaError_t)code) : "unknown trellm error";
    }
}

extern "C" int trellm_abi_version(void) { return 1; }

// Programmatic dependent launch: on by default on compute capability 9+;
// trellm_set_pdl(0) switches it off (benchmarks compare both in one process).
static int g_pdl = -1;  // -1: not decided yet

extern "C" int trellm_set_pdl(int enabled) {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        cudaGetLastError();
        major = 0;
    }
    g_pdl = enabled && major >= 9 ? 1 : 0;
    return g_pdl;
}

void trellm::pdl_disable() { g_pdl = 0; }

bool trellm::pdl_enabled() {
    if (g_pdl < 0) trellm_set_pdl(1);
    return g_pdl == 1;
}

namespace {

__global__ void fill_f32_kernel(float *out, int64_t n, float value) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = value;
}

// ---------------------------------------------------------------------------------------------
// Vector access: VEC consecutive elements <-> floats in 16-byte (or 8-byte) loads and stores, the
// widest the element count allows. p must be aligned to the access (callers check on the host).

template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T *__restrict__ p, float (&out)[VEC]) {
    constexpr int BYTES = VEC * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < BYTES / 16; ++c) {
            const uint4 u = reinterpret_cast<const uint4 *>(p)[c];
            const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
            for (int i = 0; i < PER; ++i) out[c * PER + i] = to_f32(e[i]);
        }
    } else if constexpr (BYTES == 8) {
        const uint2 u = *reinterpret_cast<const uint2 *>(p);
        const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = to_f32(e[i]);
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = to_f32(p[i]);
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T *__restrict__ p, const float (&in)[VEC]) {
    constexpr int BYTES = VEC * (int)sizeof(T);
    if constexpr (BYTES % 16 == 0) {
        constexpr int PER = 16 / (int)sizeof(T);
#pragma unroll
        for (int c = 0; c < BYTES / 16; ++c) {
            uint4 u;
            T *e = reinterpret_cast<T *>(&u);
#pragma unroll
            for (int i = 0; i < PER; ++i) e[i] = from_f32<T>(in[c * PER + i]);
            reinterpret_cast<uint4 *>(p)[c] = u;
        }
    } else if constexpr (BYTES == 8) {
        uint2 u;
        T *e = reinterpret_cast<T *>(&u);
#pragma unroll
        for (int i = 0; i < VEC; ++i) e[i] = from_f32<T>(in[i]);
        *reinterpret_cast<uint2 *>(p) = u;
    } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) p[i] = from_f32<T>(in[i]);
    }
}

__host__ __device__ __forceinline__ bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// ---------------------------------------------------------------------------------------------
// Hadamard: one warp per 128-element block of a row; lane l owns elements 4l..4l+3, read and
// written as one 8- or 16-byte access when VECTOR (pointers 16-byte aligned).

template <bool VECTOR, typename T>
__device__ __forceinline__ void load4(const T *__restrict__ p, float (&v)[4]) {
    if (VECTOR) load_vec<T, 4>(p, v);
    else {
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = to_f32(p[i]);
    }
}

template <typename TIn, typename TOut, bool VECTOR>
__global__ void hadamard_128_kernel(const TIn *__restrict__ x, TOut *__restrict__ y, int64_t rows, int64_t dim,
                                    const half *__restrict__ pre, const half *__restrict__ post,
                                    const half *__restrict__ bias) {
    const int lane = threadIdx.x & 31;
    const int64_t blocks_per_row = dim / 128;
    const int64_t job = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (job >= rows * blocks_per_row) return;
    const int64_t row = job / blocks_per_row;
    const int64_t col = (job % blocks_per_row) * 128 + lane * 4;
    const TIn *src = x + row * dim + col;
    float v[4], s[4];
    load4<VECTOR>(src, v);
    if (pre) {
        load4<VECTOR>(pre + col, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= s[i];
    }
    warp_hadamard_128(v);
    if (post) {
        load4<VECTOR>(post + col, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= s[i];
    }
    if (bias) {
        load4<VECTOR>(bias + col, s);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] += s[i];
    }
    TOut *dst = y + row * dim + col;
    if (VECTOR) store_vec<TOut, 4>(dst, v);
    else {
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[i] = from_f32<TOut>(v[i]);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: one block per row; pass 1 forms h (rounded to the dtype) and its sum of squares, pass 2
// scales. Each thread handles VEC consecutive elements per step (16-byte accesses; VEC = 1: scalar).

template <typename T, typename W, int VEC>
__global__ void rms_norm_kernel(const T *__restrict__ x, const T *__restrict__ residual, const W *__restrict__ weight,
                                T *__restrict__ y, T *__restrict__ h_out, int64_t dim, float eps, bool unit_offset) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    const int64_t row = blockIdx.x;
    const int64_t vecs = dim / VEC;
    const T *xr = x + row * dim;
    const T *rr = residual ? residual + row * dim : nullptr;
    T *hr = h_out ? h_out + row * dim : nullptr;
    __shared__ float partial[32];
    // The block's sum of squares, in a fixed order (both paths below use it).
    auto block_rstd = [&](float sumsq) {
        sumsq = warp_sum(sumsq);
        if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sumsq;
        __syncthreads();
        if (threadIdx.x < 32) {
            float s = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
            s = warp_sum(s);
            if (threadIdx.x == 0) partial[0] = s;
        }
        __syncthreads();
        return rsqrtf(partial[0] / (float)dim + eps);
    };
    // With a residual: h = x + residual for vector i, rounded to the dtype, and stored to h_out.
    auto add_residual = [&](int64_t i, float (&h)[VEC]) {
        if (!rr) return;
        float r[VEC];
        load_vec<T, VEC>(rr + i * VEC, r);
#pragma unroll
        for (int j = 0; j < VEC; ++j) h[j] = to_f32(from_f32<T>(h[j] + r[j]));
        store_vec<T, VEC>(hr + i * VEC, h);
    };
    if (VEC > 1 && vecs <= blockDim.x) {
        // One vector per thread (the launcher's choice up to 1024 vectors, e.g. a decode step's rows): h
        // and the weights stay in registers, and the weights are read before the reduction, so the row
        // is not read back after its barriers (one dependent memory round trip fewer; the same values).
        const int64_t i = threadIdx.x;
        const bool live = i < vecs;
        float h[VEC] = {}, w[VEC];
        if (live) {
            load_vec<T, VEC>(xr + i * VEC, h);
            if (weight) load_vec<W, VEC>(weight + i * VEC, w);
            add_residual(i, h);
        }
        float sumsq = 0.f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) sumsq += h[j] * h[j];
        const float rstd = block_rstd(sumsq);
        if (live) {
#pragma unroll
            for (int j = 0; j < VEC; ++j) h[j] = weight ? h[j] * rstd * (unit_offset ? 1.f + w[j] : w[j]) : h[j] * rstd;
            store_vec<T, VEC>(y + row * dim + i * VEC, h);
        }
        return;
    }
    float sumsq = 0.f;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
        float h[VEC];
        load_vec<T, VEC>(xr + i * VEC, h);
        add_residual(i, h);
#pragma unroll
        for (int j = 0; j < VEC; ++j) sumsq += h[j] * h[j];
    }
    const float rstd = block_rstd(sumsq);
    const T *src = rr ? hr : xr;  // each thread re-reads the h it wrote itself
    T *yr = y + row * dim;
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) {
        float v[VEC];
        load_vec<T, VEC>(src + i * VEC, v);
        if (weight) {
            float w[VEC];
            load_vec<W, VEC>(weight + i * VEC, w);
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = v[j] * rstd * (unit_offset ? 1.f + w[j] : w[j]);
        } else {
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] *= rstd;
        }
        store_vec<T, VEC>(yr + i * VEC, v);
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE of q and k, optionally per-head RMS-normed first, optionally writing k and v into the paged
// KV cache: one warp per (token, head row). A row is staged in shared memory as float (16-byte
// loads when aligned), normed and rounded to the dtype (as a separate norm op would), rotated
// (NeoX halves or GPT-J pairs over the first 2*half dims, the tail copied), and stored with 16-byte
// writes. Rows of a token: hq q heads, hkv k heads, then (with pages) hkv v heads, copied as is.

struct RopeArgs {
    const void *q, *k, *v;
    void *q_out, *k_out, *k_pages, *v_pages;
    const int64_t *positions, *slots;  // positions NULL: row t of cos/sin belongs to token t
    const float *cos, *sin;            // [table_len, half]
    const void *q_norm, *k_norm;       // per-head RMSNorm weights [head_dim] (dtype of q) or NULL
    int64_t tokens, table_len;
    int hq, hkv, head_dim, half, interleaved, unit_offset;
    float eps;
};

constexpr int ROPE_WARPS = 4;
constexpr int TRELLM_ROPE_MAX_HEAD_DIM = 1024;  // 4 warps x 2 rows x 1024 floats = 32 KiB of shared memory

template <typename T>
__device__ __forceinline__ void row_to_smem(const T *__restrict__ src, float *dst, int n, int lane) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (n % VEC == 0 && aligned16(src)) {
        for (int i = lane; i < n / VEC; i += 32) {
            float v[VEC];
            load_vec<T, VEC>(src + i * VEC, v);
#pragma unroll
            for (int j = 0; j < VEC; ++j) dst[i * VEC + j] = v[j];
        }
    } else {
        for (int i = lane; i < n; i += 32) dst[i] = to_f32(src[i]);
    }
}

template <typename T>
__device__ __forceinline__ void smem_to_row(const float *src, T *__restrict__ dst, int n, int lane) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (n % VEC == 0 && aligned16(dst)) {
        for (int i = lane; i < n / VEC; i += 32) {
            float v[VEC];
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[j] = src[i * VEC + j];
            store_vec<T, VEC>(dst + i * VEC, v);
        }
    } else {
        for (int i = lane; i < n; i += 32) dst[i] = from_f32<T>(src[i]);
    }
}

template <typename T>
__device__ __forceinline__ void copy_row(const T *__restrict__ src, T *__restrict__ dst, int n, int lane) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (n % VEC == 0 && aligned16(src) && aligned16(dst)) {
        for (int i = lane; i < n / VEC; i += 32)
            reinterpret_cast<uint4 *>(dst)[i] = reinterpret_cast<const uint4 *>(src)[i];
    } else {
        for (int i = lane; i < n; i += 32) dst[i] = src[i];
    }
}

template <typename T>
__global__ void __launch_bounds__(ROPE_WARPS * 32) rotary_qk_kernel(const RopeArgs a) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    extern __shared__ float rope_smem[];  // per warp: the row in, the row out
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int D = a.head_dim;
    const int v_rows = a.k_pages ? a.hkv : 0;
    const int rows_per_token = a.hq + a.hkv + v_rows;
    const int64_t job = (int64_t)blockIdx.x * ROPE_WARPS + warp;
    if (job >= a.tokens * rows_per_token) return;
    const int64_t token = job / rows_per_token;
    const int h = (int)(job % rows_per_token);
    const int64_t slot = a.k_pages ? a.slots[token] : -1;
    if (h >= a.hq + a.hkv) {  // a v row: straight into the cache
        const int head = h - a.hq - a.hkv;
        if (slot >= 0)
            copy_row(static_cast<const T *>(a.v) + (token * a.hkv + head) * D,
                     static_cast<T *>(a.v_pages) + (slot * a.hkv + head) * D, D, lane);
        return;
    }
    const bool is_q = h < a.hq;
    const int head = is_q ? h : h - a.hq;
    const int64_t row = token * (is_q ? a.hq : a.hkv) + head;
    float *x = rope_smem + warp * 2 * D, *y = x + D;
    row_to_smem(static_cast<const T *>(is_q ? a.q : a.k) + row * D, x, D, lane);
    __syncwarp();
    const T *w = static_cast<const T *>(is_q ? a.q_norm : a.k_norm);
    if (w) {
        float ss = 0.f;
        for (int i = lane; i < D; i += 32) ss += x[i] * x[i];
        const float rstd = rsqrtf(warp_sum(ss) / (float)D + a.eps);
        for (int i = lane; i < D; i += 32) {
            const float wv = to_f32(w[i]);
            x[i] = to_f32(from_f32<T>(x[i] * rstd * (a.unit_offset ? 1.f + wv : wv)));
        }
        __syncwarp();
    }
    int64_t pos = a.positions ? a.positions[token] : token;
    pos = pos < 0 ? 0 : pos >= a.table_len ? a.table_len - 1 : pos;  // never read outside the table
    const float *c = a.cos + pos * a.half, *s = a.sin + pos * a.half;
    const int half = a.half;
    for (int d = lane; d < D; d += 32) {
        float o = x[d];
        if (d < 2 * half) {
            if (a.interleaved) {
                const int j = d >> 1;
                o = (d & 1) ? x[d] * c[j] + x[d - 1] * s[j] : x[d] * c[j] - x[d + 1] * s[j];
            } else if (d < half) {
                o = x[d] * c[d] - x[d + half] * s[d];
            } else {
                const int j = d - half;
                o = x[d] * c[j] + x[j] * s[j];
            }
        }
        y[d] = o;
    }
    __syncwarp();
    smem_to_row(y, static_cast<T *>(is_q ? a.q_out : a.k_out) + row * D, D, lane);
    if (!is_q && slot >= 0) smem_to_row(y, static_cast<T *>(a.k_pages) + (slot * a.hkv + head) * D, D, lane);
}

template <typename T>
int launch_rotary_qk(const RopeArgs &a, cudaStream_t stream) {
    const int64_t rows = a.tokens * (a.hq + a.hkv + (a.k_pages ? a.hkv : 0));
    if (rows == 0) return TRELLM_OK;
    const int64_t blocks = (rows + ROPE_WARPS - 1) / ROPE_WARPS;
    if (blocks > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    const size_t smem = (size_t)ROPE_WARPS * 2 * a.head_dim * sizeof(float);
    rotary_qk_kernel<T><<<(unsigned)blocks, ROPE_WARPS * 32, smem, stream>>>(a);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

// ---------------------------------------------------------------------------------------------
// Gated activation (apply_act: common.cuh, shared with the EXL3 GEMV's fused input transform)

template <typename T>
__global__ void gated_activation_kernel(const T *__restrict__ gate, int64_t gate_stride, const T *__restrict__ up,
                                        int64_t up_stride, T *__restrict__ out, int64_t rows, int64_t dim, int act) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    // grid.y strides over rows, grid.x * blockDim.x over columns: no per-element division.
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const T *g = gate + r * gate_stride, *u = up + r * up_stride;
        T *o = out + r * dim;
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < dim; c += (int64_t)gridDim.x * blockDim.x) {
            // Match the reference: act(gate) is rounded to the dtype before the multiply.
            const T a = from_f32<T>(apply_act(to_f32(g[c]), act));
            o[c] = from_f32<T>(to_f32(a) * to_f32(u[c]));
        }
    }
}

// 16-byte vectors: VEC elements per thread per step (dim, strides and pointers aligned to VEC).
template <typename T, int VEC>
__global__ void gated_activation_vec_kernel(const T *__restrict__ gate, int64_t gate_stride, const T *__restrict__ up,
                                            int64_t up_stride, T *__restrict__ out, int64_t rows, int64_t dim, int act) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    const int64_t vecs = dim / VEC;
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint4 *g = reinterpret_cast<const uint4 *>(gate + r * gate_stride);
        const uint4 *u = reinterpret_cast<const uint4 *>(up + r * up_stride);
        uint4 *o = reinterpret_cast<uint4 *>(out + r * dim);
        for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < vecs; c += (int64_t)gridDim.x * blockDim.x) {
            uint4 gv = g[c], uv = u[c], ov;
            const T *ge = reinterpret_cast<const T *>(&gv);
            const T *ue = reinterpret_cast<const T *>(&uv);
            T *oe = reinterpret_cast<T *>(&ov);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                const T a = from_f32<T>(apply_act(to_f32(ge[i]), act));
                oe[i] = from_f32<T>(to_f32(a) * to_f32(ue[i]));
            }
            o[c] = ov;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// KV-cache write: one block per token, 16-byte copies when the row allows.

template <typename V>
__global__ void write_kv_kernel(const V *__restrict__ k, const V *__restrict__ v, V *__restrict__ k_pages,
                                V *__restrict__ v_pages, const int64_t *__restrict__ slots, int64_t row_vecs) {
    pdl_trigger();  // the next kernel (an EXL3 GEMV) may start prefetching its weights
    const int64_t t = blockIdx.x;
    const int64_t slot = slots[t];
    if (slot < 0) return;
    for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
        k_pages[slot * row_vecs + i] = k[t * row_vecs + i];
        v_pages[slot * row_vecs + i] = v[t * row_vecs + i];
    }
}

template <typename T, typename W>
int launch_rms_norm(const T *x, const T *residual, const W *weight, T *y, T *h_out, int64_t rows, int64_t dim,
                    float eps, bool unit_offset, bool vector, cudaStream_t stream) {
    constexpr int VEC = 16 / (int)sizeof(T);
    if (vector) {
        // One vector per thread for rows up to 1024 vectors (8192 fp16); whole warps, at least one.
        const int64_t vecs = dim / VEC;
        const int threads = (int)(vecs >= 1024 ? 1024 : ((vecs + 31) / 32) * 32);
        rms_norm_kernel<T, W, VEC><<<(unsigned)rows, threads, 0, stream>>>(x, residual, weight, y, h_out, dim, eps,
                                                                           unit_offset);
    } else {
        const int threads = dim >= 4096 ? 1024 : dim >= 1024 ? 512 : 256;
        rms_norm_kernel<T, W, 1><<<(unsigned)rows, threads, 0, stream>>>(x, residual, weight, y, h_out, dim, eps,
                                                                         unit_offset);
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_fill_f32(float *out, int64_t n, float value, cudaStream_t stream) {
    if (n < 0) return TRELLM_E_BAD_SHAPE;
    if (n == 0) return TRELLM_OK;
    const int blocks = (int)(n < 65536 * 256 ? (n + 255) / 256 : 65536);
    fill_f32_kernel<<<blocks, 256, 0, stream>>>(out, n, value);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_hadamard_128(const void *x, int x_dtype, void *y, int y_dtype, int64_t rows, int64_t dim,
                                   const void *pre, const void *post, const void *bias, cudaStream_t stream) {
    if (rows < 0 || dim <= 0 || dim % 128) return TRELLM_E_BAD_SHAPE;
    if (rows == 0) return TRELLM_OK;
    const int64_t warps = rows * (dim / 128);
    const int blocks = (int)((warps + 7) / 8);
    const half *p = static_cast<const half *>(pre), *q = static_cast<const half *>(post),
               *b = static_cast<const half *>(bias);
    const bool vector = aligned16(x) && aligned16(y) && aligned16(pre) && aligned16(post) && aligned16(bias);
    if (vector) {
        TRELLM_DISPATCH_DTYPE(x_dtype, TIn,
            TRELLM_DISPATCH_DTYPE(y_dtype, TOut,
                hadamard_128_kernel<TIn, TOut, true><<<blocks, 256, 0, stream>>>(
                    static_cast<const TIn *>(x), static_cast<TOut *>(y), rows, dim, p, q, b)));
    } else {
        TRELLM_DISPATCH_DTYPE(x_dtype, TIn,
            TRELLM_DISPATCH_DTYPE(y_dtype, TOut,
                hadamard_128_kernel<TIn, TOut, false><<<blocks, 256, 0, stream>>>(
                    static_cast<const TIn *>(x), static_cast<TOut *>(y), rows, dim, p, q, b)));
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_rms_norm(const void *x, const void *residual, const void *weight, void *y, void *h_out,
                               int64_t rows, int64_t dim, int dtype, int w_dtype, float eps, int unit_offset,
                               cudaStream_t stream) {
    if (rows < 0 || dim <= 0) return TRELLM_E_BAD_SHAPE;
    if (residual && !h_out) return TRELLM_E_BAD_ARG;
    if (rows == 0) return TRELLM_OK;
    if (rows > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    const int64_t vec = dtype == TRELLM_F32 ? 4 : 8;  // elements per 16 bytes
    const bool vector = dim % vec == 0 && aligned16(x) && aligned16(residual) && aligned16(weight) && aligned16(y) &&
                        aligned16(h_out);
    TRELLM_DISPATCH_DTYPE(dtype, T,
        TRELLM_DISPATCH_DTYPE(w_dtype, W,
            return launch_rms_norm<T, W>(static_cast<const T *>(x), static_cast<const T *>(residual),
                                         static_cast<const W *>(weight), static_cast<T *>(y), static_cast<T *>(h_out),
                                         rows, dim, eps, unit_offset != 0, vector, stream)));
    return TRELLM_OK;
}

extern "C" int trellm_rotary_embedding(const void *x, void *y, const float *cos, const float *sin, int64_t tokens,
                                       int64_t heads, int64_t head_dim, int64_t rot_half, int interleaved, int dtype,
                                       cudaStream_t stream) {
    if (tokens < 0 || heads <= 0 || rot_half < 0 || 2 * rot_half > head_dim) return TRELLM_E_BAD_SHAPE;
    if (head_dim > TRELLM_ROPE_MAX_HEAD_DIM || heads > INT32_MAX) return TRELLM_E_UNSUPPORTED;
    RopeArgs a = {};
    a.q = x; a.q_out = y; a.cos = cos; a.sin = sin;
    a.tokens = tokens; a.table_len = tokens > 0 ? tokens : 1;
    a.hq = (int)heads; a.hkv = 0; a.head_dim = (int)head_dim; a.half = (int)rot_half;
    a.interleaved = interleaved != 0;
    TRELLM_DISPATCH_DTYPE(dtype, T, return launch_rotary_qk<T>(a, stream));
    return TRELLM_OK;
}

extern "C" int trellm_rotary_qk(const void *q, const void *k, void *q_out, void *k_out, const int64_t *positions,
                                const float *cos, const float *sin, int64_t table_len, const void *q_norm,
                                const void *k_norm, float norm_eps, int norm_unit_offset, const void *v,
                                void *k_pages, void *v_pages, const int64_t *slots, int64_t tokens, int64_t hq,
                                int64_t hkv, int64_t head_dim, int64_t rot_half, int interleaved, int dtype,
                                cudaStream_t stream) {
    if (tokens < 0 || hq <= 0 || hkv <= 0 || hq > INT32_MAX || hkv > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    if (head_dim <= 0 || rot_half < 0 || 2 * rot_half > head_dim) return TRELLM_E_BAD_SHAPE;
    if (head_dim > TRELLM_ROPE_MAX_HEAD_DIM) return TRELLM_E_UNSUPPORTED;
    if (!q || !k || !q_out || !k_out || !positions || (rot_half > 0 && (!cos || !sin || table_len <= 0)))
        return TRELLM_E_BAD_ARG;
    if ((q_norm == nullptr) != (k_norm == nullptr)) return TRELLM_E_BAD_ARG;
    if (k_pages && (!v_pages || !v || !slots)) return TRELLM_E_BAD_ARG;
    RopeArgs a = {};
    a.q = q; a.k = k; a.v = v; a.q_out = q_out; a.k_out = k_out; a.k_pages = k_pages; a.v_pages = v_pages;
    a.positions = positions; a.slots = slots; a.cos = cos; a.sin = sin;
    a.q_norm = q_norm; a.k_norm = k_norm;
    a.tokens = tokens; a.table_len = table_len > 0 ? table_len : 1;
    a.hq = (int)hq; a.hkv = (int)hkv; a.head_dim = (int)head_dim; a.half = (int)rot_half;
    a.interleaved = interleaved != 0; a.unit_offset = norm_unit_offset != 0; a.eps = norm_eps;
    TRELLM_DISPATCH_DTYPE(dtype, T, return launch_rotary_qk<T>(a, stream));
    return TRELLM_OK;
}

extern "C" int trellm_gated_activation(const void *gate, int64_t gate_stride, const void *up, int64_t up_stride,
                                       void *out, int64_t rows, int64_t dim, int dtype, int activation,
                                       cudaStream_t stream) {
    if (rows < 0 || dim <= 0) return TRELLM_E_BAD_SHAPE;
    if (activation < TRELLM_ACT_SILU || activation > TRELLM_ACT_RELU2) return TRELLM_E_BAD_ARG;
    if (rows == 0) return TRELLM_OK;
    const int elem = dtype == TRELLM_F32 ? 4 : 2;
    const int vec = 16 / elem;
    const bool aligned = ((uintptr_t)gate | (uintptr_t)up | (uintptr_t)out) % 16 == 0 && dim % vec == 0 &&
                         gate_stride % vec == 0 && up_stride % vec == 0;
    const int64_t units = aligned ? dim / vec : dim;
    const int64_t col_blocks = (units + 255) / 256;
    const dim3 grid((unsigned)(col_blocks < 64 ? col_blocks : 64), (unsigned)(rows < 65535 ? rows : 65535));
    if (aligned) {
        TRELLM_DISPATCH_DTYPE(dtype, T,
            gated_activation_vec_kernel<T, 16 / sizeof(T)><<<grid, 256, 0, stream>>>(
                static_cast<const T *>(gate), gate_stride, static_cast<const T *>(up), up_stride,
                static_cast<T *>(out), rows, dim, activation));
    } else {
        TRELLM_DISPATCH_DTYPE(dtype, T,
            gated_activation_kernel<T><<<grid, 256, 0, stream>>>(static_cast<const T *>(gate), gate_stride,
                                                                 static_cast<const T *>(up), up_stride,
                                                                 static_cast<T *>(out), rows, dim, activation));
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_write_kv_pages(const void *k, const void *v, void *k_pages, void *v_pages, const int64_t *slots,
                                     int64_t tokens, int64_t row_elems, int dtype, cudaStream_t stream) {
    if (tokens < 0 || row_elems <= 0) return TRELLM_E_BAD_SHAPE;
    if (tokens == 0) return TRELLM_OK;
    if (tokens > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    const int64_t elem = dtype == TRELLM_F32 ? 4 : 2;
    if (dtype < TRELLM_F16 || dtype > TRELLM_F32) return TRELLM_E_BAD_DTYPE;
    const int64_t bytes = row_elems * elem;
    const bool aligned = ((uintptr_t)k | (uintptr_t)v | (uintptr_t)k_pages | (uintptr_t)v_pages) % 16 == 0;
    if (bytes % 16 == 0 && aligned) {
        write_kv_kernel<uint4><<<(unsigned)tokens, 128, 0, stream>>>(
            static_cast<const uint4 *>(k), static_cast<const uint4 *>(v), static_cast<uint4 *>(k_pages),
            static_cast<uint4 *>(v_pages), slots, bytes / 16);
    } else if (elem == 4) {
        write_kv_kernel<uint32_t><<<(unsigned)tokens, 128, 0, stream>>>(
            static_cast<const uint32_t *>(k), static_cast<const uint32_t *>(v), static_cast<uint32_t *>(k_pages),
            static_cast<uint32_t *>(v_pages), slots, row_elems);
    } else {
        write_kv_kernel<uint16_t><<<(unsigned)tokens, 128, 0, stream>>>(
            static_cast<const uint16_t *>(k), static_cast<const uint16_t *>(v), static_cast<uint16_t *>(k_pages),
            static_cast<uint16_t *>(v_pages), slots, row_elems);
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}
