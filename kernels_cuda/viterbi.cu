// Trellis Viterbi encoder (conversion). Placeholder until the kernel lands: reports "not supported",
// and the binding leaves trellis_viterbi on the torch reference.
#include "common.cuh"

extern "C" int64_t trellm_viterbi_scratch_bytes(int64_t tiles, int K) { return 0; }

extern "C" int trellm_trellis_viterbi(const float *targets, int32_t *states, int64_t tiles, int K, int codebook,
                                      void *scratch, cudaStream_t stream) {
    return TRELLM_E_UNSUPPORTED;
}
