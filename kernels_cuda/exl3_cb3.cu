// The EXL3 GEMV's and mid-size matmul's instantiations for the MUL1 codebook on its split-halves route
// (CB_MUL1_SPLIT, TRELLM_MUL1_GEMV=split; the mid-size matmul's for one row group; moe.cu has the MoE pair
// kernels'): the tile decode reads MUL1 as codebook 2.
#include "exl3_gemm_mid.cuh"

namespace trellm {
#define CB_VALUE 3
TRELLM_DEFINE_GEMV_LAUNCHER(3)
TRELLM_DEFINE_MID_LAUNCHERS(3)
#undef CB_VALUE
}  // namespace trellm
