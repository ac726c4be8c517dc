// LoRA updates per row (the BGMV kernels of Punica / S-LoRA): each row of a batch may use a different
// adapter slot, read from a device tensor, so one captured CUDA graph serves every mix of adapters.
//
// One launch per projection, or per group of projections of one x (q/k/v, gate/up): every block first
// computes its row's h = A_s x (rank x k multiply-adds, A read from L2), then adds B_s h to its columns of
// y. Computing h again in each column block costs less than a second launch at decode sizes, where
// launches and latency are the cost. The shrink is latency-bound (a few blocks, k up to 14336), so the
// whole block splits k and keeps SHRINK_ROWS rows of A in flight per step, reusing each load of x.
// The split route below (TRELLM_LORA_KERNEL=split) spreads the shrink over many blocks instead.
#include "common.cuh"

namespace {

constexpr int THREADS = 256;
constexpr int COLS_PER_THREAD = 4;  // columns of y per thread: 1024 per block
constexpr int VEC = 8;              // elements per 16-byte load of a 16-bit dtype

constexpr int SHRINK_ROWS = 16;  // rows of A whose loads one thread keeps in flight together (rank 16: one pass)

template <typename T> constexpr int elems16() { return 16 / (int)sizeof(T); }  // elements per 16-byte load

// The dot product of two 16-byte groups of T, in float.
template <typename T>
__device__ __forceinline__ float dot16(const uint4 &ux, const uint4 &ua) {
    const T *ex = reinterpret_cast<const T *>(&ux);
    const T *ea = reinterpret_cast<const T *>(&ua);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < elems16<T>(); ++i) acc += to_f32(ex[i]) * to_f32(ea[i]);
    return acc;
}

// acc += h[e] * u[e] over the 16-byte group u of a B row (in order: one rounding per term).
template <typename T>
__device__ __forceinline__ void fma_b16(const float *h, const uint4 &u, float &acc) {
    const T *eb = reinterpret_cast<const T *>(&u);
#pragma unroll
    for (int e = 0; e < elems16<T>(); ++e) acc += h[e] * to_f32(eb[e]);
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
                    if (r < rows) acc[r] += dot16<T>(ux, ua[r]);
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
            for (int j = 0; j < rank; j += VEC) fma_b16<T>(hs + j, __ldg(reinterpret_cast<const uint4 *>(br + j)), acc);
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

// ---- the split route (TRELLM_LORA_KERNEL=split): the shrink spread over many blocks, then the expand ----
//
// Launch 1 (shrink): block (row, part, k-slice) takes SPLIT_K elements of k for every rank row of its slot
// (warp w holds rows w*SPLIT_ROWS.. in registers) and writes its partial h to a float workspace
// [rows, parts, splits, rank]: the 128-460 KB of A a projection reads are spread over tens of SMs instead of
// read whole by each column block. Launch 2 (expand): block (row, column block) sums its row's partials
// (splits * rank floats from L2, in a fixed order: the result does not depend on the batch) and adds B_s h.
//
// Both are programmatic dependent launches: each lets the next kernel be scheduled at once (pdl_trigger) and,
// before pdl_wait, reads only what no kernel of the step writes (A into registers, B into shared memory) and
// the row's slot, to choose which rows to request while the kernel before (the base matmul, or the shrink)
// still runs. The slot is
// read again after pdl_wait (bypassing L1) and the factors reloaded if it changed, so correctness never
// rests on the early read. Every block passes pdl_wait before it exits, even with nothing to do, so that
// this grid's completion implies its predecessors' (the kernel after may read what they wrote).

constexpr int SPLIT_WARPS = 4;
constexpr int SPLIT_ROWS = 4;  // rows of A a warp holds per pass: 4 warps x 4 = rank 16 in one pass
constexpr int EXPAND_COLS = 2;  // columns of y per thread: THREADS * 2 = 512 per block
constexpr int EXPAND_PREFETCH = 16;  // rank values of a B row requested before pdl_wait
static_assert(TRELLM_LORA_SPLIT_K % (32 * 8) == 0, "a k-slice is whole 16-byte loads of every lane");

__device__ __forceinline__ bool slot_ok(int64_t s, int64_t num_slots) { return s >= 0 && s < num_slots; }

// A row's slot, read through L2 (an L1 line from a read before pdl_wait is never reused after it).
__device__ __forceinline__ int64_t read_slot(const int64_t *slots, int64_t row) {
    return (int64_t)__ldcg(reinterpret_cast<const long long *>(slots + row));
}

// A 16-byte load of factors (read-only while any kernel of a step runs) issued where it stands: asm volatile, so
// the compiler keeps a load written before pdl_wait before it (an __ldg may be sunk to its first use, after).
// ptxas keeps the shrink's before ACQBULK (checked in the SASS of all three dtypes, nvcc 13.0); the expand's
// it moved after, so the expand copies its B values with cp.async instead.
__device__ __forceinline__ uint4 load_factors16(const void *p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// A slice (16-byte loads) of rows r0..r0+SPLIT_ROWS-1 of slot s's A: lane's loads u at k0 + (u*32 + lane) * E;
// zeros past k or past the rank.
template <typename T, int LOADS>
__device__ __forceinline__ void load_a_slice(const T *__restrict__ a, int64_t s, int r0, int rank, int64_t k, int64_t k0,
                                             int lane, uint4 (&ua)[SPLIT_ROWS][LOADS]) {
    constexpr int E = elems16<T>();
#pragma unroll
    for (int r = 0; r < SPLIT_ROWS; ++r) {
        const T *ar = a + (s * rank + r0 + r) * k;
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int64_t c = k0 + (int64_t)(u * 32 + lane) * E;
            ua[r][u] = make_uint4(0, 0, 0, 0);
            if (r0 + r < rank && c < k) ua[r][u] = load_factors16(ar + c);
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(SPLIT_WARPS * 32) lora_shrink_kernel(const T *x, int64_t ldx, Parts parts,
                                                                       const int64_t *__restrict__ slots, float *partial,
                                                                       int64_t k, int64_t num_slots, int rank, int splits) {
    pdl_trigger();
    constexpr int E = elems16<T>();
    constexpr int LOADS = TRELLM_LORA_SPLIT_K / (32 * E);  // 16-byte loads per lane per A row of the slice
    const int part = (int)blockIdx.y / splits, split = (int)blockIdx.y % splits;
    const int64_t row = blockIdx.x, k0 = (int64_t)split * TRELLM_LORA_SPLIT_K;
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, first = warp * SPLIT_ROWS;
    Part p = parts.p[0];  // selected without a run-time index into the parameters (no local copy)
#pragma unroll
    for (int i = 1; i < TRELLM_LORA_MAX_PARTS; ++i)
        if (i == part && i < parts.count) p = parts.p[i];
    const T *a = static_cast<const T *>(p.a);
    const bool vec = p.vec;
    const int64_t s_early = read_slot(slots, row);
    uint4 ua[SPLIT_ROWS][LOADS];
    if (vec && slot_ok(s_early, num_slots) && first < rank) load_a_slice<T, LOADS>(a, s_early, first, rank, k, k0, lane, ua);
    pdl_wait();  // from here on x (and the slot) as the kernels before left them
    const T *xr = x + row * ldx;  // x, y and the partials: plain loads (the kernel before wrote them while this one ran)
    uint4 ux[LOADS];  // requested with the slot, not after it (x is needed whenever the slot is valid)
    if (vec) {
#pragma unroll
        for (int u = 0; u < LOADS; ++u) {
            const int64_t c = k0 + (int64_t)(u * 32 + lane) * E;
            ux[u] = c < k ? *reinterpret_cast<const uint4 *>(xr + c) : make_uint4(0, 0, 0, 0);
        }
    }
    const int64_t s = read_slot(slots, row);
    if (!slot_ok(s, num_slots)) return;
    float *out = partial + (((int64_t)row * parts.count + part) * splits + split) * rank;
    if (vec) {
        for (int r0 = first; r0 < rank; r0 += SPLIT_WARPS * SPLIT_ROWS) {
            if (r0 != first || s != s_early) load_a_slice<T, LOADS>(a, s, r0, rank, k, k0, lane, ua);
#pragma unroll
            for (int r = 0; r < SPLIT_ROWS; ++r) {
                float acc = 0.f;
#pragma unroll
                for (int u = 0; u < LOADS; ++u) acc += dot16<T>(ux[u], ua[r][u]);
                acc = warp_sum(acc);
                if (lane == 0 && r0 + r < rank) out[r0 + r] = acc;
            }
        }
    } else {  // element loads: k or a row start not in whole 16-byte groups
        const int64_t end = min(k, k0 + (int64_t)TRELLM_LORA_SPLIT_K);
        for (int r0 = first; r0 < rank; r0 += SPLIT_WARPS * SPLIT_ROWS) {
            float acc[SPLIT_ROWS];
#pragma unroll
            for (int r = 0; r < SPLIT_ROWS; ++r) acc[r] = 0.f;
            for (int64_t c = k0 + lane; c < end; c += 32) {
                const float xv = to_f32(xr[c]);
#pragma unroll
                for (int r = 0; r < SPLIT_ROWS; ++r)
                    if (r0 + r < rank) acc[r] += xv * to_f32(a[(s * rank + r0 + r) * k + c]);
            }
#pragma unroll
            for (int r = 0; r < SPLIT_ROWS; ++r) {
                const float v = warp_sum(acc[r]);
                if (lane == 0 && r0 + r < rank) out[r0 + r] = v;
            }
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(THREADS) lora_expand_kernel(Parts parts, const int64_t *__restrict__ slots,
                                                              const float *partial, int64_t num_slots, int rank, int splits) {
    pdl_trigger();
    constexpr int E = elems16<T>();
    constexpr int PRE = EXPAND_PREFETCH / E;  // 16-byte loads per column requested before pdl_wait
    __shared__ float hs[TRELLM_LORA_MAX_RANK];
    __shared__ float sums[THREADS];
    int part = 0;
    Part p = parts.p[0];
#pragma unroll
    for (int i = 1; i < TRELLM_LORA_MAX_PARTS; ++i)
        if (i < parts.count && (int)blockIdx.y >= parts.p[i].first_block) part = i, p = parts.p[i];
    const T *y = static_cast<const T *>(p.y);
    T *out = static_cast<T *>(p.out);
    const T *b = static_cast<const T *>(p.b);
    const int64_t n = p.n, row = blockIdx.x, col_block = (int64_t)blockIdx.y - p.first_block;
    const int64_t width = num_slots * rank;
    const bool vec_b = rank % E == 0 && width % E == 0 && ((uintptr_t)b % 16) == 0;
    auto column = [&](int i) { return (col_block * EXPAND_COLS + i) * THREADS + threadIdx.x; };
    // The thread's first B values, copied to shared memory before pdl_wait (cp.async: register loads written
    // there are moved after it by ptxas); each thread reads back only its own copies.
    __shared__ uint4 b_early[EXPAND_COLS][PRE][THREADS];
    const int64_t s_early = read_slot(slots, row);
    const bool early = vec_b && slot_ok(s_early, num_slots);
    if (early) {
#pragma unroll
        for (int i = 0; i < EXPAND_COLS; ++i) {
            const T *br = b + column(i) * width + s_early * rank;
#pragma unroll
            for (int q = 0; q < PRE; ++q)
                if (column(i) < n && q * E < rank) cp_async_16(&b_early[i][q][threadIdx.x], br + q * E);
        }
    }
    cp_async_commit();
    pdl_wait();  // from here on y, the partials (and the slot) as the kernels before left them
    // The slot, the partials and y requested together (a row without a slot has no partials: in bounds,
    // their values unused). h = the sum of the splits' partials: thread t adds splits g, g + groups, ...
    // of rank value t % rank.
    const int64_t s = read_slot(slots, row);
    const int groups = THREADS / rank, j = threadIdx.x % rank, g = threadIdx.x / rank;
    const float *pr = partial + ((int64_t)row * parts.count + part) * splits * rank;
    float v = 0.f;
    if (g < groups)
        for (int sp = g; sp < splits; sp += groups) v += pr[(int64_t)sp * rank + j];
    float yv[EXPAND_COLS];
#pragma unroll
    for (int i = 0; i < EXPAND_COLS; ++i) yv[i] = column(i) < n ? to_f32(y[row * p.ldy + column(i)]) : 0.f;
    if (!slot_ok(s, num_slots)) {  // the row as it is (nothing to do in place; 16-bit -> float -> 16-bit is exact)
        cp_async_wait<0>();  // no copy left in flight (the slot was valid before pdl_wait, as it never should be)
        if (y == out) return;
#pragma unroll
        for (int i = 0; i < EXPAND_COLS; ++i)
            if (column(i) < n) out[row * p.ldo + column(i)] = from_f32<T>(yv[i]);
        return;
    }
    sums[threadIdx.x] = v;
    __syncthreads();
    if ((int)threadIdx.x < rank) {
        float h = 0.f;
        for (int gi = 0; gi < groups; ++gi) h += sums[gi * rank + threadIdx.x];
        hs[threadIdx.x] = h;
    }
    __syncthreads();
    const bool prefetched = early && s == s_early;
    cp_async_wait<0>();
#pragma unroll
    for (int i = 0; i < EXPAND_COLS; ++i) {
        const int64_t c = column(i);
        if (c >= n) continue;
        const T *br = b + c * width + s * rank;
        float acc = 0.f;
        if (vec_b) {
#pragma unroll
            for (int q = 0; q < PRE; ++q) {
                if (q * E >= rank) break;
                fma_b16<T>(hs + q * E, prefetched ? b_early[i][q][threadIdx.x] : __ldg(reinterpret_cast<const uint4 *>(br + q * E)), acc);
            }
            for (int j0 = EXPAND_PREFETCH; j0 < rank; j0 += E)
                fma_b16<T>(hs + j0, __ldg(reinterpret_cast<const uint4 *>(br + j0)), acc);
        } else {
            for (int jj = 0; jj < rank; ++jj) acc += hs[jj] * to_f32(br[jj]);
        }
        out[row * p.ldo + c] = from_f32<T>(yv[i] + acc);
    }
}

constexpr int64_t EXPAND_COLS_PER_BLOCK = THREADS * EXPAND_COLS;

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

extern "C" int trellm_lora_add_split(const void *x, int64_t ldx, int count, const void *const *y, const int64_t *ldy,
                                     void *const *out, const int64_t *ldo, const void *const *a, const void *const *b,
                                     const int64_t *n, const int64_t *slots, float *workspace, int64_t rows, int64_t k,
                                     int64_t num_slots, int64_t rank, int dtype, cudaStream_t stream) {
    if (!shape_ok(rows, k, num_slots, rank) || count < 1 || count > TRELLM_LORA_MAX_PARTS || ldx < k)
        return TRELLM_E_BAD_SHAPE;
    const int64_t splits = (k + TRELLM_LORA_SPLIT_K - 1) / TRELLM_LORA_SPLIT_K;
    Parts parts{};
    parts.count = count;
    int64_t blocks = 0;
    for (int i = 0; i < count; ++i) {
        if (n[i] <= 0 || ldy[i] < n[i] || ldo[i] < n[i]) return TRELLM_E_BAD_SHAPE;
        parts.p[i] = Part{y[i], out[i], ldy[i], ldo[i], n[i], a[i], b[i], (int)blocks, vec_ok(x, ldx, a[i], k)};
        blocks += (n[i] + EXPAND_COLS_PER_BLOCK - 1) / EXPAND_COLS_PER_BLOCK;
    }
    if (blocks > 65535 || count * splits > 65535) return TRELLM_E_BAD_SHAPE;
    if (rows == 0) return TRELLM_OK;
    TRELLM_DISPATCH_DTYPE(dtype, T, {
        cudaError_t err = launch_pdl(lora_shrink_kernel<T>, dim3((unsigned)rows, (unsigned)(count * splits)),
                                     dim3(SPLIT_WARPS * 32), 0, stream, static_cast<const T *>(x), ldx, parts, slots,
                                     workspace, k, num_slots, (int)rank, (int)splits);
        if (err != cudaSuccess) return (int)err;
        err = launch_pdl(lora_expand_kernel<T>, dim3((unsigned)rows, (unsigned)blocks), dim3(THREADS), 0, stream, parts,
                         slots, static_cast<const float *>(workspace), num_slots, (int)rank, (int)splits);
        if (err != cudaSuccess) return (int)err;
    });
    return TRELLM_OK;
}
