"""Time one decode step of bench_decode's model (PDL on unless TRELLM_PDL=0), the graph captured first in
a fresh process: the A/B unit for knobs read at launch (env) or baked into a build (TRELLM_NVCC_FLAGS).

    python benchmarks/bench_step.py BITS [LABEL]

Knobs compared this way (NOTES): TRELLM_GEMV_EARLY_STAGES, TRELLM_PDL, TRELLM_NVCC_FLAGS=-DTRELLM_GEMV_FMA_SHIFTS=N.
Run variants interleaved (A B A B), each in its own process: one process's clocks and allocator drift.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_decode import Model  # noqa: E402
from common import time_graph  # noqa: E402

from trellm.kernels_cuda import ops as _cuda_ops  # noqa: E402,F401

bits, label = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
model = Model(32, bits, 6, 513)
tok, pos = torch.tensor([123], device="cuda"), torch.tensor([512], device="cuda")
cu = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
ctx = torch.tensor([513], device="cuda", dtype=torch.int32)
t = time_graph(lambda: model.forward(tok, pos, cu, ctx), reps=20)
print(f"{label} step K={bits}: {t * 1e3:.3f} ms = {1 / t:.0f} tokens/s", flush=True)
