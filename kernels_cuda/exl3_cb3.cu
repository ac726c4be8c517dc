// The EXL3 GEMV's instantiations for the MUL1 codebook on its split-halves route (CB_MUL1_SPLIT,
// TRELLM_MUL1_GEMV=split): the GEMV only; the other EXL3 kernels decode MUL1 as codebook 2.
#include "exl3_gemv.cuh"

namespace trellm {
#define CB_VALUE 3
TRELLM_DEFINE_GEMV_LAUNCHER(3)
#undef CB_VALUE
}  // namespace trellm
