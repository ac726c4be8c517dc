// EXL3 GEMV, mid-size matmul and tile-decode instantiations for codebook 1 (one translation unit per codebook: parallel builds).
#include "exl3_gemm_mid.cuh"

namespace trellm {
#define CB_VALUE 1
TRELLM_DEFINE_CODEBOOK_LAUNCHERS(1)
TRELLM_DEFINE_MID_LAUNCHERS(1)
#undef CB_VALUE
}  // namespace trellm
