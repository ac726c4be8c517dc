// EXL3 GEMV, mid-size matmul and tile-decode instantiations for codebook 2 (one translation unit per codebook: parallel builds).
#include "exl3_gemm_mid.cuh"

namespace trellm {
#define CB_VALUE 2
TRELLM_DEFINE_CODEBOOK_LAUNCHERS(2)
TRELLM_DEFINE_MID_LAUNCHERS(2)
#undef CB_VALUE
}  // namespace trellm
