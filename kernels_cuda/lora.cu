// LoRA updates per row (the BGMV kernels of Punica / S-LoRA): each row of a batch may use a different
// adapter slot, read from a device tensor, so one captured CUDA graph serves every mix of adapters.
#include "common.cuh"

namespace {

constexpr int SHRINK_WARPS = 8;  // rank rows per shrink block, one warp each
constexpr int EXPAND_THREADS = 256;

// h[row, j] = a[s * rank + j, :] . x[row, :] for j < rank, s = slots[row] (rows without a slot skipped).
template <typename T>
__global__ void lora_shrink_kernel(const T *__restrict__ x, int64_t ldx, const T *__restrict__ a,
                                   const int64_t *__restrict__ slots, float *__restrict__ h, int64_t k,
                                   int64_t num_slots, int rank) {
    const int64_t row = blockIdx.x;
    const int64_t s = slots[row];
    const int j = blockIdx.y * SHRINK_WARPS + threadIdx.x / 32;
    if (s < 0 || s >= num_slots || j >= rank) return;
    const int lane = threadIdx.x & 31;
    const T *xr = x + row * ldx;
    const T *ar = a + (s * rank + j) * k;
    float acc = 0.f;
    for (int64_t c = lane; c < k; c += 32) acc += to_f32(xr[c]) * to_f32(ar[c]);
    acc = warp_sum(acc);
    if (lane == 0) h[row * rank + j] = acc;
}

// y[row, c] += b[c, s * rank : (s + 1) * rank] . h[row, :]
template <typename T>
__global__ void lora_expand_kernel(T *__restrict__ y, int64_t ldy, const T *__restrict__ b,
                                   const int64_t *__restrict__ slots, const float *__restrict__ h, int64_t n,
                                   int64_t num_slots, int rank) {
    __shared__ float hs[TRELLM_LORA_MAX_RANK];
    const int64_t row = blockIdx.x;
    const int64_t s = slots[row];
    if (s < 0 || s >= num_slots) return;
    for (int j = threadIdx.x; j < rank; j += blockDim.x) hs[j] = h[row * rank + j];
    __syncthreads();
    const int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= n) return;
    const T *br = b + c * (num_slots * rank) + s * rank;
    float acc = 0.f;
    for (int j = 0; j < rank; ++j) acc += hs[j] * to_f32(br[j]);
    T *yp = y + row * ldy + c;
    *yp = from_f32<T>(to_f32(*yp) + acc);
}

template <typename T>
int launch(const void *x, int64_t ldx, void *y, int64_t ldy, const void *a, const void *b, const int64_t *slots,
           float *h, int64_t rows, int64_t k, int64_t n, int64_t num_slots, int rank, cudaStream_t stream) {
    dim3 shrink_grid((unsigned)rows, (unsigned)((rank + SHRINK_WARPS - 1) / SHRINK_WARPS));
    lora_shrink_kernel<T><<<shrink_grid, SHRINK_WARPS * 32, 0, stream>>>(
        static_cast<const T *>(x), ldx, static_cast<const T *>(a), slots, h, k, num_slots, rank);
    TRELLM_LAUNCH_CHECK();
    dim3 expand_grid((unsigned)rows, (unsigned)((n + EXPAND_THREADS - 1) / EXPAND_THREADS));
    lora_expand_kernel<T><<<expand_grid, EXPAND_THREADS, 0, stream>>>(
        static_cast<T *>(y), ldy, static_cast<const T *>(b), slots, h, n, num_slots, rank);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_lora_add(const void *x, int64_t ldx, void *y, int64_t ldy, const void *a, const void *b,
                               const int64_t *slots, float *h, int64_t rows, int64_t k, int64_t n, int64_t num_slots,
                               int64_t rank, int dtype, cudaStream_t stream) {
    if (rows < 0 || k <= 0 || n <= 0 || num_slots <= 0 || rank <= 0 || rank > TRELLM_LORA_MAX_RANK || ldx < k || ldy < n)
        return TRELLM_E_BAD_SHAPE;
    if (rows == 0) return TRELLM_OK;
    if (rows > 0x7fffffff) return TRELLM_E_BAD_SHAPE;
    TRELLM_DISPATCH_DTYPE(dtype, T,
        return launch<T>(x, ldx, y, ldy, a, b, slots, h, rows, k, n, num_slots, (int)rank, stream));
    return TRELLM_OK;
}
