// EXL3 matmul for a batched decode step's row counts (up to 64 rows): the trellis is decoded in registers
// and multiplied on the tensor cores against x fragments staged in shared memory, so W_hat never goes
// through memory. Above 16 rows the only route before was decode-to-fp16 + cuBLAS, which writes and
// re-reads W_hat in fp16 (four times the 4 bpw trellis each way): about 0.4x bf16 F.linear on the H200.
//
// Three launches (trellm_exl3_matmul_mid):
//   1. pack: xp = fp16(H128(x * suh)) in the split-halves B-fragment layout [k/16][G][32 lanes][4 x uint32]
//      (G row groups of 8, rows past m zero): lane l's four words of (k tile t, group g) are the duplicated
//      halves x[t*16 + c], x[.. + 8], x[.. + 1], x[.. + 9] of row 8g + l/4, c = 2(l%4) -- exactly the
//      registers the GEMV builds with byte_perms (xf, xo), so one 16-byte shared load feeds both mmas;
//   2. the matmul: block (c, s) = 128-column output group c (warp w owns column tile 8c + w) times k-slice s.
//      Per chunk of 8 k tiles, the block's x fragments and each warp's trellis words come in by cp.async
//      (two buffers) while the chunk before is decoded; each warp keeps its 16 columns x 8G rows in
//      registers and stores them once as fp32 partials [s][m][n]. Warps split columns, not k, so there is
//      no cross-warp reduction and no shared accumulator (the 9..16-row GEMV's bound, NOTES 2026-12-03c);
//   3. finish: one warp per (row, 128-column group): the slices summed, H128, * svh (+ bias), y.
#pragma once

#include "exl3_gemv.cuh"

namespace trellm {

constexpr int MID_WARPS = 8;       // one output group of 128 columns per block
constexpr int MID_CHUNK_TILES = 8; // k tiles per pipeline chunk (k % 128 == 0, so chunks are whole)
constexpr int MID_MAX_ROWS = 64;

template <int K, int G> struct MidGeom {
    static constexpr int TILE_BYTES = TileGeom<K>::WORDS * 4;
    static constexpr int TRELLIS_CHUNK_BYTES = MID_CHUNK_TILES * TILE_BYTES;  // per warp
    static constexpr int X_CHUNK_BYTES = MID_CHUNK_TILES * G * 32 * 16;       // per block
    static constexpr int BUFFER_BYTES = X_CHUNK_BYTES + MID_WARPS * TRELLIS_CHUNK_BYTES;
    static constexpr size_t SMEM_BYTES = 2 * (size_t)BUFFER_BYTES;
};

struct MidArgs {
    const uint32_t *xp;       // packed x fragments, [k/16][G][32][4]
    const uint32_t *trellis;  // [k/16][n/16][8K] words
    float *partial;           // [slices][m][n]
    int m, k, n, tiles_per_slice;
};

// Launches 1 and 3 (pack, finish) are in exl3.cu, beside the entry point.

// Launch 2: see the top of the file. 2 blocks per SM: 96 KB of buffers at most (G = 8, K = 8).
template <int K, int CB, int G>
__global__ void __launch_bounds__(MID_WARPS * 32, 2) exl3_matmul_mid_kernel(const MidArgs a) {
    using Geo = MidGeom<K, G>;
    using TG = TileGeom<K>;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, warp = warp_index();
    const int tiles_k = a.k / 16, tiles_n = a.n / 16;
    const int j = blockIdx.x * MID_WARPS + warp;  // this warp's column tile
    const int t_begin = blockIdx.y * a.tiles_per_slice;
    const int chunks = (min(t_begin + a.tiles_per_slice, tiles_k) - t_begin) / MID_CHUNK_TILES;
    const uint32_t smem_base = (uint32_t)__cvta_generic_to_shared(smem_raw);

    auto issue = [&](int chunk, int buffer) {
        const int t0 = t_begin + chunk * MID_CHUNK_TILES;
        const uint32_t base = smem_base + buffer * Geo::BUFFER_BYTES;
        const unsigned char *xsrc = reinterpret_cast<const unsigned char *>(a.xp) + (size_t)t0 * G * 32 * 16;
        for (int o = threadIdx.x * 16; o < Geo::X_CHUNK_BYTES; o += MID_WARPS * 32 * 16)
            cp_async_16_to(base + o, xsrc + o);
        const uint32_t ring = base + Geo::X_CHUNK_BYTES + warp * Geo::TRELLIS_CHUNK_BYTES;
        constexpr int PIECES = Geo::TILE_BYTES / 16;  // 16-byte pieces per tile
        for (int q = lane; q < MID_CHUNK_TILES * PIECES; q += 32) {
            const int tt = q / PIECES, piece = q % PIECES;
            const uint32_t *src = a.trellis + ((size_t)(t0 + tt) * tiles_n + j) * TG::WORDS + piece * 4;
            cp_async_16_to(ring + q * 16, src);
        }
    };

    int w0, r;
    lane_window<K>(lane, w0, r);
    float acc[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;

    if (chunks > 0) issue(0, 0);
    cp_async_commit();
    for (int chunk = 0; chunk < chunks; ++chunk) {
        if (chunk + 1 < chunks) issue(chunk + 1, (chunk + 1) & 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned char *buf = smem_raw + (chunk & 1) * Geo::BUFFER_BYTES;
        const uint4 *xs = reinterpret_cast<const uint4 *>(buf);
        const uint32_t *ring = reinterpret_cast<const uint32_t *>(buf + Geo::X_CHUNK_BYTES + warp * Geo::TRELLIS_CHUNK_BYTES);
#pragma unroll 2
        for (int tt = 0; tt < MID_CHUNK_TILES; ++tt) {
            uint32_t raw[TG::NW];
#pragma unroll
            for (int q = 0; q < TG::NW; ++q) raw[q] = ring[tt * TG::WORDS + (w0 + q) % TG::WORDS];
            if constexpr (CB != TRELLM_CB_MUL1) {
                uint32_t even[4], odd[4];
                tile_fragments_split<K, CB>(raw, r, even, odd);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const uint4 xv = xs[(tt * G + g) * 32 + lane];
                    mma_16816(acc[g], even, xv.x, xv.y);
                    mma_16816(acc[g], odd, xv.z, xv.w);
                }
            } else {
                uint32_t frag[4];
                tile_fragment<K, CB>(raw, r, frag);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const uint4 xv = xs[(tt * G + g) * 32 + lane];
                    mma_16816(acc[g], frag, __byte_perm(xv.x, xv.z, 0x5410), __byte_perm(xv.y, xv.w, 0x5410));
                }
            }
        }
        __syncthreads();  // the buffer is refilled by the issue two chunks on
    }
    // acc[g]: (n = lane/4, rows 8g + 2(lane%4) + {0, 1}) and (n = lane/4 + 8, the same rows)
    float *part = a.partial + (size_t)blockIdx.y * a.m * a.n;
    const int n0 = j * 16 + lane / 4;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const int r0 = g * 8 + (lane % 4) * 2;
        if (r0 < a.m) {
            part[(size_t)r0 * a.n + n0] = acc[g][0];
            part[(size_t)r0 * a.n + n0 + 8] = acc[g][2];
        }
        if (r0 + 1 < a.m) {
            part[(size_t)(r0 + 1) * a.n + n0] = acc[g][1];
            part[(size_t)(r0 + 1) * a.n + n0 + 8] = acc[g][3];
        }
    }
}

// Row groups of 8 for m rows: 2, 4 or 8 (the instantiated sizes).
inline int mid_groups(int m) { return m <= 16 ? 2 : m <= 32 ? 4 : 8; }

// Tiles of k per slice: enough slices that the grid fills the GPU at 2 blocks per SM, in whole chunks.
inline int mid_tiles_per_slice(int k, int n, int num_sms) {
    const int tiles_k = k / 16, groups_n = n / 128;
    const int resident = 2 * (num_sms > 0 ? num_sms : 132);
    const int slices = max(1, min(tiles_k / MID_CHUNK_TILES, (resident + groups_n - 1) / groups_n));
    const int per = (tiles_k + slices - 1) / slices;
    return (per + MID_CHUNK_TILES - 1) / MID_CHUNK_TILES * MID_CHUNK_TILES;
}

inline int mid_slices(int k, int n, int num_sms) {
    const int per = mid_tiles_per_slice(k, n, num_sms);
    return (k / 16 + per - 1) / per;
}

// Floats of workspace: the packed x (4 bytes per element of the padded rows) and the partials.
inline int64_t mid_workspace_floats(int m, int k, int n, int num_sms) {
    return (int64_t)k * mid_groups(m) * 8 + (int64_t)mid_slices(k, n, num_sms) * m * n;
}

template <int K, int CB, int G>
int launch_mid_matmul(const MidArgs &args, int slices, cudaStream_t stream) {
    auto kernel = exl3_matmul_mid_kernel<K, CB, G>;
    constexpr size_t smem = MidGeom<K, G>::SMEM_BYTES;
    static cudaError_t configured = cudaErrorNotReady;
    if (configured == cudaErrorNotReady) {
        configured = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (configured != cudaSuccess) cudaGetLastError();
    }
    if (configured != cudaSuccess) return TRELLM_E_UNSUPPORTED;  // more shared memory than this GPU gives a block
    kernel<<<dim3(args.n / 128, slices), MID_WARPS * 32, smem, stream>>>(args);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <int K, int CB>
int launch_mid_k(const MidArgs &args, int G, int slices, cudaStream_t stream) {
    switch (G) {
        case 2: return launch_mid_matmul<K, CB, 2>(args, slices, stream);
        case 4: return launch_mid_matmul<K, CB, 4>(args, slices, stream);
        case 8: return launch_mid_matmul<K, CB, 8>(args, slices, stream);
        default: return TRELLM_E_BAD_ARG;
    }
}

template <int CB>
int launch_exl3_matmul_mid(const MidArgs &args, int K, int G, int slices, cudaStream_t stream);

// The K dispatch for one codebook (CB_VALUE, defined by the including exl3_cb*.cu, as for the GEMV's).
#define TRELLM_DEFINE_MID_LAUNCHERS(CB_VALUE)                                                                 \
    template <>                                                                                             \
    int launch_exl3_matmul_mid<CB_VALUE>(const MidArgs &args, int K, int G, int slices, cudaStream_t stream) { \
        switch (K) {                                                                                        \
            TRELLM_FOR_EACH_K(_MID_CASE)                                                                    \
            default: return TRELLM_E_BAD_ARG;                                                               \
        }                                                                                                   \
    }
#define _MID_CASE(KV) \
    case KV: return launch_mid_k<KV, CB_VALUE>(args, G, slices, stream);

}  // namespace trellm
