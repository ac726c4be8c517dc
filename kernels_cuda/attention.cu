// Paged-KV attention for decode and chunked prefill (GQA, causal, sliding window, softcap, sinks).
//
// One block per (query token, kv head, chunk of up to GMAX query heads of that kv head's group): the
// group's queries share every K/V row read. Each warp walks a strided subset of the token's visible
// keys with an online softmax; the warps' partial results are merged through shared memory.
// Prefill chunks run through the same kernel (each query token is its own block), which is correct
// but re-reads K/V per token: a tiled prefill kernel is the follow-up.
#include "common.cuh"

namespace {

constexpr int ATT_WARPS = 4;
constexpr int GMAX = 8;

template <typename T, int DPL>
__global__ void __launch_bounds__(ATT_WARPS * 32)
paged_attention_kernel(const T *__restrict__ q, const T *__restrict__ k_pages, const T *__restrict__ v_pages,
                       const int32_t *__restrict__ block_table, const int32_t *__restrict__ cu_seqlens,
                       const int32_t *__restrict__ context_lens, const float *__restrict__ sinks,
                       T *__restrict__ out, int batch, int hq, int hkv, int page_size, int max_blocks, float scale,
                       int sliding_window, float softcap) {
    constexpr int D = DPL * 32;
    const int token = blockIdx.x, kvh = blockIdx.y;
    const int group = hq / hkv;
    const int g0 = blockIdx.z * GMAX;
    const int gn = min(GMAX, group - g0);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    // Which sequence holds this token: the last b with cu_seqlens[b] <= token.
    int lo = 0, hi = batch - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_seqlens[mid] <= token) lo = mid; else hi = mid - 1;
    }
    const int b = lo;
    const int q_len = cu_seqlens[b + 1] - cu_seqlens[b];
    const int ctx = context_lens[b];
    const int qpos = ctx - q_len + (token - cu_seqlens[b]);
    const int k_end = min(qpos, ctx - 1);  // inclusive
    const int k_begin = sliding_window > 0 ? max(0, qpos - sliding_window + 1) : 0;

    float qv[GMAX][DPL];
#pragma unroll
    for (int g = 0; g < GMAX; ++g)
#pragma unroll
        for (int i = 0; i < DPL; ++i)
            qv[g][i] = g < gn ? to_f32(q[((size_t)token * hq + kvh * group + g0 + g) * D + i * 32 + lane]) * scale : 0.f;

    float m_run[GMAX], l_run[GMAX], acc[GMAX][DPL];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        m_run[g] = -INFINITY;
        l_run[g] = 0.f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) acc[g][i] = 0.f;
    }

    const int32_t *table = block_table + (size_t)b * max_blocks;
    for (int j = k_begin + warp; j <= k_end; j += ATT_WARPS) {
        const int page = table[j / page_size];
        const size_t row = (((size_t)page * page_size + (j % page_size)) * hkv + kvh) * D;
        float kr[DPL], vr[DPL];
#pragma unroll
        for (int i = 0; i < DPL; ++i) {
            kr[i] = to_f32(k_pages[row + i * 32 + lane]);
            vr[i] = to_f32(v_pages[row + i * 32 + lane]);
        }
#pragma unroll
        for (int g = 0; g < GMAX; ++g) {
            if (g >= gn) break;
            float s = 0.f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) s += qv[g][i] * kr[i];
            s = warp_sum(s);
            if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
            const float m_new = fmaxf(m_run[g], s);
            const float corr = __expf(m_run[g] - m_new);
            const float p = __expf(s - m_new);
            l_run[g] = l_run[g] * corr + p;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[g][i] = acc[g][i] * corr + p * vr[i];
            m_run[g] = m_new;
        }
    }

    __shared__ float sm_m[ATT_WARPS][GMAX], sm_l[ATT_WARPS][GMAX];
    __shared__ float sm_acc[ATT_WARPS][GMAX][D];
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
        if (lane == 0) { sm_m[warp][g] = m_run[g]; sm_l[warp][g] = l_run[g]; }
#pragma unroll
        for (int i = 0; i < DPL; ++i) sm_acc[warp][g][i * 32 + lane] = acc[g][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < gn * D; idx += blockDim.x) {
        const int g = idx / D, d = idx % D;
        const int head = kvh * group + g0 + g;
        float m_all = -INFINITY;
        for (int w = 0; w < ATT_WARPS; ++w) m_all = fmaxf(m_all, sm_m[w][g]);
        const float sink = sinks ? sinks[head] : -INFINITY;
        m_all = fmaxf(m_all, sink);
        float l_all = sinks ? __expf(sink - m_all) : 0.f, o = 0.f;
        for (int w = 0; w < ATT_WARPS; ++w) {
            if (sm_m[w][g] == -INFINITY) continue;
            const float f = __expf(sm_m[w][g] - m_all);
            l_all += sm_l[w][g] * f;
            o += sm_acc[w][g][d] * f;
        }
        out[((size_t)token * hq + head) * D + d] = from_f32<T>(l_all > 0.f ? o / l_all : 0.f);
    }
}

template <typename T>
int launch_attention(const void *q, const void *kp, const void *vp, const int32_t *bt, const int32_t *cu,
                     const int32_t *cl, const float *sinks, void *out, int64_t tokens, int64_t batch, int64_t hq,
                     int64_t hkv, int64_t d, int64_t page_size, int64_t max_blocks, float scale, int window,
                     float softcap, cudaStream_t stream) {
    const int group = (int)(hq / hkv);
    dim3 grid((unsigned)tokens, (unsigned)hkv, (unsigned)((group + GMAX - 1) / GMAX));
#define ATT_CASE(DPL)                                                                                          \
    case DPL:                                                                                                  \
        paged_attention_kernel<T, DPL><<<grid, ATT_WARPS * 32, 0, stream>>>(                                   \
            static_cast<const T *>(q), static_cast<const T *>(kp), static_cast<const T *>(vp), bt, cu, cl, sinks, \
            static_cast<T *>(out), (int)batch, (int)hq, (int)hkv, (int)page_size, (int)max_blocks, scale, window, \
            softcap);                                                                                          \
        break;
    switch (d / 32) {
        ATT_CASE(2) ATT_CASE(3) ATT_CASE(4) ATT_CASE(5) ATT_CASE(6) ATT_CASE(8)
        default: return TRELLM_E_UNSUPPORTED;
    }
#undef ATT_CASE
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_paged_attention(const void *q, const void *k_pages, const void *v_pages,
                                      const int32_t *block_table, const int32_t *cu_seqlens,
                                      const int32_t *context_lens, const float *sinks, void *out, int64_t tokens,
                                      int64_t batch, int64_t hq, int64_t hkv, int64_t head_dim, int64_t page_size,
                                      int64_t max_blocks, float scale, int sliding_window, float softcap, int dtype,
                                      cudaStream_t stream) {
    if (tokens < 0 || batch <= 0 || hq <= 0 || hkv <= 0 || hq % hkv || page_size <= 0 || max_blocks <= 0)
        return TRELLM_E_BAD_SHAPE;
    if (head_dim % 32 || head_dim < 64 || head_dim > 256 || head_dim == 224) return TRELLM_E_UNSUPPORTED;
    if (tokens == 0) return TRELLM_OK;
    TRELLM_DISPATCH_DTYPE(dtype, T,
        return launch_attention<T>(q, k_pages, v_pages, block_table, cu_seqlens, context_lens, sinks, out, tokens,
                                   batch, hq, hkv, head_dim, page_size, max_blocks, scale, sliding_window, softcap,
                                   stream));
    return TRELLM_OK;
}
