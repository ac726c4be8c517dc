// Where an EXL3 GEMV launch's time goes, phase by phase (GPU only, not part of the library build).
//
//   nvcc -arch=sm_90 -O3 -std=c++17 --expt-relaxed-constexpr -DTRELLM_GEMV_TRACE -I kernels_cuda \
//        benchmarks/gemv_phases.cu -o /tmp/gemv_phases && /tmp/gemv_phases
//
// The kernel, built with TRELLM_GEMV_TRACE, has thread 0 of each block record the SM clock at each phase
// boundary (exl3_gemv.cuh, GEMV_MARK). For each Llama-3.1-8B shape at 1 row and 4 bpw this prints the
// launch's span (first block start to last block end, global timer), the per-block phase times
// (median and max over blocks) and the phases of the block that ended last, for a launch alone and for
// the last launch of a graph of 10 back-to-back launches (as in a decode step), next to the time per
// launch of empty kernels of the same grid (the launch floor). TRELLM_PDL=0 launches without PDL; the
// launcher's other knobs (TRELLM_GEMV_EARLY_STAGES, ...) apply as in the library.
#include "exl3_gemv.cuh"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {
bool g_pdl = true;
}
bool trellm::pdl_enabled() { return g_pdl; }
void trellm::pdl_disable() { g_pdl = false; }

using namespace trellm;

#define CHECK(call)                                                                                   \
    do {                                                                                              \
        const cudaError_t e_ = (call);                                                                \
        if (e_ != cudaSuccess) {                                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));     \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

__global__ void fill_words(uint32_t *w, size_t count, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 0x9E3779B1u ^ seed;
        h ^= h >> 15;
        h *= 0x85EBCA6Bu;
        h ^= h >> 13;
        w[i] = h;
    }
}

__global__ void fill_halves(half *h, size_t count, uint32_t seed, float scale, bool signs_only) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < count; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t v = (uint32_t)i * 0x9E3779B1u ^ seed;
        v ^= v >> 16;
        v *= 0x7FEB352Du;
        v ^= v >> 15;
        const float u = (v & 0xFFFF) / 65535.f * 2.f - 1.f;
        h[i] = __float2half(signs_only ? (u < 0.f ? -scale : scale) : u * scale);
    }
}

__global__ void empty_kernel(int) {
    pdl_trigger();
    pdl_wait();
}

struct Trace {
    std::vector<long long> rows;   // [blocks][GEMV_TRACE_FIELDS]
    std::vector<long long> warps;  // [blocks][GEMV_WARPS][GEMV_TRACE_WARP_MARKS]
    int blocks = 0;
    long long at(int b, int f) const { return rows[(size_t)b * GEMV_TRACE_FIELDS + f]; }
    long long warp_at(int b, int w, int mark) const {
        return warps[((size_t)b * GEMV_WARPS + w) * GEMV_TRACE_WARP_MARKS + mark];
    }
};

Trace read_trace(int blocks) {
    Trace t;
    t.blocks = std::min(blocks, GEMV_TRACE_BLOCKS);
    t.rows.resize((size_t)t.blocks * GEMV_TRACE_FIELDS);
    CHECK(cudaMemcpyFromSymbol(t.rows.data(), gemv_trace, t.rows.size() * sizeof(long long)));
    t.warps.resize((size_t)t.blocks * GEMV_WARPS * GEMV_TRACE_WARP_MARKS);
    CHECK(cudaMemcpyFromSymbol(t.warps.data(), gemv_trace_warps, t.warps.size() * sizeof(long long)));
    return t;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

const char *PHASES[GEMV_TRACE_MARKS - 1] = {"start -> pdl_wait done", "x transform", "x fragments", "column loop",
                                            "partials stored",        "arrivals",    "finish groups"};

void report(const char *label, const Trace &t) {
    long long first = t.at(0, GEMV_TRACE_START_NS), last_start = first, last_end = 0;
    int last_block = 0;
    std::vector<double> ns_per_cycle;
    for (int b = 0; b < t.blocks; ++b) {
        first = std::min(first, t.at(b, GEMV_TRACE_START_NS));
        last_start = std::max(last_start, t.at(b, GEMV_TRACE_START_NS));
        if (t.at(b, GEMV_TRACE_END_NS) > last_end) {
            last_end = t.at(b, GEMV_TRACE_END_NS);
            last_block = b;
        }
        const long long cycles = t.at(b, GEMV_TRACE_MARKS - 1) - t.at(b, 0);
        if (cycles > 0) ns_per_cycle.push_back((double)(t.at(b, GEMV_TRACE_END_NS) - t.at(b, GEMV_TRACE_START_NS)) / cycles);
    }
    const double npc = median(ns_per_cycle);
    std::vector<double> ends;
    for (int b = 0; b < t.blocks; ++b) ends.push_back((t.at(b, GEMV_TRACE_END_NS) - first) / 1e3);
    printf("  %s: %d blocks, span %.2f us (global timer), blocks started within %.2f us, median block end at %.2f us; "
           "%.3f ns/cycle\n",
           label, t.blocks, (last_end - first) / 1e3, (last_start - first) / 1e3, median(ends), npc);
    // A per-block duration (cycles(b)) in us: its median and maximum over the blocks, its median over the
    // blocks that finished a group, and the last block's.
    struct Stats { double median, max, finishers, last; };
    auto stats = [&](auto cycles) {
        std::vector<double> all, finishers;
        for (int b = 0; b < t.blocks; ++b) {
            const double us = cycles(b) * npc / 1e3;
            all.push_back(us);
            if (t.at(b, GEMV_TRACE_SM) >> 32) finishers.push_back(us);
        }
        return Stats{median(all), *std::max_element(all.begin(), all.end()), median(finishers), cycles(last_block) * npc / 1e3};
    };
    printf("    %-24s %10s %10s %12s %12s\n", "phase", "median us", "max us", "finishers", "last block");
    for (int p = 0; p < GEMV_TRACE_MARKS - 1; ++p) {
        const Stats st = stats([&](int b) { return (double)(t.at(b, p + 1) - t.at(b, p)); });
        printf("    %-24s %10.2f %10.2f %12.2f %12.2f\n", PHASES[p], st.median, st.max, st.finishers, st.last);
    }
    printf("    last block %d started at %.2f us\n", last_block, (t.at(last_block, GEMV_TRACE_START_NS) - first) / 1e3);
    // Inside the first phases, per warp: when each warp had issued its prefetch, passed pdl_wait, and
    // reached the x transform's barrier (block-relative, us).
    auto spread = [&](const char *what, auto cycles) {
        const Stats st = stats(cycles);
        printf("    %-44s median %6.2f  max %6.2f  finishers %6.2f  last block %6.2f\n", what, st.median, st.max,
               st.finishers, st.last);
    };
    auto warp_max = [&](int b, int mark) {
        long long v = t.warp_at(b, 0, mark);
        for (int w = 1; w < GEMV_WARPS; ++w) v = std::max(v, t.warp_at(b, w, mark));
        return v;
    };
    auto warp_min = [&](int b, int mark) {
        long long v = t.warp_at(b, 0, mark);
        for (int w = 1; w < GEMV_WARPS; ++w) v = std::min(v, t.warp_at(b, w, mark));
        return v;
    };
    spread("start -> last warp's prefetch issued", [&](int b) { return (double)(warp_max(b, 0) - t.at(b, 0)); });
    spread("pdl_wait release spread over warps", [&](int b) { return (double)(warp_max(b, 1) - warp_min(b, 1)); });
    spread("last pdl release -> last warp at x barrier", [&](int b) { return (double)(warp_max(b, 2) - warp_max(b, 1)); });
    spread("last warp at x barrier -> barrier passed", [&](int b) { return (double)(t.at(b, 2) - warp_max(b, 2)); });
    printf("    last block, per warp (us from block start): prefetch issued / pdl passed / at x barrier:");
    for (int w = 0; w < GEMV_WARPS; ++w)
        printf(" [%.2f %.2f %.2f]", (t.warp_at(last_block, w, 0) - t.at(last_block, 0)) * npc / 1e3,
               (t.warp_at(last_block, w, 1) - t.at(last_block, 0)) * npc / 1e3,
               (t.warp_at(last_block, w, 2) - t.at(last_block, 0)) * npc / 1e3);
    printf("\n");
}

// Microseconds per launch of `launch`, as a graph of CHAIN back-to-back launches replayed 20 times.
template <typename F> double chained_us_per_launch(cudaStream_t stream, F &&launch) {
    constexpr int CHAIN = 10, REPS = 20;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < CHAIN; ++i) launch();
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, stream));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(e0, stream));
    for (int i = 0; i < REPS; ++i) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(e1, stream));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return ms * 1e3 / (REPS * CHAIN);
}

void run_shape(int k, int n, int num_sms, cudaStream_t stream) {
    constexpr int K = 4, CB = TRELLM_CB_MCG;
    const int m = 1;
    const size_t words = (size_t)(k / 16) * (n / 16) * TileGeom<K>::WORDS;
    const int slices = gemv_slices(k, m, n);
    uint32_t *trellis;
    half *x, *suh, *svh, *y;
    float *partial;
    int *counters;
    CHECK(cudaMalloc(&trellis, words * 4));
    CHECK(cudaMalloc(&x, (size_t)m * k * 2));
    CHECK(cudaMalloc(&suh, (size_t)k * 2));
    CHECK(cudaMalloc(&svh, (size_t)n * 2));
    CHECK(cudaMalloc(&y, (size_t)m * n * 2));
    CHECK(cudaMalloc(&partial, (size_t)slices * m * n * 4));
    CHECK(cudaMalloc(&counters, (size_t)(n / 128) * 4));
    CHECK(cudaMemset(counters, 0, (size_t)(n / 128) * 4));
    fill_words<<<1024, 256>>>(trellis, words, 1);
    fill_halves<<<64, 256>>>(x, (size_t)m * k, 2, 1.f, false);
    fill_halves<<<64, 256>>>(suh, k, 3, 1.f, true);
    fill_halves<<<64, 256>>>(svh, n, 4, 0.01f, true);
    CHECK(cudaDeviceSynchronize());

    MatmulParts parts{};
    parts.count = 1;
    parts.part[0] = MatmulArgs{x, nullptr, 0, suh, trellis, svh, nullptr, y, partial, counters, TRELLM_F16, TRELLM_F16, m, k, n, 0};
    auto launch = [&] {
        const int rc = launch_matmul_k<K, CB>(parts, num_sms, stream);
        if (rc != TRELLM_OK) {
            fprintf(stderr, "launch failed: %d\n", rc);
            exit(1);
        }
    };
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));

    // Alone: one launch on an idle GPU.
    for (int i = 0; i < 3; ++i) launch();
    std::vector<double> alone;
    for (int i = 0; i < 20; ++i) {
        CHECK(cudaStreamSynchronize(stream));
        CHECK(cudaEventRecord(e0, stream));
        launch();
        CHECK(cudaEventRecord(e1, stream));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        alone.push_back(ms * 1e3);
    }
    // The blocks of this launch: the trace rows one launch writes after the trace is cleared.
    int blocks = 0;
    std::vector<long long> zeros((size_t)GEMV_TRACE_BLOCKS * GEMV_TRACE_FIELDS, 0);
    CHECK(cudaMemcpyToSymbol(gemv_trace, zeros.data(), zeros.size() * sizeof(long long)));
    launch();
    CHECK(cudaStreamSynchronize(stream));
    {
        Trace all = read_trace(GEMV_TRACE_BLOCKS);
        while (blocks < GEMV_TRACE_BLOCKS && all.at(blocks, GEMV_TRACE_START_NS) != 0) ++blocks;
    }
    const Trace t_alone = read_trace(blocks);

    // Chained: a graph of CHAIN launches, replayed; the trace is the last launch's.
    const double chained_us = chained_us_per_launch(stream, launch);
    const Trace t_chain = read_trace(blocks);
    // The launch floor: empty kernels of the same grid, same launch attribute.
    const double empty_us = chained_us_per_launch(stream, [&] {
        CHECK(launch_pdl(empty_kernel, dim3(blocks), dim3(GEMV_WARPS * 32), 0, stream, 0));
    });

    const double ideal_us = words * 4.0 / 4.15e6;  // bytes / (4.15 TB/s measured copy bandwidth) in us
    printf("%d -> %d, 1 row, K=%d: %d blocks (%d k-slices); alone %.2f us (events, median of 20); chained %.2f us "
           "per launch; empty kernels of that grid chained %.2f us; weights at copy bandwidth %.2f us\n",
           k, n, K, blocks, slices, median(alone), chained_us, empty_us, ideal_us);
    report("alone", t_alone);
    report("last of a chain", t_chain);
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    cudaFree(trellis), cudaFree(x), cudaFree(suh), cudaFree(svh), cudaFree(y), cudaFree(partial), cudaFree(counters);
}

int main() {
    if (const char *e = getenv("TRELLM_PDL")) g_pdl = e[0] != '0';
    int dev = 0, num_sms = 0;
    CHECK(cudaGetDevice(&dev));
    CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, dev));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    printf("EXL3 GEMV phases, PDL %s, %d SMs\n", g_pdl ? "on" : "off", num_sms);
    const int shapes[][2] = {{4096, 1024}, {4096, 4096}, {4096, 6144}, {4096, 14336}, {14336, 4096}, {4096, 28672}};
    for (const auto &s : shapes) run_shape(s[0], s[1], num_sms, stream);
    return 0;
}
