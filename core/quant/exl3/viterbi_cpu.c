/* Tail-biting Viterbi tile encoder for EXL3 on the CPU (same algorithm as trellm.ops.exl3.trellis_viterbi).
 *
 * One tile = 256 targets in trellis-position order. A node is the low 16-K bits of a state; state
 * s = (k << (16-K)) | node enters from node s >> K. Pass 1 starts at position 128 with free nodes and
 * backtracks to find the node entering position 0; pass 2 runs 0..255 from that node only and ends on it.
 * Tiles are independent: OpenMP spreads them over cores.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One trellis step for the candidates whose top K bits are k: relax next[e] from prev[e >> K]. */
static inline void relax(const float *restrict prev, const float *restrict vals, float target, uint8_t k, int nodes,
                         int K, float *restrict next, uint8_t *restrict bp)
{
    if (k == 0) {
#pragma omp simd
        for (int e = 0; e < nodes; e++) {
            float d = vals[e] - target;
            next[e] = prev[e >> K] + d * d;
            bp[e] = 0;
        }
        return;
    }
#pragma omp simd
    for (int e = 0; e < nodes; e++) {
        float d = vals[e] - target;
        float c = prev[e >> K] + d * d;
        int better = c < next[e];
        next[e] = better ? c : next[e];
        bp[e] = better ? k : bp[e];
    }
}

static void run_pass(const float *lut, const float *w, const int *pos, int steps, int K, float *cost,
                     float *next, uint8_t *backptr, uint8_t *scratch, int keep_from)
{
    const int nodes = 1 << (16 - K), nk = 1 << K, hi_shift = 16 - 2 * K;
    for (int step = 0; step < steps; step++) {
        const float target = w[pos[step]];
        uint8_t *bp = step >= keep_from ? backptr + (size_t)(step - keep_from) * nodes : scratch;
        for (int k = 0; k < nk; k++)
            relax(cost + ((size_t)k << hi_shift), lut + ((size_t)k << (16 - K)), target, (uint8_t)k, nodes, K, next, bp);
        float *tmp = cost; cost = next; next = tmp;
    }
    if (steps & 1) memcpy(next, cost, sizeof(float) * nodes);
}

static int backtrack(const uint8_t *backptr, int steps, int K, int node, int32_t *states_out)
{
    const int nodes = 1 << (16 - K);
    for (int s = steps - 1; s >= 0; s--) {
        int k = backptr[(size_t)s * nodes + node];
        int state = (k << (16 - K)) | node;
        states_out[s] = state;
        node = state >> K;
    }
    return node;
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
            for (int e = 0; e < nodes; e++) cost[e] = 3.0e38f;
            cost[ring] = 0.0f;
            run_pass(lut, w, order2, 256, K, cost, next, backptr, scratch, 0);
            backtrack(backptr, 256, K, ring, out);
        }
        free(cost); free(next); free(backptr); free(scratch);
    }
    return failed ? 2 : 0;
}
