"""One 4096->14336 K=4 EXL3 GEMV (random trellis), a few times: a target for ncu."""
import torch

from trellm.kernels_cuda import ops as _cuda_ops  # noqa: F401  (registers the CUDA implementations)
from trellm.ops import exl3

k, n, K = 4096, 14336, 4
trellis = torch.randint(-32768, 32768, (k // 16, n // 16, 16 * K), device="cuda", dtype=torch.int16)
suh = (torch.randn(k, device="cuda") * 0.02).half()
svh = (torch.randn(n, device="cuda") * 0.02).half()
x = torch.randn(1, k, device="cuda", dtype=torch.float16)
for _ in range(3):
    exl3.exl3_matmul(x, trellis, suh, svh, "mcg")
torch.cuda.synchronize()
