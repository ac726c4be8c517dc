// Hyper-connection (mHC) kernels: the weights a block reads its input through and the merge of its output back
// into the N residual streams (DeepSeek V4, GLM 5.3). In torch a block's weights take ~140 small kernels (the
// Sinkhorn loop alone 6 per iteration) and its merge ~5; here two launches and one.
//
// hc_mix_kernel: one block per (mix row, token): the raw dot product of the flattened streams x [N * D] with
// fn's row and the sum of squares of x, stored as dot * rsqrt(mean(x^2) + norm_eps) (the RMS norm of x, which
// is linear in x, applied after the product).
// hc_weights_kernel: one block per token: pre / post / comb from the (2 + N) * N mixes in one thread, the N x N
// matrix in its registers (the Sinkhorn is ~40 N^2 flops a token), then every thread sums the streams weighted
// by pre for its columns.
// hc_merge_kernel: one thread per (token, column): the N new streams post[i] * out + sum_j comb[j][i] * x_j.
#include "common.cuh"

namespace {

constexpr int HC_THREADS = 256;

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// grid (mixes, tokens). x [tokens, k] (dtype), fn float32 [mixes, k], k % 4 == 0; raw float32 [tokens, mixes].
__global__ void __launch_bounds__(HC_THREADS) hc_mix_kernel(const void *x, int dtype, const float *fn, float *raw,
                                                            int64_t k, float norm_eps) {
    __shared__ float red[HC_THREADS / 32][2];
    const int row = blockIdx.x, mixes = gridDim.x;
    const size_t t = blockIdx.y;
    const size_t base = t * (size_t)k;
    const float *w = fn + (size_t)row * k;
    float dot = 0.f, ssq = 0.f;
#pragma unroll 4  // several loads in flight per thread: at batch 1 only (2 + N) * N blocks read fn
    for (int64_t i = 4 * (int64_t)threadIdx.x; i < k; i += 4 * HC_THREADS) {
        float v[4];
        load4_as_f32(x, dtype, base + i, v);
        const float4 f = *reinterpret_cast<const float4 *>(w + i);
        dot += v[0] * f.x + v[1] * f.y + v[2] * f.z + v[3] * f.w;
        ssq += v[0] * v[0] + v[1] * v[1] + v[2] * v[2] + v[3] * v[3];
    }
    dot = warp_sum(dot);
    ssq = warp_sum(ssq);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { red[warp][0] = dot; red[warp][1] = ssq; }
    __syncthreads();
    if (threadIdx.x == 0) {
        dot = ssq = 0.f;
        for (int w2 = 0; w2 < HC_THREADS / 32; ++w2) { dot += red[w2][0]; ssq += red[w2][1]; }
        raw[t * mixes + row] = dot * rsqrtf(ssq / (float)k + norm_eps);
    }
}

// pre / post / comb of one token from its (2 + N) * N mixes m, in one thread. N is a compile-time constant so the
// N x N matrix lives in registers with every index static: the Sinkhorn loop is a chain of dependent
// reductions, and through shared memory (the first version) its latency was ~70 us per token on an H200 at N = 4.
// The operations and their order are the reference loop's, so the results are the same bits.
template <int N>
__device__ __forceinline__ void hc_token_weights(const float *__restrict__ m, const float *__restrict__ bias,
                                                 const float *__restrict__ scale, float *pre,
                                                 float *__restrict__ post, float *__restrict__ comb,
                                                 int sinkhorn_iters, float eps) {
    float c[N][N];
#pragma unroll
    for (int i = 0; i < N; ++i) {  // row softmax of the comb logits, + eps
        float top = -INFINITY;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            c[i][j] = m[2 * N + i * N + j] * scale[2] + bias[2 * N + i * N + j];
            top = fmaxf(top, c[i][j]);
        }
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            c[i][j] = expf(c[i][j] - top);
            sum += c[i][j];
        }
#pragma unroll
        for (int j = 0; j < N; ++j) c[i][j] = c[i][j] / sum + eps;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
        pre[i] = hc_sigmoid(m[i] * scale[0] + bias[i]) + eps;
        post[i] = 2.f * hc_sigmoid(m[N + i] * scale[1] + bias[N + i]);
    }
    for (int it = 0; it < max(sinkhorn_iters, 1); ++it) {  // columns; then iters - 1 times rows and columns
        if (it > 0) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                float sum = 0.f;
#pragma unroll
                for (int j = 0; j < N; ++j) sum += c[i][j];
#pragma unroll
                for (int j = 0; j < N; ++j) c[i][j] /= sum + eps;
            }
        }
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float sum = 0.f;
#pragma unroll
            for (int i = 0; i < N; ++i) sum += c[i][j];
#pragma unroll
            for (int i = 0; i < N; ++i) c[i][j] /= sum + eps;
        }
    }
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) comb[i * N + j] = c[i][j];
}

// grid (tokens). raw [tokens, (2 + n) * n] -> post float32 [tokens, n], comb float32 [tokens, n, n] and
// block_input [tokens, d] (dtype) = sum_j pre[j] * x[t, j, :].
__global__ void __launch_bounds__(HC_THREADS) hc_weights_kernel(const void *x, int dtype, const float *__restrict__ raw,
                                                                const float *__restrict__ bias,
                                                                const float *__restrict__ scale,
                                                                float *__restrict__ post, float *__restrict__ comb,
                                                                void *block_input, int n, int64_t d,
                                                                int sinkhorn_iters, float eps) {
    __shared__ float pre[TRELLM_HC_MAX_STREAMS];
    const size_t t = blockIdx.x;
    if (threadIdx.x == 0) {
        const float *m = raw + t * (size_t)(2 + n) * n;
        float *p = post + t * n, *cb = comb + t * (size_t)n * n;
        switch (n) {
            case 1: hc_token_weights<1>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 2: hc_token_weights<2>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 3: hc_token_weights<3>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 4: hc_token_weights<4>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 5: hc_token_weights<5>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 6: hc_token_weights<6>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            case 7: hc_token_weights<7>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;
            default: hc_token_weights<8>(m, bias, scale, pre, p, cb, sinkhorn_iters, eps); break;  // n <= 8 (checked)
        }
    }
    __syncthreads();
    const size_t row = t * (size_t)n * d;
    for (int64_t col = threadIdx.x; col < d; col += HC_THREADS) {
        float sum = 0.f;
        for (int j = 0; j < n; ++j) sum += pre[j] * load_as_f32(x, dtype, row + (size_t)j * d + col);
        store_from_f32(block_input, dtype, t * (size_t)d + col, sum);
    }
}

// One thread per (token, column): y[t, i, col] = round(round(post[t, i]) * out[t, col]) + round(sum_j
// round(comb[t, j, i]) * x[t, j, col]), rounded again (the reference's products and sum in the streams' dtype).
__global__ void __launch_bounds__(HC_THREADS) hc_merge_kernel(const void *x, const void *out, const float *post,
                                                              const float *comb, void *y, int dtype, int n, int64_t d,
                                                              int64_t total) {
    const int64_t i = (int64_t)blockIdx.x * HC_THREADS + threadIdx.x;
    if (i >= total) return;
    const int64_t t = i / d, col = i % d;
    const size_t row = (size_t)t * n * d + col;
    float xs[TRELLM_HC_MAX_STREAMS];
    for (int j = 0; j < n; ++j) xs[j] = load_as_f32(x, dtype, row + (size_t)j * d);
    const float o = load_as_f32(out, dtype, (size_t)t * d + col);
    for (int s = 0; s < n; ++s) {
        float mixed = 0.f;
        for (int j = 0; j < n; ++j) mixed += round_as(comb[((size_t)t * n + j) * n + s], dtype) * xs[j];
        const float spread = round_as(round_as(post[(size_t)t * n + s], dtype) * o, dtype);
        store_from_f32(y, dtype, row + (size_t)s * d, spread + round_as(mixed, dtype));
    }
}

bool hc_dtype_ok(int d) { return d >= TRELLM_F16 && d <= TRELLM_F32; }

}  // namespace

extern "C" int trellm_hyper_connection_weights(const void *x, int dtype, const float *fn, const float *bias,
                                               const float *scale, float *raw, float *post, float *comb,
                                               void *block_input, int64_t tokens, int64_t streams, int64_t dim,
                                               int64_t sinkhorn_iters, float eps, float norm_eps,
                                               cudaStream_t stream) {
    if (!hc_dtype_ok(dtype)) return TRELLM_E_BAD_DTYPE;
    if (tokens < 0 || streams < 1 || streams > TRELLM_HC_MAX_STREAMS || dim < 1 || dim % 4 || sinkhorn_iters < 0 ||
        tokens > 65535 || dim * streams > INT32_MAX || sinkhorn_iters > INT32_MAX)
        return TRELLM_E_BAD_SHAPE;
    if (tokens == 0) return TRELLM_OK;
    const int mixes = (int)((2 + streams) * streams);
    hc_mix_kernel<<<dim3(mixes, (unsigned)tokens), HC_THREADS, 0, stream>>>(x, dtype, fn, raw, streams * dim, norm_eps);
    TRELLM_LAUNCH_CHECK();
    hc_weights_kernel<<<(unsigned)tokens, HC_THREADS, 0, stream>>>(x, dtype, raw, bias, scale, post, comb, block_input,
                                                                  (int)streams, dim, (int)sinkhorn_iters, eps);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

extern "C" int trellm_hyper_connection_merge(const void *x, const void *out, const float *post, const float *comb,
                                             void *y, int dtype, int64_t tokens, int64_t streams, int64_t dim,
                                             cudaStream_t stream) {
    if (!hc_dtype_ok(dtype)) return TRELLM_E_BAD_DTYPE;
    if (tokens < 0 || streams < 1 || streams > TRELLM_HC_MAX_STREAMS || dim < 1) return TRELLM_E_BAD_SHAPE;
    const int64_t total = tokens * dim;
    if (total == 0) return TRELLM_OK;
    const int64_t blocks = (total + HC_THREADS - 1) / HC_THREADS;
    if (blocks > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    hc_merge_kernel<<<(unsigned)blocks, HC_THREADS, 0, stream>>>(x, out, post, comb, y, dtype, (int)streams, dim, total);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}
