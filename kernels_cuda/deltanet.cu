// Decode-step kernels of the gated delta net and of Kimi delta attention (KDA): the gated delta rule for one
// token per sequence and the causal depthwise conv1d step. Each replaces a dozen small torch kernels with one launch.
//
// Gated delta rule, per (sequence, value head) with state S [Dk, Dv] (float32):
//     S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T (q / sqrt(Dk))
// KDA is the same rule with a decay per key channel, S <- diag(exp(g)) S, g [Dk]: the kernel's KEY_DECAY form,
// which keeps the Dk decays in shared memory beside q and k and scales row i of the state by its own.
// Every column j of S evolves on its own given the two dot products over Dk, so a block owns 32
// columns: lane = column, warp w holds rows [w*Dk/4, (w+1)*Dk/4) of them in registers; the two column
// sums go through shared memory. One read and one write of the state, coalesced along Dv.
#include "common.cuh"

namespace {

constexpr int DN_WARPS = 4;

struct DeltaArgs {
    const void *q, *k, *v;
    const float *g, *beta, *state;
    float *new_state;
    void *out;
    const int64_t *slots;   // NULL: row b of state; else state row slots[b] (in place when new_state == state)
    const uint8_t *fresh;   // NULL, or [batch]: 1 = start from the zero state
    int q_dtype, k_dtype, v_dtype, heads, dv;
    float scale;
    // Row layout: head h of sequence b reads q/k at b * qk_row + (h / groups) * DK, v at b * v_row + h * dv.
    int64_t qk_row, v_row;
    int groups;
    // Raw inputs (gates != NULL, a gated delta net's decode step): q and k are L2-normalised here (l2_eps), and
    // g = -exp(A_log[h]) * softplus(a + dt_bias[h]), beta = sigmoid(b) * beta_scale from gates = {a, b} [batch, heads].
    const void *gate_a, *gate_b;
    int gate_dtype;
    const float *A_log, *dt_bias;
    float beta_scale, l2_eps;
    // KDA (key_decay): g is float32 [batch, heads, DK], or from raw inputs gate_a = f [batch, heads * DK] per channel:
    // g = lower_bound * sigmoid(exp(A_log[h]) * x) (bounded) or -exp(A_log[h]) * softplus(x), x = f + dt_bias[h * DK + i].
    int key_decay, bounded;
    float lower_bound;
};

__device__ __forceinline__ float dn_softplus(float x) { return x > 20.f ? x : log1pf(__expf(x)); }  // torch's threshold

// KDA's log decay of one key channel from its raw gate x = f + dt_bias, rate = exp(A_log[h]).
__device__ __forceinline__ float kda_log_decay(float x, float rate, const DeltaArgs &a) {
    return a.bounded ? a.lower_bound / (1.f + __expf(-rate * x)) : -rate * dn_softplus(x);
}

// Block-wide sums of two values (DN_WARPS warps); red [DN_WARPS][32] is free before and after.
__device__ __forceinline__ float2 dn_block_sum2(float2 v, float (*red)[32]) {
    v.x = warp_sum(v.x);
    v.y = warp_sum(v.y);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { red[warp][0] = v.x; red[warp][1] = v.y; }
    __syncthreads();
    float2 total = make_float2(0.f, 0.f);
#pragma unroll
    for (int w = 0; w < DN_WARPS; ++w) { total.x += red[w][0]; total.y += red[w][1]; }
    __syncthreads();
    return total;
}

// grid (Dv / 32, batch * heads), DN_WARPS warps. KEY_DECAY: KDA's decay per key channel (a.key_decay).
template <int DK, bool KEY_DECAY>
__global__ void __launch_bounds__(DN_WARPS * 32) gated_delta_step_kernel(const DeltaArgs a) {
    constexpr int R = DK / DN_WARPS;
    __shared__ float qs[DK], ks[DK];
    __shared__ float key_decays[KEY_DECAY ? DK : 1];
    __shared__ float red[DN_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t bh = blockIdx.y;
    const int col = blockIdx.x * 32 + lane;
    const size_t b = bh / a.heads;
    const int h = (int)(bh % a.heads);
    const size_t qk = b * a.qk_row + (size_t)(h / a.groups) * DK;
    const bool raw = a.gate_a != nullptr;
    const float rate = raw ? __expf(a.A_log[h]) : 0.f;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
        qs[i] = load_as_f32(a.q, a.q_dtype, qk + i) * (raw ? 1.f : a.scale);
        ks[i] = load_as_f32(a.k, a.k_dtype, qk + i);
        if constexpr (KEY_DECAY) {
            const size_t c = bh * DK + i;
            key_decays[i] = __expf(raw ? kda_log_decay(load_as_f32(a.gate_a, a.gate_dtype, c) + a.dt_bias[(size_t)h * DK + i],
                                                       rate, a)
                                       : a.g[c]);
        }
    }
    __syncthreads();
    float decay = 1.f, beta;  // decay: the scalar per head (unused with KEY_DECAY)
    if (raw) {
        float2 ssq = make_float2(0.f, 0.f);
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            ssq.x += qs[i] * qs[i];
            ssq.y += ks[i] * ks[i];
        }
        ssq = dn_block_sum2(ssq, red);
        const float q_factor = rsqrtf(ssq.x + a.l2_eps) * a.scale, k_factor = rsqrtf(ssq.y + a.l2_eps);
        for (int i = threadIdx.x; i < DK; i += blockDim.x) {
            qs[i] *= q_factor;
            ks[i] *= k_factor;
        }
        __syncthreads();
        if constexpr (!KEY_DECAY) decay = __expf(-rate * dn_softplus(load_as_f32(a.gate_a, a.gate_dtype, bh) + a.dt_bias[h]));
        beta = a.beta_scale / (1.f + __expf(-load_as_f32(a.gate_b, a.gate_dtype, bh)));
    } else {
        if constexpr (!KEY_DECAY) decay = __expf(a.g[bh]);
        beta = a.beta[bh];
    }
    const size_t row = a.slots ? (size_t)a.slots[b] * a.heads + h : bh;
    const bool zero = a.fresh && a.fresh[b];
    const float *S = a.state + row * DK * a.dv + col;
    float *NS = a.new_state + row * DK * a.dv + col;
    const int r0 = warp * R;

    float s[R];
    float predicted = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        s[r] = zero ? 0.f : S[(size_t)(r0 + r) * a.dv] * (KEY_DECAY ? key_decays[r0 + r] : decay);
        predicted += s[r] * ks[r0 + r];
    }
    red[warp][lane] = predicted;
    __syncthreads();
    predicted = 0.f;
#pragma unroll
    for (int w = 0; w < DN_WARPS; ++w) predicted += red[w][lane];
    const float u = beta * (load_as_f32(a.v, a.v_dtype, b * a.v_row + (size_t)h * a.dv + col) - predicted);
    __syncthreads();  // everyone has read red before it is reused

    float o = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        s[r] += ks[r0 + r] * u;
        o += s[r] * qs[r0 + r];
        NS[(size_t)(r0 + r) * a.dv] = s[r];
    }
    red[warp][lane] = o;
    __syncthreads();
    if (warp == 0) {
        o = 0.f;
#pragma unroll
        for (int w = 0; w < DN_WARPS; ++w) o += red[w][lane];
        store_from_f32(a.out, a.v_dtype, bh * a.dv + col, o);
    }
}

constexpr int CONV_MAX_WIDTH = 8;

struct ConvArgs {
    const void *x, *weight, *bias, *states;
    void *out, *new_states;
    const int64_t *slots;   // NULL: state row b; else row slots[b] (in place when new_states == states)
    const uint8_t *fresh;   // NULL, or [batch]: 1 = zero history
    int x_dtype, w_dtype, b_dtype, s_dtype, batch, channels, width, silu;
};

// One thread per (sequence, channel): window = [states | x] (in the weight dtype), y = window . w + bias.
__global__ void conv1d_step_kernel(const ConvArgs a) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)a.batch * a.channels) return;
    const int c = (int)(i % a.channels);
    const int64_t b = i / a.channels;
    const size_t srow = a.slots ? (size_t)a.slots[b] * a.channels + c : (size_t)i;
    const bool zero = a.fresh && a.fresh[b];
    const int hist = a.width - 1;
    float window[CONV_MAX_WIDTH];
#pragma unroll
    for (int j = 0; j < CONV_MAX_WIDTH - 1; ++j)
        if (j < hist) window[j] = zero ? 0.f : round_as(load_as_f32(a.states, a.s_dtype, srow * hist + j), a.w_dtype);
    window[hist < CONV_MAX_WIDTH ? hist : CONV_MAX_WIDTH - 1] = round_as(load_as_f32(a.x, a.x_dtype, (size_t)i), a.w_dtype);
    float y = 0.f;
#pragma unroll
    for (int j = 0; j < CONV_MAX_WIDTH; ++j)
        if (j < a.width) y += window[j] * load_as_f32(a.weight, a.w_dtype, (size_t)c * a.width + j);
    if (a.bias) y += load_as_f32(a.bias, a.b_dtype, c);
    if (a.silu) y = y / (1.f + __expf(-y));
    store_from_f32(a.out, a.x_dtype, (size_t)i, y);
#pragma unroll
    for (int j = 0; j < CONV_MAX_WIDTH - 1; ++j)
        if (j < hist) store_from_f32(a.new_states, a.s_dtype, srow * hist + j, window[j + 1]);
}

bool valid_dtype(int d) { return d >= TRELLM_F16 && d <= TRELLM_F32; }

// One warp per row of x [rows, dim]: y = round(round(x * rsqrt(mean(x^2) + eps) * w) * act(gate)), act silu or
// sigmoid, rounded to x's dtype where the reference rounds (rms_norm's output, the product).
__global__ void gated_rms_norm_kernel(const void *x, int x_dtype, const void *weight, int w_dtype, const void *gate,
                                      int g_dtype, void *y, int64_t rows, int dim, float eps, int sigmoid_gate) {
    const int lane = threadIdx.x & 31;
    const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const size_t base = (size_t)row * dim;
    float ssq = 0.f;
    for (int c = lane; c < dim; c += 32) {
        const float v = load_as_f32(x, x_dtype, base + c);
        ssq += v * v;
    }
    const float rstd = rsqrtf(warp_sum(ssq) / dim + eps);
    for (int c = lane; c < dim; c += 32) {
        const float normed = round_as(load_as_f32(x, x_dtype, base + c) * rstd * load_as_f32(weight, w_dtype, c), x_dtype);
        const float g = load_as_f32(gate, g_dtype, base + c);
        const float act = sigmoid_gate ? 1.f / (1.f + __expf(-g)) : g / (1.f + __expf(-g));
        store_from_f32(y, x_dtype, base + c, normed * act);
    }
}

}  // namespace

extern "C" int trellm_gated_rms_norm(const void *x, int x_dtype, const void *weight, int w_dtype, const void *gate,
                                     int g_dtype, void *y, int64_t rows, int64_t dim, float eps, int sigmoid_gate,
                                     cudaStream_t stream) {
    if (rows < 0 || dim < 1 || dim > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    if (!valid_dtype(x_dtype) || !valid_dtype(w_dtype) || !valid_dtype(g_dtype)) return TRELLM_E_BAD_DTYPE;
    if (rows == 0) return TRELLM_OK;
    constexpr int warps = 4;
    const int64_t blocks = (rows + warps - 1) / warps;
    if (blocks > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    gated_rms_norm_kernel<<<(unsigned)blocks, warps * 32, 0, stream>>>(x, x_dtype, weight, w_dtype, gate, g_dtype, y, rows,
                                                                      (int)dim, eps, sigmoid_gate);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

namespace {

template <bool KEY_DECAY>
int launch_delta_kernel(const DeltaArgs &a, dim3 grid, int64_t dk, cudaStream_t stream) {
    switch (dk) {
        case 64: gated_delta_step_kernel<64, KEY_DECAY><<<grid, DN_WARPS * 32, 0, stream>>>(a); break;
        case 128: gated_delta_step_kernel<128, KEY_DECAY><<<grid, DN_WARPS * 32, 0, stream>>>(a); break;
        case 256: gated_delta_step_kernel<256, KEY_DECAY><<<grid, DN_WARPS * 32, 0, stream>>>(a); break;
        default: return TRELLM_E_UNSUPPORTED;
    }
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

int launch_delta_step(DeltaArgs a, int64_t batch, int64_t heads, int64_t dk, int64_t dv, cudaStream_t stream) {
    if (batch <= 0 || heads <= 0 || dv <= 0 || dv % 32 || batch * heads > 65535) return TRELLM_E_BAD_SHAPE;
    if (!valid_dtype(a.q_dtype) || !valid_dtype(a.k_dtype) || !valid_dtype(a.v_dtype)) return TRELLM_E_BAD_DTYPE;
    if (a.groups < 1 || heads % a.groups) return TRELLM_E_BAD_SHAPE;
    a.heads = (int)heads;
    a.dv = (int)dv;
    if (!a.gate_a) {  // q, k, v contiguous [batch, heads, d]
        a.qk_row = heads * dk;
        a.v_row = heads * dv;
    }
    const dim3 grid((unsigned)(dv / 32), (unsigned)(batch * heads));
    return a.key_decay ? launch_delta_kernel<true>(a, grid, dk, stream) : launch_delta_kernel<false>(a, grid, dk, stream);
}

int launch_conv_step(ConvArgs a, int64_t batch, int64_t channels, int64_t width, cudaStream_t stream) {
    if (batch <= 0 || channels <= 0 || width < 1 || width > CONV_MAX_WIDTH) return TRELLM_E_BAD_SHAPE;
    if (batch * channels > INT32_MAX) return TRELLM_E_BAD_SHAPE;
    if (!valid_dtype(a.x_dtype) || !valid_dtype(a.w_dtype) || !valid_dtype(a.s_dtype) || (a.bias && !valid_dtype(a.b_dtype)))
        return TRELLM_E_BAD_DTYPE;
    a.batch = (int)batch;
    a.channels = (int)channels;
    a.width = (int)width;
    const int64_t total = batch * channels;
    conv1d_step_kernel<<<(unsigned)((total + 255) / 256), 256, 0, stream>>>(a);
    TRELLM_LAUNCH_CHECK();
    return TRELLM_OK;
}

DeltaArgs delta_args(const void *q, int q_dtype, const void *k, int k_dtype, const void *v, int v_dtype, const float *g,
                     const float *beta, const float *state, float *new_state, void *out, const int64_t *slots,
                     const uint8_t *fresh, float scale) {
    DeltaArgs a;
    a.q = q; a.k = k; a.v = v; a.g = g; a.beta = beta; a.state = state; a.new_state = new_state; a.out = out;
    a.slots = slots; a.fresh = fresh;
    a.q_dtype = q_dtype; a.k_dtype = k_dtype; a.v_dtype = v_dtype; a.heads = 1; a.dv = 0; a.scale = scale;
    a.qk_row = a.v_row = 0; a.groups = 1;
    a.gate_a = a.gate_b = nullptr; a.gate_dtype = 0; a.A_log = a.dt_bias = nullptr; a.beta_scale = 1.f; a.l2_eps = 0.f;
    a.key_decay = a.bounded = 0; a.lower_bound = 0.f;
    return a;
}

int delta_step_slots(const void *q, int q_dtype, const void *k, int k_dtype, const void *v, int v_dtype, const float *g,
                     const float *beta, float *states, const int64_t *slots, const uint8_t *fresh, void *out,
                     int64_t batch, int64_t heads, int64_t dk, int64_t dv, float scale, int key_decay,
                     cudaStream_t stream) {
    if (!slots) return TRELLM_E_BAD_ARG;
    DeltaArgs a = delta_args(q, q_dtype, k, k_dtype, v, v_dtype, g, beta, states, states, out, slots, fresh, scale);
    a.key_decay = key_decay;
    return launch_delta_step(a, batch, heads, dk, dv, stream);
}

// The step's arguments from raw inputs (trellm_gated_delta_net_step_slots, trellm_kimi_delta_attention_step_slots):
// q | k | v read in place from mixed rows, the gates from a and b. TRELLM_OK or the error of arguments that do not fit.
int raw_delta_args(DeltaArgs *d, const void *mixed, int dtype, int64_t row_stride, const void *a, const void *b,
                   int gate_dtype, const float *A_log, const float *dt_bias, float l2_eps, float *states,
                   const int64_t *slots, const uint8_t *fresh, void *out, int64_t k_heads, int64_t v_heads, int64_t dk,
                   int64_t dv, float scale) {
    if (!slots || !a || !b || !A_log || !dt_bias) return TRELLM_E_BAD_ARG;
    if (k_heads <= 0 || v_heads % k_heads || row_stride < 2 * k_heads * dk + v_heads * dv) return TRELLM_E_BAD_SHAPE;
    if (!valid_dtype(gate_dtype)) return TRELLM_E_BAD_DTYPE;
    const size_t esize = dtype == TRELLM_F32 ? 4 : 2;
    const char *base = static_cast<const char *>(mixed);
    *d = delta_args(base, dtype, base + esize * k_heads * dk, dtype, base + esize * 2 * k_heads * dk, dtype, nullptr,
                    nullptr, states, states, out, slots, fresh, scale);
    d->qk_row = d->v_row = row_stride;
    d->groups = (int)(v_heads / k_heads);
    d->gate_a = a; d->gate_b = b; d->gate_dtype = gate_dtype; d->A_log = A_log; d->dt_bias = dt_bias;
    d->l2_eps = l2_eps;
    return TRELLM_OK;
}

ConvArgs conv_args(const void *x, int x_dtype, const void *weight, int w_dtype, const void *bias, int b_dtype,
                   const void *states, int s_dtype, void *out, void *new_states, const int64_t *slots,
                   const uint8_t *fresh, int silu) {
    ConvArgs a;
    a.x = x; a.weight = weight; a.bias = bias; a.states = states; a.out = out; a.new_states = new_states;
    a.slots = slots; a.fresh = fresh;
    a.x_dtype = x_dtype; a.w_dtype = w_dtype; a.b_dtype = b_dtype; a.s_dtype = s_dtype;
    a.batch = a.channels = a.width = 0; a.silu = silu;
    return a;
}

}  // namespace

extern "C" int trellm_gated_delta_rule_step(const void *q, int q_dtype, const void *k, int k_dtype, const void *v,
                                            int v_dtype, const float *g, const float *beta, const float *state,
                                            float *new_state, void *out, int64_t batch_heads, int64_t dk, int64_t dv,
                                            float scale, cudaStream_t stream) {
    DeltaArgs a = delta_args(q, q_dtype, k, k_dtype, v, v_dtype, g, beta, state, new_state, out, nullptr, nullptr, scale);
    return launch_delta_step(a, batch_heads, 1, dk, dv, stream);
}

extern "C" int trellm_gated_delta_rule_step_slots(const void *q, int q_dtype, const void *k, int k_dtype, const void *v,
                                                  int v_dtype, const float *g, const float *beta, float *states,
                                                  const int64_t *slots, const uint8_t *fresh, void *out, int64_t batch,
                                                  int64_t heads, int64_t dk, int64_t dv, float scale,
                                                  cudaStream_t stream) {
    return delta_step_slots(q, q_dtype, k, k_dtype, v, v_dtype, g, beta, states, slots, fresh, out, batch, heads, dk, dv,
                            scale, 0, stream);
}

extern "C" int trellm_kda_step_slots(const void *q, int q_dtype, const void *k, int k_dtype, const void *v, int v_dtype,
                                     const float *g, const float *beta, float *states, const int64_t *slots,
                                     const uint8_t *fresh, void *out, int64_t batch, int64_t heads, int64_t dk,
                                     int64_t dv, float scale, cudaStream_t stream) {
    return delta_step_slots(q, q_dtype, k, k_dtype, v, v_dtype, g, beta, states, slots, fresh, out, batch, heads, dk, dv,
                            scale, 1, stream);
}

extern "C" int trellm_gated_delta_net_step_slots(const void *mixed, int dtype, int64_t row_stride, const void *a,
                                                 const void *b, int gate_dtype, const float *A_log, const float *dt_bias,
                                                 float beta_scale, float l2_eps, float *states, const int64_t *slots,
                                                 const uint8_t *fresh, void *out, int64_t batch, int64_t k_heads,
                                                 int64_t v_heads, int64_t dk, int64_t dv, float scale,
                                                 cudaStream_t stream) {
    DeltaArgs d;
    const int rc = raw_delta_args(&d, mixed, dtype, row_stride, a, b, gate_dtype, A_log, dt_bias, l2_eps, states, slots,
                                  fresh, out, k_heads, v_heads, dk, dv, scale);
    if (rc != TRELLM_OK) return rc;
    d.beta_scale = beta_scale;
    return launch_delta_step(d, batch, v_heads, dk, dv, stream);
}

extern "C" int trellm_kimi_delta_attention_step_slots(const void *mixed, int dtype, int64_t row_stride, const void *f,
                                                      const void *b, int gate_dtype, const float *A_log,
                                                      const float *dt_bias, int bounded, float lower_bound,
                                                      float l2_eps, float *states, const int64_t *slots,
                                                      const uint8_t *fresh, void *out, int64_t batch, int64_t k_heads,
                                                      int64_t v_heads, int64_t dk, int64_t dv, float scale,
                                                      cudaStream_t stream) {
    DeltaArgs d;
    const int rc = raw_delta_args(&d, mixed, dtype, row_stride, f, b, gate_dtype, A_log, dt_bias, l2_eps, states, slots,
                                  fresh, out, k_heads, v_heads, dk, dv, scale);
    if (rc != TRELLM_OK) return rc;
    d.key_decay = 1;
    d.bounded = bounded;
    d.lower_bound = lower_bound;
    return launch_delta_step(d, batch, v_heads, dk, dv, stream);
}

extern "C" int trellm_causal_conv1d_step(const void *x, int x_dtype, const void *weight, int w_dtype, const void *bias,
                                         int b_dtype, const void *states, int s_dtype, void *out, void *new_states,
                                         int64_t batch, int64_t channels, int64_t width, int silu,
                                         cudaStream_t stream) {
    ConvArgs a = conv_args(x, x_dtype, weight, w_dtype, bias, b_dtype, states, s_dtype, out, new_states, nullptr, nullptr,
                           silu);
    return launch_conv_step(a, batch, channels, width, stream);
}

extern "C" int trellm_causal_conv1d_step_slots(const void *x, int x_dtype, const void *weight, int w_dtype,
                                               const void *bias, int b_dtype, void *states, int s_dtype,
                                               const int64_t *slots, const uint8_t *fresh, void *out, int64_t batch,
                                               int64_t channels, int64_t width, int silu, cudaStream_t stream) {
    if (!slots) return TRELLM_E_BAD_ARG;
    ConvArgs a = conv_args(x, x_dtype, weight, w_dtype, bias, b_dtype, states, s_dtype, out, states, slots, fresh, silu);
    return launch_conv_step(a, batch, channels, width, stream);
}
