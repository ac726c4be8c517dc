// Error strings, the fill probe, the 128-point Hadamard, RMSNorm (+ residual), RoPE, gated activations,
// and the paged KV-cache write.
#include "common.cuh"

#include <math.h>

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

namespace {

__global__ void fill_f32_kernel(float *out, int64_t n, float value) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = value;
}

// ---------------------------------------------------------------------------------------------
// Hadamard: one warp per 128-element block of a row.

template <typename TIn, typename TOut>
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
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[i] = to_f32(src[i]);
        if (pre) v[i] *= __half2float(pre[col + i]);
    }
    warp_hadamard_128(v);
    TOut *dst = y + row * dim + col;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float o = v[i];
        if (post) o *= __half2float(post[col + i]);
        if (bias) o += __half2float(bias[col + i]);
        dst[i] = from_f32<TOut>(o);
    }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm: one block per row; pass 1 forms h (rounded to the dtype) and its sum of squares.

template <typename T, typename W>
__global__ void rms_norm_kernel(const T *__restrict__ x, const T *__restrict__ residual, const W *__restrict__ weight,
                                T *__restrict__ y, T *__restrict__ h_out, int64_t dim, float eps, bool unit_offset) {
    const int64_t row = blockIdx.x;
    const T *xr = x + row * dim;
    const T *rr = residual ? residual + row * dim : nullptr;
    T *hr = h_out ? h_out + row * dim : nullptr;
    float sumsq = 0.f;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float h = to_f32(xr[i]);
        if (rr) {
            T hq = from_f32<T>(h + to_f32(rr[i]));
            hr[i] = hq;
            h = to_f32(hq);
        }
        sumsq += h * h;
    }
    __shared__ float partial[32];
    sumsq = warp_sum(sumsq);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sumsq;
    __syncthreads();
    if (threadIdx.x < 32) {
        float s = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        s = warp_sum(s);
        if (threadIdx.x == 0) partial[0] = s;
    }
    __syncthreads();
    const float rstd = rsqrtf(partial[0] / (float)dim + eps);
    const T *src = rr ? hr : xr;
    T *yr = y + row * dim;
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = to_f32(src[i]) * rstd;
        if (weight) {
            float w = to_f32(weight[i]);
            v *= unit_offset ? 1.f + w : w;
        }
        yr[i] = from_f32<T>(v);
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE: one thread per (token, head, pair); the unrotated tail is copied.

template <typename T>
__global__ void rotary_kernel(const T *__restrict__ x, T *__restrict__ y, const float *__restrict__ cos_t,
                              const float *__restrict__ sin_t, int64_t tokens, int64_t heads, int64_t head_dim,
                              int64_t half_rot, bool interleaved) {
    const int64_t per_head = head_dim - half_rot;  // half_rot pairs + (head_dim - 2*half_rot) tail elements
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= tokens * heads * per_head) return;
    const int64_t th = idx / per_head, i = idx % per_head;
    const int64_t token = th / heads;
    const T *xs = x + th * head_dim;
    T *ys = y + th * head_dim;
    if (i < half_rot) {
        const float c = cos_t[token * half_rot + i], s = sin_t[token * half_rot + i];
        const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half_rot;
        const float x1 = to_f32(xs[a]), x2 = to_f32(xs[b]);
        ys[a] = from_f32<T>(x1 * c - x2 * s);
        ys[b] = from_f32<T>(x2 * c + x1 * s);
    } else {
        const int64_t t = 2 * half_rot + (i - half_rot);
        ys[t] = xs[t];
    }
}

// ---------------------------------------------------------------------------------------------
// Gated activation

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

template <typename T>
__global__ void gated_activation_kernel(const T *__restrict__ gate, int64_t gate_stride, const T *__restrict__ up,
                                        int64_t up_stride, T *__restrict__ out, int64_t rows, int64_t dim, int act) {
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
    const int64_t t = blockIdx.x;
    const int64_t slot = slots[t];
    if (slot < 0) return;
    for (int64_t i = threadIdx.x; i < row_vecs; i += blockDim.x) {
        k_pages[slot * row_vecs + i] = k[t * row_vecs + i];
        v_pages[slot * row_vecs + i] = v[t * row_vecs + i];
    }
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
    TRELLM_DISPATCH_DTYPE(x_dtype, TIn,
        TRELLM_DISPATCH_DTYPE(y_dtype, TOut,
            hadamard_128_kernel<TIn, TOut><<<blocks, 256, 0, stream>>>(
                static_cast<const TIn *>(x), static_cast<TOut *>(y), rows, dim, p, q, b)));
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
    const int threads = dim >= 4096 ? 1024 : dim >= 1024 ? 512 : 256;
    TRELLM_DISPATCH_DTYPE(dtype, T,
        TRELLM_DISPATCH_DTYPE(w_dtype, W,
            rms_norm_kernel<T, W><<<(unsigned)rows, threads, 0, stream>>>(
                static_cast<const T *>(x), static_cast<const T *>(residual), static_cast<const W *>(weight),
                static_cast<T *>(y), static_cast<T *>(h_out), dim, eps, unit_offset != 0)));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_rotary_embedding(const void *x, void *y, const float *cos, const float *sin, int64_t tokens,
                                       int64_t heads, int64_t head_dim, int64_t rot_half, int interleaved, int dtype,
                                       cudaStream_t stream) {
    if (tokens < 0 || heads <= 0 || rot_half < 0 || 2 * rot_half > head_dim) return TRELLM_E_BAD_SHAPE;
    const int64_t total = tokens * heads * (head_dim - rot_half);
    if (total == 0) return TRELLM_OK;
    const int blocks = (int)((total + 255) / 256);
    TRELLM_DISPATCH_DTYPE(dtype, T,
        rotary_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T *>(x), static_cast<T *>(y), cos, sin,
                                                     tokens, heads, head_dim, rot_half, interleaved != 0));
    TRELLM_LAUNCH_CHECK();
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
