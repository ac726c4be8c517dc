// LoRA updates per row (the BGMV kernels of Punica / S-LoRA): each row of a batch may use a different
// adapter slot, read from a device tensor, so one captured CUDA graph serves every mix of adapters.
//
// One launch per projection, or per group of projections of one x (q/k/v, gate/up): every block first
// computes its row's h = A_s x (rank x k multiply-adds, A read from L2), then adds B_s h to its columns of
// y. Computing h again in each column block costs less than a second launch at decode sizes, where
// launches and latency are the cost. The shrink is latency-bound (a few blocks, k up to 14336), so the
// whole block splits k and keeps SHRINK_ROWS rows of A in flight per step, reusing each load of x.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int COLS_PER_THREAD = 4;  // columns of y per thread: 1024 per block
constexpr int VEC = 8;              // elements per 16-byte load of a 16-bit dtype

constexpr int SHRINK_ROWS = 16;  // rows of A whose loads one thread keeps in flight together (rank 16: one pass)

template <typename T>
__device__ __forceinline__ float dot8(const uint4 &ux, const uint4 &ua) {
    const T *ex = reinterpret_cast<const T *>(&ux);
    const T *ea = reinterpret_cast<const T *>(&ua);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc += to_f32(ex[i]) * to_f32(ea[i]);
    return acc;
}

// hs[j] = a_s[j, :] . x for j < rank, by the whole block: each thread takes every THREADS-th 16-byte
// group of k (or element, without vec), SHRINK_ROWS rows at a time, then warps and the block reduce.
template <typename T>
__device__ void shrink(const T *__restrict__ x, const T *__restrict__ a_s, int64_t k, int rank, bool vec, float *hs) {
    __shared__ float partial[THREADS / 32][SHRINK_ROWS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int j0 = 0; j0 < rank; j0 += SHRINK_ROWS) {
        const int rows = min(SHRINK_ROWS, rank - j0);
        const T *a0 = a_s + (int64_t)j0 * k;
        float acc[SHRINK_ROWS];
#pragma unroll
        for (int r = 0; r < SHRINK_ROWS; ++r) acc[r] = 0.f;
        if (vec) {  // 16-byte loads: k % 8 == 0 and x, a 16-byte aligned (checked on the host)
            for (int64_t c = (int64_t)threadIdx.x * VEC; c < k; c += THREADS * VEC) {
                const uint4 ux = *reinterpret_cast<const uint4 *>(x + c);
                uint4 ua[SHRINK_ROWS];
#pragma unroll
                for (int r = 0; r < SHRINK_ROWS; ++r)
                    if (r < rows) ua[r] = __ldg(reinterpret_cast<const uint4 *>(a0 + r * k + c));
#pragma unroll
                for (int r = 0; r < SHRINK_ROWS; ++r)
                    if (r < rows) acc[r] += dot8<T>(ux, ua[r]);
            }
        } else {
            for (int64_t c = threadIdx.x; c < k; c += THREADS) {
                const float xv = to_f32(x[c]);
#pragma unroll
                for (int r = 0; r < SHRINK_ROWS; ++r)
                    if (r < rows) acc[r] += xv * to_f32(a0[r * k + c]);
            }
        }
#pragma unroll
        for (int r = 0; r < SHRINK_ROWS; ++r) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) partial[warp][r] = v;
        }
        __syncthreads();
        if (threadIdx.x < rows) {
            float h = 0.f;
#pragma unroll
            for (int w = 0; w < THREADS / 32; ++w) h += partial[w][threadIdx.x];
            hs[j0 + threadIdx.x] = h;
        }
        __syncthreads();  // hs written; partial free for the next rows
    }
}

// One projection's share of a launch: its output columns and factors. Several parts of one x (q/k/v,
// gate/up) go in one launch: the grid's column blocks are split between them, each block serves one part.
struct Part {
    const void *y;
    void *out;
    int64_t ldy, ldo, n;
    const void *a, *b;
    int first_block;  // this part's first column block (blockIdx.y)
    bool vec;         // a's rows (and x) allow 16-byte loads
};

struct Parts {
    Part p[TRELLM_LORA_MAX_PARTS];
    int count;
};

template <typename T>
__global__ void __launch_bounds__(THREADS, 2) lora_add_kernel(const T *__restrict__ x, int64_t ldx, Parts parts, const int64_t *__restrict__ slots,
                                int64_t k, int64_t num_slots, int rank) {
    __shared__ float hs[TRELLM_LORA_MAX_RANK];
    Part part = parts.p[0];
#pragma unroll
    for (int i = 1; i < TRELLM_LORA_MAX_PARTS; ++i)
        if (i < parts.count && (int)blockIdx.y >= parts.p[i].first_block) part = parts.p[i];
    const T *y = static_cast<const T *>(part.y);
    T *out = static_cast<T *>(part.out);
    const int64_t n = part.n, ldy = part.ldy, ldo = part.ldo, col_block = (int64_t)blockIdx.y - part.first_block;
    const int64_t row = blockIdx.x;
    const int64_t s = slots[row];
    if (s < 0 || s >= num_slots) {  // the row as it is (nothing to do in place)
        if (y == out) return;
        for (int i = 0; i < COLS_PER_THREAD; ++i) {
            const int64_t c = (col_block * COLS_PER_THREAD + i) * THREADS + threadIdx.x;
            if (c < n) out[row * ldo + c] = y[row * ldy + c];
        }
        return;
    }
    const T *a = static_cast<const T *>(part.a);
    const T *b = static_cast<const T *>(part.b);
    shrink<T>(x + row * ldx, a + s * rank * k, k, rank, part.vec && sizeof(T) == 2, hs);
    const int64_t width = num_slots * rank;
    // B_s h: a thread's columns are independent, so their loads overlap; 16-byte loads of a B row when
    // its slot's rank values are whole, aligned 16-byte groups
    const bool vec_b = sizeof(T) == 2 && rank % VEC == 0 && width % VEC == 0 && ((uintptr_t)b % 16) == 0;
#pragma unroll
    for (int i = 0; i < COLS_PER_THREAD; ++i) {
        const int64_t c = (col_block * COLS_PER_THREAD + i) * THREADS + threadIdx.x;
        if (c >= n) break;
        const T *br = b + c * width + s * rank;
        float acc = 0.f;
        if (vec_b) {
            for (int j = 0; j < rank; j += VEC) {
                const uint4 ub = __ldg(reinterpret_cast<const uint4 *>(br + j));
                const T *eb = reinterpret_cast<const T *>(&ub);
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc += hs[j + e] * to_f32(eb[e]);
            }
        } else {
            for (int j = 0; j < rank; ++j) acc += hs[j] * to_f32(br[j]);
        }
        out[row * ldo + c] = from_f32<T>(to_f32(y[row * ldy + c]) + acc);
    }
}

constexpr int64_t COLS_PER_BLOCK = THREADS * COLS_PER_THREAD;

int launch(const void *x, int64_t ldx, Parts &parts, int blocks, const int64_t *slots, int64_t rows, int64_t k,
           int64_t num_slots, int64_t rank, int dtype, cudaStream_t stream) {
    if (rows == 0) return TRELLM_OK;
    const dim3 grid((unsigned)rows, (unsigned)blocks);
    TRELLM_DISPATCH_DTYPE(dtype, T, {
        lora_add_kernel<T><<<grid, THREADS, 0, stream>>>(static_cast<const T *>(x), ldx, parts, slots, k, num_slots, (int)rank);
        TRELLM_LAUNCH_CHECK();
    });
    return TRELLM_OK;
}

bool vec_ok(const void *x, int64_t ldx, const void *a, int64_t k) {
    return k % VEC == 0 && ldx % VEC == 0 && ((uintptr_t)x % 16) == 0 && ((uintptr_t)a % 16) == 0;
}

bool shape_ok(int64_t rows, int64_t k, int64_t num_slots, int64_t rank) {
    return rows >= 0 && rows <= 0x7fffffff && k > 0 && num_slots > 0 && rank > 0 && rank <= TRELLM_LORA_MAX_RANK;
}

}  // namespace

extern "C" int trellm_lora_add(const void *x, int64_t ldx, const void *y, int64_t ldy, void *out, int64_t ldo,
                               const void *a, const void *b, const int64_t *slots, int64_t rows, int64_t k, int64_t n,
                               int64_t num_slots, int64_t rank, int dtype, cudaStream_t stream) {
    if (!shape_ok(rows, k, num_slots, rank) || n <= 0 || ldx < k || ldy < n || ldo < n) return TRELLM_E_BAD_SHAPE;
    Parts parts{};
    parts.count = 1;
    parts.p[0] = Part{y, out, ldy, ldo, n, a, b, 0, vec_ok(x, ldx, a, k)};
    return launch(x, ldx, parts, (int)((n + COLS_PER_BLOCK - 1) / COLS_PER_BLOCK), slots, rows, k, num_slots, rank, dtype, stream);
}

extern "C" int trellm_lora_add_parts(const void *x, int64_t ldx, int count, void *const *y, const int64_t *ldy,
                                     const void *const *a, const void *const *b, const int64_t *n, const int64_t *slots,
                                     int64_t rows, int64_t k, int64_t num_slots, int64_t rank, int dtype,
                                     cudaStream_t stream) {
    if (!shape_ok(rows, k, num_slots, rank) || count < 1 || count > TRELLM_LORA_MAX_PARTS || ldx < k)
        return TRELLM_E_BAD_SHAPE;
    Parts parts{};
    parts.count = count;
    int64_t blocks = 0;
    for (int i = 0; i < count; ++i) {
        if (n[i] <= 0 || ldy[i] < n[i]) return TRELLM_E_BAD_SHAPE;
        parts.p[i] = Part{y[i], y[i], ldy[i], ldy[i], n[i], a[i], b[i], (int)blocks, vec_ok(x, ldx, a[i], k)};
        blocks += (n[i] + COLS_PER_BLOCK - 1) / COLS_PER_BLOCK;
    }
    if (blocks > 65535) return TRELLM_E_BAD_SHAPE;
    return launch(x, ldx, parts, (int)blocks, slots, rows, k, num_slots, rank, dtype, stream);
}
