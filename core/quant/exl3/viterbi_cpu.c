/* Tail-biting Viterbi tile encoder for EXL3 on the CPU (same algorithm as trellm.ops.exl3.trellis_viterbi).
 *
 * One tile = 256 targets in trellis-position order. A node is the low 16-K bits of a state; the state
 * s = (k << (16-K)) | node enters from node s >> K = (k << (16-2K)) | (node >> K). Pass 1 starts at
 * position 128 with free nodes and backtracks to find the node entering position 0; pass 2 runs 0..255
 * from that node only and ends on it. Tiles are independent: OpenMP spreads them over cores.
 * The step is specialised per K (compile-time loop bounds vectorise far better).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INF_COST 3.0e38f

/* relax_K: next[e] = min_k prev[(k << (16-2K)) | (e >> K)] + (lut[(k << (16-K)) | e] - target)^2, argmin in bp. */
#define DEFINE_RELAX(K)                                                                                      \
    static void relax_##K(const float *restrict cost, const float *restrict lut, float target,               \
                          float *restrict next, uint8_t *restrict bp)                                        \
    {                                                                                                        \
        enum { NODES = 1 << (16 - K), NK = 1 << K, NHI = 1 << (16 - 2 * K) };                                \
        for (int k = 0; k < NK; k++) {                                                                       \
            const float *restrict prev = cost + ((size_t)k << (16 - 2 * K));                                 \
            const float *restrict vals = lut + ((size_t)k << (16 - K));                                      \
            const uint8_t kk = (uint8_t)k;                                                                   \
            if (K >= 4) {                                                                                    \
                for (int hi = 0; hi < NHI; hi++) {                                                           \
                    const float base = prev[hi];                                                             \
                    float *restrict nx = next + (hi << K);                                                   \
                    uint8_t *restrict b = bp + (hi << K);                                                    \
                    const float *restrict v = vals + (hi << K);                                              \
                    _Pragma("omp simd") for (int lo = 0; lo < NK; lo++) {                                    \
                        float d = v[lo] - target;                                                            \
                        float c = base + d * d;                                                              \
                        int better = (k == 0) | (c < nx[lo]);                                                \
                        nx[lo] = better ? c : nx[lo];                                                        \
                        b[lo] = better ? kk : b[lo];                                                         \
                    }                                                                                        \
                }                                                                                            \
            } else {                                                                                         \
                _Pragma("omp simd") for (int e = 0; e < NODES; e++) {                                       \
                    float d = vals[e] - target;                                                              \
                    float c = prev[e >> K] + d * d;                                                          \
                    int better = (k == 0) | (c < next[e]);                                                   \
                    next[e] = better ? c : next[e];                                                          \
                    bp[e] = better ? kk : bp[e];                                                             \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }

DEFINE_RELAX(1)
DEFINE_RELAX(2)
DEFINE_RELAX(3)
DEFINE_RELAX(4)
DEFINE_RELAX(5)
DEFINE_RELAX(6)
DEFINE_RELAX(7)
DEFINE_RELAX(8)

typedef void (*relax_fn)(const float *, const float *, float, float *, uint8_t *);
static const relax_fn RELAX[9] = {NULL, relax_1, relax_2, relax_3, relax_4, relax_5, relax_6, relax_7, relax_8};

/* Run ``steps`` steps over positions ``pos``; keeps back-pointers of steps >= keep_from. Final costs end in ``cost``. */
static void run_pass(const float *lut, const float *w, const int *pos, int steps, int K, float *cost, float *next,
                     uint8_t *backptr, uint8_t *scratch, int keep_from)
{
    const int nodes = 1 << (16 - K);
    float *a = cost, *b = next;
    for (int step = 0; step < steps; step++) {
        uint8_t *bp = step >= keep_from ? backptr + (size_t)(step - keep_from) * nodes : scratch;
        RELAX[K](a, lut, w[pos[step]], b, bp);
        float *t = a; a = b; b = t;
    }
    if (a != cost) memcpy(cost, a, sizeof(float) * nodes);
}

static void backtrack(const uint8_t *backptr, int steps, int K, int node, int32_t *states_out)
{
    const int nodes = 1 << (16 - K);
    for (int s = steps - 1; s >= 0; s--) {
        int k = backptr[(size_t)s * nodes + node];
        int state = (k << (16 - K)) | node;
        states_out[s] = state;
        node = state >> K;
    }
}

int trellm_viterbi_tiles(const float *lut, const float *targets, int32_t *states, int n_tiles, int K)
{
    if (K < 1 || K > 8) return 1;
    const int nodes = 1 << (16 - K);
    int order1[256], order2[256];
    for (int i = 0; i < 256; i++) { order1[i] = (i + 128) & 255; order2[i] = i; }
    int failed = 0;
#pragma omp parallel
    {
        float *cost = malloc(sizeof(float) * nodes), *next = malloc(sizeof(float) * nodes);
        uint8_t *backptr = malloc((size_t)256 * nodes), *scratch = malloc(nodes);
        int32_t head[128];
        if (!cost || !next || !backptr || !scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < n_tiles; t++) {
            if (failed) continue;
            const float *w = targets + (size_t)t * 256;
            int32_t *out = states + (size_t)t * 256;
            for (int e = 0; e < nodes; e++) cost[e] = 0.0f;
            run_pass(lut, w, order1, 256, K, cost, next, backptr, scratch, 128);
            int best = 0;
            for (int e = 1; e < nodes; e++) if (cost[e] < cost[best]) best = e;
            backtrack(backptr, 128, K, best, head);
            int ring = head[0] >> K;
            for (int e = 0; e < nodes; e++) cost[e] = INF_COST;
            cost[ring] = 0.0f;
            run_pass(lut, w, order2, 256, K, cost, next, backptr, scratch, 0);
            backtrack(backptr, 256, K, ring, out);
        }
        free(cost); free(next); free(backptr); free(scratch);
    }
    return failed ? 2 : 0;
}
