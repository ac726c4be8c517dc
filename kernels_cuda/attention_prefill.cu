// Tiled (flash-attention style) paged-KV attention for prefill chunks: fp16/bf16, GQA, causal with the
// query chunk at the END of each sequence's context, sliding window, softcap, sinks.
//
// Why: paged_attention_kernel (attention.cu) runs one block per query token, so a 2048-token prompt reads
// every key 2048 times and does its dot products on CUDA cores. Here one block owns a tile of 64 query
// ROWS of one sequence and one kv head, reads each 16-byte chunk of that sequence's K/V tiles into shared
// memory once, and runs both matmuls (S = Q K^T, O += P V) on tensor cores (mma.sync m16n8k16, fp32
// accumulators, online softmax in fp32).
//
// Work split:
//   * rows = (query token, query head of the kv head's group) pairs, token-major: row r of a tile is
//     token r / group, head kvh * group + r % group. A tile holds 64 / group tokens, so the group's heads
//     share every K/V tile read (Llama 3: 16 tokens x 4 heads per tile).
//   * grid = (upper bound on the number of query tiles, hkv). Each block maps blockIdx.x onto
//     (sequence, tile) with a warp prefix scan over cu_seqlens on the device (no host sync, graph-safe);
//     surplus blocks exit at once. Tiles are numbered last-first inside a sequence, so the tiles with
//     the most keys (causal) start first.
//   * 4 warps; warp w owns rows 16w..16w+15 and computes its S and O slices on its own (no cross-warp
//     reduction). A key tile is BK = 64 keys (32 for head_dim > 128, to keep O in registers).
//   * Pipeline per key tile (cp.async, one K and one V buffer): V(t) streams in while S = Q K(t)^T runs;
//     K(t+1) streams in while the softmax and P V(t) run.
//   * Only key tiles in [first key any row sees, last query position] are visited, so tiles entirely
//     masked by causality or the window are skipped; tiles fully inside every row's range skip the mask.
//   * Keys outside the block's range (before the window, past the chunk) are zero-filled in shared memory
//     and never read from the pages: block-table entries past a sequence's end may be anything.
// Shared memory rows are padded by 16 bytes, so ldmatrix reads of 8 rows hit 8 different bank groups.
#include "common.cuh"

namespace {

constexpr int PF_WARPS = 4;
constexpr int PF_ROWS = PF_WARPS * 16;  // query rows per block
constexpr float PF_LOG2E = 1.4426950408889634f;

struct PrefillArgs {
    const void *q, *k_pages, *v_pages;
    const int32_t *block_table, *cu_seqlens, *context_lens;
    const float *sinks;
    void *out;
    int batch, hq, hkv, page_size, page_shift, max_blocks, sliding_window;  // page_shift: log2(page_size) or -1
    float scale, softcap;
};

// 16-byte global -> shared copy; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16_zfill(void *smem_dst, const void *gmem_src, bool valid) {
    const uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void *smem) {
    const uint32_t a = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// c += a b for one m16n8k16 tile, a and b in T (half or bf16), c fp32.
template <typename T> __device__ __forceinline__ void mma_tile(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma_tile<half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma_tile<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                                   uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x in one MUFU op (exp2f adds a denormal-range fixup around it); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as one register of two T (the first in the low half: the lower column of a fragment).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<half>(float lo, float hi) {
    half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&h);
}

template <int D> struct PrefillGeom {
    static constexpr int BK = D > 128 ? 32 : 64;  // keys per tile
    static constexpr int LD = D + 8;              // shared row stride in elements (16 bytes of padding)
    static constexpr int CHUNKS = D / 8;          // 16-byte chunks per row
    static constexpr bool Q_IN_REGS = D <= 128;   // Q fragments held in registers (else re-read from smem)
    static constexpr size_t SMEM = (size_t)(PF_ROWS + 2 * BK) * LD * 2;
};

// Which (sequence, tile) block `t` works on: sequence b has ceil(q_len_b / tpt) tiles, numbered in
// sequence order. A warp scans 32 sequences at a time. Returns false for the surplus blocks.
__device__ __forceinline__ bool find_tile(const int32_t *cu, int batch, int tpt, int t, int &seq, int &tile) {
    const int lane = threadIdx.x & 31;
    int before = 0;  // tiles of the sequences already scanned
    for (int b0 = 0; b0 < batch; b0 += 32) {
        const int b = b0 + lane;
        const int n = b < batch ? (cu[b + 1] - cu[b] + tpt - 1) / tpt : 0;
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (t < before + total) {
            const int first = __ffs(__ballot_sync(0xffffffffu, before + incl > t)) - 1;
            const int incl_f = __shfl_sync(0xffffffffu, incl, first);
            const int n_f = __shfl_sync(0xffffffffu, n, first);
            seq = b0 + first;
            tile = n_f - 1 - (t - (before + incl_f - n_f));  // last tile first
            return true;
        }
        before += total;
    }
    return false;
}

template <typename T, int D>
__global__ void __launch_bounds__(PF_WARPS * 32) paged_attention_prefill_kernel(const PrefillArgs a) {
    using G = PrefillGeom<D>;
    constexpr int BK = G::BK, LD = G::LD, CHUNKS = G::CHUNKS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int group = a.hq / a.hkv;
    const int tpt = PF_ROWS / group;  // query tokens per tile
    const int kvh = blockIdx.y;

    int b, tile;
    if (!find_tile(a.cu_seqlens, a.batch, tpt, blockIdx.x, b, tile)) return;  // uniform over the block

    extern __shared__ __align__(16) unsigned char pf_smem[];
    T *q_s = reinterpret_cast<T *>(pf_smem);  // [PF_ROWS][LD]; at the end the output rows
    T *k_s = q_s + PF_ROWS * LD;              // [BK][LD]
    T *v_s = k_s + BK * LD;                   // [BK][LD]

    const int q_len = a.cu_seqlens[b + 1] - a.cu_seqlens[b];
    const int ctx = a.context_lens[b];
    const int tok0 = a.cu_seqlens[b] + tile * tpt;  // flat index of the tile's first token
    const int n_tok = min(tpt, q_len - tile * tpt);
    const int n_rows = n_tok * group;
    const int pos0 = ctx - q_len + tile * tpt;      // absolute position of the tile's first token
    const int pos_last = pos0 + n_tok - 1;
    const int window = a.sliding_window;
    const int k_lo = window > 0 ? max(0, pos0 - window + 1) : 0;  // first key any row sees
    const int k_hi = pos_last + 1;                                 // one past the last
    const int kt_first = k_lo / BK, kt_last = (k_hi - 1) / BK;

    const T *q = static_cast<const T *>(a.q);
    const T *k_pages = static_cast<const T *>(a.k_pages);
    const T *v_pages = static_cast<const T *>(a.v_pages);
    const int32_t *table = a.block_table + (size_t)b * a.max_blocks;
    const size_t row_stride = (size_t)a.hkv * D;  // elements between consecutive token rows of a page

    // Q rows (zeros past the tile's tokens).
#pragma unroll
    for (int i = 0; i < PF_ROWS * CHUNKS / (PF_WARPS * 32); ++i) {
        const int c = tid + i * PF_WARPS * 32, r = c / CHUNKS, ch = c % CHUNKS;
        const bool ok = r < n_rows;
        const T *src = ok ? q + ((size_t)(tok0 + r / group) * a.hq + kvh * group + r % group) * D + ch * 8 : q;
        cp_async_16_zfill(q_s + r * LD + ch * 8, src, ok);
    }
    // One K or V tile: keys j0 .. j0 + BK - 1, zeros outside [k_lo, k_hi).
    auto load_tile = [&](T *dst, const T *pages, int kt) {
#pragma unroll
        for (int i = 0; i < BK * CHUNKS / (PF_WARPS * 32); ++i) {
            const int c = tid + i * PF_WARPS * 32, r = c / CHUNKS, ch = c % CHUNKS;
            const int j = kt * BK + r;
            const bool ok = j >= k_lo && j < k_hi;
            const T *src = pages;
            if (ok) {
                const int page = a.page_shift >= 0 ? j >> a.page_shift : j / a.page_size;
                const int slot = j - page * a.page_size;
                src = pages + ((size_t)table[page] * a.page_size + slot) * row_stride + (size_t)kvh * D + ch * 8;
            }
            cp_async_16_zfill(dst + r * LD + ch * 8, src, ok);
        }
    };
    load_tile(k_s, k_pages, kt_first);
    cp_async_commit();

    // This lane's two rows (fragment rows lane/4 and lane/4 + 8 of the warp's 16) and their positions;
    // -1 for rows past the tile's tokens: they see no key (never stored).
    const int row0 = warp * 16 + (lane >> 2);
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) qpos[h] = row0 + 8 * h < n_rows ? pos0 + (row0 + 8 * h) / group : -1;

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // log2 units; l is this lane's part
    uint32_t qf[G::Q_IN_REGS ? D / 16 : 1][4];

    // ldmatrix addresses (element offsets). A (Q): matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15).
    // B of S (K rows): (keys 0-7, dims 0-7), (keys 0-7, dims 8-15), (keys 8-15, dims 0-7), (keys 8-15, 8-15).
    // B of P V (V rows, transposed): (keys 0-7, dims 0-7), (keys 8-15, dims 0-7), (keys 0-7, 8-15), (8-15, 8-15).
    const int a_off = (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + (lane >> 4) * 8;
    const int k_off = ((lane >> 4) * 8 + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
    const int v_off = (((lane >> 3) & 1) * 8 + (lane & 7)) * LD + (lane >> 4) * 8;

    const float s_mul = (a.softcap > 0.f ? 1.f / a.softcap : PF_LOG2E) * a.scale;
    for (int kt = kt_first; kt <= kt_last; ++kt) {
        cp_async_wait<0>();  // K(kt) (and Q on the first tile) arrived
        __syncthreads();     // ... for every thread; and every warp is done with V(kt - 1)
        if constexpr (G::Q_IN_REGS) {
            if (kt == kt_first) {
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], q_s + a_off + kk * 16);
            }
        }
        load_tile(v_s, v_pages, kt);
        cp_async_commit();

        // S = Q K^T for the warp's 16 rows x BK keys.
        float s[BK / 8][4];
#pragma unroll
        for (int i = 0; i < BK / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t af[4];
            if constexpr (G::Q_IN_REGS) {
#pragma unroll
                for (int i = 0; i < 4; ++i) af[i] = qf[kk][i];
            } else {
                ldmatrix_x4(af, q_s + a_off + kk * 16);
            }
#pragma unroll
            for (int np = 0; np < BK / 16; ++np) {
                uint32_t bf[4];
                ldmatrix_x4(bf, k_s + k_off + np * 16 * LD + kk * 16);
                mma_tile<T>(s[2 * np], af, bf[0], bf[1]);
                mma_tile<T>(s[2 * np + 1], af, bf[2], bf[3]);
            }
        }
        __syncthreads();  // every warp is done with K(kt): fetch K(kt + 1) during the softmax and P V
        if (kt < kt_last) load_tile(k_s, k_pages, kt + 1);
        cp_async_commit();  // (possibly empty: keeps the group count of the waits fixed)

        // Scores in log2 units (scale, softcap), mask, online softmax.
        const int j0 = kt * BK;
        const bool full = j0 + BK - 1 <= pos0 && (window <= 0 || j0 >= pos_last - window + 1);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float v = s[nt][e] * s_mul;
                if (a.softcap > 0.f) v = tanhf(v) * (a.softcap * PF_LOG2E);
                if (!full) {
                    const int j = j0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    const int qp = qpos[e >> 1];
                    if (j > qp || (window > 0 && j <= qp - window)) v = -INFINITY;
                }
                s[nt][e] = v;
                mx[e >> 1] = fmaxf(mx[e >> 1], v);
            }
        }
        float corr[2], base[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(m_run[h], mx[h]);
            base[h] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing seen yet: exp2(-inf) = 0
            corr[h] = fast_exp2(m_run[h] - base[h]);
            m_run[h] = m_new;
            l_run[h] *= corr[h];
        }
        uint32_t pf[BK / 16][4];  // P as A fragments of the P V mma (keys 16ks..16ks+15)
#pragma unroll
        for (int nt = 0; nt < BK / 8; ++nt) {
            const float p0 = fast_exp2(s[nt][0] - base[0]), p1 = fast_exp2(s[nt][1] - base[0]);
            const float p2 = fast_exp2(s[nt][2] - base[1]), p3 = fast_exp2(s[nt][3] - base[1]);
            l_run[0] += p0 + p1;
            l_run[1] += p2 + p3;
            pf[nt / 2][(nt & 1) * 2 + 0] = pack2<T>(p0, p1);
            pf[nt / 2][(nt & 1) * 2 + 1] = pack2<T>(p2, p3);
        }
#pragma unroll
        for (int dn = 0; dn < D / 8; ++dn) {
            o[dn][0] *= corr[0]; o[dn][1] *= corr[0];
            o[dn][2] *= corr[1]; o[dn][3] *= corr[1];
        }

        cp_async_wait<1>();  // V(kt) arrived (K(kt + 1) may still be in flight)
        __syncthreads();
        // O += P V.
#pragma unroll
        for (int ks = 0; ks < BK / 16; ++ks) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                uint32_t bf[4];
                ldmatrix_x4_trans(bf, v_s + v_off + ks * 16 * LD + dp * 16);
                mma_tile<T>(o[2 * dp], pf[ks], bf[0], bf[1]);
                mma_tile<T>(o[2 * dp + 1], pf[ks], bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();  // nothing in flight into shared memory past this point

    // Finish the rows: the 4 lanes of a row sum their parts of l; the sink joins the softmax as one more
    // logit; O / l in T, staged in the warp's own Q rows, then stored as 16-byte chunks.
    float inv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_run[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        const int r = row0 + 8 * h;
        float f = 1.f;
        if (a.sinks && r < n_rows) {
            const float sink = a.sinks[kvh * group + r % group] * PF_LOG2E;
            const float m_all = fmaxf(m_run[h], sink);
            f = fast_exp2(m_run[h] - m_all);
            l = l * f + fast_exp2(sink - m_all);
        }
        inv[h] = l > 0.f ? f / l : 0.f;
    }
    __syncwarp();  // the warp's ldmatrix reads of its Q rows are done
    T *o_s = q_s + (warp * 16) * LD;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
        const int col = dn * 8 + (lane & 3) * 2;
        *reinterpret_cast<uint32_t *>(o_s + (lane >> 2) * LD + col) = pack2<T>(o[dn][0] * inv[0], o[dn][1] * inv[0]);
        *reinterpret_cast<uint32_t *>(o_s + ((lane >> 2) + 8) * LD + col) = pack2<T>(o[dn][2] * inv[1], o[dn][3] * inv[1]);
    }
    __syncwarp();
    T *out = static_cast<T *>(a.out);
    for (int c = lane; c < 16 * CHUNKS; c += 32) {
        const int r = c / CHUNKS, ch = c % CHUNKS, row = warp * 16 + r;
        if (row >= n_rows) continue;
        *reinterpret_cast<uint4 *>(out + ((size_t)(tok0 + row / group) * a.hq + kvh * group + row % group) * D + ch * 8) =
            *reinterpret_cast<const uint4 *>(o_s + r * LD + ch * 8);
    }
}

template <typename T, int D>
int launch_prefill(const PrefillArgs &a, int64_t tokens, cudaStream_t stream) {
    auto kernel = paged_attention_prefill_kernel<T, D>;
    const size_t smem = PrefillGeom<D>::SMEM;
    // Above 48 KB a kernel must opt in; per call, so every device the library runs on gets it.
    if (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        if (err != cudaSuccess) {
            cudaGetLastError();
            return (int)err;
        }
    }
    const int tpt = PF_ROWS / (a.hq / a.hkv);
    // Sequence b has ceil(q_b / tpt) <= q_b / tpt + 1 tiles: at most tokens / tpt + batch in all.
    const int64_t tiles = (tokens + tpt - 1) / tpt + a.batch;
    kernel<<<dim3((unsigned)tiles, (unsigned)a.hkv), PF_WARPS * 32, smem, stream>>>(a);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

template <typename T>
int launch_prefill_dim(const PrefillArgs &a, int64_t tokens, int64_t d, cudaStream_t stream) {
    switch (d) {
        case 64: return launch_prefill<T, 64>(a, tokens, stream);
        case 96: return launch_prefill<T, 96>(a, tokens, stream);
        case 128: return launch_prefill<T, 128>(a, tokens, stream);
        case 160: return launch_prefill<T, 160>(a, tokens, stream);
        case 192: return launch_prefill<T, 192>(a, tokens, stream);
        case 256: return launch_prefill<T, 256>(a, tokens, stream);
        default: return TRELLM_E_UNSUPPORTED;
    }
}

}  // namespace

extern "C" int trellm_paged_attention_prefill(const void *q, const void *k_pages, const void *v_pages,
                                              const int32_t *block_table, const int32_t *cu_seqlens,
                                              const int32_t *context_lens, const float *sinks, void *out,
                                              int64_t tokens, int64_t batch, int64_t hq, int64_t hkv,
                                              int64_t head_dim, int64_t page_size, int64_t max_blocks, float scale,
                                              int sliding_window, float softcap, int dtype, cudaStream_t stream) {
    if (tokens < 0 || batch <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || page_size <= 0 || max_blocks <= 0)
        return TRELLM_E_BAD_SHAPE;
    if (hq / hkv > PF_ROWS) return TRELLM_E_UNSUPPORTED;  // a tile holds at least one token's heads
    if (dtype != TRELLM_F16 && dtype != TRELLM_BF16) return TRELLM_E_UNSUPPORTED;
    if (!q || !k_pages || !v_pages || !out || !block_table || !cu_seqlens || !context_lens) return TRELLM_E_BAD_ARG;
    if (((uintptr_t)q | (uintptr_t)k_pages | (uintptr_t)v_pages | (uintptr_t)out) & 15) return TRELLM_E_BAD_ARG;
    if (tokens == 0) return TRELLM_OK;
    PrefillArgs a;
    a.q = q; a.k_pages = k_pages; a.v_pages = v_pages;
    a.block_table = block_table; a.cu_seqlens = cu_seqlens; a.context_lens = context_lens;
    a.sinks = sinks; a.out = out;
    a.batch = (int)batch; a.hq = (int)hq; a.hkv = (int)hkv; a.page_size = (int)page_size;
    a.page_shift = (page_size & (page_size - 1)) == 0 ? __builtin_ctzll((unsigned long long)page_size) : -1;
    a.max_blocks = (int)max_blocks; a.sliding_window = sliding_window;
    a.scale = scale; a.softcap = softcap;
    if (dtype == TRELLM_F16) return launch_prefill_dim<half>(a, tokens, head_dim, stream);
    return launch_prefill_dim<__nv_bfloat16>(a, tokens, head_dim, stream);
}
