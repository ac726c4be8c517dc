// The EXL3 GEMV's instantiations for the MUL1 codebook on its split-halves route (CB_MUL1_SPLIT,
// TRELLM_MUL1_GEMV=split; moe.cu has the MoE pair kernels'): the mid-size matmul and the tile decode read
// MUL1 as codebook 2.
#include "exl3_gemv.cuh"

namespace trellm {
#define CB_VALUE 3
TRELLM_DEFINE_GEMV_LAUNCHER(3)
#undef CB_VALUE
}  // namespace trellm
