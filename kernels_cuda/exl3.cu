// EXL3 C entry points: the fused small-batch matmul, the mid-size matmul, tile decode, codebook decode.
#include "exl3_gemm_mid.cuh"

using namespace trellm;

namespace {

int check_exl3_dims(int64_t k, int64_t n, int K, int codebook) {
    if (k <= 0 || n <= 0 || k % 128 || n % 128) return TRELLM_E_BAD_SHAPE;
    if (K < 1 || K > 8) return TRELLM_E_BAD_ARG;
    if (codebook < 0 || codebook > 2) return TRELLM_E_BAD_ARG;
    if (k > INT32_MAX / 2 || n > INT32_MAX / 2) return TRELLM_E_BAD_SHAPE;
    return TRELLM_OK;
}

// The kernels' ResidualStream from the C ABI's rs (NULL: neither end), for the GEMV and the mid-size matmul.
ResidualStream residual_stream(const trellm_residual_stream *rs) {
    if (!rs) return ResidualStream{};
    return ResidualStream{rs->residual, rs->ssq_out, rs->ssq_in, rs->norm_weight, rs->norm_eps, rs->norm_unit_offset};
}

}  // namespace

extern "C" int64_t trellm_exl3_matmul_small_workspace(int64_t m, int64_t k, int64_t n) {
    return (int64_t)gemv_slices((int)k, (int)m, (int)n) * m * n;
}

namespace {

// The small-batch matmul of x (or act(x) * x_up, x_up non-null) by 1..4 parts in one launch.
int exl3_matmul_small_parts(const void *x, const void *x_up, int act, int x_dtype, int parts, const void *const *suh,
                            const int16_t *const *trellis, const void *const *svh, const void *const *bias,
                            void *const *y, const int64_t *n, int y_dtype, float *workspace, int32_t *counters,
                            int64_t counters_len, int64_t m, int64_t k, int K, int codebook, int num_sms,
                            cudaStream_t stream, const HeadEpilogue *head = nullptr,
                            const trellm_residual_stream *rs = nullptr) {
    if (parts < 1 || parts > GEMV_MAX_PARTS) return TRELLM_E_BAD_ARG;
    if (x_up && (act < TRELLM_ACT_SILU || act > TRELLM_ACT_RELU2)) return TRELLM_E_BAD_ARG;
    if (m < 1 || m > 16) return TRELLM_E_BAD_SHAPE;
    if (x_dtype < TRELLM_F16 || x_dtype > TRELLM_F32 || y_dtype < TRELLM_F16 || y_dtype > TRELLM_F32)
        return TRELLM_E_BAD_DTYPE;
    MatmulParts mp;
    mp.count = parts;
    mp.head = head ? *head : HeadEpilogue{};
    if (rs) {
#ifdef TRELLM_GEMV_NO_RESIDUAL_STREAM  // the A/B baseline build: the kernel has neither end
        if (rs->residual || rs->ssq_in) return TRELLM_E_BAD_ARG;
#endif
        if (rs->residual && (parts != 1 || head || !rs->ssq_out)) return TRELLM_E_BAD_ARG;
        if (rs->ssq_in && (x_up || !(rs->norm_eps >= 0.f))) return TRELLM_E_BAD_ARG;
    }
    mp.stream = residual_stream(rs);
    int64_t groups = 0, partial_offset = 0, n_total = 0;
    for (int p = 0; p < parts; ++p) n_total += n[p];
    const int slices = gemv_slices((int)k, (int)m, (int)n_total);
    for (int p = 0; p < parts; ++p) {
        const int rc = check_exl3_dims(k, n[p], K, codebook == CB_MUL1_SPLIT ? TRELLM_CB_MUL1 : codebook);
        if (rc) return rc;
        if (reinterpret_cast<uintptr_t>(trellis[p]) % 16) return TRELLM_E_BAD_ARG;  // 16-byte cp.async chunks
        MatmulArgs &a = mp.part[p];
        a.x = x;
        a.x_up = x_up;
        a.act = act;
        a.suh = static_cast<const half *>(suh[p]);
        a.trellis = reinterpret_cast<const uint32_t *>(trellis[p]);
        a.svh = static_cast<const half *>(svh[p]);
        a.bias = static_cast<const half *>(bias[p]);
        a.y = y[p];
        a.partial = workspace + partial_offset;
        a.counters = counters + groups;
        a.x_dtype = x_dtype;
        a.y_dtype = y_dtype;
        a.m = (int)m;
        a.k = (int)k;
        a.n = (int)n[p];
        a.cols_per_block = 0;
        partial_offset += (int64_t)slices * m * n[p];
        groups += n[p] / 128;
    }
    if (counters_len < groups) return TRELLM_E_BAD_ARG;
    switch (codebook) {
        case 0: return launch_exl3_matmul_small<0>(mp, K, num_sms, stream);
        case 1: return launch_exl3_matmul_small<1>(mp, K, num_sms, stream);
        case 2: return launch_exl3_matmul_small<2>(mp, K, num_sms, stream);
        default: return launch_exl3_matmul_small<CB_MUL1_SPLIT>(mp, K, num_sms, stream);
    }
}

}  // namespace

extern "C" int trellm_exl3_matmul_small_multi(const void *x, int x_dtype, int parts, const void *const *suh,
                                              const int16_t *const *trellis, const void *const *svh,
                                              const void *const *bias, void *const *y, const int64_t *n, int y_dtype,
                                              float *workspace, int32_t *counters, int64_t counters_len, int64_t m,
                                              int64_t k, int K, int codebook, const trellm_residual_stream *rs,
                                              int num_sms, cudaStream_t stream) {
    return exl3_matmul_small_parts(x, nullptr, 0, x_dtype, parts, suh, trellis, svh, bias, y, n, y_dtype, workspace,
                                   counters, counters_len, m, k, K, codebook, num_sms, stream, nullptr, rs);
}

namespace {

// The attention epilogue of a q/k/v call (both routes' *_qkv_rope entries), its arguments checked.
int qkv_head_epilogue(int dtype, const int64_t *n, const int64_t *positions, const float *cos, const float *sin,
                      int64_t table_len, int64_t rot_half, int interleaved, const void *q_norm, const void *k_norm,
                      float norm_eps, int norm_unit_offset, void *k_pages, void *v_pages, const int64_t *slots,
                      HeadEpilogue &head) {
    if (dtype != TRELLM_F16 && dtype != TRELLM_BF16) return TRELLM_E_BAD_DTYPE;
    if (n[0] <= 0 || n[0] % 128 || n[1] <= 0 || n[1] % 128 || n[2] != n[1]) return TRELLM_E_BAD_SHAPE;
    if (rot_half <= 0 || rot_half % 4 || 2 * rot_half > 128 || table_len <= 0) return TRELLM_E_BAD_ARG;
    if (!positions || !cos || !sin || (q_norm == nullptr) != (k_norm == nullptr)) return TRELLM_E_BAD_ARG;
    if ((k_pages == nullptr) != (v_pages == nullptr) || (k_pages != nullptr) != (slots != nullptr)) return TRELLM_E_BAD_ARG;
    head = HeadEpilogue{};
    head.enabled = 1;
    head.positions = positions;
    head.cos = cos;
    head.sin = sin;
    head.table_len = table_len;
    head.rot_half = (int)rot_half;
    head.interleaved = interleaved;
    head.q_norm = q_norm;
    head.k_norm = k_norm;
    head.eps = norm_eps;
    head.unit_offset = norm_unit_offset;
    head.k_pages = k_pages;
    head.v_pages = v_pages;
    head.slots = slots;
    head.hkv = (int)(n[1] / 128);
    return TRELLM_OK;
}

}  // namespace

extern "C" int trellm_exl3_matmul_small_qkv_rope(
    const void *x, int dtype, const void *const *suh, const int16_t *const *trellis, const void *const *svh,
    const void *const *bias, void *const *y, const int64_t *n, float *workspace, int32_t *counters,
    int64_t counters_len, int64_t m, int64_t k, int K, int codebook, const int64_t *positions, const float *cos,
    const float *sin, int64_t table_len, int64_t rot_half, int interleaved, const void *q_norm, const void *k_norm,
    float norm_eps, int norm_unit_offset, void *k_pages, void *v_pages, const int64_t *slots,
    const trellm_residual_stream *rs, int num_sms,
    cudaStream_t stream) {
    HeadEpilogue head;
    const int rc = qkv_head_epilogue(dtype, n, positions, cos, sin, table_len, rot_half, interleaved, q_norm, k_norm,
                                     norm_eps, norm_unit_offset, k_pages, v_pages, slots, head);
    if (rc) return rc;
    return exl3_matmul_small_parts(x, nullptr, 0, dtype, 3, suh, trellis, svh, bias, y, n, dtype, workspace, counters,
                                   counters_len, m, k, K, codebook, num_sms, stream, &head, rs);
}

extern "C" int trellm_exl3_matmul_small(const void *x, int x_dtype, const void *suh, const int16_t *trellis,
                                        const void *svh, const void *bias, void *y, int y_dtype, float *workspace,
                                        int32_t *counters, int64_t counters_len, int64_t m, int64_t k, int64_t n,
                                        int K, int codebook, const trellm_residual_stream *rs, int num_sms,
                                        cudaStream_t stream) {
    return exl3_matmul_small_parts(x, nullptr, 0, x_dtype, 1, &suh, &trellis, &svh, &bias, &y, &n, y_dtype, workspace,
                                   counters, counters_len, m, k, K, codebook, num_sms, stream, nullptr, rs);
}

extern "C" int trellm_exl3_matmul_small_gated(const void *gate, const void *up, int activation, int x_dtype,
                                              const void *suh, const int16_t *trellis, const void *svh,
                                              const void *bias, void *y, int y_dtype, float *workspace,
                                              int32_t *counters, int64_t counters_len, int64_t m, int64_t k,
                                              int64_t n, int K, int codebook, const trellm_residual_stream *rs,
                                              int num_sms, cudaStream_t stream) {
    if (!up) return TRELLM_E_BAD_ARG;
    return exl3_matmul_small_parts(gate, up, activation, x_dtype, 1, &suh, &trellis, &svh, &bias, &y, &n, y_dtype,
                                   workspace, counters, counters_len, m, k, K, codebook, num_sms, stream, nullptr, rs);
}

// The mid-size matmul's pack and finish launches (exl3_gemm_mid.cuh has the matmul between them).
namespace trellm {

// Launch 1: one warp per (part, row of the padded G*8, 128-wide chunk of k). A programmatic dependent of
// whatever wrote x, and it lets the matmul start at once (its trellis requests do not need the pack).
__global__ void exl3_mid_pack_kernel(const MidArgs a) {
    pdl_trigger();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int job = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int chunks = a.k / 128, rows = a.groups * 8;
    if (job >= a.parts * rows * chunks) return;
    const int part = job / (rows * chunks), row = job / chunks % rows, kk0 = (job % chunks) * 128 + lane * 4;
    const MidPart p = mid_part(a, part);
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    if (row < a.m) {
        load4_as_f32(a.x, a.x_dtype, (size_t)row * a.k + kk0, v);
        if (a.stream.ssq_in) stream_norm_input(a.stream, a.x_dtype, a.k, row, kk0, lane, v);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] *= __half2float(p.suh[kk0 + i]);
    }
    warp_hadamard_128(v);  // every lane takes part (rows past m are zero)
    if (a.x_sums) {  // MUL1's split route: this chunk's sum of x as the matmul reads it (fp16)
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 4; ++i) sum += __half2float(__float2half_rn(v[i]));
        sum = warp_sum(sum);
        if (lane == 0) a.x_sums[((size_t)part * rows + row) * chunks + job % chunks] = sum;
    }
    // The B fragment of (k tile t, row group g): lane 4(row % 8) + (c % 8) / 2 holds (x[c], x[c + 1]) in its
    // first word for c < 8, in its second for c >= 8 (c = k % 16, even c in the low half).
    const int g = row / 8, fragment_lane_row = (row % 8) * 4;
    uint16_t *xp16 = reinterpret_cast<uint16_t *>(p.xp);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int kk = kk0 + i, t = kk / 16, c = kk % 16;
        const int fragment_lane = fragment_lane_row + (c % 8) / 2, word = c >= 8;
        xp16[((((size_t)t * a.groups + g) * 32 + fragment_lane) * 2 + word) * 2 + (c & 1)] =
            __half_as_ushort(__float2half_rn(v[i]));
    }
}

// Launch 3: one warp per (row, 128-column group of any part): the group's partials in block order.
__global__ void exl3_mid_finish_kernel(const MidArgs a) {
    pdl_trigger();
    pdl_wait();
    const int lane = threadIdx.x & 31;
    const int job = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const int all_groups = a.group_begin[a.parts];
    if (job >= a.m * all_groups) return;
    const int row = job / all_groups, global_group = job % all_groups, chunks_k = a.k / MID_UNIT_K;
    int group, part;
    const MidPart p = mid_part_of(a, global_group, group, part);
    const int col = group * 128 + lane * 4;
    const int first = mid_block_of(global_group * chunks_k, a.units, a.blocks);
    const int pieces = mid_block_of((global_group + 1) * chunks_k - 1, a.units, a.blocks) - first + 1;
    float v[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < pieces; ++s) {
        const float4 q = *reinterpret_cast<const float4 *>(p.partial + ((size_t)s * a.m + row) * p.n + col);
        v[0] += q.x; v[1] += q.y; v[2] += q.z; v[3] += q.w;
    }
    if (a.x_sums) {  // MUL1's split route: the codebook's scale and offset (mul1_split_partial) on the whole sum
        const int chunks = a.k / 128;
        const float *sums = a.x_sums + ((size_t)part * a.groups * 8 + row) * chunks;
        float x_sum = 0.f;
        for (int c = lane; c < chunks; c += 32) x_sum += sums[c];
        x_sum = __shfl_sync(0xffffffffu, warp_sum(x_sum), 0);
#pragma unroll
        for (int i = 0; i < 4; ++i) v[i] = mul1_split_partial(v[i], x_sum);
    }
    warp_hadamard_128(v);
    if (a.head.enabled) {
        finish_head(a.head, p, a.y_dtype, part, v, row, col, lane);
        return;
    }
    if (a.stream.residual) {
        float res[4];
        load4_as_f32(a.stream.residual, a.y_dtype, (size_t)row * p.n + col, res);
        stream_add_output(a.stream, p.y, a.y_dtype, p.svh, p.bias, p.n, row, col, lane, v, res);
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float o = v[i] * __half2float(p.svh[col + i]);
        if (p.bias) o += __half2float(p.bias[col + i]);
        store_from_f32(p.y, a.y_dtype, (size_t)row * p.n + col + i, o);
    }
}

}  // namespace trellm

extern "C" int64_t trellm_exl3_matmul_mid_workspace(int64_t m, int64_t k, int parts, const int64_t *n, int num_sms) {
    if (m < 1 || m > MID_MAX_ROWS || k <= 0 || k % 128 || k > INT32_MAX / 2 || parts < 1 || parts > MID_MAX_PARTS)
        return 0;
    int64_t total_n = 0;
    for (int p = 0; p < parts; ++p) {
        if (n[p] <= 0 || n[p] % 128) return 0;
        total_n += n[p];
    }
    if (k % MID_UNIT_K || total_n / 128 * (k / MID_UNIT_K) > INT32_MAX / 2) return 0;
    return mid_workspace_floats((int)m, (int)k, parts, total_n, num_sms);
}

namespace {

// The mid-size matmul of x by 1..4 parts (three launches); head: the q/k/v attention epilogue (3 parts) or null.
int exl3_matmul_mid_parts(const void *x, int x_dtype, int parts, const void *const *suh,
                          const int16_t *const *trellis, const void *const *svh, const void *const *bias,
                          void *const *y, const int64_t *n, int y_dtype, float *workspace, int64_t workspace_len,
                          int64_t m, int64_t k, int K, int codebook, const trellm_residual_stream *rs, int num_sms,
                          cudaStream_t stream, const HeadEpilogue *head) {
    if (parts < 1 || parts > MID_MAX_PARTS || (head && parts != 3)) return TRELLM_E_BAD_ARG;
    if (rs && rs->residual && (parts != 1 || !rs->ssq_out)) return TRELLM_E_BAD_ARG;
    if (rs && rs->ssq_in && !(rs->norm_eps >= 0.f)) return TRELLM_E_BAD_ARG;
    if (m < 1 || m > MID_MAX_ROWS) return TRELLM_E_BAD_SHAPE;
    if (x_dtype < TRELLM_F16 || x_dtype > TRELLM_F32 || y_dtype < TRELLM_F16 || y_dtype > TRELLM_F32)
        return TRELLM_E_BAD_DTYPE;
    if (codebook == CB_MUL1_SPLIT && mid_groups((int)m) != 1) codebook = TRELLM_CB_MUL1;  // split: one row group
    const int64_t need = trellm_exl3_matmul_mid_workspace(m, k, parts, n, num_sms);
    if (need == 0) return TRELLM_E_BAD_SHAPE;
    if (workspace_len < need || reinterpret_cast<uintptr_t>(workspace) % 16) return TRELLM_E_BAD_ARG;
    MidArgs a{};
    a.parts = parts;
    a.x = x;
    a.x_dtype = x_dtype;
    a.y_dtype = y_dtype;
    a.m = (int)m;
    a.k = (int)k;
    a.groups = mid_groups((int)m);
    a.stream = residual_stream(rs);
    a.head = head ? *head : HeadEpilogue{};
    int64_t total_n = 0;
    for (int p = 0; p < parts; ++p) {
        const int rc = check_exl3_dims(k, n[p], K, codebook == CB_MUL1_SPLIT ? TRELLM_CB_MUL1 : codebook);
        if (rc) return rc;
        if (reinterpret_cast<uintptr_t>(trellis[p]) % 16) return TRELLM_E_BAD_ARG;
        a.group_begin[p] = (int)(total_n / 128);
        total_n += n[p];
    }
    for (int p = parts; p <= MID_MAX_PARTS; ++p) a.group_begin[p] = (int)(total_n / 128);
    a.units = a.group_begin[parts] * (a.k / MID_UNIT_K);
    a.blocks = mid_blocks(a.units, a.k / MID_UNIT_K, num_sms);
    const int pieces = mid_pieces(a.k / MID_UNIT_K, a.units, a.blocks);
    float *partial = workspace + (int64_t)parts * k * a.groups * 4;
    for (int p = 0; p < parts; ++p) {
        MidPart &q = a.part[p];
        q.trellis = reinterpret_cast<const uint32_t *>(trellis[p]);
        q.suh = static_cast<const half *>(suh[p]);
        q.svh = static_cast<const half *>(svh[p]);
        q.bias = static_cast<const half *>(bias[p]);
        q.y = y[p];
        q.xp = reinterpret_cast<uint32_t *>(workspace) + (int64_t)p * k * a.groups * 4;
        q.partial = partial;
        q.n = (int)n[p];
        partial += (int64_t)pieces * m * n[p];
    }
    a.x_sums = codebook == CB_MUL1_SPLIT ? partial : nullptr;  // after the partials (mid_workspace_floats)
    const int pack_jobs = parts * a.groups * 8 * (a.k / 128);
    const cudaError_t err = launch_pdl(exl3_mid_pack_kernel, dim3((pack_jobs + 7) / 8), dim3(256), 0, stream, a);
    if (err != cudaSuccess) return (int)err;
    int rc;
    switch (codebook) {
        case 0: rc = launch_exl3_matmul_mid<0>(a, K, stream); break;
        case 1: rc = launch_exl3_matmul_mid<1>(a, K, stream); break;
        case 2: rc = launch_exl3_matmul_mid<2>(a, K, stream); break;
        default: rc = launch_exl3_matmul_mid<CB_MUL1_SPLIT>(a, K, stream); break;
    }
    if (rc) return rc;
    const int finish_jobs = a.m * a.group_begin[parts];
    const cudaError_t fin = launch_pdl(exl3_mid_finish_kernel, dim3((finish_jobs + 7) / 8), dim3(256), 0, stream, a);
    return fin == cudaSuccess ? TRELLM_OK : (int)fin;
}

}  // namespace

extern "C" int trellm_exl3_matmul_mid(const void *x, int x_dtype, int parts, const void *const *suh,
                                      const int16_t *const *trellis, const void *const *svh,
                                      const void *const *bias, void *const *y, const int64_t *n, int y_dtype,
                                      float *workspace, int64_t workspace_len, int64_t m, int64_t k, int K,
                                      int codebook, const trellm_residual_stream *rs, int num_sms,
                                      cudaStream_t stream) {
    return exl3_matmul_mid_parts(x, x_dtype, parts, suh, trellis, svh, bias, y, n, y_dtype, workspace, workspace_len,
                                 m, k, K, codebook, rs, num_sms, stream, nullptr);
}

extern "C" int trellm_exl3_matmul_mid_qkv_rope(
    const void *x, int dtype, const void *const *suh, const int16_t *const *trellis, const void *const *svh,
    const void *const *bias, void *const *y, const int64_t *n, float *workspace, int64_t workspace_len, int64_t m,
    int64_t k, int K, int codebook, const int64_t *positions, const float *cos, const float *sin, int64_t table_len,
    int64_t rot_half, int interleaved, const void *q_norm, const void *k_norm, float norm_eps, int norm_unit_offset,
    void *k_pages, void *v_pages, const int64_t *slots, const trellm_residual_stream *rs, int num_sms,
    cudaStream_t stream) {
    HeadEpilogue head;
    const int rc = qkv_head_epilogue(dtype, n, positions, cos, sin, table_len, rot_half, interleaved, q_norm, k_norm,
                                     norm_eps, norm_unit_offset, k_pages, v_pages, slots, head);
    if (rc) return rc;
    return exl3_matmul_mid_parts(x, dtype, 3, suh, trellis, svh, bias, y, n, dtype, workspace, workspace_len, m, k, K,
                                 codebook, rs, num_sms, stream, &head);
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
