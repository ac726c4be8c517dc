// EXL3 matmul for a batched decode step's row counts (up to 64 rows): the trellis is decoded in registers
// and multiplied on the tensor cores against x fragments staged in shared memory, so W_hat never goes
// through memory. Above 16 rows the only route before was decode-to-fp16 + cuBLAS, which writes and
// re-reads W_hat in fp16 (four times the 4 bpw trellis each way): about 0.4x bf16 F.linear on the H200.
// One call takes 1..4 matmuls of the same x (q/k/v, gate/up), like the GEMV's MatmulParts.
//
// Three launches (trellm_exl3_matmul_mid), each a programmatic dependent of the one before:
//   1. pack: per part, xp = fp16(H128(x * suh)) (x RMS-normed first with the residual stream's sums, as the
//      GEMV's input transform does) in the tensor-core B-fragment layout [k/16][G][32 lanes][2 x
//      uint32] (G row groups of 8, rows past m zero): lane l's two words of (k tile t, group g) are the pairs
//      (x[t*16 + c], x[.. + 1]) and (x[.. + 8], x[.. + 9]) of row 8g + l/4, c = 2(l%4), so one 8-byte shared
//      load is the mma's B operand;
//   2. the matmul. The work is a list of units, (128-column output group, chunk of 8 k tiles), group-major
//      over all parts, split evenly over one wave of blocks (stream-K): block b takes the units
//      [b * units / blocks, (b + 1) * units / blocks), so every SM gets the same work whatever the shape (a
//      grid of whole k-slices left 1.27 waves at 4096->14336). In a unit, warp w owns column tile 8c + w of
//      group c; the unit's x fragments (shared by the warps) and each warp's trellis words come in by
//      cp.async, several units ahead (MidGeom::STAGES), while the unit before is decoded; the weights are
//      paired into fp16 as the bit-exact decoder does, one mma per row group. Each warp keeps its 16
//      columns x 8G rows in registers across the block's units of one group and stores them once, as fp32
//      partial number (b - the group's first block) of that group. Warps split columns, not k: no
//      cross-warp reduction and no shared accumulator (the 9..16-row GEMV's bound, NOTES 2026-12-03c);
//   3. finish: one warp per (row, 128-column group): the group's partials summed in block order (a fixed
//      order: bit-stable), H128, * svh (+ bias), y (+ the residual, its squares summed for the next norm; or,
//      for q/k/v, the per-head norm, RoPE and KV-page stores: both as the GEMV's finishing warp does).
//      (Finishing a group in the block that completes it, as the GEMV does, was slower: 4096->14336 at 32 rows
//      36.5 -> 41.6 us, the block's pipeline stalled on the partials' round trips, NOTES 2026-12-04c.)
#pragma once

#include "exl3_gemv.cuh"

namespace trellm {

constexpr int MID_WARPS = 8;       // one output group of 128 columns per unit
// k tiles per unit. 8 by default (k % 128 == 0, so every shape's chunks are whole); build with
// TRELLM_NVCC_FLAGS="-DTRELLM_MID_CHUNK_TILES=16" to halve the per-unit work (copies, barrier, cursor: about 25
// of the 80 instructions issued per tile, NOTES 2026-12-04c), for shapes with k % 256 == 0 only (others are
// refused). Measured (NOTES 2026-12-04d): 1-3% faster at 8..32 rows, 1-2% slower at 64; not the default, which
// takes every k % 128 == 0.
#ifndef TRELLM_MID_CHUNK_TILES
#define TRELLM_MID_CHUNK_TILES 8
#endif
constexpr int MID_CHUNK_TILES = TRELLM_MID_CHUNK_TILES;
constexpr int MID_UNIT_K = 16 * MID_CHUNK_TILES;  // k values per unit
constexpr int MID_MAX_ROWS = 64;
constexpr int MID_MAX_PARTS = 4;
// The matmul kernel's launch bound: one wave is this many blocks per SM. Build with
// TRELLM_NVCC_FLAGS="-DTRELLM_MID_BLOCKS_PER_SM=3" for 24 warps per SM (64 KB of stages, at most 80
// registers per thread: every instantiation fits without spilling, by the build's resource report), to hide
// more of the decode's latency (ncu: 68% issue-active at 4 warps per scheduler, NOTES 2026-12-04c). Measured
// no faster than 2 (NOTES 2026-12-04d).
#ifndef TRELLM_MID_BLOCKS_PER_SM
#define TRELLM_MID_BLOCKS_PER_SM 2
#endif
constexpr int MID_BLOCKS_PER_SM = TRELLM_MID_BLOCKS_PER_SM;

// Shared memory per block for the pipeline: 96 KB at 2 blocks per SM on the H100/H200 (227 KB; 1 block on
// sm_86/89, 99 KB).
constexpr int MID_SMEM_BUDGET = 192 * 1024 / MID_BLOCKS_PER_SM;

// A unit's shared-memory stage: the x fragments of its 8 k tiles (all row groups; 8 bytes per lane per group
// and tile) and each warp's trellis words. As many stages as the budget holds, 2..8: a unit's decode is
// shorter than a DRAM round trip under load, so one unit ahead (the first version) left the warps waiting.
// (Up to 16, so that the small stages of K <= 2 fill the budget too, measured no faster than 8 with the
// occupancy pinned: mid_launch_smem.)
template <int K, int G> struct MidGeom {
    static constexpr int TILE_BYTES = TileGeom<K>::WORDS * 4;
    static constexpr int TRELLIS_CHUNK_BYTES = MID_CHUNK_TILES * TILE_BYTES;  // per warp
    static constexpr int X_CHUNK_BYTES = MID_CHUNK_TILES * G * 32 * 8;        // per block
    static constexpr int BUFFER_BYTES = X_CHUNK_BYTES + MID_WARPS * TRELLIS_CHUNK_BYTES;
    static constexpr int FIT = MID_SMEM_BUDGET / BUFFER_BYTES;
    static constexpr int STAGES = FIT < 2 ? 2 : (FIT > 8 ? 8 : FIT);
    static constexpr size_t SMEM_BYTES = (size_t)STAGES * BUFFER_BYTES;
};

struct MidPart {
    const uint32_t *trellis;  // [k/16][n/16][8K] words
    const half *suh, *svh;    // [k], [n]
    const half *bias;         // [n] or null
    void *y;                  // [m, n] of y_dtype
    uint32_t *xp;             // x packed with this part's suh, [k/16][G][32][2]
    float *partial;           // [pieces][m][n]
    int n;
};

// Everything the three launches read: the parts, and the split of the units over the blocks.
struct MidArgs {
    MidPart part[MID_MAX_PARTS];
    int group_begin[MID_MAX_PARTS + 1];  // part p's 128-column groups are [group_begin[p], group_begin[p + 1])
    int parts;
    const void *x;
    int x_dtype, y_dtype, m, k, groups;  // groups: G, the row groups of 8
    int units, blocks;                   // units = group_begin[parts] * k / MID_UNIT_K
    ResidualStream stream;               // the input norm (pack) and the residual add (finish; one part)
    float *x_sums;                       // CB_MUL1_SPLIT (one row group): [parts][8][k / 128] sums of the packed x
                                         // (pack), for the codebook's offset (finish); null otherwise
    HeadEpilogue head;                   // head.enabled: q/k/v (3 parts) finished for attention, as the GEMV's
};

// Block b's first unit; and the block that holds unit u (the largest b with mid_unit_begin(b) <= u).
__host__ __device__ __forceinline__ int mid_unit_begin(int b, int units, int blocks) {
    return (int)((long long)b * units / blocks);
}
__host__ __device__ __forceinline__ int mid_block_of(int u, int units, int blocks) {
    return (int)(((long long)(u + 1) * blocks - 1) / units);
}

// Part p of the call, selected with constant indices so the argument struct stays in parameter space (a
// dynamic index would copy it to local memory); and the part of a global 128-column group, with the group's
// index inside it.
__device__ __forceinline__ MidPart mid_part(const MidArgs &a, int p) {
    MidPart part = a.part[0];
#pragma unroll
    for (int q = 1; q < MID_MAX_PARTS; ++q)
        if (p == q) part = a.part[q];
    return part;
}
__device__ __forceinline__ MidPart mid_part_of(const MidArgs &a, int global_group, int &group, int &index) {
    MidPart p = a.part[0];
    int begin = 0;
    index = 0;
#pragma unroll
    for (int q = 1; q < MID_MAX_PARTS; ++q) {
        if (q < a.parts && global_group >= a.group_begin[q]) {
            p = a.part[q];
            begin = a.group_begin[q];
            index = q;
        }
    }
    group = global_group - begin;
    return p;
}

// Launches 1 and 3 (pack, finish) are in exl3.cu, beside the entry point.

// Where a block's walk over its units stands: the unit's 128-column group (global, over all parts) and k
// chunk, and the part's pointers at that unit. Advanced by a step per unit (no division in the loop: a
// division per unit cost the first stream-K version 15-20% at lm_head, NOTES 2026-12-04c).
template <int K, int G> struct MidCursor {
    int group, chunk;           // global group, chunk of k
    int local_group, n;         // the group inside its part, the part's n
    const uint32_t *trellis;    // this warp's first word of (chunk, column tile)
    const unsigned char *x;     // the chunk's packed x fragments
    float *partial;             // the part's partials

    __device__ __forceinline__ void enter_group(const MidArgs &a, int warp) {
        int index;
        const MidPart p = mid_part_of(a, group, local_group, index);
        n = p.n;
        trellis = p.trellis + ((size_t)chunk * MID_CHUNK_TILES * (n / 16) + local_group * MID_WARPS + warp) * TileGeom<K>::WORDS;
        x = reinterpret_cast<const unsigned char *>(p.xp) + (size_t)chunk * MidGeom<K, G>::X_CHUNK_BYTES;
        partial = p.partial;
    }
    __device__ __forceinline__ void start(const MidArgs &a, int u, int chunks_k, int warp) {
        group = u / chunks_k;
        chunk = u - group * chunks_k;
        enter_group(a, warp);
    }
    __device__ __forceinline__ void next(const MidArgs &a, int chunks_k, int warp) {
        if (++chunk == chunks_k) {
            chunk = 0;
            ++group;
            enter_group(a, warp);
        } else {
            trellis += (size_t)MID_CHUNK_TILES * (n / 16) * TileGeom<K>::WORDS;
            x += MidGeom<K, G>::X_CHUNK_BYTES;
        }
    }
};

// Launch 2: see the top of the file. The first stages' trellis words are requested before pdl_wait (they do
// not depend on the pack), x and every global write after; the finish may launch once every block is past
// its loop.
template <int K, int CB, int G>
__global__ void __launch_bounds__(MID_WARPS * 32, MID_BLOCKS_PER_SM) exl3_matmul_mid_kernel(const MidArgs a) {
    using Geo = MidGeom<K, G>;
    using TG = TileGeom<K>;
    constexpr int S = Geo::STAGES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int lane = threadIdx.x & 31, warp = warp_index();
    const int chunks_k = a.k / MID_UNIT_K;
    const int u_begin = mid_unit_begin(blockIdx.x, a.units, a.blocks);
    const int count = mid_unit_begin(blockIdx.x + 1, a.units, a.blocks) - u_begin;
    const uint32_t smem_base = (uint32_t)__cvta_generic_to_shared(smem_raw);
    MidCursor<K, G> fetch, work;  // the unit being requested, the unit being decoded
    fetch.start(a, u_begin, chunks_k, warp);
    work = fetch;

    // Request the fetch cursor's unit into stage `stage`: x fragments (16 bytes per thread per copy) and this
    // warp's trellis words (2K 16-byte pieces per tile); compile-time trip counts.
    auto issue_x = [&](int stage, const unsigned char *x_chunk) {
        const uint32_t base = smem_base + stage * Geo::BUFFER_BYTES + threadIdx.x * 16;
        constexpr int STEP = MID_WARPS * 32 * 16, COPIES = (Geo::X_CHUNK_BYTES + STEP - 1) / STEP;
#pragma unroll
        for (int c = 0; c < COPIES; ++c)
            if (Geo::X_CHUNK_BYTES % STEP == 0 || threadIdx.x * 16 + c * STEP < Geo::X_CHUNK_BYTES)
                cp_async_16_to(base + c * STEP, x_chunk + threadIdx.x * 16 + c * STEP);
    };
    auto issue_trellis = [&](int stage) {
        const uint32_t ring = smem_base + stage * Geo::BUFFER_BYTES + Geo::X_CHUNK_BYTES + warp * Geo::TRELLIS_CHUNK_BYTES;
        constexpr int PIECES = Geo::TILE_BYTES / 16, ALL = MID_CHUNK_TILES * PIECES, COPIES = (ALL + 31) / 32;
        const size_t tile_row = (size_t)(fetch.n / 16) * TG::WORDS;  // words from one k tile to the next
#pragma unroll
        for (int c = 0; c < COPIES; ++c) {
            const int q = lane + c * 32;
            if (ALL % 32 == 0 || q < ALL)
                cp_async_16_to(ring + q * 16, fetch.trellis + (q / PIECES) * tile_row + (q % PIECES) * 4);
        }
    };

    int w0, r;
    lane_window<K>(lane, w0, r);
    float acc[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;

    // Units 0..S-2 in flight before the loop (their trellis words before pdl_wait, their x after, each a
    // cp.async group: the loop's wait counts the later x groups as the newest); each iteration waits for its
    // own unit, then requests the unit S-1 ahead into the stage read in the iteration before (every warp is
    // past it: the barrier).
#pragma unroll
    for (int s = 0; s < S - 1; ++s) {
        if (s < count) {
            if (s > 0) fetch.next(a, chunks_k, warp);
            issue_trellis(s);
        }
        cp_async_commit();
    }
    pdl_wait();
    {
        MidCursor<K, G> early = work;
#pragma unroll
        for (int s = 0; s < S - 1; ++s) {
            if (s < count) {
                if (s > 0) early.next(a, chunks_k, warp);
                issue_x(s, early.x);
            }
            cp_async_commit();
        }
    }
    int stage = 0, refill = S - 1;
    for (int i = 0; i < count; ++i) {
        cp_async_wait<S - 2>();
        __syncthreads();
        if (i + S - 1 < count) {
            fetch.next(a, chunks_k, warp);
            issue_x(refill, fetch.x);
            issue_trellis(refill);
        }
        cp_async_commit();
        refill = refill + 1 == S ? 0 : refill + 1;
        const unsigned char *buf = smem_raw + stage * Geo::BUFFER_BYTES;
        stage = stage + 1 == S ? 0 : stage + 1;
        const uint2 *xs = reinterpret_cast<const uint2 *>(buf);
        const uint32_t *ring = reinterpret_cast<const uint32_t *>(buf + Geo::X_CHUNK_BYTES + warp * Geo::TRELLIS_CHUNK_BYTES);
#pragma unroll 2
        for (int tt = 0; tt < MID_CHUNK_TILES; ++tt) {
            uint32_t raw[TG::NW];
#pragma unroll
            for (int q = 0; q < TG::NW; ++q) raw[q] = ring[tt * TG::WORDS + (w0 + q) % TG::WORDS];
            // The weights as fp16 (halves paired and added, as the bit-exact decoder does): one mma per row
            // group. The GEMV's split halves (two mmas against duplicated x) would double the tensor-core work,
            // which bounds this kernel at 4..8 row groups; MUL1's split route (CB_MUL1_SPLIT) is built for one
            // row group only, where it takes the GEMV's two mmas per tile for fewer decode instructions.
            if constexpr (CB == CB_MUL1_SPLIT) {
                static_assert(G == 1, "MUL1's split route runs one row group");
                uint32_t even[4], odd[4], x_even[2], x_odd[2];
                tile_fragments_split<K, CB>(raw, r, even, odd);
                const uint2 xv = xs[tt * 32 + lane];
                split_b_operand(xv.x, x_even[0], x_odd[0]);
                split_b_operand(xv.y, x_even[1], x_odd[1]);
                mma_16816(acc[0], even, x_even[0], x_even[1]);
                mma_16816(acc[0], odd, x_odd[0], x_odd[1]);
            } else {
                uint32_t frag[4];
                tile_fragment<K, CB>(raw, r, frag);
#pragma unroll
                for (int g = 0; g < G; ++g) {
                    const uint2 xv = xs[(tt * G + g) * 32 + lane];
                    mma_16816(acc[g], frag, xv.x, xv.y);
                }
            }
        }
        if (i + 1 == count || work.chunk + 1 == chunks_k) {
            // The block's last unit of this group: its partial, numbered from the group's first block.
            // acc[g]: (n = lane/4, rows 8g + 2(lane%4) + {0, 1}) and (n = lane/4 + 8, the same rows)
            const int piece = blockIdx.x - mid_block_of(work.group * chunks_k, a.units, a.blocks);
            float *part = work.partial + (size_t)piece * a.m * work.n;
            const int n0 = (work.local_group * MID_WARPS + warp) * 16 + lane / 4;
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const int r0 = g * 8 + (lane % 4) * 2;
                if (r0 < a.m) {
                    part[(size_t)r0 * work.n + n0] = acc[g][0];
                    part[(size_t)r0 * work.n + n0 + 8] = acc[g][2];
                }
                if (r0 + 1 < a.m) {
                    part[(size_t)(r0 + 1) * work.n + n0] = acc[g][1];
                    part[(size_t)(r0 + 1) * work.n + n0 + 8] = acc[g][3];
                }
                acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
            }
        }
        if (i + 1 < count) work.next(a, chunks_k, warp);
    }
    pdl_trigger();
}

// Row groups of 8 for m rows: 1, 2, 4 or 8 (the instantiated sizes). One group since the route starts at 6 rows
// (half the mmas and x fragments of two, measured faster: NOTES 2026-12-04d).
inline int mid_groups(int m) { return m <= 8 ? 1 : m <= 16 ? 2 : m <= 32 ? 4 : 8; }

// Blocks of the matmul launch: one wave at MID_BLOCKS_PER_SM (fewer when there are fewer units), the units
// split evenly over it (the first version's grid, about one k-slice of one group per block, took 1.27 waves
// at 4096->14336 and measured slower).
inline int mid_blocks(int units, int chunks_k, int num_sms) {
    const int wave = MID_BLOCKS_PER_SM * (num_sms > 0 ? num_sms : 132);
    return units < wave ? units : wave;
}

// Partials a group may need: a group's chunks_k units meet at most ceil(chunks_k / the fewest units of a
// block) + 1 blocks.
inline int mid_pieces(int chunks_k, int units, int blocks) {
    const int fewest = units / blocks;
    return (chunks_k + fewest - 1) / fewest + 1;
}

// Floats of workspace for total_n columns over `parts` parts: each part's packed x (fp16 per element of the
// padded rows), the partials, and (MUL1's split route) the sums of x per row and 128-chunk of k.
inline int64_t mid_workspace_floats(int m, int k, int parts, int64_t total_n, int num_sms) {
    const int chunks_k = k / MID_UNIT_K, units = (int)(total_n / 128) * chunks_k;
    const int blocks = mid_blocks(units, chunks_k, num_sms);
    return (int64_t)parts * k * mid_groups(m) * 4 + (int64_t)mid_pieces(chunks_k, units, blocks) * m * total_n +
           (int64_t)parts * mid_groups(m) * 8 * (k / 128);
}

// Dynamic shared memory for a launch whose stages take stages_bytes: at least enough that no more than
// MID_BLOCKS_PER_SM blocks fit an SM. The grid is one wave of MID_BLOCKS_PER_SM blocks per SM, each with the
// same work; where the stages were small and the registers allowed a third block (K <= 2 at 2 row groups: 8
// stages of 6-8 KB), the scheduler put three blocks on some SMs and left others idle, and those shapes ran
// 27% slower than K = 4 (NOTES 2026-12-04d). Never more than a block may have (sm_86/89 fit one block anyway).
inline size_t mid_launch_smem(size_t stages_bytes) {
    int dev = 0, per_sm = 0, reserved = 0, optin = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev);
    cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, dev);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
    const long long one_too_many = (long long)per_sm / (MID_BLOCKS_PER_SM + 1) - reserved + 1;
    const size_t pinned = (size_t)(one_too_many < optin ? one_too_many : optin);
    return stages_bytes > pinned ? stages_bytes : pinned;
}

template <int K, int CB, int G>
int launch_mid_matmul(const MidArgs &args, cudaStream_t stream) {
    auto kernel = exl3_matmul_mid_kernel<K, CB, G>;
    static const size_t smem = mid_launch_smem(MidGeom<K, G>::SMEM_BYTES);
    static cudaError_t configured = cudaErrorNotReady;
    if (configured == cudaErrorNotReady) {
        configured = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (configured != cudaSuccess) cudaGetLastError();
    }
    if (configured != cudaSuccess) return TRELLM_E_UNSUPPORTED;  // more shared memory than this GPU gives a block
    const cudaError_t err = launch_pdl(kernel, dim3(args.blocks), dim3(MID_WARPS * 32), smem, stream, args);
    return err == cudaSuccess ? TRELLM_OK : (int)err;
}

template <int K, int CB>
int launch_mid_k(const MidArgs &args, cudaStream_t stream) {
    if constexpr (CB == CB_MUL1_SPLIT) {
        return args.groups == 1 ? launch_mid_matmul<K, CB, 1>(args, stream) : TRELLM_E_BAD_ARG;
    } else {
        switch (args.groups) {
            case 1: return launch_mid_matmul<K, CB, 1>(args, stream);
            case 2: return launch_mid_matmul<K, CB, 2>(args, stream);
            case 4: return launch_mid_matmul<K, CB, 4>(args, stream);
            case 8: return launch_mid_matmul<K, CB, 8>(args, stream);
            default: return TRELLM_E_BAD_ARG;
        }
    }
}

template <int CB>
int launch_exl3_matmul_mid(const MidArgs &args, int K, cudaStream_t stream);

// The K dispatch for one codebook (CB_VALUE, defined by the including exl3_cb*.cu, as for the GEMV's).
#define TRELLM_DEFINE_MID_LAUNCHERS(CB_VALUE)                                                                 \
    template <>                                                                                             \
    int launch_exl3_matmul_mid<CB_VALUE>(const MidArgs &args, int K, cudaStream_t stream) {                   \
        switch (K) {                                                                                        \
            TRELLM_FOR_EACH_K(_MID_CASE)                                                                    \
            default: return TRELLM_E_BAD_ARG;                                                               \
        }                                                                                                   \
    }
#define _MID_CASE(KV) \
    case KV: return launch_mid_k<KV, CB_VALUE>(args, stream);

}  // namespace trellm
