// EXL3 C entry points: GEMV, its output transform, tile decode, codebook decode.
#include "exl3_gemv.cuh"

using namespace trellm;

namespace {

// One warp per (batch row, 128-column block): sum the k-slice partials, Hadamard, * svh (+ bias).
template <typename TOut>
__global__ void exl3_output_kernel(const float *__restrict__ partial, int splits, const half *__restrict__ svh,
                                   const half *__restrict__ bias, TOut *__restrict__ y, int m, int n) {
    const int lane = threadIdx.x & 31;
    const int64_t job = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int blocks_n = n / 128;
    if (job >= (int64_t)m * blocks_n) return;
    const int row = (int)(job / blocks_n), col = (int)(job % blocks_n) * 128 + lane * 4;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s) {
        const float4 p = *reinterpret_cast<const float4 *>(partial + ((size_t)s * m + row) * n + col);
        v[0] += p.x; v[1] += p.y; v[2] += p.z; v[3] += p.w;
    }
    warp_hadamard_128(v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float o = v[i] * __half2float(svh[col + i]);
        if (bias) o += __half2float(bias[col + i]);
        y[(size_t)row * n + col + i] = from_f32<TOut>(o);
    }
}

int check_exl3_dims(int64_t k, int64_t n, int K, int codebook) {
    if (k <= 0 || n <= 0 || k % 128 || n % 128) return TRELLM_E_BAD_SHAPE;
    if (K < 1 || K > 8) return TRELLM_E_BAD_ARG;
    if (codebook < 0 || codebook > 2) return TRELLM_E_BAD_ARG;
    if (k > INT32_MAX / 2 || n > INT32_MAX / 2) return TRELLM_E_BAD_SHAPE;
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_exl3_gemv_splits(int64_t k) { return (int)((k / 16 + GEMV_SLICE - 1) / GEMV_SLICE); }

extern "C" int trellm_exl3_gemv(const void *xh, const int16_t *trellis, float *partial, int64_t m, int64_t k,
                                int64_t n, int K, int codebook, int num_sms, cudaStream_t stream) {
    int rc = check_exl3_dims(k, n, K, codebook);
    if (rc) return rc;
    if (m < 1 || m > 32) return TRELLM_E_BAD_SHAPE;
    const half *x = static_cast<const half *>(xh);
    const uint32_t *t = reinterpret_cast<const uint32_t *>(trellis);
    switch (codebook) {
        case 0: return launch_exl3_gemv<0>(x, t, partial, (int)m, (int)k, (int)n, K, num_sms, stream);
        case 1: return launch_exl3_gemv<1>(x, t, partial, (int)m, (int)k, (int)n, K, num_sms, stream);
        default: return launch_exl3_gemv<2>(x, t, partial, (int)m, (int)k, (int)n, K, num_sms, stream);
    }
}

extern "C" int trellm_exl3_output(const float *partial, int splits, const void *svh, const void *bias, void *y,
                                  int y_dtype, int64_t m, int64_t n, cudaStream_t stream) {
    if (m < 1 || n <= 0 || n % 128 || splits < 1) return TRELLM_E_BAD_SHAPE;
    const int64_t warps = m * (n / 128);
    const int blocks = (int)((warps + 7) / 8);
    TRELLM_DISPATCH_DTYPE(y_dtype, T,
                          exl3_output_kernel<T><<<blocks, 256, 0, stream>>>(
                              partial, splits, static_cast<const half *>(svh), static_cast<const half *>(bias),
                              static_cast<T *>(y), (int)m, (int)n));
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_exl3_decode_tiles(const int16_t *trellis, void *w_hat, int64_t k, int64_t n, int K,
                                        int codebook, cudaStream_t stream) {
    int rc = check_exl3_dims(k, n, K, codebook);
    if (rc == TRELLM_E_BAD_SHAPE && k % 16 == 0 && n % 16 == 0 && k > 0 && n > 0) rc = TRELLM_OK;  // tiles only
    if (rc) return rc;
    const uint32_t *t = reinterpret_cast<const uint32_t *>(trellis);
    half *w = static_cast<half *>(w_hat);
    switch (codebook) {
        case 0: return launch_exl3_decode_tiles<0>(t, w, (int)k, (int)n, K, stream);
        case 1: return launch_exl3_decode_tiles<1>(t, w, (int)k, (int)n, K, stream);
        default: return launch_exl3_decode_tiles<2>(t, w, (int)k, (int)n, K, stream);
    }
}

extern "C" int trellm_exl3_codebook_decode(const int32_t *states, void *out, int64_t count, int codebook,
                                           cudaStream_t stream) {
    if (count < 0) return TRELLM_E_BAD_SHAPE;
    if (count == 0) return TRELLM_OK;
    const int blocks = (int)((count + 255) / 256);
    half *o = static_cast<half *>(out);
    switch (codebook) {
        case 0: exl3_codebook_decode_kernel<0><<<blocks, 256, 0, stream>>>(states, o, count); break;
        case 1: exl3_codebook_decode_kernel<1><<<blocks, 256, 0, stream>>>(states, o, count); break;
        case 2: exl3_codebook_decode_kernel<2><<<blocks, 256, 0, stream>>>(states, o, count); break;
        default: return TRELLM_E_BAD_ARG;
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}
