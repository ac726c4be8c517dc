// EXL3 small-batch matmul (m <= 32) and tile decoding, templated on K (bits) and codebook.
//
// The GEMV computes partial[s, m, n] = sum over the k-slice s of xh[m, k] * W_hat[k, n].
// A lane holding trellis positions 8t..8t+7 of a tile holds exactly the m16n8k16 A fragment of the
// TRANSPOSED tile (rows = output columns, cols = k), so one mma.m16n8k16 per tile multiplies
// W_hat^T (16 n x 16 k) by xh^T (16 k x 8 rows of x): batch 1..8 wastes nothing, and each further
// group of 8 rows of x reuses the decoded fragment for one more mma.
//
// Work split: a block of WARPS warps owns a k-slice of WARPS*KT tiles and a run of column tiles;
// each warp owns KT tiles of that slice (its x fragments stay in registers) and walks the column
// tiles, prefetching the next column's trellis words while decoding the current ones. The warps add
// their 16x8 results into a shared-memory accumulator; the block writes it once per slice.
#pragma once

#include "common.cuh"

namespace trellm {

constexpr int GEMV_WARPS = 8;
constexpr int GEMV_KT = 8;                          // k tiles per warp
constexpr int GEMV_SLICE = GEMV_WARPS * GEMV_KT;    // k tiles per block slice

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Decoded A fragment of the transposed tile: {e0e1, e4e5, e2e3, e6e7}.
template <int K, int CB> __device__ __forceinline__ void tile_fragment(const uint32_t (&raw)[TileGeom<K>::NW], int r,
                                                                      uint32_t (&a)[4]) {
    uint32_t st[8];
    lane_states<K>(raw, r, st);
    half2 p01 = decode_pair<CB>(st[0], st[1]);
    half2 p45 = decode_pair<CB>(st[4], st[5]);
    half2 p23 = decode_pair<CB>(st[2], st[3]);
    half2 p67 = decode_pair<CB>(st[6], st[7]);
    a[0] = *reinterpret_cast<uint32_t *>(&p01);
    a[1] = *reinterpret_cast<uint32_t *>(&p45);
    a[2] = *reinterpret_cast<uint32_t *>(&p23);
    a[3] = *reinterpret_cast<uint32_t *>(&p67);
}

template <int K, int CB, int MT>
__global__ void __launch_bounds__(GEMV_WARPS * 32) exl3_gemv_kernel(const half *__restrict__ xh,
                                                                    const uint32_t *__restrict__ trellis,
                                                                    float *__restrict__ partial, int m, int k, int n,
                                                                    int cols_per_block) {
    using G = TileGeom<K>;
    constexpr int ACC_STRIDE = MT * 8 + 1;  // padded row of the shared accumulator
    extern __shared__ float acc_smem[];     // [cols_per_block * 16][ACC_STRIDE]

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tiles_k = k / 16, tiles_n = n / 16;
    const int slice = blockIdx.y;
    const int j_begin = blockIdx.x * cols_per_block;
    const int j_end = min(j_begin + cols_per_block, tiles_n);
    const int i_begin = slice * GEMV_SLICE + warp * GEMV_KT;

    for (int idx = threadIdx.x; idx < cols_per_block * 16 * ACC_STRIDE; idx += blockDim.x) acc_smem[idx] = 0.f;

    // x fragments (B operand: k x batch rows), one pair of registers per (k tile, group of 8 rows).
    uint32_t xf[GEMV_KT][MT][2];
    int valid_kt = 0;
#pragma unroll
    for (int t = 0; t < GEMV_KT; ++t) {
        const int i = i_begin + t;
        if (i < tiles_k) valid_kt = t + 1;
#pragma unroll
        for (int g = 0; g < MT; ++g) {
            const int row = g * 8 + (lane >> 2);
            const int col = i * 16 + (lane & 3) * 2;
            uint32_t b0 = 0, b1 = 0;
            if (i < tiles_k && row < m) {
                const uint32_t *p = reinterpret_cast<const uint32_t *>(xh + (size_t)row * k + col);
                b0 = p[0];
                b1 = p[4];
            }
            xf[t][g][0] = b0;
            xf[t][g][1] = b1;
        }
    }
    __syncthreads();

    int w0, r;
    lane_window<K>(lane, w0, r);
    constexpr int TILE_WORDS = G::WORDS;
    const size_t row_stride = (size_t)tiles_n * TILE_WORDS;  // words between tile (i, j) and (i+1, j)

    uint32_t buf[2][GEMV_KT][G::NW];
    auto load = [&](uint32_t(&dst)[GEMV_KT][G::NW], int j) {
#pragma unroll
        for (int t = 0; t < GEMV_KT; ++t) {
            if (t < valid_kt) {
                const uint32_t *tile = trellis + (size_t)(i_begin + t) * row_stride + (size_t)j * TILE_WORDS;
                load_lane_words<K>(tile, w0, dst[t]);
            }
        }
    };
    auto compute = [&](const uint32_t(&src)[GEMV_KT][G::NW], int j) {
        float c[MT][4];
#pragma unroll
        for (int g = 0; g < MT; ++g) c[g][0] = c[g][1] = c[g][2] = c[g][3] = 0.f;
#pragma unroll
        for (int t = 0; t < GEMV_KT; ++t) {
            if (t < valid_kt) {
                uint32_t a[4];
                tile_fragment<K, CB>(src[t], r, a);
#pragma unroll
                for (int g = 0; g < MT; ++g) mma_16816(c[g], a, xf[t][g][0], xf[t][g][1]);
            }
        }
        // c[g]: (n = lane/4, rows 2(lane%4)+{0,1}) and (n = lane/4 + 8, same rows)
        float *acc = acc_smem + (size_t)(j - j_begin) * 16 * ACC_STRIDE;
        const int nn = lane >> 2, mm = (lane & 3) * 2;
#pragma unroll
        for (int g = 0; g < MT; ++g) {
            atomicAdd(acc + nn * ACC_STRIDE + g * 8 + mm, c[g][0]);
            atomicAdd(acc + nn * ACC_STRIDE + g * 8 + mm + 1, c[g][1]);
            atomicAdd(acc + (nn + 8) * ACC_STRIDE + g * 8 + mm, c[g][2]);
            atomicAdd(acc + (nn + 8) * ACC_STRIDE + g * 8 + mm + 1, c[g][3]);
        }
    };

    if (valid_kt > 0 && j_begin < j_end) {
        load(buf[0], j_begin);
        int j = j_begin;
        for (; j + 1 < j_end; j += 2) {
            load(buf[1], j + 1);
            compute(buf[0], j);
            if (j + 2 < j_end) load(buf[0], j + 2);
            compute(buf[1], j + 1);
        }
        if (j < j_end) compute(buf[0], j);
    }
    __syncthreads();

    // Write this slice's partial sums for the valid batch rows, coalesced along n.
    const int cols = (j_end - j_begin) * 16;
    for (int idx = threadIdx.x; idx < m * cols; idx += blockDim.x) {
        const int row = idx / cols, c = idx % cols;
        partial[((size_t)slice * m + row) * n + j_begin * 16 + c] = acc_smem[c * ACC_STRIDE + row];
    }
}

// One warp per tile: W_hat[16i + r, 16j + c] for the lane's eight positions.
template <int K, int CB>
__global__ void exl3_decode_tiles_kernel(const uint32_t *__restrict__ trellis, half *__restrict__ w, int k, int n) {
    const int lane = threadIdx.x & 31;
    const int tiles_n = n / 16;
    const int64_t tile = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (tile >= (int64_t)(k / 16) * tiles_n) return;
    const int i = (int)(tile / tiles_n), j = (int)(tile % tiles_n);
    int w0, r;
    lane_window<K>(lane, w0, r);
    uint32_t raw[TileGeom<K>::NW];
    load_lane_words<K>(trellis + tile * TileGeom<K>::WORDS, w0, raw);
    uint32_t st[8];
    lane_states<K>(raw, r, st);
    const int r0 = (lane % 4) * 2, c0 = lane / 4;
    const int row_off[8] = {0, 1, 8, 9, 0, 1, 8, 9};
    const int col_off[8] = {0, 0, 0, 0, 8, 8, 8, 8};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int row = i * 16 + r0 + row_off[e], col = j * 16 + c0 + col_off[e];
        w[(size_t)row * n + col] = decode_one<CB>(st[e]);
    }
}

template <int CB>
__global__ void exl3_codebook_decode_kernel(const int32_t *__restrict__ states, half *__restrict__ out, int64_t count) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) out[i] = decode_one<CB>((uint32_t)states[i]);
}

// Host launchers, one translation unit per codebook (exl3_cb{0,1,2}.cu).
template <int CB>
int launch_exl3_gemv(const half *xh, const uint32_t *trellis, float *partial, int m, int k, int n, int K,
                     int num_sms, cudaStream_t stream);
template <int CB>
int launch_exl3_decode_tiles(const uint32_t *trellis, half *w, int k, int n, int K, cudaStream_t stream);

template <int K, int CB, int MT>
int launch_gemv_mt(const half *xh, const uint32_t *trellis, float *partial, int m, int k, int n, int num_sms,
                   cudaStream_t stream) {
    const int tiles_n = n / 16;
    const int slices = (k / 16 + GEMV_SLICE - 1) / GEMV_SLICE;
    // Aim for ~4 blocks per SM; each block walks a run of column tiles to keep loads in flight.
    const int target_blocks = 4 * (num_sms > 0 ? num_sms : 132);
    int cols = (tiles_n * slices + target_blocks - 1) / target_blocks;
    const int acc_bytes_per_col = 16 * (MT * 8 + 1) * (int)sizeof(float);
    const int max_cols = (32 * 1024) / acc_bytes_per_col;
    cols = max(1, min(cols, max_cols));
    dim3 grid((tiles_n + cols - 1) / cols, slices);
    const size_t smem = (size_t)cols * acc_bytes_per_col;
    exl3_gemv_kernel<K, CB, MT><<<grid, GEMV_WARPS * 32, smem, stream>>>(xh, trellis, partial, m, k, n, cols);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <int K, int CB>
int launch_gemv_k(const half *xh, const uint32_t *trellis, float *partial, int m, int k, int n, int num_sms,
                  cudaStream_t stream) {
    if (m <= 8) return launch_gemv_mt<K, CB, 1>(xh, trellis, partial, m, k, n, num_sms, stream);
    if (m <= 16) return launch_gemv_mt<K, CB, 2>(xh, trellis, partial, m, k, n, num_sms, stream);
    if (m <= 32) return launch_gemv_mt<K, CB, 4>(xh, trellis, partial, m, k, n, num_sms, stream);
    return TRELLM_E_UNSUPPORTED;
}

#define TRELLM_FOR_EACH_K(MACRO) MACRO(1) MACRO(2) MACRO(3) MACRO(4) MACRO(5) MACRO(6) MACRO(7) MACRO(8)

#define TRELLM_DEFINE_CODEBOOK_LAUNCHERS(CB_VALUE)                                                              \
    template <>                                                                                                 \
    int launch_exl3_gemv<CB_VALUE>(const half *xh, const uint32_t *trellis, float *partial, int m, int k, int n, \
                                   int K, int num_sms, cudaStream_t stream) {                                  \
        switch (K) {                                                                                            \
            _GEMV_CASE(1) _GEMV_CASE(2) _GEMV_CASE(3) _GEMV_CASE(4)                                             \
            _GEMV_CASE(5) _GEMV_CASE(6) _GEMV_CASE(7) _GEMV_CASE(8)                                             \
            default: return TRELLM_E_BAD_ARG;                                                                   \
        }                                                                                                       \
    }                                                                                                           \
    template <>                                                                                                 \
    int launch_exl3_decode_tiles<CB_VALUE>(const uint32_t *trellis, half *w, int k, int n, int K,              \
                                           cudaStream_t stream) {                                              \
        const int64_t tiles = (int64_t)(k / 16) * (n / 16);                                                     \
        const int blocks = (int)((tiles + 7) / 8);                                                              \
        switch (K) {                                                                                            \
            _DEC_CASE(1) _DEC_CASE(2) _DEC_CASE(3) _DEC_CASE(4)                                                 \
            _DEC_CASE(5) _DEC_CASE(6) _DEC_CASE(7) _DEC_CASE(8)                                                 \
            default: return TRELLM_E_BAD_ARG;                                                                   \
        }                                                                                                       \
        TRELLM_LAUNCH_CHECK();                                                                                  \
        return TRELLM_OK;                                                                                       \
    }

#define _GEMV_CASE(KV) \
    case KV: return launch_gemv_k<KV, CB_VALUE>(xh, trellis, partial, m, k, n, num_sms, stream);
#define _DEC_CASE(KV) \
    case KV: exl3_decode_tiles_kernel<KV, CB_VALUE><<<blocks, 256, 0, stream>>>(trellis, w, k, n); break;

}  // namespace trellm
